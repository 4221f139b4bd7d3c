"""What one ZeRO train step computes: :class:`StepBuilder`, the step half of :class:`jzero.Engine`.

One optimizer step is one ``jax.jit`` whose body is a ``shard_map`` over the whole mesh, with the
plan's shardings as the jit's in/out shardings and the train state donated. Inside, every
collective is explicit (see :mod:`jzero.collectives`), so the compiled HLO moves exactly the bytes
ZeRO says it should:

1. For each micro-batch (``lax.scan`` over ``gradient_accumulation_steps``): forward and backward
   on the device's slice of the batch. Stage-3 partitioned params are gathered by a collective
   whose backward reduce-scatters (stacked layers: one layer at a time inside
   :func:`jzero.scan_layers`); stage-2 gradients are reduce-scattered into the partitioned
   accumulator after every micro-batch; stage 0/1 accumulate the full local gradient. With
   parameter offload each host-tier partition is moved to the device right before its gather
   and its gradient lands in a device slot (:mod:`jzero.param_offload`).
2. Stage 0 all-reduces the accumulated gradient, stage 1 reduce-scatters it.
3. fp16: any inf/nan anywhere -> skip the step and let the loss scaler back off (DeepSpeed's
   dynamic loss scaling; bf16 with ``check_grad_overflow``); fp32: a global norm that is not finite (a NaN row, a loss that
   divides by zero) skips the step too -- an elementwise select of the old state, fused into the
   update, where fp16's ``lax.cond`` would hold a second copy of the state (a cond still, with
   host-tier state; not with the delayed update, whose steady step always applies: the engine
   warns). Gradients are unscaled, the true global norm is computed from the
   partitions (a ``psum`` of partial sums of squares) and the gradient clipped DeepSpeed's way:
   ``g *= min(1, clip / (norm + 1e-6))``.
4. The optax update runs on each device's partition of the fp32 master (or, in fp32, of the params
   themselves); stage 1/2 all-gather the updated partitions into new replicated compute params,
   stage 3 just casts its partition (with ZeRO++'s hpZ, then refreshes each device's secondary
   partition from its node's primary partitions, :mod:`jzero.zeropp`). Host-tier params are
   written back to the host. With ZeRO-Offload's delayed parameter update the update uses the
   gradient the previous step carried and this step's gradient is carried to the next
   (:mod:`jzero.delayed`).

The loss of a micro-batch is each device's mean over its slice, divided by the data-parallel size
and by ``gradient_accumulation_steps`` before the backward pass, so the summed gradient is the
gradient of the global mean loss -- the same number a single device computes on the whole batch.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jzero import collectives, delayed, nvme, offload
from jzero.collectives import ZeroParam
from jzero.errors import JZeroError, JZeroWarning
from jzero.layers import LayerPolicy, engine_context
from jzero.param_nvme import ParamSource
from jzero.plan import LeafPlan
from jzero.precision import LossScaleState, has_overflow

__all__ = ["TrainState", "StepBuilder"]

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
      dtype, split over the node's local axes; see :mod:`jzero.zeropp`); None without hpZ. A
      function of ``params``: recomputed at init and restore, never saved.
    delayed: ZeRO-Offload's delayed parameter update: the gradient this step computed, carried
      to the next step, which updates with it (:class:`jzero.delayed.DelayedGrads`); None
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
  delayed: delayed.DelayedGrads | None = None


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
  #: traced (:class:`jzero.layers.TraceLog`); None before the first trace.
  traced_gathers: tuple[int, ...] | None = None

  def gathered_working_set(self) -> tuple[int, int]:
    """Stage 3's (largest group gathered at once, elements gathered at the start), as
    :meth:`jzero.plan.Plan.gathered_working_set` -- with the largest group as the traced step
    really gathers it once the step has been traced (a unit inside the model's own ``nn.scan``
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

  # -- the step -------------------------------------------------------------------------------------
  def _reduce_micro(self, leaf: LeafPlan, g: jax.Array, accumulate: bool) -> jax.Array:
    """A micro-batch's gradient -> what the accumulator holds.

    Partitioned gradients (stage 2 and 3) arrive reduce-scattered over the ZeRO axes by the
    backward of the parameter's gather / attach (:mod:`jzero.collectives`); they are summed over
    the replica axes here. A full local gradient (stage 0/1) is upcast to the accumulation dtype
    only when there is something to accumulate: with one micro-batch it is reduced in the
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
    """What the step differentiates, per leaf: a stage-3 partition itself; a zero gradient slot of
    the partition's shape (communication dtype) for a replicated parameter whose gradient is
    partitioned (stage 2, stage-3 persistent); a zero slot of the partition's shape and dtype on
    the device for a host-tier partition (parameter offload, :mod:`jzero.param_offload`); the
    parameter itself otherwise (stage 0/1)."""
    plan, n = self.plan, self.mesh.zero_size

    def target(leaf: LeafPlan, p: jax.Array) -> jax.Array:
      if leaf.param_tier == "host":
        return jnp.zeros(p.shape, p.dtype)
      if leaf.param_tier == "nvme":  # p is a 0-byte placeholder (jzero.param_nvme)
        shape = list(leaf.padded_shape)
        shape[leaf.shard_dim] //= n
        return jnp.zeros(shape, p.dtype)
      if leaf.grad_partitioned and not leaf.param_partitioned:
        shape = list(leaf.padded_shape)
        shape[leaf.shard_dim] //= n
        return jnp.zeros(shape, plan.comm_dtype)
      return p

    return plan.map(target, params)

  def _model_params(self, targets: PyTree, params: PyTree, secondary: PyTree = None) -> PyTree:
    """What the model sees, per leaf (see :mod:`jzero.units` and :mod:`jzero.layers`).

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
        source = layer = None
        if leaf.param_tier == "nvme":  # read from the store in gather() (jzero.param_nvme)
          source = ParamSource(self.nvme_store.reader, leaf.path, axes.zero_axes)
          layer = jnp.arange(leaf.shape[0]) if leaf.stacked else jnp.zeros((), jnp.int32)
        zp = ZeroParam(target, leaf.shard_dim, size, axes.zero_axes, plan.comm_dtype,
                       secondary=sec, comm=comm, host=p if leaf.param_tier == "host" else None,
                       source=source, layer=layer)
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

  def _param_on_host(self, leaf: LeafPlan) -> bool:
    """The state's param of ``leaf`` lives in host memory: parameter offload, or fp32 training's
    param (its master) with the state on the host and a copy on the NVMe tier."""
    return leaf.param_tier == "host" or (leaf.param_copy_on_nvme and not self.plan.has_master
                                         and leaf.state_tier == "host")

  def _local_master(self, leaf: LeafPlan, p: jax.Array) -> jax.Array:
    """fp32 training: this device's partition of a param, as the optimizer's master."""
    if leaf.state_partitioned and not leaf.param_partitioned:
      return collectives.local_slice(p, leaf.shard_dim, leaf.padded, self.mesh.zero_axes)
    return p

  def _compute_param(self, leaf: LeafPlan, m: jax.Array) -> jax.Array:
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
                    ready: bool | str | None = None):
    """Overflow check, unscale, clip by the global norm, optimizer update -> (state, metrics).

    ``ready``: with the delayed update, whether the state is known to carry a gradient (True: the
    steady step, False: the prime step, None: read ``state.delayed.ready``), or
    :data:`jzero.delayed.WARMUP` (a plain step that carries nothing)."""
    plan, axes = self.plan, self.mesh
    scale = state.loss_scale.scale
    checks = self._checks_overflow()
    if checks:
      overflow = lax.psum(has_overflow(grads).astype(jnp.int32), axes.zero_axes) > 0
    grads = jax.tree.map(lambda g: g / scale, grads)
    grad_norm = self._global_norm(grads)
    norm_check = self.config.precision == "fp32" and (state.delayed is None
                                                       or ready == delayed.WARMUP)
    if norm_check:  # fp32: a NaN or inf anywhere makes the global norm non-finite
      overflow = jnp.logical_not(jnp.isfinite(grad_norm))
    elif not checks:  # bf16 without check_grad_overflow; the delayed update (jzero.delayed)
      overflow = jnp.zeros((), bool)
    clip = self.config.gradient_clipping
    factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None
    nvme_out = None
    if plan.has_nvme:  # NVMe leaves: updated after this jit, from the store (jzero.nvme); the
      # clipping factor is applied there, inside the update, as it is here (the same rounding)
      nvme_out = nvme.step_outputs(self, state, grads, factor)
      grads = nvme.shrink(plan, grads)
    if factor is not None:
      grads = jax.tree.map(lambda g: g * factor, grads)
    if state.delayed is not None:  # DPU: update with the carried g_{t-1}, carry g_t
      grads, skip_update, carried = delayed.swap(state.delayed, grads, overflow, ready)
    else:
      skip_update, carried = overflow, None

    def apply_update(_, keep: jax.Array | None = None):
      """The update; with ``keep`` (a traced bool, device-tier state only) the old partition and
      optimizer state are selected elementwise where it is true, before any gather."""
      master = state.master if plan.has_master else plan.map(self._local_master, state.params)
      if plan.has_nvme:
        master = nvme.shrink(plan, master)
      if plan.uses_host:  # ZeRO-Offload: host-tier state updated group by group (jzero.offload)
        # Which masters arrive (and go back) in host memory: the separate fp32 master follows the
        # state's tier; in fp32 training the master is the param partition, in the param's tier.
        master_on_host = (plan.map(lambda l: l.state_tier == "host") if plan.has_master
                          else plan.map(self._param_on_host))
        master, compute_from, opt_state = offload.apply_update(
            self.tx, grads, state.opt_state, master,
            plan.map(lambda l: l.state_tier == "host"), mode=plan.offload_update,
            grouped=self.schedule is not None, master_on_host=master_on_host)
      else:
        updates, opt_state = self.tx.update(grads, state.opt_state, master)
        new_master = optax.apply_updates(master, updates)
        if keep is not None:
          new_master, opt_state = jax.tree.map(lambda old, new: jnp.where(keep, old, new),
                                               (master, state.opt_state), (new_master, opt_state))
        master = compute_from = new_master
      # NVMe leaves keep their params here: the store's update makes the new ones (jzero.nvme);
      # a param copied to the NVMe tier is written there after the step from the new master,
      # which in fp32 training is the state's param itself (jzero.param_nvme)
      def new_param(l: LeafPlan, m_dev: jax.Array, m: jax.Array, old: jax.Array) -> jax.Array:
        if l.state_tier == "nvme" or plan.param_placeholder(l):
          return old
        return m if l.param_copy_on_nvme else self._compute_param(l, m_dev)
      params = plan.map(new_param, compute_from, master, state.params)
      secondary = plan.map(self._secondary, params) if plan.zeropp.hpz > 1 else None
      if plan.param_offloads:  # the new partitions go back to the host tier (jzero.param_offload)
        params = plan.map(lambda l, p, m: p if l.param_tier != "host" else
                          m if not plan.has_master else offload.to_host(p), params, master)
      return params, (master if plan.has_master else None), opt_state, secondary

    def skip(_):
      if plan.uses_host:  # typed like apply_update's results (jzero.offload)
        master, opt_state = offload.keep_tiers(
            state.opt_state, state.master, plan.map(lambda l: l.state_tier == "host"),
            master_on_host=plan.has_master)
        params = plan.map(lambda l, p: offload.to_host(p) if self._param_on_host(l) else p,
                          state.params)
        return params, master, opt_state, state.secondary
      return state.params, state.master, state.opt_state, state.secondary

    if isinstance(skip_update, bool):
      params, master, opt_state, secondary = (skip if skip_update else apply_update)(None)
    elif checks or plan.uses_host or plan.param_offloads:
      params, master, opt_state, secondary = lax.cond(skip_update, skip, apply_update, None)
    else:  # an elementwise select fuses into the update: no second copy of the state (a cond's)
      params, master, opt_state, secondary = apply_update(None, keep=skip_update)

    applied = state.step - state.skipped
    if state.delayed is not None:  # the carried gradient is not applied yet
      applied = applied - state.delayed.ready.astype(applied.dtype)
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
    if nvme_out is not None:
      return new_state, metrics, nvme_out
    return new_state, metrics

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

  def _local_step(self, state: TrainState, batch: PyTree, ready: bool | str | None = None):
    return self._local_update(state, *self._local_grads(state, batch), ready=ready)

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
    body = plan.shard_map(fn, in_specs, out_specs)
    return jax.jit(body, in_shardings=self._shardings(in_specs, kinds(in_specs)),
                   out_shardings=out_shardings if isinstance(out_specs, tuple) else out_shardings[0],
                   donate_argnums=donate, compiler_options=plan.xla_options() or None)

  def _build_step(self, batch: PyTree, ready: bool | str | None = None):
    specs, batch_specs = self.state_specs(), jax.tree.map(lambda _: self.plan.batch_spec(), batch)
    return self._jit(functools.partial(self._local_step, ready=ready), (specs, batch_specs),
                     self._step_out_specs(specs), donate=(0,))

  def _step_out_specs(self, specs: TrainState) -> tuple:
    """(state, metrics) specs; with an NVMe tier also what the store's update reads."""
    if self.plan.has_nvme:
      return (specs, P(), nvme.step_output_specs(self))
    return (specs, P())

  def _build_split_step(self, batch: PyTree, ready: bool | str | None = None):
    """The step as two jits -- forward+backward+reduction, then the update -- for timing them."""
    specs, batch_specs = self.state_specs(), jax.tree.map(lambda _: self.plan.batch_spec(), batch)
    grad_specs = self.plan.state_specs()
    grads = self._jit(self._local_grads, (specs, batch_specs), (grad_specs, P(), P()), donate=())
    update = self._jit(functools.partial(self._local_update, ready=ready),
                       (specs, grad_specs, P(), P()),
                       self._step_out_specs(specs), donate=(0,))
    return grads, update
