"""State a user can trust: a script that ends right after saving, relative paths, damaged files,
a donated state used again, and the DeepSpeed call shapes migrating scripts use (tags,
client_state)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jzero import checkpoint
from jzero.cli import main as cli_main
from jzero.errors import CheckpointError, DataError, JZeroWarning
from jzero.sharding.plan import flatten_paths

from zero_testing import SMALL, batches, ds_config, make_engine

TESTS = Path(__file__).parents[1]
SCENARIOS = TESTS / "exit_scenarios.py"


def _scenario(*args: str, cwd: Path) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  return subprocess.run([sys.executable, str(SCENARIOS), *args], capture_output=True, text=True,
                        env=env, cwd=cwd, timeout=300)


# --- the end of the program ----------------------------------------------------------------------


def test_script_ending_right_after_save_keeps_the_checkpoint(tmp_path):
  """Five times, a script saves (asynchronously) and ends at once: each run exits 0, leaves its
  checkpoint finalized, verified and named by ``latest``, and prints no traceback. (Before the
  exit-time wait, 3 runs of 3 lost their checkpoint.)"""
  for run in range(5):
    done = _scenario("save-exit", "ckpt", f"run{run}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert checkpoint.latest_tag(tmp_path / "ckpt") == f"run{run}"
    checkpoint.describe(tmp_path / "ckpt")  # every file present with its recorded checksum
  assert checkpoint.all_tags(tmp_path / "ckpt") == [f"run{i}" for i in range(5)]
  assert not list((tmp_path / "ckpt").glob("*orbax-checkpoint-tmp*"))


def test_save_failing_at_exit_is_one_line_and_status_1(tmp_path):
  done = _scenario("save-fails-at-exit", "ckpt", cwd=tmp_path)
  assert done.returncode == 1
  errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
  assert errors == [f"jzero: error: saving checkpoint '1' to {tmp_path / 'ckpt'} failed: No space "
                    f"left on device; nothing of it was kept. The checkpoints saved before are "
                    f"intact: []."], done.stderr[-3000:]
  assert checkpoint.latest_tag(tmp_path / "ckpt") is None
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []  # the failed save's too


def test_reusing_a_donated_state_raises_and_the_process_survives(tmp_path):
  """train_step donates its state; calling train_step, eval_loss, logical_params or
  save_checkpoint with it again is a JZeroError (with 8 CPU devices XLA would read freed memory
  and the process die of SIGSEGV), and training goes on with the state train_step returned."""
  done = _scenario("reuse-donated", cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  for name in ("train_step", "eval_loss", "logical_params", "save_checkpoint"):
    assert any(line.startswith(f"{name}: JZeroError: {name}: this train state was donated")
               for line in lines), done.stdout
  assert lines[-1].startswith("went on training: loss ")
  assert not (tmp_path / "unused-checkpoint-dir").exists()


# --- relative paths ------------------------------------------------------------------------------


def test_relative_paths_through_save_load_resume_convert_inspect(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  engine = make_engine(2)
  state = engine.init(jax.random.key(0))
  engine.save_checkpoint(state, "ckpt")
  engine.wait_for_checkpoints()
  restored = engine.load_checkpoint("ckpt")
  np.testing.assert_array_equal(restored.params["pos"], state.params["pos"])

  small = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
           "--no-progress", "--config", str(TESTS.parent / "configs" / "zero2.json")]
  assert cli_main(["train", *small, "--steps", "2", "--checkpoint-dir", "ck"]) == 0
  assert cli_main(["train", *small, "--steps", "3", "--checkpoint-dir", "ck"]) == 0
  assert "resumed from ck at step 2" in capsys.readouterr().out
  assert cli_main(["convert", "ck", "--safetensors", "w.safetensors"]) == 0
  assert (tmp_path / "w.safetensors").is_file()
  assert cli_main(["inspect", "ck"]) == 0
  assert "step 3" in capsys.readouterr().out
  assert checkpoint.read_weights("w.safetensors")["pos"].shape == (16, 32)


# --- damaged files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A finalized stage-2 checkpoint of SMALL after one training step, and the engine."""
  directory = tmp_path_factory.mktemp("saved")
  engine = make_engine(2)
  state, _ = engine.train_step(engine.init(jax.random.key(0)),
                               engine.shard_batch(batches(SMALL.seq_len, 8, 1)[0]))
  engine.save_checkpoint(state, directory)
  engine.wait_for_checkpoints()
  return directory, engine


def _files(step_dir: Path) -> list[str]:
  return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                if p.is_file() and p.name != checkpoint.FILES_FILE)


