"""A new tier is one class plus one registry entry, and touches no library file.

The toy tier below (``NumpySgd``) places the largest leaf's state in a tier of its own,
``"numpy"``, through placement data (:meth:`jzero.tiers.base.Tier.place`), and updates that leaf
on the host with numpy. Its update (:class:`jzero.tiers.base.Update`) wraps the device's: the step
hands the leaf's clipped gradient out of the jit (``hand_out``) and updates the others on the
device as usual; after the step it writes ``p - lr * g`` into the state (``after_step``). Registered by adding it to ``registry.TIERS``, it
trains the run SGD trains on the device -- every parameter equal to float rounding, the numpy
leaf among them -- and the plan records where the leaf lives.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from jzero.tiers import registry
from jzero.tiers.base import Tier, Update
from zero_testing import SMALL, batches, engine_run, make_engine

N, LR = 8, 0.1


class NumpySgd(Tier):
  """SGD of the largest leaf in numpy on the host, after each step."""

  name = "numpy_sgd"

  @classmethod
  def place(cls, plan, zero, placement):
    largest = max(plan.leaf_list(), key=lambda l: l.numel).path
    return dataclasses.replace(placement, state_tiers={**placement.state_tiers, largest: "numpy"})

  @classmethod
  def create(cls, engine):
    leaves = [l for l in engine.plan.leaf_list() if l.state_tier == "numpy"]
    return cls(leaves[0]) if leaves else None

  def __init__(self, leaf):
    self.leaf = leaf

  def update(self, engine, inner):
    return NumpySgdUpdate(inner, engine.plan, self.leaf)


class NumpySgdUpdate(Update):
  """The device's update of every other leaf; this one's gradient out of the jit, SGD after it."""

  def __init__(self, inner, plan, leaf):
    super().__init__(inner)
    self.plan, self.leaf = plan, leaf
    self.index = [l.path for l in plan.leaf_list()].index(leaf.path)

  def hand_out(self, state, grads, factor):
    grads, outputs = self.inner.hand_out(state, grads, factor)
    flat, treedef = jax.tree.flatten(grads)
    out = flat[self.index] if factor is None else flat[self.index] * factor
    flat[self.index] = jax.numpy.zeros_like(out)  # the device's SGD leaves this leaf as it is
    return jax.tree.unflatten(treedef, flat), {**outputs, NumpySgd.name: out}

  def output_specs(self):
    return {**self.inner.output_specs(), NumpySgd.name: self.plan.state_spec(self.leaf)}

  def after_step(self, state, metrics, outputs):
    state = self.inner.after_step(state, metrics, outputs)
    flat, treedef = jax.tree.flatten(state.params)
    i, grad = self.index, np.asarray(self.leaf.to_logical(outputs[NumpySgd.name]))
    flat[i] = jax.device_put(np.asarray(flat[i]) - np.float32(LR) * grad, flat[i].sharding)
    return state._replace(params=jax.tree.unflatten(treedef, flat))


CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 2}}


def test_a_toy_tier_places_a_leaf_and_updates_it(monkeypatch):
  data = batches(SMALL.seq_len, N, 3)
  plain = make_engine(CONFIG, optimizer=optax.sgd(LR))
  initial, plain_params, plain_losses = engine_run(plain, data)
  monkeypatch.setattr(registry, "TIERS", registry.TIERS + (NumpySgd,))
  engine = make_engine(CONFIG, optimizer=optax.sgd(LR))
  _, params, losses = engine_run(engine, data)
  (tier,) = engine.tiers
  assert isinstance(tier, NumpySgd)
  assert [l.path for l in engine.plan.leaf_list() if l.state_tier == "numpy"] == [tier.leaf.path]
  assert all(l.state_tier == "device" for l in plain.plan.leaf_list())
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
  index = [l.path for l in engine.plan.leaf_list()].index(tier.leaf.path)
  ours, theirs = jax.tree.leaves(params), jax.tree.leaves(plain_params)
  assert not np.allclose(ours[index], jax.tree.leaves(initial)[index])  # the numpy update moved it
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
