"""`jzero aot`: the train step compiled for 8 compile-only H100s (XLA's GPU compiler, no GPU).

The compile tests need the CUDA compiler plugin (the gpu-aot extra, part of the test extra on
Linux) and skip without it; the error, spec and model-shape tests run everywhere. Every figure is
deterministic (bytes, counts, flags of the scheduled program); no wall time is asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jzero.planning import aot, aot_report
from jzero.analysis.hlo import collectives
from jzero.analysis.tables import format_count
from jzero.errors import ConfigError, JZeroError
from jzero.models import GPT, GPTConfig
from jzero.models.gpt import PRESETS
from zero_testing import needs_cuda_compiler

CONFIGS = Path(__file__).parents[2] / "configs"

BF16_ADAM = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
_REPORTS: dict[str, aot_report.AotReport] = {}


def _compile(name: str, **zero) -> aot_report.AotReport:
  """compile_for on 8 x H100, the default GPT, bf16 + AdamW; cached per variant."""
  if name not in _REPORTS:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      _REPORTS[name] = aot.compile_for(dict(BF16_ADAM, zero_optimization=zero), "h100", 8)
  return _REPORTS[name]


def _layer_gathers(report: aot_report.AotReport) -> list:
  """The all-gathers inside the layer scans (run more than once per step)."""
  return [c for c in report.collectives if c.kind == "all-gather" and c.count > 1]


@needs_cuda_compiler
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_default_model_compiles_for_8_h100_and_arguments_are_the_plans_state(stage):
  r = _compile(f"stage{stage}", stage=stage)
  assert (r.stage, r.devices, r.precision) == (stage, 8, "bf16")
  assert "H100" in r.gpu and r.device_memory > 80e9 and r.fits
  # XLA-GPU's argument bytes are the persistent state the plan lays out (+ batch, counters, rng)
  assert r.argument == pytest.approx(r.persistent_state, rel=0.02)
  # the plan's bytes by kind are ZeRO's, which the estimator predicts from the same leaves
  for kind in aot_report.STATE_KINDS:
    assert r.state[kind] == pytest.approx(r.estimate[kind], rel=1e-3), kind
  n_params = r.num_params  # bf16 params (stage 3: partitioned, small leaves kept whole)
  if stage < 3:
    assert r.state["params"] == 2 * n_params
  else:
    assert 2 * n_params / 8 < r.state["params"] < 2 * n_params / 2
  assert r.state["master"] == pytest.approx(4 * n_params / (8 if stage >= 1 else 1), rel=1e-3)
  kinds = {c.kind for c in r.collectives}
  assert ("reduce-scatter" in kinds) == (stage >= 1)
  assert r.temp > 0 and r.peak == r.argument + r.output + r.temp - r.alias
  # the arithmetic's peak of the whole step (jzero.analysis.step_memory) within 10% of XLA's
  assert r.step_estimate == pytest.approx(r.peak, rel=0.1), r.step_estimate / r.peak
  assert f"estimate / compiled {r.step_estimate / r.peak:.2f}" in aot_report.format_report(r)


@needs_cuda_compiler
def test_zeropp_step_calls_the_pallas_kernels():
  """qwZ + qgZ on 2 nodes x 4 H100s: the compiled step calls ZeRO++'s Pallas block kernels as
  Triton kernels (quantize before the int8 gather and the int4 all-to-alls, dequantize-sum after);
  plain ZeRO-3 of the same model calls none."""
  small = GPTConfig(d_model=128, n_layers=2, n_heads=4, seq_len=64)
  zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    zeropp = aot.compile_for(dict(BF16_ADAM, zero_optimization=zero), "h100", 8, nodes=2,
                             model=small)
    plain = aot.compile_for(dict(BF16_ADAM, zero_optimization={"stage": 3}), "h100", 8, nodes=2,
                            model=small)
  assert plain.pallas_kernels == 0
  assert zeropp.pallas_kernels >= 4  # at least quantize + dequantize for weights and gradients
  assert f"Pallas kernels (ZeRO++ block quantization, Triton): {zeropp.pallas_kernels} calls" in (
      aot_report.format_report(zeropp))
  assert aot.pallas_calls('%k = f32[8] custom-call(f32[8] %x), custom_call_target='
                          '"__gpu$xla.gpu.triton"\n%y = f32[8] add(%k, %k)') == 1


@needs_cuda_compiler
def test_overlap_comm_makes_zero3_layer_gathers_async_and_overlapped():
  on = _compile("stage3", stage=3)  # DeepSpeed's default: overlap_comm true in stage 3
  off = _compile("stage3-no-overlap", stage=3, overlap_comm=False)
  assert on.xla_options["xla_gpu_enable_pipelined_all_gather"] is True
  gathers_on, gathers_off = _layer_gathers(on), _layer_gathers(off)
  assert gathers_on and gathers_off
  assert all(c.is_async and c.overlapped and c.overlapped_ops > 0 for c in gathers_on)
  assert any(c.overlapped_matmuls > 0 for c in gathers_on)  # prefetch: the next layer's gather
  assert on.matmul_overlap_fraction > 0.5
  assert not any(c.is_async or c.overlapped for c in gathers_off)
  assert on.overlap_fraction > 0.9 and off.overlap_fraction == 0.0
  # the same bytes move either way: overlap changes when, not what
  gathered = lambda r: sum(c.step_bytes for c in r.collectives if c.kind == "all-gather")
  assert gathered(on) == pytest.approx(gathered(off), rel=0.01)


@needs_cuda_compiler
def test_smaller_buckets_give_more_smaller_combined_collectives():
  default = _compile("stage2", stage=2)
  # Stage 2 gathers the stacked layers' updated partitions one layer at a time inside a loop, so
  # the all-gathers XLA combines are the top level's few small leaves (160 KiB in all): the
  # all-gather bucket must be below that to cut them
  small = _compile("stage2-small-buckets", stage=2, reduce_bucket_size=100_000,
                   allgather_bucket_size=25_000)
  buckets = {"reduce-scatter": 100_000 * 2, "all-gather": 25_000 * 2}  # elements x bf16
  # XLA bounds a combined reduce-scatter's scattered result: the bucket over the ZeRO size
  assert small.xla_options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 200_000 // 8
  assert small.xla_options["xla_gpu_all_gather_combine_threshold_bytes"] == 50_000
  for kind, bucket in buckets.items():
    combined_default = [c for c in default.collectives if c.kind == kind and c.buffers > 1]
    assert max(c.full_bytes for c in combined_default) > bucket, kind  # the bucket has work
    ops_default = [c for c in default.collectives if c.kind == kind]
    ops_small = [c for c in small.collectives if c.kind == kind]
    assert len(ops_small) > len(ops_default), kind
    assert max(c.full_bytes for c in ops_small if c.buffers > 1) < max(
        c.full_bytes for c in combined_default), kind
    # a combined collective stays within the bucket; a single buffer larger than it goes alone
    assert all(c.full_bytes <= bucket for c in ops_small if c.buffers > 1), kind
    assert sum(c.buffers for c in ops_small) >= sum(c.buffers for c in ops_default)
    # the same gradient / parameter bytes, cut into more pieces
    total = lambda ops: sum(c.step_bytes for c in ops)
    assert total(ops_small) == pytest.approx(total(ops_default), rel=1e-6), kind


@needs_cuda_compiler
def test_cli_json(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, "-m", "jzero.cli", "aot", "--config", str(CONFIGS / "zero2.json"),
       "--gpu", "a100", "--devices", "8", "--precision", "bf16", "--layers", "2", "--d-model", "64",
       "--heads", "2", "--seq-len", "32", "--checkpoint-activations", "--json"],
      capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)  # stdout is JSON only; progress went to stderr
  assert "compiled in" in out.stderr
  assert report["gpu"] == "NVIDIA A100-SXM4-80GB" and report["stage"] == 2
  assert report["checkpoint_activations"] is True and report["precision"] == "bf16"
  assert report["argument"] == pytest.approx(report["persistent_state"], rel=0.02)
  assert report["fits"] is True and report["collectives"]
  fields = {"kind", "buffers", "is_async", "overlapped", "step_bytes"}
  assert fields <= set(report["collectives"][0])


@needs_cuda_compiler
def test_compile_for_works_in_a_fresh_interpreter_without_jax_platforms():
  """From Python, as documented: no ``JAX_PLATFORMS=cpu`` set by hand on a machine without a GPU;
  the host side still runs on the CPU afterwards."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = ("import jax\nfrom jzero.planning import aot\n"
          "from jzero.models import GPTConfig\n"
          "r = aot.compile_for('configs/zero1.json', 'h100', 8, precision='bf16', "
          "model=GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32))\n"
          "print(r.stage, r.fits, jax.devices()[0].platform)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=CONFIGS.parent, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-3:] == ["1", "True", "cpu"]


