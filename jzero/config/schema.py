"""DeepSpeed's JSON config format, typed and validated.

jzero reads the configs DeepSpeed users already have (JSON, or the same schema in YAML) into
pydantic models that mirror DeepSpeed's own (``DeepSpeedZeroConfig``, ``DeepSpeedFP16Config``, ...)
with the defaults, aliases and deprecations of DeepSpeed 0.19.6. A config goes through three steps:

1. ``Config.load`` parses and validates. All problems of one config are reported together in one
   ConfigError, one line per key. Keys DeepSpeed rejects (unknown keys inside ``zero_optimization``,
   the offload blocks, ``fp16``, ``bf16``, ``data_types``) are errors with a "did you mean";
   keys DeepSpeed ignores (unknown top-level keys, unknown keys of the blocks it reads with
   ``dict.get``) are dropped with a JZeroWarning each -- except a top-level key so close to a known
   one that it is a misspelling (``zero_optimisation``): DeepSpeed would train without the setting
   it names, so it is an error. DeepSpeed's features that change what is trained (tensor and
   sequence parallelism, MoQ, compression, random-LTD, sparse attention, ...) are fields, read
   only so that step 3 can refuse them when they are on; DeepSpeed's keys that change nothing
   here (profiling, DeepSpeed's own tuning: :data:`IGNORED_KEYS`) are dropped with a warning; the
   monitors (``tensorboard``, ``csv_monitor``, ``wandb``) are fields (:mod:`jzero.train.monitor`).
2. ``Config.resolve`` replaces Hugging Face's ``"auto"`` values (kept as values until then) with
   numbers taken from the data-parallel size, the model's hidden size and ``auto_values``, and
   completes the batch-size triple exactly as DeepSpeed does (:mod:`jzero.config.auto`). The
   result holds no "auto".
3. ``Config.check_supported`` is the one place that says what jzero honours: ``SUPPORT_TABLE``
   (:mod:`jzero.config.support`)
   lists every setting jzero refuses (NotSupportedError) or that has no effect under XLA
   (JZeroWarning). A setting not in the table is honoured by the module that reads it.

Attribute names are DeepSpeed's field names; the ``stage3_`` spellings are aliases, accepted in
input (as is the plain name) and written by ``to_dict``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from jzero.config import auto, support
from jzero.config.blocks import (ActivationCheckpointingConfig, AioConfig, AutoReal, BatchSize,
                                 Bf16Config, CheckpointConfig, CometConfig, CsvMonitorConfig,
                                 DataTypesConfig, DType, Flag, Fp16Config, OptimizerConfig,
                                 SchedulerConfig, TensorBoardConfig, TrackioConfig, WandbConfig,
                                 ZeroConfig, number, replace_key)
from jzero.config.messages import report, show, suggest, warn
from jzero.errors import ConfigError

__all__ = ["Config", "IGNORED_KEYS"]

# DeepSpeed's top-level keys that change nothing jzero trains: profiling, the tuning
# of DeepSpeed's own machinery, and engines jzero does not have (inference, pipeline modules).
# Each is dropped with a warning, as an unknown key is.
IGNORED_KEYS = (
    "comms_logger", "flops_profiler", "timers", "log_level", "autotuning", "nebula", "datastates",
    "compile", "graph_harvesting", "disable_allgather", "sparse_gradients",
    "managed_gradient_accumulation",
    "use_data_before_expert_parallelism", "seq_parallel_communication_data_type",
    "data_parallel_size", "hybrid_engine", "pipeline", "weight_quantization",
)
# DeepSpeed's features that change what is trained: read only to be refused when on
# (jzero.config.support); ``to_dict`` leaves them out while they are absent.
_FEATURES = ("tensor_parallel", "sequence_parallel_size", "quantize_training",
             "compression_training", "data_efficiency", "sparse_attention",
             "progressive_layer_drop", "curriculum_learning", "torch_autocast", "amp", "elasticity",
             "expert_parallel")
# How close an unknown top-level key must be to a known one to count as its misspelling.
_MISSPELLED = 0.8
_MISSPELLED_WHY = ("DeepSpeed ignores unknown top-level keys, so it would train without this "
                   "setting; correct the name")


# --- the config --------------------------------------------------------------------------------


class Config(BaseModel):
  """A DeepSpeed config. Build it with ``Config.load``; equality ignores ``source``."""

  model_config = ConfigDict(extra="forbid", protected_namespaces=())

  train_batch_size: BatchSize = None
  train_micro_batch_size_per_gpu: BatchSize = None
  gradient_accumulation_steps: BatchSize = None
  gradient_clipping: AutoReal = 1.0  # 0 disables clipping
  steps_per_print: Annotated[int | None, number(True, lo=1, nullable=True)] = None
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
  gradient_predivide_factor: Annotated[float, number(False, lo=0)] = 1.0
  checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
  # _FEATURES: as DeepSpeed reads them (blocks with dict.get), refused when on
  tensor_parallel: dict[str, Any] | None = None
  sequence_parallel_size: Annotated[int | None, number(True, lo=1, nullable=True)] = None
  quantize_training: dict[str, Any] | None = None
  compression_training: dict[str, Any] | None = None
  data_efficiency: dict[str, Any] | None = None
  sparse_attention: dict[str, Any] | None = None
  progressive_layer_drop: dict[str, Any] | None = None
  curriculum_learning: dict[str, Any] | None = None
  torch_autocast: dict[str, Any] | None = None
  amp: dict[str, Any] | None = None
  elasticity: dict[str, Any] | None = None
  expert_parallel: dict[str, Any] | None = None
  # monitors (jzero.train.monitor): process 0 writes every step's metrics
  tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
  csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
  wandb: WandbConfig = Field(default_factory=WandbConfig)
  comet: CometConfig = Field(default_factory=CometConfig)
  trackio: TrackioConfig = Field(default_factory=TrackioConfig)

  _source: str | None = PrivateAttr(default=None)

  @model_validator(mode="before")
  @classmethod
  def _top_level(cls, data: Any) -> Any:
    if not isinstance(data, dict):
      return data
    data = dict(data)
    replace_key(data, "bfloat16", "bf16")
    if isinstance(data.get("zero_optimization"), bool):
      legacy = {"stage": 0}
      if data["zero_optimization"]:
        legacy = {"stage": 1, "allgather_bucket_size": data.pop("allgather_size", 500_000_000)}
      warn(f'"zero_optimization": {show(data["zero_optimization"])} is deprecated: jzero reads '
            f'it as "zero_optimization": {show(legacy)}')
      data["zero_optimization"] = legacy
    known = (*cls.model_fields, *IGNORED_KEYS)
    for key in [k for k in data if k not in cls.model_fields]:
      if key in IGNORED_KEYS:
        warn(f"'{key}': jzero ignores this top-level key")
      elif suggest(key, known, _MISSPELLED):
        continue  # a misspelling: left for extra="forbid" to report (_problems)
      else:
        warn(f"'{key}': jzero ignores this top-level key{suggest(key, known)}")
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

  @property
  def checks_overflow(self) -> bool:
    """fp16, or bf16 with ``check_grad_overflow``: a step whose gradient is not finite is skipped
    and the loss scaler backs off."""
    return self.precision == "fp16" or (self.precision == "bf16" and self.bf16.check_grad_overflow)

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
      return cls.validated(dict(source), None)
    if isinstance(source, (str, os.PathLike)):
      path = os.fspath(source)
      return cls.validated(_read(path), path)
    raise ConfigError("expected a path to a .json/.yaml config file or a dict, got "
                      f"{type(source).__name__}")

  @classmethod
  def validated(cls, data: Any, source: str | None) -> Config:
    """``data`` (a dict) validated into a Config read from ``source``."""
    if not isinstance(data, dict):
      raise ConfigError(report(source, "invalid DeepSpeed config", [
          f"the top level must be a mapping of keys to values, got {type(data).__name__}"]))
    try:
      config = cls.model_validate(data)
    except ValidationError as error:
      raise ConfigError(report(source, "invalid DeepSpeed config", _problems(error))) from None
    config._source = source
    return config

  def to_dict(self) -> dict[str, Any]:
    """The config as a JSON-serialisable dict with DeepSpeed's key names; ``load`` reads it back."""
    absent = {name for name in _FEATURES if getattr(self, name) is None}
    return self.model_dump(mode="json", by_alias=True, exclude=absent)

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
    data = auto.fill(self.to_dict(), self.source, dp_world_size=dp_world_size,
                     hidden_size=hidden_size, total_num_steps=total_num_steps,
                     auto_values=auto_values)
    resolved = Config.validated(data, self.source)
    (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
     resolved.gradient_accumulation_steps) = auto.batch_triple(
         resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
         resolved.gradient_accumulation_steps, dp_world_size, self.source)
    return resolved

  def check_supported(self) -> None:
    """Refuses what jzero does not implement and warns about what XLA makes moot.

    Walks ``SUPPORT_TABLE``: raises NotSupportedError listing every refused setting, one line
    each, after one JZeroWarning per setting that has no effect under XLA. "auto" counts as
    DeepSpeed's default.
    """
    support.check_supported(self)


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
    if problem["type"] == "extra_forbidden" and len(loc) == 1:  # a misspelling (_top_level)
      known = (*Config.model_fields, *IGNORED_KEYS)
      message = f"unknown top-level key{suggest(loc[0], known, _MISSPELLED)} {_MISSPELLED_WHY}"
    elif problem["type"] == "extra_forbidden" and loc[-1] in (*Config.model_fields, *IGNORED_KEYS):
      message = (f"unknown key: {loc[-1]} is a top-level key of DeepSpeed's config, not part of "
                 f"{'.'.join(loc[:-1])}; move it to the top level")
    elif problem["type"] == "extra_forbidden":
      model = _model_at(loc[:-1])
      known = [*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)]
      message = "unknown key" + suggest(loc[-1], known)
    elif problem["type"] in ("value_error", "assertion_error"):
      message = str(problem["ctx"]["error"])
    elif problem["type"] == "missing":
      message = "required key is missing"
    elif problem["type"] in ("model_type", "dict_type"):
      message = f"expected a mapping (a JSON object), got {show(problem['input'])}"
    else:
      message = f"{problem['msg']}, got {show(problem['input'])}"
    key = ".".join(loc)
    lines += [f"{key}: {line}" if key else line for line in message.splitlines()]
  return lines
