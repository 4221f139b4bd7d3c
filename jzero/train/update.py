"""The update phase of one step (:func:`local_update`), on one device's blocks inside the step's
``shard_map``: reduced gradients -> new state and metrics.

1. fp16: any inf/nan anywhere -> skip the step and let the loss scaler back off (DeepSpeed's
   dynamic loss scaling; bf16 with ``check_grad_overflow``); fp32: a global norm that is not finite
   (a NaN row, a loss that divides by zero) skips the step too (not with the delayed update, whose
   steady step always applies: the engine warns).
2. Gradients are unscaled and the true global norm is computed from the partitions (a ``psum`` of
   partial sums of squares); DeepSpeed's clipping factor is ``min(1, clip / (norm + 1e-6))``.
3. The step's update chain (``parts.update``, :mod:`jzero.tiers.base`) runs with the gradient,
   the state, whether to skip and the clipping factor: the tiers' links that take leaves out of
   the step, the clipping, the delayed update, the non-finite skip (a ``lax.cond`` or a fused
   select, one mode), the host's or the device's optax update on each device's partition of the
   fp32 master and the stage's gathers back to compute params
   (:func:`jzero.comm.layouts.compute_param`; with ZeRO++'s hpZ, then each device's secondary
   partition).

The update names no tier: the chain is composed by :func:`jzero.tiers.registry.update`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jzero.comm.zero_param import SlotTarget, is_slot
from jzero.train import aux_metrics
from jzero.train.precision import has_overflow
from jzero.train.state import TrainState

if TYPE_CHECKING:  # annotations only (step imports this module)
  from jzero.train.step import StepParts

__all__ = ["local_update", "reduce_grads", "apply_update", "applied_updates", "global_norm"]

PyTree = Any


def local_update(parts: StepParts, state: TrainState, grads: PyTree, loss: jax.Array,
                 aux: dict):
  """The whole update phase on one device's blocks (the partition view): :func:`reduce_grads`
  then :func:`apply_update` -> (state, metrics, outputs)."""
  grads, grad_norm, overflow = reduce_grads(parts, state, grads)
  return apply_update(parts, state, grads, grad_norm, overflow, loss, aux)


def reduce_grads(parts: StepParts, state: TrainState,
                 grads: PyTree) -> tuple[PyTree, jax.Array, jax.Array]:
  """On one device's blocks: the overflow check, the unscaled gradients and their global norm
  -> (gradients, norm, overflow). A frozen leaf's gradient is None."""
  plan, settings, delayed = parts.plan, parts.settings, parts.delayed
  axes = plan.mesh
  scale = state.loss_scale.scale
  checks = settings.checks_overflow
  # a tier's slot (SlotTarget: the gradient in host memory) brings its sum of squares, unscaled
  # here; its gradient is unscaled where it is updated
  on_device = [g for g in jax.tree.leaves(grads, is_leaf=is_slot) if not is_slot(g)]
  if checks:
    norms = [g.norm for g in jax.tree.leaves(grads, is_leaf=is_slot) if is_slot(g)]
    found = has_overflow(on_device) | has_overflow(norms)
    overflow = lax.psum(found.astype(jnp.int32), axes.zero_axes) > 0
  grads = jax.tree.map(lambda g: dataclasses.replace(g, norm=g.norm / scale ** 2) if is_slot(g)
                       else g / scale, grads, is_leaf=is_slot)
  grad_norm = global_norm(parts, grads)
  if settings.precision == "fp32" and (delayed is None or delayed.checks_finite(state.delayed)):
    overflow = jnp.logical_not(jnp.isfinite(grad_norm))  # a NaN or inf anywhere: norm not finite
  elif not checks:  # bf16 without check_grad_overflow; the delayed update's steady step
    overflow = jnp.zeros((), bool)
  return grads, grad_norm, overflow


def apply_update(parts: StepParts, state: TrainState, grads: PyTree, grad_norm: jax.Array,
                 overflow: jax.Array, loss: jax.Array, aux: dict):
  """The clipping factor, the update chain and the state's counters -> (state, metrics,
  outputs): ``outputs`` is what the update hands out of the jit for work after it, by name
  (``{}`` when nothing is). In the partition view on one device's blocks; in the whole view on
  global arrays (:mod:`jzero.sharding.opt_layout`). The step's variant (the delayed update's) is
  in ``state``."""
  settings, update, delayed = parts.settings, parts.update, parts.delayed
  scale = state.loss_scale.scale
  clip = settings.gradient_clipping
  factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None
  new_state, outputs = update.update(grads, state, overflow, factor)

  applied = applied_updates(state.step, state.skipped, delayed, state.delayed)
  skipped = state.skipped + overflow.astype(jnp.int32)
  metrics = aux_metrics.into_metrics({
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": _learning_rate(parts, applied, new_state.opt_state),
      "loss_scale": scale,
      "overflow": overflow,
      "skipped": skipped,
      "min_scale_overflow": parts.scaler.at_min_scale_overflow(state.loss_scale, overflow),
  }, aux)
  new_state = new_state._replace(
      step=state.step + 1, skipped=skipped,
      loss_scale=parts.scaler.update(state.loss_scale, overflow))
  return new_state, metrics, outputs


def applied_updates(step: Any, skipped: Any, delayed: Any = None, carried: Any = None) -> Any:
  """The updates applied before a state's next step: the lr schedule's count (optax's update
  count; DeepSpeed's ``lr_scheduler.step()`` calls). A state's steps less those skipped, less the
  gradient the delayed update (``delayed``) still carries (``carried``: the state's ``delayed``, or
  its ``ready`` flag). The state's counters are device arrays in the step, numpy on the host (the lr
  the next step uses, :meth:`jzero.train.reporting.StepReporter.next_lr`)."""
  applied = step - skipped
  if delayed is None:
    return applied
  return delayed.applied_steps(getattr(carried, "ready", carried), applied)


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
  zero = jnp.zeros((), jnp.float32)

  def squares(g):
    if g is None:  # a frozen leaf
      return zero
    if isinstance(g, SlotTarget):  # a tier's slot: the sum of squares of its partition
      return jnp.sum(g.norm)
    return jnp.sum(jnp.square(g))
  sums = plan.map(lambda l, g: (squares(g), l.state_partitioned), grads)
  flat = jax.tree.leaves(sums, is_leaf=lambda x: isinstance(x, tuple))
  partitioned = sum((s for s, split in flat if split), jnp.zeros((), jnp.float32))
  replicated = sum((s for s, split in flat if not split), jnp.zeros((), jnp.float32))
  return jnp.sqrt(lax.psum(partitioned, plan.mesh.zero_axes) + replicated)
