"""Tests of jzero.config.schema: DeepSpeed's config format, its defaults, "auto" and what jzero honours."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import pytest

from jzero.config import Config
from jzero.config.support import SUPPORT_TABLE
from jzero.errors import ConfigError, JZeroWarning, NotSupportedError

DATA = Path(__file__).parents[1] / "data" / "ds_configs"
RESOLVE = dict(dp_world_size=8, hidden_size=256, total_num_steps=100,
               auto_values={"micro_batch_size": 4, "warmup_num_steps": 10})
NVME = "deepspeedai_DeepSpeedExamples__inference_sglang_ds_offload_nvme_aio.json"
MEGATRON = "deepspeedai_DeepSpeed__tests_model_Megatron_GPT2_ds_config_func_bs8_zero2_offload.json"
IMAGENET = "deepspeedai_DeepSpeedExamples__training_imagenet_config_ds_fp16_z1_config.json"
BF16_FULL = "deepspeedai_DeepSpeedExamples__training_bf16_master_weight_configs_bf16_full.json"
BATCH = "deepspeedai_DeepSpeed__tests_unit_ds_batch_config.json"
SWIFT = "modelscope_ms-swift__swift_llm_ds_config_zero3.json"
HF_ZERO2 = "huggingface_transformers__tests_deepspeed_ds_config_zero2.json"
HF_ZERO3 = "huggingface_transformers__tests_deepspeed_ds_config_zero3.json"
HF_ZERO3_BF16 = "huggingface_transformers__tests_deepspeed_ds_config_zero3_bf16.json"

# Each real config: "ok", or the lines NotSupportedError must hold, or the ConfigError text that
# resolve(**RESOLVE) raises (DeepSpeed itself rejects those batch sizes on 8 data-parallel ranks).
REAL_CONFIGS = {
    SWIFT: "ok",
    BF16_FULL: ["bf16.bf16_master_weights_and_grads=true", "bf16.bf16_optimizer_states=true",
                "torch_autocast.enabled=true"],
    IMAGENET: ["fp16.auto_cast=true"],
    # honoured since ZeRO++ exists; its hpZ group of 16 needs 16 devices (tests/comm/test_zeropp.py)
    "deepspeedai_DeepSpeed__docs__tutorials_zeropp.md.json": "ok",
    MEGATRON: "ok",
    "huggingface_accelerate__examples_deepspeed_config_templates_zero_stage2_offload_config.json":
        "ok",
    # offload to the cpu is honoured: optimizer (jzero.tiers.host_optimizer) and params (jzero.tiers.host_params)
    "huggingface_accelerate__tests_deepspeed_ds_config_zero3.json": "ok",
    HF_ZERO2: "ok",
    HF_ZERO3: "ok",
    HF_ZERO3_BF16: "ok",
    NVME: "train_batch_size 1 is not a multiple of the data-parallel size 8, so no whole "
          "train_micro_batch_size_per_gpu gives it",
    BATCH: "train_batch_size 2 is not a multiple of gradient_accumulation_steps 1 * "
           "data-parallel size 8 = 8, so no whole train_micro_batch_size_per_gpu gives it",
}


def load_quietly(source) -> Config:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", JZeroWarning)
    return Config.load(source)


def error_of(source, error=ConfigError) -> str:
  with pytest.raises(error) as info:
    load_quietly(source)
  return str(info.value)


def test_every_real_config_is_listed():
  assert sorted(REAL_CONFIGS) == sorted(p.name for p in DATA.glob("*.json"))


@pytest.mark.filterwarnings("ignore::jzero.errors.JZeroWarning")
@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_outcome(name):
  expected = REAL_CONFIGS[name]
  config = Config.load(DATA / name)
  if isinstance(expected, str) and expected != "ok":
    with pytest.raises(ConfigError, match="invalid batch size") as info:
      config.resolve(**RESOLVE)
    assert expected in str(info.value) and str(DATA / name) in str(info.value)
    return
  resolved = config.resolve(**RESOLVE)
  if expected == "ok":
    resolved.check_supported()
    return
  with pytest.raises(NotSupportedError) as info:
    resolved.check_supported()
  lines = str(info.value).splitlines()
  assert lines[0] == f"{DATA / name}: jzero cannot run this config:"
  assert len(lines) == 1 + len(expected)
  for line in expected:
    assert any(line in got for got in lines[1:]), (line, lines)


@pytest.mark.filterwarnings("ignore::jzero.errors.JZeroWarning")
@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_round_trips_through_to_dict(name):
  config = Config.load(DATA / name)
  data = config.to_dict()
  assert json.loads(json.dumps(data)) == data
  assert Config.load(data) == config


def test_ms_swift_zero3_resolves_like_hugging_face():
  resolved = load_quietly(DATA / SWIFT).resolve(
      **RESOLVE)
  zero = resolved.zero_optimization
  assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
          resolved.gradient_accumulation_steps) == (32, 4, 1)
  assert zero.reduce_bucket_size == 256 * 256
  assert zero.prefetch_bucket_size == int(0.9 * 256 * 256) == 58982
  assert zero.param_persistence_threshold == 2560
  assert zero.gather_16bit_weights_on_model_save is True
  assert zero.offload_param.device == "none" and zero.overlap_comm is True
  assert resolved.gradient_clipping == 1.0 and resolved.precision == "fp32"
  assert '"auto"' not in json.dumps(resolved.to_dict())


def test_nvme_param_config_is_supported_and_warns_for_the_keys_it_does_not_honour():
  """ZeRO-Infinity's parameter tier (jzero.tiers.nvme_params) reads offload_param's NVMe keys and aio's
  concurrency; the libaio request size and pinning the tier's host buffers have no effect (a
  warning each)."""
  config = load_quietly(DATA / NVME)
  assert config.zero_optimization.offload_param.buffer_size == "auto"
  assert config.aio.intra_op_parallelism == 8
  with pytest.warns(JZeroWarning) as record:
    config.check_supported()
  messages = sorted(str(w.message) for w in record)
  assert len(messages) == 2, messages
  assert re.match(r"aio\.block_size=8388608 has no effect under XLA: it tunes libaio requests",
                  messages[0]), messages
  assert re.match(r"zero_optimization\.offload_param\.pin_memory=true has no effect.*host "
                  r"callbacks", messages[1]), messages


def test_ds_batch_config_passes_on_two_ranks():
  config = load_quietly(DATA / BATCH)
  resolved = config.resolve(dp_world_size=2)
  assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
          resolved.gradient_accumulation_steps) == (2, 1, 1)
  resolved.check_supported()
  assert resolved.precision == "fp16" and resolved.optimizer.params == {"lr": 0.00015}


LOAD_WARNINGS = {
    IMAGENET: [
        "'cuda_visible_devices': jzero ignores this top-level key"],
    HF_ZERO3_BF16: [
        'bfloat16 is deprecated: jzero reads it as bf16={"enabled": "auto"}',
        "zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated: jzero reads it "
        "as zero_optimization.gather_16bit_weights_on_model_save=true"],
    HF_ZERO3: [
        "zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated: jzero reads it "
        "as zero_optimization.gather_16bit_weights_on_model_save=true"],
    MEGATRON: [
        "zero_optimization.cpu_offload is deprecated: jzero reads it as "
        'zero_optimization.offload_optimizer={"device": "cpu"}'],
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_load_warnings(name):
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    Config.load(DATA / name)
  assert [str(w.message) for w in record] == LOAD_WARNINGS.get(name, [])
  assert all(w.category is JZeroWarning for w in record)


def test_megatron_config_warns_about_activation_partitioning():
  config = load_quietly(
      DATA / MEGATRON)
  assert config.zero_optimization.offload_optimizer.device == "cpu"
  assert config.activation_checkpointing.partition_activations is True
  with pytest.warns(JZeroWarning) as record:  # optimizer offload to the cpu is honoured
    config.check_supported()
  assert [str(w.message) for w in record] == [
      f"activation_checkpointing.{key}=true has no effect under XLA: no model parallelism; XLA "
      "owns activation memory"
      for key in ("partition_activations", "contiguous_memory_optimization")]


def test_imagenet_config_reads_tabs_zero_clipping_and_float_eps():
  config = load_quietly(DATA / IMAGENET)
  assert config.gradient_clipping == 0.0 and config.zero_allow_untested_optimizer is True
  assert config.optimizer.params["betas"] == [0.8, 0.999]


# --- defaults --------------------------------------------------------------------------------


def test_defaults_are_deepspeed_0_19_6():
  config = Config.load({})
  zero = config.zero_optimization
  assert config.gradient_clipping == 1.0 and config.steps_per_print is None
  assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 500_000_000,
                                                                             500_000_000)
  assert zero.prefetch_bucket_size == 50_000_000 and zero.param_persistence_threshold == 100_000
  assert zero.sub_group_size == zero.max_live_parameters == zero.max_reuse_distance == 10**9
  assert zero.offload_param is None and zero.zero_hpz_partition_size == 1
  assert (config.fp16.initial_scale_power, config.fp16.loss_scale_window,
          config.fp16.hysteresis, config.fp16.min_loss_scale) == (16, 1000, 2, 1)
  assert config.bf16.check_grad_overflow is True and config.precision == "fp32"
  assert config.activation_checkpointing is None and config.optimizer is None
  assert config.checkpoint.tag_validation == "Warn" and config.gradient_allreduce_op == "mean"
  assert config.aio.block_size == 1_048_576 and config.source is None
  offload = Config.load({"zero_optimization": {"stage": 3, "offload_param": {},
                                               "offload_optimizer": {}}}).zero_optimization
  assert offload.offload_param.pin_memory is True and offload.offload_param.buffer_count == 5
  assert offload.offload_optimizer.pin_memory is True
  assert offload.offload_optimizer.buffer_count == 4 and offload.offload_optimizer.ratio == 1.0


@pytest.mark.parametrize("stage, overlap", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_defaults_to_stage_3(stage, overlap):
  implicit = Config.load({"zero_optimization": {"stage": stage}})
  assert implicit.zero_optimization.overlap_comm is overlap
  explicit = Config.load({"zero_optimization": {"stage": stage, "overlap_comm": not overlap}})
  assert explicit.zero_optimization.overlap_comm is (not overlap)


def test_activation_checkpointing_presence_is_kept():
  config = Config.load({"activation_checkpointing": {}})
  assert config.activation_checkpointing is not None
  assert config.activation_checkpointing.partition_activations is False


def test_precision_property():
  assert Config.load({"fp16": {"enabled": True}}).precision == "fp16"
  assert Config.load({"bf16": {"enabled": True}}).precision == "bf16"
  assert Config.load({"bf16": {"enabled": "auto"}}).precision == "fp32"


# --- aliases, deprecations -----------------------------------------------------------------------


def test_stage3_aliases_and_plain_names_are_both_accepted():
  aliased = Config.load({"zero_optimization": {"stage3_param_persistence_threshold": 7,
                                               "stage3_max_live_parameters": 5e8}})
  plain = Config.load({"zero_optimization": {"param_persistence_threshold": 7,
                                             "max_live_parameters": 500_000_000}})
  assert aliased == plain
  assert aliased.zero_optimization.param_persistence_threshold == 7
  assert aliased.to_dict()["zero_optimization"]["stage3_param_persistence_threshold"] == 7
  message = error_of({"zero_optimization": {"stage3_param_persistence_threshold": 1,
                                            "param_persistence_threshold": 2}})
  assert "stage3_param_persistence_threshold and param_persistence_threshold" in message


@pytest.mark.parametrize("zero, block, expected", [
    ({"cpu_offload": True}, "offload_optimizer", {"device": "cpu"}),
    ({"cpu_offload_param": True, "stage": 3}, "offload_param", {"device": "cpu"}),
    ({"cpu_offload_param": True, "cpu_offload_use_pin_memory": False}, "offload_param",
     {"device": "cpu", "pin_memory": False}),
])
def test_deprecated_offload_keys_are_mapped(zero, block, expected):
  with pytest.warns(JZeroWarning, match="is deprecated: jzero reads it as"):
    config = Config.load({"zero_optimization": zero})
  offload = getattr(config.zero_optimization, block)
  assert {key: getattr(offload, key) for key in expected} == expected


def test_cpu_offload_false_means_no_offload():
  with pytest.warns(JZeroWarning, match="cpu_offload is deprecated"):
    config = Config.load({"zero_optimization": {"cpu_offload": False}})
  assert config.zero_optimization.offload_optimizer is None


def test_legacy_boolean_zero_optimization():
  with pytest.warns(JZeroWarning, match=r'"zero_optimization": true is deprecated'):
    config = Config.load({"zero_optimization": True, "allgather_size": 1000})
  assert config.zero_optimization.stage == 1
  assert config.zero_optimization.allgather_bucket_size == 1000
  with pytest.warns(JZeroWarning, match=r'"zero_optimization": false is deprecated'):
    assert Config.load({"zero_optimization": False}).zero_optimization.stage == 0


def test_bfloat16_is_read_as_bf16():
  with pytest.warns(JZeroWarning, match="bfloat16 is deprecated: jzero reads it as bf16"):
    assert Config.load({"bfloat16": {"enabled": True}}).precision == "bf16"


def test_aio_thread_count_is_ignored_with_a_warning():
  with pytest.warns(JZeroWarning, match=r"aio\.thread_count: DeepSpeed >= 0\.16\.4 ignores it "
                    r"\(it is intra_op_parallelism now\)"):
    config = Config.load({"aio": {"thread_count": 4}})
  assert config.aio.intra_op_parallelism == 1


@pytest.mark.parametrize("data, old, new", [
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "cpu_offload", "offload_optimizer"),
    ({"zero_optimization": {"cpu_offload_param": False, "offload_param": {}}},
     "cpu_offload_param", "offload_param"),
    ({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                            "stage3_gather_16bit_weights_on_model_save": True}},
     "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
    ({"zero_optimization": {"cpu_offload_use_pin_memory": True,
                            "offload_param": {"pin_memory": False}}},
     "cpu_offload_use_pin_memory", "offload_param.pin_memory"),
    ({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}, "bfloat16", "bf16"),
])
def test_deprecated_key_with_its_replacement_is_an_error(data, old, new):
  assert (f"Cannot provide deprecated parameter '{old}' and replacing parameter '{new}' together"
          in error_of(data))


# --- unknown keys, types, semantic checks ------------------------------------------------------


def test_unknown_key_in_a_strict_block_suggests_the_closest():
  message = error_of({"zero_optimization": {"stgae": 2}})
  assert "zero_optimization.stgae: unknown key; did you mean 'stage'?" in message
  assert "did you mean 'buffer_size'?" in error_of(
      {"zero_optimization": {"offload_param": {"buffer_sise": 1}}})
  assert "fp16.initial_scale_pwr: unknown key; did you mean 'initial_scale_power'?" in error_of(
      {"fp16": {"initial_scale_pwr": 8}})
  assert "bf16.enable: unknown key" in error_of({"bf16": {"enable": True}})
  assert "data_types.grad_accum: unknown key" in error_of({"data_types": {"grad_accum": "fp32"}})


def test_offload_optimizer_has_no_buffer_size():
  assert "zero_optimization.offload_optimizer.buffer_size: unknown key" in error_of(
      {"zero_optimization": {"offload_optimizer": {"buffer_size": 1}}})


def test_all_problems_are_reported_together_with_the_file_name(tmp_path):
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({"zero_optimization": {"stgae": 2, "stage": 2.5},
                              "fp16": {"enabled": "yes"}, "train_batch_size": 0}))
  lines = error_of(path).splitlines()
  assert lines[0] == f"{path}: invalid DeepSpeed config:"
  assert lines[1:] == [
      "  train_batch_size: must be >= 1, got 0",
      '  fp16.enabled: expected true or false, got "yes"',
      "  zero_optimization.stage: expected an integer, got 2.5",
      "  zero_optimization.stgae: unknown key; did you mean 'stage'?",
  ]


def test_unknown_keys_of_lenient_blocks_warn():
  with pytest.warns(JZeroWarning) as record:
    config = Config.load({"activation_checkpointing": {"partition_activation": True},
                          "aio": {"queue_dept": 4}})
  messages = [str(w.message) for w in record]
  assert messages == [
      "activation_checkpointing.partition_activation: unknown key, ignored (DeepSpeed ignores it "
      "too); did you mean 'partition_activations'?",
      "aio.queue_dept: unknown key, ignored (DeepSpeed ignores it too); did you mean "
      "'queue_depth'?",
  ]
  assert config.activation_checkpointing.partition_activations is False


def test_each_unknown_top_level_key_warns_once():
  """DeepSpeed's keys that change nothing here, and unknown keys not close enough to a known one
  to be its misspelling, are dropped with a warning each."""
  with pytest.warns(JZeroWarning) as record:
    Config.load({"flops_profiler": {"enabled": True}, "comms_logger": {}, "steps_per_log": 10,
                 "cuda_visible_devices": 0})
  messages = [str(w.message) for w in record]
  assert messages == [
      "'flops_profiler': jzero ignores this top-level key",
      "'comms_logger': jzero ignores this top-level key",
      "'steps_per_log': jzero ignores this top-level key; did you mean 'steps_per_print'?",
      "'cuda_visible_devices': jzero ignores this top-level key",
  ]


@pytest.mark.parametrize("key, known", [
    ("zero_optimisation", "zero_optimization"), ("gradient_clip", "gradient_clipping"),
    ("optimiser", "optimizer"), ("tensorbaord", "tensorboard"),
    ("sequence_parallel", "sequence_parallel_size"),
])
def test_misspelled_top_level_key_is_an_error(key, known):
  """DeepSpeed would ignore it and train without the setting (``zero_optimisation`` at stage 0)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an error, not a warning first
    with pytest.raises(ConfigError) as info:
      Config.load({key: {"stage": 3}, "fp16": {"enabled": "yes"}})
  lines = str(info.value).splitlines()
  assert f"  {key}: unknown top-level key; did you mean '{known}'? DeepSpeed ignores unknown " \
         "top-level keys, so it would train without this setting; correct the name" in lines
  assert '  fp16.enabled: expected true or false, got "yes"' in lines  # reported together


