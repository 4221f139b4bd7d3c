"""The train state: :class:`TrainState`, everything one optimizer step reads and writes, and where
the plan puts each of its leaves (:func:`state_specs`, :func:`state_memory_kinds`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.plan import Plan
from jzero.train.precision import LossScaleState

if TYPE_CHECKING:  # annotations only: the delayed update defines the carried state
  from jzero.tiers.delayed import DelayedGrads, DelayedUpdate, Variant

__all__ = ["TrainState", "logical_params", "state_memory_kinds", "state_specs"]

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
    model_state: the model's state besides its parameters -- BatchNorm's running statistics --
      as ``{collection: tree}``, Linen's layout (``{"batch_stats": {...}}``; NNX variables by
      their Linen collection name; ``{}`` for a model with none), replicated, in the model's own
      dtypes (:mod:`jzero.modeling.model_state`). Each micro-batch's forward pass updates it.
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
  model_state: dict[str, PyTree]
  secondary: PyTree | None = None
  delayed: DelayedGrads | None = None


def state_specs(plan: Plan, opt: OptLayout, delayed: DelayedUpdate | None = None,
                variant: Variant | None = None) -> TrainState:
  """PartitionSpecs of every TrainState leaf (prefix tree); ``opt``: the optimizer state's layout;
  ``delayed``: the delayed update, whose
  carried state the TrainState holds (``delayed``), for the step of ``variant`` (None: a state no
  step variant is written into yet)."""
  return TrainState(step=P(), skipped=P(), params=plan.param_specs(),
                    master=plan.state_specs() if plan.has_master else None,
                    opt_state=opt.specs(), loss_scale=P(), rng=P(), model_state=P(),
                    secondary=plan.secondary_specs(),
                    delayed=_delayed(delayed.specs, variant, plan) if delayed else None)


def state_memory_kinds(plan: Plan, opt: OptLayout, delayed: DelayedUpdate | None = None,
                       variant: Variant | None = None) -> TrainState:
  """Memory kind of every TrainState leaf (prefix tree; None: JAX's default, the device). A leaf's
  master and optimizer state, and its stored param, are in the memory kinds the plan records
  (host memory under ZeRO-Offload: :mod:`jzero.tiers.host_optimizer`,
  :mod:`jzero.tiers.host_params`)."""
  device = plan.memory_kind()
  if device is None:  # every leaf on the device
    return jax.tree.map(lambda _: device, state_specs(plan, opt, delayed, variant),
                        is_leaf=lambda x: isinstance(x, P))
  return TrainState(step=device, skipped=device, params=plan.map(plan.param_memory_kind),
                    master=plan.map(plan.state_memory_kind) if plan.has_master else None,
                    opt_state=opt.memory_kinds(), loss_scale=device, rng=device,
                    model_state=device,
                    secondary=jax.tree.map(lambda _: device, plan.secondary_specs(),
                                           is_leaf=lambda x: isinstance(x, P)),
                    delayed=(_delayed(delayed.memory_kinds, variant, plan, device) if delayed
                             else None))


def _delayed(make: Any, variant: Variant | None, *args: Any) -> DelayedGrads:
  """The delayed update's ``make(*args)`` (specs or memory kinds) for ``variant`` (None: its
  default)."""
  return make(*args) if variant is None else make(*args, variant=variant)


def logical_params(plan: Plan, full_state: TrainState, dtype: Any = jnp.float32) -> PyTree:
  """Parameters in the model's own shapes (padding removed), replicated, in ``dtype``, from a
  state with every array in it (:meth:`jzero.Engine.full_state`): the fp32 master in mixed
  precision (a frozen leaf's param), the params themselves in fp32. Host-memory arrays (offload) are read on the device:
  a copy of the partitions, then gathered."""
  source = full_state.params
  if plan.has_master:  # a frozen leaf has no master: its param
    source = plan.map(lambda l, m, p: p if l.frozen else m, full_state.master, source)
  source = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
                        if x.sharding.memory_kind not in (None, "device") else x, source)
  unpad = lambda leaf, x: leaf.to_logical(x).astype(dtype)
  return jax.jit(lambda s: plan.map(unpad, s), out_shardings=plan.sharding(P()))(source)
