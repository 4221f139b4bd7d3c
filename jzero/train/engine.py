"""The training engine: ``jzero.initialize(...)`` -> ``engine.init`` / ``engine.train_step``.

The engine wires; it computes nothing of a step. It owns the configuration, the mesh, the plan
(:meth:`Engine.init` makes it: the layout, then the tiers' placement) and the steps it built: one
:class:`jzero.train.step.BuiltStep` per step variant its tiers ask for, from
:func:`jzero.train.step.build_step` with the :class:`~jzero.train.step.StepParts` it assembles. On
the host it creates the train state in the plan's placement, shards and checks batches, runs the
steps and the tiers' work after them, reports on them (:mod:`jzero.train.reporting`), evaluates,
reads parameters back, and saves / restores checkpoints (:mod:`jzero.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jzero import checkpoint
from jzero.analysis import memory_report as memory_report_lib
from jzero.analysis.hlo import StepTiming
from jzero.comm import layouts, program
from jzero.config import Config
from jzero.config.blocks import DTYPES
from jzero.errors import JZeroError
from jzero.modeling.model_adapter import ModelAdapter
from jzero.runtime import distributed
from jzero.runtime.data import DataLoader
from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.plan import Plan
from jzero.sharding.zeropp import ZeroPP
from jzero.tiers import registry
from jzero.tiers.base import Tier
from jzero.train import input_checks, monitor as monitor_lib, reporting, setup
from jzero.train import state as state_lib
from jzero.train import step as step_lib
from jzero.train.batches import Batches
from jzero.train.precision import LossScaler
from jzero.train.preemption import PreemptionWatch
from jzero.train.state import TrainState

if TYPE_CHECKING:  # annotations only
  from jzero.tiers.nvme_settings import NvmeSettings
  from jzero.tiers.nvme_store import NvmeStore

__all__ = ["Engine"]

PyTree = Any

_TRAIN_STEP_HINT = (
    "{call}: jzero's engine has no separate forward, backward and step (DeepSpeed's "
    "loss = engine(batch); engine.backward(loss); engine.step()). One compiled call does all "
    "three on the state it returns: state, metrics = engine.train_step(state, batch) "
    "(metrics['loss'] is the loss; engine.eval_loss(state, batch) evaluates without an update).")


def _refuse(call: str) -> Callable[..., Any]:
  def refuse(self, *args, **kwargs):
    raise JZeroError(_TRAIN_STEP_HINT.format(call=call))
  return refuse


@dataclasses.dataclass
class Engine:
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
  # shard_batch refuses integer inputs past the model's largest embedding table (an out-of-range
  # lookup gives NaN); set False when an integer leaf larger than that is not an embedding input.
  check_input_ids: bool = True
  nvme_settings: NvmeSettings | None = None  # the NVMe tier's (jzero.tiers.nvme)
  nvme_store: NvmeStore | None = dataclasses.field(default=None, repr=False)
  # the config's tensorboard / csv_monitor / wandb writers (jzero.train.monitor), from initialize
  monitor: monitor_lib.Monitor = dataclasses.field(default_factory=monitor_lib.Monitor)
  tokens_per_sample: int | None = None  # tokens/s = samples/s x this (initialize's argument)
  _step_parts: step_lib.StepParts | None = dataclasses.field(default=None, repr=False)
  _steps: dict = dataclasses.field(default_factory=dict, repr=False)  # variant -> BuiltStep
  _split_steps: dict = dataclasses.field(default_factory=dict, repr=False)  # variant -> 2 jits
  _eval_fn: Any = dataclasses.field(default=None, repr=False)
  _refresh_fn: Any = dataclasses.field(default=None, repr=False)
  _tiers: tuple[Tier, ...] | None = dataclasses.field(default=None, repr=False)
  _host_step: int | None = dataclasses.field(default=None, repr=False)
  _batches: Batches | None = dataclasses.field(default=None, repr=False)
  _last_lr: Any = dataclasses.field(default=None, repr=False)  # the last step's lr (on device)
  _preemption: PreemptionWatch = dataclasses.field(default_factory=PreemptionWatch, repr=False)
  _reporter: reporting.StepReporter | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    here = [d for d in self.mesh.mesh.devices.flat if d.process_index == jax.process_index()]
    self._batches = Batches(self.config, self.mesh)
    self._reporter = reporting.StepReporter(self.config, here, DTYPES[self.config.precision],
                                            self.monitor, self.tokens_per_sample)

  # -- the config's numbers, DeepSpeed's engine shapes -------------------------------------------
  @property
  def global_batch_size(self) -> int:
    return self.config.train_batch_size

  @property
  def gas(self) -> int:
    return self.config.gradient_accumulation_steps

  @property
  def micro_batch_size(self) -> int:
    return self.config.train_micro_batch_size_per_gpu

  def __iter__(self):
    """``engine, optimizer, dataloader, lr_scheduler = jzero.initialize(...)``: DeepSpeed's
    4-tuple (the optax transformation, ``training_dataloader`` and the schedule ``step -> lr``)."""
    return iter((self, self.tx, self.training_dataloader, self.schedule))

  @property
  def module(self) -> Any:
    """The model as given to :func:`initialize` (an NNX factory's module has abstract shapes)."""
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

  # DeepSpeed's loss = engine(batch); engine.backward(loss); engine.step(): one call here
  __call__ = forward = _refuse("engine(batch)")
  backward, step = _refuse("engine.backward(loss)"), _refuse("engine.step()")

  @property
  def timings(self) -> list[StepTiming]:
    """``wall_clock_breakdown``: each step's forward+backward and update times."""
    return self._reporter.timings

  # -- the plan, the tiers, the step's parts -------------------------------------------------------
  def _require_plan(self) -> Plan:
    if self.plan is None:
      raise JZeroError("the engine has no plan yet: call engine.init(rng) first (or "
                       "engine.load_checkpoint(...), which creates it).")
    return self.plan

  @property
  def tiers(self) -> tuple[Tier, ...]:
    """The tiers the plan and config use (:mod:`jzero.tiers.registry`), in the registry's order;
    empty before the plan exists."""
    if self._tiers is None and self.plan is not None:
      self._tiers = registry.active(self)
    return self._tiers or ()

  def _carrier(self) -> Tier | None:
    """The tier whose state the TrainState carries between steps (``TrainState.delayed``)."""
    return next((t for t in self.tiers if t.carries()), None)

  def _parts(self) -> step_lib.StepParts:
    """What the engine's steps compute with (made once per plan)."""
    plan = self._require_plan()
    if self._step_parts is None or self._step_parts.plan is not plan:
      self._step_parts = step_lib.StepParts(
          plan=plan, model=self.model, loss_fn=self.loss_fn, tx=self.tx, schedule=self.schedule,
          scaler=self.scaler, tiers=self.tiers,
          settings=step_lib.StepSettings.from_config(self.config), tier_view=self)
    return self._step_parts

  @property
  def loss_takes_rng(self) -> bool:
    """Whether the loss has an ``rng`` parameter (:func:`jzero.train.step.takes_rng`)."""
    return step_lib.takes_rng(self.loss_fn)

  def state_specs(self) -> TrainState:
    """PartitionSpecs of every TrainState leaf (prefix tree)."""
    return state_lib.state_specs(self._require_plan(), self.tx, self._carrier(), self)

  def state_memory_kinds(self) -> TrainState:
    """Memory kind of every TrainState leaf (prefix tree; None: the device)."""
    return state_lib.state_memory_kinds(self._require_plan(), self.tx, self._carrier(), self)

  def state_shardings(self) -> TrainState:
    """NamedShardings of every TrainState leaf (prefix tree), with their memory kinds."""
    return self._require_plan().shardings(self.state_specs(), self.state_memory_kinds())

  def batch_sharding(self) -> NamedSharding:
    return self._require_plan().sharding(self._require_plan().batch_spec())

  def gathered_working_set(self) -> tuple[int, int]:
    """Stage 3's (largest group gathered at once, elements gathered at the start), as
    :meth:`jzero.sharding.plan.Plan.gathered_working_set` -- with the largest group as the traced
    step really gathers it once a step has been traced (a unit inside the model's own ``nn.scan``
    gathers one layer's slice per call, which the plan cannot see)."""
    largest, upfront = self._require_plan().gathered_working_set()
    traces = [b.trace for b in (*self._steps.values(), *(s[0] for s in self._split_steps.values()))]
    traced = [t.gathered for t in traces if t.gathered is not None]
    if traced and self.plan.stage == 3:
      largest = max(traced[-1], default=0)
    return largest, upfront

  # -- init -------------------------------------------------------------------------------------
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
      self.plan = setup.plan_from_config(self.config, self.mesh, self.model, self.stacked_layers,
                                         self.zeropp, rng, sample_batch)
    for tier in self.tiers:
      tier.prepare(self)
    state = setup.initial_state(self.plan, self.model, self.tx, self.scaler, self.tiers, self,
                                self.state_shardings(), rng, sample_batch, params)
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
      refresh = lambda p: plan.map(lambda l, x: layouts.secondary_partition(plan, l, x), p)
      self._refresh_fn = jax.jit(program.shard_map(plan, refresh, (specs,), out),
                                 in_shardings=(plan.shardings(specs),),
                                 out_shardings=plan.shardings(out))
    return state._replace(secondary=self._refresh_fn(state.params))

  # -- batches (jzero.train.input_checks) ----------------------------------------------------------
  def check_live(self, state: TrainState, where: str) -> None:
    """Raises JZeroError if ``state`` was donated to a train step (its arrays are deleted)."""
    input_checks.check_live(state, where)

  def _check_batch(self, batch: PyTree) -> None:
    self._batches.check(batch, self._tracer())

  def _tracer(self) -> Callable[[PyTree], None] | None:
    """What checks a batch of new shapes against the model (None before the plan exists)."""
    return functools.partial(step_lib.trace_loss, self._parts()) if self.plan is not None else None

  def _check_input_ids(self, batch: PyTree) -> None:
    if self.check_input_ids and self.plan is not None:
      input_checks.check_input_ids(self.plan, batch)

  def local_rows(self) -> np.ndarray:
    """The rows of the global batch this process's devices hold, ascending (all of them in a
    single process): what a process loads when it reads only its part of the batch."""
    return self._batches.local_rows()

  def shard_batch(self, batch: PyTree, *, process_local: bool | None = None) -> PyTree:
    """Places a host batch (numpy) on the mesh, split over the batch axes.

    ``batch`` is either the global batch (leading dim ``train_batch_size``, the same in every
    process) or this process's part of it: the rows :meth:`local_rows` names, in that order,
    assembled across processes with ``jax.make_array_from_process_local_data`` (DeepSpeed's way:
    each rank loads only its samples). ``process_local=None`` tells them apart by the leading
    dimension.
    """
    input_checks.check_arrays(batch)
    self._check_input_ids(batch)
    return self._batches.shard(batch, self.batch_sharding, process_local,
                               self._tracer())

  # -- steps ---------------------------------------------------------------------------------------
  def _variants(self, state: TrainState | None, step: int | None, fused: bool = True) -> dict:
    """The step variant each tier asks for (:meth:`jzero.tiers.base.Tier.variant`), by name."""
    return {t.name: v for t in self.tiers
            if (v := t.variant(self, state, step, fused)) is not None}

  def variant_for(self, state: TrainState) -> dict:
    """The step variant each tier would run ``state`` with next, by tier name (e.g. the delayed
    update's prime step, ``{"delayed": False}``, for a state that carries no gradient)."""
    return self._variants(state, self._host_step if self._host_step is not None
                          else int(state.step))

  @property
  def step_variants(self) -> tuple:
    """The variants of the fused step built so far (each a tuple of (tier, variant) pairs; ``()``:
    the plain step)."""
    return tuple(self._steps)

  def jitted_step(self, batch: PyTree, variants: dict | None = None):
    """The jitted (not yet compiled) fused step of ``variants`` (default: the steady step, e.g.
    the delayed update's step that applies the carried gradient), to lower or ``jax.export``."""
    self._check_batch(batch)
    return self._step(batch, self._variants(None, None) if variants is None else variants)

  def _step(self, batch: PyTree, variants: dict):
    """The fused step of ``variants`` (:meth:`_variants`), built once per variant."""
    key = tuple(sorted(variants.items()))
    if key not in self._steps:
      self._steps[key] = step_lib.build_step(self._parts(), self.state_specs(),
                                             self.state_memory_kinds(), batch, variants)
    return self._steps[key].fn

  def jitted_split_step(self, batch: PyTree, variants: dict | None = None) -> tuple:
    """The step as two jits, ``(state, batch) -> grads`` and ``(state, *grads) -> (state,
    metrics, outputs)``: what ``wall_clock_breakdown`` times."""
    key = tuple(sorted((variants or {}).items()))
    if key not in self._split_steps:
      self._split_steps[key] = step_lib.build_split_step(
          self._parts(), self.state_specs(), self.state_memory_kinds(), batch, variants)
    grads, update = self._split_steps[key]
    return grads.fn, update

  def compile_step(self, state: TrainState, batch: PyTree):
    """The compiled step (for ``memory_analysis()`` and the HLO) without running it."""
    return self.jitted_step(batch).lower(state, batch).compile()

  def train_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch (leading dim ``train_batch_size``). Donates ``state``.

    Every ``steps_per_print`` steps the step's metrics are logged (logger ``jzero``) with the
    throughput since the last log. With ``wall_clock_breakdown`` the step runs as two jits,
    forward+backward+reduction then the update, each timed to completion; the timings are
    appended to ``engine.timings`` and logged with the metrics. With a monitor in the config
    (``tensorboard``, ``csv_monitor``, ``wandb``) every step's metrics are written to it.

    Several processes: a collective that fails because a peer is gone is a JZeroError that says
    so; a preemption the script does not poll for raises :class:`jzero.Preempted` after the save
    (:meth:`reached_preemption`).
    """
    with distributed.explained_peer_loss():
      self._check_batch(batch)
      self.check_live(state, "train_step")
      if self._host_step is None:
        self._host_step = int(state.step)
      if self.config.wall_clock_breakdown:
        variants = self._variants(state, self._host_step, fused=False)
        key = tuple(sorted(variants.items()))
        built = key in self._split_steps
        grads_fn, update_fn = self.jitted_split_step(batch, variants)
        state, metrics = self._reporter.timed(("split", key), not built, grads_fn, update_fn,
                                              self._after_step, self._host_step + 1, state, batch)
      else:
        variants = self._variants(state, self._host_step)
        key = tuple(sorted(variants.items()))
        built = key in self._steps
        fn = self._step(batch, variants)
        lowering = lambda: [(fn, reporting.abstract_arguments((state, batch)))]
        self._reporter.running(key, not built, lowering)
        state, metrics, outputs = fn(state, batch)
        state = self._after_step(state, metrics, outputs)
        for tier in self.tiers:
          tier.seen(state, variants.get(tier.name))
      self._host_step += 1
      self._last_lr = metrics["lr"]
      self._reporter.after_step(self._host_step, metrics, lambda: self.memory_report(state))
      if jax.process_count() > 1:  # a preemption the script does not poll for
        self._preemption.after_step(self._host_step, lambda d: self.save_checkpoint(state, d),
                                    self.wait_for_checkpoints)
      return state, metrics

  def _after_step(self, state: TrainState, metrics: dict, outputs: dict) -> TrainState:
    """The tiers' work after the jitted step (e.g. the NVMe store's update of its leaves,
    committed before the step ends); ``outputs``: what the step returned for them, by name."""
    for tier in self.tiers:
      state = tier.after_step(self, state, metrics, outputs.get(tier.name))
    return state

  def throughput(self, step_seconds: float) -> monitor_lib.Throughput:
    """What steps of ``step_seconds`` each make per second -- samples, tokens (with
    ``tokens_per_sample``), model FLOPs utilization -- for the step variant that ran last. The
    FLOPs are read once per variant from its compiled program (:mod:`jzero.analysis.flops`),
    lowered again from its abstract arguments: XLA's compilation cache returns the program that
    ran, except for a step with host callbacks (the NVMe tiers), which compiles once more."""
    return self._reporter.throughput(step_seconds)

  def reached_preemption(self, step: int) -> bool:
    """True on every process at the same ``step`` once any process got SIGTERM (a preemption):
    the flag a training loop reads after each step, as Orbax's ``reached_preemption`` (call it
    once per step with the same step numbers on every process; :func:`jzero.train.loop.train_loop`
    does). Then save and stop."""
    return distributed.should_stop(step)

  def eval_loss(self, state: TrainState, batch: PyTree) -> float | tuple[float, dict]:
    """Mean loss of ``batch`` (leading dim a multiple of the data-parallel size), no update.

    Returns what the loss returns, averaged over the batch: a float, or ``(loss, aux)`` with each
    aux value a float. Evaluation, as ``model.eval()`` in PyTorch: an NNX model is called in its
    eval mode (Dropout deterministic, for this call only), and a loss with an ``rng`` parameter
    gets ``rng=None`` (a Linen model's dropout is off when the loss passes
    ``deterministic=rng is None``, README).
    """
    self._require_plan()
    self.check_live(state, "eval_loss")
    self._batches.check_eval(batch, self._tracer())
    if self._eval_fn is None:
      self._eval_fn = step_lib.build_eval(self._parts())
    loss, aux = self._eval_fn(state.params, state.secondary,
                              jax.device_put(batch, self.batch_sharding()))
    if aux is None:
      return float(loss)
    return float(loss), jax.tree.map(lambda a: np.asarray(a).item() if np.ndim(a) == 0
                                     else np.asarray(a), aux)

  # -- the state read back, with what the tiers hold outside it -----------------------------------
  def logical_params(self, state: TrainState, dtype: Any = jnp.float32) -> PyTree:
    """Parameters in the model's own shapes (padding removed), replicated, in ``dtype``: the fp32
    master in mixed precision, the params themselves in fp32."""
    self.check_live(state, "logical_params")
    return state_lib.logical_params(self._require_plan(), self.full_state(state), dtype)

  def full_state(self, state: TrainState) -> TrainState:
    """``state`` with the arrays the tiers hold outside it read in (the NVMe store's masters,
    optimizer state and params, laid out by the plan): what checkpoints save."""
    return self._through_tiers("full_state", state)

  def expand_abstract(self, abstract: TrainState) -> TrainState:
    """An abstract TrainState with the real shapes of what :meth:`full_state` reads in."""
    return self._through_tiers("expand_abstract", abstract)

  def absorb(self, state: TrainState) -> TrainState:
    """A full state (a restore) -> what the tiers hold taken in, as the step expects it."""
    return self._through_tiers("absorb", state)

  def _through_tiers(self, hook: str, state: TrainState) -> TrainState:
    for tier in self.tiers:
      state = getattr(tier, hook)(self, state)
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
    self._preemption.saved = (Path(directory), int(tag) if str(tag).isdigit() else None)
    return tag

  def load_checkpoint(self, directory: str | Path, tag: str | int | None = None, *,
                      params_only: bool = False, sample_batch: Any = None,
                      with_client_state: bool = False) -> Any:
    """Restores a checkpoint of any stage / device count into this engine's placement. ``tag``
    names the checkpoint (default: the one ``latest`` names). Returns the TrainState, or
    ``(state, client_state)`` with ``with_client_state=True``."""
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
    """Measured per-device bytes next to the estimator's prediction
    (:mod:`jzero.analysis.memory_report`)."""
    return memory_report_lib.memory_report(self, state, batch)

  def bind(self, params: PyTree) -> Any:
    """The user's model built from logical params (e.g. :meth:`logical_params`), for evaluation."""
    return self.model.bind(params)

