"""Memory: the analytic estimator (paper tables, offload, persistence, activations, which stage),
the measured report of a live engine against it, and the ``jzero estimate`` command's function."""

import argparse

import jax
import numpy as np
import pytest

from jzero.analysis import estimate as estimator
from jzero.analysis import memory_report
from jzero.analysis.estimate import ParamShape, estimate
from jzero.analysis.tables import markdown_table
from jzero.cli import estimate as estimate_cli
from jzero.errors import ConfigError
from jzero.models import GPT, GPTConfig
from jzero.sharding.mesh import MeshSpec
from jzero.sharding.planner import Dtypes, Layout, make_plan
from jzero.modeling.model_adapter import as_model
from zero_testing import make_engine

GB = 1e9
SMALL = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)
TINY = GPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16)  # quick to compile


def _config(stage: int, bf16: bool = False) -> dict:
  config = {"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}}
  if bf16:
    config["bf16"] = {"enabled": True}
  return config


def _engine(cfg: GPTConfig, stage: int, bf16: bool = False):
  engine = make_engine(_config(stage, bf16), model=cfg)
  return engine, engine.init(jax.random.key(0))


# -- the paper's tables ----------------------------------------------------------------------------
@pytest.mark.parametrize("stage, total", [(0, 112), (1, 38.5), (2, 26.25), (3, 14)])
def test_7b_on_8_gpus_adam_mixed_precision(stage, total):
  est = estimate(7e9, stage, 8, param_bytes=2, optimizer_bytes=12)
  assert est.model_states == total * GB
  assert est.device_total == total * GB


@pytest.mark.parametrize("stage, devices, total",
                         [(0, 4, 2100), (1, 4, 1050), (2, 4, 787.5), (3, 4, 525), (3, 8, 262.5)])
def test_175b_adam_moments_only(stage, devices, total):
  est = estimate(175e9, stage, devices, param_bytes=2, optimizer_bytes=8)
  assert est.model_states == total * GB


def test_categories_follow_the_partitioning():
  d = {s: estimate(7e9, s, 8).bytes["device"] for s in range(4)}
  assert d[0] == {"params": 14 * GB, "grads": 14 * GB, "optimizer": 84 * GB}
  assert d[1] == {"params": 14 * GB, "grads": 14 * GB, "optimizer": 10.5 * GB}
  assert d[2] == {"params": 14 * GB, "grads": 1.75 * GB, "optimizer": 10.5 * GB}
  assert d[3] == {"params": 1.75 * GB, "grads": 1.75 * GB, "optimizer": 10.5 * GB}
  fp32 = estimate(1e9, 1, 4, param_bytes=4, optimizer_bytes=8)  # (p + g)Ψ + KΨ/N
  assert fp32.model_states == 8 * GB + 2 * GB
  nodes = estimate(1e9, 3, 4, 2, param_bytes=4, optimizer_bytes=8)  # N = 4 x 2
  assert nodes.devices == 8 and nodes.model_states == 16 * GB / 8


# -- offload ---------------------------------------------------------------------------------------
def test_optimizer_offload_moves_the_optimizer_state_and_the_update_places_the_gradients():
  """The tier's rule moves the optimizer state; where the gradients are is the update's
  (jzero/analysis/update_memory.py; tests/analysis/test_update_memory.py has every mode): the
  streamed update keeps the gradient partition on the device, the host Adam (device: cpu's
  default) sends it to the host."""
  zero2 = estimate(7e9, 2, 8, offload_optimizer="cpu", offload_update="stream")
  assert zero2.bytes["device"] == {"params": 14 * GB, "grads": 1.75 * GB, "optimizer": 0}
  assert zero2.bytes["host"] == {"params": 0, "grads": 0, "optimizer": 10.5 * GB}
  assert zero2.tier_total("host") == 10.5 * GB and zero2.host_per_node == 84 * GB
  assert zero2.tier_total("nvme") == 0
  zero1 = estimate(7e9, 1, 8, offload_optimizer="cpu", offload_update="stream")
  assert zero1.model_states == 28 * GB and zero1.tier_total("host") == 10.5 * GB
  # ZeRO-Offload's schedule: the gradients leave the device (DeepSpeed's 2Ψ there), the host holds
  # the arriving gradient partition and the new params beside the optimizer state
  adam = estimate(7e9, 2, 8, offload_optimizer="cpu")
  assert adam.bytes["device"] == {"params": 14 * GB, "grads": 0, "optimizer": 0}
  assert adam.bytes["host"] == {"params": 1.75 * GB, "grads": 1.75 * GB, "optimizer": 10.5 * GB}
  zero3 = estimate(7e9, 3, 8, offload_optimizer="nvme")  # the NVMe store's own update
  assert zero3.update == "store"
  assert zero3.bytes["device"] == {"params": 1.75 * GB, "grads": 1.75 * GB, "optimizer": 0}
  # one update group (sub_group_size 1e9 > the 875M partition) passes through host memory
  assert zero3.tier_total("host") == 10.5 * GB and zero3.tier_total("nvme") == 10.5 * GB


def test_param_offload_leaves_only_persistent_params_on_the_device():
  infinity = estimate(7e9, 3, 8, offload_optimizer="cpu", offload_param="nvme",
                      offload_update="cpu_adam")
  assert infinity.model_states == 0  # a count alone: no layer whose gradient is in flight
  # optimizer 10.5 + the gradient partition 1.75 (the new params go to the store)
  assert infinity.tier_total("host") == 12.25 * GB and infinity.tier_total("nvme") == 1.75 * GB
  leaves = [ParamShape((1000, 1000)), ParamShape((10,))]
  persistent = estimate(leaves, 3, 8, offload_optimizer="cpu", offload_param="cpu",
                        offload_update="stream")
  assert persistent.bytes["device"]["params"] == 2 * 10
  assert persistent.bytes["host"]["params"] == 2 * 1_000_000 / 8
  # ZeRO-3 params + optimizer on the host, 2 nodes x 8, ZeRO-Offload's schedule: 18Ψ/nodes per
  # node (params, the new params, the gradient, 12 of optimizer state), DeepSpeed's 18Ψ/nodes
  # before its buffer factor of 1.5
  assert estimate(7e9, 3, 8, 2, offload_optimizer="cpu", offload_param="cpu",
                  offload_update="cpu_adam").host_per_node == 18 * 7e9 / 2
  # named: beside params on NVMe, device: cpu alone streams (as the engine resolves it)
  assert infinity.name == "ZeRO-3 + optimizer->cpu (cpu_adam), params->nvme"
  assert persistent.name == "ZeRO-3 + optimizer->cpu (stream), params->cpu"


def test_params_on_nvme_keep_max_in_cpu_and_the_staging_buffers_on_the_host():
  """max_in_cpu elements of the partition stay in host memory, the rest on NVMe; the staging
  buffers (buffer_count x buffer_size) are host bytes on top. 7e9 over 8: 875M per device."""
  partition = 7e9 / 8
  for cache in (0, 1e8, 1e12):  # none, part, more than the partition
    est = estimate(7e9, 3, 8, offload_optimizer="cpu", offload_param="nvme",
                   param_buffer_elements=5e8, param_cache_elements=cache)
    cached = min(cache, partition)
    assert est.bytes["host"]["params"] == 2 * (cached + 5e8)
    assert est.bytes["nvme"]["params"] == 2 * (partition - cached)
  cpu = estimate(7e9, 3, 8, offload_param="cpu", param_buffer_elements=5e8,
                 param_cache_elements=1e8)  # the NVMe keys do not apply to host params
  assert cpu.bytes["host"]["params"] == 2 * partition


@pytest.mark.parametrize("stage, opt, param, message", [
    (0, "cpu", None, "stage 1, 2 or 3"), (2, None, "cpu", "needs ZeRO stage 3"),
    (2, None, "nvme", "needs ZeRO stage 3"), (3, "gpu", None, r"a tier's value \('cpu', 'nvme'\)")])
def test_offload_the_stage_does_not_have_is_refused(stage, opt, param, message):
  with pytest.raises(ConfigError, match=message):
    estimate(1e9, stage, 8, offload_optimizer=opt, offload_param=param)


# -- stage-3 persistence ---------------------------------------------------------------------------
def test_persistence_by_hand():
  leaves = [ParamShape((1000,)), ParamShape((4, 300), stacked=True), ParamShape((50_000,)),
            ParamShape(())]
  assert estimator.persistent_numel(leaves, 500) == 1200 + 1  # per layer 300 < 500; 0-d: unsplittable
  assert estimator.persistent_numel(leaves, 500, model_threshold=1000) == 1  # 1200 > the cap
  assert estimator.persistent_numel(leaves, 2000) == 1000 + 1200 + 1
  est = estimate(leaves, 3, 8, param_bytes=2, persistence_threshold=500)
  psi = 1000 + 1200 + 50_000 + 1
  assert est.num_params == psi and est.persistent_params == 1201
  assert est.bytes["device"]["params"] == 2 * (psi - 1201) / 8 + 2 * 1201
  assert est.bytes["device"]["grads"] == 2 * psi / 8  # persistent grads stay partitioned
  assert estimate(leaves, 2, 8, persistence_threshold=500).persistent_params == 0


@pytest.mark.parametrize("threshold, cap", [(5000, None), (20_000, 30_000), (0, None)])
def test_persistence_matches_the_plan(threshold, cap):
  adapter = as_model(lambda rngs: GPT(SMALL, rngs=rngs))
  abstract = adapter.abstract_params(None, None)
  plan = make_plan(abstract, Layout(stage=3, mesh=MeshSpec.default().build(),
                                     stacked=lambda p: p.startswith("blocks/"),
                                     persistence_threshold=threshold,
                                     model_persistence_threshold=cap), Dtypes("bfloat16"))
  in_plan = sum(l.numel for l in plan.leaf_list() if not l.param_partitioned)
  shapes = estimator.param_shapes(abstract, adapter.stacked_layers)
  assert [(s.shape, s.stacked) for s in shapes] == [(l.shape, l.stacked) for l in plan.leaf_list()]
  assert estimator.persistent_numel(shapes, threshold, cap) == in_plan
  assert estimator.persistent_numel(plan.leaf_list(), threshold, cap) == in_plan
  if threshold == 5000:
    assert 0 < in_plan < sum(l.numel for l in plan.leaf_list())
  if cap is None:  # the estimator's gathered layer is the plan's
    assert estimator.largest_gathered_numel(shapes, threshold) == plan.gathered_working_set()[0]


# -- activations -----------------------------------------------------------------------------------
def test_activation_formula():
  # s = 2048, b = 1, h = 4096, a = 32: s·b·h = 8,388,608; 34 + 5·32·2048/4096 = 114.
  assert estimator.activation_bytes(1, 2048, 4096, 1, 32) == 8_388_608 * 114
  assert estimator.activation_bytes(1, 2048, 4096, 1, 32, checkpointing=True) == 2 * 8_388_608
  assert estimator.activation_bytes(2, 2048, 4096, 3, 32, bytes_per_element=4) == (
      3 * 2 * 2 * 8_388_608 * 114)
  est = estimate(7e9, 3, 8, activations=1e9)
  assert est.device_total == 15 * GB and est.model_states == 14 * GB


# -- which stage? ----------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, name", [
    (200, "DDP (stage 0)"), (80, "ZeRO-1"), (40, "ZeRO-2"), (16, "ZeRO-3"),
    (12, "ZeRO-3 + optimizer->cpu")])
