"""The NVMe tier (jzero.tiers.nvme_store): optimizer state and fp32 master in a tensorstore store.

Exactness against the same stage without offload (fp32, 8 simulated devices, stages 1-3: losses
and parameters within 1e-6), the store's files and the state's 0-byte placeholders, the memory
report from the store's files, unique directories, path errors before the first step, a process
killed during a step (the store still holds the last completed step), and checkpoints across tiers.
A tiny MLP (tests/nvme_worker.py) keeps the file fast; bench/nvme.py measures the default job.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jzero
from jzero.errors import ConfigError, NotSupportedError
from jzero.tiers import nvme_settings, nvme_state
from jzero.tiers import nvme_store
from nvme_worker import batch, config, loss_fn, model_factory
from zero_testing import SAME_MATH, make_engine, max_relative_diff

STEPS = 3
TESTS = Path(__file__).parents[1]


def _engine(stage, nvme_path=None, precision="fp32", **offload):
  return make_engine(config(stage, nvme_path, precision, **offload), model_factory(), loss_fn)


def _train(engine, state=None, steps=STEPS):
  state = engine.init(jax.random.key(0)) if state is None else state
  losses = []
  for i in range(steps):
    state, metrics = engine.train_step(state, engine.shard_batch(batch(i)))
    losses.append(float(metrics["loss"]))
  return state, jax.tree.map(np.asarray, engine.logical_params(state)), np.array(losses)


@functools.lru_cache(maxsize=None)
def _baseline(stage, precision="fp32"):
  _, params, losses = _train(_engine(stage, precision=precision))
  return params, losses


def _assert_same(params, losses, stage, precision="fp32"):
  ref_params, ref_losses = _baseline(stage, precision)
  assert max_relative_diff(params, ref_params) <= SAME_MATH
  assert np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)) <= SAME_MATH


@pytest.mark.parametrize("stage,sub_group_size,groups", [(1, 60, 3), (2, 10**9, 1), (3, 10**9, 1)])
def test_fp32_nvme_equals_no_offload_and_lives_in_the_store(stage, sub_group_size, groups,
                                                           tmp_path):
  """Same losses and params as the stage without offload (pipelined sub-groups in stage 1; one
  group elsewhere, to compile less); the moments exist only in the store's group files while the
  state holds 0-byte placeholders; the memory report's NVMe bytes, read from
  the files, equal the estimator's nvme tier."""
  cfg = config(stage, tmp_path)
  cfg["zero_optimization"]["sub_group_size"] = sub_group_size
  engine = make_engine(cfg, model_factory(), loss_fn)
  state, params, losses = _train(engine)
  _assert_same(params, losses, stage)
  store = engine.nvme_store
  assert store.step == STEPS and len(store.groups) == groups
  assert store.directory.is_relative_to(tmp_path / f"zero_stage_{stage}")
  for g in range(groups):  # per group one file per device: its partitions of the group's arrays
    for r in range(8):
      data = store.directory / f"slot_{store.slot}" / f"group_{g}" / "c" / str(r) / "0"
      assert data.stat().st_size == store.group_numel[g] * 4
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and all(x.size == 0 for x in moments)  # every leaf is on the NVMe tier
  report = engine.memory_report(state)
  assert report.measured["optimizer"]["nvme"] == pytest.approx(
      report.estimate.bytes["nvme"]["optimizer"], rel=0.05)  # padding: a few elements more
  assert report.measured["optimizer"].get("device", 0) <= 8  # Adam's step count
  assert "NVMe store of process 0" in jzero.analysis.memory_report.format_memory_report(report)


