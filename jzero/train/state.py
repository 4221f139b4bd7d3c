"""The train state: :class:`TrainState`, everything one optimizer step reads and writes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from jzero.train.precision import LossScaleState

if TYPE_CHECKING:  # annotations only: the carrying tier defines the carried state
  from jzero.tiers.delayed import DelayedGrads

__all__ = ["TrainState"]

PyTree = Any


class TrainState(NamedTuple):
  """Everything one optimizer step reads and writes, laid out by the plan.

  Attributes:
    step: optimizer steps taken (DeepSpeed's ``global_steps``; skipped fp16 steps included).
    skipped: steps skipped because the gradient was not finite (fp16 overflow, or a NaN / inf).
    params: compute params (compute dtype) in the plan's param layout.
    master: fp32 master params in the plan's state layout; None in fp32 training.
    opt_state: the optax state, param-like leaves in the state layout.
    loss_scale: the loss scaler's state.
    rng: raw key data of the training PRNG key (``jax.random.key_data``).
    secondary: ZeRO++ hpZ: each device's secondary partition of the stage-3 params (compute
      dtype, split over the node's local axes; see :mod:`jzero.comm.zeropp`); None without hpZ. A
      function of ``params``: recomputed at init and restore, never saved.
    delayed: ZeRO-Offload's delayed parameter update: the gradient this step computed, carried
      to the next step, which updates with it (:class:`jzero.tiers.delayed.DelayedGrads`); None
      without ``offload_optimizer.delayed_update``.
  """

  step: jax.Array
  skipped: jax.Array
  params: PyTree
  master: PyTree | None
  opt_state: PyTree
  loss_scale: LossScaleState
  rng: jax.Array
  secondary: PyTree | None = None
  delayed: DelayedGrads | None = None
