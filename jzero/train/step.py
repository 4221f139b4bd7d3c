"""What one ZeRO train step computes: :class:`StepBuilder`, the step half of :class:`jzero.Engine`.

One optimizer step is one ``jax.jit`` whose body is a ``shard_map`` over the whole mesh, with the
plan's shardings as the jit's in/out shardings and the train state donated. Inside, every
collective is explicit (see :mod:`jzero.comm.collectives`), so the compiled HLO moves exactly the
bytes ZeRO says it should:

1. For each micro-batch (``lax.scan`` over ``gradient_accumulation_steps``): forward and backward
   on the device's slice of the batch. Stage-3 partitioned params are gathered by a collective
   whose backward reduce-scatters (stacked layers: one layer at a time inside
   :func:`jzero.scan_layers`); stage-2 gradients are reduce-scattered into the partitioned
   accumulator after every micro-batch; stage 0/1 accumulate the full local gradient. With
   parameter offload each host-tier partition is moved to the device right before its gather
   and its gradient lands in a device slot (:mod:`jzero.tiers.host_params`).
2. Stage 0 all-reduces the accumulated gradient, stage 1 reduce-scatters it.
3. fp16: any inf/nan anywhere -> skip the step and let the loss scaler back off (DeepSpeed's
   dynamic loss scaling; bf16 with ``check_grad_overflow``); fp32: a global norm that is not finite
   (a NaN row, a loss that divides by zero) skips the step too -- an elementwise select of the old
   state, fused into the update, where fp16's ``lax.cond`` would hold a second copy of the state (a
   cond still, with host-tier state; not with the delayed update, whose steady step always applies:
   the engine warns). Gradients are unscaled, the true global norm is computed from the
   partitions (a ``psum`` of partial sums of squares) and the gradient clipped DeepSpeed's way:
   ``g *= min(1, clip / (norm + 1e-6))``.
4. The optax update runs on each device's partition of the fp32 master (or, in fp32, of the params
   themselves); stage 1/2 all-gather the updated partitions into new replicated compute params,
   stage 3 just casts its partition (with ZeRO++'s hpZ, then refreshes each device's secondary
   partition from its node's primary partitions, :mod:`jzero.comm.zeropp`). Host-tier params are
   written back to the host. With ZeRO-Offload's delayed parameter update the update uses the
   gradient the previous step carried and this step's gradient is carried to the next
   (:mod:`jzero.tiers.delayed`).

The loss of a micro-batch is each device's mean over its slice, divided by the data-parallel size
and by ``gradient_accumulation_steps`` before the backward pass, so the summed gradient is the
gradient of the global mean loss -- the same number a single device computes on the whole batch.

**Tiers.** The step names no tier. Where a tier changes it -- a leaf's partition fetched from
host memory or read from NVMe when its gather runs, the NVMe leaves' gradients handed out of the
jit for the store's update, the delayed update's gradient swap, the host tier's update of what
lives in host memory, where new params are stored -- the step calls the hooks of the engine's
active tiers (``self.tiers``, :mod:`jzero.tiers.base`) at fixed points, in the registry's order.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jzero.comm import collective_order, collectives, program
from jzero.comm.zero_param import ZeroParam
from jzero.errors import JZeroError, JZeroWarning
from jzero.modeling.layer_scan import LayerPolicy, engine_context
from jzero.sharding.plan import LeafPlan
from jzero.train.precision import has_overflow
from jzero.train.state import TrainState

__all__ = ["StepBuilder", "split_loss"]

PyTree = Any


def split_loss(out: Any) -> tuple[jax.Array, Any]:
  """What a loss_fn returned -> (scalar loss, aux dict or None); a loss that is not a scalar is an
  error naming the fix (value_and_grad would raise JAX's own TypeError deep in the step)."""
  loss, aux = out if isinstance(out, tuple) else (out, None)
  if jnp.ndim(loss) != 0:
    raise JZeroError(
        f"loss_fn returned a loss of shape {tuple(jnp.shape(loss))}; jzero needs a scalar, the "
        f"mean over the batch it is given (as DeepSpeed's loss.backward() does): return "
        f"loss.mean().")
  return loss, aux


class StepBuilder:
  """The train step of :class:`jzero.Engine`, as methods that read the engine's plan, config,
  optimizer and loss scaler (``self`` is the engine). ``_local_*`` run inside the step's
  ``shard_map`` on one device's blocks; :meth:`_jit` wraps them in ``jit(shard_map(...))`` with
  the plan's shardings and memory kinds."""

  #: The full-parameter elements of each group stage 3 gathered together while the step was last
  #: traced (:class:`jzero.modeling.layer_scan.TraceLog`); None before the first trace.
  traced_gathers: tuple[int, ...] | None = None

  def gathered_working_set(self) -> tuple[int, int]:
    """Stage 3's (largest group gathered at once, elements gathered at the start), as
    :meth:`jzero.sharding.plan.Plan.gathered_working_set` -- with the largest group as the traced
    step really gathers it once the step has been traced (a unit inside the model's own ``nn.scan``
    gathers one layer's slice per call, which the plan cannot see)."""
    largest, upfront = self.plan.gathered_working_set()
    if self.traced_gathers is not None and self.plan.stage == 3:
      largest = max(self.traced_gathers, default=0)
    return largest, upfront

  @property
  def loss_takes_rng(self) -> bool:
    """Whether the loss has an ``rng`` parameter: a per-device, per-micro-batch key in training,
    ``None`` in evaluation."""
    return "rng" in inspect.signature(self.loss_fn).parameters

  # -- the step ------------------------------------------------------------------------------------
  def _reduce_micro(self, leaf: LeafPlan, g: jax.Array, accumulate: bool) -> jax.Array:
    """A micro-batch's gradient -> what the accumulator holds.

    Partitioned gradients (stage 2 and 3) arrive reduce-scattered over the ZeRO axes by the
    backward of the parameter's gather / attach (:mod:`jzero.comm.collectives`); they are summed
    over the replica axes here. A full local gradient (stage 0/1) is upcast to the accumulation
    dtype only when there is something to accumulate: with one micro-batch it is reduced in the
    communication dtype and only its reduced partition is upcast (:meth:`_reduce_final`).
    """
    plan, axes = self.plan, self.mesh
    if leaf.grad_partitioned:
      g = g.astype(plan.comm_dtype)
      g = lax.psum(g, axes.replica_axes) if axes.replica_axes else g
      return g.astype(plan.grad_accum_dtype)
    return g.astype(plan.grad_accum_dtype) if accumulate else g

  def _reduce_final(self, leaf: LeafPlan, g: jax.Array) -> jax.Array:
    """Accumulated gradient -> fp32 gradient in the state layout, summed over devices."""
    plan, axes = self.plan, self.mesh
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

  def _grad_targets(self, params: PyTree) -> PyTree:
    """What the step differentiates, per leaf: what a tier holding the leaf's param says (a zero
    gradient slot on the device for a partition in host memory or on NVMe,
    :meth:`jzero.tiers.base.Tier.grad_target`); a stage-3 partition itself; a zero gradient slot
    of the partition's shape (communication dtype) for a replicated parameter whose gradient is
    partitioned (stage 2, stage-3 persistent); the parameter itself otherwise (stage 0/1)."""
    plan, n = self.plan, self.mesh.zero_size

    def target(leaf: LeafPlan, p: jax.Array) -> jax.Array:
      for tier in self.tiers:
        if (slot := tier.grad_target(self, leaf, p)) is not None:
          return slot
      if leaf.grad_partitioned and not leaf.param_partitioned:
        shape = list(leaf.padded_shape)
        shape[leaf.shard_dim] //= n
        return jnp.zeros(shape, plan.comm_dtype)
      return p

    return plan.map(target, params)

  def _model_params(self, targets: PyTree, params: PyTree, secondary: PyTree = None) -> PyTree:
    """What the model sees, per leaf (see :mod:`jzero.modeling.gather_units` and
    :mod:`jzero.modeling.layer_scan`).

    Stage-3 partitions go to the model as :class:`ZeroParam` partitions: gathered by their unit's
    calls, or one layer at a time by the layer scan; a partition no unit gathers is gathered here.
    A replicated parameter with a partitioned gradient is attached to its gradient slot here
    (stacked: inside the layer scan, one layer at a time), so its gradient is reduce-scattered the
    moment backward has produced it. With ZeRO++ each carries the plan's ``comm`` for the leaf
    (and with hpZ its secondary partition, which the gathers read).
    """
    plan, axes = self.plan, self.mesh
    if secondary is None:
      secondary = plan.map(lambda _: None)

    def leaf_param(leaf: LeafPlan, target: jax.Array, p: jax.Array, sec: jax.Array | None):
      if not leaf.grad_partitioned:
        return target
      size = leaf.shape[leaf.shard_dim]
      comm = plan.comm(leaf)
      if leaf.param_partitioned:
        extra = {}  # where a tier's partition comes from when gather() runs (jzero.tiers)
        for tier in self.tiers:
          extra.update(tier.gather_inputs(self, leaf, p) or {})
        zp = ZeroParam(target, leaf.shard_dim, size, axes.zero_axes, plan.comm_dtype,
                       secondary=sec, comm=comm, **extra)
        keep = leaf.stacked or leaf.unit is not None
      else:
        zp = ZeroParam(target, leaf.shard_dim, size, axes.zero_axes, full=p,
                       scatter=plan.reduce_scatter, comm=comm)
        keep = leaf.stacked
      return zp if keep else zp.gather()

    return plan.map(leaf_param, targets, params, secondary)

  def _bind(self, targets: PyTree, params: PyTree, secondary: PyTree = None) -> Any:
    """The user's model over :meth:`_model_params`, its gather units installed."""
    units = frozenset(l.unit for l in self.plan.leaf_list()
                      if l.param_partitioned and l.unit is not None)
    return self.model.bind(self._model_params(targets, params, secondary), units)

  def local_master(self, leaf: LeafPlan, p: jax.Array) -> jax.Array:
    """fp32 training: this device's partition of a param, as the optimizer's master."""
    if leaf.state_partitioned and not leaf.param_partitioned:
      return collectives.local_slice(p, leaf.shard_dim, leaf.padded, self.mesh.zero_axes)
    return p

  def compute_param(self, leaf: LeafPlan, m: jax.Array) -> jax.Array:
    """Updated master partition -> compute param in the param layout (stage 1/2: cast, then
    all-gathered in the compute dtype, as DeepSpeed gathers its 16-bit partitions).

    A stacked leaf is gathered one layer at a time (a scan writing each gathered layer into the
    output), so the step never holds a second full copy of the stack: gathered whole, XLA's GPU
    compiler issues every stack's gather at once and transposes each result into the output layout
    (the 7B shape's stage-1/2 peak was those copies, 26 GB per device)."""
    m = m.astype(self.plan.compute_dtype)
    if not leaf.state_partitioned or leaf.param_partitioned:
      return m
    gather = functools.partial(collectives.all_gather, dim=leaf.shard_dim,
                               size=leaf.shape[leaf.shard_dim], axes=self.mesh.zero_axes)
    if leaf.stacked:
      return lax.map(gather, m)
    return gather(m)

  def _local_grads(self, state: TrainState, batch: PyTree):
    """Forward + backward over the micro-batches and the gradient reduction.

    Returns (fp32 gradients summed over devices in the state layout, still multiplied by the loss
    scale; mean loss; mean aux).
    """
    plan, axes = self.plan, self.mesh
    gas, micro = self.gas, self.micro_batch_size
    micro_batches = jax.tree.map(lambda x: x.reshape((gas, micro) + x.shape[1:]), batch)
    mean_over = axes.dp_size if self.config.gradient_allreduce_op == "mean" else 1
    loss_mult = state.loss_scale.scale / (gas * mean_over)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    key = jax.random.fold_in(key, lax.axis_index(axes.batch_axes))
    zero = self.config.zero_optimization
    checkpointing = self.config.activation_checkpointing
    policy = LayerPolicy(checkpoint_activations=checkpointing is not None,
                         prefetch=zero.stage == 3 and zero.prefetch_bucket_size > 0,
                         offload_inputs=checkpointing is not None
                         and bool(checkpointing.cpu_checkpointing))

    def scaled_loss(targets, mb, rng):
      with engine_context(policy) as log:
        model = self._bind(targets, state.params, state.secondary)
        out = self.loss_fn(model, mb, rng=rng) if self.loss_takes_rng else self.loss_fn(model, mb)
      self.traced_gathers = tuple(log.gathered)
      if policy.offload_inputs and not sum(log.tagged):
        warnings.warn(
            "activation_checkpointing.cpu_checkpointing: the model ran no jzero remat region "
            "(jzero.scan_layers, linen_scan_layers, jzero.remat or a ZeRO-3 gather unit), so no "
            "activation was offloaded to the host", JZeroWarning, stacklevel=2)
      loss, aux = split_loss(out)
      loss, aux = loss.astype(jnp.float32), {} if aux is None else aux
      return loss * loss_mult, (loss, aux)

    def micro_grads(mb, i):
      grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
      (_, (loss, aux)), g = grad_fn(self._grad_targets(state.params), mb,
                                    jax.random.fold_in(key, i))
      return loss, aux, plan.map(lambda l, x: self._reduce_micro(l, x, gas > 1), g)

    if gas == 1:
      loss, aux, grads = micro_grads(jax.tree.map(lambda x: x[0], micro_batches), 0)
    else:
      def accumulate(acc, xs):
        out = micro_grads(*xs)
        return jax.tree.map(jnp.add, acc, out), None

      first = jax.tree.map(lambda x: x[0], micro_batches)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro_grads, first, 0))
      (loss, aux, grads), _ = lax.scan(accumulate, zeros, (micro_batches, jnp.arange(gas)))
      loss, aux = loss / gas, jax.tree.map(lambda a: a / gas, aux)
    mean = lambda x: lax.pmean(x, axes.batch_axes)
    return plan.map(self._reduce_final, grads), mean(loss), jax.tree.map(mean, aux)

  def _local_update(self, state: TrainState, grads: PyTree, loss: jax.Array, aux: dict,
                    variants: dict | None = None):
    """Overflow check, unscale, clip by the global norm, optimizer update -> (state, metrics,
    outputs): ``outputs`` is what tiers hand out of the jit for their work after it, by tier name
    (``{}`` when none does).

    The update phase is the core's (unscale, norm, clip, optax on the device, the stage's
    gathers) composed with the active tiers' hooks, in the registry's order
    (:mod:`jzero.tiers.base`); ``variants``: the step variant each tier asked for, by name."""
    plan, axes, tiers = self.plan, self.mesh, self.tiers
    variants = variants or {}
    variant = lambda tier: variants.get(tier.name)
    scale = state.loss_scale.scale
    checks = self.checks_overflow()
    if checks:
      overflow = lax.psum(has_overflow(grads).astype(jnp.int32), axes.zero_axes) > 0
    grads = jax.tree.map(lambda g: g / scale, grads)
    grad_norm = self._global_norm(grads)
    if self.config.precision == "fp32" and all(t.checks_finite(variant(t)) for t in tiers):
      overflow = jnp.logical_not(jnp.isfinite(grad_norm))  # a NaN or inf anywhere: norm not finite
    elif not checks:  # bf16 without check_grad_overflow; the delayed update's steady step
      overflow = jnp.zeros((), bool)
    clip = self.config.gradient_clipping
    factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None
    outputs = {}  # what leaves the jit for a tier's work after it (the NVMe store's update)
    for tier in tiers:
      grads, out = tier.take_outputs(self, state, grads, factor)
      if out is not None:
        outputs[tier.name] = out
    if factor is not None:
      grads = jax.tree.map(lambda g: g * factor, grads)
    skip_update, carried = overflow, None
    for tier in tiers:  # the delayed update: apply the carried g_{t-1}, carry g_t
      grads, skip_update, carried = tier.choose_gradient(state, grads, overflow, skip_update,
                                                         carried, variant(tier))
    owner = next((t for t in tiers if t.owns_update()), None)

    def apply_update(_, keep: jax.Array | None = None):
      """The update; with ``keep`` (a traced bool, device-memory state only) the old partition and
      optimizer state are selected elementwise where it is true, before any gather."""
      master = state.master if plan.has_master else plan.map(self.local_master, state.params)
      for tier in tiers:
        master = tier.master_in(self, master)
      if owner is not None:  # e.g. ZeRO-Offload: host-memory state updated group by group
        master, compute_from, opt_state = owner.optimizer_update(self, grads, state.opt_state,
                                                                 master)
      else:
        updates, opt_state = self.tx.update(grads, state.opt_state, master)
        new_master = optax.apply_updates(master, updates)
        if keep is not None:
          new_master, opt_state = self._skippable_update(grads, state.opt_state, master,
                                                         new_master, keep)
        master = compute_from = new_master

      def new_param(l: LeafPlan, m_dev: jax.Array, m: jax.Array, old: jax.Array) -> jax.Array:
        for tier in tiers:
          if (p := tier.new_param(self, l, m_dev, m, old)) is not None:
            return p
        return self.compute_param(l, m_dev)

      params = plan.map(new_param, compute_from, master, state.params)
      secondary = plan.map(self._secondary, params) if plan.zeropp.hpz > 1 else None
      for tier in tiers:
        params = tier.place_params(self, params, master)
      return params, (master if plan.has_master else None), opt_state, secondary

    def skip(_):
      params, master, opt_state = state.params, state.master, state.opt_state
      for tier in tiers:  # typed like apply_update's results
        params, master, opt_state = tier.skipped(self, params, master, opt_state)
      return params, master, opt_state, state.secondary

    if isinstance(skip_update, bool):
      params, master, opt_state, secondary = (skip if skip_update else apply_update)(None)
    elif checks or any(t.needs_cond for t in tiers):
      params, master, opt_state, secondary = lax.cond(skip_update, skip, apply_update, None)
    else:  # an elementwise select fuses into the update: no second copy of the state (a cond's)
      params, master, opt_state, secondary = apply_update(None, keep=skip_update)

    applied = state.step - state.skipped
    for tier in tiers:
      applied = tier.applied_steps(state, applied)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": self._learning_rate(applied, opt_state),
        "loss_scale": scale,
        "overflow": overflow,
        "skipped": state.skipped + overflow.astype(jnp.int32),
        "min_scale_overflow": self.scaler.at_min_scale_overflow(state.loss_scale, overflow),
        **aux,
    }
    new_state = TrainState(
        step=state.step + 1, skipped=state.skipped + overflow.astype(jnp.int32), params=params,
        master=master, opt_state=opt_state, loss_scale=self.scaler.update(state.loss_scale, overflow),
        rng=state.rng, secondary=secondary, delayed=carried)
    return new_state, metrics, outputs

  def _skippable_update(self, grads: PyTree, opt_state: PyTree, master: PyTree,
                        new_master: PyTree, keep: jax.Array) -> tuple[PyTree, PyTree]:
    """fp32's skip of a non-finite step, updating the state in place: (master, optimizer state),
    the old ones where ``keep`` (a traced bool) is true, else the updated ones.

    A plain elementwise select of old and new state costs a state-sized temporary: the new
    master reads the new moments, the selected moments overwrite the old ones in place, so XLA
    either keeps the new moments beside the old (the select's two consumers) or copies the old
    ones first -- +50% of the compiled temp at stage 0, +8% step time on the default job. So the
    new optimizer state is computed a second time, from the old state read *after* the new master
    exists (:func:`jzero.comm.collective_order.identity_after`, per parameter leaf): XLA then
    updates the master first, reading the old moments, and the moments after it, in place.
    The values are the same bits as one ``tx.update``; the work is two elementwise passes over
    the moments instead of one. State that is not shaped like the parameters (a client
    optimizer's factored statistics) is selected without the ordering."""
    new_master = jax.tree.map(lambda old, new: jnp.where(keep, old, new), master, new_master)
    read_after = lambda x, m: collective_order.identity_after(x, m) if m.size else x  # 0-byte:
    # a placeholder whose state lives outside the step (the NVMe store)
    old_state = optax.tree_utils.tree_map_params(self.tx, read_after, opt_state, new_master,
                                                 transform_non_params=lambda x: x)
    _, new_state = self.tx.update(grads, old_state, master)
    return new_master, jax.tree.map(lambda old, new: jnp.where(keep, old, new), old_state,
                                    new_state)

  def _learning_rate(self, applied: jax.Array, opt_state: PyTree) -> jax.Array:
    """The lr of this step: the config's schedule, or a client optimizer's ``learning_rate``
    hyperparameter (``optax.inject_hyperparams``); NaN where it cannot be read."""
    if self.schedule is not None:
      return self.schedule(applied)
    try:
      lr = optax.tree_utils.tree_get(opt_state, "learning_rate",
                                     filtering=lambda _, value: isinstance(value, jax.Array))
    except KeyError:  # several optimizers with a learning rate
      lr = None
    return jnp.nan if lr is None else jnp.asarray(lr, jnp.float32)

  def _local_step(self, state: TrainState, batch: PyTree, variants: dict | None = None):
    return self._local_update(state, *self._local_grads(state, batch), variants=variants)

  def _global_norm(self, grads: PyTree) -> jax.Array:
    """L2 norm of the full gradient, from partitions: psum of the partitioned partial sums."""
    plan = self.plan
    parts = plan.map(lambda l, g: (jnp.sum(jnp.square(g)), l.state_partitioned), grads)
    flat = jax.tree.leaves(parts, is_leaf=lambda x: isinstance(x, tuple))
    partitioned = sum((s for s, split in flat if split), jnp.zeros((), jnp.float32))
    replicated = sum((s for s, split in flat if not split), jnp.zeros((), jnp.float32))
    return jnp.sqrt(lax.psum(partitioned, self.mesh.zero_axes) + replicated)

  def _jit(self, fn, in_specs: tuple, out_specs: Any, donate: tuple[int, ...]):
    """jit(shard_map(fn)) with the plan's shardings as the jit's in/out shardings (TrainState
    arguments and results with their memory kinds)."""
    plan = self._require_plan()
    state_kinds = self.state_memory_kinds()
    kinds = lambda specs: tuple(state_kinds if isinstance(s, TrainState) else None for s in specs)
    out = out_specs if isinstance(out_specs, tuple) else (out_specs,)
    out_shardings = self._shardings(out, kinds(out))
    body = program.shard_map(plan, fn, in_specs, out_specs)
    return jax.jit(body, in_shardings=self._shardings(in_specs, kinds(in_specs)),
                   out_shardings=out_shardings if isinstance(out_specs, tuple) else out_shardings[0],
                   donate_argnums=donate, compiler_options=program.compile_options(plan) or None)

  def _build_step(self, batch: PyTree, variants: dict | None = None):
    specs, batch_specs = self.state_specs(), jax.tree.map(lambda _: self.plan.batch_spec(), batch)
    return self._jit(functools.partial(self._local_step, variants=variants),
                     (specs, batch_specs), self._step_out_specs(specs), donate=(0,))

  def _step_out_specs(self, specs: TrainState) -> tuple:
    """(state, metrics, outputs) specs; outputs: what tiers that work after the step read."""
    return (specs, P(), {t.name: s for t in self.tiers if (s := t.output_specs(self)) is not None})

  def _build_split_step(self, batch: PyTree, variants: dict | None = None):
    """The step as two jits -- forward+backward+reduction, then the update -- for timing them."""
    specs, batch_specs = self.state_specs(), jax.tree.map(lambda _: self.plan.batch_spec(), batch)
    grad_specs = self.plan.state_specs()
    grads = self._jit(self._local_grads, (specs, batch_specs), (grad_specs, P(), P()), donate=())
    update = self._jit(functools.partial(self._local_update, variants=variants),
                       (specs, grad_specs, P(), P()),
                       self._step_out_specs(specs), donate=(0,))
    return grads, update
