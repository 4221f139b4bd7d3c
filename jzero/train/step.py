"""One ZeRO train step on one device's blocks: what the model sees (:func:`bind`), forward,
backward and the gradients' reduction (:func:`local_grads`). :mod:`jzero.train.programs` jits it
(``jit(shard_map(...))``, :func:`jzero.train.programs.build_step`).

What the step reads is explicit: :class:`StepParts` -- the plan, the model adapter, the loss, the
optax transformation, its state's layout and schedule, the loss scaler, the active tiers and what
they own at run time (:data:`jzero.tiers.base.Resources`), the update chain they compose, the
delayed update and the config's numbers (:class:`StepSettings`). The step is a function of its
state and batch: the delayed update's variant is in the state
(:class:`jzero.tiers.delayed.DelayedGrads`).

1. For each micro-batch (``lax.scan`` over ``gradient_accumulation_steps``): forward and backward
   on the device's slice of the batch (:func:`local_grads`). Stage-3 partitioned params are
   gathered by a collective whose backward reduce-scatters (stacked layers: one layer at a time
   inside :func:`jzero.scan_layers`); stage-2 gradients are reduce-scattered into the partitioned
   accumulator after every micro-batch; stage 0/1 accumulate the full local gradient. A tier that
   keeps a partition elsewhere (host memory, NVMe) hands it to the gather as a
   :class:`~jzero.comm.zero_param.PartitionSource`, and its gradient lands in a device slot.
2. Stage 0 all-reduces the accumulated gradient, stage 1 reduce-scatters it.
3. The update phase (:mod:`jzero.train.update`): overflow / non-finite skip, unscale, the global
   norm from partitions, DeepSpeed's clipping, the optax update in its view, the stage's gathers
   back to compute params, the tiers' hooks.

A frozen leaf (:attr:`jzero.sharding.plan.LeafPlan.frozen`) is handed to the model as a constant:
no gradient of it is computed or reduced.

The loss of a micro-batch is each device's mean over its slice, divided by the data-parallel size
and by ``gradient_accumulation_steps`` before the backward pass, so the summed gradient is the
gradient of the global mean loss -- the same number a single device computes on the whole batch.

The model's state besides its parameters (``TrainState.model_state``: BatchNorm's statistics) goes
into each micro-batch's forward pass and what that pass leaves comes out of it: the accumulation
scan carries it from micro-batch to micro-batch, and the step's new state holds what the last one
left. Inside the step every BatchNorm averages its statistics over the data axes, so they are the
global micro-batch's (:mod:`jzero.modeling.model_state`). A model with no such state carries
``{}``: its program is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jzero.comm import collectives
from jzero.comm.zero_param import SlotTarget, ZeroParam, is_slot, one_pass
from jzero.errors import JZeroWarning
from jzero.modeling.layer_scan import LayerPolicy, engine_context
from jzero.modeling.model_adapter import ModelAdapter
from jzero.modeling.model_state import explain_unbound_axis
from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.plan import LeafPlan, Plan
from jzero.tiers.base import AfterStep, Resources, Tier, Update
from jzero.tiers.delayed import DelayedUpdate
from jzero.train import aux_metrics
from jzero.train.precision import LossScaler
from jzero.train.state import TrainState

__all__ = ["StepParts", "StepSettings", "bind", "grad_targets", "local_grads", "takes_rng",
           "trace_loss"]

PyTree = Any


def takes_rng(loss_fn: Callable[..., Any]) -> bool:
  """Whether a loss has an ``rng`` parameter: a per-device, per-micro-batch key in training,
  ``None`` in evaluation."""
  return "rng" in inspect.signature(loss_fn).parameters


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """The config's numbers one step reads (:meth:`from_config`)."""

  gas: int
  micro_batch_size: int
  precision: str
  checks_overflow: bool
  gradient_clipping: float
  mean_over_replicas: bool  # gradient_allreduce_op "mean": divide by the data-parallel size
  layer_policy: LayerPolicy

  @classmethod
  def from_config(cls, config: Any, prefetch: bool = False) -> StepSettings:
    """The step's numbers of ``config``; ``prefetch``: the plan's
    (:attr:`jzero.sharding.plan.Plan.prefetch`)."""
    checkpointing = config.activation_checkpointing
    policy = LayerPolicy(checkpoint_activations=checkpointing is not None, prefetch=prefetch,
                         offload_inputs=checkpointing is not None
                         and bool(checkpointing.cpu_checkpointing))
    return cls(gas=config.gradient_accumulation_steps,
               micro_batch_size=config.train_micro_batch_size_per_gpu,
               precision=config.precision, checks_overflow=config.checks_overflow,
               gradient_clipping=config.gradient_clipping,
               mean_over_replicas=config.gradient_allreduce_op == "mean", layer_policy=policy)