def test_recommend_smallest_stage_that_fits_with_headroom(budget, name):
  rec = estimator.recommend(7e9, budget * GB, 8)
  assert rec.choice.name == name
  assert str(rec).startswith(f"{name} fits")


def test_recommend_headroom_and_host_budget():
  assert estimator.recommend(7e9, 15 * GB, 8, headroom=0).choice.name == "ZeRO-3"  # 14 GB
  assert estimator.recommend(7e9, 15 * GB, 8).choice.name == "ZeRO-3 + optimizer->cpu"  # 13.5 usable
  # 10.8 GB usable: ZeRO-2 keeps its 14 GB of params; ZeRO-3 + optimizer->cpu needs 112 GB of
  # host per node with the host Adam (it holds the gradient and the new params there too) and
  # 84 GB with the streamed update (gradients on the device: 3.5 GB), the one that fits 90 GB
  # (100 less 10%); the optimizer on NVMe with the params on the host leaves (2 + 2)Ψ/N x 8 =
  # 28 GB there and the update group (12 B x 875M) x 8
  assert estimator.recommend(7e9, 12 * GB, 8, host_budget=125 * GB).choice.name == (
      "ZeRO-3 + optimizer->cpu")
  assert estimator.recommend(7e9, 12 * GB, 8, host_budget=100 * GB).choice.name == (
      "ZeRO-3 + optimizer->cpu (stream)")
  rec = estimator.recommend(7e9, 12 * GB, 8, host_budget=80 * GB)
  assert rec.choice is None


