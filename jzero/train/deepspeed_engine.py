"""DeepSpeed's engine as a script holds it: :class:`DeepSpeedEngine`, a thin adapter over
:class:`jzero.Engine`.

``engine, optimizer, dataloader, lr_scheduler = jzero.initialize(...)`` unpacks as DeepSpeed's
4-tuple: this adapter, :class:`DeepSpeedOptimizer`, the engine's data loader and
:class:`DeepSpeedScheduler` (None without a scheduler block, as DeepSpeed). Unlike jzero's engine,
whose train state is a value the caller keeps, the adapter holds the state, as DeepSpeed's engine
holds the model: ``loss = engine(batch); engine.backward(loss); engine.step()`` runs one compiled
``train_step`` (at ``engine(batch)``, whose loss it returns) and commits it at ``step()``;
``save_checkpoint(save_dir, tag, client_state)`` and ``load_checkpoint(load_dir, tag)`` take and
return what DeepSpeed's do. Every other public name of DeepSpeed 0.19's ``DeepSpeedEngine`` is a row
of :data:`jzero.train.deepspeed_names.NAMES`: implemented here, or refused from that table with a
:class:`~jzero.errors.JZeroError` naming jzero's way -- never an AttributeError. jzero's own engine
is ``DeepSpeedEngine.jzero_engine``; it computes everything, the adapter only translates.
"""

from __future__ import annotations

import collections.abc
import gc
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
from flax import nnx

from jzero.checkpoint import layout
from jzero.config.blocks import DTYPES
from jzero.config.messages import user_stacklevel
from jzero.errors import JZeroError, JZeroWarning
from jzero.runtime.data import DataLoader
from jzero.sharding.plan import flatten_paths
from jzero.train.deepspeed_names import NAMES, refusal_message

if TYPE_CHECKING:  # annotations only
  from jzero.train.engine import Engine
  from jzero.train.state import TrainState

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizer", "DeepSpeedScheduler", "ParamGroup"]

PyTree = Any

_TRAIN_STEP = "state, metrics = engine.jzero_engine.train_step(state, batch)"


def _zero(cfg: Any) -> Any:
  return cfg.zero_optimization


def _offload(cfg: Any) -> Any:
  return cfg.zero_optimization.offload_optimizer


def _dump(block: Any) -> Any:
  return None if block is None else block.model_dump(by_alias=True)