def test_top_level_block_inside_zero_optimization_says_where_it_belongs():
  """The Hugging Face docs' ZeRO-Infinity example nests aio in zero_optimization."""
  message = error_of({"zero_optimization": {"stage": 3, "aio": {"block_size": 1048576}}})
  assert ("zero_optimization.aio: unknown key: aio is a top-level key of DeepSpeed's config, not "
          "part of zero_optimization; move it to the top level") in message
  assert ("zero_optimization.offload_param.fp16: unknown key: fp16 is a top-level key" in error_of(
      {"zero_optimization": {"offload_param": {"fp16": {"enabled": True}}}}))


_TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning",
               "head_pruning", "channel_pruning")
# Each DeepSpeed feature that changes what is trained, on (from DeepSpeed's docs and tutorials),
# then off; the refusal's line, and what it says jzero does instead.
FEATURES = [
    ({"tensor_parallel": {"autotp_size": 4}}, {"tensor_parallel": {"autotp_size": 0}},
     "tensor_parallel.autotp_size=4 (AutoTP", "zero_optimization.stage 3 partitions every weight"),
    ({"sequence_parallel_size": 4}, {"sequence_parallel_size": 1},
     "sequence_parallel_size=4 (DeepSpeed-Ulysses", "each device runs whole sequences"),
    ({"quantize_training": {"enabled": True, "quantize_bits": {"start_bits": 16,
                                                               "target_bits": 8}}},
     {"quantize_training": {"enabled": False}},
     "quantize_training.enabled=true (MoQ", "jzero trains unquantized weights"),
    ({"data_efficiency": {"enabled": True, "data_routing": {
        "enabled": True, "random_ltd": {"enabled": True, "total_layer_num": 24}}}},
     {"data_efficiency": {"enabled": False}},
     "data_efficiency.enabled=true (random-LTD", "jzero trains every token of every batch"),
    *(({"compression_training": {t: {"shared_parameters": {"enabled": True}}}},
       {"compression_training": {t: {"shared_parameters": {"enabled": False}}}},
       f"compression_training.{t}.shared_parameters.enabled=true (DeepSpeed's compression",
       "jzero trains the model as written") for t in _TECHNIQUES),
    ({"compression_training": {"layer_reduction": {"enabled": True, "keep_number_layer": 5}}},
     {"compression_training": {"layer_reduction": {"enabled": False}}},
     "compression_training.layer_reduction.enabled=true", "jzero trains the model as written"),
    ({"sparse_attention": {"mode": "fixed", "block": 16}}, {},
     'sparse_attention={"mode": "fixed", "block": 16} (DeepSpeed\'s block-sparse attention',
     "jzero runs the model's attention as the model defines it"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}},
     {"progressive_layer_drop": {"enabled": False}},
     "progressive_layer_drop.enabled=true", "jzero runs every layer"),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}},
     {"curriculum_learning": {"enabled": False}},
     "curriculum_learning.enabled=true", "jzero trains on the batches as its data loader gives"),
    ({"torch_autocast": {"enabled": True}}, {"torch_autocast": {"enabled": False}},
     "torch_autocast.enabled=true", "bf16.enabled or fp16.enabled sets the compute dtype"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, {"amp": {"enabled": False}},
     "amp.enabled=true (NVIDIA Apex AMP", "jzero's mixed precision is bf16.enabled or fp16"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 2000}},
     {"elasticity": {"enabled": False}},
     "elasticity.enabled=true", "jzero trains with the config's batch sizes"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 4}},
     {"expert_parallel": {"enabled": False}},
     "expert_parallel.enabled=true (AutoEP", "ZeRO partitions the experts' weights"),
]


