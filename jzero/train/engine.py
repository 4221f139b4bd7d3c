"""The training engine: ``jzero.initialize(...)`` -> ``engine.init`` / ``engine.train_step``.

The engine wires; it computes nothing of a step. It owns the configuration, the mesh, the plan
(made once, :meth:`Engine.make_plan`: in ``initialize`` when it can be, else at ``init``), what
the plan's tiers own at run time (:attr:`Engine.resources`: the NVMe store) and the plan's
programs (:class:`jzero.train.programs.Programs`: one jitted step per step variant, built from the
:class:`~jzero.train.step.StepParts` of :func:`jzero.train.setup.step_parts`). On the host it
creates the train state in the plan's placement, shards and checks batches, runs the steps and
the update's work after them, reports on them (:mod:`jzero.train.reporting`) and evaluates; the
state outside a step (read back, checkpoints, imports) is :class:`jzero.train.state_io.StateIO`'s.
DeepSpeed's names are not the engine's: :mod:`jzero.train.deepspeed_engine` adapts them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from jzero.checkpoint.optax_import import host_or_mesh
from jzero.analysis.hlo import StepTiming
from jzero.config import Config
from jzero.config.blocks import DTYPES
from jzero.errors import JZeroError, refuse_deepspeed_call
from jzero.modeling.model_adapter import ModelAdapter
from jzero.runtime import distributed
from jzero.runtime.data import DataLoader
from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.plan import Plan
from jzero.sharding.zeropp import ZeroPP
from jzero.tiers import registry
from jzero.tiers.base import Resources, Tier
from jzero.tiers.delayed import DelayedUpdate, Variant
from jzero.train import deepspeed_names, input_checks, monitor as monitor_lib, reporting, setup
from jzero.train import step as step_lib
from jzero.train.batches import Batches
from jzero.train.precision import LossScaler
from jzero.train.programs import Programs
from jzero.train.step_runner import StepRunner
from jzero.train.state import TrainState
from jzero.train.state_io import StateIO

if TYPE_CHECKING:  # annotations only
  from jzero.tiers.nvme_store import NvmeStore

__all__ = ["Engine"]

PyTree = Any

@dataclasses.dataclass
class Engine(StateIO):
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
  # the config's tensorboard / csv_monitor / wandb writers (jzero.train.monitor), from initialize
  monitor: monitor_lib.Monitor = dataclasses.field(default_factory=monitor_lib.Monitor)
  tokens_per_sample: int | None = None  # tokens/s = samples/s x this (initialize's argument)
  # DeepSpeed's 4-tuple, made when the engine is unpacked (jzero.initialize sets it)
  unpack: Callable[[], tuple] | None = dataclasses.field(default=None, repr=False)
  # the delayed parameter update (jzero.tiers.delayed), from the config; None when it is off
  delayed: DelayedUpdate | None = dataclasses.field(init=False, default=None, repr=False)
  # what the plan's tiers own at run time, by tier name (jzero.tiers.base.Resources)
  resources: Resources = dataclasses.field(default_factory=dict, init=False, repr=False)
  _opened: bool = dataclasses.field(default=False, repr=False)  # the resources are open
  _built: Programs | None = dataclasses.field(default=None, repr=False)  # the plan's programs
  _batches: Batches | None = dataclasses.field(default=None, repr=False)
  runner: StepRunner | None = dataclasses.field(default=None, repr=False)  # the host's step driver

  def __post_init__(self):
    here = [d for d in self.mesh.mesh.devices.flat if d.process_index == jax.process_index()]
    self._batches = Batches(self.config, self.mesh)
    self.delayed = DelayedUpdate.from_config(self.config)
    self.runner = StepRunner(reporting.StepReporter(
        self.config, here, DTYPES[self.config.precision], self.monitor, self.tokens_per_sample,
        self.schedule))

  # -- the config's numbers; DeepSpeed's 4-tuple -----------------------------------------------
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
    4-tuple, its engine the adapter :class:`jzero.train.deepspeed_engine.DeepSpeedEngine` over
    this one (``unpack``, from :func:`jzero.initialize`)."""
    if self.unpack is None:
      raise JZeroError("DeepSpeed's 4-tuple comes from jzero.initialize(...); this engine was "
                       "made directly.")
    return iter(self.unpack())

  __call__ = refuse_deepspeed_call("engine(batch)")

  def __getattr__(self, name: str) -> Any:  # only names not found otherwise
    if name in deepspeed_names.NAMES:
      row = deepspeed_names.NAMES[name]
      raise JZeroError(
          f"engine.{name}: a name of DeepSpeed's engine, not of jzero.Engine. DeepSpeed's engine "
          f"is the first of initialize's 4-tuple (engine, optimizer, _, lr_scheduler = "
          f"jzero.initialize(...)); there it {'is refused' if row.status == 'refused' else 'works'}"
          f": {row.note}. jzero's engine trains with state, metrics = engine.train_step(state, "
          f"batch).")
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  @property
  def timings(self) -> list[StepTiming]:
    """``wall_clock_breakdown``: each step's forward+backward and update times."""
    return self.runner.reporter.timings

  # -- the plan, the tiers, the step's parts -------------------------------------------------------
  def _require_plan(self) -> Plan:
    if self.plan is None:
      raise JZeroError("the engine has no plan yet: call engine.init(rng) first (or "
                       "engine.load_checkpoint(...), which creates it).")
    return self.plan

  @property
  def tiers(self) -> tuple[type[Tier], ...]:
    """The tiers the plan uses (:func:`jzero.tiers.registry.active`), in the registry's order;
    empty before the plan exists."""
    return registry.active(self.plan) if self.plan is not None else ()

  @property
  def nvme_store(self) -> NvmeStore | None:
    """The NVMe tier's store (:mod:`jzero.tiers.nvme_store`; None without it)."""
    return self.resources.get("nvme")

  def _open(self) -> Resources:
    """What the plan's tiers own at run time (:meth:`jzero.tiers.base.Tier.open`), opened once,
    before the first state (the plan, once made, is the engine's for good)."""
    if not self._opened:
      self.resources = registry.open_resources(self.tiers, self._require_plan(), self.config,
                                               self.tx)
      self._opened = True
    return self.resources

  def _programs(self) -> Programs:
    """The plan's programs (:mod:`jzero.train.programs`), made once."""
    if self._built is None:
      self._built = Programs(setup.step_parts(
          self._require_plan(), self.config, self.model, self.loss_fn, self.tx, self.schedule,
          self.scaler, self.delayed, self._open()))
    return self._built

  @property
  def loss_takes_rng(self) -> bool:
    """Whether the loss has an ``rng`` parameter (:func:`jzero.train.step.takes_rng`)."""
    return step_lib.takes_rng(self.loss_fn)

  def state_specs(self) -> TrainState:
    """PartitionSpecs of every TrainState leaf (prefix tree)."""
    return self._programs().specs()

  def state_memory_kinds(self) -> TrainState:
    """Memory kind of every TrainState leaf (prefix tree; None: the device)."""
    return self._programs().kinds()

  def state_shardings(self) -> TrainState:
    """NamedShardings of every TrainState leaf (prefix tree), with their memory kinds."""
    return self._require_plan().shardings(self.state_specs(), self.state_memory_kinds())

  def batch_sharding(self) -> NamedSharding:
    return self._require_plan().sharding(self._require_plan().batch_spec())

  def gathered_working_set(self, state: TrainState | None = None,
                           batch: PyTree = None) -> tuple[int, int]:
    """Stage 3's (largest group gathered at once, elements gathered at the start): the plan's
    (:meth:`jzero.sharding.plan.Plan.gathered_working_set`), the largest group as the model
    really runs once measured from a ``state`` and ``batch`` (a unit inside the model's own
    ``nn.scan`` gathers one layer's slice per call; :func:`jzero.train.programs.gathered_groups`)."""
    largest, upfront = self._require_plan().gathered_working_set()
    if self.plan.stage != 3:
      return largest, upfront
    groups = self._programs().gathered(state, batch)
    return (max(groups, default=0) if groups is not None else largest), upfront

  def make_plan(self, sample_batch: Any = None) -> Plan:
    """The engine's plan, made once from the config and the model (``sample_batch``: a Linen
    model's, as :meth:`init` takes it): :func:`jzero.initialize` makes it when it can (an NNX
    model, or a sample batch), else :meth:`init` or a restore."""
    if self.plan is None:
      self.plan = setup.plan_from_config(self.config, self.mesh, self.model, self.stacked_layers,
                                         self.zeropp, jax.random.key(0), sample_batch, self.tx)
    return self.plan

  def abstract_state(self, sample_batch: Any = None, *, full: bool = True) -> TrainState:
    """The TrainState as ShapeDtypeStructs with their shardings, a pure function of the plan
    (:func:`jzero.train.setup.abstract_state`; makes the plan if needed): as checkpoints hold it
    (every array in its real shape, no hpZ secondary), or with ``full=False`` as
    :meth:`train_step` takes it (what a tier holds outside the state as its placeholders, the
    secondary partitions) -- what a step compiles for."""
    plan = self.make_plan(sample_batch)
    parts = self._programs().parts
    held = None if full else registry.held(parts.tiers, plan)
    abstract = setup.abstract_state(plan, self.model, parts.update, self.scaler, sample_batch,
                                    held)
    shardings = self.state_shardings()
    if full:
      shardings = shardings._replace(secondary=None)
    return jax.tree.map(lambda sharding, x: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), x), shardings,
        abstract, is_leaf=lambda x: isinstance(x, NamedSharding))

  # -- init -------------------------------------------------------------------------------------
  def init(self, rng: jax.Array, sample_batch: Any = None, *, params: PyTree = None,
           model_state: PyTree = None) -> TrainState:
    """Creates the train state directly in its ZeRO placement.

    Args:
      rng: a PRNG key. The model is initialised with it as it is: the parameters are
        ``module.init(rng, ...)["params"]`` for a Linen module, those of ``factory(nnx.Rngs(rng))``
        for an NNX factory -- what a plain Flax loop gets from the same key. The training key
        (dropout etc.) is ``split(rng)[1]`` (:func:`jzero.train.setup.train_key`).
      sample_batch: Linen models: a batch to trace ``module.init`` with, unless ``initialize``
        got ``sample_batch`` or ``training_data``.
      params: start from these parameters (the model's logical shapes, e.g. imported weights)
        instead of the model's initialisation; optimizer state starts fresh (to continue a plain
        optax run with its optimizer state: :meth:`import_optax`). numpy arrays, or jax arrays on
        any devices (an array on others, e.g. one device as plain Orbax restores it, is read to
        the host first). A partitioned leaf may also come as the plan lays out its param, a
        jax.Array zero-padded to ``plan.param_shape`` (``checkpoint.load_weights`` places them
        so): it stays sharded.
      model_state: start from this model state (``{collection: tree}``, e.g. a flax run's
        ``{"batch_stats": ...}``) instead of the model's initial one; arrays as ``params``.
    """
    self.make_plan(sample_batch)
    parts = self._programs().parts  # the tiers' resources opened first
    devices = list(self.mesh.mesh.devices.flat)
    rng = host_or_mesh(rng, devices, "rng")
    if params is not None:
      params = host_or_mesh(params, devices, "params")
    if model_state is not None:
      model_state = host_or_mesh(model_state, devices, "model_state")
    state = setup.initial_state(self.plan, self.model, parts.update, self.scaler, parts.tiers,
                                parts.resources, self.state_shardings(), rng, sample_batch,
                                params, model_state)
    return self.runner.start(self.with_secondary(state), self.delayed)

  def with_secondary(self, state: TrainState) -> TrainState:
    """``state`` with its hpZ secondary partitions computed from its params -- by the code the
    step refreshes them with, so init, restore and a running step agree bit for bit. ``state``
    unchanged without hpZ."""
    if self._require_plan().zeropp.hpz <= 1:
      return state
    return state._replace(secondary=self._programs().refresh()(state.params))

  # -- batches (jzero.train.input_checks) ----------------------------------------------------------
  def check_live(self, state: TrainState, where: str) -> None:
    """Raises JZeroError if ``state`` was donated to a train step (its arrays are deleted)."""
    input_checks.check_live(state, where)

  def _check_input_ids(self, batch: PyTree) -> None:
    """The data loader's check of a batch's integer ids (``check_input_ids``)."""
    if self.check_input_ids and self.plan is not None:
      input_checks.check_input_ids(self.plan, batch)

  def _tracer(self) -> Callable[[PyTree], None] | None:
    """What checks a batch of new shapes against the model (None before the plan exists)."""
    return (functools.partial(step_lib.trace_loss, self._programs().parts)
            if self.plan is not None else None)

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
    return self._batches.shard(batch, self.batch_sharding, process_local, self._tracer(),
                               self.plan if self.check_input_ids else None)

  # -- steps ---------------------------------------------------------------------------------------
  def variant_for(self, state: TrainState) -> Variant | None:
    """The step variant ``state`` would run with next (e.g. the delayed update's prime step,
    ``Variant.PRIME``, for a state that carries no gradient; None: the plain step)."""
    step = self.runner.step
    return self.runner.variant(self.delayed, state,
                                step if step is not None else int(state.step))

  @property
  def step_variants(self) -> tuple:
    """The variants of the fused step built so far (:class:`jzero.tiers.delayed.Variant`; None:
    the plain step)."""
    return self._built.variants if self._built is not None else ()

  def jitted_step(self, batch: PyTree, variant: Variant | None = None):
    """The jitted (not yet compiled) fused step of ``variant``, to lower or ``jax.export``:
    ``engine.jitted_step(batch).lower(state, batch)``. With the delayed update the default is the
    step a new or restored state runs (``Variant.READ``: it reads the carried gradient's flag);
    :meth:`compile_step` compiles the steady one, :meth:`lowerable` labels a state for another
    variant (part of its tree structure: :class:`jzero.tiers.delayed.DelayedGrads`)."""
    self._batches.check(batch, self._tracer())
    if variant is None and self.delayed is not None:
      variant = Variant.READ
    return self._programs().fused(batch, variant)

  @property
  def steady_variant(self) -> Variant | None:
    """The variant of the step the engine runs once a delayed update applies a gradient every
    step (None without the delayed update)."""
    return self.runner.variant(self.delayed, None, None)

  def lowerable(self, state: TrainState, variant: Variant | None) -> TrainState:
    """``state`` labelled for the step :meth:`jitted_step` returns for ``variant``; ``state``
    itself without the delayed update."""
    return state if self.delayed is None else self.delayed.labelled(state, variant)

  def jitted_split_step(self, batch: PyTree, variant: Variant | None = None) -> tuple:
    """The step as two jits, ``(state, batch) -> grads`` and ``(state, *grads) -> (state,
    metrics, outputs)``: what ``wall_clock_breakdown`` times (with the delayed update, the step
    that reads the carried flag: ``Variant.READ``)."""
    if variant is None and self.delayed is not None:
      variant = Variant.READ
    return self._programs().split(batch, variant)

  def compile_step(self, state: TrainState, batch: PyTree):
    """The compiled step (for ``memory_analysis()`` and the HLO) without running it."""
    variant = self.steady_variant
    return self.jitted_step(batch, variant).lower(self.lowerable(state, variant), batch).compile()

  def train_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch (leading dim ``train_batch_size``). Donates ``state``.

    Every ``steps_per_print`` steps the metrics and the throughput are logged (logger ``jzero``);
    with ``wall_clock_breakdown`` the step runs as two jits (forward+backward+reduction, the
    update), each timed into ``engine.timings``; the config's monitors get every step's metrics.
    Several processes: a peer gone is a JZeroError saying so; a preemption the script does not
    poll for raises :class:`jzero.Preempted` after the save (:meth:`reached_preemption`)."""
    with distributed.explained_peer_loss():
      self._batches.check(batch, self._tracer())
      self.check_live(state, "train_step")
      return self.runner.run(self._programs(), not self.config.wall_clock_breakdown,
                              state, batch, self.memory_report, self.save_checkpoint,
                              self.wait_for_checkpoints)

  def throughput(self, step_seconds: float) -> monitor_lib.Throughput:
    """Samples, tokens (with ``tokens_per_sample``) and model FLOPs utilization per second of
    steps of ``step_seconds``, for the variant that ran last; its FLOPs read once from its program
    lowered again (:mod:`jzero.analysis.flops`; XLA's cache returns the one that ran, except with
    host callbacks, the NVMe tiers, which compile once more)."""
    return self.runner.reporter.throughput(step_seconds)

  def reached_preemption(self, step: int) -> bool:
    """True on every process at the same ``step`` once any process got SIGTERM (a preemption):
    the flag a training loop reads after each step, as Orbax's ``reached_preemption`` (call it
    once per step with the same step numbers on every process; :func:`jzero.train.loop.train_loop`
    does). Then save and stop."""
    return distributed.should_stop(step)

  def eval_loss(self, state: TrainState, batch: PyTree) -> float | tuple[float, dict]:
    """Mean loss of ``batch`` (leading dim a multiple of the data-parallel size), no update: a
    float, or ``(loss, aux)`` with each aux value a float. As ``model.eval()`` in PyTorch: an NNX
    model runs in eval mode (this call only), a loss with an ``rng`` parameter gets ``rng=None``
    (Linen: dropout off by ``deterministic=rng is None``, docs/getting-started.md), BatchNorm
    normalises by ``state.model_state``'s running statistics (NNX: ``model.eval()``; Linen: the
    loss's ``train=rng is not None``, as flax's ResNet) and leaves them as they are."""
    self._require_plan()
    self.check_live(state, "eval_loss")
    self._batches.check_eval(batch, self._tracer())
    loss, aux = self._programs().evaluate()(state.params, state.secondary, state.model_state,
                                            jax.device_put(batch, self.batch_sharding()))
    if aux is None:
      return float(loss)
    return float(loss), jax.tree.map(lambda a: np.asarray(a).item() if np.ndim(a) == 0
                                     else np.asarray(a), aux)
