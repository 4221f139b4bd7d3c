"""Shared pieces of the engine tests: configs, a plain single-device optax loop, comparisons."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.models import GPT, GPTConfig, lm_loss
from jzero.runtime import quiet_start
from jzero.runtime.data import ByteCorpus

LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0

#: Tests that compile for a GPU topology need XLA's CUDA compiler (the gpu-aot extra, which the
#: test extra installs).
needs_cuda_compiler = pytest.mark.skipif(
    not quiet_start.cuda_plugin_installed(),
    reason='needs the CUDA compiler plugin: pip install -e ".[gpu-aot]"')

SMALL = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)

# -- Bounds. Every tolerance of the suite is one of these or carries its own reason beside it; none
# is fitted to one CPU. u = 2^-24 is fp32's unit roundoff (6.0e-8); max_relative_diff compares each
# leaf in norm. tests/isa_matrix.sh reruns the suite under other XLA CPU ISAs (other kernels,
# other roundings) to check they hold.
U32 = 2.0 ** -24

#: The same fp32 math with the data placed or the work split otherwise (an offload tier, the NVMe
#: store, a step split in two jits, several processes instead of devices, a resumed run against an
#: uninterrupted one, gather units against one gather): the results differ by rounding only -- the
#: order of one sum over <= 8 devices per gradient element ((N - 1)u = 7u) and XLA's fusion of the
#: elementwise optimizer update (a few u). Adam's update is a ratio of moments of the same gradient,
#: so it does not amplify a relative error; over the <= 20 steps of these tests that stays within
#: 1e-6 = 17u (measured <= 2e-7 under the AVX-512, AVX2 and SSE4.2 kernels, tests/isa_matrix.sh).
SAME_MATH = 1e-6

#: 8 devices against a plain one-device optax loop over the same batches (small models, <= 8
#: steps): besides SAME_MATH's sources, XLA compiles the model for other shapes (a micro-batch per
#: device against the whole batch), so every dot product accumulates its contraction (d <= 256 here)
#: in another order: d*u = 1.5e-5 in the worst case, sqrt(d)*u = 1e-6 for random rounding; the
#: loss mean over the batch adds log2(8) roundings. 1e-5 sits between the typical and the worst
#: case. (The 20-step exactness test of the default model does not use it: there the reference is
#: float64, tests/train/test_engine.py.)
VS_ONE_DEVICE = 1e-5

#: Where a leaf misses VS_ONE_DEVICE, its gradient is ill-conditioned rather than the engine wrong:
#: Adam divides each gradient element by its own running magnitude, so an element whose gradient is
#: a near-cancelling sum (a zero-initialised LayerNorm bias in the first steps) carries that sum's
#: relative rounding error -- its condition number times u -- straight into its update, and a few
#: such elements set the leaf's error. The one-device fp32 loop measures that conditioning: its own
#: distance from the float64 loop. The engine sums each gradient element as <= N partial sums (one
#: per device) and then across devices, against one sum in the one-device loop, so against the exact
#: (float64) result its error is bounded by N times the fp32 loop's, leaf by leaf. Measured (d_model
#: 36, seeds 0-5, 3 steps): engine / one-device error ratio 0.3-3.6; seed 0's ln2 bias has the
#: one-device loop itself 9.7e-6 from exact and the engine 3.1e-5.
ILL_CONDITIONED_FACTOR = 8


def ds_config(stage: int, *, micro: int = 1, gas: int = 1, precision: str = "fp32",
              **zero) -> dict:
  """A DeepSpeed config for the engine tests: AdamW at a constant lr, clipping at 1.0."""
  cfg = {
      "train_micro_batch_size_per_gpu": micro,
      "gradient_accumulation_steps": gas,
      "gradient_clipping": CLIP,
      "optimizer": {"type": "AdamW",
                    "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
      "zero_optimization": {"stage": stage, **zero},
  }
  if precision in ("bf16", "fp16"):
    cfg[precision] = {"enabled": True}
  return cfg


def gpt_factory(cfg: GPTConfig):
  return lambda rngs: GPT(cfg, rngs=rngs)


def make_engine(config: dict | int, model=SMALL, loss=lm_loss, **kw) -> jzero.Engine:
  """The suite's one engine factory: ``jzero.initialize(model, loss, config, **kw)``.

  ``config``: a config dict, or a ZeRO stage for :func:`ds_config`'s config of it. ``model``: a
  GPTConfig for the in-repo GPT of that shape (SMALL by default, with ``lm_loss``), else what
  ``jzero.initialize`` takes (an NNX factory or class, a Linen module). ``kw``: initialize's
  keywords (``mesh``, ``init_inputs``, ``sample_batch``, ...).
  """
  if isinstance(config, int):
    config = ds_config(config)
  if isinstance(model, GPTConfig):
    model = gpt_factory(model)
  return jzero.initialize(model, loss, config, **kw)


_CORPUS: dict[int, ByteCorpus] = {}


def corpus(seq_len: int) -> ByteCorpus:
  if seq_len not in _CORPUS:
    _CORPUS[seq_len] = ByteCorpus.load(None, seq_len=seq_len, max_bytes=1 << 20)
  return _CORPUS[seq_len]


def batches(seq_len: int, batch_size: int, steps: int) -> list[dict]:
  return [corpus(seq_len).batch(i, batch_size) for i in range(steps)]


def reference_optimizer() -> optax.GradientTransformation:
  """What ds_config's engine runs, in plain optax: clipping by the global norm, then AdamW."""
  return optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD))


