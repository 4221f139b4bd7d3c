"""The host Adam kernel against jzero's optax chain on XLA:CPU at XLA's default settings, in a
process of its own (the suite's conftest compiles XLA at LLVM level 0, which fuses multiply-adds
elsewhere); tests/tiers/test_host_adam.py runs it. Not a test module itself.

Usage: python host_adam_worker.py OUT_JSON

For each config block of :data:`BLOCKS` and each backend, seven steps of
:class:`jzero.tiers.host_adam.HostAdam` and of ``build_optimizer``'s transformation jitted on
XLA:CPU from the same params and gradients, each step's bf16 or fp16 cast beside; writes, per
block and backend, the number of elements of the master, the moments and the 16-bit params whose
bits differ, step by step.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jzero.tiers.host_adam import HostAdam  # noqa: E402
from jzero.train.optim import build_optimizer, host_adam_settings  # noqa: E402

BACKENDS = ("numba", "xla")
# Both weight-decay forms, no decay (optax skips a zero decay, and so does the kernel), other
# betas / eps, and a schedule (the learning rate computed in the graph).
BLOCKS = {
  "AdamW": ({"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, None),
  "Adam L2": ({"type": "Adam", "params": {"lr": 2e-3, "weight_decay": 0.05,
                                          "adam_w_mode": False}}, None),
  "Adam no decay": ({"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}, None),
  "AdamW warmup": ({"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6,
                                                "weight_decay": 0.1}},
                   {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3,
                                                   "warmup_num_steps": 4}}),
}
STEPS = 7


def gradient(rng: np.random.Generator, n: int) -> np.ndarray:
  """Gradients over many magnitudes, of both signs, some zero."""
  g = rng.standard_normal(n, dtype=np.float32) * np.float32(10.0) ** rng.integers(-6, 2, n)
  g[rng.random(n) < 0.01] = 0.0
  return g.astype(np.float32)


def bits(x: np.ndarray) -> np.ndarray:
  return x.view(np.uint16 if x.itemsize == 2 else np.uint32)


def compare(name: str, backend: str, n: int = 200_003) -> list[dict[str, int]]:
  """Per step, the number of differing elements of p, m, v and the 16-bit params."""
  block, scheduler = BLOCKS[name]
  tx, schedule = build_optimizer(block, scheduler)

  @jax.jit
  def device_step(p, opt_state, g):
    updates, opt_state = tx.update(g, opt_state, p)
    p = optax.apply_updates(p, updates)
    return p, opt_state, p.astype(jnp.bfloat16), p.astype(jnp.float16)

  rng = np.random.default_rng(0)
  p0 = rng.standard_normal(n, dtype=np.float32)
  p_dev = jnp.asarray(p0)
  opt_state = tx.init(p_dev)
  p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
  outs = {"bf16": np.empty(n, ml_dtypes.bfloat16), "fp16": np.empty(n, np.float16)}
  counts = []
  with HostAdam(host_adam_settings(block), threads=2, backend=backend, chunk=1 << 15) as adam:
    for count in range(STEPS):
      g = gradient(rng, n)
      p_dev, opt_state, bf16, fp16 = device_step(p_dev, opt_state, jnp.asarray(g))
      kind = "bf16" if count % 2 else "fp16"
      adam.step(p, m, v, g, count + 1, float(schedule(count)), out_params=outs[kind])
      adam_state = next(s for s in opt_state if isinstance(s, optax.ScaleByAdamState))
      pairs = {"p": (p, p_dev), "m": (m, adam_state.mu), "v": (v, adam_state.nu),
               kind: (outs[kind], bf16 if kind == "bf16" else fp16)}
      counts.append({k: int(np.sum(bits(a) != bits(np.asarray(b)))) for k, (a, b) in
                     pairs.items()})
  return counts


if __name__ == "__main__":
  result = {f"{name} / {backend}": compare(name, backend)
            for name in BLOCKS for backend in BACKENDS}
  with open(sys.argv[1], "w") as f:
    json.dump(result, f)
