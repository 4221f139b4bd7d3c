"""The one check that a directory jzero writes to (a checkpoint directory, ``nvme_path``) takes a
write: a small file written, fsync'ed and removed. Each caller turns the OSError into its own
error, naming the cause and the fix."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_probe_error"]

#: Bytes the probe writes: one page, so a full disk or an exceeded quota shows.
PROBE_BYTES = 4096


def write_probe_error(directory: Path) -> OSError | None:
  """None when a :data:`PROBE_BYTES` file can be written, fsync'ed and removed in ``directory``;
  otherwise the OSError (read-only file system, disk full, no permission) for the caller's
  message."""
  try:
    fd, probe = tempfile.mkstemp(prefix=".jzero-probe-", dir=directory)
    try:
      os.write(fd, b"\0" * PROBE_BYTES)
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    return e
  return None
