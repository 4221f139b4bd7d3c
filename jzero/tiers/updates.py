"""The links of the step's update that are no tier's: the root, :class:`DeviceUpdate` (optax on the
device), :class:`SkipNonFinite` (a step whose gradient is not finite keeps its state) and
:class:`ClipByFactor` (DeepSpeed's clipping by the global norm), each an optax-shaped
:class:`jzero.tiers.base.Update`; and the placeholders of what a tier keeps outside the train
state's arrays (:func:`shrink`).

**The skip** is one mode of the chain, read from the links below it
(:attr:`jzero.tiers.base.Update.skip_mode`): "cond" -- a ``lax.cond`` whose skipping branch is the
links' :meth:`~jzero.tiers.base.Update.skipped` (the old state, placed as the update places its
results); "select" -- one
update with the flag, which selects the old state elementwise where it is true: the device update
fuses the select into the optax update (:func:`_skippable_update`), the host update selects inside
its host computation (XLA's GPU compiler rejects a host computation inside a conditional). The
device update's mode is "cond" where the loss scale checks overflow (fp16: a second copy of the
update is not worth it for a rare skip) and "select" otherwise (fp32's non-finite skip, fused).

**Placeholders.** A leaf whose master and optimizer state a tier keeps outside the train state's
arrays (:meth:`jzero.tiers.base.Tier.holds_state`: the NVMe store's) has them in the train state as
arrays of its partitioned layout with the shard dimension of size 0 -- the tree structure and
partition specs are those of every other plan, so optax, the step's ``shard_map`` and the donation
machinery see nothing new; so does a param a tier holds (:meth:`~jzero.tiers.base.Tier.holds_param`).
The device update leaves such a leaf's param as it is: the tier's update makes the new one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jzero.comm import collective_order, layouts, program
from jzero.sharding.opt_layout import OptLayout, View
from jzero.sharding.plan import LeafPlan, Plan
from jzero.tiers.base import Update

__all__ = ["Held", "DeviceUpdate", "SkipNonFinite", "ClipByFactor", "shrink", "placeholder_shape"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Held:
  """The leaves (by path) whose state / param the active tiers keep outside the train state's
  arrays (0-byte placeholders there)."""

  state: frozenset[str] = frozenset()
  param: frozenset[str] = frozenset()


def placeholder_shape(leaf: LeafPlan) -> tuple[int, ...]:
  """A held leaf's placeholder: its partitioned layout with the shard dimension of size 0."""
  shape = list(leaf.padded_shape)
  shape[leaf.shard_dim] = 0
  return tuple(shape)


def shrink(plan: Plan, tree: PyTree, paths: frozenset[str]) -> PyTree:
  """``tree`` (params structure) with the leaves of ``paths`` cut to size 0 along their shard
  dimension (placeholders); the others as they are."""
  def cut(leaf, x):
    if leaf.path not in paths or x is None:
      return x
    return lax.slice_in_dim(x, 0, 0, axis=leaf.shard_dim % x.ndim)
  return plan.map(cut, tree)