@pytest.mark.parametrize("on, off, setting, instead", FEATURES,
                         ids=[next(iter(f[0])) + str(i) for i, f in enumerate(FEATURES)])
def test_deepspeed_features_that_change_the_training_are_refused(on, off, setting, instead):
  """Dropped with a warning before, the run then trained plain data parallel."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "jzero ignores this top-level key" any more
    config = Config.load({**on, "train_batch_size": 8})
    with pytest.raises(NotSupportedError) as info:
      config.resolve(dp_world_size=8).check_supported()
    lines = str(info.value).splitlines()
    assert lines[0] == "jzero cannot run this config:" and len(lines) == 2, lines
    assert lines[1].startswith(f"  not yet supported: {setting}") and instead in lines[1], lines
    Config.load({**off, "train_batch_size": 8}).resolve(dp_world_size=8).check_supported()


def test_config_warnings_point_at_the_users_call():
  """Not at jzero's own line (schema.py's warn): the stacklevel is counted past jzero's and
  pydantic's frames, however deep the warning is raised."""
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    config = Config.load({"flops_profiler": {}, "fp16": {"enabled": "auto"},  # load, nested block
                          "zero_optimization": {"cpu_offload": True, "stage": 1,
                                                "contiguous_gradients": False}})
    line = sys._getframe().f_lineno - 3
    config.resolve(dp_world_size=8, auto_values={"micro_batch_size": 1})  # "auto"
    config.check_supported()  # no effect under XLA
  assert [(w.filename, w.lineno) for w in record] == (
      [(__file__, line)] * 2 + [(__file__, line + 4), (__file__, line + 5)]), record


