"""A tier written outside jzero (tests/tiers/test_toy_tier.py adds it): the optimizer state in
numpy on the host, ``zero_optimization.offload_optimizer.device: "numpy"``.

One module, one registry line (``registry.register(NumpyTier)``), no library file. The tier
(:class:`NumpyTier`) holds every leaf's optimizer state outside the train state's arrays (0-byte
placeholders there); its resource (:class:`NumpyStore`, opened per plan) keeps it as numpy arrays,
global, in the state layout. The step hands the gradients out of the jit unclipped, with the
clipping factor (:class:`NumpyUpdate`, the outermost link of the update chain, as the NVMe
store's); after the step one jitted function updates master and state from the store and writes
the new params into the train state. Its bytes are the column "numpy" of the estimator and of the
memory report; checkpoints read the store into the state and take it back on restore.

fp32 training only (the master is the param), no hpZ, an elementwise optimizer (the config's):
what else it is asked is refused by :meth:`NumpyTier.check_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.plan import LeafPlan
from jzero.tiers.base import Tier, Update
from jzero.tiers.updates import placeholder_shape, shrink

NUMPY = "numpy"


def _is_leaf(x: Any) -> bool:
  return isinstance(x, LeafPlan)


class NumpyStore:
  """The optimizer state of a plan's leaves as numpy arrays (global shapes, the state layout)."""

  def __init__(self, plan: Any, tx: optax.GradientTransformation):
    self.plan, self.tx = plan, tx
    self.opt_state: Any = None
    self.updates = 0  # steps applied (a skipped step is none)

  def param_like(self, fn) -> Any:
    """``fn(leaf, array)`` over the stored state's arrays laid out like a parameter (its twins,
    :mod:`jzero.sharding.opt_layout`; 0 for the others)."""
    twins = OptLayout.of(self.plan, self.tx).twins()
    return jax.tree.map(lambda leaf, x: 0 if leaf is None else fn(leaf, x), twins, self.opt_state,
                        is_leaf=lambda x: x is None or _is_leaf(x))

  def per_device_bytes(self) -> int:
    n = self.plan.mesh.zero_size
    return sum(jax.tree.leaves(self.param_like(
        lambda leaf, x: x.nbytes // n if leaf.state_partitioned else x.nbytes)))

  def global_bytes(self) -> int:
    return sum(jax.tree.leaves(self.param_like(lambda leaf, x: x.nbytes)))


class NumpyTier(Tier):
  """The optimizer state in numpy (module docstring)."""

  name = NUMPY
  memory = NUMPY
  answers = (("offload_optimizer", NUMPY),)
  wraps = "step"

  @classmethod
  def check_config(cls, config: Any) -> None:
    zero = config.zero_optimization
    if getattr(zero.offload_optimizer, "device", None) != NUMPY:
      return
    if config.precision != "fp32" or int(zero.zero_hpz_partition_size) > 1:
      raise ConfigError("zero_optimization.offload_optimizer.device='numpy' keeps fp32 "
                        "training's state without hpZ; use fp32 and no zero_hpz_partition_size.")

  @classmethod
  def place(cls, plan: Any, zero: Any, placement: Any) -> Any:
    if getattr(zero.offload_optimizer, "device", None) != NUMPY:
      return placement
    if any(l.shard_dim is None for l in plan.leaf_list()):
      raise ConfigError("offload_optimizer.device='numpy' holds every leaf; a 0-d leaf has no "
                        "placeholder.")
    return dataclasses.replace(placement, state_tiers={
        **placement.state_tiers, **{l.path: NUMPY for l in plan.leaf_list()}})

  @classmethod
  def uses(cls, plan: Any) -> bool:
    return any(l.state_tier == NUMPY for l in plan.leaf_list())

  @classmethod
  def holds_state(cls, plan: Any, leaf: Any) -> bool:
    return leaf.state_tier == NUMPY

  @classmethod
  def open(cls, plan: Any, config: Any, tx: optax.GradientTransformation) -> NumpyStore:
    return NumpyStore(plan, tx)

  @classmethod
  def write_initial(cls, plan: Any, resource: NumpyStore, masters: dict) -> None:
    tree = plan.map(lambda l: masters[l.path])
    resource.opt_state = jax.tree.map(np.asarray, jax.jit(resource.tx.init)(tree))

  @classmethod
  def update(cls, plan: Any, config: Any, tx: optax.GradientTransformation,
             resource: NumpyStore, inner: Update, *, elementwise: bool) -> Update:
    return NumpyUpdate(inner, plan)

  @classmethod
  def after_step(cls, plan: Any, config: Any, tx: optax.GradientTransformation,
                 resource: NumpyStore) -> Any:
    return NumpyAfterStep(plan, tx, resource)

  @classmethod
  def full_state(cls, plan: Any, resource: NumpyStore, state: Any) -> Any:
    shardings = plan.shardings(OptLayout.of(plan, resource.tx).specs())
    return state._replace(opt_state=jax.device_put(resource.opt_state, shardings))

  @classmethod
  def absorb(cls, plan: Any, resource: NumpyStore, state: Any) -> Any:
    resource.opt_state = jax.tree.map(np.asarray, state.opt_state)
    placeholders = jax.tree.map(
        lambda leaf, x: x if leaf is None else jax.device_put(
            np.zeros(placeholder_shape(leaf), x.dtype), x.sharding),
        OptLayout.of(plan, resource.tx).twins(), state.opt_state,
        is_leaf=lambda x: x is None or _is_leaf(x))
    return state._replace(opt_state=placeholders)

  @classmethod
  def measured_bytes(cls, plan: Any, resource: NumpyStore) -> dict:
    return {"optimizer": {NUMPY: resource.per_device_bytes()}}

  @classmethod
  def held_bytes(cls, plan: Any, resource: NumpyStore) -> dict:
    return {"optimizer": resource.global_bytes()}


class NumpyUpdate(Update):
  """The step hands every leaf's gradient (state layout) and the clipping factor out of the jit
  (:class:`NumpyAfterStep` updates them after it)."""

  def __init__(self, inner: Update, plan: Any):
    super().__init__(inner)
    self.plan = plan
    self.paths = frozenset(l.path for l in plan.leaf_list() if l.state_tier == NUMPY)

  @property
  def output_specs(self) -> dict:
    specs = {l.path: self.plan.state_spec(l) for l in self.plan.leaf_list()
             if l.path in self.paths}
    return {**self.inner.output_specs, NUMPY: {"grads": specs, "factor": P()}}

  def update(self, grads: Any, state: Any, skip: Any = None, factor: Any = None):
    plan = self.plan
    handed = {l.path: g for l, g in zip(plan.leaf_list(), jax.tree.leaves(grads))
              if l.path in self.paths}
    new, outputs = self.inner.update(shrink(plan, grads, self.paths), state, skip, factor)
    one = jax.numpy.ones((), jax.numpy.float32)
    return new, {**outputs, NUMPY: {"grads": handed, "factor": one if factor is None else factor}}


class NumpyAfterStep:
  """After the jitted step: master and state updated from the store with the handed-out
  gradients, the new params written (one jitted update on global arrays, made at the first
  step)."""

  def __init__(self, plan: Any, tx: optax.GradientTransformation, store: NumpyStore):
    self.plan, self.tx, self.store = plan, tx, store
    self._apply = None

  def __call__(self, state: Any, metrics: dict, outputs: dict) -> Any:
    if bool(metrics["overflow"]):  # a skipped step: the stored state stays
      return state
    if self._apply is None:
      self._apply = self._program(state)
    io = outputs[NUMPY]
    params, opt_state = self._apply(state.params, io["grads"], io["factor"],
                                    self.store.opt_state)
    self.store.opt_state = jax.tree.map(np.asarray, opt_state)
    self.store.updates += 1
    return state._replace(params=params)

  def _program(self, state: Any):
    """One jitted update on global arrays: the fp32 master (the param, in the state layout),
    the optax update, the new params in the param layout and sharding."""
    plan, tx = self.plan, self.tx
    widen = lambda l, p: l.to_padded(p) if l.state_partitioned and not l.param_partitioned else p
    narrow = lambda l, m: l.to_logical(m) if l.state_partitioned and not l.param_partitioned else m

    def apply(params, grads, factor, opt_state):
      master = plan.map(widen, params)
      g = plan.map(lambda l: grads[l.path] * factor)
      updates, opt_state = tx.update(g, opt_state, master)
      new = optax.apply_updates(master, updates)
      return plan.map(lambda l, m: narrow(l, m).astype(plan.compute_dtype), new), opt_state

    shardings = (jax.tree.map(lambda x: x.sharding, state.params),
                 plan.shardings(OptLayout.of(plan, tx).specs()))
    return jax.jit(apply, out_shardings=shardings)