def subprocess_env(**extra: str) -> dict[str, str]:
  """This process's environment for a worker subprocess: XLA_FLAGS without a device-count flag
  (workers choose their own devices; an ISA flag, tests/isa_matrix.sh, is kept)."""
  env = dict(os.environ, **extra)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def free_port() -> int:
  """A TCP port on 127.0.0.1 free right now (for a jax.distributed coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def multiprocess_job(out, mode: str = "stage3", processes: int = 2,
                     devices: int = 4) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Runs tests/multiprocess_worker.py (``mode``: stage3, zeropp or param-nvme) as ``processes``
  processes of ``devices`` CPU devices each, joined over gloo, writing into the directory ``out``;
  fails with a process's log if one exits non-zero. Returns process 0's losses and final logical
  params (``out/result.npz``)."""
  worker = Path(__file__).with_name("multiprocess_worker.py")
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(processes), str(port),
                             str(devices), str(out), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=subprocess_env())
           for i in range(processes)]
  logs = [p.communicate(timeout=400)[0] for p in procs]
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"
  with np.load(Path(out) / "result.npz") as f:
    return f["losses"], {k: f[k] for k in f.files if k != "losses"}


def loss_of_params(factory, loss_fn=lm_loss):
  """``loss_fn`` of the NNX model ``factory(rngs)`` builds, as a function of its params' pure dict
  (the model's structure only: nothing is initialised)."""
  graphdef, template = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))), nnx.Param)

  def loss(p, batch):
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, p)
    return loss_fn(nnx.merge(graphdef, state), batch)

  return loss


def reference_run(cfg: GPTConfig, params: dict, data: list[dict], loss_fn=lm_loss, *,
                  float64: bool = False):
  """The plain single-device optax loop: same model, same data, whole batch on one device.

  Independent of jzero's optimizer code: optax's own clip_by_global_norm and adamw. ``float64``:
  the same loop in double precision (params, activations, optimizer state), the stand-in for the
  exact result against which float32 runs' rounding errors are measured.
  """
  if float64:
    with jax.enable_x64(True):
      return reference_run(cfg, jax.tree.map(lambda x: np.asarray(x, np.float64), params), data,
                           loss_fn)
  device = jax.devices()[0]
  params = jax.device_put(jax.tree.map(np.asarray, params), device)
  loss = loss_of_params(gpt_factory(cfg), loss_fn)
  tx = reference_optimizer()

  @jax.jit
  def step(p, opt, batch):
    value, grads = jax.value_and_grad(loss)(p, batch)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, value

  opt = tx.init(params)
  losses = []
  for batch in data:
    params, opt, value = step(params, opt, jax.device_put(batch, device))
    losses.append(float(value))
  return params, losses


def engine_run(engine, data: list[dict], seed: int = 0):
  """Trains ``engine`` on ``data``; returns (initial logical params, final logical params, losses)."""
  state = engine.init(jax.random.key(seed))
  initial = jax.tree.map(np.asarray, engine.logical_params(state))
  losses = []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return initial, jax.tree.map(np.asarray, engine.logical_params(state)), losses


def assert_same_as_one_device(params, one_device, exact) -> None:
  """``params`` equal the one-device fp32 loop's ``one_device`` to VS_ONE_DEVICE, or, for a leaf
  that misses it, are within ILL_CONDITIONED_FACTOR times that loop's own rounding error of the
  exact result (``exact()``: the float64 loop's params, computed only when needed)."""
  if max_relative_diff(params, one_device) <= VS_ONE_DEVICE:
    return
  exact = exact()
  for (path, got), fp32, f64 in zip(jax.tree_util.tree_leaves_with_path(params),
                                    jax.tree.leaves(one_device), jax.tree.leaves(exact)):
    engine_err, loop_err = max_relative_diff(got, f64), max_relative_diff(fp32, f64)
    assert engine_err <= max(VS_ONE_DEVICE, ILL_CONDITIONED_FACTOR * loop_err), (
        f"{jax.tree_util.keystr(path)}: {engine_err:.2e} from the float64 loop, where the "
        f"one-device fp32 loop is {loop_err:.2e} from it")


def max_relative_diff(a, b) -> float:
  """Largest leaf-wise ||a - b|| / ||b|| over two param trees (0-norm leaves compared absolutely)."""
  diffs = jax.tree.map(
      lambda x, y: float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                         / max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)), a, b)
  return max(jax.tree.leaves(diffs))

