"""DeepSpeed's JSON config format, typed and validated.

jzero reads the configs DeepSpeed users already have (JSON, or the same schema in YAML) into
pydantic models that mirror DeepSpeed's own (``DeepSpeedZeroConfig``, ``DeepSpeedFP16Config``, ...)
with the defaults, aliases and deprecations of DeepSpeed 0.19.6. A config goes through three steps:

1. ``Config.load`` parses and validates. All problems of one config are reported together in one
   ConfigError, one line per key. Keys DeepSpeed rejects (unknown keys inside ``zero_optimization``,
   the offload blocks, ``fp16``, ``bf16``, ``data_types``) are errors with a "did you mean";
   keys DeepSpeed ignores (unknown top-level keys, unknown keys of the blocks it reads with
   ``dict.get``) are dropped with a JZeroWarning each.
2. ``Config.resolve`` replaces Hugging Face's ``"auto"`` values (kept as values until then) with
   numbers taken from the data-parallel size, the model's hidden size and ``auto_values``, and
   completes the batch-size triple exactly as DeepSpeed does (:mod:`jzero.autofill`). The
   result holds no "auto".
3. ``Config.check_supported`` is the one place that says what jzero honours: ``SUPPORT_TABLE``
   (:mod:`jzero.support`)
   lists every setting jzero refuses (NotSupportedError) or that has no effect under XLA
   (JZeroWarning). A setting not in the table is honoured by the module that reads it.

Attribute names are DeepSpeed's field names; the ``stage3_`` spellings are aliases, accepted in
input (as is the plain name) and written by ``to_dict``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from jzero.errors import ConfigError, JZeroWarning

Auto = Literal["auto"]
DType = Literal["fp32", "fp16", "bf16"]


def _show(value: Any) -> str:
  """A value as the user wrote it in JSON."""
  try:
    return json.dumps(value)
  except (TypeError, ValueError):
    return repr(value)


def _warn(message: str) -> None:
  warnings.warn(message, JZeroWarning, stacklevel=2)


def _suggest(key: Any, known: Any) -> str:
  match = difflib.get_close_matches(str(key), list(known), n=1)
  return f"; did you mean '{match[0]}'?" if match else ""


# --- scalar types: JSON numbers and booleans, checked the way a DeepSpeed user expects ---------


def _number(integral: bool, lo: float | None = None, hi: float | None = None,
            nullable: bool = False) -> BeforeValidator:
  """Accepts JSON numbers (``5e8`` for an integer too) and "auto"; rejects bools and strings."""
  expected = "an integer" if integral else "a number"

  def check(value: Any) -> Any:
    if value == "auto" or (value is None and nullable):
      return value
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))):
      raise ValueError(f"expected {expected}, got {_show(value)}")
    if integral and isinstance(value, float):
      if not value.is_integer():
        raise ValueError(f"expected {expected}, got {_show(value)}")
      value = int(value)
    if lo is not None and value < lo:
      raise ValueError(f"must be >= {lo}, got {_show(value)}")
    if hi is not None and value > hi:
      raise ValueError(f"must be <= {hi}, got {_show(value)}")
    return value if integral else float(value)

  return BeforeValidator(check)


def _check_flag(value: Any) -> Any:
  """Accepts true/false and "auto" only (no 0/1 or "yes")."""
  if isinstance(value, bool) or value == "auto":
    return value
  raise ValueError(f"expected true or false, got {_show(value)}")


# "auto" passes the validators; the field type decides whether it is allowed (Auto in the type).
Flag = Annotated[bool, BeforeValidator(_check_flag)]
AutoFlag = Annotated[bool | Auto, BeforeValidator(_check_flag)]
Size = Annotated[int, _number(True, lo=0)]
AutoSize = Annotated[int | Auto, _number(True, lo=0)]
AutoInt = Annotated[int | Auto, _number(True)]
AutoReal = Annotated[float | Auto, _number(False, lo=0)]
AutoFraction = Annotated[float | Auto, _number(False, lo=0, hi=1)]
BatchSize = Annotated[int | Auto | None, _number(True, lo=1, nullable=True)]


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
        _warn(f"{cls.key}.{name}: {why}{_suggest(name, cls.model_fields)}")
    return data


def _replace(data: dict, old: str, new: str | tuple[str, ...], where: str = "",
             convert: Callable[[Any], Any] = lambda value: value) -> None:
  """Maps deprecated key ``old`` to ``new`` (the key, then its alias) with a warning."""
  if old not in data:
    return
  new = (new,) if isinstance(new, str) else new
  if any(name in data for name in new):
    raise ValueError(f"Cannot provide deprecated parameter '{old}' and replacing parameter "
                     f"'{new[0]}' together")
  data[new[0]] = convert(data.pop(old))
  _warn(f"{where}{old} is deprecated: jzero reads it as {where}{new[0]}={_show(data[new[0]])}")


def _cpu_if(on: Any) -> dict | None:
  return {"device": "cpu"} if _check_flag(on) is True else None


class OffloadParamConfig(_Block):
  """``zero_optimization.offload_param`` (DeepSpeedZeroOffloadParamConfig; stage 3 only)."""

  device: Literal["none", "cpu", "nvme", "auto"] = "none"
  nvme_path: str | None = None
  buffer_count: AutoSize = 5
  buffer_size: AutoSize = 100_000_000
  max_in_cpu: AutoSize = 1_000_000_000
  pin_memory: AutoFlag = True


class OffloadOptimizerConfig(_Block):
  """``zero_optimization.offload_optimizer`` (DeepSpeedZeroOffloadOptimizerConfig)."""

  device: Literal["none", "cpu", "nvme", "auto"] = "none"
  nvme_path: str | None = None
  buffer_count: AutoSize = 4
  pin_memory: AutoFlag = True
  pipeline_read: AutoFlag = False
  pipeline_write: AutoFlag = False
  fast_init: AutoFlag = False
  ratio: AutoFraction = 1.0
  super_offload: AutoFlag = False
  cpuadam_cores_perc: AutoFraction = 0.8
  # jzero's own key (not DeepSpeed's): how the host-resident state is updated (jzero.offload).
  update: Literal["stream", "host"] | None = None  # None: jzero.offload.DEFAULT_UPDATE
  # jzero's own key: ZeRO-Offload's one-step delayed parameter update (jzero.delayed).
  delayed_update: Flag = False
  # jzero's own key: plain steps before the delayed update starts (the paper's warm-up).
  delayed_update_warmup: int = Field(0, ge=0)


class LeafModuleConfig(_Block):
  """``zero_optimization.leaf_module``: modules ZeRO-3 gathers as one unit (see jzero.units)."""

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
  zero_quantized_weights: AutoFlag = False
  zero_quantized_nontrainable_weights: AutoFlag = False
  zero_quantized_gradients: AutoFlag = False
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
    _replace(data, "cpu_offload", "offload_optimizer", where, _cpu_if)
    _replace(data, "cpu_offload_param", "offload_param", where, _cpu_if)
    _replace(data, "stage3_gather_fp16_weights_on_model_save",
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
      _warn(f"{where}cpu_offload_use_pin_memory is deprecated: jzero reads it as pin_memory="
            f"{_show(pin)} of offload_param and offload_optimizer")
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


class OptimizerConfig(_LenientBlock):
  """``optimizer``: ``type`` and ``params``, passed on raw to the optimizer (see jzero.optim)."""

  key = "optimizer"
  type: str
  params: dict[str, Any] = Field(default_factory=dict)

  @field_validator("params")
  @classmethod
  def _no_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
    if "max_grad_norm" in params:
      raise ValueError("'max_grad_norm' is not supported as an optimizer parameter, please switch "
                       "to using the deepspeed parameter 'gradient_clipping'")
    return params


class SchedulerConfig(_LenientBlock):
  """``scheduler``: ``type`` and ``params`` of a DeepSpeed LR schedule."""

  key = "scheduler"
  type: str
  params: dict[str, Any] = Field(default_factory=dict)


class ActivationCheckpointingConfig(_LenientBlock):
  """``activation_checkpointing``; its presence tells jzero to rematerialise layers."""

  key = "activation_checkpointing"
  partition_activations: Flag = False
  contiguous_memory_optimization: Flag = False
  cpu_checkpointing: Flag = False
  number_checkpoints: Annotated[int | None, _number(True, lo=0, nullable=True)] = None
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
    raise ValueError(f"expected Warn, Ignore or Fail (any case), got {_show(mode)}")


# --- the config --------------------------------------------------------------------------------


class Config(BaseModel):
  """A DeepSpeed config. Build it with ``Config.load``; equality ignores ``source``."""

  model_config = ConfigDict(extra="forbid", protected_namespaces=())

  train_batch_size: BatchSize = None
  train_micro_batch_size_per_gpu: BatchSize = None
  gradient_accumulation_steps: BatchSize = None
  gradient_clipping: AutoReal = 1.0  # 0 disables clipping
  steps_per_print: Annotated[int | None, _number(True, lo=1, nullable=True)] = None
  wall_clock_breakdown: Flag = False
  memory_breakdown: Flag = False
  dump_state: Flag = False
  dataloader_drop_last: Flag = False  # jzero's loader always drops it: says so when False
  fp16: Fp16Config = Field(default_factory=Fp16Config)
  bf16: Bf16Config = Field(default_factory=Bf16Config)  # after fp16: its check reads fp16
  optimizer: OptimizerConfig | None = None
  scheduler: SchedulerConfig | None = None
  zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
  zero_allow_untested_optimizer: Flag = False
  zero_force_ds_cpu_optimizer: Flag = True
  activation_checkpointing: ActivationCheckpointingConfig | None = None
  aio: AioConfig = Field(default_factory=AioConfig)
  data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
  communication_data_type: DType | None = None
  gradient_allreduce_op: Literal["mean", "sum"] = "mean"  # after zero_optimization: reads it
  prescale_gradients: Flag = False
  gradient_predivide_factor: Annotated[float, _number(False, lo=0)] = 1.0
  checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

  _source: str | None = PrivateAttr(default=None)

  @model_validator(mode="before")
  @classmethod
  def _top_level(cls, data: Any) -> Any:
    if not isinstance(data, dict):
      return data
    data = dict(data)
    _replace(data, "bfloat16", "bf16")
    if isinstance(data.get("zero_optimization"), bool):
      legacy = {"stage": 0}
      if data["zero_optimization"]:
        legacy = {"stage": 1, "allgather_bucket_size": data.pop("allgather_size", 500_000_000)}
      _warn(f'"zero_optimization": {_show(data["zero_optimization"])} is deprecated: jzero reads '
            f'it as "zero_optimization": {_show(legacy)}')
      data["zero_optimization"] = legacy
    for key in [k for k in data if k not in cls.model_fields]:
      _warn(f"'{key}': jzero ignores this top-level key{_suggest(key, cls.model_fields)}")
      del data[key]
    return data

  @field_validator("bf16")
  @classmethod
  def _one_half_precision(cls, bf16: Bf16Config, info: ValidationInfo) -> Bf16Config:
    fp16 = info.data.get("fp16")
    if bf16.enabled is True and fp16 is not None and fp16.enabled is True:
      raise ValueError("enabled together with fp16.enabled: bfloat16 and fp16 modes cannot be "
                       "simultaneously enabled; disable one")
    return bf16

  @field_validator("communication_data_type", mode="before")
  @classmethod
  def _comm_dtype(cls, dtype: Any) -> Any:
    if dtype is None or (isinstance(dtype, str) and dtype.lower() in get_args(DType)):
      return None if dtype is None else dtype.lower()
    raise ValueError("Invalid communication_data_type. Supported data types: "
                     f"['fp16', 'bf16', 'fp32']. Got: {dtype}")

  @field_validator("gradient_allreduce_op")
  @classmethod
  def _sum_below_stage3(cls, op: str, info: ValidationInfo) -> str:
    zero = info.data.get("zero_optimization")
    if op == "sum" and zero is not None and zero.stage == 3:
      raise ValueError('"sum" is not supported with zero_optimization.stage 3; use "mean"')
    return op

  @property
  def source(self) -> str | None:
    """The file this config was loaded from (None for a dict)."""
    return self._source

  @property
  def precision(self) -> Literal["fp32", "bf16", "fp16"]:
    """The training precision; meaningful once "auto" is resolved."""
    if self.fp16.enabled is True:
      return "fp16"
    return "bf16" if self.bf16.enabled is True else "fp32"

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Config) and self.to_dict() == other.to_dict()

  @classmethod
  def load(cls, source: str | os.PathLike | Mapping[str, Any]) -> Config:
    """Parses and validates a config: a path to a .json/.yaml/.yml file, or a dict.

    Files whose name does not end in .yaml/.yml are read as JSON, like DeepSpeed. Raises
    ConfigError naming every invalid key (and the file); warns (JZeroWarning) about keys that
    are ignored or deprecated.
    """
    if isinstance(source, Mapping):
      return cls._validate(dict(source), None)
    if isinstance(source, (str, os.PathLike)):
      path = os.fspath(source)
      return cls._validate(_read(path), path)
    raise ConfigError("expected a path to a .json/.yaml config file or a dict, got "
                      f"{type(source).__name__}")

  @classmethod
  def _validate(cls, data: Any, source: str | None) -> Config:
    if not isinstance(data, dict):
      raise ConfigError(_report(source, "invalid DeepSpeed config", [
          f"the top level must be a mapping of keys to values, got {type(data).__name__}"]))
    try:
      config = cls.model_validate(data)
    except ValidationError as error:
      raise ConfigError(_report(source, "invalid DeepSpeed config", _problems(error))) from None
    config._source = source
    return config

  def to_dict(self) -> dict[str, Any]:
    """The config as a JSON-serialisable dict with DeepSpeed's key names; ``load`` reads it back."""
    return self.model_dump(mode="json", by_alias=True)

  def resolve(self, *, dp_world_size: int, hidden_size: int | None = None,
              total_num_steps: int | None = None,
              auto_values: dict[str, Any] | None = None) -> Config:
    """Returns a new Config with every "auto" replaced and the batch triple completed.

    "auto" is filled as Hugging Face does: from ``auto_values`` (keys in ``AUTO_VALUE_KEYS``),
    the model's ``hidden_size`` (reduce_bucket_size = H*H; at stage 3 also
    stage3_prefetch_bucket_size = int(0.9*H*H) and stage3_param_persistence_threshold = 10*H)
    and ``total_num_steps``. Any other "auto" inside zero_optimization, the offload blocks, fp16
    and bf16 takes DeepSpeed's default for the field, as DeepSpeed does. A config with no batch
    keys takes its micro-batch from ``auto_values["micro_batch_size"]``. The batch triple is
    then derived and checked as DeepSpeed's ``_set_batch_related_parameters``, with
    ``dp_world_size`` as the world size. Raises ConfigError listing every value it cannot fill.
    """
    from jzero.autofill import resolve  # pylint: disable=import-outside-toplevel
    return resolve(self, dp_world_size=dp_world_size, hidden_size=hidden_size,
                   total_num_steps=total_num_steps, auto_values=auto_values)

  def check_supported(self) -> None:
    """Refuses what jzero does not implement and warns about what XLA makes moot.

    Walks ``SUPPORT_TABLE``: raises NotSupportedError listing every refused setting, one line
    each, after one JZeroWarning per setting that has no effect under XLA. "auto" counts as
    DeepSpeed's default.
    """
    from jzero.support import check_supported  # pylint: disable=import-outside-toplevel
    check_supported(self)