def test_recommend_when_nothing_fits():
  rec = estimator.recommend(7e9, 10 * GB, 8, host_budget=1)  # no host memory: no offload
  assert rec.choice is None and rec.devices_needed == 13  # 112 GB / 9 GB usable = 12.4
  assert "does not fit: needs 13 devices" in str(rec)
  rec = estimator.recommend(7e9, 10 * GB, 8, activations=9.5 * GB)
  assert rec.devices_needed is None and "at any device count" in str(rec)


# -- measured vs predicted -------------------------------------------------------------------------
@pytest.mark.parametrize("stage, bf16", [(1, False), (2, False), (3, False), (3, True)])
def test_measured_state_bytes_match_the_estimator(stage, bf16):
  engine, state = _engine(GPTConfig(), stage, bf16)
  assert engine.mesh.zero_size == 8
  # the module reads the plan, the state and the tiers' resources: no engine
  report = memory_report.memory_report(engine.plan, state, engine.resources,
                                       config=engine.config, tx=engine.tx)
  assert report.optimizer_bytes == (12 if bf16 else 8)
  assert report.estimate.num_params == 6_394_368
  if stage == 3:
    persistent = sum(l.numel for l in engine.plan.leaf_list() if not l.param_partitioned)
    assert report.estimate.persistent_params == persistent > 0
  assert report.ratio() == pytest.approx(1, abs=0.02)
  for name in memory_report.REPORT_CATEGORIES:
    if report.predicted[name]:
      assert report.ratio(name) == pytest.approx(1, abs=0.02), name
  assert set(report.measured["params"]) == {"device"}
  text = memory_report.format_memory_report(report)
  assert f"ZeRO-{stage}" in text and "measured/predicted" in text