#: The config getters (``works``: the resolved config's value), by DeepSpeed's name.
_CONFIG_GETTERS: dict[str, Callable[[Any], Any]] = {
    "train_batch_size": lambda c: c.train_batch_size,
    "train_micro_batch_size_per_gpu": lambda c: c.train_micro_batch_size_per_gpu,
    "gradient_accumulation_steps": lambda c: c.gradient_accumulation_steps,
    "steps_per_print": lambda c: c.steps_per_print,
    "wall_clock_breakdown": lambda c: c.wall_clock_breakdown,
    "memory_breakdown": lambda c: c.memory_breakdown,
    "dump_state": lambda c: c.dump_state,
    "gradient_clipping": lambda c: c.gradient_clipping,
    "dataloader_drop_last": lambda c: c.dataloader_drop_last,
    "gradient_predivide_factor": lambda c: c.gradient_predivide_factor,
    "postscale_gradients": lambda c: not c.prescale_gradients,
    "optimizer_params": lambda c: dict(c.optimizer.params) if c.optimizer else None,
    "scheduler_name": lambda c: c.scheduler.type if c.scheduler else None,
    "scheduler_params": lambda c: dict(c.scheduler.params) if c.scheduler else None,
    "fp16_enabled": lambda c: c.precision == "fp16",
    "bfloat16_enabled": lambda c: c.precision == "bf16",
    "fp16_auto_cast": lambda c: c.fp16.auto_cast,
    "loss_scale": lambda c: c.fp16.loss_scale,
    "dynamic_loss_scale": lambda c: c.precision == "fp16" and c.fp16.loss_scale == 0,
    "initial_dynamic_scale": lambda c: 2 ** c.fp16.initial_scale_power,
    "dynamic_loss_scale_args": lambda c: (
        {"init_scale": 2 ** c.fp16.initial_scale_power, "scale_window": c.fp16.loss_scale_window,
         "delayed_shift": c.fp16.hysteresis, "consecutive_hysteresis":
         c.fp16.consecutive_hysteresis, "min_scale": c.fp16.min_loss_scale}
        if c.precision == "fp16" and c.fp16.loss_scale == 0 else None),
    "checkpoint_tag_validation_enabled": lambda c: c.checkpoint.tag_validation != "Ignore",
    "checkpoint_tag_validation_fail": lambda c: c.checkpoint.tag_validation == "Fail",
    "use_node_local_storage": lambda c: c.checkpoint.use_node_local_storage,
    "load_universal_checkpoint": lambda c: c.checkpoint.load_universal,
    "aio_config": lambda c: _dump(c.aio),
    "zero_optimization": lambda c: _zero(c).stage > 0,
    "zero_optimization_stage": lambda c: _zero(c).stage,
    "zero_optimization_partition_gradients": lambda c: _zero(c).stage >= 2,
    "zero_optimization_partition_weights": lambda c: _zero(c).stage == 3,
    "is_first_weights_partition_group": lambda c: _zero(c).stage == 3,
    "zero_allow_untested_optimizer": lambda c: c.zero_allow_untested_optimizer,
    "zero_force_ds_cpu_optimizer": lambda c: c.zero_force_ds_cpu_optimizer,
    "zero_reduce_scatter": lambda c: _zero(c).reduce_scatter,
    "zero_overlap_comm": lambda c: _zero(c).overlap_comm,
    "zero_offload_optimizer": lambda c: _dump(_offload(c)),
    "zero_offload_param": lambda c: _dump(_zero(c).offload_param),
    "zero_use_cpu_optimizer": lambda c: _offload(c) is not None and _offload(c).device in (
        "cpu", "nvme"),
    "zero_cpu_offload": lambda c: _offload(c) is not None and _offload(c).device == "cpu",
    "zero_nvme_offload_optimizer": lambda c: _offload(c) is not None and _offload(
        c).device == "nvme",
    "zero_partial_offload": lambda c: _offload(c).ratio if _offload(c) is not None else 1.0,
    "super_offload": lambda c: _offload(c) is not None and _offload(c).super_offload,
    "cpuadam_cores_perc": lambda c: _offload(c).cpuadam_cores_perc if _offload(c) else 0.8,
    "zero_sub_group_size": lambda c: _zero(c).sub_group_size,
    "zero_reduce_bucket_size": lambda c: _zero(c).reduce_bucket_size,
    "zero_multi_rank_bucket_allreduce": lambda c: _zero(c).use_multi_rank_bucket_allreduce,
    "zero_allgather_bucket_size": lambda c: _zero(c).allgather_bucket_size,
    "zero_contiguous_gradients": lambda c: _zero(c).contiguous_gradients,
    "zero_elastic_checkpoint": lambda c: _zero(c).elastic_checkpoint,
    "zero_max_live_parameters": lambda c: _zero(c).max_live_parameters,
    "zero_max_reuse_distance": lambda c: _zero(c).max_reuse_distance,
    "zero_prefetch_bucket_size": lambda c: _zero(c).prefetch_bucket_size,
    "zero_module_granularity_threshold": lambda c: _zero(c).module_granularity_threshold,
    "zero_param_persistence_threshold": lambda c: _zero(c).param_persistence_threshold,
    "zero_model_persistence_threshold": lambda c: _zero(c).model_persistence_threshold,
    "zero_gather_16bit_weights_on_model_save":
        lambda c: _zero(c).gather_16bit_weights_on_model_save,
    "zero_ignore_unused_parameters": lambda c: _zero(c).ignore_unused_parameters,
    "zero_save_muon_momentum_buffer_in_memory":
        lambda c: _zero(c).save_muon_momentum_buffer_in_memory,
    "zero_allgather_partitions": lambda c: _zero(c).allgather_partitions,
    "zero_round_robin_gradients": lambda c: _zero(c).round_robin_gradients,
    "zero_hpz_partition_size": lambda c: _zero(c).zero_hpz_partition_size,
    "zero_quantized_weights": lambda c: _zero(c).zero_quantized_weights,
    "zero_quantized_nontrainable_weights": lambda c: _zero(c).zero_quantized_nontrainable_weights,
    "zero_quantized_gradients": lambda c: _zero(c).zero_quantized_gradients,
    "zero_log_trace_cache_warnings": lambda c: _zero(c).log_trace_cache_warnings,
    "zero_allgather_sequential": lambda c: _zero(c).allgather_sequential,
    "is_sanity_checks_enabled": lambda c: _zero(c).enable_sanity_checks,
}

