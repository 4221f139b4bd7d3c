"""A tiny model for the NVMe-tier tests, and a script run as a subprocess by
tests/tiers/test_nvme.py.

``python tests/nvme_worker.py NVME_PATH OUT.npz [optimizer|params|infinity] [kill|full]``: train 2
steps with the optimizer state on the NVMe tier (stage 2; ``params``: stage 3 with the params there
too; ``infinity``: stage 3, the params' copies there and their state in host memory), save what the
store has committed (``jzero.tiers.nvme_state.open_committed``) to ``OUT.npz``, print
the store directory as JSON, then SIGKILL this process from inside the third step's writes (after
two of its three groups have landed) -- or, with ``full``, let those writes fail as on a full disk
and end with the StepNotCommitted the step raises: the store must still hold step 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

ROWS, D_IN, D_OUT = 8, 12, 4


def model_factory():
  from flax import nnx

  class MLP(nnx.Module):
    """Leaves split along their first or second dim, and padded ones (20 x 4, the biases)."""

    def __init__(self, rngs: nnx.Rngs):
      self.a = nnx.Linear(D_IN, 32, rngs=rngs)
      self.b = nnx.Linear(32, 20, rngs=rngs)
      self.c = nnx.Linear(20, D_OUT, rngs=rngs)

    def __call__(self, x):
      import jax
      return self.c(jax.nn.gelu(self.b(jax.nn.gelu(self.a(x)))))

  return MLP


def loss_fn(model, batch):
  import jax.numpy as jnp
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batch(i: int) -> dict:
  rng = np.random.default_rng(i)
  return {"x": rng.normal(size=(ROWS, D_IN)).astype(np.float32),
          "y": rng.normal(size=(ROWS, D_OUT)).astype(np.float32)}


def config(stage: int, nvme_path=None, precision: str = "fp32", **offload) -> dict:
  cfg = {"train_batch_size": ROWS, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
  if nvme_path is not None:
    cfg["zero_optimization"]["offload_optimizer"] = {
        "device": "nvme", "nvme_path": str(nvme_path), "pipeline_read": True,
        "pipeline_write": True, "buffer_count": 2, **offload}
    cfg["zero_optimization"]["sub_group_size"] = 60  # elements per device: three groups
  if precision == "bf16":
    cfg["bf16"] = {"enabled": True}
  return cfg


def main(nvme_path: str, out: str, tier: str = "optimizer", fault: str = "kill") -> None:
  import jax
  import jzero
  from jzero.tiers import nvme_state
  if tier == "params":  # stage 3 with the params on the tier too (jzero.tiers.nvme_params)
    cfg = config(3, nvme_path)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path,
                                                 "max_in_cpu": 0}
  elif tier == "infinity":  # the params' copies on the tier, their state in host memory
    cfg = config(3)
    cfg["zero_optimization"].update(
        offload_optimizer={"device": "cpu"}, sub_group_size=60,
        offload_param={"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0})
  else:
    cfg = config(2, nvme_path)
  engine = jzero.initialize(model_factory(), loss_fn, cfg)
  state = engine.init(jax.random.key(0))
  for i in range(2):
    state, _ = engine.train_step(state, engine.shard_batch(batch(i)))
  store = engine.nvme_store
  step, arrays, _ = nvme_state.open_committed(store.directory)
  np.savez(out, **arrays)
  print(json.dumps({"directory": str(store.directory), "step": step,
                    "groups": len(store.groups)}), flush=True)
  if fault == "full":
    import fault_injection
    with fault_injection.failing_store_writes(store, after=1):
      engine.train_step(state, engine.shard_batch(batch(2)))  # raises StepNotCommitted
  write, calls = store._write, [0]

  def dying_write(slot, group, rows):
    future = write(slot, group, rows)
    calls[0] += 1
    if calls[0] == 2:  # two of step 3's groups are on disk, the manifest still says step 2
      future.result()
      os.kill(os.getpid(), signal.SIGKILL)
    return future

  store._write = dying_write
  engine.train_step(state, engine.shard_batch(batch(2)))
  print("the step ended without being killed", flush=True)


if __name__ == "__main__":
  import jzero
  jzero.simulate_cpu_devices(8)
  main(*sys.argv[1:])
