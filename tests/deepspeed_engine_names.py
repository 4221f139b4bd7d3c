"""The public names of DeepSpeed 0.19.8's ``DeepSpeedEngine`` (deepspeed/runtime/engine.py), written
down from its source: the methods and properties of the class body, the public attributes its
methods assign (``self.name = ...``), ``module``, and the ``torch.nn.Module`` calls training scripts
make on the engine. No DeepSpeed import: tests/train/test_deepspeed_engine.py walks these names.
"""

__all__ = ["METHODS", "PROPERTIES", "ATTRIBUTES", "TORCH_MODULE_METHODS", "ALL_NAMES"]

METHODS = """
    aio_config all_gather_scalar allreduce_and_copy allreduce_bucket allreduce_gradients
    allreduce_no_retain autotp_size autotuning_enabled autotuning_end_profile_step
    autotuning_metric autotuning_metric_path autotuning_model_info_path
    autotuning_profile_model_info autotuning_start_profile_step backward
    bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled
    buffered_allreduce_fallback checkpoint_serialization_enabled
    checkpoint_tag_validation_enabled checkpoint_tag_validation_fail checkpoint_writer_enabled
    clip_fp32_gradients coalesce_grad_reduction collect_python_gc compile compile_autosp
    compile_autotp compile_zero_optimization_stage cpuadam_cores_perc curriculum_learning_config
    curriculum_learning_enabled data_efficiency_config data_efficiency_enabled
    data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy
    dump_state dynamic_loss_scale dynamic_loss_scale_args empty_partition_cache eval
    flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth
    flops_profiler_output_file flops_profiler_profile_step flops_profiler_recompute_fwd_factor
    flops_profiler_top_modules forward fp16_auto_cast fp16_enabled
    fp16_master_weights_and_gradients get_autosp_backend get_autotp_backend get_batch_info
    get_compile_time get_data_parallel_rank get_data_types get_deepcompile_backend
    get_deepspeed_compile_backend get_global_grad_norm get_lr get_model_parallel_rank get_mom
    get_optimizer_configuration get_sequence_parallel_group get_tensor_parallel_rank get_type
    get_wall_clock_timers gradient_accumulation_steps gradient_clipping
    gradient_predivide_factor initial_dynamic_scale is_deepcompile_active is_deepcompile_enabled
    is_first_weights_partition_group is_gradient_accumulation_boundary is_iterable_style_dataset
    is_map_style_dataset is_sanity_checks_enabled load_checkpoint load_module_state_dict
    load_moe_state_dict load_universal_checkpoint log_level loss_scale
    managed_gradient_accumulation memory_breakdown module_state_dict no_sync offload_states
    optimizer_legacy_fusion optimizer_name optimizer_params postscale_gradients
    print_forward_breakdown random_ltd_config random_ltd_enabled random_ltd_initialize
    register_compile_pass reload_states save_16bit_model save_checkpoint save_fp16_model scale
    scheduler_name scheduler_params set_custom_curriculum_learning_schedule
    set_data_post_process_func set_gradient_accumulation_boundary set_train_batch_size
    set_train_micro_batch_size sparse_all_gather sparse_allreduce sparse_allreduce_bucket
    sparse_allreduce_no_retain step steps_per_print super_offload swap_tensor_config
    tensor_parallel_config torch_autocast_dtype torch_autocast_enabled
    torch_autocast_lower_precision_safe_modules train train_batch_size
    train_micro_batch_size_per_gpu use_node_local_storage uses_parallelization_pass_only
    wall_clock_breakdown was_step_applied zenflow_config zero_allgather_bucket_size
    zero_allgather_partitions zero_allgather_sequential zero_allow_untested_optimizer
    zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint
    zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_grad
    zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1
    zero_load_from_fp32_weights zero_log_trace_cache_warnings zero_max_live_parameters
    zero_max_reuse_distance zero_model_persistence_threshold zero_module_granularity_threshold
    zero_multi_rank_bucket_allreduce zero_nvme_offload_optimizer zero_offload_optimizer
    zero_offload_param zero_optimization zero_optimization_partition_gradients
    zero_optimization_partition_weights zero_optimization_stage zero_overlap_comm
    zero_param_persistence_threshold zero_parameter_alignment zero_partial_offload
    zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights
    zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter
    zero_round_robin_gradients zero_save_muon_momentum_buffer_in_memory zero_sub_group_size
    zero_use_cpu_optimizer
""".split()

PROPERTIES = """
    communication_data_type is_compiled
""".split()

ATTRIBUTES = """
    all_to_all_group autotuning_model_info basic_optimizer checkpoint_engine checkpoint_mp_rank
    client_lr_scheduler client_optimizer collate_fn config data_parallel_group device
    dist_backend dont_change_device dp_world_size enable_backward_allreduce engine_timers
    engine_timers_cache expert_data_parallel_group expert_parallel_group first_dataloader_check
    flatten flops flops_profiler fwd_duration gate_modules global_rank global_samples
    global_steps gradient_average has_moe_layers inside_no_sync_ctxt
    loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size local_all_to_all_group
    local_rank losses lr_scheduler mesh_device micro_steps module module_forward_post_hook
    module_forward_pre_hook moe_layers monitor mp_world_size mpu num_experts
    optimized_linear_base_weight_sharding optimized_linear_lora_enabled optimizer param_names
    pipeline_parallelism random_ltd_scheduler save_non_zero_checkpoint save_zero_checkpoint
    scale_wrt_gas seq_data_parallel_group seq_dp_world_size seq_parallel_group
    sequence_parallel_size skipped_steps summary_events timers torch_autocast_z0_gradscaler
    tput_timer training_data training_dataloader unflatten update_interval use_ds_comm
    warn_unscaled_loss world_size
""".split()

TORCH_MODULE_METHODS = "parameters named_parameters state_dict load_state_dict to cuda half float bfloat16".split()

ALL_NAMES = METHODS + PROPERTIES + ATTRIBUTES + TORCH_MODULE_METHODS