def test_reports_show_themselves_in_a_notebook():
  """The estimator's table and the memory report render as HTML with the same cells as their text
  (html.escape'd), give plain records and plot with matplotlib (bars per category)."""
  import html
  import matplotlib
  matplotlib.use("Agg")
  table = estimator.EstimateTable(estimate(7e9, s, 8) for s in range(4))
  assert str(table) == estimator.format_estimates(table)
  page = table._repr_html_()
  for row in estimator.estimate_rows(table)[1]:
    assert all(f">{html.escape(cell)}<" in page for cell in row)
  records = table.to_records()
  assert [r["configuration"] for r in records] == ["DDP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
  assert [r["device_total"] for r in records] == [112 * GB, 38.5 * GB, 26.25 * GB, 14 * GB]
  ax = table.plot(budget=40 * GB)
  assert len(ax.patches) == 3 * 4  # params, grads, optimizer for each of the 4 stages
  assert max(p.get_y() + p.get_height() for p in ax.patches) == pytest.approx(112)

  engine, state = _engine(TINY, 3)
  report = engine.memory_report(state)
  title, header, rows, notes = memory_report.report_rows(report)
  page = report._repr_html_()
  assert html.escape(title) in page and all(f">{html.escape(c)}<" in page for c in header)
  assert str(report) == memory_report.format_memory_report(report)
  records = report.to_records()
  assert [r["category"] for r in records] == list(report.categories)
  assert sum(r["measured"] for r in records) == report.measured_bytes()
  assert len(report.plot().patches) == 2 * len(records)


def test_compiled_step_memory_analysis():
  engine, state = _engine(TINY, 2)
  batch = engine.shard_batch(
      {"tokens": np.zeros((engine.global_batch_size, TINY.seq_len + 1), np.int32)})
  report = engine.memory_report(state, batch)
  c = report.compiled
  assert min(c.argument, c.output, c.temp, c.alias) > 0 and c.generated_code >= 0
  assert c.peak == c.argument + c.output + c.temp - c.alias > 0
  assert c.argument >= report.measured_bytes() - report.measured_bytes("grads")  # state is an input
  assert "compiled step (XLA memory_analysis)" in memory_report.format_memory_report(report)


# -- `jzero estimate` ------------------------------------------------------------------------------
def _run(argv: str, capsys) -> str:
  parser = argparse.ArgumentParser()
  estimate_cli.add_estimate_arguments(parser)
  assert estimate_cli.run_estimate(parser.parse_args(argv.split())) == 0
  return capsys.readouterr().out


def test_cli_classic_tables(capsys):
  out = _run("--params 7e9 --devices 8", capsys)
  for number in ("112.00 GB", "38.50 GB", "26.25 GB", "14.00 GB"):
    assert number in out
  out = _run("--params 175B --devices 4 --optimizer-bytes 8", capsys)
  for number in ("2,100.00 GB", "1,050.00 GB", "787.50 GB", "525.00 GB"):
    assert number in out
  assert "262.50 GB" in _run("--params 175B --devices 8 --optimizer-bytes 8 --stage 3", capsys)


def test_cli_offload_budget_and_model(capsys):
  out = _run("--params 7B --offload-optimizer cpu --offload-update stream --budget 12GB", capsys)
  assert "ZeRO-2 + optimizer->cpu" in out and "10.50 GB" in out and "84.00 GB" in out
  assert "DDP (stage 0)" in out and "ZeRO-1 + optimizer->cpu" in out
  assert "which stage? ZeRO-3 + optimizer->cpu fits" in out  # the host Adam: the default
  out = _run("--model default --stage 3 --precision fp32 --micro-batch 4", capsys)
  assert "6,394,368 params" in out and "627,200 params replicated" in out
  assert "activations" in out and "K = 8 B/param" in out


def test_cli_zero3_with_both_offloads_counts_the_gathered_layer(capsys):
  """ZeRO-3 with params and optimizer offloaded keeps the gathered layer on the device (twice:
  the next one is prefetched): never a 0 B device total when the layer is known, and a note
  saying what is left out when it is not."""
  both = "--stage 3 --offload-optimizer cpu --offload-param nvme"
  out = _run(f"--params 7e9 {both} --hidden 4096", capsys)
  layer = 12 * 4096**2 + 13 * 4096
  assert f"largest layer ({layer:,} params)" in out
  row = next(line for line in out.splitlines() if line.startswith("ZeRO-3 + optimizer->cpu"))
  assert estimator.format_bytes(2 * 2 * layer) in row and " 0 B" not in row
  assert estimator.format_bytes(2 * 2 * 5 * 10**8) in _run(
      f"--params 7e9 {both} --largest-layer 5e8", capsys)
  assert "leaves out the gathered working set" in _run(f"--params 7e9 {both}", capsys)
  assert "largest layer (" in _run(f"--model default {both}", capsys)  # its layer scan's layer
  trillion = _run("--params 1e12 --devices 8 --nodes 2 --offload-optimizer cpu "
                  "--offload-update stream --offload-param nvme --hidden 25600 --stage 3", capsys)
  row = next(line for line in trillion.splitlines() if "params->nvme" in line)
  # per process: optimizer 12 x 1e12/16 + cache 2 x 1e9 + buffers 2 x 5e8 on the host (the
  # streamed update keeps the 125 GB gradient partition on the device)
  assert "753.00 GB" in row and "123.00 GB" in row and "31.46 GB" in row and "125.00 GB" in row


def test_cli_bad_flags(capsys):
  with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
    _run("--params 7e9 --stage 2 --offload-param cpu", capsys)
  with pytest.raises(ConfigError, match="--seq-len --hidden --layers --heads"):
    _run("--params 7e9 --micro-batch 1", capsys)
  with pytest.raises(SystemExit):
    _run("--params 7e9 --budget 16parsecs", capsys)
  assert estimate_cli.parse_bytes("80GiB") == 80 * 2**30 and estimate_cli.parse_bytes("16GB") == 16e9


def test_markdown_table_lines_as_the_benchmarks_write_them():
  """bench/plan_questions.py and plan_validation.py write their tables through one writer: a
  header, its rule, one line per row; a '|' inside a cell is escaped."""
  assert markdown_table(("candidate", "ms"), [("zero3|mb2", 12.5), (7, "-")]) == [
      "| candidate | ms |", "|---|---|", "| zero3\\|mb2 | 12.5 |", "| 7 | - |"]