def test_integral_floats_are_integers():
  zero = Config.load({"zero_optimization": {"reduce_bucket_size": 5e8, "sub_group_size": 1e14,
                                            "stage": 3.0}}).zero_optimization
  assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)
  assert zero.sub_group_size == 10**14 and zero.stage == 3


@pytest.mark.parametrize("data, line", [
    ({"zero_optimization": {"stage": 2.5}},
     "zero_optimization.stage: expected an integer, got 2.5"),
    ({"zero_optimization": {"stage": True}},
     "zero_optimization.stage: expected an integer, got true"),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}},
     'zero_optimization.reduce_bucket_size: expected an integer, got "5e8"'),
    ({"train_batch_size": "32"}, 'train_batch_size: expected an integer, got "32"'),
    ({"gradient_clipping": False}, "gradient_clipping: expected a number, got false"),
    ({"steps_per_print": "auto"}, 'steps_per_print: Input should be a valid integer'),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale: must be >= 0, got -1"),
    ({"zero_optimization": {"overlap_comm": 1}},
     "zero_optimization.overlap_comm: expected true or false, got 1"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device: Input should be 'none', 'cpu', 'nvme' or 'auto', "
     'got "gpu"'),
    ({"fp16": True}, "fp16: expected a mapping (a JSON object), got true"),
    ({"optimizer": {"params": {}}}, "optimizer.type: required key is missing"),
])
def test_wrong_types_name_key_value_and_expected_type(data, line):
  assert line in error_of(data)


