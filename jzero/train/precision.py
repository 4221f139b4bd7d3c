"""DeepSpeed's fp16 loss scaling as a jittable state machine.

DeepSpeed keeps the loss scale in a Python object (``deepspeed/runtime/fp16/loss_scaler.py``) that
the ZeRO optimizer updates after every step on the host. jzero splits it in two: a frozen
:class:`LossScaler` holding the configuration (static under ``jit``) and a :class:`LossScaleState`
of jnp scalars that lives in the train state, so the update runs inside the jitted step and is
checkpointed and restored like any other array.

:meth:`LossScaler.update` is ``DynamicLossScaler.update_scale`` exactly:

* overflow: the step is skipped (by the engine); if ``hysteresis == 1`` or the current hysteresis is
  down to 1, ``scale = max(scale / 2, min_scale)``, otherwise the current hysteresis drops by one;
  either way ``last_overflow_iter = cur_iter``.
* no overflow: with ``consecutive_hysteresis`` the hysteresis is refilled; then with ``stable =
  cur_iter - last_overflow_iter - 1``, if ``stable > 0 and stable % scale_window == 0`` the scale
  doubles and the hysteresis is refilled. So the scale doubles on the ``scale_window + 1``-th clean
  step after an overflow (or after the start), and every ``scale_window`` clean steps after that.
* ``cur_iter += 1`` on every step.

One deviation: the scale stops growing at ``2**127``, float32's largest power of two. DeepSpeed's
float64 scale would reach ``2**128``, overflow every float32 loss on the next step and halve back;
a float32 scale would become inf, and inf never halves back.

The static scaler (``fp16.loss_scale > 0``, and 1.0 for fp32/bf16) is DeepSpeed's ``LossScaler``
whose ``update_scale`` does nothing, not even count: :meth:`LossScaler.update` returns the state
unchanged. Skipping a step with inf/nan gradients is the engine's decision (from
:func:`has_overflow`) for static and dynamic scaling alike, as in DeepSpeed's ZeRO optimizer.

Overflow at the minimum scale: ZeRO stages 1-3 build their scaler with ``CreateLossScaler``, which
never passes ``raise_error_at_min_scale``, so its default ``True`` applies: an overflow that would
halve a scale already equal to ``min_loss_scale`` raises ``Exception("Current loss scale already at
minimum - cannot decrease scale anymore. Exiting run.")`` from ``optimizer.step()`` and ends the
run (the non-ZeRO ``FP16_Optimizer`` instead keeps the scale at the floor silently). A jitted step
cannot raise, so :meth:`LossScaler.at_min_scale_overflow` reports that condition as a bool array;
the training loop raises :data:`MIN_SCALE_ERROR` when it is true.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jzero.errors import ConfigError

__all__ = ["MIN_SCALE_ERROR", "LossScaleState", "LossScaler", "has_overflow"]

MIN_SCALE_ERROR = (
  "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
_MAX_SCALE = 2.0**127  # the largest power of two in float32


class LossScaleState(NamedTuple):
  """The loss scaler's mutable state, as jnp scalars (a pytree that goes through ``jit``)."""

  scale: jax.Array  # float32
  cur_iter: jax.Array  # int32: steps seen so far
  last_overflow_iter: jax.Array  # int32: -1 before the first overflow
  cur_hysteresis: jax.Array  # int32: overflows still tolerated before the scale drops


