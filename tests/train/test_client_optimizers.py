"""A user's own optax transformation, passed as ``initialize(optimizer=tx)``, gives the plain
one-device optax loop's losses and parameters at every stage (fp32; tests/optax_testing.py's
model has dimensions no device count divides and a LayerNorm): elementwise ones in the partition
view, those that reduce across elements in the whole view (:mod:`jzero.sharding.opt_layout`).

Bounds: losses within 1e-6 relative; params within VS_ONE_DEVICE (1e-5) leaf by leaf, or, for an
ill-conditioned leaf, the float64 rule of ``zero_testing.assert_same_as_one_device``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_testing import Tiny, data, engine_run_with, plain_run
from zero_testing import assert_same_as_one_device

STEPS = 6
LOSS_BOUND = 1e-6
#: (stage, devices): every optimizer at stage 3 on 8 devices (partitioned parameters, padded
#: leaves, the whole view's gathers); the other layouts with REPRESENTATIVES.
EVERY_OPTIMIZER = (3, 8)
LAYOUTS = [(0, 8), (1, 8), (2, 8), (3, 4)]


def _decay_mask(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


def _frozen_labels(params):
  return {k: jax.tree.map(lambda _: "frozen" if k == "embed" else "train", v)
          for k, v in params.items()}


def _schedule():
  return optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, STEPS)


#: The optimizers the issue names, each as a user would write it.
OPTIMIZERS = {
    "adamw_decay_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),  # factored at 12 x 20
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    "lion": lambda: optax.lion(1e-3),
    "sm3": lambda: optax.sm3(1e-1),
    "novograd": lambda: optax.novograd(1e-2),
    "adagrad": lambda: optax.adagrad(1e-1),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "sgd_nesterov": lambda: optax.sgd(1e-1, momentum=0.9, nesterov=True),
    "adabelief": lambda: optax.adabelief(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
    "clip_adamw_schedule": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                               optax.adamw(_schedule())),
    "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "masked_adamw": lambda: optax.masked(optax.adamw(1e-2), _decay_mask),
    "multi_transform_frozen": lambda: optax.multi_transform(
        {"train": optax.adamw(1e-2), "frozen": optax.set_to_zero()}, _frozen_labels),
}


#: One of each kind of update: elementwise (partition view), a global norm, factored state, a
#: trust ratio, an orthogonalisation, a frozen subtree, state that is not per parameter.
REPRESENTATIVES = ["adamw_decay_mask", "clip_adamw_schedule", "adafactor", "lamb", "muon",
                   "multi_transform_frozen", "multi_steps"]

CASES = ([(name, *EVERY_OPTIMIZER) for name in OPTIMIZERS]
         + [(name, *layout) for layout in LAYOUTS for name in REPRESENTATIVES])


def _lr_change(step, opt_state, put=lambda old, new: new):
  """inject_hyperparams: the learning rate halved before step 3 (the same in both loops)."""
  if step != 3:
    return opt_state
  old = optax.tree_utils.tree_get(opt_state, "learning_rate")
  return optax.tree_utils.tree_set(opt_state, learning_rate=put(old, old / 2))


def _engine_hook(name):
  if name != "inject_hyperparams":
    return None
  put = lambda old, new: jax.device_put(new, old.sharding)
  return lambda step, state: state._replace(opt_state=_lr_change(step, state.opt_state, put))


def _plain_hook(name):
  return _lr_change if name == "inject_hyperparams" else None


@functools.lru_cache(maxsize=None)
def _batches():
  return data(STEPS)


@functools.lru_cache(maxsize=None)
def _plain(name: str, initial_key: bytes):
  """The plain loop's (params, losses) and its float64 twin (lazily) for one optimizer."""
  initial = _INITIAL[initial_key]
  params, losses, _ = plain_run(OPTIMIZERS[name](), initial, _batches(), hook=_plain_hook(name))
  exact = functools.lru_cache(maxsize=None)(lambda: plain_run(
      OPTIMIZERS[name](), initial, _batches(), float64=True, hook=_plain_hook(name))[0])
  return params, losses, exact


_INITIAL: dict[bytes, dict] = {}


@pytest.mark.parametrize("name,stage,devices", CASES,
                         ids=[f"{n}-stage{s}-{d}dev" for n, s, d in CASES])
def test_optax_optimizer_matches_the_plain_loop(name, stage, devices):
  engine, state, initial, params, losses, _ = engine_run_with(
      OPTIMIZERS[name](), stage, _batches(), devices=devices, hook=_engine_hook(name))
  key = b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(initial))
  _INITIAL.setdefault(key, initial)
  ref_params, ref_losses, exact = _plain(name, key)
  rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
  assert rel <= LOSS_BOUND, (name, losses, ref_losses)
  assert_same_as_one_device(params, ref_params, exact)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_is_partitioned_and_predicted(name):
  """Stage 3 on 8 devices: one device's optimizer-state bytes (the memory report, measured) are
  at most 1.05 x the plain state's / 8 plus the leaves kept whole (small statistics, counts), and
  the estimator's figure is within 2% of the measurement. The model's widths (36, 100) pad its
  partitioned leaves by 3% in all."""
  wider = lambda rngs: Tiny(rngs, width=36, hidden=100)
  engine, state, initial, *_ = engine_run_with(OPTIMIZERS[name](), 3, [], model=wider)
  plain = sum(np.asarray(x).nbytes for x in jax.tree.leaves(OPTIMIZERS[name]().init(initial)))
  replicated = engine._programs().parts.opt.bytes_per_device()["replicated"]
  report = engine.memory_report(state)
  measured = report.measured_bytes("optimizer")
  assert measured <= 1.05 * plain / 8 + replicated, (measured, plain / 8, replicated)
  assert report.predicted_bytes("optimizer") == pytest.approx(measured, rel=0.02)