@pytest.mark.parametrize("stage", [4, 7])
def test_stage_above_3_is_an_error(stage):
  assert (f"zero_optimization.stage: got {stage}: Maximum supported ZeRO stage is 3"
          in error_of({"zero_optimization": {"stage": stage}}))


@pytest.mark.parametrize("data, text", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "bf16: enabled together with fp16.enabled: bfloat16 and fp16 modes cannot be simultaneously"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}},
     "fp16.loss_scale_window: must be > 0 for dynamic loss scaling"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}},
     "fp16.min_loss_scale: must be > 0 for dynamic loss scaling"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
     "optimizer.params: 'max_grad_norm' is not supported as an optimizer parameter, please switch "
     "to using the deepspeed parameter 'gradient_clipping'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"ratio": 0.5}}},
     "Partial offloading only supported for ZeRO Stage 3."),
    ({"zero_optimization": {"stage": 3}, "gradient_allreduce_op": "sum"},
     'gradient_allreduce_op: "sum" is not supported with zero_optimization.stage 3'),
    ({"zero_optimization": {"allgather_bucket_size": 7}},
     "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2"),
    ({"communication_data_type": "fp8"},
     "Invalid communication_data_type. Supported data types: ['fp16', 'bf16', 'fp32']. Got: fp8"),
    ({"checkpoint": {"tag_validation": "sometimes"}},
     'checkpoint.tag_validation: expected Warn, Ignore or Fail (any case), got "sometimes"'),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: must be >= 1, got 0"),
])
def test_deepspeed_semantic_checks(data, text):
  assert text in error_of(data)


