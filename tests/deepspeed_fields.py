"""DeepSpeed's config fields and their types, written down from DeepSpeed's own config classes,
and a checker that says which key of a config DeepSpeed would reject (no torch, no DeepSpeed).

Read from deepspeedai/DeepSpeed (the pydantic models and the getters of the top-level parser):

* ``deepspeed/runtime/zero/config.py`` (commit 1b88ac36): ``DeepSpeedZeroConfig`` -- ``stage`` a
  ``ZeroStageEnum`` (0-3), bucket sizes and stage-3 thresholds ``int`` >= 0,
  ``zero_hpz_partition_size: int = Field(1, ge=0)``, the ZeRO++ switches ``bool``.
* ``deepspeed/runtime/zero/offload_config.py`` (commit 1978617c): ``device`` an
  ``OffloadDeviceEnum`` ("none", "cpu", "nvme"), ``nvme_path`` a ``Path``, ``buffer_count``,
  ``buffer_size``, ``max_in_cpu`` ``int`` >= 0, ``pin_memory`` ``bool``, ``ratio: float`` in
  [0, 1].
* ``deepspeed/runtime/config_utils.py``: ``DeepSpeedConfigModel`` has ``extra="forbid"`` -- an
  unknown key in these blocks is an error -- and, outside ``strict`` mode, drops every value that
  is the string "auto" before validation, so "auto" silently means the field's default (an
  ``"auto"`` hpZ partition size is hpZ off). The checker refuses "auto" for that reason.
* ``deepspeed/runtime/precision_config.py`` (commit 0ac46845): ``DeepSpeedBF16Config`` and
  ``DeepSpeedFP16Config`` (``enabled: bool``, ...).
* ``deepspeed/runtime/config.py`` (commit 029f12b3): the top-level scalars are read with
  ``get_scalar_param`` and checked by ``_batch_assertion`` (``train_batch_size``,
  ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` > 0 and their product with
  the world size); ``optimizer`` and ``scheduler`` are ``{"type": str, "params": dict}``.
* ``deepspeed/runtime/activation_checkpointing/config.py``: ``partition_activations``,
  ``contiguous_memory_optimization``, ``cpu_checkpointing``, ``synchronize_checkpoint_boundary``,
  ``profile`` (bool) and ``number_checkpoints`` (int or None).

Types are checked as JSON gives them: an ``int`` field takes an int (not a float, not a bool), a
``float`` field an int or a float, a ``bool`` field a bool.
"""

from __future__ import annotations

from typing import Any

INT, NONNEG, POS, FLOAT, BOOL, STR, PATH, DICT = ("int", "int>=0", "int>0", "float", "bool", "str",
                                                  "path", "dict")
OPTIONAL = "optional "  # prefix: None is allowed too

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

OFFLOAD_PARAM = {"device": OFFLOAD_DEVICES, "nvme_path": OPTIONAL + PATH, "buffer_count": NONNEG,
                 "buffer_size": NONNEG, "max_in_cpu": NONNEG, "pin_memory": BOOL}
OFFLOAD_OPTIMIZER = {"device": OFFLOAD_DEVICES, "nvme_path": OPTIONAL + PATH,
                     "buffer_count": NONNEG, "pin_memory": BOOL, "pipeline_read": BOOL,
                     "pipeline_write": BOOL, "fast_init": BOOL, "ratio": (0.0, 1.0),
                     "super_offload": BOOL, "convert_grad_on_cpu": BOOL,
                     "cpuadam_cores_perc": (0.0, 1.0)}
