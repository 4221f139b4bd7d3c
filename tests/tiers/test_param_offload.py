"""Parameter offload (jzero.tiers.host_params): stage-3 parameter partitions in host memory.

Exactness against stage 3 without offload (fp32, 20 steps, 8 simulated devices: losses and
parameters to 1e-6 relative), with parameter offload alone and with configs/ds_zero3_offload.json's
offload blocks (parameters and optimizer state); placement from the live arrays' memory kinds;
donation; the CUDA export's host memory kinds and per-layer transfers to the device inside the
layer scan; the memory report's host bytes; checkpoints across tiers; the settings refused.
The GPT is the tests' small shape (2 scanned layers, d_model 64) with a persistence threshold of
1,000 elements, so the matrices and embeddings are partitioned (and offloaded) while the biases
and norms persist on the device: both kinds of leaf are exercised.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import jzero
from jzero.errors import ConfigError, NotSupportedError
from jzero.sharding.plan import flatten_paths
from models_testing import LinenScanned, linen_engine
from zero_testing import SAME_MATH, SMALL, batches, ds_config, make_engine, max_relative_diff

N = 8
STEPS = 20
THRESHOLD = 1000
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ds_zero3_offload.json"
# configs/ds_zero3_offload.json's offload blocks: parameters and optimizer state to the cpu (for
# its AdamW, the host Adam: jzero.tiers.host_step).
DS_ZERO3_OFFLOAD = {k: v for k, v in json.loads(CONFIG.read_text())["zero_optimization"].items()
                    if k.startswith("offload_")}
VARIANTS = {
    "none": {},
    "param": {"offload_param": {"device": "cpu", "pin_memory": False}},
    "param+optimizer": DS_ZERO3_OFFLOAD,
    "param+streamed optimizer": {**DS_ZERO3_OFFLOAD,
                                 "offload_optimizer": {"device": "cpu", "update": "stream"}},
}


@functools.lru_cache(maxsize=None)
def _data():
  return tuple(batches(SMALL.seq_len, N, STEPS))


def _engine(variant: str):
  return make_engine(ds_config(
      3, stage3_param_persistence_threshold=THRESHOLD, **VARIANTS[variant]))


@functools.lru_cache(maxsize=None)
def _run(variant: str):
  """(engine, final state, final logical params, losses, every step donated its input)."""
  engine = _engine(variant)
  state = engine.init(jax.random.key(0))
  losses, donated = [], True
  for batch in _data():
    old = state
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
    donated &= all(x.is_deleted() for x in jax.tree.leaves(old))
  return (engine, state, jax.tree.map(np.asarray, engine.logical_params(state)),
          np.array(losses), donated)


def _host_paths(engine) -> set[str]:
  return {l.path for l in engine.plan.leaf_list() if l.param_tier == "host"}


@pytest.mark.parametrize("variant,kind", [("param", "unpinned_host"),
                                          ("param+optimizer", "pinned_host")])
def test_param_offload_equals_stage3_without_offload_and_lives_on_the_host(variant, kind):
  """20 steps: the same losses and parameters as stage 3 without offload (fp32, 1e-6); every
  partitioned param is a host array of the configured kind, every persistent one a device array,
  and every step donated the whole state (host buffers included)."""
  engine, state, params, losses, donated = _run(variant)
  _, _, ref_params, ref_losses, _ = _run("none")
  assert np.max(np.abs(losses - ref_losses) / ref_losses) <= SAME_MATH
  assert max_relative_diff(params, ref_params) <= SAME_MATH
  assert donated
  plan = engine.plan
  host = _host_paths(engine)
  assert host == {l.path for l in plan.leaf_list() if l.param_partitioned}
  assert {"blocks/mlp_in/kernel", "embed/embedding", "pos"} <= host  # scanned, unit, up front
  assert "blocks/mlp_in/bias" not in host  # persistent: stays on the device
  kinds = {path: x.sharding.memory_kind for path, x in flatten_paths(state.params).items()}
  assert {kinds[p] for p in host} == {kind}
  assert {kinds[p] for p in set(kinds) - host} == {"device"}
  if variant == "param+optimizer":  # the host Adam's, beside the params in host memory
    assert {l.state_tier for l in plan.leaf_list() if l.shard_dim is not None} == {"host_step"}


def test_what_the_offload_moves_is_logged_when_the_plan_is_built():
  """Threshold 1,000: the matrices and embeddings move, the biases and norms persist. Most of the
  model moves, so a log line says how much (as DeepSpeed's "Total persistent parameters"), not a
  warning."""
  lines = []
  handler = logging.Handler()
  handler.emit = lambda record: lines.append(record.getMessage())
  logger = logging.getLogger("jzero")
  logger.addHandler(handler)
  try:
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always", jzero.JZeroWarning)
      engine = _engine("param")  # initialize builds the plan (an NNX model needs no batch)
      engine.init(jax.random.key(0))
    assert not [w for w in record if "offload_param" in str(w.message)]
  finally:
    logger.removeHandler(handler)
  leaves = engine.plan.leaf_list()
  total = sum(l.numel for l in leaves)
  kept = [l for l in leaves if l.param_tier == "device"]
  moved = total - sum(l.numel for l in kept)
  said = [line for line in lines if line.startswith("offload_param")]
  assert said == [
      f"offload_param (device: cpu) moves {moved:,} of the model's {total:,} parameters "
      f"({moved / total:.0%}) to host memory; the other {total - moved:,} ({len(kept)} leaves) "
      f"stay on the device, persistent: leaves under stage3_param_persistence_threshold=1,000 "
      f"elements (per layer) are kept whole on every device, as in DeepSpeed."], lines
  assert kept and 2 * moved > total


def test_step_exported_for_cuda_keeps_params_on_the_host_and_fetches_one_layer_at_a_time():
  """The GPU path without a GPU: in the step's StableHLO for CUDA the host params (and the
  streamed update's moments) are pinned_host arguments and results, and inside the layer scan
  each layer's partition of a stacked host leaf is moved to the device (forward, and again in
  the rematerialised backward)."""
  from jax import export
  engine = _engine("param+streamed optimizer")
  state = engine.init(jax.random.key(0))
  batch = engine.shard_batch(_data()[0])
  text = export.export(engine.jitted_step(batch), platforms=("cuda",))(state, batch).mlir_module()
  main = next(line for line in text.splitlines() if "func.func public @main" in line)
  args, results = main.split("->", 1)
  plan = engine.plan
  expected = len(_host_paths(engine)) + 2 * sum(l.state_tier == "host" for l in plan.leaf_list())
  assert args.count('mhlo.memory_kind = "pinned_host"') == expected
  assert results.count('mhlo.memory_kind = "pinned_host"') == expected
  for leaf in plan.leaf_list():
    if leaf.param_tier != "host" or not leaf.stacked:
      continue
    layer = list(leaf.padded_shape[1:])
    layer[leaf.shard_dim] //= N
    pattern = (r'_xla_buffer_placement = "device"\}\} : \(tensor<'
               + "x".join(map(str, layer)) + r"xf32>\)")
    assert len(re.findall(pattern, text)) >= 2, leaf.path  # forward + backward re-fetch


def test_linen_scan_layers_fetch_each_layer_from_the_host():
  """The same per-layer transfer for a Linen model's jzero.linen_scan_layers (export only)."""
  from jax import export
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(N, 16, 12)).astype(np.float32),
           "y": rng.normal(size=(N, 16, 3)).astype(np.float32)}
  engine = linen_engine(LinenScanned(), ds_config(
      3, stage3_param_persistence_threshold=0, offload_param={"device": "cpu"}))
  state = engine.init(jax.random.key(0), batch)
  kinds = {p: x.sharding.memory_kind for p, x in flatten_paths(state.params).items()}
  assert kinds["blocks/Dense_0/kernel"] == "pinned_host"  # (3, 32, 128), stacked
  batch = engine.shard_batch(batch)
  text = export.export(engine.jitted_step(batch), platforms=("cuda",))(state, batch).mlir_module()
  # one layer's partition of blocks/Dense_0/kernel: (32, 128) split along its 32 rows
  assert len(re.findall(r'_xla_buffer_placement = "device"\}\} : \(tensor<4x128xf32>\)', text)) >= 2