def test_semantic_checks_that_pass():
  assert Config.load({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}})
  config = Config.load({"communication_data_type": "BF16", "checkpoint": {"tag_validation": "fail"},
                        "zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.3}}})
  assert config.communication_data_type == "bf16" and config.checkpoint.tag_validation == "Fail"
  assert config.zero_optimization.offload_optimizer.ratio == 0.3


# --- files -------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path):
  assert error_of(tmp_path / "nope.json") == f"{tmp_path / 'nope.json'}: no such config file"


def test_malformed_json_gives_line_and_column(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n  }\n}\n')
  assert error_of(path).startswith(f"{path}: invalid JSON at line 4, column 3:")


def test_malformed_yaml_gives_line_and_column(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("zero_optimization:\n  stage: [2\n")
  assert error_of(path).startswith(f"{path}: invalid YAML at line 3, column 1:")


@pytest.mark.parametrize("name, text", [
    ("dup.json", '{"fp16": {"enabled": true, "enabled": false}, "steps_per_print": 1}'),
    ("dup.yaml", "fp16:\n  enabled: true\n  enabled: false\n"),
])
def test_duplicate_keys_are_an_error(tmp_path, name, text):
  (tmp_path / name).write_text(text)
  assert error_of(tmp_path / name) == (
      f"{tmp_path / name}: Duplicate keys in DeepSpeed config: ['enabled']")


@pytest.mark.parametrize("source, text", [
    (42, "expected a path to a .json/.yaml config file or a dict, got int"),
    ([1], "expected a path to a .json/.yaml config file or a dict, got list"),
])
def test_a_source_that_is_neither_path_nor_dict(source, text):
  assert error_of(source) == text


def test_top_level_must_be_a_mapping(tmp_path):
  (tmp_path / "list.json").write_text("[1, 2]")
  assert "the top level must be a mapping of keys to values, got list" in error_of(
      tmp_path / "list.json")


def test_yaml_equivalent_of_a_json_config_is_equal(tmp_path):
  json_path = DATA / HF_ZERO2
  yaml_path = tmp_path / "zero2.yaml"
  yaml_path.write_text("""\
fp16: {enabled: auto, loss_scale: 0, loss_scale_window: 1000, initial_scale_power: 16,
       hysteresis: 2, min_loss_scale: 1}
bf16:
  enabled: auto
optimizer:
  type: AdamW
  params: {lr: auto, betas: auto, eps: auto, weight_decay: auto}
scheduler:
  type: WarmupLR
  params: {warmup_min_lr: auto, warmup_max_lr: auto, warmup_num_steps: auto}
zero_optimization:
  stage: 2
  offload_optimizer: {device: cpu, pin_memory: true}
  allgather_partitions: true
  allgather_bucket_size: 2e8
  overlap_comm: true
  reduce_scatter: true
  reduce_bucket_size: 2e8
  contiguous_gradients: true
gradient_accumulation_steps: auto
gradient_clipping: auto
steps_per_print: 2000
train_batch_size: auto
train_micro_batch_size_per_gpu: auto
wall_clock_breakdown: false
""")
  from_yaml, from_json = Config.load(yaml_path), Config.load(json_path)
  assert from_yaml == from_json
  assert from_yaml.source == str(yaml_path) and from_json.source == str(json_path)
  assert from_yaml.zero_optimization.reduce_bucket_size == 200_000_000


# --- the batch triple --------------------------------------------------------------------------


def batch(dp: int, **given) -> tuple[int, int, int]:
  names = {"train": "train_batch_size", "micro": "train_micro_batch_size_per_gpu",
           "gas": "gradient_accumulation_steps"}
  config = Config.load({names[key]: value for key, value in given.items()}).resolve(
      dp_world_size=dp)
  return (config.train_batch_size, config.train_micro_batch_size_per_gpu,
          config.gradient_accumulation_steps)


# DeepSpeed's TestBatchConfig (world 2): all three given, then train + micro.
@pytest.mark.parametrize("train, micro, gas, ok", [
    (32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)])
def test_deepspeed_batch_config_cases(train, micro, gas, ok):
  if ok:
    assert batch(2, train=train, micro=micro, gas=gas) == (train, micro, gas)
    assert batch(2, train=train, micro=micro) == (train, micro, gas)
    assert batch(2, train=train, gas=gas) == (train, micro, gas)
    assert batch(2, micro=micro, gas=gas) == (train, micro, gas)
    return
  for given in (dict(train=train, micro=micro, gas=gas), dict(train=train, micro=micro)):
    with pytest.raises(ConfigError, match="invalid batch size"):
      batch(2, **given)


def test_batch_error_names_the_three_keys_and_the_dp_size():
  with pytest.raises(ConfigError) as info:
    batch(2, train=33, micro=17, gas=2)
  assert ("train_batch_size (33) != train_micro_batch_size_per_gpu (17) * "
          "gradient_accumulation_steps (2) * data-parallel size (2) = 68; fix:" in str(info.value))
  with pytest.raises(ConfigError) as info:
    batch(2, train=32, micro=18)
  # a derived count that cannot be whole says so, instead of showing it as 0
  assert ("train_batch_size 32 is not a multiple of train_micro_batch_size_per_gpu 18 * "
          "data-parallel size 2 = 36, so no whole gradient_accumulation_steps gives it; fix: a "
          "train_batch_size that is a multiple of 36 (e.g. 36)" in str(info.value))
  assert "(0, derived)" not in str(info.value)


@pytest.mark.parametrize("given, expected", [
    (dict(train=64, micro=4, gas=2), (64, 4, 2)),
    (dict(train=64, micro=4), (64, 4, 2)),
    (dict(train=64, gas=2), (64, 4, 2)),
    (dict(micro=4, gas=2), (64, 4, 2)),
    (dict(train=64), (64, 8, 1)),
    (dict(micro=4), (32, 4, 1)),
])
def test_batch_triple_derivation(given, expected):
  assert batch(8, **given) == expected


@pytest.mark.parametrize("given", [{}, dict(gas=2)])
def test_batch_needs_train_or_micro(given):
  with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu "
                     "needs to be provided"):
    batch(8, **given)


# --- resolving "auto" --------------------------------------------------------------------------

HF_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": "auto",
                          "stage3_max_live_parameters": "auto",
                          "offload_param": {"buffer_size": "auto"}},
}
ALL_VALUES = {"micro_batch_size": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
              "lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1,
              "warmup_num_steps": 7, "bf16": True}


def test_resolve_fills_every_auto_from_the_arguments():
  config = Config.load(HF_AUTO)
  resolved = config.resolve(dp_world_size=4, hidden_size=10, total_num_steps=50,
                            auto_values=ALL_VALUES)
  zero = resolved.zero_optimization
  assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
          resolved.gradient_accumulation_steps) == (24, 2, 3)
  assert resolved.gradient_clipping == 0.5 and resolved.precision == "bf16"
  assert resolved.fp16.enabled is False
  assert resolved.optimizer.params == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6,
                                       "weight_decay": 0.1}
  assert resolved.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                       "warmup_num_steps": 7, "total_num_steps": 50}
  assert (zero.reduce_bucket_size, zero.prefetch_bucket_size,
          zero.param_persistence_threshold) == (100, 90, 100)
  assert zero.gather_16bit_weights_on_model_save is False
  assert zero.offload_param.buffer_size == 10**8
  # stage3_max_live_parameters "auto" stays: jzero chooses the prefetch (jzero.planning.overlap)
  assert zero.max_live_parameters == "auto"
  assert json.dumps(resolved.to_dict()).count('"auto"') == 1
  assert config.train_batch_size == "auto" and config.optimizer.params["lr"] == "auto"
  assert resolved.resolve(dp_world_size=4) == resolved


