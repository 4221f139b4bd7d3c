"""Checkpoints under faults and odd input lose nothing (issue 48): two processes racing for one
directory (one writer, the other refused naming it), a full disk before and during a save (one
message, no temporary directory, the previous checkpoint intact and the resume exact), a read-only
file system (one error at once), directory names with spaces, unicode or a backslash, a directory
that is a file or cannot be created, a tag too long for a file name, a ``latest`` naming a tag that
is gone, a tag directory holding another checkpoint.

The small disk is a 2 MiB tmpfs where the test may mount one (root); elsewhere the disk's error is
injected at the write layer (tests/fault_injection.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jzero import checkpoint
from jzero.checkpoint import claim, layout
from jzero.errors import CheckpointError, ConfigError
import fault_injection
from checkpoint_helpers import flat, train
from zero_testing import make_engine

TESTS = Path(__file__).parents[1]
HELPER = TESTS / "checkpoint_helpers.py"


@pytest.fixture(scope="module")
def run():
  """An engine, its state after 2 steps, and the uninterrupted run's losses of steps 3-5."""
  engine = make_engine(2)
  state, _ = train(engine, engine.init(jax.random.key(0)), 2)
  _, losses = train(engine, state_copy(engine, state), 5)
  return engine, state, losses


def state_copy(engine, state):
  """``state`` by value (train_step donates what it is given)."""
  return jax.tree.map(lambda x: x.copy(), state)


def _leftovers(directory: Path) -> list[str]:
  return sorted(p.name for p in directory.iterdir()
                if layout.ORBAX_TMP in p.name or p.name.endswith(layout.DELETING))


# -- two writers -----------------------------------------------------------------------------------


def test_two_processes_saving_into_one_directory_one_writes_the_other_is_refused(tmp_path):
  """Two processes, each with its state ready, start saving steps 1-3 into one directory at the
  same moment: one saves all three, the other is refused at its first save with an error naming
  the writer (host and pid) -- no checkpoint of the one is the other's -- and both exit within
  30 s of the start signal."""
  directory, go = tmp_path / "ckpt", tmp_path / "go"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
         "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, str(HELPER), "race", str(directory), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for _ in range(2)]
  for p in procs:
    assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
  go.touch()
  t0 = time.monotonic()
  outs = [p.communicate(timeout=120) for p in procs]
  took = time.monotonic() - t0
  assert took < 30, took
  codes = sorted(p.returncode for p in procs)
  assert codes == [0, 3], [o[1][-2000:] for o in outs]
  winner = next(p for p in procs if p.returncode == 0)
  refused = next(o for p, o in zip(procs, outs) if p.returncode == 3)[0]
  assert (f"checkpoint directory {directory} is in use: process {winner.pid} on "
          f"{socket.gethostname()}") in refused, refused
  assert checkpoint.all_tags(directory) == ["1", "2", "3"] and not _leftovers(directory)
  for tag in ("1", "2", "3"):
    assert checkpoint.read_metadata(directory, tag)["client_state"] == {"pid": winner.pid}
  assert not (directory / claim.LOCK_FILE).exists()  # released when the writer ended
  make_engine(2).load_checkpoint(directory)


def test_one_process_may_claim_a_directory_twice_and_a_released_one_is_free(tmp_path):
  """Within one process claims are counted (two Checkpointers of one directory); once both are
  closed the lock file is gone and another claimer gets the directory."""
  first, second = checkpoint.Checkpointer(tmp_path), checkpoint.Checkpointer(tmp_path)
  assert (tmp_path / claim.LOCK_FILE).is_file()
  first.close()
  assert (tmp_path / claim.LOCK_FILE).is_file()
  second.close()
  assert not (tmp_path / claim.LOCK_FILE).exists()


