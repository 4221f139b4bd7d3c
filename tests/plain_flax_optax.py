"""A plain Flax + optax + Orbax training script, as a user writes one: it never imports jzero.

Usage:
  python plain_flax_optax.py train OUT      # both optimizers: 10 steps, saved after step 4
  python plain_flax_optax.py resume OPTIMIZER CKPT OUT_JSON   # continue CKPT's latest step to 10

``train`` runs a Linen MLP on one device with each optimizer of :data:`OPTIMIZERS` -- AdamW with a
linear warmup (``optax.adamw``) and SGD with momentum 0.9 (``optax.sgd``), both on
an optax schedule -- saving ``OUT/<optimizer>/`` with Orbax's ``CheckpointManager`` after step 4
(items ``params`` and ``opt_state``, as flax's examples write them), and writes every step's loss
to ``OUT/losses.json``. ``resume`` restores a ``CheckpointManager`` directory with its own target
structure (``tx.init(params)``), trains the remaining steps up to 10, and writes their losses.

tests/checkpoint/test_optax_interop.py imports this module for the model, the data and the
optimizers, and runs it as a subprocess for the runs themselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

STEPS, SAVED_AT, BATCH, FEATURES, CLASSES = 10, 4, 16, 7, 3
LR, WARMUP, BETAS, EPS, WD, MOMENTUM = 1e-2, 8, (0.9, 0.95), 1e-8, 0.1, 0.9


class MLP(nn.Module):
  """Two Dense layers (a hidden width that splits unevenly over 8 devices: padding in ZeRO)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(13)(x)))


def loss_fn(model, batch):
  """Mean cross-entropy of ``model(batch["x"])`` (``model``: the module's apply, bound)."""
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batches() -> list[dict]:
  """The run's global batches, one per step."""
  rs = np.random.RandomState(0)
  return [{"x": rs.randn(BATCH, FEATURES).astype(np.float32),
           "y": rs.randint(0, CLASSES, BATCH).astype(np.int32)} for _ in range(STEPS)]


def schedule():
  """Linear warmup from 0 to LR over WARMUP steps after the first: DeepSpeed's WarmupLR with
  warmup_type linear (its first two steps both use warmup_min_lr)."""
  return optax.linear_schedule(0.0, LR, WARMUP, transition_begin=1)


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(schedule(), b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD),
    "sgd": lambda: optax.sgd(schedule(), momentum=MOMENTUM),
}


def init_params(key=None):
  return MLP().init(jax.random.key(0) if key is None else key, batches()[0]["x"])["params"]


def _step(tx):
  model = MLP()

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(lambda x: model.apply({"params": p}, x), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def train(out: Path) -> None:
  losses = {}
  for name, make in OPTIMIZERS.items():
    tx = make()
    step = _step(tx)
    params = init_params()
    opt_state = tx.init(params)
    manager = ocp.CheckpointManager(out / name)
    losses[name] = []
    for i, batch in enumerate(batches()):
      params, opt_state, loss = step(params, opt_state, batch)
      losses[name].append(float(loss))
      if i + 1 == SAVED_AT:
        manager.save(SAVED_AT, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state)))
    manager.wait_until_finished()
    manager.close()
  (out / "losses.json").write_text(json.dumps(losses))


def resume(name: str, directory: Path, out_json: Path) -> None:
  tx = OPTIMIZERS[name]()
  manager = ocp.CheckpointManager(directory)
  at = manager.latest_step()
  params = init_params()  # the target structure
  restored = manager.restore(at, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(params),
      opt_state=ocp.args.StandardRestore(tx.init(params))))
  params, opt_state = restored["params"], restored["opt_state"]
  step = _step(tx)
  losses = []
  for batch in batches()[at:]:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  manager.close()
  out_json.write_text(json.dumps({"step": at, "losses": losses}))


if __name__ == "__main__":
  if sys.argv[1] == "train":
    train(Path(sys.argv[2]))
  else:
    resume(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