def test_resolve_defaults_without_auto_values():
  """Every "auto" that falls back to a default says so, one warning each (a user without
  Hugging Face's Trainer, which fills them, should know)."""
  with pytest.warns(JZeroWarning) as record:
    resolved = Config.load(HF_AUTO).resolve(dp_world_size=1, hidden_size=4, total_num_steps=9,
                                            auto_values={"micro_batch_size": 8,
                                                         "warmup_num_steps": 1})
  fallback = "and auto_values has no"
  assert [str(w.message) for w in record] == [
      *[f"{p}.enabled is \"auto\" {fallback} '{p}': training without {p} (DeepSpeed's default "
        f"false); pass jzero.initialize(..., auto_values={{'{p}': True}}) to enable it"
        for p in ("fp16", "bf16")],
      f"gradient_clipping is \"auto\" {fallback} 'gradient_clipping': clipping at 1.0 "
      "(DeepSpeed's default)",
      'gradient_accumulation_steps is "auto" and neither auto_values nor train_batch_size / '
      "train_micro_batch_size_per_gpu fix it: using 1 (DeepSpeed's default)",
      *[f"zero_optimization.{key} is \"auto\": using DeepSpeed's default {value}"
        for key, value in [("stage3_gather_16bit_weights_on_model_save", "false"),
                           ("offload_param.buffer_size", "100000000")]],
      *[f"optimizer.params.{key} is \"auto\" {fallback} '{key}': using DeepSpeed's FusedAdam "
        f"default {value}"
        for key, value in [("lr", "0.001"), ("betas", "[0.9, 0.999]"), ("eps", "1e-08"),
                           ("weight_decay", "0.0")]],
      'scheduler.params.warmup_min_lr is "auto": using 0 (what Hugging Face fills)',
  ]
  assert resolved.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                       "weight_decay": 0.0}
  assert resolved.scheduler.params["warmup_max_lr"] == 1e-3
  assert (resolved.train_batch_size, resolved.gradient_accumulation_steps) == (8, 1)
  assert resolved.gradient_clipping == 1.0 and resolved.precision == "fp32"
  # stage 3's stage3_max_live_parameters "auto" is jzero's to choose (the prefetch), unsaid
  assert resolved.zero_optimization.max_live_parameters == "auto"


def test_auto_micro_batch_is_derived_when_the_others_fix_it():
  """48 samples, 3 accumulation steps, 8 devices: micro-batch "auto" is 2, with no warning; an
  "auto" accumulation count is derived the same way."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    resolved = Config.load({"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto",
                            "gradient_accumulation_steps": 3}).resolve(dp_world_size=8)
    assert resolved.train_micro_batch_size_per_gpu == 2
    resolved = Config.load({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2,
                            "gradient_accumulation_steps": "auto"}).resolve(dp_world_size=8)
    assert resolved.gradient_accumulation_steps == 3


def test_resolve_lists_every_missing_value():
  """Once each: a hidden-size key that cannot be filled is not also given DeepSpeed's default."""
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    with pytest.raises(ConfigError) as info:
      Config.load(HF_AUTO).resolve(dp_world_size=2)
  warned = "\n".join(str(w.message) for w in record)
  assert record and "bucket_size" not in warned and "persistence" not in warned, warned
  assert str(info.value).splitlines() == [
      'cannot resolve "auto":',
      '  train_micro_batch_size_per_gpu: is "auto" and train_batch_size does not fix it; pass '
      "jzero.initialize(..., auto_values={'micro_batch_size': N}) (CLI: --micro-batch N)",
      *[f'  zero_optimization.{key}: is "auto"; pass jzero.initialize(..., hidden_size=H) (read '
        "from the model's hidden_size, d_model, embed_dim or emb_dim when it or its config has "
        "one); jzero derives it from that like Hugging Face"
        for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                    "stage3_param_persistence_threshold")],
      "  scheduler.params.warmup_num_steps: is \"auto\"; pass jzero.initialize(..., "
      "auto_values={'warmup_num_steps': N}) (CLI: --warmup-steps N)",
      '  scheduler.params.total_num_steps: is "auto"; pass jzero.initialize(..., '
      "total_num_steps=N) (CLI: --steps N)",
  ]


def test_hidden_size_is_only_needed_for_stage3_keys_at_stage_3():
  resolved = Config.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
      "stage": 2, "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto"}}).resolve(dp_world_size=1)
  assert resolved.zero_optimization.prefetch_bucket_size == 50_000_000
  assert resolved.zero_optimization.param_persistence_threshold == 100_000


def test_config_without_batch_keys_takes_micro_from_auto_values():
  config = Config.load({"zero_optimization": {"stage": 3}})
  resolved = config.resolve(dp_world_size=8, auto_values={"micro_batch_size": 4})
  assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
          resolved.gradient_accumulation_steps) == (32, 4, 1)


def test_explicit_batch_values_are_not_overridden_by_auto_values():
  resolved = Config.load({"train_batch_size": 16}).resolve(
      dp_world_size=2, auto_values={"micro_batch_size": 4})
  assert (resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps) == (8, 1)


def test_resolve_keeps_source_and_rejects_bad_arguments():
  path = DATA / BATCH
  assert Config.load(path).resolve(dp_world_size=1).source == str(path)
  with pytest.raises(ConfigError, match=r"auto_values: unknown keys \['micro_batch'\]"):
    Config.load({}).resolve(dp_world_size=1, auto_values={"micro_batch": 4})
  with pytest.raises(ConfigError, match="dp_world_size must be a positive integer, got 0"):
    Config.load({}).resolve(dp_world_size=0)