def test_memory_report_counts_offloaded_params_as_host_bytes():
  """The report measures the partitioned params in unpinned_host and only the persistent ones on
  the device, each equal to the estimator's share (which names params->cpu)."""
  engine, state, *_ = _run("param")
  report = engine.memory_report(state)
  plan = engine.plan
  persistent = sum(l.numel for l in plan.leaf_list() if not l.param_partitioned)
  partitioned = sum(math.prod(l.padded_shape) for l in plan.leaf_list() if l.param_partitioned)
  assert report.measured["params"] == {"device": 4 * persistent,
                                       "unpinned_host": 4 * partitioned // N}
  assert report.estimate.name == "ZeRO-3 + params->cpu"
  assert report.estimate.bytes["host"]["params"] == pytest.approx(4 * partitioned / N, rel=1e-3)
  assert report.estimate.bytes["device"]["params"] == 4 * persistent
  assert report.ratio("params") == pytest.approx(1.0, abs=1e-3)


def test_checkpoints_restore_across_param_tiers_exactly(tmp_path):
  """Saved from the host tier, restored into a plan without offload and back, exactly; the
  restored host partitions are host arrays again and train on."""
  engine, state, params, *_ = _run("param+optimizer")
  engine.save_checkpoint(state, tmp_path / "offload")
  engine.wait_for_checkpoints()
  plain = _run("none")[0]
  restored = plain.load_checkpoint(tmp_path / "offload")
  assert max_relative_diff(jax.tree.map(np.asarray, plain.logical_params(restored)), params) == 0
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.params)} <= {None, "device"}
  plain.save_checkpoint(restored, tmp_path / "plain")
  plain.wait_for_checkpoints()
  back = _run("param")[0]
  again = back.load_checkpoint(tmp_path / "plain")
  assert max_relative_diff(jax.tree.map(np.asarray, back.logical_params(again)), params) == 0
  kinds = {p: x.sharding.memory_kind for p, x in flatten_paths(again.params).items()}
  assert {kinds[p] for p in _host_paths(back)} == {"unpinned_host"}
  # the host Adam's moments, read from its store (what the checkpoint saved)
  for a, b in zip(jax.tree.leaves(engine.full_state(state).opt_state),
                  jax.tree.leaves(again.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  again, metrics = back.train_step(again, back.shard_batch(_data()[0]))
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("zero,error,match", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, ConfigError,
     r"offload_param\.device=cpu needs ZeRO stage 3, got stage 2"),
    ({"stage": 1, "offload_param": {"device": "cpu"}}, ConfigError, "needs ZeRO stage 3"),
    ({"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "."}}, ConfigError,
     r"offload_param\.device=nvme needs ZeRO stage 3, got stage 2"),
    ({"stage": 3, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "."}}, NotSupportedError,
     "together with the NVMe tier"),
    ({"stage": 3, "offload_param": {"device": "cpu"}, "zero_hpz_partition_size": 2}, ConfigError,
     "hpZ keeps a device copy"),
])
def test_param_offload_settings_jzero_cannot_honour_are_refused(zero, error, match):
  config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}
  with pytest.raises(error, match=match):
    make_engine(config)


@pytest.mark.parametrize("key", ["buffer_count", "buffer_size", "max_in_cpu"])
def test_nvme_only_param_keys_warn_with_cpu_offload(key):
  config = ds_config(3, offload_param={"device": "cpu", key: 7})
  with pytest.warns(jzero.JZeroWarning, match=rf"offload_param\.{key}=7 has no effect"):
    make_engine(config)