@needs_cuda_compiler
def test_report_table_names_every_part():
  report = _compile("stage3", stage=3)
  text = aot_report.format_report(report)
  for part in ("NVIDIA H100 80GB HBM3", "params", "master", "optimizer", "estimator",
               "XLA memory_analysis", "fits: yes", "all-gather", "reduce-scatter", "async",
               "overlapped with compute"):
    assert part in text, part
  # in a notebook: the same parts as HTML tables, and a plot of the state against the memory
  import html
  import matplotlib
  matplotlib.use("Agg")
  assert str(report) == text
  page = report._repr_html_()
  tables = [p for p in aot_report.report_parts(report) if not isinstance(p, str)]
  assert page.count("<table>") == len(tables) == 3  # state, collectives, overlap by place
  for _, header, rows in tables:
    assert all(f">{html.escape(cell)}<" in page for row in [header, *rows] for cell in row)
  ax = report.plot()
  assert len(ax.patches) == 2 * len(report.kinds) and len(ax.lines) == 2


class _Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up, self.down = nnx.Linear(64, 128, rngs=rngs), nnx.Linear(128, 64, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


@needs_cuda_compiler
def test_a_factory_model_is_labelled_by_its_class_and_a_readable_count():
  """A factory's model is named by the class it builds (it said 'function, 0.000B params')."""
  r = aot.compile_for(dict(BF16_ADAM, zero_optimization={"stage": 3}), "h100", 8,
                      model=lambda rngs: _Mlp(rngs), loss_fn=lambda m, b: jnp.mean(m(b["x"]) ** 2),
                      batch=lambda n: {"x": jax.ShapeDtypeStruct((n, 64), jnp.float32)})
  assert r.model == "_Mlp" and r.num_params == 64 * 128 + 128 + 128 * 64 + 64
  assert "_Mlp, 16.6K params" in aot_report.format_report(r)
  assert [format_count(n) for n in (950, 86_656, 6_390_000, 6.748e9, 999_999)] == [
      "950", "86.7K", "6.39M", "6.75B", "1M"]


# -- runs without the plugin -----------------------------------------------------------------------
def test_missing_plugin_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)  # import fails
  with pytest.raises(JZeroError, match=r"gpu-aot"):
    aot.gpu_devices("h100", 8)