ZERO = {
    "stage": (0, 1, 2, 3), "contiguous_gradients": BOOL, "reduce_scatter": BOOL,
    "reduce_bucket_size": NONNEG, "use_multi_rank_bucket_allreduce": BOOL,
    "allgather_partitions": BOOL, "allgather_bucket_size": NONNEG, "overlap_comm": OPTIONAL + BOOL,
    "load_from_fp32_weights": BOOL, "elastic_checkpoint": BOOL,
    "offload_param": OFFLOAD_PARAM, "offload_optimizer": OFFLOAD_OPTIMIZER,
    "sub_group_size": NONNEG, "stage3_prefetch_bucket_size": NONNEG,
    "stage3_param_persistence_threshold": NONNEG, "stage3_model_persistence_threshold": NONNEG,
    "stage3_max_live_parameters": NONNEG, "stage3_max_reuse_distance": NONNEG,
    "stage3_gather_16bit_weights_on_model_save": BOOL, "ignore_unused_parameters": BOOL,
    "round_robin_gradients": BOOL, "zero_hpz_partition_size": NONNEG,
    "zero_quantized_weights": BOOL, "zero_quantized_nontrainable_weights": BOOL,
    "zero_quantized_gradients": BOOL, "mics_shard_size": INT,
    "mics_hierarchical_params_gather": BOOL, "memory_efficient_linear": BOOL,
}
BF16 = {"enabled": BOOL, "immediate_grad_update": BOOL, "check_grad_overflow": BOOL,
        "bf16_master_weights_and_grads": BOOL, "bf16_optimizer_states": BOOL}
FP16 = {"enabled": BOOL, "auto_cast": BOOL, "loss_scale": FLOAT, "initial_scale_power": INT,
        "loss_scale_window": INT, "hysteresis": INT, "consecutive_hysteresis": BOOL,
        "min_loss_scale": INT, "fp16_master_weights_and_grads": BOOL}
ACTIVATION_CHECKPOINTING = {"partition_activations": BOOL,
                            "contiguous_memory_optimization": BOOL, "cpu_checkpointing": BOOL,
                            "number_checkpoints": OPTIONAL + INT,
                            "synchronize_checkpoint_boundary": BOOL, "profile": BOOL}
TYPED_BLOCK = {"type": STR, "params": DICT}
TOP = {"train_batch_size": POS, "train_micro_batch_size_per_gpu": POS,
       "gradient_accumulation_steps": POS, "gradient_clipping": FLOAT, "steps_per_print": INT,
       "optimizer": TYPED_BLOCK, "scheduler": TYPED_BLOCK, "bf16": BF16, "fp16": FP16,
       "zero_optimization": ZERO, "activation_checkpointing": ACTIVATION_CHECKPOINTING}


def _value_problem(value: Any, kind: Any) -> str | None:
  """Why ``value`` is not of DeepSpeed's ``kind`` (None: it is)."""
  if isinstance(kind, str) and kind.startswith(OPTIONAL):
    return None if value is None else _value_problem(value, kind[len(OPTIONAL):])
  if value == "auto":
    return "'auto' (DeepSpeed drops it: the field's default applies)"
  if isinstance(kind, tuple) and all(isinstance(k, float) for k in kind):  # a float range
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return None if ok and kind[0] <= value <= kind[1] else f"{value!r} is not a number in {kind}"
  if isinstance(kind, tuple):  # an enum
    same_type = all(type(value) is type(k) for k in kind[:1])
    return None if same_type and value in kind else f"{value!r} is not one of {kind}"
  is_int = isinstance(value, int) and not isinstance(value, bool)
  checks = {INT: is_int, NONNEG: is_int and value >= 0, POS: is_int and value > 0,
            FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
            BOOL: isinstance(value, bool), STR: isinstance(value, str),
            PATH: isinstance(value, str) and bool(value), DICT: isinstance(value, dict)}
  return None if checks[kind] else f"{value!r} is not {kind}"


def problems(config: dict, schema: dict = TOP, where: str = "") -> list[str]:
  """Every key of ``config`` DeepSpeed would reject or read otherwise, as 'path: why'."""
  out = []
  for key, value in config.items():
    path = f"{where}{key}"
    if key not in schema:
      out.append(f"{path}: not a field of DeepSpeed's config")
    elif isinstance(schema[key], dict):
      if isinstance(value, dict):
        out += problems(value, schema[key], path + ".")
      elif value is not None:
        out.append(f"{path}: {value!r} is not a block")
    else:
      problem = _value_problem(value, schema[key])
      if problem:
        out.append(f"{path}: {problem}")
  return out
