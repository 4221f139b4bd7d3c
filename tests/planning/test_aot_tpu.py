"""`jzero aot --tpu`: the train step compiled for compile-only TPU chips (libtpu, no TPU).

The compiles need libtpu (the tpu-aot extra, part of the test extra on Linux) and skip without it.
One small GPT (2 layers, d 256) keeps each compile at a few seconds; each variant is compiled
once per module. Every figure asserted is deterministic (bytes, counts, memory kinds of the
compiled program); no wall time is.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import pytest

from jzero.analysis.hlo import parameter_bytes
from jzero.errors import ConfigError, JZeroError
from jzero.models.gpt import preset
from jzero.planning import aot, aot_report, plan_for, tpu_specs
from jzero.config.blocks import STREAM
from jzero.runtime import quiet_start

needs_libtpu = pytest.mark.skipif(
    not quiet_start.tpu_compiler_installed(),
    reason="libtpu is not installed: pip install -e '.[tpu-aot]' (the tpu-aot extra) compiles "
           "for TPU slices without a TPU")

SMALL = dataclasses.replace(preset("default"), n_layers=2)
BF16_ADAM = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
_REPORTS: dict[str, aot_report.AotReport] = {}


def _compile(name: str, topology: str = "2x4", slices: int = 1, **zero) -> aot_report.AotReport:
  """compile_for on v5e chips, the small GPT, bf16 + AdamW; cached per variant."""
  if name not in _REPORTS:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      _REPORTS[name] = aot.compile_for(dict(BF16_ADAM, zero_optimization=zero), tpu="v5e",
                                       topology=topology, slices=slices, model=SMALL)
  return _REPORTS[name]


@needs_libtpu
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_compiles_for_v5e_2x4_with_the_plans_state_as_arguments(stage):
  r = _compile(f"stage{stage}", stage=stage)
  assert (r.platform, r.stage, r.devices, r.nodes) == ("tpu", stage, 8, 1)
  assert r.gpu == "TPU v5e" and r.device_memory == 16 * 10**9 and r.fits
  # the compiled step takes the plan's shards: XLA's argument bytes less the batch and what the
  # chip's tiles pad are the plan's params + master + optimizer, plus at most a few scalars the
  # plan does not count as model state (step and Adam counts, loss scale)
  assert r.tile_padding > 0 and r.host_argument == 0
  assert 0 <= r.state_arguments - r.persistent_state <= 64
  assert "ratio 1.0000" in aot_report.format_report(r)
  kinds = {c.kind for c in r.collectives}
  if stage == 0:
    assert kinds == {"all-reduce"}  # DDP: the gradients are all-reduced, nothing is gathered
  else:
    assert "all-gather" in kinds and ("reduce-scatter" in kinds or stage < 2)
  assert r.sent_bytes > 0 and "XLA TPU compile" in aot_report.format_report(r)


@needs_libtpu
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_compiles_for_v5e(stage):
  """Two micro-batches per step: the layer scan's reduce-scatters inside the micro-batch loop
  (libtpu's while-loop reduce-scatter motion failed a RET_CHECK on this loop until the step put
  a barrier on each micro-batch's gradients); the host Adam's sum in host memory inside that loop
  is refused on TPU, by name, before libtpu aborts the process compiling it."""
  config = dict(BF16_ADAM, gradient_accumulation_steps=2, zero_optimization={"stage": stage})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    r = aot.compile_for(config, tpu="v5e", topology="2x4", model=SMALL)
    assert r.fits and r.stage == stage
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "update": "cpu_adam"}
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 on TPU"):
      aot.compile_for(config, tpu="v5e", topology="2x4", model=SMALL)


@needs_libtpu
def test_stage3_shards_state_eightfold_and_overlaps_some_gathers():
  r0, r3 = _compile("stage0", stage=0), _compile("stage3", stage=3)
  assert r3.persistent_state < r0.persistent_state / 4
  asyncs = [c for c in r3.collectives if c.is_async]
  # XLA's TPU scheduler runs some of the layer gathers as start / done fusions with compute between
  assert asyncs and all(c.kind == "all-gather" for c in asyncs)
  assert 0 < r3.overlap_fraction < 1


@needs_libtpu
def test_optimizer_offload_compiles_with_host_memory_kinds():
  r = _compile("offload", stage=2,
               offload_optimizer={"device": "cpu", "pin_memory": True, "update": "stream"})
  # the fp32 master and Adam's moments are arguments in host memory (pinned_host), the bf16
  # params in HBM; together, less tiles and batch, the plan's bytes
  host = r.state["master"] + r.state["optimizer"]
  assert host * 0.98 < r.host_argument < host * 1.05
  assert 0 <= r.state_arguments - r.persistent_state <= 64
  assert r.argument < r.persistent_state - host * 0.9


@needs_libtpu
def test_a_tpu_plan_compiles_host_offload_as_it_is(tmp_path):
  """Compile-only TPU chips keep memory kinds, so `jzero plan` compiles an offload candidate's own
  config there (no device twin) and its device bytes are its compile's HBM peak, the host-Adam
  candidate's too."""
  plan = plan_for(SMALL, gpu=None, tpu="v5e", topology="2x4", stages=(2,), offload_tiers=("cpu",),
                  micro_batches=(2,), checkpointing=("none",), compile_top=10, cache_dir=tmp_path,
                  global_batch=16)
  rows = {(r.candidate.offload_optimizer, r.candidate.offload_update): r for r in plan.rows}
  plain, stream, adam = rows[None, None], rows["cpu", STREAM], rows["cpu", None]
  assert plan.search.compiled == 3  # three programs: no twin shared
  assert stream.device_from == "compiled" and stream.device_bytes == stream.compiled.peak
  # the streamed update brings a leaf's master and moments into HBM: more than without offload
  assert stream.compiled.peak > plain.compiled.peak
  assert abs(stream.estimate_ratio - 1) < 0.05
  # the host Adam's step compiles as it is (its gradient slots and handed gradients in host
  # memory); its compiled HBM peak is the row's. (Its peak is above the plain step's here: this
  # model's temporaries fit on the chip without offload, where a transfer to host memory stages
  # its buffers in HBM; at a size whose activations live in HBM it is below -- docs/planning.md,
  # bench/tpu_offload_memory.py.)
  assert adam.device_from == "compiled" and adam.device_bytes == adam.compiled.peak


@needs_libtpu
def test_zeropp_step_compiles_for_two_v5e_slices_hpz_within_a_slice():
  r = _compile("zeropp", topology="2x2", slices=2, stage=3, zero_quantized_weights=True,
               zero_quantized_gradients=True, zero_hpz_partition_size=4)
  assert (r.devices, r.nodes) == (8, 2) and r.mesh.startswith("node=2 x local=4")
  assert 0 <= r.state_arguments - r.persistent_state <= 64 and r.state["secondary"] > 0
  payloads = {p for c in r.collectives for p in c.payload}
  assert {"u8", "f32"} <= payloads  # quantized blocks (as bytes) and their scales are moved
  # qgZ's two hops, int4 blocks (as bytes): all-to-all within a slice (ICI) and across the
  # slices, where XLA lowers the crossing to the megascale runtime's DCN transfers
  assert any(c.kind == "all-to-all" and c.axes == ("local",) and "u8" in c.payload
             for c in r.collectives)
  dcn = [c for c in r.collectives if c.kind.startswith("dcn ")]
  assert any(c.kind == "dcn all-to-all" and "u8" in c.payload for c in dcn)
  assert {c.axes for c in dcn} == {("node",)} and all(c.is_async for c in dcn)
  assert any(c.kind == "dcn all-gather" and "s8" in c.payload for c in dcn)  # qwZ's int8
  # the block kernels run as Pallas' Mosaic kernels (tpu_custom_call): quantize before the int8
  # gather and the int4 hops, requantize-sum between the hops, dequantize(-sum) after them; the
  # plain stage-3 step calls none
  assert r.pallas_kernels >= 4 and _compile("stage3", stage=3).pallas_kernels == 0
  assert f"Pallas kernels (ZeRO++ block quantization, Mosaic): {r.pallas_kernels} calls" in (
      aot_report.format_report(r))


def test_bad_tpu_targets_are_refused_before_any_compile():
  with pytest.raises(ConfigError, match="unknown TPU 'v9'"):
    aot.prepare(BF16_ADAM, tpu="v9", topology="2x4")
  with pytest.raises(ConfigError, match=r"--topology '2x4' for v5p.*3 positive sizes"):
    aot.prepare(BF16_ADAM, tpu="v5p", topology="2x4")
  with pytest.raises(ConfigError, match="give --tpu too"):
    aot.prepare(BF16_ADAM, topology="2x4")
  assert {s.name for s in tpu_specs.TPU_SPECS.values()} == {"v4", "v5e", "v5p", "v6e"}


def test_a_missing_compiler_names_the_extra_that_installs_it(monkeypatch):
  """Without libtpu (or the CUDA plugin) a compile for the topology is refused with the extra to
  install, before any device work."""
  monkeypatch.setattr(quiet_start, "tpu_compiler_installed", lambda: False)
  with pytest.raises(JZeroError, match=r"TPU topology needs libtpu.*Install the tpu-aot extra: "
                     r"pip install -e \"\.\[tpu-aot\]\""):
    tpu_specs.tpu_devices("v5e", "2x4")
  monkeypatch.setattr(quiet_start, "hidden", lambda: ())
  monkeypatch.setattr(quiet_start, "cuda_plugin_installed", lambda: False)
  with pytest.raises(JZeroError, match=r"GPU topology needs the CUDA compiler plugin.*Install the "
                     r"gpu-aot extra: pip install -e \"\.\[gpu-aot\]\""):
    aot.gpu_devices("h100", 8)


def test_parameter_bytes_pads_to_the_first_tile():
  hlo = ("ENTRY %main (a: f32[8,32], b: s32[]) -> f32[8,32] {\n"
         "  %a = f32[8,32]{1,0:T(8,128)} parameter(0)\n"
         "  %b = s32[]{:T(128)} parameter(1)\n"
         "  ROOT %c = f32[8,32]{1,0:T(8,128)} copy(%a)\n}\n")
  assert parameter_bytes(hlo) == (8 * 32 * 4 + 4, 8 * 128 * 4 + 128 * 4)


@needs_libtpu
def test_libtpu_stays_quiet_where_no_tpu_is_present():
  """jzero keeps libtpu unloaded until a TPU compile asks for it, then loads it with the
  compile-only host's variables: no start-up noise on stderr either way."""
  code = ("import jzero, jax\n"
          "from jzero.runtime import quiet_start\n"
          "print(jax.devices()[0].platform, quiet_start.hidden())\n"
          "from jzero.planning.tpu_specs import tpu_devices\n"
          "print(len(tpu_devices('v6e', '4x4')), quiet_start.hidden())\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={k: v for k, v in __import__("os").environ.items()
                             if k != "JAX_PLATFORMS" and not k.startswith("TPU_")})
  assert done.returncode == 0, done.stderr
  before, after = done.stdout.split("\n")[:2]
  assert before.startswith("cpu ('libtpu'") and after.startswith("16 ") and "libtpu" not in after
  assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr


