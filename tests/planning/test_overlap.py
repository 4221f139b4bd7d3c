"""ZeRO-3's overlap where memory is tight (jzero.comm.program, jzero.planning.overlap,
jzero.planning.loop_overlap, the loop counts of jzero.analysis.hlo).

The mechanism at a small scale: a 12.6M GPT (4 layers x 512) on 8 compile-only A100s whose memory
is cut to 85 MB, so that the step needs 80% of the card, as the 10B model does on 8 A100-40GB (the
full-size table is bench/aot_overlap.py's). Overlap figures are the compiler's deterministic
output for this jax; they are asserted as they come.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import pytest

from jzero.analysis.hlo import Collective, collectives
from jzero.analysis.hlo_module import parse_module, trip_count
from jzero.comm import program
from jzero.errors import JZeroWarning
from jzero.models import GPTConfig
from jzero.planning import aot, aot_report, loop_overlap, overlap
from jzero.sharding.mesh import MeshSpec
from zero_testing import needs_cuda_compiler

# A step as XLA's GPU compiler leaves it with gas 4: the collective pipeliner peeled the first
# micro-batch out of the accumulation loop (its layer loop runs at the top level, its gathers
# overlapped) and dropped the loop's trip count annotation; inside the loop, the layer loop's
# gather runs synchronously.
PEELED = """HloModule m, is_scheduled=true

%fused_add (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %sum = s32[] add(%p, %one)
}

%fused_compare (q: s32[]) -> pred[] {
  %q = s32[] parameter(0)
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%q, %three), direction=LT
}

%layer (lp: (s32[], f32[2])) -> (s32[], f32[2]) {
  %lp = (s32[], f32[2]) parameter(0)
  %lx = f32[2]{0} get-tuple-element(%lp), index=1
  %ag = (f32[2], f32[16]) all-gather-start(%lx), replica_groups={{0,1,2,3,4,5,6,7}}, \
dimensions={0}, backend_config={"is_sync":false}
  %f = f32[2]{0} fusion(%lx), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %agd = f32[16]{0} all-gather-done(%ag)
  ROOT %lt = (s32[], f32[2]) tuple(%lp, %f)
}

%layer_sync (sp: (s32[], f32[2])) -> (s32[], f32[2]) {
  %sp = (s32[], f32[2]) parameter(0)
  %sx = f32[2]{0} get-tuple-element(%sp), index=1
  %sag = (f32[2], f32[16]) all-gather-start(%sx), replica_groups={{0,1,2,3,4,5,6,7}}, \
dimensions={0}, backend_config={"is_sync":true}
  %sagd = f32[16]{0} all-gather-done(%sag)
  %sf = f32[2]{0} fusion(%sx), kind=kLoop, calls=%fused_add
  ROOT %st = (s32[], f32[2]) tuple(%sp, %sf)
}

%acc_cond (cp: (s32[], f32[2])) -> pred[] {
  %cp = (s32[], f32[2]) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  ROOT %c = pred[] fusion(%ci), kind=kLoop, calls=%fused_compare
}

%acc (ap: (s32[], f32[2])) -> (s32[], f32[2]) {
  %ap = (s32[], f32[2]) parameter(0)
  %ai = s32[] get-tuple-element(%ap), index=0
  %inner = (s32[], f32[2]) while(%ap), condition=%acc_cond, body=%layer_sync, \
backend_config={"known_trip_count":{"n":"40"}}
  %next = s32[] fusion(%ai), kind=kLoop, calls=%fused_add
  %ax = f32[2]{0} get-tuple-element(%inner), index=1
  ROOT %at = (s32[], f32[2]) tuple(%next, %ax)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[2]) tuple(%start, %x)
  %first = (s32[], f32[2]) while(%init), condition=%acc_cond, body=%layer, \
backend_config={"known_trip_count":{"n":"40"}}
  %loop = (s32[], f32[2]) while(%init), condition=%acc_cond, body=%acc, \