@dataclasses.dataclass(frozen=True)
class StepParts:
  """Everything a step computes with. ``tiers``: the active tiers (classes), whose forward-pass
  hooks the step calls with their ``resources``; ``opt``: the optimizer state's layout and the
  view its update runs in (:class:`jzero.sharding.opt_layout.OptLayout`); ``update``: the update
  chain (:func:`jzero.tiers.registry.update`); ``after_step``: the host's work after the jitted
  step, in order (:func:`jzero.tiers.registry.after_step`); ``delayed``: the delayed parameter
  update, or None."""

  def run_after_step(self, state: Any, metrics: dict, outputs: dict) -> Any:
    """The :attr:`after_step` hooks, one after another, on the state the jitted step returned."""
    for hook in self.after_step:
      state = hook(state, metrics, outputs)
    return state

  plan: Plan
  model: ModelAdapter
  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  opt: OptLayout
  schedule: Callable[[jax.Array], jax.Array] | None
  scaler: LossScaler
  tiers: tuple[type[Tier], ...]
  resources: Resources
  update: Update
  after_step: tuple[AfterStep, ...]
  delayed: DelayedUpdate | None
  settings: StepSettings

  @property
  def loss_takes_rng(self) -> bool:
    return takes_rng(self.loss_fn)

  def call_loss(self, model: Any, batch: PyTree, rng: jax.Array | None) -> Any:
    try:
      if self.loss_takes_rng:
        return self.loss_fn(model, batch, rng=rng)
      return self.loss_fn(model, batch)
    except NameError as e:  # a collective over an axis name the mesh does not have
      explained = explain_unbound_axis(e, self.plan.mesh.batch_axes)
      if explained is None:
        raise
      raise explained from None


# -- what the model sees ---------------------------------------------------------------------------
def grad_targets(parts: StepParts, params: PyTree) -> PyTree:
  """What the step differentiates, per leaf: what a tier holding the leaf's param says (a zero
  gradient slot on the device for a partition in host memory or on NVMe,
  :meth:`jzero.tiers.base.Tier.grad_target`); a stage-3 partition itself; a zero gradient slot of
  the partition's shape (communication dtype) for a replicated parameter whose gradient is
  partitioned (stage 2, stage-3 persistent); the parameter itself otherwise (stage 0/1)."""
  plan, n = parts.plan, parts.plan.mesh.zero_size

  def target(leaf: LeafPlan, p: jax.Array) -> jax.Array:
    for tier in parts.tiers:
      if (slot := tier.grad_target(plan, leaf, p)) is not None:
        return slot
    if leaf.grad_partitioned and not leaf.param_partitioned:
      shape = list(leaf.padded_shape)
      shape[leaf.shard_dim] //= n
      return jnp.zeros(shape, plan.comm_dtype)
    return p

  return plan.map(target, params)


