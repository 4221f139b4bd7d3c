"""The training engine: ``jzero.initialize(...)`` -> ``engine.init`` / ``engine.train_step``.

The engine owns the configuration, the mesh, the plan and the compiled functions: it creates
the train state directly in the plan's placement (:meth:`Engine.init`), shards batches, runs and
logs steps, evaluates, reads parameters back, and saves / restores checkpoints
(:mod:`jzero.checkpoint`). What one step computes -- micro-batches, reductions, loss scaling,
clipping, the update and its gathers -- is :mod:`jzero.train.step`, which :class:`Engine` inherits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jzero import checkpoint
from jzero.analysis import flops as flops_lib
from jzero.analysis import memory_report as memory_report_lib
from jzero.analysis.hlo import StepTiming
from jzero.comm import program
from jzero.comm import zeropp as zpp
from jzero.config import Config
from jzero.config.blocks import DTYPES
from jzero.errors import DataError, JZeroError, JZeroWarning, Preempted
from jzero.modeling.gather_units import UnitRules, check_units, choose_units
from jzero.modeling.layer_scan import LayerPolicy, engine_context
from jzero.modeling.model_adapter import ModelAdapter
from jzero.runtime import distributed
from jzero.runtime.data import DataLoader, local_rows
from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths, make_plan
from jzero.sharding.zeropp import ZeroPP
from jzero.tiers import registry
from jzero.tiers.base import Tier
from jzero.train import input_checks
from jzero.train import monitor as monitor_lib
from jzero.train.precision import LossScaler
from jzero.train.state import TrainState
from jzero.train.step import StepBuilder, split_loss

if TYPE_CHECKING:  # annotations only
  from jzero.tiers.nvme_settings import NvmeSettings
  from jzero.tiers.nvme_store import NvmeStore

__all__ = ["Engine"]

PyTree = Any
logger = logging.getLogger("jzero")

_TRAIN_STEP_HINT = (
    "{call}: jzero's engine has no separate forward, backward and step (DeepSpeed's "
    "loss = engine(batch); engine.backward(loss); engine.step()). One compiled call does all "
    "three on the state it returns: state, metrics = engine.train_step(state, batch) "
    "(metrics['loss'] is the loss; engine.eval_loss(state, batch) evaluates without an update).")


@dataclasses.dataclass
class Engine(StepBuilder):
  """A model, a loss, a resolved config and a mesh, compiled into ZeRO train steps.

  Create with :func:`initialize`. ``plan`` exists after :meth:`init`.
  """

  config: Config
  mesh: ZeroMesh
  model: ModelAdapter
  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  schedule: Callable[[jax.Array], jax.Array] | None
  scaler: LossScaler
  stacked_layers: tuple[str, ...]
  plan: Plan | None = None
  zeropp: ZeroPP = dataclasses.field(default_factory=ZeroPP)
  training_dataloader: DataLoader | None = None
  timings: list[StepTiming] = dataclasses.field(default_factory=list)
  # shard_batch refuses integer inputs past the model's largest embedding table (an out-of-range
  # lookup gives NaN); set False when an integer leaf larger than that is not an embedding input.
  check_input_ids: bool = True
  _step_fns: dict = dataclasses.field(default_factory=dict, repr=False)  # variant -> jitted step
  _split_fns: dict = dataclasses.field(default_factory=dict, repr=False)  # variant -> two jits
  _eval_fn: Any = dataclasses.field(default=None, repr=False)
  _host_step: int | None = dataclasses.field(default=None, repr=False)
  _batch_structure: Any = dataclasses.field(default=None, repr=False)
  _batch_shapes: list = dataclasses.field(default_factory=list, repr=False)  # the steps' shapes
  _refresh_fn: Any = dataclasses.field(default=None, repr=False)
  nvme_settings: NvmeSettings | None = None  # the NVMe tier's (jzero.tiers.nvme)
  nvme_store: NvmeStore | None = dataclasses.field(default=None, repr=False)
  _tiers: tuple[Tier, ...] | None = dataclasses.field(default=None, repr=False)
  _last_lr: Any = dataclasses.field(default=None, repr=False)  # the last step's lr (on device)
  _unchecked_skip: Any = dataclasses.field(default=None, repr=False)  # (step, overflow array)
  _warned_skip: bool = dataclasses.field(default=False, repr=False)
  _polls_seen: int | None = dataclasses.field(default=None, repr=False)  # should_stop calls
  _saved: tuple[Path, int] | None = dataclasses.field(default=None, repr=False)  # (dir, step)
  # the config's tensorboard / csv_monitor / wandb writers (jzero.train.monitor), from initialize
  monitor: monitor_lib.Monitor = dataclasses.field(default_factory=monitor_lib.Monitor)
  tokens_per_sample: int | None = None  # tokens/s = samples/s x this (initialize's argument)
  # throughput: (step, time) when the last report on a step was done; a step compiled since
  _clock: tuple[int, float] | None = dataclasses.field(default=None, repr=False)
  _compiled_since_clock: bool = dataclasses.field(default=False, repr=False)
  # per step variant: the jitted functions with the abstract arguments to lower them again, and
  # their matmul FLOPs per device (jzero.analysis.flops)
  _flops_args: dict = dataclasses.field(default_factory=dict, repr=False)
  _flops: dict = dataclasses.field(default_factory=dict, repr=False)
  _flops_key: Any = dataclasses.field(default=None, repr=False)  # the variant that ran last
  _reported_memory: bool = dataclasses.field(default=False, repr=False)

  # -- configuration read by the step --------------------------------------------------------------
  @property
  def stage(self) -> int:
    return self.config.zero_optimization.stage

  @property
  def compute_dtype(self):
    return DTYPES[self.config.precision]

  @property
  def global_batch_size(self) -> int:
    return self.config.train_batch_size

  @property
  def gas(self) -> int:
    return self.config.gradient_accumulation_steps

  @property
  def micro_batch_size(self) -> int:
    return self.config.train_micro_batch_size_per_gpu

  # -- DeepSpeed's engine shapes -------------------------------------------------------------------
  def __iter__(self):
    """``engine, optimizer, dataloader, lr_scheduler = jzero.initialize(...)``: DeepSpeed's
    4-tuple (the optax transformation, ``training_dataloader`` and the schedule ``step -> lr``)."""
    return iter((self, self.tx, self.training_dataloader, self.schedule))

  @property
  def module(self) -> Any:
    """The model as given to :func:`initialize` (an NNX factory's module has abstract shapes):
    its structure. The parameters live in the TrainState: :meth:`logical_params`."""
    return self.model.module

  @property
  def global_steps(self) -> int:
    """Optimizer steps taken (DeepSpeed's ``engine.global_steps``), skipped ones included: the
    step number of the last state :meth:`train_step` returned (0 before the first)."""
    return self._host_step or 0

  def get_lr(self) -> list[float]:
    """The learning rate of the last step (DeepSpeed's ``engine.get_lr()``: one per param group;
    jzero has one group). Before the first step: the schedule's (or config's) first value. NaN for a
    client optimizer without ``optax.inject_hyperparams``."""
    if self._last_lr is not None:
      return [float(self._last_lr)]
    if self.schedule is not None:
      return [float(self.schedule(0))]
    lr = (self.config.optimizer.params.get("lr") if self.config.optimizer is not None else None)
    return [float("nan") if lr is None else float(lr)]

  def __call__(self, *args, **kwargs):
    raise JZeroError(_TRAIN_STEP_HINT.format(call="engine(batch)"))

  forward = __call__

  def backward(self, *args, **kwargs):
    raise JZeroError(_TRAIN_STEP_HINT.format(call="engine.backward(loss)"))

  def step(self, *args, **kwargs):
    raise JZeroError(_TRAIN_STEP_HINT.format(call="engine.step()"))

  def _is_stacked(self, path: str) -> bool:
    return any(path == s or path.startswith(s + "/") for s in self.stacked_layers)

  def checks_overflow(self) -> bool:
    """fp16, or bf16 with ``check_grad_overflow``: a step whose gradient is not finite is skipped
    and the loss scaler backs off."""
    precision = self.config.precision
    return precision == "fp16" or (precision == "bf16" and self.config.bf16.check_grad_overflow)

  # -- plan and shardings --------------------------------------------------------------------------
  def _make_plan(self, rng: jax.Array, sample_batch: Any) -> Plan:
    zero = self.config.zero_optimization
    accum = self.config.data_types.grad_accum_dtype
    comm = self.config.communication_data_type
    abstract = self.model.abstract_params(rng, sample_batch)
    units = None
    if zero.stage == 3:
      rules = UnitRules(classes=tuple(zero.leaf_module.classes),
                        names=tuple(zero.leaf_module.names),
                        name_suffixes=tuple(zero.leaf_module.name_suffixes),
                        granularity_threshold=zero.module_granularity_threshold)
      sizes = {path: math.prod(np.shape(x)) for path, x in flatten_paths(abstract).items()}
      units = choose_units(self.model.modules(rng, sample_batch), sizes, rules)
    plan = make_plan(
        abstract, stage=zero.stage, mesh=self.mesh,
        compute_dtype=self.compute_dtype,
        grad_accum_dtype=DTYPES[accum] if accum else jnp.float32,
        comm_dtype=DTYPES[comm] if comm else None, stacked=self._is_stacked,
        persistence_threshold=zero.param_persistence_threshold,
        model_persistence_threshold=zero.model_persistence_threshold,
        reduce_scatter=zero.reduce_scatter, reduce_bucket_size=zero.reduce_bucket_size,
        gather_bucket_size=zero.prefetch_bucket_size if zero.stage == 3 else zero.allgather_bucket_size,
        overlap_comm=bool(zero.overlap_comm), units=units, zeropp=self.zeropp,
        **registry.plan_settings(zero))
    check_units(plan, zero.max_live_parameters)
    registry.check_plan(plan, zero)
    return plan

  @property
  def tiers(self) -> tuple[Tier, ...]:
    """The tiers the plan and config use (:mod:`jzero.tiers.registry`), whose hooks the step and
    the engine call; empty before the plan exists."""
    if self._tiers is None and self.plan is not None:
      self._tiers = registry.active(self)
    return self._tiers or ()

  def _carrier(self) -> Tier | None:
    """The tier whose state the TrainState carries between steps (``TrainState.delayed``)."""
    return next((t for t in self.tiers if t.carries()), None)

  def _require_plan(self) -> Plan:
    if self.plan is None:
      raise JZeroError("the engine has no plan yet: call engine.init(rng) first (or "
                       "engine.load_checkpoint(...), which creates it).")
    return self.plan

  def state_specs(self) -> TrainState:
    """PartitionSpecs of every TrainState leaf (prefix tree)."""
    plan = self._require_plan()
    return TrainState(step=P(), skipped=P(), params=plan.param_specs(),
                      master=plan.state_specs() if plan.has_master else None,
                      opt_state=plan.opt_specs(self.tx), loss_scale=P(), rng=P(),
                      secondary=plan.secondary_specs(),
                      delayed=carrier.carried_specs(self) if (carrier := self._carrier()) else None)

  def state_memory_kinds(self) -> TrainState:
    """Memory kind of every TrainState leaf (prefix tree; None: JAX's default, the device). The
    master and optimizer state of host-tier leaves are on the host
    (:mod:`jzero.tiers.host_optimizer`), as are host-tier params
    (:mod:`jzero.tiers.host_params`)."""
    plan = self._require_plan()
    device = plan.memory_kind()
    if not plan.uses_host:
      return jax.tree.map(lambda _: device, self.state_specs(), is_leaf=lambda x: isinstance(x, P))
    return TrainState(step=device, skipped=device, params=plan.map(plan.param_memory_kind),
                      master=plan.map(plan.state_memory_kind) if plan.has_master else None,
                      opt_state=plan.opt_memory_kinds(self.tx), loss_scale=device, rng=device,
                      secondary=jax.tree.map(lambda _: device, plan.secondary_specs(),
                                             is_leaf=lambda x: isinstance(x, P)),
                      delayed=(carrier.carried_memory_kinds(self, device)
                               if (carrier := self._carrier()) else None))

  def state_shardings(self) -> TrainState:
    """NamedShardings of every TrainState leaf (prefix tree), with their memory kinds."""
    return self._shardings(self.state_specs(), self.state_memory_kinds())

  def _shardings(self, specs: PyTree, kinds: PyTree = None) -> PyTree:
    """NamedShardings of a spec tree; ``kinds``: a prefix tree of memory kinds (None: device)."""
    plan = self._require_plan()
    if kinds is None:
      return jax.tree.map(plan.sharding, specs, is_leaf=lambda x: isinstance(x, P))
    def expand(kind, sub):
      return jax.tree.map(lambda spec: plan.sharding(spec, kind), sub,
                          is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(expand, kinds, specs, is_leaf=lambda x: x is None or isinstance(x, str))

  def batch_sharding(self) -> NamedSharding:
    return self._require_plan().sharding(self._require_plan().batch_spec())

  # -- init ----------------------------------------------------------------------------------------
  def init(self, rng: jax.Array, sample_batch: Any = None, *, params: PyTree = None) -> TrainState:
    """Creates the train state directly in its ZeRO placement.

    Args:
      rng: a PRNG key; split into the model-init key and the training key (dropout etc.).
      sample_batch: Linen models: a batch to trace ``module.init`` with, unless ``initialize``
        got ``sample_batch`` or ``training_data``.
      params: start from these parameters (the model's logical shapes, e.g. imported weights)
        instead of the model's initialisation; optimizer state starts fresh. A partitioned leaf
        may also come as the plan lays out its param, a jax.Array zero-padded to
        ``plan.param_shape`` (``checkpoint.load_weights`` places them so): it stays sharded.
    """
    self._host_step = None  # a new state starts its own step count
    if self.plan is None:
      self.plan = self._make_plan(rng, sample_batch)
    plan, compute, tiers, carrier = self.plan, self.compute_dtype, self.tiers, self._carrier()
    for tier in tiers:
      tier.prepare(self)

    def to_layout(leaf: LeafPlan, x: jax.Array, partitioned: bool) -> jax.Array:
      if not partitioned:
        return leaf.to_logical(x)
      return x if x.shape == leaf.padded_shape else leaf.to_padded(x)  # given padded: as it is

    def make_state(rng, params):
      init_key, train_key = jax.random.split(rng)
      if params is None:
        params = self.model.init_params(init_key, sample_batch)
      p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
      state_layout = plan.map(lambda l, x: to_layout(l, x, l.state_partitioned), p32)
      params = plan.map(lambda l, x: to_layout(l, x, l.param_partitioned).astype(compute), p32)
      outputs = {}  # e.g. the NVMe store's initial masters; the state holds placeholders
      for tier in tiers:
        state_layout, params, out = tier.initial_layout(self, state_layout, params)
        if out is not None:
          outputs[tier.name] = out
      state = TrainState(
          step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32),
          params=params,
          master=state_layout if plan.has_master else None,
          opt_state=self.tx.init(state_layout), loss_scale=self.scaler.init(),
          rng=jax.random.key_data(train_key),
          delayed=carrier.initial_carried(state_layout) if carrier else None)
      return state, outputs

    shardings = self.state_shardings()._replace(secondary=None)
    output_shardings = {t.name: s for t in tiers
                        if (s := t.init_output_shardings(self)) is not None}
    shardings = (shardings, output_shardings)
    if params is None:
      params = self.model.initial_params
    if params is not None:
      input_checks.check_params(self.plan, params)
      state, outputs = jax.jit(make_state, out_shardings=shardings)(rng, params)
    else:
      state, outputs = jax.jit(lambda r: make_state(r, None), out_shardings=shardings)(rng)
    if not isinstance(state.step, jax.core.Tracer):  # not under eval_shape (a restore's shapes)
      for tier in tiers:
        if tier.name in outputs:
          tier.after_init(self, state, outputs[tier.name])
    return self.with_secondary(state)

  def with_secondary(self, state: TrainState) -> TrainState:
    """``state`` with its hpZ secondary partitions computed from its params -- by the code the
    step refreshes them with, so init, restore and a running step agree bit for bit. ``state``
    unchanged without hpZ."""
    plan = self._require_plan()
    if plan.zeropp.hpz <= 1:
      return state
    if self._refresh_fn is None:  # no compile options: also traced inside eval_shape(init)
      specs, out = plan.param_specs(), plan.secondary_specs()
      body = program.shard_map(plan, lambda p: plan.map(self._secondary, p), (specs,), out)
      to_sharding = lambda tree: jax.tree.map(plan.sharding, tree,
                                              is_leaf=lambda x: isinstance(x, P))
      self._refresh_fn = jax.jit(body, in_shardings=(to_sharding(specs),),
                                 out_shardings=to_sharding(out))
    return state._replace(secondary=self._refresh_fn(state.params))

  def _secondary(self, leaf: LeafPlan, p: jax.Array) -> jax.Array | None:
    """hpZ: a device's secondary partition of one leaf from its primary partition (in
    ``shard_map``)."""
    if not leaf.secondary:
      return None
    return zpp.refresh_secondary(p, leaf.shard_dim, self.plan.comm(leaf), int(leaf.stacked))

  # -- what the user passes (jzero.train.input_checks) -----------------------------------------------
  def check_live(self, state: TrainState, where: str) -> None:
    """Raises JZeroError if ``state`` was donated to a train step (its arrays are deleted)."""
    input_checks.check_live(state, where)

  def _check_batch(self, batch: PyTree) -> None:
    input_checks.check_arrays(batch)
    if self._batch_structure is None:  # the step is compiled for the first batch's structure
      self._batch_structure = jax.tree.structure(batch)
    input_checks.check_batch(batch, self._batch_structure, self.global_batch_size,
                             self.micro_batch_size, self.gas, self.mesh.dp_size)
    self._check_new_shapes(batch)

  def _check_new_shapes(self, batch: PyTree) -> None:
    if self.plan is not None:  # shapes the model cannot take (input_checks.check_new_shapes)
      input_checks.check_new_shapes(batch, self._batch_shapes, self._trace_loss)

  def _trace_loss(self, batch: PyTree) -> None:
    """The loss of the model over logical parameters on a micro-batch of ``batch``'s trailing
    shapes, traced abstractly: the model's own errors on those shapes, with no device work."""
    plan = self.plan
    params = plan.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, plan.compute_dtype))
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.micro_batch_size,) + x.shape[1:],
                                                        x.dtype), batch)

    def loss(params, mb):
      model = self.model.bind(params)
      if self.loss_takes_rng:
        return self.loss_fn(model, mb, rng=jax.random.key(0))
      return self.loss_fn(model, mb)

    jax.eval_shape(loss, params, micro)

  def _check_input_ids(self, batch: PyTree) -> None:
    if self.check_input_ids and self.plan is not None:
      input_checks.check_input_ids(self.plan, batch)

  def _after_step(self, state: TrainState, metrics: dict, outputs: dict) -> TrainState:
    """The tiers' work after the jitted step (e.g. the NVMe store's update of its leaves,
    committed before the step ends); ``outputs``: what the step returned for them, by name."""
    for tier in self.tiers:
      state = tier.after_step(self, state, metrics, outputs.get(tier.name))
    return state

  def _variants(self, state: TrainState | None, step: int | None, fused: bool = True) -> dict:
    """The step variant each tier asks for (:meth:`jzero.tiers.base.Tier.variant`), by name."""
    return {t.name: v for t in self.tiers
            if (v := t.variant(self, state, step, fused)) is not None}

  def variant_for(self, state: TrainState) -> dict:
    """The step variant each tier would run ``state`` with next, by tier name (e.g. the delayed
    update's prime step, ``{"delayed": False}``, for a state that carries no gradient)."""
    step = self._host_step if self._host_step is not None else int(state.step)
    return self._variants(state, step)

  @property
  def step_variants(self) -> tuple:
    """The variants of the fused step compiled so far (each a tuple of (tier, variant) pairs;
    ``()``: the plain step)."""
    return tuple(self._step_fns)

  def train_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch (leading dim ``train_batch_size``). Donates ``state``.

    Every ``steps_per_print`` steps the step's metrics are logged (logger ``jzero``) with the
    throughput since the last log. With ``wall_clock_breakdown`` the step runs as two jits,
    forward+backward+reduction then the update, each timed to completion
    (``block_until_ready``); the timings are appended to ``engine.timings`` and logged with the
    metrics. With a monitor in the config (``tensorboard``, ``csv_monitor``, ``wandb``) every
    step's metrics are written to it (:mod:`jzero.train.monitor`).

    Several processes: a collective that fails because a peer is gone is a JZeroError that says
    so; a preemption the script does not poll for raises :class:`jzero.Preempted`
    (:meth:`reached_preemption`).
    """
    with distributed.explained_peer_loss():
      return self._train_step(state, batch)

  def _train_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
    self._check_batch(batch)
    self.check_live(state, "train_step")
    if self._host_step is None:
      self._host_step = int(state.step)
    if self.config.wall_clock_breakdown:
      variants = self._variants(state, self._host_step, fused=False)
      key = tuple(sorted(variants.items()))
      if key not in self._split_fns:
        self._split_fns[key] = self._build_split_step(batch, variants)
        self._compiled_since_clock = True
      grads_fn, update_fn = self._split_fns[key]
      self._flops_key = ("split", key)
      lowered = self._flops_args.setdefault(self._flops_key, [])
      if not lowered:
        lowered.append((grads_fn, _abstract((state, batch))))
      t0 = time.perf_counter()
      grads = jax.block_until_ready(grads_fn(state, batch))
      t1 = time.perf_counter()
      if len(lowered) == 1:
        lowered.append((update_fn, _abstract((state, *grads))))
      state, metrics, outputs = jax.block_until_ready(update_fn(state, *grads))
      state = self._after_step(state, metrics, outputs)
      self.timings.append(StepTiming(step=self._host_step + 1, forward_backward_s=t1 - t0,
                                     optimizer_s=time.perf_counter() - t1))
    else:
      variants = self._variants(state, self._host_step)
      self._flops_key = tuple(sorted(variants.items()))
      self._compiled_since_clock |= self._flops_key not in self._step_fns
      step_fn = self._step_fn(batch, variants)
      if self._flops_key not in self._flops_args:
        self._flops_args[self._flops_key] = [(step_fn, _abstract((state, batch)))]
      state, metrics, outputs = step_fn(state, batch)
      state = self._after_step(state, metrics, outputs)
      for tier in self.tiers:
        tier.seen(state, variants.get(tier.name))
    self._host_step += 1
    self._last_lr = metrics["lr"]
    self._warn_first_skip(self._host_step, metrics["overflow"])
    if jax.process_count() > 1:
      self._raise_if_preempted(state)
    every = self.config.steps_per_print
    printing = every and self._host_step % every == 0 and jax.process_index() == 0  # one per job
    if printing or self.monitor.enabled:  # (the monitor writes on process 0 only)
      throughput = self._measure_throughput(metrics)
      if self.monitor.enabled:
        self._monitor_step(state, metrics, throughput)
      if printing:
        self._log_step(metrics, throughput)
      self._clock = (self._host_step, time.perf_counter())  # the reporting is not the step's time
    return state, metrics

  def throughput(self, step_seconds: float) -> monitor_lib.Throughput:
    """What steps of ``step_seconds`` each make per second -- samples, tokens (with
    ``tokens_per_sample``), model FLOPs utilization -- for the step variant that ran last (after a
    :meth:`train_step`). The FLOPs are read once per variant from its compiled program
    (:mod:`jzero.analysis.flops`), lowered again from its abstract arguments: XLA's compilation
    cache returns the program that ran, except for a step with host callbacks (the NVMe tiers),
    which compiles once more. The peak comes from the device or a measurement of it."""
    if self._flops_key is None:
      raise JZeroError("engine.throughput(...) needs a step first: it reads the FLOPs of the step "
                       "that ran (state, metrics = engine.train_step(state, batch)).")
    if self._flops_key not in self._flops:
      self._flops[self._flops_key] = sum(flops_lib.step_flops(fn.lower(*args).compile())
                                         for fn, args in self._flops_args[self._flops_key])
    devices = [d for d in self.mesh.mesh.devices.flat if d.process_index == jax.process_index()]
    return monitor_lib.Throughput(
        step_seconds=step_seconds, samples_per_step=self.global_batch_size,
        tokens_per_step=(self.global_batch_size * self.tokens_per_sample
                         if self.tokens_per_sample else None),
        flops_per_step=self._flops[self._flops_key], devices=len(devices),
        peak=flops_lib.peak_flops(self.compute_dtype, devices))

  def _measure_throughput(self, metrics: dict) -> monitor_lib.Throughput | None:
    """Waits for the step; the throughput since the last step reported on (None for the first,
    or when a step compiled in between)."""
    jax.block_until_ready(metrics["loss"])
    now, step, previous = time.perf_counter(), self._host_step, self._clock
    compiled, self._compiled_since_clock = self._compiled_since_clock, False
    if previous is None or compiled or step <= previous[0]:
      return None
    return self.throughput((now - previous[1]) / (step - previous[0]))

  def _monitor_step(self, state: TrainState, metrics: dict,
                    throughput: monitor_lib.Throughput | None) -> None:
    """Writes the step's events to the monitor; at its first step, the memory report's too."""
    local = next(d for d in self.mesh.mesh.devices.flat if d.process_index == jax.process_index())
    timing = self.timings[-1] if self.config.wall_clock_breakdown and self.timings else None
    events = monitor_lib.step_events(
        self._host_step, self.global_batch_size, metrics, fp16=self.config.precision == "fp16",
        throughput=throughput, timing=timing, memory_stats=local.memory_stats())
    if not self._reported_memory:
      self._reported_memory = True
      events += monitor_lib.memory_events(self.memory_report(state),
                                          self._host_step * self.global_batch_size)
    self.monitor.write_events(events)

  def reached_preemption(self, step: int) -> bool:
    """True on every process at the same ``step`` once any process got SIGTERM (a preemption):
    the flag a training loop reads after each step, as Orbax's ``reached_preemption`` (call it
    once per step with the same step numbers on every process; :func:`jzero.train.loop.train_loop`
    does). Then save and stop."""
    return distributed.should_stop(step)

  def _raise_if_preempted(self, state: TrainState) -> None:
    """Preemption for a script that does not poll for it (several processes; see
    :mod:`jzero.runtime.distributed`): if the script has not called :meth:`reached_preemption`
    (or ``should_stop``) since the last step, the engine asks, with the step number every process
    shares; at the sync point every process saves this step to the directory of the script's last
    ``save_checkpoint`` and raises :class:`jzero.Preempted` once the save is complete -- or, with
    no such directory, raises it at once, saying nothing was saved. The process is the script's
    to end: the engine never exits it.
    """
    previous, self._polls_seen = self._polls_seen, distributed.polls()
    if previous is None or previous != self._polls_seen:  # first step, or the script checks
      return
    step = self._host_step
    if not distributed.reached_sync_point(step):
      return
    if self._saved is None:
      raise Preempted(
          f"preempted (SIGTERM) at step {step}; nothing saved: the script neither polls "
          f"engine.reached_preemption(step) nor has saved with engine.save_checkpoint, so jzero "
          f"had nowhere to save. Poll reached_preemption after each step and save when it is "
          f"true (jzero.train.loop.train_loop does).", step=step, directory=None)
    directory, saved_step = self._saved
    if saved_step != step:
      self.save_checkpoint(state, directory)
    self.wait_for_checkpoints()
    raise Preempted(f"preempted (SIGTERM): every process stopped after step {step}, saved in "
                    f"{directory}; run the same command to resume from it.", step=step,
                    directory=str(directory))

  def _warn_first_skip(self, step: int, overflow: jax.Array) -> None:
    """Warns the first time a step was skipped for a gradient that was not finite (fp16's loss
    scaler and bf16's check skip steps as their normal work, logged with the metrics instead). The
    flag read is the previous step's, after this step was dispatched: the device is never left idle
    waiting."""
    if self.config.precision != "fp32" or self._warned_skip:
      return
    previous, self._unchecked_skip = self._unchecked_skip, (step, overflow)
    if previous is not None and bool(previous[1]):
      self._warned_skip = True
      warnings.warn(
          f"step {previous[0]}: the gradient was not finite (NaN or inf), so the step was skipped: "
          f"parameters and optimizer state are unchanged. metrics['overflow'] flags such steps "
          f"and metrics['skipped'] counts them. Look for NaN or inf in the batch, an integer input "
          f"out of an embedding's range, or a loss that divides by zero.", JZeroWarning,
          stacklevel=3)

  def _log_step(self, metrics: dict, throughput: monitor_lib.Throughput | None) -> None:
    lr = float(metrics["lr"])
    line = (f"step {self._host_step}: loss {float(metrics['loss']):.4f} | grad_norm "
            f"{float(metrics['grad_norm']):.3f}{'' if np.isnan(lr) else f' | lr {lr:.3e}'} | "
            f"loss_scale {float(metrics['loss_scale']):g}"
            f"{' | overflow: step skipped' if bool(metrics['overflow']) else ''}")
    if self.config.wall_clock_breakdown and self.timings:
      t = self.timings[-1]
      line += (f" | time (ms) fwd+bwd {t.forward_backward_s * 1e3:.1f} | optimizer "
               f"{t.optimizer_s * 1e3:.1f} | total {t.total_s * 1e3:.1f}")
    if throughput is not None:
      rate = throughput.tokens_per_second
      line += (f" | {rate:,.0f} tokens/s" if rate is not None
               else f" | {throughput.samples_per_second:,.1f} samples/s")
      line += "" if throughput.mfu is None else f" | MFU {throughput.mfu:.1%}"
    logger.info(line)

  def jitted_step(self, batch: PyTree):
    """The jitted (not yet compiled) fused step, e.g. to lower or ``jax.export`` it (with the
    delayed update: the steady step, which applies the carried gradient)."""
    self._check_batch(batch)
    return self._step_fn(batch, self._variants(None, None))

  def _step_fn(self, batch: PyTree, variants: dict):
    """The fused step of ``variants`` (:meth:`_variants`), compiled once per variant."""
    key = tuple(sorted(variants.items()))
    if key not in self._step_fns:
      self._step_fns[key] = self._build_step(batch, variants)
    return self._step_fns[key]

  def compile_step(self, state: TrainState, batch: PyTree):
    """The compiled step (for ``memory_analysis()`` and the HLO) without running it."""
    return self.jitted_step(batch).lower(state, batch).compile()

  def local_rows(self) -> np.ndarray:
    """The rows of the global batch this process's devices hold, ascending (all of them in a
    single process): what a process loads when it reads only its part of the batch."""
    return local_rows(self.mesh.sharding(self.mesh.batch_spec()), self.global_batch_size)

  def shard_batch(self, batch: PyTree, *, process_local: bool | None = None) -> PyTree:
    """Places a host batch (numpy) on the mesh, split over the batch axes.

    ``batch`` is either the global batch (leading dim ``train_batch_size``, the same in every
    process) or this process's part of it: the rows :meth:`local_rows` names, in that order,
    assembled across processes with ``jax.make_array_from_process_local_data`` (DeepSpeed's way:
    each rank loads only its samples). ``process_local=None`` tells them apart by the leading
    dimension.
    """
    input_checks.check_arrays(batch)
    lead = {np.shape(x)[0] if np.shape(x) else None for x in jax.tree.leaves(batch)}
    if process_local is None:
      process_local = jax.process_count() > 1 and lead != {self.global_batch_size}
    self._check_input_ids(batch)
    if not process_local:
      self._check_batch(batch)
      return jax.device_put(batch, self.batch_sharding())
    n_local = len(self.local_rows())
    if lead != {n_local}:
      raise DataError(
          f"batch leaves have leading dimensions {sorted(lead, key=str)}; give either the global "
          f"batch (train_batch_size = {self.global_batch_size} rows: micro "
          f"{self.micro_batch_size} x gas {self.gas} x data-parallel size {self.mesh.dp_size}) "
          f"or this process's part of it, which must have {n_local} rows (the rows "
          f"engine.local_rows() names: `batch[engine.local_rows()]`).")
    self._check_batch(jax.tree.map(lambda x: np.broadcast_to(
        np.zeros((), np.asarray(x).dtype), (self.global_batch_size,) + np.shape(x)[1:]), batch))
    sharding = self.batch_sharding()
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        sharding, np.asarray(x), (self.global_batch_size,) + np.shape(x)[1:]), batch)

  def eval_loss(self, state: TrainState, batch: PyTree) -> float | tuple[float, dict]:
    """Mean loss of ``batch`` (leading dim a multiple of the data-parallel size), no update.

    Returns what the loss returns, averaged over the batch: a float, or ``(loss, aux)`` with each
    aux value a float (a Python number per leaf). Evaluation, as ``model.eval()`` in PyTorch: an
    NNX model is called in its eval mode (nnx's ``model.eval()``: Dropout deterministic, for this
    call only), and a loss with an ``rng`` parameter gets ``rng=None`` (a Linen model's dropout is
    off when the loss passes ``deterministic=rng is None``, README).
    """
    plan = self._require_plan()
    self.check_live(state, "eval_loss")
    input_checks.check_arrays(batch)
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
      if not np.shape(x) or np.shape(x)[0] % self.mesh.dp_size:
        raise DataError(f"eval batch leaf {jax.tree_util.keystr(path) or 'batch'} has shape "
                        f"{tuple(np.shape(x))}; its leading dimension must be a multiple of the "
                        f"data-parallel size {self.mesh.dp_size}.")
    self._check_new_shapes(batch)
    if self._eval_fn is None:
      def local_loss(params, secondary, mb):
        with engine_context(LayerPolicy()):
          model = self.model.evaluating(self._bind(self._grad_targets(params), params, secondary))
          out = self.loss_fn(model, mb, rng=None) if self.loss_takes_rng else self.loss_fn(model, mb)
        loss, aux = split_loss(out)
        mean = lambda x: lax.pmean(jnp.asarray(x).astype(jnp.float32), self.mesh.batch_axes)
        return mean(loss), jax.tree.map(mean, aux)

      specs = (plan.param_specs(), plan.secondary_specs(), plan.batch_spec())
      body = program.shard_map(plan, local_loss, specs, P())
      self._eval_fn = jax.jit(body)
    loss, aux = self._eval_fn(state.params, state.secondary,
                              jax.device_put(batch, self.batch_sharding()))
    if aux is None:
      return float(loss)
    return float(loss), jax.tree.map(lambda a: np.asarray(a).item() if np.ndim(a) == 0
                                     else np.asarray(a), aux)

  # -- reading the state back ----------------------------------------------------------------------
  def logical_params(self, state: TrainState, dtype: Any = jnp.float32) -> PyTree:
    """Parameters in the model's own shapes (padding removed), replicated, in ``dtype``.

    The fp32 master in mixed precision, the params themselves in fp32.
    """
    plan = self._require_plan()
    self.check_live(state, "logical_params")
    full = self.full_state(state)  # e.g. the NVMe tier's arrays, read from its store
    source = full.master if plan.has_master else full.params
    # Host-tier arrays (offload) are read on the device: a copy of the partitions, then gathered.
    source = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
                          if x.sharding.memory_kind not in (None, "device") else x, source)
    unpad = lambda leaf, x: leaf.to_logical(x).astype(dtype)
    return jax.jit(lambda s: plan.map(unpad, s), out_shardings=plan.sharding(P()))(source)

  # -- the state with what the tiers hold outside it ----------------------------------------------
  def full_state(self, state: TrainState) -> TrainState:
    """``state`` with the arrays the tiers hold outside it read in (the NVMe store's masters,
    optimizer state and params, laid out by the plan): what checkpoints save."""
    for tier in self.tiers:
      state = tier.full_state(self, state)
    return state

  def expand_abstract(self, abstract: TrainState) -> TrainState:
    """An abstract TrainState with the real shapes of what :meth:`full_state` reads in."""
    for tier in self.tiers:
      abstract = tier.expand_abstract(self, abstract)
    return abstract

  def absorb(self, state: TrainState) -> TrainState:
    """A full state (a restore) -> what the tiers hold taken in, as the step expects it."""
    for tier in self.tiers:
      state = tier.absorb(self, state)
    return state

  # -- checkpoints (jzero.checkpoint) -------------------------------------------------------------
  def save_checkpoint(self, state: TrainState, directory: str | Path | None = None,
                      tag: str | int | None = None, *, client_state: dict | None = None,
                      keep: int | None = None, save_latest: bool = True) -> str:
    """Starts an asynchronous sharded save of ``state`` as ``directory/<tag>``; returns the tag.

    DeepSpeed's ``save_checkpoint(save_dir, tag, client_state, save_latest)`` with the state
    passed explicitly. ``tag`` defaults to the state's step; ``client_state`` is any JSON-able
    dict, given back by ``load_checkpoint(..., with_client_state=True)``. The save finishes in the
    background; the program's end waits for it (see :mod:`jzero.checkpoint.save`).
    """
    if directory is None or not isinstance(state, TrainState):
      given = f"{state!r}" if isinstance(state, (str, Path)) else type(state).__name__
      raise JZeroError(
          f"save_checkpoint({given}, ...): jzero saves the state you pass, first: "
          f"engine.save_checkpoint(state, directory, tag) (DeepSpeed's save_checkpoint(save_dir, "
          f"tag) saves the engine's own state; jzero's state is what train_step returned).")
    tag = checkpoint.save_checkpoint(self, state, directory, tag, keep=keep,
                                     client_state=client_state, save_latest=save_latest)
    self._saved = (Path(directory), int(tag) if str(tag).isdigit() else None)
    return tag

  def load_checkpoint(self, directory: str | Path, tag: str | int | None = None, *,
                      params_only: bool = False, sample_batch: Any = None,
                      with_client_state: bool = False) -> Any:
    """Restores a checkpoint of any stage / device count into this engine's placement.

    ``tag`` names the checkpoint (default: the one ``latest`` names). Returns the TrainState, or
    ``(state, client_state)`` with ``with_client_state=True``.
    """
    self._host_step = None  # read from the restored state at its first step
    return checkpoint.load_checkpoint(self, directory, tag, params_only=params_only,
                                      sample_batch=sample_batch,
                                      with_client_state=with_client_state)

  def import_deepspeed(self, ds: Any, convert: Callable[[dict], PyTree], *,
                       rng: jax.Array | None = None, sample_batch: Any = None) -> TrainState:
    """Continues a DeepSpeed run: ``ds`` (``checkpoint.read_deepspeed``) placed in this engine's
    plan, ``convert`` mapping torch names to the params tree
    (:func:`jzero.checkpoint.import_deepspeed`)."""
    self._host_step = None  # read from the imported state at its first step
    return checkpoint.import_deepspeed(self, ds, convert, rng=rng, sample_batch=sample_batch)

  def wait_for_checkpoints(self) -> None:
    """Blocks until every pending save is finalized (``latest`` moved)."""
    checkpoint.wait_until_finished()

  def memory_report(self, state: TrainState, batch: PyTree = None):
    """Measured per-device bytes next to the estimator's prediction (:mod:`jzero.analysis.memory_report`)."""
    return memory_report_lib.memory_report(self, state, batch)

  def bind(self, params: PyTree) -> Any:
    """The user's model built from logical params (e.g. :meth:`logical_params`), for evaluation."""
    return self.model.bind(params)


def _abstract(tree: PyTree) -> PyTree:
  """``tree``'s arrays as ShapeDtypeStructs with their shardings: what lowers a jitted step again
  after its arguments were donated."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                     sharding=getattr(x, "sharding", None)), tree)
