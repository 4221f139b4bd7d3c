"""A training script run by tests/runtime/test_launch.py as several processes; not a test module
itself.

Usage: python launch_worker.py STEPS [--no-poll] [--save-dir DIR]

Joins the job through ``jzero.initialize`` alone (no arguments: the ``jzero launch`` or SLURM
environment says where the others are), prints ``joined via SOURCE as I/N pid PID``, then trains a
tiny model under ZeRO stage 3 for STEPS steps, printing ``process I step S loss L`` after each and
stopping early, at the same step on every process, when ``engine.reached_preemption`` says a
process got SIGTERM (``preempted at step S``). With ``--no-poll`` it never asks (the engine's
own preemption check must stop it); with ``--save-dir DIR`` it saves step 2 there.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jzero
from jzero.runtime import distributed
class Tiny(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)))

  def __call__(self, x):
    return x @ self.w


def loss_fn(model: Tiny, batch: dict) -> jax.Array:
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def main(steps: int, polls: bool = True, save_dir: str | None = None) -> None:
  cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
         "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
  engine = jzero.initialize(Tiny, loss_fn, cfg)
  info = distributed.init_distributed()
  me = jax.process_index()
  print(f"joined via {info.source} as {me}/{jax.process_count()} pid {os.getpid()}", flush=True)
  state = engine.init(jax.random.key(0))
  rows = engine.local_rows()
  rng = np.random.default_rng(0)
  for step in range(1, steps + 1):
    x = rng.normal(size=(engine.global_batch_size, 8)).astype(np.float32)
    batch = {"x": x[rows], "y": np.zeros((len(rows), 4), np.float32)}  # this process's rows
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    print(f"process {me} step {step} loss {float(metrics['loss'])!r}", flush=True)
    if save_dir and step == 2:
      engine.save_checkpoint(state, save_dir)
    if polls and engine.reached_preemption(step):
      print(f"process {me} preempted at step {step}", flush=True)
      return
    time.sleep(0.2)


if __name__ == "__main__":
  main(int(sys.argv[1]), polls="--no-poll" not in sys.argv,
       save_dir=sys.argv[sys.argv.index("--save-dir") + 1] if "--save-dir" in sys.argv else None)