@pytest.mark.parametrize("devices, nodes, flag", [(0, 1, "--devices 0"), (6, 4, "--nodes 4"),
                                                  (8, 0, "--nodes 0")])
def test_bad_device_counts_are_refused(devices, nodes, flag):
  with pytest.raises(ConfigError, match=flag):
    aot.gpu_devices("h100", devices, nodes)


def test_params_on_nvme_are_refused_with_the_reason(tmp_path):
  """The parameter NVMe tier's host callbacks lower only for a present backend: a clear error
  before anything is built (no store directory is created)."""
  config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
      "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
  with pytest.raises(ConfigError, match=r"offload_param\.device=nvme.*host callbacks.*"
                                        r"offload_param\.device: cpu"):
    aot.compile_for(config, "h100", 8, model="default")
  assert not any(tmp_path.iterdir())


def test_unknown_gpu_names_the_known_ones():
  with pytest.raises(ConfigError, match=r"--gpu.*'a100'.*'h100'.*'rtx3090'"):
    aot.gpu_spec("v100")


def test_gpu_specs_are_xla_target_configs_with_their_sources():
  for name, file in aot.GPU_SPECS.items():
    spec = aot.gpu_spec(name)
    text = (aot.SPEC_DIR / file).read_text()
    assert "Apache License" in text and spec.text == text
    assert spec.memory_bytes == int(text.split("device_memory_size:")[1].split()[0])
    # XLA's own files carry its copyright; the others say where each value comes from
    assert "The OpenXLA Authors" in text or ("Sources:" in text or "Read from a real" in text)
  assert aot.gpu_spec("a100").description == "NVIDIA A100-SXM4-80GB"
  assert aot.gpu_spec("a100-40gb").memory_bytes < aot.gpu_spec("a100").memory_bytes
  assert aot.gpu_spec("h200").memory_bytes == 150_109_880_320  # what XLA read on an H200
  assert {aot.gpu_spec(g).description for g in ("rtx3090", "rtx4090", "l4", "l40s", "a10g",
                                                "b200")} == {
      "NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 4090", "NVIDIA L4", "NVIDIA L40S",
      "NVIDIA A10G", "NVIDIA B200"}