backend_config={"known_induction_variable":{"tuple_index":"0"}}
  ROOT %out = f32[2]{0} get-tuple-element(%loop), index=1
}
"""


def test_a_peeled_accumulation_loop_is_counted_and_told_apart():
  first, in_loop = sorted(collectives(PEELED), key=lambda c: c.count)
  # the unannotated loop runs 3 times (i = 0, 1, 2 < 3): its layer loop's gather 3 x 40 times
  assert (first.count, first.loops, first.overlapped) == (40, (("first", 40),), True)
  assert (in_loop.count, in_loop.loops, in_loop.is_async) == (120, (("loop", 3), ("inner", 40)),
                                                              False)
  assert _trips(PEELED) == 3
  assert _trips(PEELED.replace("direction=LT", "direction=LE")) == 4  # i <= 3
  assert _trips(PEELED.replace("%start = s32[] copy(%zero)", "%start = s32[] constant(2)")) == 1
  assert _trips(PEELED.replace('"known_induction_variable"', '"no_variable"')) is None
  assert loop_overlap.accumulation_loop([first, in_loop], gas=4) == "loop"
  assert loop_overlap.accumulation_loop([first, in_loop], gas=1) is None
  shares = loop_overlap.breakdown([first, in_loop], gas=4)
  assert [(s.where, s.kind, s.overlap) for s in shares] == [
      (loop_overlap.IN_LOOP, "all-gather", 0.0), (loop_overlap.OUTSIDE, "all-gather", 1.0)]
  assert shares[0].sync_bytes == shares[0].sent_bytes == 3 * shares[1].sent_bytes
  assert loop_overlap.place_overlap(shares, loop_overlap.IN_LOOP) == 0.0
  assert math.isnan(loop_overlap.place_overlap(shares[1:], loop_overlap.IN_LOOP))


def _trips(text: str) -> int | None:
  """trip_count of the while named "loop" in ``text``."""
  comps = parse_module(text).comps
  rest = next(rest for name, _, _, rest in comps["main"] if name == "loop")
  return trip_count(comps, "main", rest)


def test_the_slop_factor_gives_a_compile_the_limit_of_a_run():
  # a run: (pool - io) x 100%; without the device XLA reads (0.8 x card - io) x slop
  card, io = 42e9, 17e9
  slop = program.scheduler_slop_for(100, 0.95 * card, card, io)
  assert slop == math.floor(100 * (0.95 * card - io) / (0.8 * card - io)) == 137
  assert (0.8 * card - io) * slop / 100 <= 0.95 * card - io
  assert program.scheduler_slop_for(95, 0.5 * card, card, 40e9) == 95  # no base: left as is


def _report(prefetch: bool, peak: int, overlapped: bool) -> aot_report.AotReport:
  """A report of 8 GB gathered, all overlapped or none, at ``peak`` bytes of a 100-byte card."""
  gather = Collective("all-gather", "ag", 8_000_000_000, 8, (), 1, is_async=True,
                      overlapped_ops=int(overlapped))
  return aot_report.AotReport(
      gpu="A100", gpu_name="a100", devices=8, nodes=1, mesh="", stage=3, precision="bf16",
      model="", num_params=1, micro_batch=1, gradient_accumulation_steps=4,
      checkpoint_activations=True, state={}, estimate={}, argument=0, output=0, temp=peak,
      alias=0, device_memory=100, memory_fraction=0.95, trace_s=0, lower_s=0, compile_s=0,
      collectives=[gather], xla_options={}, prefetch=prefetch, largest_gathered=2 * 434_000_000)


@pytest.mark.parametrize("with_prefetch, without, chosen", [
    (_report(True, 96, True), _report(False, 94, True), "no prefetch"),  # only without fits
    (_report(True, 94, False), _report(False, 94, True), "no prefetch"),  # it overlaps more
    (_report(True, 94, True), None, None),  # fits and overlaps: one compile
    (_report(True, 94, False), _report(False, 94, False), "prefetch")])  # a tie keeps it
def test_auto_takes_the_step_that_fits_then_the_one_that_overlaps_more(with_prefetch, without,
                                                                       chosen):
  """stage3_max_live_parameters "auto": the step with the prefetch first, compiled without it
  too when that one does not fit or overlaps under 90%; the better is taken, said with the
  number that makes it."""
  compiled = []

  def compile_once(target, data):
    compiled.append(data["zero_optimization"]["stage3_max_live_parameters"])
    return with_prefetch if len(compiled) == 1 else without

  target = type("Target", (), {"say": staticmethod(lambda _: None)})()
  r = overlap.compile_resolved(compile_once, target, {"zero_optimization": {
      "stage": 3, "stage3_max_live_parameters": "auto"}})
  if chosen is None:
    assert compiled == ["auto"] and r.choices == () and r.prefetch
    return
  assert compiled == ["auto", 434_000_000]  # one layer's parameters: no prefetch
  assert r.choices[0].startswith(f'stage3_max_live_parameters "auto": {chosen} ')
  assert r.prefetch is (chosen == "prefetch")
  assert ("(set it to 434000000 for the same step)" in r.choices[0]) is (chosen == "no prefetch")


@needs_cuda_compiler
def test_compile_options_carry_the_pool_limit_and_the_prefetch_cap(monkeypatch):
  """overlap_comm: the scheduler's limit at the whole pool (unless XLA_FLAGS names it); stage 3's
  prefetch when stage3_max_live_parameters holds two layers ("auto": always), not otherwise; a
  layer larger than the cap is said."""

  from jzero.train.initialize import initialize
  from jzero.models import GPT, lm_loss

  small = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)
  mesh = MeshSpec.default().build(aot.gpu_devices("h100", 8))

  def plan(max_live, **zero):
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_max_live_parameters": max_live,
                                    "stage3_param_persistence_threshold": 0, **zero}}
    engine = initialize(model=lambda rngs: GPT(small, rngs=rngs), loss_fn=lm_loss, config=config,
                        mesh=mesh)
    return engine.make_plan()

  layer = plan("auto").gathered_working_set()[0]
  assert layer == 12 * 64 * 64 + 10 * 64  # qkv, out, MLP in and out; biases and LayerNorms
  for max_live, prefetch in (("auto", True), (2 * layer, True), (2 * layer - 1, False)):
    p = plan(max_live)
    options = program.compile_options(p)
    assert p.prefetch is prefetch, max_live
    assert options.get("xla_gpu_enable_pipelined_all_gather", False) is prefetch, max_live
    assert options[program.SLOP_OPTION] == program.SCHEDULER_POOL_PERCENT == 100
  with pytest.warns(JZeroWarning, match=f"one layer of the scanned stack holds {layer:,} param"):
    assert plan(layer - 1).prefetch is False
  assert program.SLOP_OPTION not in program.compile_options(plan("auto", overlap_comm=False))
  monkeypatch.setenv("XLA_FLAGS", f"--{program.SLOP_OPTION}=120")
  assert program.SLOP_OPTION not in program.compile_options(plan("auto"))


# -- the mechanism, compiled -----------------------------------------------------------------------
MODEL = GPTConfig(vocab_size=512, seq_len=64, d_model=512, n_layers=4, n_heads=4)
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
          "bf16": {"enabled": True}, "activation_checkpointing": {},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3}}
CARD = 85_000_000  # bytes: the step's peak is 80% of it, its resident state 27%


@pytest.fixture(scope="module")
def small_card(tmp_path_factory):
  text = aot.gpu_spec("a100-40gb").text
  path = tmp_path_factory.mktemp("spec") / "a100_85mb.txtpb"
  path.write_text(re.sub(r"device_memory_size:\s*\d+", f"device_memory_size: {CARD}", text))
  return str(path)


@needs_cuda_compiler
def test_in_loop_collectives_overlap_once_the_scheduler_has_the_pool(small_card):
  """Compiled with the limit XLA gives a part that is not present -- 95% of (80% of the card less
  the inputs and outputs), what jzero aot compiled before -- the gathers and reduce-scatters
  inside the accumulation loop run synchronously; with the limit a run with 95% of the card
  has, and jzero's slop factor (the whole pool), all of them overlap, and the peak fits."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    target, data = aot.prepare(CONFIG, small_card, 8, model=MODEL, memory_fraction=0.95)
    before = aot.compile_once(target, data, slop=program.XLA_DEFAULT_SLOP_PERCENT)
    now = overlap.compile_resolved(aot.compile_once, target, data)
  # XLA's limit from the slop factor jzero passed: a run's, (pool - io), to the factor's percent
  # step; jzero reads io from the lowered step's shapes, XLA from its buffers (kB apart)
  io = now.argument + now.output - now.alias
  assert now.xla_options[program.SLOP_OPTION] == 100  # what a run passes
  slop = now.scheduler_slop  # what the compile without the device got
  base = 0.8 * CARD - io
  assert 0.95 * CARD - io - base / 100 < base * slop / 100 <= 0.95 * CARD - io
  assert now.scheduler_limit == pytest.approx(0.95 * CARD - io, rel=1e-3)
  assert before.scheduler_limit == pytest.approx(0.95 * base, rel=1e-3)
  for r in (before, now):
    assert r.sent_bytes == pytest.approx(before.sent_bytes, rel=0.01)  # the same traffic
  shares = [loop_overlap.breakdown(r.collectives, 4) for r in (before, now)]
  in_loop = [loop_overlap.place_overlap(s, loop_overlap.IN_LOOP) for s in shares]
  assert round(in_loop[0], 3) == 0.676 and round(before.overlap_fraction, 3) == 0.733
  assert sum(s.sync_bytes for s in shares[0] if s.where == loop_overlap.IN_LOOP) > 0
  assert in_loop[1] == 1.0 and round(now.overlap_fraction, 3) == 0.976
  assert now.fits and now.peak <= 0.95 * CARD
  text = aot_report.format_report(now)
  assert "overlap by place and kind" in text and "in the accumulation loop" in text
  assert "latency-hiding scheduler planned within" in text