#: DeepSpeed getters whose answer is always the same in jzero (the table's note says why).
_CONSTANTS: dict[str, Any] = {
    **dict.fromkeys(
        ("fp16_master_weights_and_gradients", "bf16_master_weights_and_gradients",
         "bf16_optimizer_states", "torch_autocast_enabled", "data_efficiency_enabled",
         "data_sampling_enabled", "curriculum_learning_enabled", "random_ltd_enabled",
         "zero_legacy_stage1", "flops_profiler_enabled", "autotuning_enabled",
         "is_deepcompile_enabled", "is_deepcompile_active"), False),
    "zero_load_from_fp32_weights": True, "zero_compute_grad_norm": True,
    "get_model_parallel_rank": 0, "get_tensor_parallel_rank": 0,
}


def _check_one_step(config: Any, leaves: list) -> None:
  """DeepSpeed's gradient accumulation calls ``engine(micro_batch)`` once per micro-batch; here
  each call is one optimizer step: a single process's batch of another size is refused, saying
  so (several processes: the engine's batch check names the sizes)."""
  gas, size = config.gradient_accumulation_steps, config.train_batch_size
  rows = {np.shape(x)[0] for x in leaves if np.ndim(x)}
  if gas > 1 and jax.process_count() == 1 and rows and rows != {size}:
    raise JZeroError(
        f"engine(batch) got {max(rows)} rows with gradient_accumulation_steps = {gas}: "
        f"DeepSpeed's loop calls engine(micro_batch) {gas} times per optimizer step, but each "
        f"engine(batch) here is one optimizer step over train_batch_size = {size} rows, its "
        f"{gas} micro-batches accumulated inside the compiled step. Give engine(batch) the "
        f"{size} rows of one step.")


def _getter(fn: Callable[[Any], Any]) -> Callable[[DeepSpeedEngine], Any]:
  def get(self: DeepSpeedEngine) -> Any:
    return fn(self.jzero_engine.config)
  return get


_REFUSED_DOC = ("Refused in jzero, with a JZeroError that says why and what jzero does instead "
                "(its row of jzero.train.deepspeed_names.NAMES).")


def _refused_method(name: str) -> Callable[..., Any]:
  def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise JZeroError(refusal_message(name))
  refuse.__name__, refuse.__doc__ = name, _REFUSED_DOC
  return refuse


def _refused_attribute(name: str) -> property:
  def refuse(self: Any) -> Any:
    raise JZeroError(refusal_message(name))
  return property(refuse, doc=_REFUSED_DOC)