def test_a_flipped_byte_in_any_file_is_named(saved, tmp_path):
  """XOR 64 bytes in the middle of any file -- a data file, the array metadata, the JSON --
  keeping its size: loading and ``jzero inspect`` refuse it naming the file; nothing restores
  corrupt values."""
  directory, engine = saved
  step_dir = directory / checkpoint.latest_tag(directory)
  names = _files(step_dir)
  data_files = [n for n in names if "/d/" in n]
  assert data_files and any(n.endswith(("_METADATA", "manifest.ocdbt")) for n in names)
  for rel in names:
    copy = tmp_path / rel.replace("/", "_")
    shutil.copytree(directory, copy)
    victim = copy / step_dir.name / rel
    raw = bytearray(victim.read_bytes())
    middle = max(0, len(raw) // 2 - 32)
    for i in range(middle, min(len(raw), middle + 64)):
      raw[i] ^= 0xA5
    victim.write_bytes(bytes(raw))
    pattern = f"file {rel} does not match the checksum"
    with pytest.raises(CheckpointError, match=pattern):
      engine.load_checkpoint(copy, step_dir.name)
    with pytest.raises(CheckpointError, match=pattern):
      checkpoint.describe(copy)
    assert cli_main(["inspect", str(copy)]) == 2


def test_inspect_refuses_a_truncated_file(saved, tmp_path, capsys):
  directory, _ = saved
  copy = tmp_path / "copy"
  shutil.copytree(directory, copy)
  step_dir = copy / checkpoint.latest_tag(copy)
  victim = max((p for p in step_dir.rglob("d/*")), key=lambda p: p.stat().st_size)
  victim.write_bytes(victim.read_bytes()[:100])
  assert cli_main(["inspect", str(copy)]) == 2
  err = capsys.readouterr().err
  assert f"file {victim.relative_to(step_dir)} has 100 bytes but" in err


# --- DeepSpeed's call shapes ---------------------------------------------------------------------


def test_tags_client_state_and_latest(saved, tmp_path):
  """save_checkpoint(dir, tag=..., client_state=...) and load_checkpoint(dir, tag=None) as in
  DeepSpeed's examples: ``latest`` holds the tag, the client state comes back."""
  directory, engine = saved
  state = engine.load_checkpoint(directory)
  assert engine.save_checkpoint(state, tmp_path, tag="epoch_0", client_state={"epoch": 0}) == \
      "epoch_0"
  engine.save_checkpoint(state, tmp_path, tag="epoch_1", client_state={"epoch": 1},
                         save_latest=False)
  engine.wait_for_checkpoints()
  assert (tmp_path / "latest").read_text().strip() == "epoch_0"
  assert checkpoint.all_tags(tmp_path) == ["epoch_0", "epoch_1"]
  _, client = engine.load_checkpoint(tmp_path, with_client_state=True)
  assert client == {"epoch": 0}
  again, client = engine.load_checkpoint(tmp_path, "epoch_1", with_client_state=True)
  assert client == {"epoch": 1} and int(again.step) == int(state.step) == 1
  for bad in ("", "a/b", "latest", ".hidden"):
    with pytest.raises(CheckpointError, match="cannot name a checkpoint directory"):
      engine.save_checkpoint(state, tmp_path, tag=bad)


def test_fp32_weights_on_model_save_keep_the_model_dtype(tmp_path):
  """stage3_gather_16bit_weights_on_model_save in fp32 training writes fp32 weights, as DeepSpeed
  saves the module's own dtype; the written weights equal the parameters exactly."""
  engine = make_engine(ds_config(3, stage3_gather_16bit_weights_on_model_save=True))
  state = engine.init(jax.random.key(0))
  engine.save_checkpoint(state, tmp_path)
  engine.wait_for_checkpoints()
  weights = checkpoint.read_weights(tmp_path / "0" / checkpoint.WEIGHTS16)
  params = {p: np.asarray(x) for p, x in flatten_paths(engine.logical_params(state)).items()}
  assert weights.keys() == params.keys()
  for path, x in params.items():
    assert weights[path].dtype == np.float32, path
    np.testing.assert_array_equal(weights[path], x, err_msg=path)


def test_resume_with_another_global_batch_warns_with_both_sizes(saved):
  directory, _ = saved
  other = make_engine({**ds_config(2), "gradient_accumulation_steps": 2})  # global batch 16 instead of 8
  with pytest.warns(JZeroWarning, match="global batch of 8 samples per step; this engine uses 16"):
    other.load_checkpoint(directory)


def test_a_batch_that_gains_a_key_is_named(saved):
  directory, engine = saved
  state = engine.load_checkpoint(directory)
  batch = batches(SMALL.seq_len, 8, 1)[0]
  state, _ = engine.train_step(state, engine.shard_batch(batch))
  with pytest.raises(DataError, match=r"keys \['mask'\] are new"):
    engine.train_step(state, {**batch, "mask": np.ones_like(batch["tokens"])})
