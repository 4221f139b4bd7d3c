"""``jzero train`` SIGKILLed at random moments, then resumed: every run must resume and save again.
Not part of the default run (minutes); tests/checkpoint/test_kill_resume.py kills at each phase of a
save deterministically.

  python tests/random_kills.py [--trials 20] [--seed 0]

Each trial starts a fresh ``jzero train`` (tiny model, saving every 2 steps, 40 steps), waits for
its first step (its losses file), kills it with SIGKILL after a random delay drawn between then and
its expected end (timed on an undisturbed run), then runs the same command to 44 steps and checks
that it exits 0 and ended with a complete checkpoint at step 44. Prints one line per trial (what
the kill left on disk, where the run resumed) and the count.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "zero3.json"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--no-progress"]


def _command(ckpt: Path, steps: int) -> list[str]:
  return [sys.executable, "-m", "jzero.cli", "train", "--config", str(CONFIG), "--steps",
          str(steps), "--checkpoint-dir", str(ckpt), "--save-every", "2",
          "--losses-file", str(ckpt) + ".losses", *TINY]


def _start(ckpt: Path, env: dict) -> tuple[subprocess.Popen, float]:
  """Starts a 40-step run; returns it once it has taken its first step, and when that was."""
  run = subprocess.Popen(_command(ckpt, 40), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=env)
  losses = Path(str(ckpt) + ".losses")
  while not (losses.exists() and losses.read_text().strip()):
    if run.poll() is not None:
      raise RuntimeError(f"the run exited with {run.returncode} before its first step")
    time.sleep(0.05)
  return run, time.perf_counter()


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--trials", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  rng = random.Random(args.seed)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  from jzero import checkpoint
  ok = 0
  with tempfile.TemporaryDirectory() as tmp:
    probe, first = _start(Path(tmp) / "probe", env)
    probe.wait()
    span = time.perf_counter() - first
    print(f"undisturbed run: {span:.1f} s from its first step to its exit")
    for trial in range(args.trials):
      ckpt = Path(tmp) / f"trial{trial}"
      run, _ = _start(ckpt, env)
      delay = rng.uniform(0, span)
      time.sleep(delay)
      run.send_signal(signal.SIGKILL)
      run.wait()
      state = (f"complete {checkpoint.all_tags(ckpt)[-2:]}, incomplete "
               f"{checkpoint.incomplete_tags(ckpt)}, latest {checkpoint.latest_tag(ckpt)}, "
               f"temporary {len(list(ckpt.glob('*orbax-checkpoint-tmp*')))}"
               if ckpt.exists() else "nothing saved")
      resumed = subprocess.run(_command(ckpt, 44), capture_output=True, text=True, env=env)
      start = re.search(r"resumed from .* at step (\d+)", resumed.stdout)
      good = resumed.returncode == 0 and checkpoint.latest_step(ckpt) == 44
      ok += good
      print(f"trial {trial}: killed {delay:.1f} s after its first step ({state}); resumed from "
            f"step {start.group(1) if start else 0}, exit {resumed.returncode}, final step "
            f"{checkpoint.latest_step(ckpt)}: {'ok' if good else 'FAILED'}", flush=True)
      if not good:
        print(resumed.stderr[-2000:])
  print(f"{ok} of {args.trials} killed runs resumed and saved again")
  return 0 if ok == args.trials else 1


if __name__ == "__main__":
  sys.exit(main())
