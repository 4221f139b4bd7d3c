"""A checkpoint is complete or it is not there: ``jzero train`` killed at each phase of a save
(injected at a fixed point of the save code by tests/kill_during_save.py) resumes and saves again,
and nothing complete is lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jzero import checkpoint
from jzero.errors import CheckpointError

HERE = Path(__file__).parents[1]
CONFIG = HERE.parents[0] / "configs" / "zero3.json"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--no-progress"]


def _train(ckpt: Path, steps: int, *kill: str, keep: int | None = None
           ) -> subprocess.CompletedProcess:
  args = ["train", "--config", str(CONFIG), "--steps", str(steps), "--checkpoint-dir", str(ckpt),
          "--save-every", "2", *TINY, *(["--keep", str(keep)] if keep else [])]
  command = ([str(HERE / "kill_during_save.py"), *kill, "--", *args] if kill
             else ["-m", "jzero.cli", *args])
  return subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


# phase -> (what the directory holds after the kill at the save of step 4, the step resumed from)
EXPECTED = {
    "before-commit": (["2"], 2),   # only a temporary directory under 4's name
    "before-files": (["2"], 2),    # 4/ committed by Orbax, no file list: incomplete, skipped
    "before-latest": (["2", "4"], 4),  # 4/ complete, `latest` still says 2: resumed from 4
}


@pytest.mark.parametrize("phase", list(EXPECTED))
def test_killed_save_resumes_and_saves_again(tmp_path, phase):
  """With --keep 1 too: retention runs only after a save is complete, so the killed save's
  complete predecessor stays."""
  ckpt = tmp_path / "ckpt"
  killed = _train(ckpt, 6, phase, "4", keep=1)
  assert killed.returncode == -9, killed.stderr[-2000:]
  complete, resume_step = EXPECTED[phase]
  assert checkpoint.all_tags(ckpt) == complete
  assert checkpoint.latest_tag(ckpt) == "2"
  if phase == "before-files":
    assert checkpoint.incomplete_tags(ckpt) == ["4"]
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
      checkpoint.read_metadata(ckpt, 4)
    described = subprocess.run([sys.executable, "-m", "jzero.cli", "inspect", str(ckpt), "--tag",
                                "4"], capture_output=True, text=True, timeout=300)
    assert "INCOMPLETE" in described.stdout, described.stdout + described.stderr
  if phase == "before-commit":
    assert not (ckpt / "4").exists()

  resumed = _train(ckpt, 8)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from {ckpt} at step {resume_step}" in resumed.stdout
  if phase == "before-files":
    assert "skipping incomplete checkpoint(s) ['4']" in resumed.stderr
  assert checkpoint.all_tags(ckpt) == ["2", "4", "6", "8"]
  assert checkpoint.incomplete_tags(ckpt) == [] and checkpoint.latest_tag(ckpt) == "8"
  assert checkpoint.latest_step(ckpt) == 8
