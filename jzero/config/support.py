"""What jzero honours of a DeepSpeed config: ``SUPPORT_TABLE`` and ``check_supported``.

Every DeepSpeed setting jzero does not honour as written is a row here: refused (NotSupportedError,
all refused settings of a config listed together) or without effect under XLA (a JZeroWarning
each). A row applies when the setting differs from DeepSpeed's default, or when its ``applies``
says so; "auto" counts as the default, and an absent setting (None) never applies. A setting not
in the table is honoured by the module that reads it. :meth:`jzero.Config.check_supported` calls
:func:`check_supported`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel

from jzero.config.blocks import CPU_ADAM
from jzero.config.messages import report, show, warn
from jzero.errors import NotSupportedError

if TYPE_CHECKING:  # annotations only: the schema calls this module
  from jzero.config.schema import Config

__all__ = ["SUPPORT_TABLE", "REFUSED", "NO_EFFECT", "check_supported"]

REFUSED, NO_EFFECT = True, False


class _Rule(NamedTuple):
  key: str  # dotted path of python attribute names (messages show DeepSpeed's spelling)
  refused: bool  # REFUSED: NotSupportedError; NO_EFFECT: JZeroWarning
  why: str
  applies: Callable[[Any], bool] | None = None  # default: the value differs from DeepSpeed's
  when: Callable[[Config], bool] | None = None  # the whole config's condition (default: always)


def _nvme(config: Config) -> bool:
  """The optimizer state goes to the NVMe tier (jzero.tiers.nvme_store honours the NVMe settings)."""
  block = config.zero_optimization.offload_optimizer
  return block is not None and block.device == "nvme"


def _not_nvme(config: Config) -> bool:
  return not _nvme(config)


def _param_nvme(config: Config) -> bool:
  """The stage-3 parameter partitions go to the NVMe tier (jzero.tiers.nvme_params)."""
  block = config.zero_optimization.offload_param
  return block is not None and block.device == "nvme"


def _not_param_nvme(config: Config) -> bool:
  return not _param_nvme(config)


def _pinned_on_nvme(block: BaseModel | None) -> bool:
  """An offload block on the NVMe tier whose config asks for pin_memory itself."""
  return (block is not None and block.device == "nvme" and "pin_memory" in block.model_fields_set)


def _any_nvme(config: Config) -> bool:
  return _nvme(config) or _param_nvme(config)


def _no_nvme(config: Config) -> bool:
  return not _any_nvme(config)


_NVME_ONLY = "an NVMe-swapping setting, read only with offload_optimizer.device: nvme"
_PARAM_NVME_ONLY = "a parameter NVMe-swapping setting, read only with offload_param.device: nvme"
_LIBAIO = ("it tunes libaio requests; tensorstore writes each device's partition of an array as one "
           "file in one request (jzero.tiers.nvme_store maps aio.queue_depth and intra_op_parallelism)")
_MICS = "MiCS is not implemented"
_HOOKS = "a PyTorch module-hook option; jzero installs no hooks"
_REUSE = ("jzero keeps no gathered parameters for reuse: every unit and layer is gathered again "
          "in backward, so at most one (two with prefetch) is alive at a time")
_ACTIVATIONS = "no model parallelism; XLA owns activation memory"
_DATA_PARALLEL = "jzero is data-parallel only (every mesh axis carries the batch)"
_COMPRESSION = ("DeepSpeed's compression library quantizes, prunes or removes parts of the model "
                "while it trains; jzero trains the model as written")
_COMPRESSION_TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning",
                           "row_pruning", "head_pruning", "channel_pruning")
_MONITORS = ("the {} monitor is not implemented; tensorboard, csv_monitor and wandb are "
             "(jzero.train.monitor)")
_OPTIMIZERS = ("adam", "adamw", "lion", "sgd")
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest")

# Every DeepSpeed setting jzero does not honour as written. A row applies when the setting
# differs from DeepSpeed's default (or when ``applies(value)`` says so); settings absent from
# the table are honoured.
SUPPORT_TABLE: tuple[_Rule, ...] = (
    # --- DeepSpeed features that change what is trained (top-level blocks jzero reads only here)
    _Rule("tensor_parallel.autotp_size", REFUSED,
          f"AutoTP splits each layer's weights over autotp_size devices; {_DATA_PARALLEL}: "
          "zero_optimization.stage 3 partitions every weight over the devices instead and gathers "
          "it layer by layer",
          lambda size: size not in (0, 1)),
    _Rule("sequence_parallel_size", REFUSED,
          "DeepSpeed-Ulysses splits each sequence over that many devices, with all-to-all "
          f"exchanges in attention; {_DATA_PARALLEL}: each device runs whole sequences",
          lambda size: size != 1),
    _Rule("quantize_training.enabled", REFUSED,
          "MoQ quantizes the weights to fewer bits as training goes; jzero trains unquantized "
          "weights", bool),
    *(_Rule(f"compression_training.{technique}.shared_parameters.enabled", REFUSED, _COMPRESSION,
            bool) for technique in _COMPRESSION_TECHNIQUES),
    _Rule("compression_training.layer_reduction.enabled", REFUSED, _COMPRESSION, bool),
    _Rule("data_efficiency.enabled", REFUSED,
          "random-LTD drops tokens in the middle layers and curriculum learning chooses and cuts "
          "the samples; jzero trains every token of every batch its data loader gives", bool),
    _Rule("curriculum_learning.enabled", REFUSED,
          "DeepSpeed's legacy curriculum learning shortens the sequences early in training; "
          "jzero trains on the batches as its data loader gives them", bool),
    _Rule("progressive_layer_drop.enabled", REFUSED,
          "progressive layer dropping skips layers at random as training goes; jzero runs every "
          "layer of the model", bool),
    _Rule("sparse_attention", REFUSED,
          "DeepSpeed's block-sparse attention kernels replace the dense attention of models built "
          "on them; jzero runs the model's attention as the model defines it"),
    _Rule("torch_autocast.enabled", REFUSED,
          "PyTorch autocast runs chosen modules in lower precision; jzero has no per-module "
          "autocast: bf16.enabled or fp16.enabled sets the compute dtype of the whole model, with "
          "fp32 master weights", bool),
    _Rule("amp.enabled", REFUSED,
          "NVIDIA Apex AMP is PyTorch's; jzero's mixed precision is bf16.enabled or fp16.enabled "
          "(dynamic loss scaling with fp16)", bool),
    _Rule("elasticity.enabled", REFUSED,
          "DeepSpeed's elasticity chooses train_batch_size and the micro-batch for the GPUs "
          "present; jzero trains with the config's batch sizes", bool),
    _Rule("expert_parallel.enabled", REFUSED,
          "AutoEP places the experts of a mixture-of-experts layer on different devices; "
          f"{_DATA_PARALLEL}: ZeRO partitions the experts' weights as it does any other", bool),
    # --- offload (jzero.tiers.host_optimizer, jzero.tiers.nvme_store): device "cpu" and "nvme" for
    # the optimizer
    _Rule("zero_optimization.offload_optimizer.super_offload", REFUSED,
          "SuperOffload (GH200 superchip offload) is not implemented"),
    _Rule("zero_optimization.offload_optimizer.buffer_count", NO_EFFECT, _NVME_ONLY,
          when=_not_nvme),
    _Rule("zero_optimization.offload_optimizer.pipeline_read", NO_EFFECT, _NVME_ONLY,
          when=_not_nvme),
    _Rule("zero_optimization.offload_optimizer.pipeline_write", NO_EFFECT, _NVME_ONLY,
          when=_not_nvme),
    # the host-Adam update's config value and its memory model (jzero.analysis.update_memory,
    # jzero plan's candidates) come before its engine: this row goes when the engine runs it
    _Rule("zero_optimization.offload_optimizer.update", REFUSED,
          "the step that streams the gradients to the host and runs Adam there is not in this "
          "build yet; use update: stream or host", lambda update: update == CPU_ADAM),
    _Rule("zero_optimization.offload_optimizer.fast_init", NO_EFFECT,
          "jzero creates the optimizer state directly in its tier; there is no slow init"),
    _Rule("zero_optimization.offload_optimizer.cpuadam_cores_perc", NO_EFFECT,
          "the host update is XLA's host computation (or runs on the device); it has no "
          "DeepSpeedCPUAdam thread pool to size"),
    _Rule("zero_optimization.offload_optimizer.nvme_path", NO_EFFECT,
          "nvme_path is only read with device: nvme", bool, when=_not_nvme),
    _Rule("zero_optimization.offload_optimizer.pin_memory", NO_EFFECT,
          "with device: nvme the store's reads land in ordinary host buffers that are copied to "
          "the devices (pin_memory places the state in pinned_host with device: cpu)", bool,
          when=lambda config: _pinned_on_nvme(config.zero_optimization.offload_optimizer)),
    # --- parameter offload (jzero.tiers.host_params, jzero.tiers.nvme_params): "cpu" and "nvme",
    # stage 3 --
    _Rule("zero_optimization.offload_param.pin_memory", NO_EFFECT,
          "with device: nvme the host cache and staging buffers are ordinary host memory that "
          "host callbacks hand to the devices (pin_memory places the partitions in pinned_host "
          "with device: cpu)", bool,
          when=lambda config: _pinned_on_nvme(config.zero_optimization.offload_param)),
    _Rule("zero_optimization.offload_param.buffer_count", NO_EFFECT, _PARAM_NVME_ONLY,
          when=_not_param_nvme),
    _Rule("zero_optimization.offload_param.buffer_size", NO_EFFECT, _PARAM_NVME_ONLY,
          when=_not_param_nvme),
    _Rule("zero_optimization.offload_param.max_in_cpu", NO_EFFECT, _PARAM_NVME_ONLY,
          when=_not_param_nvme),
    _Rule("zero_optimization.offload_param.nvme_path", NO_EFFECT,
          "offload_param.nvme_path is only read with offload_param.device: nvme", bool,
          when=_not_param_nvme),
    _Rule("zero_optimization.zero_quantized_nontrainable_weights", REFUSED,
          "keeping frozen weights' partitions as int8 is not implemented yet; ZeRO++'s qwZ, hpZ "
          "and qgZ are (zero_quantized_weights, zero_hpz_partition_size, "
          "zero_quantized_gradients)"),
    _Rule("zero_optimization.zeropp_loco_param", REFUSED,
          "LoCo-ZeRO++'s error feedback for qgZ is not implemented yet; zero_quantized_gradients "
          "without it is"),
    _Rule("zero_optimization.mics_shard_size", REFUSED, _MICS),
    _Rule("zero_optimization.mics_hierarchical_params_gather", REFUSED, _MICS),
    _Rule("zero_optimization.zenflow", REFUSED, "ZenFlow is not implemented"),
    _Rule("zero_optimization.legacy_stage1", REFUSED,
          "DeepSpeed's legacy stage-1 code path; use stage 1"),
    _Rule("zero_optimization.pipeline_loading_checkpoint", REFUSED,
          "pipeline-parallel checkpoint loading is not implemented"),
    _Rule("zero_optimization.load_from_fp32_weights", REFUSED,
          "jzero always restores the fp32 master weights from the checkpoint"),
    _Rule("bf16.bf16_master_weights_and_grads", REFUSED,
          "bf16 master weights are not implemented yet; jzero keeps fp32 master weights"),
    _Rule("bf16.bf16_optimizer_states", REFUSED,
          "bf16 optimizer states are not implemented yet; jzero keeps them in fp32"),
    _Rule("fp16.fp16_master_weights_and_grads", REFUSED,
          "fp16 master weights are not implemented; jzero keeps fp32 master weights"),
    _Rule("fp16.auto_cast", REFUSED,
          "automatic input casting is not implemented; the model's dtype policy casts"),
    _Rule("optimizer.type", REFUSED, "jzero supports the optimizers Adam, AdamW, Lion and SGD",
          lambda name: name.lower() not in _OPTIMIZERS),
    _Rule("scheduler.type", REFUSED, f"jzero supports the schedulers {', '.join(_SCHEDULERS)}",
          lambda name: name not in _SCHEDULERS),
    _Rule("checkpoint.load_universal", REFUSED,
          "DeepSpeed universal checkpoints cannot be read; jzero checkpoints reshard themselves"),
    _Rule("data_types.param_dtype", REFUSED, "a separate parameter dtype is not implemented yet"),
    _Rule("data_types.buffer_dtype", REFUSED, "a separate buffer dtype is not implemented yet"),
    _Rule("zero_optimization.contiguous_gradients", NO_EFFECT,
          "XLA assigns buffers statically; there is no fragmentation to avoid"),
    _Rule("zero_optimization.use_multi_rank_bucket_allreduce", NO_EFFECT,
          "XLA schedules and combines the collectives"),
    _Rule("zero_optimization.allgather_partitions", NO_EFFECT, "jzero always all-gathers"),
    _Rule("zero_optimization.elastic_checkpoint", NO_EFFECT,
          "jzero checkpoints are always reshardable"),
    _Rule("zero_optimization.sub_group_size", NO_EFFECT,
          "XLA fuses the optimizer update per leaf; there are no staging buffers (it sizes the "
          "NVMe tier's groups with offload_optimizer.device: nvme)", when=_not_nvme),
    _Rule("zero_optimization.max_reuse_distance", NO_EFFECT, _REUSE),
    _Rule("zero_optimization.use_all_reduce_for_fetch_params", NO_EFFECT,
          "jzero fetches parameters with one all-gather per unit or layer"),
    _Rule("zero_optimization.allgather_sequential", NO_EFFECT, "XLA schedules the all-gathers"),
    _Rule("zero_optimization.ignore_unused_parameters", NO_EFFECT,
          "JAX gives unused parameters zero gradients"),
    _Rule("zero_optimization.round_robin_gradients", NO_EFFECT,
          "it orders DeepSpeed's CPU-offload gradient copies"),
    _Rule("zero_optimization.memory_efficient_linear", NO_EFFECT, _HOOKS),
    _Rule("zero_optimization.override_module_apply", NO_EFFECT, _HOOKS),
    _Rule("zero_optimization.log_trace_cache_warnings", NO_EFFECT,
          "there is no trace cache; XLA compiles the step once"),
    _Rule("zero_optimization.enable_sanity_checks", NO_EFFECT, "DeepSpeed-internal debug checks"),
    _Rule("zero_optimization.save_muon_momentum_buffer_in_memory", NO_EFFECT,
          "it only concerns Muon with NVMe offload"),
    _Rule("bf16.immediate_grad_update", NO_EFFECT,
          "XLA fuses the update; there is no delayed gradient copy"),
    _Rule("prescale_gradients", NO_EFFECT, "the mean is the same; jzero always pre-divides"),
    _Rule("gradient_predivide_factor", NO_EFFECT,
          "the mean is the same; jzero always pre-divides"),
    _Rule("activation_checkpointing.partition_activations", NO_EFFECT, _ACTIVATIONS),
    _Rule("activation_checkpointing.contiguous_memory_optimization", NO_EFFECT, _ACTIVATIONS),
    _Rule("activation_checkpointing.number_checkpoints", NO_EFFECT, _ACTIVATIONS),
    _Rule("activation_checkpointing.synchronize_checkpoint_boundary", NO_EFFECT, _ACTIVATIONS),
    _Rule("activation_checkpointing.profile", NO_EFFECT, _ACTIVATIONS),
    _Rule("optimizer.params.torch_adam", NO_EFFECT,
          "optax has one Adam; there is no torch/fused choice", bool),
    _Rule("zero_force_ds_cpu_optimizer", NO_EFFECT,
          "jzero builds the optimizer from the config; there is no client optimizer"),
    _Rule("memory_breakdown", NO_EFFECT,
          "jzero reports memory from XLA's own accounting instead"),
    _Rule("dump_state", NO_EFFECT, "a DeepSpeed debugging printout"),
    _Rule("aio", NO_EFFECT, "it tunes NVMe I/O, and neither offload_optimizer.device nor "
          "offload_param.device is nvme", when=_no_nvme),
    _Rule("aio.block_size", NO_EFFECT, _LIBAIO, when=_any_nvme),
    _Rule("aio.single_submit", NO_EFFECT, _LIBAIO, when=_any_nvme),
    _Rule("aio.overlap_events", NO_EFFECT,
          "tensorstore completes requests as futures; jzero overlaps reads and writes with the "
          "update by offload_optimizer.pipeline_read / pipeline_write", when=_any_nvme),
    _Rule("comet.enabled", REFUSED, _MONITORS.format("Comet")),
    _Rule("trackio.enabled", REFUSED, _MONITORS.format("Trackio")),
    _Rule("aio.use_gds", REFUSED,
          "GPUDirect Storage is not implemented: the NVMe tier reads into host memory and "
          "copies to the device", when=_any_nvme),
)


def _lookup(config: Config, key: str) -> tuple[str, Any, Any] | None:
  """(DeepSpeed's name, value, DeepSpeed's default) of a dotted key; None if its block is absent."""
  node, names, default = config, [], None
  for part in key.split("."):
    if isinstance(node, BaseModel):
      field = type(node).model_fields[part]
      names.append(field.alias or part)
      node, default = getattr(node, part), field.get_default(call_default_factory=True)
    elif isinstance(node, dict) and part in node:
      names.append(part)
      node, default = node[part], None
    else:
      return None
  return ".".join(names), node, default


def _show_setting(value: Any) -> str:
  if isinstance(value, BaseModel):
    return show(value.model_dump(mode="json", exclude_defaults=True))
  return value if isinstance(value, str) else show(value)


def check_supported(config: Config) -> None:
  """Walks :data:`SUPPORT_TABLE` over ``config`` (:meth:`Config.check_supported`)."""
  refused = []
  for rule in SUPPORT_TABLE:
    found = _lookup(config, rule.key)
    if found is None:
      continue
    name, value, default = found
    if rule.when is not None and not rule.when(config):
      continue
    if value is None or value == "auto" or not (
        rule.applies(value) if rule.applies else value != default):
      continue
    setting = f"{name}={_show_setting(value)}"
    if rule.refused:
      refused.append(f"not yet supported: {setting} ({rule.why})")
    else:
      warn(f"{setting} has no effect under XLA: {rule.why}")
  if refused:
    raise NotSupportedError(report(config.source, "jzero cannot run this config", refused))
