"""What tracing an optax transformation tells (:mod:`jzero.sharding.tx_traits`), device-free: which
transformations may run on each device's partition, and which leaves they never change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from jzero.sharding.tx_traits import traits

S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
PARAMS = {"embed": S(256, 36), "blocks": {"w": S(2, 36, 108), "ln": S(2, 36)}}
PARTITIONS = {"embed": S(32, 36), "blocks": {"w": S(2, 36, 14), "ln": S(2, 5)}}
MASK = {"embed": False, "blocks": {"w": True, "ln": True}}
LABELS = {"embed": "frozen", "blocks": {"w": "train", "ln": "train"}}


ELEMENTWISE = {
    "adam": optax.adam(1e-3),
    "adamw_mask": optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 2, p)),
    "lion": optax.lion(1e-3),
    "sgd_nesterov": optax.sgd(0.1, momentum=0.9, nesterov=True),
    "rmsprop": optax.rmsprop(1e-3),
    "adagrad": optax.adagrad(1e-2),
    "adabelief": optax.adabelief(1e-3),
    "radam": optax.radam(1e-3),
    "schedule_free": optax.contrib.schedule_free_adamw(1e-3),
    "multi_steps": optax.MultiSteps(optax.adam(1e-3), 2),
    "inject": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    "masked": optax.masked(optax.adamw(1e-3), MASK),
}
COUPLED = {
    "clip_by_global_norm": (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                            "reduce_sum"),
    "adafactor": (optax.adafactor(1e-3), "reduce_sum"),
    "lamb": (optax.lamb(1e-3), "reduce_sum"),
    "lars": (optax.lars(1e-3), "reduce_sum"),
    "novograd": (optax.novograd(1e-3), "reduce_sum"),
    "sm3": (optax.sm3(1e-3), "reshape"),
    "muon": (optax.contrib.muon(1e-3), "reshape"),
    "apply_if_finite": (optax.apply_if_finite(optax.adam(1e-3), 3), "reduce_and"),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_transformations_may_run_on_partitions(name):
  found = traits(ELEMENTWISE[name], PARAMS, PARTITIONS)
  assert found.elementwise and not found.coupling and not found.frozen


@pytest.mark.parametrize("name", list(COUPLED))
def test_transformations_that_reduce_across_elements_are_found(name):
  tx, primitive = COUPLED[name]
  found = traits(tx, PARAMS, PARTITIONS)
  assert not found.elementwise and found.coupling.startswith(primitive)


def test_a_constant_from_a_shape_is_not_elementwise():
  """``g / numel``: every equation elementwise, but a constant the partitions' shapes change."""
  def update(g, s, p=None):
    return jax.tree.map(lambda x: x / x.size, g), s
  tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  found = traits(tx, PARAMS, PARTITIONS)
  assert not found.elementwise and "shapes" in found.coupling


def test_nothing_partitioned_is_elementwise_for_the_step():
  assert traits(optax.lamb(1e-3), PARAMS, None).elementwise


def test_set_to_zero_under_multi_transform_freezes_its_leaves():
  tx = optax.multi_transform({"train": optax.adamw(1e-3), "frozen": optax.set_to_zero()}, LABELS)
  found = traits(tx, PARAMS, PARTITIONS)
  assert found.elementwise and found.frozen == {"embed"}


def test_a_norm_over_the_tree_before_the_freeze_reads_every_gradient():
  multi = optax.multi_transform({"train": optax.adamw(1e-3), "frozen": optax.set_to_zero()},
                                LABELS)
  assert not traits(optax.chain(optax.clip_by_global_norm(1.0), multi), PARAMS).frozen


def test_zeroed_then_decayed_is_not_frozen():
  """masked(set_to_zero) followed by adamw: the decay still moves the 'frozen' leaf."""
  tx = optax.chain(optax.masked(optax.set_to_zero(), {"embed": True, "blocks": {
      "w": False, "ln": False}}), optax.adamw(1e-3, weight_decay=0.1))
  assert not traits(tx, PARAMS, PARTITIONS).frozen