# --- reading files and reporting errors --------------------------------------------------------


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict:
  """Builds a mapping; duplicate keys are an error, as in DeepSpeed's JSON reader."""
  keys = [key for key, _ in pairs]
  if duplicates := list(dict.fromkeys(key for key in keys if keys.count(key) > 1)):
    raise ConfigError(f"Duplicate keys in DeepSpeed config: {duplicates}")
  return dict(pairs)


class _YamlLoader(yaml.SafeLoader):
  """YAML that reads ``5e8`` as a number (as JSON and YAML 1.2 do) and rejects duplicate keys."""


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                  list("-+0123456789."))
_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                            lambda loader, node: _no_duplicates(loader.construct_pairs(node, True)))


def _read(path: str) -> Any:
  try:
    text = Path(path).read_text()
  except FileNotFoundError:
    raise ConfigError(f"{path}: no such config file") from None
  except OSError as error:
    raise ConfigError(f"{path}: cannot read the config file: {error.strerror}") from None
  try:
    if Path(path).suffix.lower() in (".yaml", ".yml"):
      return yaml.load(text, Loader=_YamlLoader)
    return json.loads(text, object_pairs_hook=_no_duplicates)
  except json.JSONDecodeError as error:
    raise ConfigError(f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: "
                      f"{error.msg}") from None
  except yaml.YAMLError as error:
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    raise ConfigError(f"{path}: invalid YAML{where}: {getattr(error, 'problem', error)}") from None
  except ConfigError as error:
    raise ConfigError(f"{path}: {error}") from None


