"""The host Adam step (jzero.tiers.host_adam): jzero's optax Adam / AdamW bit for bit on XLA:CPU,
DeepSpeed's formula (bias correction on and off) within its rounding bound, the 16-bit outputs
as XLA casts them, the threads and chunks invisible in the numbers, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jzero.errors import ConfigError, JZeroError, JZeroWarning, NotSupportedError
from jzero.tiers import host_adam
from jzero.tiers.host_adam import HostAdam, HostAdamSettings
from jzero.train.optim import host_adam_settings
from host_adam_worker import gradient

BACKENDS = ("numba", "xla")
U = 2.0 ** -24  # float32's unit roundoff
TESTS = Path(__file__).resolve().parents[1]


def test_matches_jzero_optax_bit_for_bit(tmp_path):
  """Seven steps of each config block of tests/host_adam_worker.py (AdamW, Adam's L2 mode, no
  decay, other betas / eps with a schedule), both backends: the master, both moments and the
  bf16 / fp16 params equal those of build_optimizer's transformation jitted by XLA:CPU, bit for
  bit -- the bound is 0 ulp, because the kernel does the chain's float32 operations in its order
  with its constants and fuses the multiply-adds that XLA:CPU fuses. That holds at XLA's default
  settings (the worker runs without the suite's XLA_FLAGS); at LLVM level 0 XLA fuses fewer, and
  about 0.4% of the master differs by an ulp. If a jax release moves the fusions, this fails: the
  offload tier would no longer give the device step's numbers."""
  out = tmp_path / "counts.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, str(TESTS / "host_adam_worker.py"), str(out)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  counts = json.loads(out.read_text())
  assert len(counts) == 8
  for case, steps in counts.items():
    assert len(steps) == 7 and all(len(step) == 4 for step in steps), case
    assert all(n == 0 for step in steps for n in step.values()), (case, steps)


def _moments_reference(p, m, v, g, step, s: HostAdamSettings):
  """The moments of DeepSpeed's cpu_adam formula in float64 from the float32 inputs and the
  kernel's float32 constants, with the scale of each (the sum of its terms' magnitudes), and the
  constants the update uses: (m, v, scale_m, scale_v, r1, r2, wd)."""
  f64 = np.float64
  b1, b2 = (f64(np.float32(b)) for b in s.betas)
  c1, c2 = (f64(np.float32(1 - b)) for b in s.betas)
  wd = f64(np.float32(s.weight_decay))
  r1 = r2 = 1.0
  if s.bias_correction:
    r1, r2 = (f64(np.float32(1) / (np.float32(1) - np.float32(b) ** np.float32(step)))
              for b in s.betas)
  p, m, v, g = (x.astype(f64) for x in (p, m, v, g))
  decay_p = wd * np.abs(p)
  l2 = s.weight_decay != 0 and not s.adam_w_mode
  g2 = g + wd * p if l2 else g
  m_new = c1 * g2 + b1 * m
  v_new = c2 * g2 * g2 + b2 * v
  scale_m = c1 * (np.abs(g) + (decay_p if l2 else 0)) + b1 * np.abs(m)
  scale_v = c2 * (np.abs(g) + (decay_p if l2 else 0)) ** 2 + b2 * np.abs(v)
  return m_new, v_new, scale_m, scale_v, r1, r2, wd


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_deepspeed_formula_within_rounding(bias_correction, adam_w_mode, backend):
  """DeepSpeed's semantics (adam_w_mode, bias_correction on and off -- the latter has no optax
  counterpart in jzero's config path) against the formula in float64. The bound is the rounding
  analysis of float32 arithmetic with unit roundoff u = 2^-24: each result within k u of the sum of
  its terms' magnitudes -- m: 3 roundings (the constants', the product's, the fused add's), plus
  the L2 gradient's; v: 5 (the square's too); p from the step's own m and v: 5 (the quotient's
  factor, square root, eps sum, division, fused update)."""
  s = HostAdamSettings(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.02, adam_w_mode=adam_w_mode,
                       bias_correction=bias_correction)
  n, lr = 100_000, 1e-3
  rng = np.random.default_rng(1)
  p = rng.standard_normal(n, dtype=np.float32)
  m = np.zeros(n, np.float32)
  v = np.zeros(n, np.float32)
  adam = HostAdam(s, threads=1, backend=backend)
  worst = {"m": (0.0, 0), "v": (0.0, 0), "p": (0.0, 0)}
  for step in range(1, 5):
    g = gradient(rng, n)
    before = (p.copy(), m.copy(), v.copy())
    m_ref, v_ref, scale_m, scale_v, r1, r2, wd = _moments_reference(*before, g, step, s)
    adam.step(p, m, v, g, step, lr)
    # p from the kernel's own moments, so that their rounding does not count twice.
    p64, m64, v64 = before[0].astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    update = (m64 * r1) / (np.sqrt(v64 * r2) + np.float64(np.float32(s.eps)))
    decoupled = s.weight_decay != 0 and adam_w_mode
    p_ref = p64 - np.float64(np.float32(lr)) * (update + (wd * p64 if decoupled else 0))
    scale_p = np.abs(p64) + lr * (np.abs(update) + (wd * np.abs(p64) if decoupled else 0))
    for name, got, ref, scale, k in (("m", m, m_ref, scale_m, 3 + (not adam_w_mode)),
                                     ("v", v, v_ref, scale_v, 5 + 2 * (not adam_w_mode)),
                                     ("p", p, p_ref, scale_p, 5)):
      ratio = np.max(np.abs(got - ref) / np.maximum(scale * U, np.finfo(np.float64).tiny))
      worst[name] = max(worst[name], (float(ratio), k))
      assert ratio <= k, (name, step, ratio)
  for name, (ratio, k) in worst.items():
    print(f"BOUND host Adam {name} vs float64 / (u x terms): measured {ratio:.2f} <= bound {k}")


def test_bias_correction_off_differs_from_on():
  """The two settings give different first steps, each the one its formula predicts: with the
  correction |step| ~ lr (Adam's first step is lr sign(g)), without it ~ lr (1 - b1) /
  sqrt(1 - b2)."""
  g = np.full(1000, 0.5, np.float32)
  steps = {}
  for correct in (True, False):
    p = np.ones(1000, np.float32)
    HostAdam(HostAdamSettings(bias_correction=correct), threads=1).step(
      p, np.zeros_like(p), np.zeros_like(p), g, 1, 1e-2)
    steps[correct] = 1.0 - p
  np.testing.assert_allclose(steps[True], 1e-2, rtol=1e-5)
  np.testing.assert_allclose(steps[False], 1e-2 * 0.1 / np.sqrt(0.001), rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_chunks_and_leaves_do_not_change_the_numbers(backend):
  """A list of leaves of several sizes stepped with 3 threads and small chunks equals each leaf
  stepped alone on one thread, bit for bit; the out buffers likewise."""
  rng = np.random.default_rng(2)
  sizes = [1, 17, 4096, 70_001, 3 * 1024 + 5]
  s = HostAdamSettings(weight_decay=0.01)

  def leaves():
    r = np.random.default_rng(3)
    return ([r.standard_normal(k, dtype=np.float32).reshape(-1, 1) for k in sizes],
            [np.zeros((k, 1), np.float32) for k in sizes],
            [np.zeros((k, 1), np.float32) for k in sizes])

  grads = [[gradient(rng, k).reshape(-1, 1) for k in sizes] for _ in range(3)]
  p_a, m_a, v_a = leaves()
  p_b, m_b, v_b = leaves()
  out_a = [np.empty((k, 1), ml_dtypes.bfloat16) for k in sizes]
  out_b = [np.empty((k, 1), ml_dtypes.bfloat16) for k in sizes]
  many = HostAdam(s, threads=3, backend=backend, chunk=1000)
  one = HostAdam(s, threads=1, backend=backend, chunk=10 ** 9)
  for step, g in enumerate(grads, start=1):
    many.step(p_a, m_a, v_a, g, step, 1e-3, out_params=out_a)
    for i in range(len(sizes)):
      one.step(p_b[i], m_b[i], v_b[i], g[i], step, 1e-3, out_params=out_b[i])
  many.close()
  for a, b in zip(p_a + m_a + v_a + out_a, p_b + m_b + v_b + out_b):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  assert not np.array_equal(p_a[2], leaves()[0][2])  # the step did move the params


def _all_float32_classes() -> np.ndarray:
  """float32 bit patterns across every exponent (a stride through all 2^32), and the edges of
  float16's and bfloat16's ranges: subnormals, rounding ties, overflow, infinities, NaNs."""
  sweep = np.arange(0, 2 ** 32, 4093, dtype=np.uint64).astype(np.uint32)
  edges = np.array([0x00000000, 0x80000000, 0x00000001, 0x33000000, 0x33000001, 0x337FFFFF,
                    0x387FC000, 0x387FE000, 0x38800000, 0x477FE000, 0x477FEFFF, 0x477FF000,
                    0x47800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                    0xFFC12345, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7F8000], np.uint32)
  return np.concatenate([sweep, edges, edges | np.uint32(0x80000000)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
def test_16_bit_out_params_cast_as_xla_casts(dtype, backend):
  """With a zero gradient, zero moments and lr 0 the master keeps its value, so out_params is the
  cast of every kind of float32: it equals XLA:CPU's convert of the new master (round to nearest
  even; subnormals, overflow to inf; a NaN a quiet NaN of its sign), bit for bit, and numpy's
  cast where finite. The master keeps its bits (a NaN may come back quiet), except that XLA:CPU
  flushes subnormal numbers to zero: the xla backend does, the numba kernel does not (nor does
  DeepSpeed's)."""
  bits = _all_float32_classes()
  p = bits.view(np.float32).copy()
  n = p.size
  out = np.empty(n, dtype)
  HostAdam(HostAdamSettings(), threads=2, backend=backend).step(
    p, np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32), 1, 0.0,
    out_params=out)
  quiet = ~np.uint32(0x00400000)
  kept = bits.copy()
  if backend == "xla":
    subnormal = (bits & np.uint32(0x7F800000)) == 0
    kept[subnormal] &= np.uint32(0x80000000)
    assert subnormal.sum() > 1000
  np.testing.assert_array_equal(p.view(np.uint32) & quiet, kept & quiet)
  expected = np.asarray(jax.device_put(p, jax.devices("cpu")[0]).astype(jnp.dtype(dtype)))
  np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
  finite = np.isfinite(p)
  with np.errstate(over="ignore"):  # numpy's cast of what overflows float16 warns
    cast = p[finite].astype(dtype)
  np.testing.assert_array_equal(out[finite].view(np.uint16), cast.view(np.uint16))


def test_errors_name_the_argument_and_the_fix():
  adam = HostAdam(HostAdamSettings(), threads=1)
  x = np.zeros(8, np.float32)
  cases = [
    ((x, x.copy(), x.copy(), np.zeros(8, np.float64), 1, 1e-3), {}, "grads has dtype float64"),
    ((x, x.copy(), x.copy(), np.zeros(9, np.float32), 1, 1e-3), {}, "grads has shape"),
    ((x, x.copy(), x.copy(), x.copy(), 0, 1e-3), {}, "step must be an integer >= 1"),
    ((x, x.copy(), x.copy(), x.copy(), 1, float("nan")), {}, "lr must be a finite"),
    ((np.zeros(16, np.float32)[::2], x.copy(), x.copy(), x.copy(), 1, 1e-3), {},
     "params must be C-contiguous"),
    (([x], [x.copy()], [x.copy()], [x.copy(), x.copy()], 1, 1e-3), {}, "as many leaves"),
    ((x, x.copy(), x.copy(), x.copy(), 1, 1e-3), {"out_params": np.zeros(8, np.float32)},
     "out_params has dtype float32; it must be bfloat16 or float16"),
    (([x], [x.copy()], [x.copy()], [[0.0] * 8], 1, 1e-3), {}, r"grads\[0\] must be a numpy array"),
  ]
  cases.append(((x, x, x.copy(), x.copy(), 1, 1e-3), {}, "params and exp_avg share memory"))
  read_only = x.copy()
  read_only.flags.writeable = False
  cases.append(((read_only, x.copy(), x.copy(), x.copy(), 1, 1e-3), {}, "params is read-only"))
  for args, kwargs, message in cases:
    with pytest.raises(ConfigError, match=message):
      adam.step(*args, **kwargs)
  with pytest.raises(ConfigError, match="threads: must be a positive integer"):
    HostAdam(threads=0)
  with pytest.raises(ConfigError, match="backend"):
    HostAdam(backend="cuda")
  with pytest.raises(ConfigError, match=r"betas: each must lie in \[0, 1\)"):
    HostAdamSettings(betas=(0.9, 1.0))


def test_without_numba_auto_warns_naming_the_extra_and_numba_refuses(monkeypatch):
  """The numba kernel missing: "auto" warns once with the pip line of the extra and runs the XLA
  path (the same numbers); "numba" raises naming the extra."""
  monkeypatch.setattr(host_adam, "_numba", lambda: None)
  with pytest.warns(JZeroWarning, match=r'pip install "jzero\[host-adam\]"'):
    adam = HostAdam(HostAdamSettings(weight_decay=0.01))
  assert adam.backend == "xla"
  with pytest.raises(JZeroError, match=r'jzero\[host-adam\]'):
    HostAdam(backend="numba")


def test_host_adam_settings_of_the_config_blocks():
  """Adam and AdamW have the fast host path, with DeepSpeed's rule that "AdamW" is always
  decoupled; Lion and SGD keep the optax update; refused settings are refused here too."""
  assert host_adam_settings({"type": "AdamW", "params": {"adam_w_mode": False}}).adam_w_mode
  adam = host_adam_settings({"type": "adam", "params": {"adam_w_mode": False, "lr": 5e-4,
                                                        "betas": [0.8, 0.9], "eps": 1e-6,
                                                        "weight_decay": 0.1}})
  assert adam == HostAdamSettings(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1,
                                  adam_w_mode=False, bias_correction=True)
  assert host_adam_settings({"type": "Lion"}) is None
  assert host_adam_settings({"type": "SGD", "params": {"momentum": 0.9}}) is None
  with pytest.raises(NotSupportedError, match="amsgrad"):
    host_adam_settings({"type": "Adam", "params": {"amsgrad": True}})
