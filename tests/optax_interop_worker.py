"""jzero's side of tests/checkpoint/test_optax_interop.py, and its run on another device count as a
subprocess; not a test module itself.

Usage: python optax_interop_worker.py DEVICES PLAIN_DIR OUT_JSON STAGE:OPTIMIZER...

With DEVICES simulated CPU devices, continues the plain run's checkpoint PLAIN_DIR/<optimizer>
(tests/plain_flax_optax.py) in jzero at each ZeRO stage given, with the config that builds the
plain script's optimizer, and writes each continuation's losses (steps 5-10) to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

import plain_flax_optax as plain  # noqa: E402


def config(stage: int, optimizer: str, devices: int) -> dict:
  """The DeepSpeed config whose optax chain is the plain script's optimizer ``optimizer``:
  AdamW (``optax.adamw``) or SGD with momentum (``optax.sgd``; jzero's chain adds a stateless
  weight decay of 0), with WarmupLR's linear warmup (``optax.linear_schedule(0, lr, n,
  transition_begin=1)``); no gradient clipping, as the plain loop (jzero's default clips at 1.0)."""
  block = ({"type": "AdamW", "params": {"lr": plain.LR, "betas": list(plain.BETAS),
                                        "eps": plain.EPS, "weight_decay": plain.WD}}
           if optimizer == "adamw" else
           {"type": "SGD", "params": {"lr": plain.LR, "momentum": plain.MOMENTUM}})
  return {"train_micro_batch_size_per_gpu": plain.BATCH // devices, "steps_per_print": 1000,
          "gradient_clipping": 0.0, "optimizer": block,
          "scheduler": {"type": "WarmupLR", "params": {
              "warmup_min_lr": 0.0, "warmup_max_lr": plain.LR, "warmup_num_steps": plain.WARMUP,
              "warmup_type": "linear"}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def make_engine(stage: int, optimizer: str, devices: int):
  import jzero
  return jzero.initialize(plain.MLP(), plain.loss_fn, config(stage, optimizer, devices),
                          sample_batch=plain.batches()[0], init_inputs=lambda b: (b["x"],))


def train(engine, state, first: int, last: int):
  """Steps ``first``..``last`` (1-based) of the plain run's batches: (state, losses)."""
  losses = []
  for batch in plain.batches()[first - 1:last]:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, losses


def continued(engine, plain_dir: Path, optimizer: str) -> list[float]:
  """The plain run's checkpoint continued in ``engine`` up to the last step: the losses."""
  from jzero import checkpoint
  state = engine.import_optax(**checkpoint.read_optax(plain_dir / optimizer))
  assert int(state.step) == plain.SAVED_AT
  return train(engine, state, plain.SAVED_AT + 1, plain.STEPS)[1]


def main(devices: int, plain_dir: str, out: str, runs: list[str]) -> None:
  jax.config.update("jax_num_cpu_devices", devices)
  losses = {}
  for run in runs:
    stage, optimizer = run.split(":")
    losses[run] = continued(make_engine(int(stage), optimizer, devices), Path(plain_dir),
                            optimizer)
  Path(out).write_text(json.dumps(losses))


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