# -- full and read-only disks ----------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_full_disk_on_save_keeps_the_previous_checkpoint_and_the_resume_exact(run, tmp_path,
                                                                                 when):
  """Step 2 is saved; the disk then fills ('before': to the last byte -- the save is refused at
  once; 'during': but for 64 KiB, so Orbax starts and its writes fail). One CheckpointError names
  the cause and the checkpoints kept; no temporary directory is left; 'latest' still names step
  2, which restores, and training from it gives the uninterrupted run's losses exactly."""
  engine, state, losses = run
  with fault_injection.small_disk(tmp_path / "disk") as disk:
    directory = (disk or tmp_path / "disk") / "ckpt"
    engine.save_checkpoint(state, directory)
    engine.wait_for_checkpoints()
    if disk is not None:
      context = fault_injection.filled(disk, leave=0 if when == "before" else 64 << 10)
    elif when == "before":  # the probe write before the save: as a full disk answers it
      context = _patched(claim.tempfile, "mkstemp", _enospc)
    else:  # jzero's own write after Orbax's commit: the file list
      context = _patched(layout, "record_files", _enospc)
    t0 = time.monotonic()
    with context, pytest.raises(CheckpointError) as caught:
      engine.save_checkpoint(state_copy(engine, state), directory, "later")
      engine.wait_for_checkpoints()
    assert time.monotonic() - t0 < 10
    message = str(caught.value)
    if when == "before":
      assert f"checkpoint directory {directory} cannot be written: the disk is full" in message
    else:
      assert (f"saving checkpoint 'later' to {directory} failed: No space left on device"
              in message), message
      assert "nothing of it was kept. The checkpoints saved before are intact: ['2']" in message
    assert "Traceback" not in message and "\n" not in message
    assert not _leftovers(directory) and not (directory / "later").exists()
    assert checkpoint.all_tags(directory) == ["2"] and checkpoint.latest_tag(directory) == "2"
    resumed = make_engine(2)
    _, again = train(resumed, resumed.load_checkpoint(directory), 5)
    assert again == losses
    checkpoint.writer(directory).close()  # the mount goes away


def test_a_read_only_file_system_is_one_error_at_once(run, tmp_path):
  """A checkpoint directory on a read-only file system (a tmpfs remounted read-only; elsewhere a
  directory this user cannot write): the save is refused within 10 s with one error naming the
  cause, before Orbax starts (which would wait 300 s); the checkpoint saved before is intact."""
  engine, state, _ = run
  with fault_injection.small_disk(tmp_path / "disk") as disk:
    if disk is None and os.geteuid() == 0:  # root writes anywhere: inject the file system's answer
      directory = tmp_path / "disk" / "ckpt"
      read_only = _patched(claim.tempfile, "mkstemp", _erofs)
    else:
      directory = (disk or tmp_path / "disk") / "ckpt"
      read_only = (fault_injection.remounted_read_only(disk) if disk is not None
                   else _chmod(directory, 0o555))
    engine.save_checkpoint(state, directory)
    checkpoint.writer(directory).close()
    with read_only:
      t0 = time.monotonic()
      with pytest.raises(CheckpointError) as caught:
        engine.save_checkpoint(state_copy(engine, state), directory, "later")
      assert time.monotonic() - t0 < 10
    cause = "this user may not write there" if disk is None and os.geteuid() else \
        "the file system is mounted read-only"
    assert (f"checkpoint directory {directory} cannot be written: {cause}. Nothing was saved"
            in str(caught.value)), str(caught.value)
    assert checkpoint.all_tags(directory) == ["2"] and not _leftovers(directory)
    make_engine(2).load_checkpoint(directory)


def test_jzero_train_refuses_a_read_only_checkpoint_directory_before_training(tmp_path):
  """`jzero train --checkpoint-dir` on a read-only file system (a tmpfs remounted read-only;
  elsewhere a directory this user cannot write): exit status 2 with one line, no traceback,
  before the first step."""
  with fault_injection.small_disk(tmp_path / "disk") as disk:
    directory = (disk or tmp_path / "disk") / "ckpt"
    directory.mkdir()
    if disk is not None:
      read_only, cause = fault_injection.remounted_read_only(disk), "the file system is mounted"
    elif os.geteuid():
      read_only, cause = _chmod(directory, 0o555), "this user may not write there"
    else:  # root, and no mount: a file system that refuses new files
      directory, read_only, cause = Path("/proc/jzero-ckpt"), contextlib.nullcontext(), "cannot"
    with read_only:
      t0 = time.monotonic()
      out = subprocess.run([sys.executable, "-m", "jzero.cli", "train", "--config",
                            str(TESTS.parent / "configs" / "zero3.json"), "--steps", "2",
                            "--checkpoint-dir", str(directory), "--layers", "2",
                            "--d-model", "32", "--heads", "2", "--seq-len", "16",
                            "--no-progress"], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
      took = time.monotonic() - t0
  assert out.returncode == 2, out.stderr[-2000:]
  assert f"jzero: error: checkpoint directory {directory} cannot be" in out.stderr
  assert cause in out.stderr and "Traceback" not in out.stderr
  assert "step 1" not in out.stdout and "loss" not in out.stdout
  print(f"jzero train refused the read-only directory after {took:.1f} s (imports included)")


# -- names and paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["with space", "ünïcode-日本", "tab\tand %41"])
def test_odd_directory_names_round_trip(run, tmp_path, name):
  engine, state, _ = run
  directory = tmp_path / name / "ckpt"
  engine.save_checkpoint(state, directory)
  engine.wait_for_checkpoints()
  other = make_engine(2)
  restored = other.load_checkpoint(directory)
  want = flat(engine.logical_params(state))
  for path, x in flat(other.logical_params(restored)).items():
    np.testing.assert_array_equal(np.asarray(x), np.asarray(want[path]))
  assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_backslash_in_a_directory_is_refused_before_anything_is_written(run, tmp_path):
  """Tensorstore reads '\\' as '/': the save is refused naming where the arrays would go, and
  nothing is created (neither the named directory nor the one the arrays would land in); the
  NVMe tier's nvme_path too."""
  engine, state, _ = run
  directory = tmp_path / "a\\b" / "ckpt"
  with pytest.raises(CheckpointError, match=r"holds a backslash, which Orbax and tensorstore "
                                            r"read as a path separator"):
    engine.save_checkpoint(state, directory)
  with pytest.raises(CheckpointError, match="holds a backslash"):
    engine.load_checkpoint(directory)
  assert not list(tmp_path.iterdir())
  cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 2, "offload_optimizer": {
             "device": "nvme", "nvme_path": str(tmp_path / "n\\vme")}}}
  with pytest.raises(ConfigError, match=r"nvme_path=.*holds a backslash, which tensorstore reads"):
    make_engine(cfg)
  assert not list(tmp_path.iterdir())


