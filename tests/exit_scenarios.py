"""Scripts a migrating user writes, run as subprocesses by tests/journeys/test_trust.py.

``python tests/exit_scenarios.py COMMAND ARGS``:

* ``save-exit DIR TAG``: build an engine, save its initial state as ``TAG`` and end the script --
  DeepSpeed's save is synchronous, so scripts do exactly this.
* ``save-fails-at-exit DIR``: the same, with the file list's write failing in the background.
* ``reuse-donated``: call ``train_step`` without keeping the state it returns, then every entry
  point with the donated state; print each JZeroError and go on training with the right state.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import nnx

import jzero


class Tiny(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)))

  def __call__(self, x):
    return x @ self.w


def loss_fn(model: Tiny, batch: dict) -> jax.Array:
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def engine():
  cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
  return jzero.initialize(Tiny, loss_fn, cfg)


def batch(engine) -> dict:
  return engine.shard_batch({"x": jnp.ones((8, 8)), "y": jnp.zeros((8, 4))})


def save_exit(directory: str, tag: str) -> None:
  eng = engine()
  eng.save_checkpoint(eng.init(jax.random.key(0)), directory, tag=tag)


def save_fails_at_exit(directory: str) -> None:
  from jzero.checkpoint import layout

  def broken(step_dir):
    raise OSError(28, "No space left on device")

  layout.record_files = broken
  save_exit(directory, "1")


def reuse_donated() -> None:
  eng = engine()
  state = eng.init(jax.random.key(0))
  data = batch(eng)
  new_state, _ = eng.train_step(state, data)  # `state` is donated here
  calls = {
      "train_step": lambda: eng.train_step(state, data),
      "eval_loss": lambda: eng.eval_loss(state, data),
      "logical_params": lambda: eng.logical_params(state),
      "save_checkpoint": lambda: eng.save_checkpoint(state, "unused-checkpoint-dir"),
  }
  for name, call in calls.items():
    try:
      call()
      print(f"{name}: no error")
    except jzero.JZeroError as e:
      print(f"{name}: JZeroError: {e}")
  state, metrics = eng.train_step(new_state, data)
  print(f"went on training: loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
  jzero.simulate_cpu_devices(8)
  command, *args = sys.argv[1:]
  {"save-exit": save_exit, "save-fails-at-exit": save_fails_at_exit,
   "reuse-donated": reuse_donated}[command](*args)