def _report(source: str | None, title: str, lines: list[str]) -> str:
  head = f"{source}: {title}" if source else title
  return f"{head}:\n" + "\n".join(f"  {line}" for line in lines)


def _model_at(loc: tuple[str, ...]) -> type[BaseModel]:
  """The block class at a key path, e.g. ("zero_optimization", "offload_param")."""
  model = Config
  for part in loc:
    field = next(f for name, f in model.model_fields.items() if part in (name, f.alias))
    model = next(t for t in (field.annotation, *get_args(field.annotation))
                 if isinstance(t, type) and issubclass(t, BaseModel))
  return model


def _problems(error: ValidationError) -> list[str]:
  """One line per problem: the dotted key, then what is wrong with it."""
  lines = []
  for problem in error.errors():
    loc = tuple(str(part) for part in problem["loc"])
    if problem["type"] == "extra_forbidden":
      model = _model_at(loc[:-1])
      known = [*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)]
      message = "unknown key" + _suggest(loc[-1], known)
    elif problem["type"] in ("value_error", "assertion_error"):
      message = str(problem["ctx"]["error"])
    elif problem["type"] == "missing":
      message = "required key is missing"
    elif problem["type"] in ("model_type", "dict_type"):
      message = f"expected a mapping (a JSON object), got {_show(problem['input'])}"
    else:
      message = f"{problem['msg']}, got {_show(problem['input'])}"
    key = ".".join(loc)
    lines += [f"{key}: {line}" if key else line for line in message.splitlines()]
  return lines
