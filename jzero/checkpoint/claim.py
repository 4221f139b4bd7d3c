"""One writer per checkpoint directory, and a directory checked before anything is written to it.

A :class:`~jzero.checkpoint.Checkpointer` *claims* its directory before its first save
(:func:`claim`, in the primary process): the directory is created (a parent that cannot be created,
or a path that is a file, is a :class:`~jzero.errors.CheckpointError` naming it), and an exclusive
``flock`` is taken on ``DIR/.jzero-writer``, which names the holder (host, pid, start time, command
line). A second process that claims the same directory -- another run, a second ``jzero train``
with the same ``--checkpoint-dir`` -- is refused at once with an error naming the holder: two runs
saving into one directory would commit into each other's temporary directories, move ``latest`` to
each other's tags and delete each other's checkpoints. The kernel releases the lock when its process
ends, however it ends, so a killed run never blocks the next one; :func:`release` (a Checkpointer's
``close``, and the end of the program) also removes the file. Within one process, claims of a
directory are counted, not refused. Where the file system has no ``flock`` (some network file
systems), a warning says that two runs are not kept apart there.

Before each save, :func:`check_writable` writes and fsyncs a small file in the directory, so a
read-only file system, a full disk or a directory without write permission is one clear error
before Orbax starts (Orbax's own failure there waits 300 s for a signal that never comes).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

from jzero.disk import write_probe_error
from jzero.errors import CheckpointError, JZeroWarning

__all__ = ["LOCK_FILE", "claim", "release", "check_writable"]

LOCK_FILE = ".jzero-writer"
_GUARD = threading.Lock()
_HELD: dict[Path, list] = {}  # directory -> [fd or None, claims in this process]


def _prepared(path: Path) -> Path:
  """``path`` created as a directory (with its parents), or a CheckpointError saying why not."""
  if path.exists() and not path.is_dir():
    raise CheckpointError(f"checkpoint directory {path} is a file, not a directory; point the "
                          f"checkpoint directory elsewhere or remove the file.")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    blocker = next((p for p in [path, *path.parents] if p.exists()), None)
    why = (f"{blocker} is a file" if blocker is not None and not blocker.is_dir()
           else e.strerror or str(e))
    raise CheckpointError(f"checkpoint directory {path} cannot be created ({why}); create it "
                          f"yourself or choose a directory this user can write.") from None
  return path


def _cannot_write(path: Path, error: OSError) -> CheckpointError:
  hint = {errno.EROFS: "the file system is mounted read-only",
          errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EACCES: "this user may not write there", errno.EPERM: "this user may not write "
          "there"}.get(error.errno, error.strerror or str(error))
  return CheckpointError(f"checkpoint directory {path} cannot be written: {hint}. Nothing was "
                         f"saved and the checkpoints there are as they were; free space, fix the "
                         f"permissions or choose another directory.")


def check_writable(directory: Path) -> None:
  """A CheckpointError naming the cause (read-only, full, no permission) if ``directory`` does
  not take a write (:func:`jzero.disk.write_probe_error`)."""
  error = write_probe_error(directory)
  if error is not None:
    raise _cannot_write(directory, error)


def _holder(lock: Path) -> str:
  try:
    owner = json.loads(lock.read_text())
    return (f"process {owner['pid']} on {owner['host']} (since {owner['since']}: "
            f"{owner['command']})")
  except (OSError, ValueError, KeyError, TypeError):
    return "another process"


def _lock(directory: Path) -> int | None:
  """An open descriptor of ``DIR/.jzero-writer`` holding its exclusive flock (None where the file
  system has no flock); CheckpointError naming the holder if another process has it."""
  lock = directory / LOCK_FILE
  while True:
    try:
      fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise _cannot_write(directory, e) from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise CheckpointError(
          f"checkpoint directory {directory} is in use: {_holder(lock)} saves checkpoints there. "
          f"Two runs saving into one directory overwrite each other's checkpoints and 'latest'; "
          f"give this run a directory of its own, or stop the other run first.") from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a file system without flock
      os.close(fd)
      warnings.warn(f"checkpoint directory {directory}: the file system cannot lock files "
                    f"({e.strerror or e}), so jzero cannot keep a second run from saving there "
                    f"at the same time; make sure only one run uses it.", JZeroWarning,
                    stacklevel=4)
      return None
    try:
      same = os.fstat(fd).st_ino == os.stat(lock).st_ino
    except FileNotFoundError:  # its holder released it (and removed it) meanwhile
      same = False
    if same:
      break
    os.close(fd)
  owner = {"host": socket.gethostname(), "pid": os.getpid(),
           "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:200]}
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    os.fsync(fd)
  except OSError as e:
    os.close(fd)
    raise _cannot_write(directory, e) from None
  return fd


def claim(directory: Path) -> None:
  """Creates ``directory`` and makes this process its writer (module docstring); counted when this
  process holds it already."""
  with _GUARD:
    held = _HELD.get(directory)
    if held is not None:
      held[1] += 1
      return
    _HELD[directory] = [_lock(_prepared(directory)), 1]


def release(directory: Path) -> None:
  """One claim of ``directory`` ends; the last one removes the lock file and unlocks it."""
  with _GUARD:
    held = _HELD.get(directory)
    if held is None:
      return
    held[1] -= 1
    if held[1] > 0:
      return
    del _HELD[directory]
    fd = held[0]
    if fd is not None:
      try:
        os.unlink(directory / LOCK_FILE)  # while locked: a waiting claimer sees a new file
      except OSError:
        pass
      os.close(fd)
