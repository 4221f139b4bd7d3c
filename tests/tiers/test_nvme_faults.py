"""Faults of the NVMe tier lose nothing (issue 48): a disk that fills during a step (the optimizer
tier and the parameter tier) is a StepNotCommitted naming the path and the bytes, the store keeps
its last committed step, and ``finish()`` -- once the disk has room -- completes the step so that
the run equals the uninterrupted one bitwise; a process that ends there keeps its store, which the
next run announces (bytes, age) and ``jzero nvme-stores --reclaim`` removes; a failed write of the
initial state is one clear error.

The disk is a 2 MiB tmpfs, filled, where the test may mount one (root); elsewhere the store's
writes fail as tensorstore fails on a full disk (tests/fault_injection.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jzero
from jzero.errors import JZeroError
from jzero.tiers import nvme_runs, nvme_state, nvme_store
import fault_injection
from nvme_worker import batch, config, loss_fn, model_factory
from zero_testing import make_engine

STEPS = 5
FAILS = 2  # the step index (0-based) whose writes fail: the third step
TESTS = Path(__file__).parents[1]


def _engine(tier: str, path: Path):
  cfg = config(3 if tier == "params" else 2, path)
  if tier == "params":  # the stage-3 params on the tier too (jzero.tiers.nvme_params)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(path),
                                                 "max_in_cpu": 0}
  return make_engine(cfg, model_factory(), loss_fn)


def _params(engine, state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(engine.logical_params(state))]


def _uninterrupted(tier: str, path: Path) -> tuple[list[float], list[np.ndarray]]:
  path.mkdir()
  engine = _engine(tier, path)
  state, losses = engine.init(jax.random.key(0)), []
  for i in range(STEPS):
    state, metrics = engine.train_step(state, engine.shard_batch(batch(i)))
    losses.append(float(metrics["loss"]))
  return losses, _params(engine, state)


@pytest.mark.parametrize("tier", ["optimizer", "params"])
def test_a_disk_full_during_a_step_loses_nothing(tier, tmp_path):
  """Steps 1-2 commit; step 3's writes fail (one group lands first with the injected fault): the
  step is StepNotCommitted, naming the store, the cause, the bytes a step writes and the free
  ones; the store still commits step 2 with step 2's arrays on disk; the state given to the step
  was donated, and finish() on a disk still full fails the same way. With room again, finish()
  writes step 3 and returns its state and metrics; steps 4-5 follow, and every loss and the final
  params equal the uninterrupted run's exactly."""
  ref_losses, ref_params = _uninterrupted(tier, tmp_path / "reference")
  with fault_injection.small_disk(tmp_path / "disk") as disk:
    path = disk or tmp_path / "disk"
    engine = _engine(tier, path)
    state, losses = engine.init(jax.random.key(0)), []
    for i in range(FAILS):
      state, metrics = engine.train_step(state, engine.shard_batch(batch(i)))
      losses.append(float(metrics["loss"]))
    store = engine.nvme_store
    _, before, _ = nvme_state.open_committed(store.directory)
    full = (fault_injection.filled(disk) if disk is not None
            else fault_injection.failing_store_writes(store, after=1))
    with full:
      given = state
      with pytest.raises(jzero.StepNotCommitted) as caught:
        engine.train_step(state, engine.shard_batch(batch(FAILS)))
      error = caught.value
      with pytest.raises(jzero.StepNotCommitted):
        error.finish()  # still full
    message = str(error)
    assert (f"the NVMe tier could not write step {FAILS + 1} into {store.directory}: No space "
            f"left on device") in message, message
    assert f"the store still holds step {FAILS}, committed" in message
    assert f"A step writes up to {store.bytes_per_slot:,} bytes there" in message
    assert "call error.finish()" in message and str(store.run_directory) in message
    assert (error.step, error.committed, error.path) == (FAILS + 1, FAILS, str(store.directory))
    assert store.step == FAILS
    step, after, _ = nvme_state.open_committed(store.directory)
    assert step == FAILS and set(after) == set(before)
    for name in before:
      np.testing.assert_array_equal(after[name], before[name])
    with pytest.raises(JZeroError, match="donated"):
      engine.train_step(given, engine.shard_batch(batch(FAILS)))

    state, metrics = error.finish()  # the disk has room again
    losses.append(float(metrics["loss"]))
    assert store.step == FAILS + 1 and int(state.step) == FAILS + 1
    for i in range(FAILS + 1, STEPS):
      state, metrics = engine.train_step(state, engine.shard_batch(batch(i)))
      losses.append(float(metrics["loss"]))
    assert losses == ref_losses
    for a, b in zip(_params(engine, state), ref_params):
      np.testing.assert_array_equal(a, b)
    engine.nvme_store.close()


