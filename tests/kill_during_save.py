"""``jzero train`` that SIGKILLs itself at one phase of one save; not a test module itself.

Usage: python kill_during_save.py PHASE SAVE_INDEX -- <jzero train arguments>

The kill is injected at a fixed point of the save code, not by timing (tests/test_kill_resume.py):

* ``before-commit``: when Orbax is about to rename the checkpoint's temporary directory to its tag;
* ``before-files``: after Orbax's commit, before jzero records the file list (``jzero_files.json``);
* ``before-latest``: after the file list, before ``latest`` moves to the new checkpoint.

SAVE_INDEX counts the saves of this run from 1; the earlier ones complete normally.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from orbax.checkpoint._src.path import atomicity  # noqa: E402

from jzero import cli  # noqa: E402
from jzero.checkpoint import layout  # noqa: E402

PHASES = ("before-commit", "before-files", "before-latest")


def main(phase: str, save_index: int, argv: list[str]) -> int:
  if phase not in PHASES:
    raise SystemExit(f"phase must be one of {PHASES}")
  seen = {"commit": 0, "files": 0, "latest": 0}

  def kill_on(counter: str, original):
    def wrapped(*args, **kwargs):
      seen[counter] += 1
      if seen[counter] == save_index:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
      return original(*args, **kwargs)
    return wrapped

  if phase == "before-commit":
    atomicity.AtomicRenameTemporaryPath.finalize = kill_on(
        "commit", atomicity.AtomicRenameTemporaryPath.finalize)
  elif phase == "before-files":
    layout.record_files = kill_on("files", layout.record_files)
  else:
    write_atomic = layout.write_atomic
    latest = kill_on("latest", write_atomic)
    layout.write_atomic = lambda path, text: (latest if path.name == layout.LATEST_FILE
                                              else write_atomic)(path, text)
  return cli.main(argv)


if __name__ == "__main__":
  sep = sys.argv.index("--")
  sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[sep + 1:]))
