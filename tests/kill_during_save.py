"""``jzero train`` that SIGKILLs itself at one phase of one save; not a test module itself.

Usage: python kill_during_save.py PHASE TAG -- <jzero train arguments>

The kill is injected at a fixed point of the save code, not by timing
(tests/checkpoint/test_kill_resume.py):

* ``before-commit``: when Orbax is about to rename the checkpoint's temporary directory to its tag;
* ``before-files``: after Orbax's commit, before jzero records the file list (``jzero_files.json``);
* ``before-latest``: after the file list, before ``latest`` moves to the new checkpoint.

TAG is the checkpoint whose save is killed (e.g. the step "4"); the other saves complete normally.
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


def main(phase: str, tag: str, argv: list[str]) -> int:
  if phase not in PHASES:
    raise SystemExit(f"phase must be one of {PHASES}")

  def kill_if(hit: bool) -> None:
    if hit:
      sys.stdout.flush()
      os.kill(os.getpid(), signal.SIGKILL)

  if phase == "before-commit":
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    def killing_finalize(self, *args, **kwargs):
      kill_if(self.get_final().name == tag)
      return finalize(self, *args, **kwargs)
    atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
  elif phase == "before-files":
    record_files = layout.record_files

    def killing_record(step_dir, *args, **kwargs):
      kill_if(step_dir.name == tag)
      return record_files(step_dir, *args, **kwargs)
    layout.record_files = killing_record
  else:
    write_atomic = layout.write_atomic

    def killing_write(path, text):
      kill_if(path.name == layout.LATEST_FILE and text.strip() == tag)
      return write_atomic(path, text)
    layout.write_atomic = killing_write
  return cli.main(argv)


if __name__ == "__main__":
  sep = sys.argv.index("--")
  sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[sep + 1:]))