class DeviceUpdate(Update):
  """The root of the chain: optax on the fp32 master (in fp32 training, on the params themselves)
  in the view its layout says (:mod:`jzero.sharding.opt_layout`: each device's partition inside
  the step's ``shard_map``, or whole arrays outside it), new params by the stage's layout
  (:func:`jzero.comm.layouts.compute_param`: stage 1/2 all-gather, stage 3 casts its partition),
  then ZeRO++ hpZ's secondary partitions refreshed. A skipped step keeps the old master and
  optimizer state by an elementwise select fused into the update (:func:`_skippable_update`), or
  returns them as they are (:meth:`skipped`).

  A frozen leaf (:attr:`jzero.sharding.plan.LeafPlan.frozen`) has no gradient and no master: the
  update sees a zero gradient and its param (upcast) as its master, and its param stays.

  Args:
    plan: the plan.
    tx: the optax transformation.
    opt: its state's layout and view (:class:`jzero.sharding.opt_layout.OptLayout`).
    held: the leaves whose state / param a tier keeps outside the step (placeholders here).
    checks_overflow: the loss scale checks overflow: a skip is a ``lax.cond`` (:attr:`skip_mode`).
  """

  def __init__(self, plan: Plan, tx: optax.GradientTransformation, opt: OptLayout,
               held: Held = Held(), checks_overflow: bool = False):
    super().__init__(None)
    self.plan, self.tx, self.opt, self.held = plan, tx, opt, held
    self.checks_overflow = checks_overflow

  @property
  def skip_mode(self) -> str:
    return "cond" if self.checks_overflow else "select"

  @property
  def output_specs(self) -> dict:
    return {}

  @property
  def output_kinds(self) -> dict:
    return {}

  @property
  def in_step(self) -> bool:
    """The update runs inside the step's ``shard_map`` (the partition view)."""
    return self.opt.view is View.PARTITION

  def init(self, layout: PyTree) -> dict:
    opt = self.opt
    return {"opt_state": opt.state_from_view(self.tx.init(opt.params_to_view(layout)))}

  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    plan = self.plan
    keep = skip
    master = self.masters(state)
    grads = plan.map(lambda l, g, m: jnp.zeros_like(m) if l.frozen else g, grads, master)
    master, compute_from, opt_state = self.apply(grads, state.opt_state, master, keep)
    params = self.per_device(lambda c, p: plan.map(self.new_param, c, p),
                             (plan.state_specs(), plan.param_specs()), plan.param_specs())(
                                 compute_from, state.params)
    secondary = None
    if plan.zeropp.hpz > 1:
      secondary = self.per_device(
          lambda p: plan.map(lambda l, x: layouts.secondary_partition(plan, l, x), p),
          (plan.param_specs(),), plan.secondary_specs())(params)
    params = self.store(params, master)
    master = shrink(plan, master, self.held.state | plan.frozen_paths) if plan.has_master else None
    return state._replace(params=params, master=master, opt_state=opt_state,
                          secondary=secondary), {}

  def skipped(self, state: Any) -> tuple[Any, dict]:
    params, master, opt_state = self.unchanged(state.params, state.master, state.opt_state)
    return state._replace(params=params, master=master, opt_state=opt_state), {}

  def per_device(self, fn: Any, in_specs: Any, out_specs: Any) -> Any:
    """``fn`` (one device's blocks) callable in this update's view
    (:func:`jzero.comm.program.per_device`)."""
    return program.per_device(self.plan, self.in_step, fn, in_specs, out_specs)

  def masters(self, state: Any) -> PyTree:
    """What the optimizer updates, in the state layout: the fp32 master; in fp32 training, and
    for a frozen leaf, the params' (upcast) partitions; a tier's placeholders as they are."""
    plan = self.plan
    if plan.has_master and not plan.frozen_paths:
      return shrink(plan, state.master, self.held.state)
    from_params = self.per_device(
        lambda ps: plan.map(lambda l, p: layouts.local_master(plan, l, p).astype(jnp.float32),
                            ps), (plan.param_specs(),), plan.state_specs())(state.params)
    if plan.has_master:
      from_params = plan.map(lambda l, m, p: p if l.frozen else m, state.master, from_params)
    return shrink(plan, from_params, self.held.state)

  # -- the parts a root that keeps state elsewhere (jzero.tiers.host_optimizer) replaces -------
  def apply(self, grads: PyTree, opt_state: PyTree, master: PyTree,
            keep: jax.Array | None) -> tuple[PyTree, PyTree, PyTree]:
    """(new master where it is stored, the same on the device -- what compute params are cast
    from --, new optimizer state) from the clipped ``grads``, the update run in the layout's
    view; ``keep`` (a traced bool): the old master and state where it is true."""
    opt = self.opt
    grads, view_state, view_master = (opt.params_to_view(grads), opt.state_to_view(opt_state),
                                      opt.params_to_view(master))
    updates, new_state = self.tx.update(grads, view_state, view_master)
    new_master = optax.apply_updates(view_master, updates)
    if keep is not None:
      new_master, new_state = _skippable_update(self.tx, opt, grads, view_state, view_master,
                                                new_master, keep)
    new_master = opt.params_from_view(new_master)
    return new_master, new_master, opt.state_from_view(new_state)

  def unchanged(self, params: PyTree, master: PyTree,
                opt_state: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    """A skipped step's (params, master, opt_state): the state's, placed as :meth:`apply`'s
    results are (a ``lax.cond``'s branches agree on memory spaces)."""
    return params, master, opt_state

  def new_param(self, leaf: LeafPlan, m_device: jax.Array, old: jax.Array) -> jax.Array:
    """A leaf's new param from its new master on the device (one device's blocks); a frozen
    leaf, or one whose state or param a tier holds, keeps the state's (the tier's update makes
    the new one)."""
    if leaf.frozen or leaf.path in self.held.state or leaf.path in self.held.param:
      return old
    return layouts.compute_param(self.plan, leaf, m_device)

  def store(self, params: PyTree, master: PyTree) -> PyTree:
    """The new params, placed where they are stored between steps."""
    return params


def _skippable_update(tx: optax.GradientTransformation, opt: OptLayout, grads: PyTree,
                      opt_state: PyTree, master: PyTree, new_master: PyTree,
                      keep: jax.Array) -> tuple[PyTree, PyTree]:
  """fp32's skip of a non-finite step, updating the state in place: (master, optimizer state),
  the old ones where ``keep`` (a traced bool) is true, else the updated ones (all in the
  update's view).

  A plain elementwise select of old and new state costs a state-sized temporary: the new master
  reads the new moments, the selected moments overwrite the old ones in place, so XLA either keeps
  the new moments beside the old (the select's two consumers) or copies the old ones first --
  +50% of the compiled temp at stage 0, +8% step time on the default job. So the new optimizer
  state is computed a second time, from the old state read *after* the new master exists
  (:func:`jzero.comm.collective_order.identity_after`, per twin of a parameter leaf,
  :meth:`jzero.sharding.opt_layout.OptLayout.map_twins`): XLA then updates the master first,
  reading the old moments, and the moments after it, in place. The values are the same bits as
  one ``tx.update``; the work is two elementwise passes over the moments instead of one. State
  that is not shaped like the parameters (a client optimizer's factored statistics) is selected
  without the ordering."""
  new_master = jax.tree.map(lambda old, new: jnp.where(keep, old, new), master, new_master)
  read_after = lambda x, m: collective_order.identity_after(x, m) if m.size else x  # 0-byte:
  # a placeholder whose state lives outside the step (the NVMe store)
  old_state = opt.map_twins(read_after, opt_state, new_master)
  _, new_state = tx.update(grads, old_state, master)
  return new_master, jax.tree.map(lambda old, new: jnp.where(keep, old, new), old_state, new_state)


class SkipNonFinite(Update):
  """A step whose gradient is not finite (fp16 overflow, a NaN / inf) keeps its state: optax's
  ``apply_if_finite`` with the finiteness given (the step checks it once, for the loss scaler
  and the metrics too). ``skip``: a traced bool -- a ``lax.cond`` over the links below or one
  selecting update, by their :attr:`~jzero.tiers.base.Update.skip_mode` --; a Python bool (the
  delayed update's prime and steady steps) -- the one branch."""

  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    inner = self.inner
    if skip is None or isinstance(skip, bool):
      return inner.skipped(state) if skip else inner.update(grads, state, None, factor)
    if self.skip_mode == "select":
      return inner.update(grads, state, skip, factor)

    def branch(skipped: bool):
      new, outputs = inner.skipped(state) if skipped else inner.update(grads, state, None, factor)
      return (new.params, new.master, new.opt_state, new.secondary), outputs

    (params, master, opt_state, secondary), outputs = lax.cond(
        skip, lambda _: branch(True), lambda _: branch(False), None)
    return state._replace(params=params, master=master, opt_state=opt_state,
                          secondary=secondary), outputs


class ClipByFactor(Update):
  """DeepSpeed's clipping: the gradient times ``factor`` (``min(1, clip / (norm + 1e-6))`` of the
  step's global norm, which the step computes from the partitions) before the links below."""

  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    if factor is not None:
      grads = jax.tree.map(lambda g: g * factor, grads)
    return self.inner.update(grads, state, skip, None)