def test_bf16_partial_nvme_and_checkpoints_across_tiers(tmp_path):
  """bf16 stage 3 with half the parameters' master and moments on NVMe equals the run without
  offload; its checkpoint (read from the store) restores into a device-only plan exactly, and that
  plan's checkpoint back into the NVMe tier, whose store then holds the same numbers."""
  (tmp_path / "nvme").mkdir()
  engine = _engine(3, tmp_path / "nvme", "bf16", ratio=0.5)
  state, params, losses = _train(engine)
  _assert_same(params, losses, 3, "bf16")
  tiers = {l.path: l.state_tier for l in engine.plan.leaf_list()}
  assert set(tiers.values()) == {"nvme", "device"}
  master = jzero.sharding.plan.flatten_paths(state.master)
  assert all((master[p].size == 0) == (t == "nvme") for p, t in tiers.items())
  engine.save_checkpoint(state, tmp_path / "ckpt")
  engine.wait_for_checkpoints()
  plain = _engine(3, precision="bf16")
  restored = plain.load_checkpoint(tmp_path / "ckpt")
  assert max_relative_diff(jax.tree.map(np.asarray, plain.logical_params(restored)), params) == 0
  full = nvme_state.full_state(engine.plan, engine.nvme_store, state)
  for a, b in zip(jax.tree.leaves(full.opt_state), jax.tree.leaves(restored.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  plain.save_checkpoint(restored, tmp_path / "plain")
  plain.wait_for_checkpoints()
  back = _engine(3, tmp_path / "nvme", "bf16", ratio=0.5)
  again = back.load_checkpoint(tmp_path / "plain")
  assert back.nvme_store.step == STEPS and back.nvme_store.directory != engine.nvme_store.directory
  assert max_relative_diff(jax.tree.map(np.asarray, back.logical_params(again)), params) == 0
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(nvme_state.full_state(back.plan, back.nvme_store, again))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  again, metrics = back.train_step(again, back.shard_batch(batch(STEPS)))
  assert np.isfinite(float(metrics["loss"])) and back.nvme_store.step == STEPS + 1


def test_two_engines_in_one_process_never_share_a_directory(tmp_path):
  """(The stores are opened with the engines' plans: abstract_state makes them, no device
  work.)"""
  first, second = _engine(1, tmp_path), _engine(1, tmp_path)
  first.abstract_state()
  second.abstract_state()
  a, b = first.nvme_store.run_directory, second.nvme_store.run_directory
  assert a != b and a.parent == b.parent == tmp_path / "zero_stage_1"
  assert f"-{os.getpid()}-" in a.name and f"-{os.getpid()}-" in b.name
  first.nvme_store.close()
  assert not a.exists() and b.exists()


def _unwritable(tmp_path: Path) -> Path:
  path = tmp_path / "read-only"
  path.mkdir()
  path.chmod(0o555)
  if os.access(path, os.W_OK):  # root ignores permissions: a file system refusing directories
    return Path("/sys")
  return path


def test_bad_nvme_paths_fail_before_the_first_step(tmp_path, monkeypatch):
  """Missing key, missing directory, read-only directory: at initialize; too little free space
  for both slots: at init, before any array exists. Each message names the path and the fix."""
  cfg = config(2, tmp_path)
  del cfg["zero_optimization"]["offload_optimizer"]["nvme_path"]
  with pytest.raises(ConfigError, match=r"device=nvme needs zero_optimization\.offload_optimizer"
                                        r"\.nvme_path"):
    make_engine(cfg, model_factory(), loss_fn)
  missing = tmp_path / "no" / "such"
  with pytest.raises(ConfigError, match=rf"nvme_path={missing}: no such directory\. Create it"):
    _engine(2, missing)
  ro = _unwritable(tmp_path)
  with pytest.raises(ConfigError, match=rf"nvme_path={ro} is not writable .*Make it writable"):
    _engine(2, ro)
  engine = _engine(2, tmp_path)
  monkeypatch.setattr(nvme_store.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
  with pytest.raises(ConfigError, match=rf"nvme_path={tmp_path}: the NVMe tier needs .* has "
                                        r"1,000 free\. Free space there"):
    engine.init(jax.random.key(0))
  assert not (tmp_path / "zero_stage_2").exists()


def test_missing_nvme_path_is_created_when_its_parent_exists(tmp_path):
  """DeepSpeed creates its swap folders under nvme_path (os.makedirs): a missing last component is
  created and said (the warning names the path and points at the user's initialize call); a
  missing parent stays an error (test_bad_nvme_paths_fail_before_the_first_step)."""
  path = tmp_path / "swap"
  with pytest.warns(jzero.JZeroWarning) as record:
    engine = jzero.initialize(model_factory(), loss_fn, config(2, path))  # the user's call
  created = [w for w in record if "did not exist: jzero created it" in str(w.message)]
  assert len(created) == 1 and created[0].filename == __file__, [str(w.message) for w in record]
  assert str(path) in str(created[0].message)
  assert path.is_dir() and nvme_settings.settings_from_config(engine.config).path == path


def test_nvme_settings_map_to_tensorstore_or_are_refused(tmp_path):
  cfg = config(2, tmp_path)
  cfg["aio"] = {"queue_depth": 16, "intra_op_parallelism": 4, "block_size": 4096}
  with pytest.warns(jzero.JZeroWarning, match="aio.block_size=4096 has no effect"):
    engine = make_engine(cfg, model_factory(), loss_fn)
  s = nvme_settings.settings_from_config(engine.config)
  assert (s.queue_depth, s.intra_op_parallelism, s.buffer_count, s.sub_group_size) == (16, 4, 2, 60)
  assert s.pipeline_read and s.pipeline_write
  cfg["aio"] = {"use_gds": True}
  with pytest.raises(NotSupportedError, match="aio.use_gds=true .*GPUDirect"):
    make_engine(cfg, model_factory(), loss_fn)
  import optax
  with pytest.raises(ConfigError, match="client optax optimizer"):
    make_engine(config(2, tmp_path), model_factory(), loss_fn, optimizer=optax.sgd(0.1))


def test_killed_during_a_step_the_store_holds_the_last_completed_step(tmp_path):
  """Three processes train on one nvme_path at once and are SIGKILLed inside their third step's
  writes -- the second with the parameters on the tier too (jzero.tiers.nvme_params), the third with the
  params' copies there and their state on the host: their directories differ, and each store
  reads back as exactly step 2's state (the second's and third's with every param); a store
  missing a committed file, or its manifest, is refused clearly."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
         "JAX_PLATFORMS": "cpu"}
  tiers = ("optimizer", "params", "infinity")
  procs = [subprocess.Popen([sys.executable, str(TESTS / "nvme_worker.py"), str(tmp_path),
                             str(tmp_path / f"committed{i}.npz"), tier], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i, tier in enumerate(tiers)]
  outs = [p.communicate(timeout=300) for p in procs]
  dirs = []
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == -9, (out, err[-3000:])
    info = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert info["step"] == 2 and info["groups"] >= 3
    directory = Path(info["directory"])
    step, arrays, doc = nvme_state.open_committed(directory)
    assert step == 2
    saved = np.load(tmp_path / f"committed{i}.npz")
    assert set(saved.files) == set(arrays)
    for name in arrays:
      np.testing.assert_array_equal(arrays[name], saved[name])
    masters = {m["leaf"] for g in doc["groups"] for m in g["members"].values()
               if m["what"] == "master"}
    # fp32: the params' own masters (infinity: their copies; the masters are on the host)
    assert len(masters) == (0 if tiers[i] == "optimizer" else 6)
    if tiers[i] == "infinity":  # nothing but the copies: the optimizer state is on the host
      assert all(m["what"] == "master" for g in doc["groups"] for m in g["members"].values())
    other = directory / f"slot_{'a' if doc['slot'] == 'b' else 'b'}"
    assert (other / "group_0" / "c" / "0" / "0").is_file()  # the interrupted step wrote there
    dirs.append(directory)
  assert len(set(dirs)) == len(tiers)
  files = [{f.relative_to(tmp_path) for f in d.rglob("*")} for d in dirs]
  assert not files[0] & files[1] and not files[0] & files[2] and not files[1] & files[2]
  slot = dirs[0] / f"slot_{json.loads((dirs[0] / nvme_store.MANIFEST).read_text())['slot']}"
  (slot / "group_1" / "c" / "5" / "0").unlink()
  with pytest.raises(nvme_store.NvmeStoreError, match=r"group_1: the files of device rows \[5\] are "
                                                r"missing.*damaged"):
    nvme_state.open_committed(dirs[0])
  (dirs[1] / nvme_store.MANIFEST).unlink()
  with pytest.raises(nvme_store.NvmeStoreError, match="before its first step was committed"):
    nvme_state.open_committed(dirs[1])