class DeepSpeedEngine:
  """DeepSpeed's engine over jzero's (module docstring). Made by ``jzero.initialize``'s unpack;
  ``jzero_engine`` is the :class:`jzero.Engine` that does the work, ``state`` the train state it
  holds (created at the first use from ``jax.random.key(seed)``, initialize's ``seed``)."""

  def __init__(self, engine: Engine, *, seed: int = 0, client_optimizer: Any = None,
               training_data: Any = None):
    self.jzero_engine = engine
    self.client_optimizer, self.training_data = client_optimizer, training_data
    self.client_lr_scheduler = self.mpu = self.collate_fn = None
    self.scale_wrt_gas = True
    self._seed, self._state, self._training = seed, None, True
    self._pending: tuple[Any, dict] | None = None  # engine(batch)'s step, until step()
    self._backward = False  # backward(loss) was called for the pending step
    self._metrics: dict | None = None  # the last committed step's
    self._bound: tuple[Any, Any] | None = None  # (state, the model on its weights)
    self.optimizer = DeepSpeedOptimizer(self)
    self.lr_scheduler = (DeepSpeedScheduler(self) if engine.schedule is not None
                         and engine.config.scheduler is not None else None)

  # -- the state it holds ---------------------------------------------------------------------
  @property
  def state(self) -> TrainState:
    """The train state the engine holds (jzero's :class:`~jzero.TrainState`)."""
    return self._ensure_state(None)

  @state.setter
  def state(self, state: TrainState) -> None:
    self._pending, self._bound, self._state = None, None, state

  def _ensure_state(self, batch: Any) -> TrainState:
    if self._pending is not None:
      raise JZeroError("engine(batch) ran a step that engine.backward(loss); engine.step() have "
                       "not committed yet: call them first (the state before it was donated to "
                       "the compiled step).")
    if self._state is None:
      self._state = self.jzero_engine.init(jax.random.key(self._seed), batch)
    return self._state

  # -- the loop: loss = engine(batch); engine.backward(loss); engine.step() ------------------
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.forward(*args, **kwargs)

  def forward(self, *args: Any, **kwargs: Any) -> Any:
    """Train mode: one compiled step on the batch (``engine(batch)``, ``engine(*tensors)`` or
    ``engine(**batch)``: the loss function gets that batch, the tuple or the dict), its loss
    returned; eval mode: the model's output on the current weights."""
    if not self._training:
      return self._evaluate(args, kwargs)
    if kwargs and args:
      raise JZeroError("engine(...) takes the batch as positional arguments or as keywords, not "
                       "both: jzero hands the loss function one batch (a dict for keywords).")
    batch = kwargs if kwargs else (args[0] if len(args) == 1 else tuple(args))
    engine = self.jzero_engine
    leaves = jax.tree.leaves(batch)
    _check_one_step(engine.config, leaves)
    state = self._ensure_state(batch)
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves):
      batch = engine.shard_batch(batch)
    self._state = None  # donated to the step
    self._pending = engine.train_step(state, batch)
    self._backward = False
    return self._pending[1]["loss"]

  def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
    """Checks ``loss`` is what ``engine(batch)`` returned: its gradient was taken in that step."""
    if self._pending is None or loss is not self._pending[1]["loss"]:
      raise JZeroError(
          "engine.backward(loss) takes the loss engine(batch) returned: jzero differentiates the "
          "loss inside the compiled step, so a loss computed outside it (e.g. criterion(outputs, "
          "labels)) has no gradient. Compute it in the step: jzero.initialize(..., loss_fn="
          "lambda model, batch: ...), then loss = engine(batch).")
    self._backward = True
    return loss

  def step(self, lr_kwargs: dict | None = None) -> None:
    """Commits the step ``engine(batch)`` ran (its update, the schedule's count)."""
    if lr_kwargs:
      raise JZeroError("engine.step(lr_kwargs=...): jzero's learning rate is the config's "
                       "scheduler block, a function of the step count; it takes no arguments.")
    if self._pending is None or not self._backward:
      raise JZeroError("engine.step() commits the step engine(batch) ran, after "
                       "engine.backward(loss): call loss = engine(batch); engine.backward(loss) "
                       "first.")
    self._state, self._metrics = self._pending
    self._pending, self._bound = None, None

  def zero_grad(self) -> None:
    """Nothing to do: jzero's gradients never outlive their step."""

  def train(self, mode: bool = True) -> DeepSpeedEngine:
    self._training = bool(mode)
    return self

  def eval(self) -> DeepSpeedEngine:
    return self.train(False)

  def _evaluate(self, args: tuple, kwargs: dict) -> Any:
    """The model's output on the current weights, in eval mode (dropout off)."""
    model = self.module
    return model(*args, **kwargs)

  def is_gradient_accumulation_boundary(self) -> bool:
    return True

  def was_step_applied(self) -> bool:
    return self._metrics is None or not bool(self._metrics["overflow"])

  def get_global_grad_norm(self) -> float | None:
    return None if self._metrics is None else float(self._metrics["grad_norm"])

  def get_lr(self) -> list[float]:
    return [self.jzero_engine.runner.reporter.next_lr()]

  def get_mom(self) -> list[Any]:
    optimizer = self.jzero_engine.config.optimizer
    if self.client_optimizer is not None or optimizer is None:
      raise JZeroError("engine.get_mom() reads the config optimizer's betas or momentum; a client "
                       "optax optimizer keeps its own (engine.optimizer.tx).")
    params = optimizer.params
    if "momentum" in params or optimizer.type.lower() == "sgd":
      return [params.get("momentum", 0.0)]
    return [tuple(params.get("betas", (0.9, 0.999)))]

  def get_batch_info(self) -> tuple[int, int, int]:
    c = self.jzero_engine.config
    return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps

  @property
  def global_steps(self) -> int:
    return self.jzero_engine.runner.step or 0

  @property
  def global_samples(self) -> int:
    return self.global_steps * self.jzero_engine.config.train_batch_size

  @property
  def micro_steps(self) -> int:
    return self.global_steps * self.jzero_engine.config.gradient_accumulation_steps

  @property
  def skipped_steps(self) -> int:
    if self._metrics is not None:
      return int(self._metrics["skipped"])
    return int(self._state.skipped) if self._state is not None else 0

  @property
  def losses(self) -> Any:
    return None if self._metrics is None else self._metrics["loss"]

  # -- the model, its parameters --------------------------------------------------------------
  @property
  def module(self) -> Any:
    """The model on the current weights (fp32), gathered to the host once per state, in the
    engine's mode (an NNX model's ``train()`` / ``eval()``)."""
    state = self.state
    if self._bound is None or self._bound[0] is not state:
      engine = self.jzero_engine
      model = engine.bind(engine.logical_params(state), state.model_state or None)
      self._bound = (state, model)
    model = self._bound[1]
    if isinstance(model, nnx.Module):
      if self._training:
        model.train()
      else:
        self.jzero_engine.model.evaluating(model)
    return model

  def module_state_dict(self, *args: Any, **kwargs: Any) -> PyTree:
    return self.jzero_engine.logical_params(self.state)

  state_dict = module_state_dict

  def parameters(self) -> list[Any]:
    return jax.tree.leaves(self.module_state_dict())

  def named_parameters(self) -> list[tuple[str, Any]]:
    return list(flatten_paths(self.module_state_dict()).items())

  @property
  def param_names(self) -> list[str]:
    return [leaf.path for leaf in self.jzero_engine.make_plan().leaf_list()]

  # -- checkpoints ----------------------------------------------------------------------------
  def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                      client_state: dict | None = None, save_latest: bool = True,
                      exclude_frozen_parameters: bool = False) -> bool:
    """DeepSpeed's call: the engine's state saved as ``save_dir/<tag>`` (default tag
    ``global_step<N>``), ``client_state`` beside it; True, as DeepSpeed."""
    if tag is None:
      tag = f"global_step{self.global_steps}"
    self.jzero_engine.save_checkpoint(self.state, save_dir, str(tag),
                                      client_state=dict(client_state or {}),
                                      save_latest=save_latest)
    return True

  def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None,
                      load_module_strict: bool = True, load_optimizer_states: bool = True,
                      load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                      custom_load_fn: Callable | None = None) -> tuple[str | None, dict | None]:
    """DeepSpeed's call and return: ``(load_path, client_state)``; the engine holds the restored
    state, and ``global_steps``, ``global_samples`` and ``get_lr()`` are the checkpoint's.
    ``(None, None)`` with a warning when ``load_dir`` holds no checkpoint (DeepSpeed's answer)."""
    if custom_load_fn is not None or not load_module_strict:
      raise JZeroError("load_checkpoint(custom_load_fn=..., load_module_strict=False): a jzero "
                       "checkpoint restores the model's whole parameter tree, checked leaf by "
                       "leaf; other weights come in with engine.jzero_engine.load_weights(path).")
    if load_lr_scheduler_states is False and load_optimizer_states and not load_module_only:
      raise JZeroError("load_checkpoint(load_lr_scheduler_states=False): jzero's schedule is a "
                       "function of the restored step count and cannot be left behind; "
                       "load_optimizer_states=False restores the weights alone (a fresh count).")
    self.jzero_engine.wait_for_checkpoints()  # this process's own saves, complete first
    if tag is None and layout.resume_tag(load_dir) is None:
      warnings.warn(f"load_checkpoint: {load_dir} holds no checkpoint (no `latest`): nothing "
                    f"was loaded, returning (None, None) as DeepSpeed does.", JZeroWarning,
                    stacklevel=user_stacklevel())
      return None, None
    weights_only = load_module_only or not load_optimizer_states
    self._pending = None
    state, client_state = self.jzero_engine.load_checkpoint(
        load_dir, tag, params_only=weights_only, with_client_state=True)
    self.state, self._metrics = state, None
    return str(layout.checkpoint_dir(load_dir, tag)), client_state

  def destroy(self) -> None:
    self.jzero_engine.wait_for_checkpoints()
    self._state = self._pending = self._bound = None

  def collect_python_gc(self) -> int:
    return gc.collect()

  # -- data ------------------------------------------------------------------------------------
  @property
  def training_dataloader(self) -> DataLoader | None:
    return self.jzero_engine.training_dataloader

  def deepspeed_io(self, dataset: Any, batch_size: int | None = None, **kwargs: Any) -> DataLoader:
    engine = self.jzero_engine
    size = engine.config.train_batch_size
    if batch_size not in (None, size) or kwargs:
      raise JZeroError(f"engine.deepspeed_io: jzero's loader yields global batches of "
                       f"train_batch_size = {size} placed on the mesh, and takes the dataset "
                       f"alone (got batch_size={batch_size}, {sorted(kwargs)}).")
    return DataLoader(dataset, size, engine.mesh.sharding(engine.mesh.batch_spec()))

  @staticmethod
  def is_map_style_dataset(obj: Any) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

  @staticmethod
  def is_iterable_style_dataset(obj: Any) -> bool:
    return hasattr(obj, "__iter__") and not hasattr(obj, "__getitem__")

  # -- the config, processes, devices ---------------------------------------------------------
  @property
  def config(self) -> dict:
    return self.jzero_engine.config.model_dump(by_alias=True)

  @property
  def monitor(self) -> Any:
    return self.jzero_engine.monitor

  def optimizer_name(self) -> str | None:
    if self.client_optimizer is not None:
      return type(self.client_optimizer).__name__
    optimizer = self.jzero_engine.config.optimizer
    return optimizer.type.lower() if optimizer is not None else None

  @property
  def communication_data_type(self) -> Any:
    c = self.jzero_engine.config
    return np.dtype(DTYPES[c.communication_data_type or c.precision])

  def get_data_types(self) -> tuple[Any, Any]:
    c = self.jzero_engine.config
    accum = c.data_types.grad_accum_dtype
    return np.dtype(DTYPES[c.precision]), np.dtype(DTYPES[accum] if accum else "float32")

  @property
  def gradient_average(self) -> bool:
    return self.jzero_engine.config.gradient_allreduce_op == "mean"

  @property
  def world_size(self) -> int:
    return self.jzero_engine.mesh.mesh.devices.size

  @property
  def dp_world_size(self) -> int:
    return self.jzero_engine.mesh.dp_size

  seq_dp_world_size = dp_world_size

  @property
  def global_rank(self) -> int:
    return jax.process_index()

  def get_data_parallel_rank(self) -> int:
    return jax.process_index()

  @property
  def local_rank(self) -> int:
    return int(os.environ.get("LOCAL_RANK", 0))

  @property
  def device(self) -> Any:
    return jax.local_devices()[0]

  @property
  def dist_backend(self) -> str:
    return jax.default_backend()

  mp_world_size = sequence_parallel_size = 1
  is_compiled, has_moe_layers, pipeline_parallelism = True, False, False

  def __getattr__(self, name: str) -> Any:  # only names not found otherwise
    raise AttributeError(
        f"{type(self).__name__} has no attribute {name!r}: not a name of DeepSpeed's engine "
        f"(jzero.train.deepspeed_names). DeepSpeed's engine hands other names to its module; "
        f"this one does not, since the model given to initialize is not the one training: "
        f"engine.module.{name} reads the model on the current weights, engine.jzero_engine is "
        f"jzero's engine.")

  def __repr__(self) -> str:
    return f"DeepSpeedEngine(jzero_engine={self.jzero_engine!r})"