def test_a_run_that_ends_on_a_failed_step_keeps_its_store_and_the_next_run_says_so(tmp_path):
  """A process whose third step cannot be written ends with the StepNotCommitted paragraph (no
  tensorstore traceback behind it); its store stays on disk, committed at step 2 with the arrays
  it had; the next store opened under the same nvme_path warns about it (its bytes, its age, the
  committed step, the command that removes it); `jzero nvme-stores` lists it as stale and
  --reclaim removes it and only it (the running process's store stays)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
         "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, str(TESTS / "nvme_worker.py"), str(tmp_path),
                        str(tmp_path / "committed.npz"), "optimizer", "full"], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "jzero.errors.StepNotCommitted: the NVMe tier could not write step 3" in out.stderr
  assert "RESOURCE_EXHAUSTED" not in out.stderr  # the paragraph, not tensorstore's chain
  info = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
  left = Path(info["directory"])
  step, arrays, _ = nvme_state.open_committed(left)
  saved = np.load(tmp_path / "committed.npz")
  assert step == 2 and set(arrays) == set(saved.files)
  for name in arrays:
    np.testing.assert_array_equal(arrays[name], saved[name])

  with pytest.warns(jzero.JZeroWarning) as record:
    engine = _engine("optimizer", tmp_path)
    engine.init(jax.random.key(0))
  said = [str(w.message) for w in record if "of processes that are gone" in str(w.message)]
  assert len(said) == 1, [str(w.message) for w in record]
  assert f"{tmp_path} holds 1 NVMe store(s)" in said[0] and str(left.parent) in said[0]
  assert "KB" in said[0] and "last written" in said[0] and "process_0: step 2" in said[0]
  assert f"jzero nvme-stores {tmp_path} --reclaim" in said[0]
  runs = {r.path: r.state for r in nvme_runs.find_runs(tmp_path)}
  assert runs == {left.parent: "stale", engine.nvme_store.run_directory: "running"}

  cli = lambda *a: subprocess.run([sys.executable, "-m", "jzero.cli", "nvme-stores", *a],
                                  env=env, capture_output=True, text=True, timeout=300)
  listed = cli(str(tmp_path))
  assert listed.returncode == 0, listed.stderr
  assert f"{left.parent} (stale;" in listed.stdout and "--reclaim` removes them" in listed.stdout
  assert f"{engine.nvme_store.run_directory} (running;" in listed.stdout
  reclaimed = cli(str(tmp_path), "--reclaim")
  assert reclaimed.returncode == 0 and "removed 1 stale store(s)" in reclaimed.stdout
  assert not left.parent.exists() and engine.nvme_store.directory.is_dir()
  engine.nvme_store.close()


def test_a_reused_pid_is_not_a_running_store(tmp_path):
  """A store whose pid now runs a process started after the store was made (the pid reused: here
  this very process, under a store name of the year 2000) is stale, and reclaimed; a store of
  another host is never called stale, nor reclaimed."""
  runs = tmp_path / "zero_stage_2"
  old = runs / f"{nvme_runs.host_name()}-{os.getpid()}-20000101T000000-{'a' * 12}"
  other = runs / f"elsewhere-{os.getpid()}-20000101T000000-{'b' * 12}"
  for run in (old, other):
    (run / "process_0").mkdir(parents=True)
  assert {r.path: r.state for r in nvme_runs.find_runs(tmp_path)} == {old: "stale",
                                                                      other: "other host"}
  assert [r.path for r in nvme_runs.reclaim(tmp_path)] == [old]
  assert not old.exists() and other.exists()


def test_a_failed_write_of_the_initial_state_is_one_clear_error(tmp_path):
  """The initial masters cannot be written (disk full at init): an NvmeStoreError naming the
  store, the cause and the bytes, without tensorstore's traceback; nothing else changed."""
  engine = _engine("optimizer", tmp_path)
  engine.abstract_state()  # opens the store
  with fault_injection.failing_store_writes(engine.nvme_store):
    with pytest.raises(nvme_store.NvmeStoreError) as caught:
      engine.init(jax.random.key(0))
  message = str(caught.value)
  assert (f"the NVMe tier could not write the initial state (step 0) into "
          f"{engine.nvme_store.directory}: No space left on device") in message
  assert f"{engine.nvme_store.bytes_per_slot:,} bytes there per slot" in message
  assert caught.value.__cause__ is None and caught.value.__suppress_context__
  engine.nvme_store.close()
