"""DeepSpeed 0.19's ``DeepSpeedEngine`` public names, each as jzero answers it: :data:`NAMES`.

Every public method, property and attribute of DeepSpeed's engine (its ``runtime/engine.py``),
with ``module`` and the ``torch.nn.Module`` calls training scripts make on the engine, is one row:
``works`` (DeepSpeed's meaning), ``differs`` (it works; the note says how) or ``refused`` (a
:class:`~jzero.errors.JZeroError` whose message is the note: why, and jzero's way). The adapter
(:class:`jzero.train.deepspeed_engine.DeepSpeedEngine`) implements the first two and raises the
third from this table; docs/coming-from-deepspeed.md's table is :func:`markdown_table`, which a test
keeps equal to the page.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["Name", "NAMES", "refusal_message", "markdown_table"]


@dataclasses.dataclass(frozen=True)
class Name:
  """One DeepSpeed engine name: ``kind`` is how DeepSpeed has it (a method to call, or an
  attribute / property to read); ``status`` and ``note`` as the module docstring says."""

  name: str
  kind: Literal["method", "attribute"]
  status: Literal["works", "differs", "refused"]
  note: str = ""


# reasons shared by many rows
_XLA = ("XLA compiles the step's collectives, bucketing and overlap (jzero.comm); there is no "
        "gradient buffer to drive by hand: engine.train_step runs the whole step")
_CONFIG = "the resolved config's value"
_OFF = "always False: jzero refuses the feature at initialize when the config turns it on"
_NO_FLOPS = ("jzero has no flops profiler: engine.jzero_engine.throughput(step_seconds) reads the "
             "compiled step's FLOPs, and the step log prints MFU")
_NO_AUTOTUNE = "jzero has no autotuner: `jzero plan` searches ZeRO plans for a model and a GPU"
_NO_COMPILE = ("DeepSpeed's torch.compile passes; jzero's step is always compiled by XLA "
               "(engine.jzero_engine.compile_step(state, batch) compiles it ahead)")
_NO_MOE = "jzero has no mixture-of-experts layers (expert parallelism is refused at initialize)"
_NO_TP = ("jzero is data-parallel only (tensor, sequence and pipeline parallelism are refused at "
          "initialize); its devices are the mesh: engine.jzero_engine.mesh")
_GROUPS = ("torch process groups are mesh axes in JAX: engine.jzero_engine.mesh (a ZeroMesh: "
           ".mesh, .zero_axes, .batch_axes)")
_BATCH_FIXED = ("a compiled step has one batch shape: the batch triple is fixed at initialize; "
                "initialize again with the new sizes (a checkpoint restores into any batch size, "
                "with a warning)")
_TIMERS = ("wall_clock_breakdown's times are engine.jzero_engine.timings (forward+backward and "
           "optimizer per step); throughput: engine.jzero_engine.throughput(step_seconds)")
_DATA = "jzero refuses data_efficiency and curriculum_learning at initialize"
_TORCH = ("a torch module call: parameters are a JAX pytree in the train state "
          "(engine.module_state_dict() reads them; engine.state is the whole TrainState)")
_PRECISION = "precision is the config's fp16 / bf16 block; placement is the mesh's"


def _rows(kind: str, status: str, note: str, names: str) -> list[Name]:
  return [Name(n, kind, status, note) for n in names.split()]


_M, _A = "method", "attribute"

_TABLE: list[Name] = [
    # -- the training loop --------------------------------------------------------------------
    Name("forward", _M, "differs",
         "engine(batch) in train mode runs the whole compiled step (forward, backward, update) "
         "and returns the loss (a JAX scalar; .item() works); backward(loss) and step() then "
         "commit it. In eval mode it returns the model's output on the current weights"),
    Name("backward", _M, "differs",
         "takes the loss engine(batch) returned (the gradient was computed with it); any other "
         "value is refused: the loss must be computed inside the step (initialize's loss_fn)"),
    Name("step", _M, "works", "commits the step engine(batch) ran: global_steps, the lr schedule"),
    Name("zero_grad", _M, "works", "nothing to do: gradients never outlive a step in jzero"),
    Name("train", _M, "works", "engine(batch) trains (dropout on)"),
    Name("eval", _M, "works", "engine(batch) returns the model's output, no update (dropout off)"),
    Name("is_gradient_accumulation_boundary", _M, "works",
         "always True: every engine(batch) is one optimizer step over train_batch_size samples"),
    Name("was_step_applied", _M, "works", "False after a step skipped for a non-finite gradient"),
    Name("get_global_grad_norm", _M, "works", "the last step's global norm (None before one)"),
    Name("get_lr", _M, "works", "the learning rate the next step uses (after a load too)"),
    Name("get_mom", _M, "differs",
         "the config optimizer's betas (Adam, AdamW, Lion) or momentum (SGD); refused for a "
         "client optax optimizer"),
    Name("get_type", _M, "refused",
         "torch param groups have a type; jzero's optimizer is one optax transformation "
         "(engine.optimizer.tx)"),
    Name("get_batch_info", _M, "works", "(train_batch_size, micro batch, gradient accumulation)"),
    Name("global_steps", _A, "works", "optimizer steps, skipped ones included; a load's own"),
    Name("global_samples", _A, "differs",
         "global_steps x train_batch_size (DeepSpeed counts samples as they pass; equal unless "
         "the batch size changed between runs)"),
    Name("skipped_steps", _A, "works", "steps skipped for a non-finite gradient (fp16 overflow)"),
    Name("micro_steps", _A, "works", "global_steps x gradient_accumulation_steps"),
    Name("losses", _A, "works", "the last step's loss"),
    Name("module", _A, "differs",
         "the model with the current weights, gathered to the host (an NNX module, or a Linen "
         "module bound to them); a copy: changing it changes nothing in training"),
    Name("optimizer", _A, "differs",
         "an object with param_groups (lr, betas, ...: read-only), zero_grad(); step() and "
         "state_dict() refused, naming jzero's way; .tx is the optax transformation"),
    Name("lr_scheduler", _A, "differs",
         "get_lr(), get_last_lr(), last_batch_iteration, state_dict() as DeepSpeed's; step() "
         "refused (the engine steps it); None without a scheduler block, as DeepSpeed"),
    Name("client_optimizer", _A, "works", "initialize's optimizer (an optax transformation)"),
    Name("client_lr_scheduler", _A, "works", "initialize's lr_scheduler (always None in jzero)"),
    Name("basic_optimizer", _A, "refused",
         "no torch optimizer under a ZeRO wrapper: engine.optimizer.tx is the optax one"),
    Name("training_data", _A, "works", "initialize's training_data"),
    Name("training_dataloader", _A, "differs",
         "yields global batches placed on the mesh (train_batch_size rows), not one rank's"),
    Name("collate_fn", _A, "works", "None: initialize refuses collate_fn"),
    Name("deepspeed_io", _M, "differs",
         "a jzero DataLoader of global batches of train_batch_size placed on the mesh; only "
         "dataset (and batch_size equal to train_batch_size) are taken"),
    Name("is_map_style_dataset", _M, "works", "has __getitem__ and __len__"),
    Name("is_iterable_style_dataset", _M, "works", "iterable without __getitem__"),
    Name("mpu", _A, "works", "None: initialize refuses an mpu (jzero is data-parallel only)"),
    Name("config", _A, "differs", "the resolved config as a dict (DeepSpeed keeps what it got)"),
    Name("monitor", _A, "differs", "jzero's Monitor of the tensorboard / csv_monitor / wandb blocks"),
    Name("param_names", _A, "differs", "the parameters' paths in the Flax tree ('a/b/kernel')"),
    # -- checkpoints --------------------------------------------------------------------------
    Name("save_checkpoint", _M, "differs",
         "(save_dir, tag=None, client_state={}, save_latest=True): saves the engine's state as "
         "save_dir/<tag>, default tag 'global_step<N>'; an asynchronous Orbax save, which "
         "load_checkpoint and destroy() wait for; a tag that exists is refused (DeepSpeed "
         "overwrites it)"),
    Name("load_checkpoint", _M, "differs",
         "returns (load_path, client_state); global_steps, global_samples, get_lr() are the "
         "checkpoint's; (None, None) with a warning when load_dir holds no checkpoint. "
         "load_path is the checkpoint's directory (DeepSpeed: its model-states file) and "
         "client_state the dict given to save_checkpoint (DeepSpeed adds its own keys). "
         "load_optimizer_states=False or load_module_only=True restore the weights alone"),
    Name("module_state_dict", _M, "differs",
         "the parameters as a Flax tree of fp32 arrays (the master), not torch names"),
    Name("load_module_state_dict", _M, "refused",
         "weights in: engine.jzero_engine.init(rng, params=tree) or "
         "engine.jzero_engine.load_weights(path) (safetensors, Orbax)"),
    Name("load_moe_state_dict", _M, "refused", _NO_MOE),
    Name("save_16bit_model", _M, "refused",
         "save_checkpoint, then `jzero convert DIR --safetensors model.safetensors` (or "
         "jzero.checkpoint.consolidate) writes the consolidated weights"),
    Name("save_fp16_model", _M, "refused",
         "save_checkpoint, then `jzero convert DIR --safetensors model.safetensors`"),
    Name("checkpoint_engine", _A, "refused", "jzero's checkpoints are Orbax saves (jzero.checkpoint)"),
    Name("save_non_zero_checkpoint", _A, "refused",
         "every process saves the shards its devices hold (Orbax); no per-rank file choice"),
    Name("save_zero_checkpoint", _A, "refused",
         "every process saves the shards its devices hold (Orbax); no per-rank file choice"),
    Name("loaded_checkpoint_dp_world_size", _A, "refused",
         "a jzero checkpoint restores into any device count; `jzero inspect DIR` names its writer's"),
    Name("loaded_checkpoint_mp_world_size", _A, "refused", _NO_TP),
    Name("checkpoint_mp_rank", _A, "refused", _NO_TP),
    Name("checkpoint_serialization_enabled", _M, "refused",
         "jzero's checkpoints are Orbax (tensorstore) saves; there is no torch serialization"),
    Name("checkpoint_writer_enabled", _M, "refused",
         "jzero's checkpoints are Orbax (tensorstore) saves; there is no checkpoint writer"),
    Name("checkpoint_tag_validation_enabled", _M, "works", _CONFIG),
    Name("checkpoint_tag_validation_fail", _M, "works", _CONFIG),
    Name("use_node_local_storage", _M, "works", _CONFIG),
    Name("load_universal_checkpoint", _M, "works", _CONFIG),
    Name("zero_load_from_fp32_weights", _M, "works",
         "always True: a restore reads the fp32 master and casts the compute params from it"),
    Name("zero_elastic_checkpoint", _M, "works", _CONFIG),
    Name("zero_gather_16bit_weights_on_model_save", _M, "works", _CONFIG),
    Name("destroy", _M, "works", "waits for pending saves and drops the engine's state"),
    Name("collect_python_gc", _M, "works", "gc.collect()"),
    # -- the config's numbers -----------------------------------------------------------------
    *_rows(_M, "works", _CONFIG,
           "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps "
           "steps_per_print wall_clock_breakdown dump_state gradient_clipping "
           "dataloader_drop_last gradient_predivide_factor optimizer_params scheduler_name "
           "scheduler_params loss_scale zero_optimization_stage zero_allow_untested_optimizer "
           "zero_force_ds_cpu_optimizer zero_reduce_scatter zero_overlap_comm "
           "zero_offload_optimizer zero_offload_param zero_sub_group_size zero_reduce_bucket_size "
           "zero_multi_rank_bucket_allreduce zero_allgather_bucket_size zero_contiguous_gradients "
           "zero_max_live_parameters zero_max_reuse_distance zero_prefetch_bucket_size "
           "zero_module_granularity_threshold zero_param_persistence_threshold "
           "zero_model_persistence_threshold zero_ignore_unused_parameters "
           "zero_save_muon_momentum_buffer_in_memory zero_allgather_partitions "
           "zero_round_robin_gradients zero_hpz_partition_size zero_quantized_weights "
           "zero_quantized_nontrainable_weights zero_quantized_gradients "
           "zero_log_trace_cache_warnings zero_allgather_sequential is_sanity_checks_enabled "
           "super_offload cpuadam_cores_perc fp16_enabled bfloat16_enabled fp16_auto_cast "
           "aio_config memory_breakdown"),
    Name("optimizer_name", _M, "works",
         "the config optimizer's type in lower case, or the client optimizer's class name"),
    Name("zero_optimization", _M, "works", "stage > 0"),
    Name("zero_optimization_partition_gradients", _M, "works", "stage >= 2"),
    Name("zero_optimization_partition_weights", _M, "works", "stage 3"),
    Name("is_first_weights_partition_group", _M, "works", "stage 3 (jzero has no MiCS)"),
    Name("zero_use_cpu_optimizer", _M, "works", "offload_optimizer.device is cpu or nvme"),
    Name("zero_cpu_offload", _M, "works", "offload_optimizer.device is cpu"),
    Name("zero_nvme_offload_optimizer", _M, "works", "offload_optimizer.device is nvme"),
    Name("zero_partial_offload", _M, "works", "offload_optimizer.ratio"),
    Name("zero_compute_grad_norm", _M, "works",
         "always True: every step computes the global norm (metrics['grad_norm'])"),
    Name("postscale_gradients", _M, "works", "not prescale_gradients"),
    Name("dynamic_loss_scale", _M, "works", "fp16 with loss_scale 0"),
    Name("initial_dynamic_scale", _M, "works", "2 ** fp16.initial_scale_power"),
    Name("dynamic_loss_scale_args", _M, "works",
         "DeepSpeed's dict (init_scale, scale_window, delayed_shift, consecutive_hysteresis, "
         "min_scale) with a dynamic fp16 scale, else None"),
    Name("communication_data_type", _A, "differs",
         "the gradient reduction's dtype as a JAX dtype (default: the compute dtype)"),
    Name("get_data_types", _M, "differs", "(compute dtype, gradient accumulation dtype), JAX dtypes"),
    Name("gradient_average", _A, "works", "gradient_allreduce_op is mean"),
    Name("scale_wrt_gas", _A, "works", "True: the loss is the mean over the global batch"),
    Name("fp16_master_weights_and_gradients", _M, "works", _OFF),
    Name("bf16_master_weights_and_gradients", _M, "works", _OFF),
    Name("bf16_optimizer_states", _M, "works", _OFF),
    Name("torch_autocast_enabled", _M, "works", _OFF),
    Name("data_efficiency_enabled", _M, "works", _OFF),
    Name("data_sampling_enabled", _M, "works", _OFF),
    Name("curriculum_learning_enabled", _M, "works", _OFF),
    Name("random_ltd_enabled", _M, "works", _OFF),
    Name("zero_legacy_stage1", _M, "works", _OFF),
    Name("flops_profiler_enabled", _M, "works",
         "always False: the config's flops_profiler block is ignored, with a warning"),
    Name("autotuning_enabled", _M, "works",
         "always False: the config's autotuning block is ignored, with a warning"),
    Name("is_deepcompile_enabled", _M, "works", "always False: " + _NO_COMPILE),
    Name("is_deepcompile_active", _M, "works", "always False: " + _NO_COMPILE),
    Name("is_compiled", _A, "works", "always True: the step is an XLA program"),
    Name("has_moe_layers", _A, "works", "always False: " + _NO_MOE),
    Name("pipeline_parallelism", _A, "works", "always False: " + _NO_TP),
    # -- processes and devices ----------------------------------------------------------------
    Name("world_size", _A, "differs", "the number of devices (DeepSpeed: of ranks, one per GPU)"),
    Name("dp_world_size", _A, "differs", "the devices over the mesh's batch axes"),
    Name("seq_dp_world_size", _A, "differs", "the devices over the mesh's batch axes"),
    Name("mp_world_size", _A, "works", "1: " + _NO_TP),
    Name("sequence_parallel_size", _A, "works", "1: " + _NO_TP),
    Name("global_rank", _A, "differs",
         "this process's index (jax.process_index()); one jzero process drives all its local "
         "devices"),
    Name("local_rank", _A, "differs", "LOCAL_RANK from the environment (0 when unset)"),
    Name("get_data_parallel_rank", _M, "differs", "this process's index (jax.process_index())"),
    Name("get_model_parallel_rank", _M, "works", "0: " + _NO_TP),
    Name("get_tensor_parallel_rank", _M, "works", "0: " + _NO_TP),
    Name("device", _A, "differs", "this process's first JAX device"),
    Name("dist_backend", _A, "differs", "the JAX backend's name (cpu, gpu, tpu)"),
    *_rows(_A, "refused", _GROUPS,
           "data_parallel_group seq_data_parallel_group seq_parallel_group all_to_all_group "
           "local_all_to_all_group expert_parallel_group expert_data_parallel_group mesh_device"),
    Name("get_sequence_parallel_group", _M, "refused", _NO_TP),
    Name("use_ds_comm", _A, "refused", _GROUPS),
    *_rows(_M, "refused", _NO_TP, "tensor_parallel_config autotp_size"),
    *_rows(_M, "refused", _XLA,
           "allreduce_gradients no_sync coalesce_grad_reduction scale "
           "set_gradient_accumulation_boundary clip_fp32_gradients allreduce_bucket "
           "allreduce_and_copy allreduce_no_retain buffered_allreduce_fallback "
           "sparse_allreduce_no_retain sparse_allreduce_bucket sparse_allreduce "
           "sparse_all_gather all_gather_scalar managed_gradient_accumulation"),
    *_rows(_A, "refused", _XLA,
           "enable_backward_allreduce inside_no_sync_ctxt flatten unflatten update_interval "
           "warn_unscaled_loss"),
    Name("empty_partition_cache", _M, "refused",
         "stage 3 keeps no cache of gathered parameters: each is freed after its layer"),
    *_rows(_M, "refused", _NO_COMPILE,
           "compile compile_zero_optimization_stage compile_autosp compile_autotp "
           "uses_parallelization_pass_only get_autosp_backend get_autotp_backend "
           "get_deepcompile_backend get_deepspeed_compile_backend get_compile_time "
           "register_compile_pass"),
    *_rows(_M, "refused",
           "offload is the config's offload_optimizer / offload_param blocks, fixed at "
           "initialize (the memory report: engine.jzero_engine.memory_report(state))",
           "offload_states reload_states"),
    Name("swap_tensor_config", _M, "refused",
         "the NVMe tier's settings are the config's offload blocks and aio "
         "(engine.jzero_engine.nvme_store)"),
    Name("zenflow_config", _M, "refused", "jzero refuses zenflow at initialize"),
    Name("zero_parameter_alignment", _M, "refused",
         "the plan pads each partitioned leaf itself (engine.jzero_engine.plan)"),
    Name("get_optimizer_configuration", _M, "refused",
         "the optimizer is the config's optimizer block (optimizer_name(), optimizer_params())"),
    Name("optimizer_legacy_fusion", _M, "refused", "no fused torch optimizers: XLA fuses the update"),
    Name("log_level", _M, "refused", "jzero logs to the `jzero` logger (logging.getLogger('jzero'))"),
    *_rows(_M, "refused", _BATCH_FIXED, "set_train_batch_size set_train_micro_batch_size"),
    *_rows(_M, "refused", _DATA,
           "set_data_post_process_func set_custom_curriculum_learning_schedule "
           "data_efficiency_config data_sampling_config curriculum_learning_config"),
    *_rows(_M, "refused", "jzero refuses random_ltd (data_efficiency) at initialize",
           "random_ltd_config random_ltd_initialize"),
    Name("random_ltd_scheduler", _A, "refused", "jzero refuses random_ltd at initialize"),
    *_rows(_M, "refused", "jzero refuses torch_autocast at initialize; precision is the config's "
           "fp16 / bf16 block", "torch_autocast_dtype torch_autocast_lower_precision_safe_modules"),
    Name("torch_autocast_z0_gradscaler", _A, "refused",
         "jzero refuses torch_autocast at initialize; fp16's loss scaler is the config's"),
    *_rows(_M, "refused", _NO_FLOPS,
           "flops_profiler_recompute_fwd_factor flops_profiler_profile_step "
           "flops_profiler_module_depth flops_profiler_top_modules flops_profiler_detailed "
           "flops_profiler_output_file"),
    *_rows(_A, "refused", _NO_FLOPS, "flops flops_profiler fwd_duration"),
    *_rows(_M, "refused", _NO_AUTOTUNE,
           "autotuning_start_profile_step autotuning_end_profile_step autotuning_metric_path "
           "autotuning_model_info_path autotuning_metric autotuning_profile_model_info"),
    Name("autotuning_model_info", _A, "refused", _NO_AUTOTUNE),
    *_rows(_A, "refused", _TIMERS, "engine_timers engine_timers_cache timers tput_timer"),
    Name("get_wall_clock_timers", _M, "refused", _TIMERS),
    Name("print_forward_breakdown", _M, "refused", _TIMERS),
    Name("summary_events", _A, "refused",
         "the monitors write every step's events themselves (the config's tensorboard, "
         "csv_monitor, wandb blocks)"),
    *_rows(_A, "refused", _NO_MOE, "gate_modules moe_layers num_experts"),
    *_rows(_A, "refused", "jzero has no OptimizedLinear (LoRA) layers",
           "optimized_linear_base_weight_sharding optimized_linear_lora_enabled"),
    *_rows(_A, "refused", "forward hooks are the model's own (Flax); the step is compiled",
           "module_forward_pre_hook module_forward_post_hook"),
    *_rows(_A, "refused", "the data loader checks its batches itself (engine.jzero_engine."
           "check_input_ids)", "first_dataloader_check"),
    Name("dont_change_device", _A, "refused", _PRECISION),
    # -- torch.nn.Module calls scripts make on the engine -------------------------------------
    Name("parameters", _M, "differs", "the parameters' arrays (fp32), JAX arrays"),
    Name("named_parameters", _M, "differs", "(path, array) pairs, paths as in param_names"),
    Name("state_dict", _M, "differs", "module_state_dict(): the Flax tree of fp32 parameters"),
    Name("load_state_dict", _M, "refused",
         "weights in: engine.jzero_engine.init(rng, params=tree) or load_checkpoint"),
    *_rows(_M, "refused", _PRECISION, "to cuda half float bfloat16"),
]

NAMES: dict[str, Name] = {row.name: row for row in _TABLE}
if len(NAMES) != len(_TABLE):  # a name twice is a mistake in the table
  raise ValueError(sorted({r.name for r in _TABLE if sum(s.name == r.name for s in _TABLE) > 1}))


def refusal_message(name: str) -> str:
  """What jzero says when a script uses DeepSpeed's refused ``name``."""
  row = NAMES[name]
  call = f"engine.{name}(...)" if row.kind == "method" else f"engine.{name}"
  return f"DeepSpeed's {call} has no jzero counterpart: {row.note}."


def markdown_table() -> str:
  """The table docs/coming-from-deepspeed.md shows, sorted by name."""
  lines = ["| DeepSpeed's engine | jzero | how / why |", "|---|---|---|"]
  for row in sorted(NAMES.values(), key=lambda r: r.name):
    shown = f"`{row.name}()`" if row.kind == "method" else f"`{row.name}`"
    lines.append(f"| {shown} | {row.status} | {row.note.replace('|', '/')} |")
  return "\n".join(lines)