for _name, _fn in _CONFIG_GETTERS.items():
  setattr(DeepSpeedEngine, _name, _getter(_fn))
for _name, _value in _CONSTANTS.items():
  setattr(DeepSpeedEngine, _name, (lambda v: lambda self: v)(_value))
for _name, _row in NAMES.items():
  if _row.status == "refused":
    setattr(DeepSpeedEngine, _name, _refused_method(_name) if _row.kind == "method"
            else _refused_attribute(_name))
del _name, _fn, _value, _row


class ParamGroup(collections.abc.Mapping):
  """One torch-style param group, read-only: jzero's learning rate is the schedule's."""

  def __init__(self, values: dict):
    self._values = values

  def __getitem__(self, key: str) -> Any:
    return self._values[key]

  def __iter__(self):
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)

  def __setitem__(self, key: str, value: Any) -> None:
    raise JZeroError(f"optimizer.param_groups[...][{key!r}] = ...: jzero's optimizer settings "
                     f"are the config's optimizer and scheduler blocks, compiled into the step; "
                     f"a learning rate set by hand would be ignored. Put the schedule in the "
                     f"config (scheduler block) or in an optax optimizer given to initialize.")


class DeepSpeedOptimizer:
  """The 4-tuple's optimizer: ``param_groups`` to read, ``zero_grad()``; ``tx`` is the optax
  transformation the step runs. ``step()`` and state dicts are refused, naming jzero's way."""

  def __init__(self, engine: DeepSpeedEngine):
    self._engine = engine

  @property
  def tx(self) -> Any:
    return self._engine.jzero_engine.tx

  @property
  def param_groups(self) -> list[ParamGroup]:
    optimizer = self._engine.jzero_engine.config.optimizer
    params = dict(optimizer.params) if optimizer is not None and (
        self._engine.client_optimizer is None) else {}
    if "betas" in params:
      params["betas"] = tuple(params["betas"])
    return [ParamGroup({**params, "lr": self._engine.get_lr()[0]})]

  @property
  def cur_scale(self) -> float:
    """The loss scale of the last step (fp16; 1.0 otherwise)."""
    metrics = self._engine._metrics
    return 1.0 if metrics is None else float(metrics["loss_scale"])

  loss_scale = cur_scale

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Nothing to do: jzero's gradients never outlive their step."""

  def step(self, *args: Any, **kwargs: Any) -> None:
    raise JZeroError("optimizer.step(): the engine applies the update in its step; with "
                     "DeepSpeed's loop that is engine.step() after loss = engine(batch); "
                     f"engine.backward(loss) (jzero's own: {_TRAIN_STEP}).")

  def state_dict(self) -> dict:
    raise JZeroError("optimizer.state_dict(): the optimizer state is part of the engine's "
                     "checkpoint: engine.save_checkpoint(save_dir) / load_checkpoint(load_dir).")

  load_state_dict = state_dict

  def __repr__(self) -> str:
    return f"DeepSpeedOptimizer(tx={self.tx!r})"