def bind(parts: StepParts, targets: PyTree, params: PyTree, secondary: PyTree,
         model_state: PyTree, rng: jax.Array | None) -> Any:
  """The user's model over the params as the step hands them to it, its gather units installed,
  holding ``model_state``, its BatchNorm statistics averaged over the data axes and its NNX RNG
  streams reseeded from ``rng`` (None: evaluation).

  Stage-3 partitions go to the model as :class:`ZeroParam` partitions: gathered by their unit's
  calls, or one layer at a time by the layer scan; a partition no unit gathers is gathered here.
  A replicated parameter with a partitioned gradient is attached to its gradient slot here
  (stacked: inside the layer scan, one layer at a time), so its gradient is reduce-scattered the
  moment backward has produced it. With ZeRO++ each carries the plan's ``comm`` for the leaf (and
  with hpZ its secondary partition, which the gathers read).
  """
  plan, axes = parts.plan, parts.plan.mesh
  if secondary is None:
    secondary = plan.map(lambda _: None)

  def leaf_param(leaf: LeafPlan, target: Any, p: jax.Array, sec: jax.Array | None):
    if not (leaf.grad_partitioned or leaf.param_partitioned):
      return target
    size = leaf.shape[leaf.shard_dim]
    comm = plan.comm(leaf)
    if isinstance(target, SlotTarget):  # a tier takes the gradient elsewhere (host memory)
      extra = target.zero_param_args(p if leaf.param_partitioned else None)
      target = extra.pop("partition")
    else:
      extra = {}
    if leaf.param_partitioned:
      for tier in parts.tiers:  # where a tier's partition comes from when gather() runs
        extra.update(tier.gather_inputs(plan, parts.resources.get(tier.name), leaf, p) or {})
      zp = ZeroParam(target, leaf.shard_dim, size, axes.zero_axes, plan.comm_dtype,
                     secondary=sec, comm=comm, path=leaf.path, **extra)
      keep = leaf.stacked or leaf.unit is not None
    else:
      zp = ZeroParam(target, leaf.shard_dim, size, axes.zero_axes, full=p,
                     scatter=plan.reduce_scatter, comm=comm, path=leaf.path, **extra)
      keep = leaf.stacked
    return zp if keep else zp.gather()

  units = frozenset(l.unit for l in plan.leaf_list() if l.param_partitioned and l.unit is not None)
  return parts.model.bind(plan.map(leaf_param, targets, params, secondary), units, model_state,
                          rng=rng, batch_axes=axes.batch_axes)


# -- forward, backward, reduction ------------------------------------------------------------------
def _reduce_micro(plan: Plan, leaf: LeafPlan, g: jax.Array, accumulate: bool) -> jax.Array:
  """A micro-batch's gradient -> what the accumulator holds.

  Partitioned gradients (stage 2 and 3) arrive reduce-scattered over the ZeRO axes by the
  backward of the parameter's gather / attach (:mod:`jzero.comm.collectives`); they are summed
  over the replica axes here. A full local gradient (stage 0/1) is upcast to the accumulation
  dtype only when there is something to accumulate: with one micro-batch it is reduced in the
  communication dtype and only its reduced partition is upcast (:func:`_reduce_final`).
  """
  axes = plan.mesh
  if g is None or isinstance(g, SlotTarget):  # frozen: none; a tier's slot: reduced already
    return g
  if leaf.grad_partitioned:
    g = g.astype(plan.comm_dtype)
    g = lax.psum(g, axes.replica_axes) if axes.replica_axes else g
    return g.astype(plan.grad_accum_dtype)
  return g.astype(plan.grad_accum_dtype) if accumulate else g


def _reduce_final(plan: Plan, leaf: LeafPlan, g: jax.Array) -> jax.Array:
  """Accumulated gradient -> fp32 gradient in the state layout, summed over devices."""
  axes = plan.mesh
  if g is None or isinstance(g, SlotTarget):  # frozen: none; a tier's slot: reduced already
    return g
  if leaf.grad_partitioned:
    return g.astype(jnp.float32)
  g = g.astype(plan.comm_dtype)
  if not leaf.state_partitioned:  # stage 0 (or a 0-d leaf): all-reduce
    g = lax.psum(g, axes.batch_axes)
  elif plan.reduce_scatter:  # stage 1
    g = collectives.reduce_scatter(g, leaf.shard_dim, leaf.padded, axes.zero_axes)
    g = lax.psum(g, axes.replica_axes) if axes.replica_axes else g
  else:  # stage 1 with reduce_scatter: false -- all-reduce, keep the own slice
    g = collectives.local_slice(lax.psum(g, axes.batch_axes), leaf.shard_dim, leaf.padded,
                                axes.zero_axes)
  return g.astype(jnp.float32)


