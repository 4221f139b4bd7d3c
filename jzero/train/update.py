"""The update phase of one step (:func:`local_update`), on one device's blocks inside the step's
``shard_map``: reduced gradients -> new state and metrics.

1. fp16: any inf/nan anywhere -> skip the step and let the loss scaler back off (DeepSpeed's
   dynamic loss scaling; bf16 with ``check_grad_overflow``); fp32: a global norm that is not finite
   (a NaN row, a loss that divides by zero) skips the step too -- an elementwise select of the old
   state fused into the update (:func:`_skippable_update`), where fp16's ``lax.cond`` would hold a
   second copy of the state (a cond still with host-memory state streamed through the device; the
   host update selects inside its host computation instead, since XLA's GPU compiler rejects a
   host computation inside a conditional -- :attr:`jzero.tiers.base.Update.skip_by`; not with the
   delayed update, whose steady step always applies: the engine warns).
2. Gradients are unscaled, the true global norm is computed from the partitions (a ``psum`` of
   partial sums of squares) and the gradient clipped DeepSpeed's way: ``g *= min(1, clip / (norm +
   1e-6))``.
3. The optax update runs on each device's partition of the fp32 master (or, in fp32, of the params
   themselves); stage 1/2 all-gather the updated partitions into new replicated compute params,
   stage 3 just casts its partition (:func:`jzero.comm.layouts.compute_param`; with ZeRO++'s hpZ,
   then refreshes each device's secondary partition).

**Tiers.** The update names no tier. How the optimizer update runs is one protocol,
:class:`jzero.tiers.base.Update`: :class:`DeviceUpdate` here, wrapped by the active tiers (the host
tier's update of what lives in host memory, the NVMe leaves' gradients handed out of the jit for
the store's update); the step holds the composed one (``parts.update``). The delayed update's
gradient swap is :class:`jzero.tiers.delayed.DelayedUpdate`'s (``parts.delayed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jzero.comm import collective_order, layouts
from jzero.sharding.plan import LeafPlan, Plan
from jzero.tiers.base import Update
from jzero.train.precision import has_overflow
from jzero.train.state import TrainState

if TYPE_CHECKING:  # annotations only (step imports this module)
  from jzero.train.step import StepParts

__all__ = ["DeviceUpdate", "local_update", "applied_updates", "global_norm"]

PyTree = Any


class DeviceUpdate(Update):
  """The update on the device, the root the tiers' updates wrap (:class:`jzero.tiers.base.
  Update`): optax on each device's partition of the master; a skipped step keeps the old
  partition and optimizer state by an elementwise select fused into the update
  (:func:`_skippable_update`); new params by the stage's layout
  (:func:`jzero.comm.layouts.compute_param`)."""

  def __init__(self, plan: Plan, tx: optax.GradientTransformation):
    super().__init__(None)
    self.plan, self.tx = plan, tx

  @property
  def skip_by(self) -> str | None:
    return None

  def hand_out(self, state: Any, grads: PyTree, factor: jax.Array | None) -> tuple[PyTree, dict]:
    return grads, {}

  def output_specs(self) -> dict:
    return {}

  def apply(self, grads: PyTree, opt_state: PyTree, master: PyTree,
            keep: jax.Array | None = None) -> tuple[PyTree, PyTree, PyTree]:
    updates, new_state = self.tx.update(grads, opt_state, master)
    new_master = optax.apply_updates(master, updates)
    if keep is not None:
      new_master, new_state = _skippable_update(self.tx, grads, opt_state, master, new_master,
                                                keep)
    return new_master, new_master, new_state

  def skipped(self, params: PyTree, master: PyTree,
              opt_state: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    return params, master, opt_state

  def new_param(self, leaf: LeafPlan, m_device: jax.Array, m: jax.Array,
                old: jax.Array) -> jax.Array:
    return layouts.compute_param(self.plan, leaf, m_device)

  def store_params(self, params: PyTree, master: PyTree) -> PyTree:
    return params

  def after_step(self, state: Any, metrics: dict, outputs: dict) -> Any:
    return state


def local_update(parts: StepParts, state: TrainState, grads: PyTree, loss: jax.Array, aux: dict,
                 variants: dict | None = None):
  """Overflow check, unscale, clip by the global norm, optimizer update -> (state, metrics,
  outputs): ``outputs`` is what the update hands out of the jit for work after it, by name
  (``{}`` when nothing is). ``variants``: the step's variant (the delayed update's, by its
  name)."""
  plan, settings, update, delayed = parts.plan, parts.settings, parts.update, parts.delayed
  axes = plan.mesh
  variant = (variants or {}).get(delayed.name) if delayed is not None else None
  scale = state.loss_scale.scale
  checks = settings.checks_overflow
  if checks:
    overflow = lax.psum(has_overflow(grads).astype(jnp.int32), axes.zero_axes) > 0
  grads = jax.tree.map(lambda g: g / scale, grads)
  grad_norm = global_norm(parts, grads)
  if settings.precision == "fp32" and (delayed is None or delayed.checks_finite(variant)):
    overflow = jnp.logical_not(jnp.isfinite(grad_norm))  # a NaN or inf anywhere: norm not finite
  elif not checks:  # bf16 without check_grad_overflow; the delayed update's steady step
    overflow = jnp.zeros((), bool)
  clip = settings.gradient_clipping
  factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None
  # what leaves the jit for work after it (the NVMe store's update)
  grads, outputs = update.hand_out(state, grads, factor)
  if factor is not None:
    grads = jax.tree.map(lambda g: g * factor, grads)
  skip_update, carried = overflow, None
  if delayed is not None:  # apply the carried g_{t-1}, carry g_t
    grads, skip_update, carried = delayed.update(state.delayed, grads, overflow, variant)

  def apply_update(_, keep: jax.Array | None = None):
    """The update; with ``keep`` (a traced bool, device-memory state only) the old partition and
    optimizer state are selected elementwise where it is true, before any gather."""
    master = (state.master if plan.has_master
              else plan.map(lambda l, p: layouts.local_master(plan, l, p), state.params))
    master, compute_from, opt_state = update.apply(grads, state.opt_state, master, keep)
    params = plan.map(update.new_param, compute_from, master, state.params)
    secondary = (plan.map(lambda l, p: layouts.secondary_partition(plan, l, p), params)
                 if plan.zeropp.hpz > 1 else None)
    params = update.store_params(params, master)
    return params, (master if plan.has_master else None), opt_state, secondary

  def skip(_):  # typed like apply_update's results
    return (*update.skipped(state.params, state.master, state.opt_state), state.secondary)

  if isinstance(skip_update, bool):
    params, master, opt_state, secondary = (skip if skip_update else apply_update)(None)
  elif update.skip_by == "cond" or (checks and update.skip_by is None):
    params, master, opt_state, secondary = lax.cond(skip_update, skip, apply_update, None)
  else:  # an elementwise select fuses into the update: no second copy of the state (a cond's)
    params, master, opt_state, secondary = apply_update(None, keep=skip_update)

  applied = applied_updates(state.step, state.skipped, delayed, state.delayed)
  skipped = state.skipped + overflow.astype(jnp.int32)
  metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": _learning_rate(parts, applied, opt_state),
      "loss_scale": scale,
      "overflow": overflow,
      "skipped": skipped,
      "min_scale_overflow": parts.scaler.at_min_scale_overflow(state.loss_scale, overflow),
      **aux,
  }
  new_state = TrainState(
      step=state.step + 1, skipped=skipped, params=params, master=master, opt_state=opt_state,
      loss_scale=parts.scaler.update(state.loss_scale, overflow), rng=state.rng,
      secondary=secondary, delayed=carried)
  return new_state, metrics, outputs


def _skippable_update(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree,
                      master: PyTree, new_master: PyTree, keep: jax.Array) -> tuple[PyTree, PyTree]:
  """fp32's skip of a non-finite step, updating the state in place: (master, optimizer state),
  the old ones where ``keep`` (a traced bool) is true, else the updated ones.

  A plain elementwise select of old and new state costs a state-sized temporary: the new master
  reads the new moments, the selected moments overwrite the old ones in place, so XLA either keeps
  the new moments beside the old (the select's two consumers) or copies the old ones first --
  +50% of the compiled temp at stage 0, +8% step time on the default job. So the new optimizer
  state is computed a second time, from the old state read *after* the new master exists
  (:func:`jzero.comm.collective_order.identity_after`, per parameter leaf): XLA then updates the
  master first, reading the old moments, and the moments after it, in place. The values are the
  same bits as one ``tx.update``; the work is two elementwise passes over the moments instead of
  one. State that is not shaped like the parameters (a client optimizer's factored statistics) is
  selected without the ordering."""
  new_master = jax.tree.map(lambda old, new: jnp.where(keep, old, new), master, new_master)
  read_after = lambda x, m: collective_order.identity_after(x, m) if m.size else x  # 0-byte:
  # a placeholder whose state lives outside the step (the NVMe store)
  old_state = optax.tree_utils.tree_map_params(tx, read_after, opt_state, new_master,
                                               transform_non_params=lambda x: x)
  _, new_state = tx.update(grads, old_state, master)
  return new_master, jax.tree.map(lambda old, new: jnp.where(keep, old, new), old_state, new_state)


def applied_updates(step: Any, skipped: Any, delayed: Any = None, carried: Any = None) -> Any:
  """The updates applied before a state's next step: the lr schedule's count (optax's update
  count; DeepSpeed's ``lr_scheduler.step()`` calls). A state's steps less those skipped, less the
  gradient the delayed update (``delayed``) still carries (``carried``, the state's ``delayed``).
  The state's counters are device arrays in the step, numpy on the host (the lr the next step
  uses, :meth:`jzero.train.reporting.StepReporter.next_lr`)."""
  applied = step - skipped
  return applied if delayed is None else delayed.applied_steps(carried, applied)


def _learning_rate(parts: StepParts, applied: jax.Array, opt_state: PyTree) -> jax.Array:
  """The lr of this step: the config's schedule, or a client optimizer's ``learning_rate``
  hyperparameter (``optax.inject_hyperparams``); NaN where it cannot be read."""
  if parts.schedule is not None:
    return parts.schedule(applied)
  try:
    lr = optax.tree_utils.tree_get(opt_state, "learning_rate",
                                   filtering=lambda _, value: isinstance(value, jax.Array))
  except KeyError:  # several optimizers with a learning rate
    lr = None
  return jnp.nan if lr is None else jnp.asarray(lr, jnp.float32)


def global_norm(parts: StepParts, grads: PyTree) -> jax.Array:
  """L2 norm of the full gradient, from partitions: psum of the partitioned partial sums."""
  plan = parts.plan
  sums = plan.map(lambda l, g: (jnp.sum(jnp.square(g)), l.state_partitioned), grads)
  flat = jax.tree.leaves(sums, is_leaf=lambda x: isinstance(x, tuple))
  partitioned = sum((s for s, split in flat if split), jnp.zeros((), jnp.float32))
  replicated = sum((s for s, split in flat if not split), jnp.zeros((), jnp.float32))
  return jnp.sqrt(lax.psum(partitioned, plan.mesh.zero_axes) + replicated)