@needs_cuda_compiler
def test_xla_builds_compile_only_devices_of_every_gpu_spec():
  for name in aot.GPU_SPECS:
    devices = aot.gpu_devices(name, 2)
    assert len(devices) == 2, name


def test_profile_reads_combined_async_collectives_and_their_overlap():
  hlo = """HloModule m, is_scheduled=true

ENTRY %main (p0: bf16[4,8], p1: bf16[2,8], x: f32[16,16]) -> f32[16,16] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[2,8]{1,0} parameter(1)
  %x = f32[16,16]{1,0} parameter(2)
  %ag = ((bf16[4,8], bf16[2,8]), (bf16[32,8], bf16[16,8])) all-gather-start(%p0, %p1), \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"is_sync":false}
  %f = f32[16,16]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %g = f32[16,16]{1,0} fusion(%f, %x), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %agd = (bf16[32,8]{1,0}, bf16[16,8]{1,0}) all-gather-done(%ag)
  %rs = (f32[16,16], f32[2,16]) reduce-scatter-start(%f), \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"is_sync":true}
  %rsd = f32[2,16]{1,0} reduce-scatter-done(%rs)
  ROOT %r = f32[2,16]{1,0} fusion(%rsd), kind=kLoop, calls=%fused.1
}
"""
  ag, rs = collectives(hlo)
  assert (ag.kind, ag.buffers, ag.full_bytes, ag.is_async) == ("all-gather", 2, 48 * 8 * 2, True)
  assert (ag.overlapped_ops, ag.overlapped_matmuls) == (2, 1)
  assert ag.overlapped
  assert (rs.kind, rs.buffers, rs.full_bytes, rs.is_async, rs.overlapped) == (
      "reduce-scatter", 1, 2 * 16 * 4 * 8, False, False)


# -- model shapes ----------------------------------------------------------------------------------
def test_presets_have_the_classic_sizes():
  for name, low, high in (("7b", 6.7e9, 6.8e9), ("1.3b", 1.3e9, 1.33e9)):
    cfg = PRESETS[name]
    module = nnx.eval_shape(lambda cfg=cfg: GPT(cfg, rngs=nnx.Rngs(0)))
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
    assert counted == cfg.num_params() and low < counted < high, name
  assert PRESETS["default"] == GPTConfig() and GPTConfig().num_params() == 6_394_368


def test_gated_untied_gpt_runs():
  cfg = GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layers=2, n_heads=2, mlp_dim=24,
                  gated_mlp=True, tie_embeddings=False)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  assert model.blocks.mlp_gate.kernel.shape == (2, 16, 24)
  assert model.head.kernel.shape == (16, 50)
  logits = model(jax.numpy.zeros((3, 8), jax.numpy.int32))
  assert logits.shape == (3, 8, 50) and bool(jax.numpy.isfinite(logits).all())