def test_plan_table_shows_the_overlap_inside_the_accumulation_loop():
  """jzero plan's overlap column: over the step, and inside the accumulation loop when the
  compiled step has one (the cached compile keeps it)."""
  from jzero.planning import compiled, plan_report

  def row(loop):
    c = compiled.Compiled(peak=1, flops=1, memory_bytes=1, intra_node_bytes=1,
                          inter_node_bytes=0, overlap=0.52, compile_s=1, loop_overlap=loop)
    return type("Row", (), {"compiled": c, "resources": type("R", (), {"overlap": 0.52})})()

  assert plan_report._overlap(row(0.028)) == "52% (loop 3%)"
  assert plan_report._overlap(row(None)) == "52%"


def test_advice_compiles_each_knob_and_says_what_it_gives_and_costs():
  """Under 90% overlapped (a stage-3 step with the scheduler on): the step again with the
  scheduler's limit lifted and without the prefetch, each with its overlap and peak."""
  low = dataclasses.replace(_report(True, 80, False), scheduler_limit=40,
                            xla_options={"xla_gpu_enable_latency_hiding_scheduler": True})
  asked = []

  def compile_once(target, data, slop=None):
    asked.append((slop, data["zero_optimization"].get("stage3_max_live_parameters")))
    return low if len(asked) == 1 else _report(slop is None, 90 if slop else 85, True)

  target = type("Target", (), {"say": staticmethod(lambda _: None)})()
  r = overlap.compile_resolved(compile_once, target, {"zero_optimization": {"stage": 3}},
                               advise=True)
  assert asked == [(None, None), (overlap.LIFTED_SLOP, None), (None, 434_000_000)]
  lifted, no_prefetch = r.advice
  assert "limit lifted" in lifted.knob and (lifted.overlap, lifted.peak, lifted.fits) == (
      1.0, 90, True)
  assert "no prefetch" in no_prefetch.knob and no_prefetch.peak == 85
  text = aot_report.format_overlap(r)
  assert "to raise the overlap, each knob compiled" in text and "90 B (+10 B)" in text