class DeepSpeedScheduler:
  """The 4-tuple's lr scheduler (the config's scheduler block): ``get_lr()``, ``get_last_lr()``,
  ``last_batch_iteration`` and ``state_dict()`` as DeepSpeed's; the engine steps it itself."""

  def __init__(self, engine: DeepSpeedEngine):
    self._engine = engine

  @property
  def last_batch_iteration(self) -> int:
    """DeepSpeed's count, -1 before the first applied step, then the applied steps less one."""
    return self._engine.jzero_engine.runner.reporter.applied() - 1

  def get_lr(self) -> list[float]:
    return self._engine.get_lr()

  get_last_lr = get_lr

  def state_dict(self) -> dict:
    return {"last_batch_iteration": self.last_batch_iteration}

  def __call__(self, count: Any) -> Any:
    """The schedule itself, ``count -> lr`` (optax's convention)."""
    return self._engine.jzero_engine.schedule(count)

  def step(self, *args: Any, **kwargs: Any) -> None:
    raise JZeroError("lr_scheduler.step(): the engine steps the config's schedule with each "
                     "engine.step() (as DeepSpeed's engine does for a scheduler it built); "
                     "stepping it again would skip learning rates. Its position is "
                     "engine.lr_scheduler.last_batch_iteration.")

  def load_state_dict(self, state_dict: dict) -> None:
    raise JZeroError("lr_scheduler.load_state_dict(...): the schedule's position is the step "
                     "count of the state, which engine.load_checkpoint(load_dir) restores.")

  def __repr__(self) -> str:
    return f"DeepSpeedScheduler(last_batch_iteration={self.last_batch_iteration})"