def local_grads(parts: StepParts, state: TrainState, batch: PyTree):
  """Forward + backward over the micro-batches and the gradient reduction, on one device's
  blocks. Returns (fp32 gradients summed over devices in the state layout, still multiplied by
  the loss scale; mean loss; mean aux; the model state the last micro-batch left)."""
  plan, settings, axes = parts.plan, parts.settings, parts.plan.mesh
  gas, micro, policy = settings.gas, settings.micro_batch_size, settings.layer_policy
  micro_batches = jax.tree.map(lambda x: x.reshape((gas, micro) + x.shape[1:]), batch)
  mean_over = axes.dp_size if settings.mean_over_replicas else 1
  loss_mult = state.loss_scale.scale / (gas * mean_over)
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  key = jax.random.fold_in(key, lax.axis_index(axes.batch_axes))

  def scaled_loss(trained, mb, rng, model_state, fixed):
    targets = plan.map(lambda l, t, f: f if l.frozen else t, trained, fixed)
    with engine_context(policy) as log, one_pass():
      model = bind(parts, targets, state.params, state.secondary, model_state, rng)
      out = parts.call_loss(model, mb, rng)
      model_state = parts.model.model_state(model)
    if policy.offload_inputs and not sum(log.tagged):
      warnings.warn(
          "activation_checkpointing.cpu_checkpointing: the model ran no jzero remat region "
          "(jzero.scan_layers, linen_scan_layers, jzero.remat or a ZeRO-3 gather unit), so no "
          "activation was offloaded to the host", JZeroWarning, stacklevel=2)
    loss, aux = aux_metrics.split_loss(out)
    loss = loss.astype(jnp.float32)
    aux = None if aux is None else aux_metrics.mark(aux, micro)
    return loss * loss_mult, (loss, aux, model_state)

  def micro_grads(mb, i, model_state):
    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
    targets = grad_targets(parts, state.params)  # a frozen leaf's is not differentiated
    trained = plan.map(lambda l, t: None if l.frozen else t, targets)
    fixed = plan.map(lambda l, t: t if l.frozen else None, targets)
    (_, (loss, aux, model_state)), g = grad_fn(trained, mb, jax.random.fold_in(key, i),
                                               model_state, fixed)
    return (loss, aux, plan.map(lambda l, x: _reduce_micro(plan, l, x, gas > 1), g)), model_state

  if gas == 1:
    (loss, aux, grads), model_state = micro_grads(jax.tree.map(lambda x: x[0], micro_batches), 0,
                                                  state.model_state)
    aux = jax.tree.map(lambda x: x[None], aux)  # stacked over the one micro-batch
  else:
    add = lambda total, g: total.add(g) if is_slot(total) else total + g  # noqa: E731

    def accumulate(carry, xs):
      acc, model_state = carry
      (loss, aux, grads), model_state = micro_grads(*xs, model_state)
      # the barrier keeps XLA's while-loop reduce-scatter motion off the sum: libtpu's pass fails
      # a RET_CHECK on this loop (the layer scan's reduce-scatters inside the micro-batch scan),
      # and moving the reduction after the loop is not the per-micro-batch reduction jzero runs
      grads = jax.tree.map(lambda g: g if is_slot(g) else lax.optimization_barrier(g), grads,
                           is_leaf=is_slot)
      return (jax.tree.map(add, acc, (loss, grads), is_leaf=is_slot), model_state), aux

    first = jax.tree.map(lambda x: x[0], micro_batches)
    loss_grads = jax.eval_shape(micro_grads, first, 0, state.model_state)[0]
    zeros = jax.tree.map(lambda s: s.accumulator(plan.grad_accum_dtype) if is_slot(s)
                         else jnp.zeros(s.shape, s.dtype), (loss_grads[0], loss_grads[2]),
                         is_leaf=is_slot)
    ((loss, grads), model_state), aux = lax.scan(
        accumulate, (zeros, state.model_state), (micro_batches, jnp.arange(gas)))
    grads = jax.tree.map(lambda g: g.summed() if is_slot(g) else g, grads, is_leaf=is_slot)
    loss = loss / gas
  mean = lambda x: lax.pmean(x, axes.batch_axes)
  grads = plan.map(functools.partial(_reduce_final, plan), grads)
  aux = aux_metrics.over_devices(aux_metrics.over_micro_batches(aux), axes.batch_axes)
  return grads, mean(loss), aux, model_state


def trace_loss(parts: StepParts, batch: PyTree) -> None:
  """The loss over logical parameters on a micro-batch of ``batch``'s trailing shapes, traced
  abstractly: the model's own errors on those shapes, with no device work."""
  plan = parts.plan
  params = plan.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, plan.compute_dtype))
  model_state = parts.model.abstract_model_state(None, None)
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (parts.settings.micro_batch_size,) + x.shape[1:], x.dtype), batch)
  loss = lambda p, s, mb: parts.call_loss(parts.model.bind(p, model_state=s, rng=None), mb,
                                          jax.random.key(0))
  jax.eval_shape(loss, params, model_state, micro)
