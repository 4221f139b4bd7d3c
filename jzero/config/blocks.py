"""The blocks of a DeepSpeed config (``zero_optimization``, its offload blocks, ``fp16``, ``bf16``,
``optimizer``, ...) as pydantic models with DeepSpeed's defaults, aliases and deprecations, and the
scalar types they share (:mod:`jzero.config.schema` assembles them into :class:`Config`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import ml_dtypes
import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      field_validator, model_validator)

from jzero.config.messages import show, suggest, warn

__all__ = ["Auto", "DType", "DTYPES", "Flag", "AutoFlag", "Size", "AutoSize", "AutoInt", "AutoReal",
           "AutoFraction", "BatchSize", "accept_devices_from", "number", "replace_key",
           "OffloadParamConfig", "OffloadOptimizerConfig", "LeafModuleConfig", "ZeroConfig", "Fp16Config", "Bf16Config",
           "DataTypesConfig", "OptimizerConfig", "SchedulerConfig",
           "ActivationCheckpointingConfig", "AioConfig", "CheckpointConfig", "TensorBoardConfig",
           "CsvMonitorConfig", "WandbConfig", "CometConfig", "TrackioConfig", "CPU_ADAM", "cpu_offload_update",
           "OffloadUpdate"]

Auto = Literal["auto"]
DType = Literal["fp32", "fp16", "bf16"]
DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16),
          "fp16": np.dtype(np.float16)}
"""DeepSpeed's precision names ("fp32", "bf16", "fp16": config.precision, data_types,
communication_data_type) -> dtypes."""

CPU_ADAM = "cpu_adam"
"""``zero_optimization.offload_optimizer.update: "cpu_adam"`` (jzero's key): ZeRO-Offload's
schedule -- each layer's reduced gradient partition leaves the device in the backward pass, the
optimizer step runs on the host's cores outside the jitted step, the new 16-bit params are
uploaded. Its memory model: :mod:`jzero.analysis.update_memory`."""
STREAM = "stream"
"""``offload_optimizer.update: "stream"`` (jzero's key): the optimizer state in host memory, updated
on the device one leaf at a time inside the step (:mod:`jzero.tiers.host_optimizer`): what
``device: cpu`` runs where the host step cannot (a client optax optimizer, another optimizer
than Adam / AdamW, a mesh with replicas: :func:`jzero.tiers.host_step.update_refusals`)."""


def cpu_offload_update(offload_param: str | None) -> str:
  """The update ``offload_optimizer: {device: cpu}`` runs when the config names none and the host
  step can run the rest of it: :data:`CPU_ADAM`, as DeepSpeed runs its CPU Adam -- beside params on
  NVMe :data:`STREAM`, which keeps their optimizer state in host memory where the config puts it
  (the host step would leave it in the NVMe store with them). One rule for the engine
  (:func:`jzero.tiers.host_step.resolve_update`) and the estimator
  (:func:`jzero.analysis.update_memory.default_update`)."""
  return STREAM if offload_param == "nvme" else CPU_ADAM


OffloadUpdate = Literal["stream", "host", "cpu_adam"]
"""The values of ``offload_optimizer.update`` (:mod:`jzero.tiers.host_optimizer`'s modes and
:data:`CPU_ADAM`)."""


# --- scalar types: JSON numbers and booleans, checked the way a DeepSpeed user expects ---------


def number(integral: bool, lo: float | None = None, hi: float | None = None,
            nullable: bool = False) -> BeforeValidator:
  """Accepts JSON numbers (``5e8`` for an integer too) and "auto"; rejects bools and strings."""
  expected = "an integer" if integral else "a number"

  def check(value: Any) -> Any:
    if value == "auto" or (value is None and nullable):
      return value
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))):
      raise ValueError(f"expected {expected}, got {show(value)}")
    if integral and isinstance(value, float):
      if not value.is_integer():
        raise ValueError(f"expected {expected}, got {show(value)}")
      value = int(value)
    if lo is not None and value < lo:
      raise ValueError(f"must be >= {lo}, got {show(value)}")
    if hi is not None and value > hi:
      raise ValueError(f"must be <= {hi}, got {show(value)}")
    return value if integral else float(value)

  return BeforeValidator(check)


def _check_flag(value: Any) -> Any:
  """Accepts true/false and "auto" only (no 0/1 or "yes")."""
  if isinstance(value, bool) or value == "auto":
    return value
  raise ValueError(f"expected true or false, got {show(value)}")


def _check_name_or_flag(value: Any) -> Any:
  """Accepts true/false, "auto" and a name: what a registry answers (a tier's ``device`` value,
  a quantized collective's name) is checked where the registry is read, before any device work
  (:func:`jzero.tiers.registry.check_config`, :func:`jzero.sharding.zeropp.resolve`)."""
  if isinstance(value, (bool, str)):
    return value
  raise ValueError(f"expected true, false or a name, got {show(value)}")


#: Where an offload block's accepted ``device`` values come from: the tier registry, which hands
#: its lookup here when it is imported (:func:`accept_devices_from`; the config cannot import the
#: tiers, which read the config).
_TIER_DEVICES: list[Callable[[str], tuple[str, ...]]] = [lambda block: ()]


def accept_devices_from(lookup: Callable[[str], tuple[str, ...]]) -> None:
  """``lookup(block)``: the ``device`` values of ``zero_optimization.<block>`` some tier answers
  (:func:`jzero.tiers.registry.devices`); an offload block accepts those, "none" and "auto"."""
  _TIER_DEVICES[:] = [lookup]


def _check_device(block: str) -> BeforeValidator:
  """Accepts "none", "auto" and the ``device`` values a registered tier answers for ``block``,
  read when the config is validated (a tier registered later is accepted from then on)."""
  def check(value: Any) -> Any:
    accepted = ("none", *_TIER_DEVICES[0](block), "auto")
    if value not in accepted:
      names = [f"'{v}'" for v in accepted]
      raise ValueError(f"Input should be {', '.join(names[:-1])} or {names[-1]}, "
                       f"got {show(value)}")
    return value

  return BeforeValidator(check)


# "auto" passes the validators; the field type decides whether it is allowed (Auto in the type).
Flag = Annotated[bool, BeforeValidator(_check_flag)]
#: true / false / "auto", or the name of a quantized collective (jzero.sharding.quantization).
Quantization = Annotated[bool | str, BeforeValidator(_check_name_or_flag)]
AutoFlag = Annotated[bool | Auto, BeforeValidator(_check_flag)]
Size = Annotated[int, number(True, lo=0)]
AutoSize = Annotated[int | Auto, number(True, lo=0)]
AutoInt = Annotated[int | Auto, number(True)]
AutoReal = Annotated[float | Auto, number(False, lo=0)]
AutoFraction = Annotated[float | Auto, number(False, lo=0, hi=1)]
BatchSize = Annotated[int | Auto | None, number(True, lo=1, nullable=True)]


# --- blocks ----------------------------------------------------------------------------------


class _Block(BaseModel):
  """A block DeepSpeed validates with pydantic (``extra="forbid"``): unknown keys are errors."""

  model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())


class _LenientBlock(BaseModel):
  """A block DeepSpeed reads with ``dict.get``: unknown keys are dropped with a warning."""

  model_config = ConfigDict(extra="ignore", protected_namespaces=())
  key: ClassVar[str]
  retired: ClassVar[dict[str, str]] = {}  # keys DeepSpeed no longer reads -> why

  @model_validator(mode="before")
  @classmethod
  def _drop_unknown(cls, data: Any) -> Any:
    if isinstance(data, dict):
      for name in [k for k in data if k not in cls.model_fields]:
        why = cls.retired.get(name) or "unknown key, ignored (DeepSpeed ignores it too)"
        warn(f"{cls.key}.{name}: {why}{suggest(name, cls.model_fields)}")
    return data


def replace_key(data: dict, old: str, new: str | tuple[str, ...], where: str = "",
             convert: Callable[[Any], Any] = lambda value: value) -> None:
  """Maps deprecated key ``old`` to ``new`` (the key, then its alias) with a warning."""
  if old not in data:
    return
  new = (new,) if isinstance(new, str) else new
  if any(name in data for name in new):
    raise ValueError(f"Cannot provide deprecated parameter '{old}' and replacing parameter "
                     f"'{new[0]}' together")
  data[new[0]] = convert(data.pop(old))
  warn(f"{where}{old} is deprecated: jzero reads it as {where}{new[0]}={show(data[new[0]])}")


def _cpu_if(on: Any) -> dict | None:
  return {"device": "cpu"} if _check_flag(on) is True else None


class OffloadParamConfig(_Block):
  """``zero_optimization.offload_param`` (DeepSpeedZeroOffloadParamConfig; stage 3 only)."""

  # "cpu", "nvme", or another tier's value (jzero.tiers.registry)
  device: Annotated[str, _check_device("offload_param")] = "none"
  nvme_path: str | None = None
  buffer_count: AutoSize = 5
  buffer_size: AutoSize = 100_000_000
  max_in_cpu: AutoSize = 1_000_000_000
  pin_memory: AutoFlag = True


class OffloadOptimizerConfig(_Block):
  """``zero_optimization.offload_optimizer`` (DeepSpeedZeroOffloadOptimizerConfig)."""

  # "cpu", "nvme", or another tier's value (jzero.tiers.registry)
  device: Annotated[str, _check_device("offload_optimizer")] = "none"
  nvme_path: str | None = None
  buffer_count: AutoSize = 4
  pin_memory: AutoFlag = True
  pipeline_read: AutoFlag = False
  pipeline_write: AutoFlag = False
  fast_init: AutoFlag = False
  ratio: AutoFraction = 1.0
  super_offload: AutoFlag = False
  cpuadam_cores_perc: AutoFraction = 0.8
  # jzero's own key (not DeepSpeed's): how the host-resident state is updated
  # (jzero.tiers.host_optimizer).
  update: OffloadUpdate | None = None  # None: chosen at initialize (host_step.resolve_update)
  # jzero's own key: ZeRO-Offload's one-step delayed parameter update (jzero.tiers.delayed).
  delayed_update: Flag = False
  # jzero's own key: plain steps before the delayed update starts (the paper's warm-up).
  delayed_update_warmup: int = Field(0, ge=0)


class LeafModuleConfig(_Block):
  """``zero_optimization.leaf_module``: modules ZeRO-3 gathers as one unit (see jzero.modeling.gather_units)."""

  classes: list[str] = Field(default_factory=lambda: [
      "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
      "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
      "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
  ])
  names: list[str] = Field(default_factory=list)
  name_suffixes: list[str] = Field(default_factory=list)


class ZeroConfig(_Block):
  """``zero_optimization`` (DeepSpeedZeroConfig). ``overlap_comm`` None means "stage == 3"."""

  stage: AutoSize = 0
  contiguous_gradients: AutoFlag = True
  reduce_scatter: AutoFlag = True
  reduce_bucket_size: AutoSize = 500_000_000
  use_multi_rank_bucket_allreduce: AutoFlag = True
  allgather_partitions: AutoFlag = True
  allgather_bucket_size: AutoSize = 500_000_000
  overlap_comm: Annotated[bool | Auto | None,
                          BeforeValidator(lambda on: on if on is None else _check_flag(on))] = None
  load_from_fp32_weights: AutoFlag = True
  elastic_checkpoint: AutoFlag = False
  offload_param: OffloadParamConfig | None = None
  offload_optimizer: OffloadOptimizerConfig | None = None
  zenflow: dict[str, Any] | None = None
  sub_group_size: AutoSize = 1_000_000_000
  prefetch_bucket_size: AutoSize = Field(50_000_000, alias="stage3_prefetch_bucket_size")
  param_persistence_threshold: AutoSize = Field(100_000,
                                                alias="stage3_param_persistence_threshold")
  model_persistence_threshold: AutoSize = Field(2**63 - 1,
                                                alias="stage3_model_persistence_threshold")
  max_live_parameters: AutoSize = Field(1_000_000_000, alias="stage3_max_live_parameters")
  max_reuse_distance: AutoSize = Field(1_000_000_000, alias="stage3_max_reuse_distance")
  gather_16bit_weights_on_model_save: AutoFlag = Field(
      False, alias="stage3_gather_16bit_weights_on_model_save")
  module_granularity_threshold: AutoInt = Field(0, alias="stage3_module_granularity_threshold")
  use_all_reduce_for_fetch_params: AutoFlag = Field(
      False, alias="stage3_use_all_reduce_for_fetch_params")
  allgather_sequential: AutoFlag = Field(False, alias="stage3_allgather_sequential")
  ignore_unused_parameters: AutoFlag = True
  legacy_stage1: AutoFlag = False
  round_robin_gradients: AutoFlag = False
  zero_hpz_partition_size: AutoSize = 1
  # true (DeepSpeed's int8 / int4) or a strategy's name (jzero.sharding.quantization.WEIGHTS /
  # GRADIENTS, checked by jzero.sharding.zeropp.resolve)
  zero_quantized_weights: Quantization = False
  zero_quantized_nontrainable_weights: AutoFlag = False
  zero_quantized_gradients: Quantization = False
  zeropp_loco_param: dict[str, Any] | None = None
  mics_shard_size: AutoInt = -1
  mics_hierarchical_params_gather: AutoFlag = False
  memory_efficient_linear: AutoFlag = True
  pipeline_loading_checkpoint: AutoFlag = False
  override_module_apply: AutoFlag = True
  log_trace_cache_warnings: AutoFlag = False
  enable_sanity_checks: AutoFlag = False
  save_muon_momentum_buffer_in_memory: AutoFlag = False
  leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

  @model_validator(mode="before")
  @classmethod
  def _deprecated(cls, data: Any) -> Any:
    if not isinstance(data, dict):
      return data
    data = dict(data)
    for name, field in cls.model_fields.items():
      if field.alias and name in data and field.alias in data:
        raise ValueError(f"{field.alias} and {name} are the same setting; give one")
    where = "zero_optimization."
    replace_key(data, "cpu_offload", "offload_optimizer", where, _cpu_if)
    replace_key(data, "cpu_offload_param", "offload_param", where, _cpu_if)
    replace_key(data, "stage3_gather_fp16_weights_on_model_save",
             ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
             where)
    if "cpu_offload_use_pin_memory" in data:
      pin = _check_flag(data.pop("cpu_offload_use_pin_memory"))
      for block in ("offload_param", "offload_optimizer"):
        if isinstance(data.get(block), dict):
          if "pin_memory" in data[block]:
            raise ValueError("Cannot provide deprecated parameter 'cpu_offload_use_pin_memory' and "
                             f"replacing parameter '{block}.pin_memory' together")
          data[block] = {**data[block], "pin_memory": pin}
      warn(f"{where}cpu_offload_use_pin_memory is deprecated: jzero reads it as pin_memory="
            f"{show(pin)} of offload_param and offload_optimizer")
    return data

  @field_validator("stage")
  @classmethod
  def _max_stage(cls, stage: int | str) -> int | str:
    if stage != "auto" and stage > 3:
      raise ValueError(f"got {stage}: Maximum supported ZeRO stage is 3")
    return stage

  @field_validator("allgather_bucket_size")
  @classmethod
  def _even_bucket(cls, size: int | str) -> int | str:
    if size != "auto" and size % 2:
      raise ValueError(f"got {size}: allgather_bucket_size must be a multiple of "
                       "nccl_start_alignment_factor, 2")
    return size

  @field_validator("offload_optimizer")
  @classmethod
  def _partial_offload(cls, offload: OffloadOptimizerConfig | None, info: ValidationInfo):
    stage = info.data.get("stage")
    if offload and offload.ratio != "auto" and offload.ratio < 1 and stage not in (3, None):
      raise ValueError(f"ratio {offload.ratio} < 1 (partial offload) needs stage 3, got stage "
                       f"{stage}: Partial offloading only supported for ZeRO Stage 3.")
    return offload

  @model_validator(mode="after")
  def _overlap_comm_default(self) -> ZeroConfig:
    if self.overlap_comm is None and self.stage != "auto":
      self.overlap_comm = self.stage == 3
    return self


class Fp16Config(_Block):
  """``fp16`` (DeepSpeedFP16Config). ``loss_scale`` 0 means dynamic loss scaling."""

  enabled: AutoFlag = False
  auto_cast: AutoFlag = False
  loss_scale: AutoReal = 0.0
  initial_scale_power: AutoInt = 16
  loss_scale_window: AutoInt = 1000
  hysteresis: AutoInt = 2
  consecutive_hysteresis: AutoFlag = False
  min_loss_scale: AutoInt = 1
  fp16_master_weights_and_grads: AutoFlag = False

  @field_validator("loss_scale_window", "min_loss_scale")
  @classmethod
  def _dynamic_scaling(cls, value: int | str, info: ValidationInfo) -> int | str:
    dynamic = info.data.get("enabled") is True and info.data.get("loss_scale") == 0
    if dynamic and value != "auto" and value <= 0:
      raise ValueError(f"must be > 0 for dynamic loss scaling (loss_scale 0), got {value}")
    return value


class Bf16Config(_Block):
  """``bf16`` (DeepSpeedBF16Config; the legacy key ``bfloat16`` is read as ``bf16``)."""

  enabled: AutoFlag = False
  immediate_grad_update: AutoFlag = False
  check_grad_overflow: AutoFlag = True
  bf16_master_weights_and_grads: AutoFlag = False
  bf16_optimizer_states: AutoFlag = False


class DataTypesConfig(_Block):
  """``data_types``: the dtype gradients are accumulated in (None: the model's dtype)."""

  grad_accum_dtype: DType | None = None
  param_dtype: str | None = None
  buffer_dtype: str | None = None


def _finite_params(params: dict[str, Any]) -> dict[str, Any]:
  """The raw ``params`` of an optimizer / scheduler block, refused when a number in them is NaN or
  infinite: the config is written back as JSON (:meth:`jzero.config.Config.to_dict`), where such
  a number would become null, and the optimizer would then report a missing number."""
  for name, value in params.items():
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
      what = "finite numbers" if values is value else "a finite number"
      raise ValueError(f"{name} must be {what}, got {show(value)}")
  return params


class OptimizerConfig(_LenientBlock):
  """``optimizer``: ``type`` and ``params``, passed on raw to the optimizer (see jzero.train.optim,
  which checks each parameter's type and range); a NaN or infinite number is refused here."""

  key = "optimizer"
  type: str
  params: dict[str, Any] = Field(default_factory=dict)

  @field_validator("params")
  @classmethod
  def _no_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
    if "max_grad_norm" in params:
      raise ValueError("'max_grad_norm' is not supported as an optimizer parameter, please switch "
                       "to using the deepspeed parameter 'gradient_clipping'")
    return _finite_params(params)


class SchedulerConfig(_LenientBlock):
  """``scheduler``: ``type`` and ``params`` of a DeepSpeed LR schedule (a NaN or infinite number
  refused as in :class:`OptimizerConfig`)."""

  key = "scheduler"
  type: str
  params: dict[str, Any] = Field(default_factory=dict)

  _finite = field_validator("params")(classmethod(lambda cls, params: _finite_params(params)))


class ActivationCheckpointingConfig(_LenientBlock):
  """``activation_checkpointing``; its presence tells jzero to rematerialise layers."""

  key = "activation_checkpointing"
  partition_activations: Flag = False
  contiguous_memory_optimization: Flag = False
  cpu_checkpointing: Flag = False
  number_checkpoints: Annotated[int | None, number(True, lo=0, nullable=True)] = None
  synchronize_checkpoint_boundary: Flag = False
  profile: Flag = False


class AioConfig(_LenientBlock):
  """``aio``: the asynchronous I/O used for NVMe offload."""

  key = "aio"
  retired = {"thread_count": "DeepSpeed >= 0.16.4 ignores it (it is intra_op_parallelism now); "
                             "ignored"}
  block_size: Size = 1_048_576
  queue_depth: Size = 8
  intra_op_parallelism: Size = 1
  single_submit: Flag = False
  overlap_events: Flag = True
  use_gds: Flag = False


class CheckpointConfig(_LenientBlock):
  """``checkpoint``: tag validation and where checkpoints are written."""

  key = "checkpoint"
  tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
  load_universal: Flag = False
  use_node_local_storage: Flag = False
  parallel_write: dict[str, Any] = Field(default_factory=lambda: {"pipeline_stage": False})

  @field_validator("tag_validation", mode="before")
  @classmethod
  def _any_case(cls, mode: Any) -> Any:
    if isinstance(mode, str) and mode.capitalize() in ("Warn", "Ignore", "Fail"):
      return mode.capitalize()
    raise ValueError(f"expected Warn, Ignore or Fail (any case), got {show(mode)}")


# --- monitors: DeepSpeed's deepspeed/monitor/config.py (pydantic: unknown keys are errors) -------


class TensorBoardConfig(_Block):
  """``tensorboard``: event files in ``output_path/job_name`` (:mod:`jzero.train.monitor`)."""

  enabled: Flag = False
  output_path: str = ""  # "" (DeepSpeed's default): job_name relative to the working directory
  job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(_Block):
  """``csv_monitor``: one CSV file per metric in ``output_path/job_name``."""

  enabled: Flag = False
  output_path: str = ""
  job_name: str = "DeepSpeedJobName"


class WandbConfig(_Block):
  """``wandb``: a Weights & Biases run (``WANDB_MODE=offline`` keeps it local)."""

  enabled: Flag = False
  group: str | None = None
  team: str | None = None  # wandb's entity
  project: str = "deepspeed"


class CometConfig(_Block):
  """``comet`` (read so that its keys are checked; enabling it is refused)."""

  enabled: Flag = False
  samples_log_interval: int = 100
  project: str | None = None
  workspace: str | None = None
  api_key: str | None = None
  experiment_name: str | None = None
  experiment_key: str | None = None
  online: bool | None = None
  mode: str | None = None


class TrackioConfig(_Block):
  """``trackio`` (read so that its keys are checked; enabling it is refused)."""

  enabled: Flag = False
  project: str = "deepspeed"