def test_unfillable_optimizer_auto_is_an_error():
  with pytest.raises(ConfigError, match=r'optimizer.params.momentum: is "auto" but jzero only '
                     "fills lr, betas, eps and weight_decay"):
    Config.load({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {
        "momentum": "auto"}}}).resolve(dp_world_size=1)


def test_warmup_max_lr_without_optimizer_needs_lr():
  config = Config.load({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
      "warmup_max_lr": "auto"}}})
  with pytest.raises(ConfigError, match=r"warmup_max_lr: is \"auto\"; there is no optimizer block"):
    config.resolve(dp_world_size=1)
  resolved = config.resolve(dp_world_size=1, auto_values={"lr": 0.01})
  assert resolved.scheduler.params["warmup_max_lr"] == 0.01


def test_auto_fp16_resolves_from_auto_values():
  resolved = Config.load({"train_batch_size": 8, "fp16": {"enabled": "auto"}}).resolve(
      dp_world_size=1, auto_values={"fp16": True})
  assert resolved.precision == "fp16" and resolved.fp16.enabled is True


# --- check_supported ---------------------------------------------------------------------------


def test_check_supported_refuses_every_listed_setting_at_once():
  config = Config.load({
      "zero_optimization": {"stage": 3, "mics_shard_size": 8,
                            "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
                            "load_from_fp32_weights": False},
      "optimizer": {"type": "Lamb", "params": {}},
      "scheduler": {"type": "OneCycle", "params": {}},
      "checkpoint": {"load_universal": True},
      "data_types": {"param_dtype": "bf16"},
  })
  with pytest.raises(NotSupportedError) as info:
    config.check_supported()
  assert str(info.value).splitlines()[1:] == [
      "  not yet supported: zero_optimization.zeropp_loco_param={\"err_beta\": 0.8, "
      "\"reset_T\": 1024} (LoCo-ZeRO++'s error feedback for qgZ is not implemented yet; "
      "zero_quantized_gradients without it is)",
      "  not yet supported: zero_optimization.mics_shard_size=8 (MiCS is not implemented)",
      "  not yet supported: zero_optimization.load_from_fp32_weights=false (jzero always "
      "restores the fp32 master weights from the checkpoint)",
      "  not yet supported: optimizer.type=Lamb (jzero supports the optimizers Adam, AdamW, Lion "
      "and SGD)",
      "  not yet supported: scheduler.type=OneCycle (jzero supports the schedulers WarmupLR, "
      "WarmupDecayLR, WarmupCosineLR, LRRangeTest)",
      "  not yet supported: checkpoint.load_universal=true (DeepSpeed universal checkpoints "
      "cannot be read; jzero checkpoints reshard themselves)",
      "  not yet supported: data_types.param_dtype=bf16 (a separate parameter dtype is not "
      "implemented yet)",
  ]


def test_supported_optimizers_are_case_insensitive():
  for name in ("adam", "AdamW", "LION", "SGD"):
    Config.load({"optimizer": {"type": name}}).check_supported()


def test_no_effect_settings_warn_and_pass():
  config = Config.load({
      "zero_optimization": {"stage": 3, "contiguous_gradients": False, "sub_group_size": 1e12,
                            "stage3_max_reuse_distance": 1e6, "allgather_partitions": False},
      "prescale_gradients": True,
      "aio": {"queue_depth": 32},
      "optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
  })
  with pytest.warns(JZeroWarning) as record:
    config.check_supported()
  assert [str(w.message).split(" has no effect under XLA: ")[0] for w in record] == [
      "zero_optimization.contiguous_gradients=false",
      "zero_optimization.allgather_partitions=false",
      "zero_optimization.sub_group_size=1000000000000",
      "zero_optimization.stage3_max_reuse_distance=1000000",
      "prescale_gradients=true",
      "optimizer.params.torch_adam=true",
      'aio={"queue_depth": 32}',
  ]


def test_default_and_honoured_settings_are_silent():
  config = Config.load({
      "train_batch_size": 8, "gradient_clipping": 0.5, "steps_per_print": 10,
      "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
      "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}},
      "zero_optimization": {"stage": 3, "reduce_scatter": False, "reduce_bucket_size": 1e6,
                            "stage3_param_persistence_threshold": 0, "overlap_comm": False,
                            "offload_optimizer": {"device": "none"},
                            "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                            "sub_group_size": "auto", "stage3_max_live_parameters": 1e6,
                            "stage3_module_granularity_threshold": 1000,
                            "leaf_module": {"classes": ["Block"]}},
      "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp16",
      "checkpoint": {"use_node_local_storage": True},
  })
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    config.check_supported()


def test_support_table_keys_exist():
  off = {"enabled": False}
  config = Config.load({"optimizer": {"type": "Adam", "params": {"torch_adam": False}},
                        "scheduler": {"type": "WarmupLR"}, "activation_checkpointing": {},
                        "zero_optimization": {"offload_param": {}, "offload_optimizer": {}},
                        "tensor_parallel": {"autotp_size": 0}, "sequence_parallel_size": 1,
                        "compression_training": {"layer_reduction": off, **{
                            t: {"shared_parameters": off} for t in _TECHNIQUES}},
                        "sparse_attention": {}, **{key: off for key in (
                            "quantize_training", "data_efficiency", "progressive_layer_drop",
                            "curriculum_learning", "torch_autocast", "amp", "elasticity",
                            "expert_parallel")}})
  for rule in SUPPORT_TABLE:
    node = config
    for part in rule.key.split("."):
      node = node[part] if isinstance(node, dict) else getattr(node, part)