def test_directories_that_cannot_hold_checkpoints_are_jzero_errors(run, tmp_path):
  """A parent that is a file (so the directory cannot be created), a checkpoint path that is a
  file (save and load), a tag past a file name's length: a CheckpointError each, nothing
  written."""
  engine, state, _ = run
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointError, match=rf"checkpoint directory {tmp_path}/file/ckpt cannot "
                                            rf"be created \({tmp_path}/file is a file\)"):
    engine.save_checkpoint(state, tmp_path / "file" / "ckpt")
  with pytest.raises(CheckpointError, match=rf"checkpoint directory {tmp_path}/file is a file, "
                                            r"not a directory"):
    engine.save_checkpoint(state, tmp_path / "file")
  with pytest.raises(CheckpointError, match=r"is a file, not a checkpoint directory"):
    engine.load_checkpoint(tmp_path / "file")
  with pytest.raises(CheckpointError, match=r"is 300 bytes long; .*use at most 200 bytes"):
    engine.save_checkpoint(state, tmp_path / "ckpt", "t" * 300)
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [claim.LOCK_FILE]
  checkpoint.writer(tmp_path / "ckpt").close()


def test_latest_and_tags_are_checked_against_what_they_hold(run, tmp_path):
  """'latest' naming a tag that was deleted is refused (no other checkpoint restored in its
  place); a tag directory holding another checkpoint (step 5's under the name '3'), asked for by
  its tag or by 'latest', is refused naming both; given as a directory of its own it restores."""
  engine, state, _ = run
  for step in (3, 5):
    engine.save_checkpoint(state_copy(engine, state)._replace(
        step=jax.device_put(np.int32(step), state.step.sharding)), tmp_path)
  checkpoint.writer(tmp_path).close()
  (tmp_path / "5").rename(tmp_path / "5-moved")  # latest names 5
  with pytest.raises(CheckpointError, match=r"latest names checkpoint '5', which is not in .*"
                                            r"jzero does not guess another"):
    make_engine(2).load_checkpoint(tmp_path)
  import shutil
  shutil.rmtree(tmp_path / "3")
  (tmp_path / "5-moved").rename(tmp_path / "3")
  with pytest.raises(CheckpointError, match=r"/3 holds checkpoint '5' \(step 5\), saved under "
                                            r"that tag and renamed or copied to '3'"):
    make_engine(2).load_checkpoint(tmp_path, 3)
  (tmp_path / "latest").write_text("3\n")
  with pytest.raises(CheckpointError, match=r"holds checkpoint '5'"):
    make_engine(2).load_checkpoint(tmp_path)
  restored = make_engine(2).load_checkpoint(tmp_path / "3")  # the directory itself: a copy
  assert int(restored.step) == 5


# -- helpers ---------------------------------------------------------------------------------------


def _enospc(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]) if args else None)


def _erofs(*args, **kwargs):
  raise OSError(errno.EROFS, os.strerror(errno.EROFS))


class _patched:
  """``setattr(owner, name, value)`` while the block runs."""

  def __init__(self, owner, name, value):
    self.owner, self.name, self.value = owner, name, value

  def __enter__(self):
    self.old = getattr(self.owner, self.name)
    setattr(self.owner, self.name, self.value)

  def __exit__(self, *exc):
    setattr(self.owner, self.name, self.old)


class _chmod:
  """``path`` with ``mode`` while the block runs."""

  def __init__(self, path: Path, mode: int):
    self.path, self.mode = path, mode

  def __enter__(self):
    self.old = self.path.stat().st_mode
    self.path.chmod(self.mode)

  def __exit__(self, *exc):
    self.path.chmod(self.old)
