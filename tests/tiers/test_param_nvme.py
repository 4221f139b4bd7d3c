"""Parameters on the NVMe tier (jzero.tiers.nvme_params): stage-3 partitions read layer by layer from the
store inside the step.

Exactness against stage 3 without offload (8 simulated devices, 20 steps: losses and parameters to
SAME_MATH) with the params alone on NVMe (every read from the disk: max_in_cpu 0, with gradient
accumulation 2), with the issue's ZeRO-Infinity blocks (optimizer on cpu, max_in_cpu large: every
read from the host cache; fp32 and bf16: the master and optimizer state in host memory, a copy of
each param in the store) and all on NVMe in bf16; 0 device bytes of the params between steps; the
reader's counters (disk reads, prefetch hits, cache hits) and its host bytes against the configured
bound; checkpoints from the NVMe tier into no offload and back; the settings checked before any
device work; two processes over gloo (every partition read by the process that holds its
devices) against one process without offload. The small GPT (2 scanned layers) with a persistence
threshold of 1,000 elements: matrices and embeddings go to NVMe, biases and norms persist on the
device. A process killed during
a step with params on NVMe is tests/tiers/test_nvme.py's kill test (its second process).
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import jzero
from jzero.errors import ConfigError
from jzero.models import lm_loss
from jzero.tiers import nvme_params
from zero_testing import (SAME_MATH, SMALL, batches, ds_config, gpt_factory, make_engine,
                          max_relative_diff)

N = 8
STEPS = 20
THRESHOLD = 1000


def _zero(variant: str, path) -> dict:
  """The zero_optimization blocks of a variant; ``path``: the NVMe directory."""
  params = {"device": "nvme", "nvme_path": str(path), "buffer_count": 2, "buffer_size": 10**6}
  return {
      "none": {},
      # every read from the disk, through the staging buffers
      "param": {"offload_param": {**params, "max_in_cpu": 0}},
      # the ZeRO-Infinity blocks: params on NVMe behind a host cache, optimizer on cpu
      "infinity": {"offload_param": {**params, "pin_memory": True, "max_in_cpu": 10**9},
                   "offload_optimizer": {"device": "cpu", "pin_memory": True}},
      "all-nvme": {"offload_param": {**params, "max_in_cpu": 0},
                   "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}},
  }[variant]


@functools.lru_cache(maxsize=None)
def _data(gas: int = 1):
  return tuple(batches(SMALL.seq_len, gas * N, STEPS))


def _engine(variant: str, path=None, precision: str = "fp32", gas: int = 1):
  return make_engine(ds_config(
      3, gas=gas, precision=precision, stage3_param_persistence_threshold=THRESHOLD,
      **_zero(variant, path)))


def _train(engine, steps: int = STEPS):
  state = engine.init(jax.random.key(0))
  losses = []
  for batch in _data(engine.gas)[:steps]:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, jax.tree.map(np.asarray, engine.logical_params(state)), np.array(losses)


@functools.lru_cache(maxsize=None)
def _baseline(precision: str = "fp32", gas: int = 1):
  _, params, losses = _train(_engine("none", precision=precision, gas=gas))
  return params, losses


@pytest.mark.parametrize("variant,precision,gas", [("param", "fp32", 2), ("infinity", "fp32", 1),
                                                   ("infinity", "bf16", 1), ("all-nvme", "bf16", 1)])
def test_params_on_nvme_equal_stage3_without_offload(variant, precision, gas, tmp_path):
  """20 steps: the losses and parameters of stage 3 without offload; the state holds 0 bytes of
  every NVMe-tier param (the persistent ones stay on the device); the reader served every layer
  from where the settings say."""
  engine = _engine(variant, tmp_path, precision, gas)
  state, params, losses = _train(engine)
  ref_params, ref_losses = _baseline(precision, gas)
  assert np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)) <= SAME_MATH
  assert max_relative_diff(params, ref_params) <= SAME_MATH
  plan = engine.plan
  on_nvme = [l for l in plan.leaf_list() if l.param_tier == "nvme"]
  # with the optimizer on cpu the master and state of those params live in host memory, and the
  # store holds a copy of each param; else the store holds all three
  state_tier = "host" if variant == "infinity" else "nvme"
  assert on_nvme and all(l.state_tier == state_tier for l in on_nvme)
  assert {l.path for l in on_nvme} == {l.path for l in plan.leaf_list() if l.param_partitioned}
  stored = dict(zip([l.path for l in plan.leaf_list()], jax.tree.leaves(state.params)))
  for l in on_nvme:  # 0 device bytes between steps: a placeholder, or fp32's master on the host
    x = stored[l.path]
    assert x.nbytes == 0 or (state_tier == "host" and precision == "fp32"
                             and x.sharding.memory_kind == "pinned_host"), l.path
  if state_tier == "host":
    masters = state.master if precision != "fp32" else state.params
    for l, x in zip(plan.leaf_list(), jax.tree.leaves(masters)):
      if l in on_nvme:
        assert x.nbytes > 0 and x.sharding.memory_kind == "pinned_host", l.path
  assert all(stored[l.path].nbytes > 0 for l in plan.leaf_list() if l.param_tier == "device")
  report = engine.memory_report(state)  # measured (live arrays, store files, cache) vs predicted
  assert abs(report.ratio("params") - 1) < 1e-3, report.measured["params"]
  reader = engine.nvme_store.reader
  stacked = [l for l in on_nvme if l.stacked]
  # per step and device: each stacked leaf's layers in forward and again in backward, per
  # micro-batch, and each other leaf once per micro-batch's forward and backward at most
  per_step = gas * (4 * SMALL.n_layers * len(stacked) + 2 * (len(on_nvme) - len(stacked)))
  served = reader.disk_reads + reader.prefetch_hits + reader.cache_hits
  assert stacked and 0 < served <= STEPS * N * per_step
  if variant == "infinity":  # everything fits max_in_cpu: no read reached the disk
    assert reader.cached == {l.path for l in on_nvme}
    assert reader.disk_reads == reader.prefetch_hits == 0
    held = sum(l.numel for l in on_nvme)  # padded to the devices: at most one row more per leaf
    assert held * 4 <= reader.cache_bytes() <= (held + N * len(on_nvme)) * 4
    assert reader.cache_bytes() <= nvme_params.host_bytes_bound(engine.nvme_store.settings, N)
  else:  # nothing cached: the disk, the next layer prefetched during the current one
    assert reader.cache_hits == 0 and reader.cache_bytes() == 0
    assert reader.disk_reads > 0 and reader.prefetch_hits > 0


@pytest.mark.parametrize("variant,precision", [("param", "fp32"), ("infinity", "bf16")])
def test_checkpoints_move_between_the_nvme_tier_and_no_offload(variant, precision, tmp_path):
  """A checkpoint saved with the params on NVMe (their state in the store, or on the host with a
  copy of each param in the store) restores into stage 3 without offload with the same params,
  and back into the NVMe tier, where training goes on exactly as without offload."""
  (tmp_path / "nvme_a").mkdir()
  (tmp_path / "nvme_b").mkdir()
  nvme = _engine(variant, tmp_path / "nvme_a", precision)
  state, params, _ = _train(nvme, steps=3)
  nvme.save_checkpoint(state, tmp_path / "ckpt", tag="t3")
  nvme.wait_for_checkpoints()
  plain = _engine("none", precision=precision)
  restored = plain.load_checkpoint(tmp_path / "ckpt", tag="t3")
  assert max_relative_diff(jax.tree.map(np.asarray, plain.logical_params(restored)), params) == 0
  back = _engine(variant, tmp_path / "nvme_b", precision)
  again = back.load_checkpoint(tmp_path / "ckpt", tag="t3")
  assert all(x.nbytes == 0 for l, x in zip(back.plan.leaf_list(), jax.tree.leaves(again.params))
             if l.param_tier == "nvme")  # placeholders: the params are in the store
  batch = _data()[3]
  restored, m_plain = plain.train_step(restored, plain.shard_batch(batch))
  again, m_back = back.train_step(again, back.shard_batch(batch))
  assert abs(float(m_back["loss"]) - float(m_plain["loss"])) <= SAME_MATH * abs(float(m_plain["loss"]))
  assert max_relative_diff(jax.tree.map(np.asarray, back.logical_params(again)),
                           jax.tree.map(np.asarray, plain.logical_params(restored))) <= SAME_MATH


def test_delayed_update_with_params_on_nvme_equals_it_without(tmp_path):
  """The delayed parameter update (optimizer on cpu, streamed: what device: cpu runs beside
  params on NVMe) with the params on NVMe: the store's copies are written from the delayed
  masters, and 6 steps give the losses and parameters of the same delayed update with the params
  on the device."""
  def run(**offload_param):
    engine = make_engine(ds_config(
        3, stage3_param_persistence_threshold=THRESHOLD,
        offload_optimizer={"device": "cpu", "update": "stream", "delayed_update": True},
        **offload_param))
    return _train(engine, steps=6)
  _, params, losses = run(offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
  _, ref_params, ref_losses = run()
  assert np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)) <= SAME_MATH
  assert max_relative_diff(params, ref_params) <= SAME_MATH


def test_param_nvme_settings_are_checked_before_any_device_work(tmp_path):
  config = lambda **block: ds_config(3, stage3_param_persistence_threshold=THRESHOLD,
                                     offload_param={"device": "nvme", **block})
  with pytest.raises(ConfigError, match=r"offload_param\.device=nvme needs "
                                        r"zero_optimization\.offload_param\.nvme_path"):
    make_engine(config())
  with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.nvme_path=.*no such "
                                        r"directory"):
    make_engine(config(nvme_path=str(tmp_path / "no" / "missing")))
  engine = make_engine(config(nvme_path=str(tmp_path), buffer_size=100))
  with pytest.raises(ConfigError, match=r"offload_param\.buffer_size=100: the parameter .* has "
                                        r"([0-9,]+) elements per device and layer") as info:
    engine.init(jax.random.key(0))
  largest = max(math.prod(l.padded_shape) // N // (l.shape[0] if l.stacked else 1)
                for l in engine.plan.leaf_list() if l.param_tier == "nvme")
  assert f" {largest:,} elements per device and layer" in str(info.value)
  assert not list(tmp_path.rglob("*.json"))  # refused before the store was written


def test_shipped_infinity_config_says_its_offload_moves_nothing_on_a_small_model(tmp_path):
  """configs/ds_zero3_infinity.json on the small GPT: every leaf is under the default
  stage3_param_persistence_threshold (1e5), so every parameter persists on the device and the NVMe
  store gets none. initialize, which builds the plan, says so, with the numbers, at the user's line
  (it was silent)."""
  cfg = json.loads((Path(__file__).parents[2] / "configs" / "ds_zero3_infinity.json").read_text())
  cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    engine = jzero.initialize(gpt_factory(SMALL), lm_loss, cfg)
  engine.init(jax.random.key(0))
  leaves = engine.plan.leaf_list()
  total = sum(l.numel for l in leaves)
  said = [w for w in record if str(w.message).startswith("offload_param (device")]
  assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in record]
  assert str(said[0].message) == (
      f"offload_param (device: nvme) moves 0 of the model's {total:,} parameters (0%) to the NVMe "
      f"store; the other {total:,} ({len(leaves)} leaves) stay on the device, persistent: leaves "
      f"under stage3_param_persistence_threshold=100,000 elements (per layer) are kept whole on "
      f"every device, as in DeepSpeed. Lower stage3_param_persistence_threshold (0: every leaf "
      f"but scalars is offloaded) to offload more.")
  assert all(l.param_tier == "device" for l in leaves)


def test_two_processes_with_params_on_nvme_match_one_process_without_offload(tmp_path):
  """2 processes x 4 CPU devices over gloo (tests/multiprocess_worker.py ``param-nvme``): every
  partition read from the disk by the process that holds its devices, a checkpoint saved and
  restored half-way; the losses and parameters of one process on 8 devices without offload, and
  each process's store holds its own 4 devices' rows."""
  import json
  from pathlib import Path

  from jzero.sharding.plan import flatten_paths
  from multiprocess_worker import BATCH as MP_BATCH, STAGE3, STEPS as MP_STEPS
  from zero_testing import engine_run, make_engine, multiprocess_job
  (tmp_path / "nvme").mkdir()
  losses, params = multiprocess_job(tmp_path, "param-nvme")
  engine = make_engine(ds_config(3, **STAGE3))
  _, single, single_losses = engine_run(engine, batches(SMALL.seq_len, MP_BATCH, MP_STEPS))
  assert len(losses) == MP_STEPS
  np.testing.assert_allclose(losses, single_losses, rtol=SAME_MATH)
  assert max_relative_diff(params, flatten_paths(single)) <= SAME_MATH
  stores = [json.loads((tmp_path / f"shards_{i}.json").read_text())["nvme"] for i in range(2)]
  assert [Path(s["directory"]).name for s in stores] == ["process_0", "process_1"]
  assert not set(stores[0]["devices"]) & set(stores[1]["devices"])  # each its own devices' rows
  assert all(len(s["devices"]) == 4 and s["disk_reads"] > 0 for s in stores)