def test_jzero_plan_advises_a_chosen_config_under_90_percent(monkeypatch, capsys):
  """jzero plan: a chosen GPU config that overlaps under 90% has its step compiled with advice
  (jzero aot's), on its device twin, with the plan's memory fraction; one at 90% or more not."""
  from jzero.cli import plan as plan_cli

  calls = []
  advised = dataclasses.replace(_report(True, 80, True), advice=(aot_report.Advice(
      "a larger memory pool", "the limit binds", 1.0, 1.0, 90, True),))
  monkeypatch.setattr(aot, "compile_for", lambda *a, **k: calls.append((a, k)) or advised)
  hw = type("Hw", (), {"devices": 8, "nodes": 1,
                       "memory_fraction": type("C", (), {"value": 0.95})()})()

  def plan(overlap):
    chosen = type("Row", (), {"compiled": object(),
                              "resources": type("R", (), {"overlap": overlap})()})()
    return type("Plan", (), {"chosen": chosen, "target": "a100-40gb", "hardware": hw,
                             "job": type("J", (), {"model": "10b"})(),
                             "deepspeed_config": lambda self: {"zero_optimization": {
                                 "stage": 3, "offload_optimizer": {"device": "cpu"}}}})()

  plan_cli._advise(plan(0.95))
  assert calls == []
  plan_cli._advise(plan(0.27))
  (args, kwargs), = calls
  assert args == ({"zero_optimization": {"stage": 3}}, "a100-40gb", 8)  # the device twin
  assert kwargs["advise"] is True and kwargs["memory_fraction"] == 0.95
  out = capsys.readouterr().out
  assert "overlaps 27% of its collective bytes" in out and "a larger memory pool" in out


def test_advice_after_auto_reuses_the_step_auto_compiled():
  """"auto" compiled the step both ways; the advice lists the other way from that compile and
  compiles only the lifted limit."""
  with_prefetch = dataclasses.replace(_report(True, 96, False), xla_options={
      "xla_gpu_enable_latency_hiding_scheduler": True})
  without = dataclasses.replace(_report(False, 94, False), xla_options={
      "xla_gpu_enable_latency_hiding_scheduler": True})
  asked = []

  def compile_once(target, data, slop=None):
    asked.append(slop or data["zero_optimization"]["stage3_max_live_parameters"])
    return {1: with_prefetch, 2: without}.get(len(asked), _report(False, 99, True))

  target = type("Target", (), {"say": staticmethod(lambda _: None)})()
  r = overlap.compile_resolved(compile_once, target, {"zero_optimization": {
      "stage": 3, "stage3_max_live_parameters": "auto"}}, advise=True)
  assert asked == ["auto", 434_000_000, overlap.LIFTED_SLOP]
  assert r.prefetch is False and [a.peak for a in r.advice] == [99, 96]
  assert r.advice[1].knob.startswith("stage3_max_live_parameters: 868000000 (two layers)")