def test_tpu_hardware_takes_the_datasheet_figures_and_refuses_unpublished_dcn():
  from jzero.planning.cost import tpu_hardware  # noqa: PLC0415

  hw = tpu_hardware("v5p", "2x2x2")
  assert (hw.devices, hw.nodes) == (8, 1) and hw.usable_device_memory == 95e9
  assert hw.peak_flops.value == 459e12 and hw.intra_node_bandwidth.value == 300e9
  two = tpu_hardware("v5e", "2x2", 2)
  assert (two.devices_per_node, two.nodes) == (4, 2)
  assert two.inter_node_bandwidth.value == 200e9 / 64  # 2 x 100 Gb/s NICs for 8 chips
  with pytest.raises(ConfigError, match="no DCN bandwidth for v5p"):
    tpu_hardware("v5p", "2x2x2", 2)


def test_a_tpu_loop_without_an_induction_annotation_is_counted_from_its_condition():
  """XLA's TPU compiler names no known_induction_variable on a while: the trip count is read
  from the element its condition compares (the layer scan's gathers run once per layer)."""
  from jzero.analysis.hlo import collectives  # noqa: PLC0415

  hlo = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %g = f32[8] all-gather(%x), replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%next, %g)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %limit = s32[] constant(6)
  %q = (s32[], f32[8]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %limit), direction=LT
}

ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
  %a = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %a)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
}
"""
  (gather,) = collectives(hlo)
  assert gather.count == 6


@needs_libtpu
def test_jzero_aot_tpu_on_the_command_line(tmp_path):
  """`jzero aot --tpu v6e --topology 2x4 --json`: the report as JSON on stdout, progress on
  stderr, libtpu's start-up silent."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415

  config = tmp_path / "zero1.json"
  config.write_text(json.dumps(dict(BF16_ADAM, zero_optimization={"stage": 1})))
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  done = subprocess.run([sys.executable, "-m", "jzero.cli", "aot", "--config", str(config),
                         "--tpu", "v6e", "--topology", "2x4", "--layers", "2", "--json"],
                        capture_output=True, text=True, timeout=300, env=env)
  assert done.returncode == 0, done.stderr
  report = json.loads(done.stdout)
  assert (report["platform"], report["gpu"], report["devices"]) == ("tpu", "TPU v6e", 8)
  assert report["device_memory"] == 32 * 10**9 and report["fits"] and report["stage"] == 1
  assert "XLA TPU compile" in done.stderr and "libtpu" not in done.stderr
