"""The `jzero` command line end to end (subprocesses, tiny model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).parents[1] / "configs"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--no-progress"]


def _jzero(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jzero.cli", *args], capture_output=True,
                        text=True, env=env, timeout=600)


def test_train_summary_checkpoint_and_resume(tmp_path):
  ckpt = tmp_path / "ckpt"
  first = _jzero("train", "--config", str(CONFIGS / "zero3.json"), "--steps", "10",
                 "--checkpoint-dir", str(ckpt), *TINY)
  assert first.returncode == 0, first.stderr
  out = first.stdout
  assert "[jzero] step 10: loss" in out  # steps_per_print = 10 in the config
  assert "loss: start" in out and "tokens/s" in out
  assert "measured/predicted" in out and "checkpoint at step 10" in out
  second = _jzero("train", "--config", str(CONFIGS / "zero3.json"), "--steps", "12",
                  "--checkpoint-dir", str(ckpt), *TINY)
  assert second.returncode == 0, second.stderr
  assert "resumed from" in second.stdout and "at step 10" in second.stdout
  assert "checkpoint at step 12" in second.stdout
  inspect = _jzero("inspect", str(ckpt))
  assert inspect.returncode == 0 and "step 12" in inspect.stdout and "ZeRO stage 3" in inspect.stdout


def test_estimate_prints_the_classic_table():
  out = _jzero("estimate", "--params", "7e9", "--devices", "8")
  assert out.returncode == 0, out.stderr
  for number in ("112.00 GB", "38.50 GB", "26.25 GB", "14.00 GB"):
    assert number in out.stdout