@dataclasses.dataclass(frozen=True)
class LossScaler:
  """The loss-scaling configuration; its methods are pure functions of a :class:`LossScaleState`."""

  dynamic: bool
  init_scale: float
  scale_window: int
  hysteresis: int
  consecutive_hysteresis: bool
  min_scale: float
  scale_factor: float = 2.0

  @classmethod
  def from_config(
    cls,
    *,
    loss_scale: float,
    initial_scale_power: int,
    loss_scale_window: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_loss_scale: float,
  ) -> LossScaler:
    """The scaler of DeepSpeed's ``fp16`` block: static if ``loss_scale > 0``, dynamic if 0."""
    if not _finite_number(loss_scale) or loss_scale < 0:
      raise ConfigError(
        f"fp16.loss_scale: must be a finite number >= 0, got {loss_scale!r}; use 0 for dynamic "
        f"loss scaling or a positive static scale."
      )
    if loss_scale > 0:
      return cls(False, float(loss_scale), loss_scale_window, hysteresis, consecutive_hysteresis,
                 float(min_loss_scale))
    for key, value in (("loss_scale_window", loss_scale_window), ("hysteresis", hysteresis)):
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"fp16.{key}: must be a positive integer, got {value!r}; set one.")
    if not _finite_number(min_loss_scale) or min_loss_scale <= 0:
      raise ConfigError(
        f"fp16.min_loss_scale: must be a positive number, got {min_loss_scale!r}; set one (e.g. 1)."
      )
    if isinstance(initial_scale_power, bool) or not isinstance(initial_scale_power, int) or not (
        -126 <= initial_scale_power <= 127):
      raise ConfigError(
        f"fp16.initial_scale_power: must be an integer in [-126, 127] so that the scale "
        f"2**power is a float32, got {initial_scale_power!r}; the default is 16."
      )
    return cls(True, 2.0**initial_scale_power, loss_scale_window, hysteresis,
               bool(consecutive_hysteresis), float(min_loss_scale))

  @classmethod
  def disabled(cls) -> LossScaler:
    """The static scale 1.0 DeepSpeed uses for fp32 and bf16 training."""
    return cls(False, 1.0, 1000, 1, False, 1.0)

  def init(self) -> LossScaleState:
    """The state before the first step."""
    return LossScaleState(
      scale=jnp.asarray(self.init_scale, jnp.float32),
      cur_iter=jnp.asarray(0, jnp.int32),
      last_overflow_iter=jnp.asarray(-1, jnp.int32),
      cur_hysteresis=jnp.asarray(self.hysteresis, jnp.int32),
    )

  def update(self, state: LossScaleState, overflow: jax.Array) -> LossScaleState:
    """The state after a step whose gradients did (``overflow``) or did not overflow; jittable."""
    if not self.dynamic:
      return state
    overflow = jnp.asarray(overflow, bool)
    halve = self._halves(state)
    stable = state.cur_iter - state.last_overflow_iter - 1
    grow = (stable > 0) & (stable % self.scale_window == 0)
    refill = grow | self.consecutive_hysteresis
    return LossScaleState(
      scale=jnp.where(
        overflow,
        jnp.where(halve, jnp.maximum(state.scale / self.scale_factor, self.min_scale), state.scale),
        jnp.where(grow, jnp.minimum(state.scale * self.scale_factor, _MAX_SCALE), state.scale),
      ),
      cur_iter=state.cur_iter + 1,
      last_overflow_iter=jnp.where(overflow, state.cur_iter, state.last_overflow_iter),
      cur_hysteresis=jnp.where(
        overflow,
        jnp.where(halve, state.cur_hysteresis, state.cur_hysteresis - 1),
        jnp.where(refill, self.hysteresis, state.cur_hysteresis),
      ),
    )

  def at_min_scale_overflow(self, state: LossScaleState, overflow: jax.Array) -> jax.Array:
    """Whether DeepSpeed's ZeRO optimizer would raise :data:`MIN_SCALE_ERROR` on this step.

    Args:
      state: the state before the step (the one passed to :meth:`update`).
      overflow: whether the step's gradients overflowed.

    Returns:
      A bool array: the step overflowed, would halve the scale, and the scale is already at
      ``min_scale``. DeepSpeed raises before changing any state; the training loop should raise.
    """
    if not self.dynamic:
      return jnp.asarray(False)
    at_min = state.scale == jnp.asarray(self.min_scale, jnp.float32)
    return jnp.asarray(overflow, bool) & self._halves(state) & at_min

  def _halves(self, state: LossScaleState) -> jax.Array:
    """Whether an overflow now lowers the scale (rather than the hysteresis)."""
    return (state.cur_hysteresis == 1) | (self.hysteresis == 1)


def has_overflow(tree: Any) -> jax.Array:
  """Whether any leaf of ``tree`` holds an inf or nan, as a bool scalar (jittable, shard-aware)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(False)
  return ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def _finite_number(value: object) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
