"""Full and read-only disks for the fault tests (issue 48): a real small file system where the test
may mount one (a tmpfs, as root), else the disk's error injected at the write layer -- so every
fault test runs either way, and asserts the same outcome. ``JZERO_TESTS_NO_TMPFS=1`` takes the
injected way as root too."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

ENOSPC_TENSORSTORE = ('RESOURCE_EXHAUSTED: Error writing local file "{path}": Failed writing: '
                      '"{path}.__lock": Failed to write 440 bytes to file 9: No space left on '
                      "device [os_error_code='28']")


def _mount(target: Path, options: str) -> bool:
  if (os.geteuid() != 0 or shutil.which("mount") is None
      or os.environ.get("JZERO_TESTS_NO_TMPFS") == "1"):
    return False
  return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                        capture_output=True).returncode == 0


@contextlib.contextmanager
def small_disk(target: Path, size: str = "2m") -> Iterator[Path | None]:
  """``target`` as a tmpfs of ``size`` while the block runs, where one can be mounted (yields
  ``target``); else yields None (``target`` is a plain directory: inject the error instead)."""
  target.mkdir(parents=True, exist_ok=True)
  mounted = _mount(target, f"size={size}")
  try:
    yield target if mounted else None
  finally:
    if mounted:
      subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextlib.contextmanager
def filled(disk: Path, leave: int = 0) -> Iterator[None]:
  """``disk`` (a small file system) filled but for ``leave`` bytes while the block runs."""
  filler = disk / "filler"
  with open(filler, "wb") as f:
    try:
      while (free := shutil.disk_usage(disk).free - leave) > 0:
        f.write(b"\0" * min(free, 1 << 16))
        f.flush()
    except OSError as e:
      assert e.errno == errno.ENOSPC, e
  try:
    yield
  finally:
    filler.unlink()


@contextlib.contextmanager
def remounted_read_only(disk: Path) -> Iterator[None]:
  """``disk`` (a tmpfs this process mounted) read-only while the block runs."""
  subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
  try:
    yield
  finally:
    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True, capture_output=True)


@contextlib.contextmanager
def failing_store_writes(store, after: int = 0) -> Iterator[list[int]]:
  """The NVMe store's group writes fail as tensorstore fails on a full disk, from the
  ``after + 1``-th write on, while the block runs (the earlier ones land); yields the count of
  writes asked for."""
  write, calls = store._write, [0]

  def full(slot, group, rows):
    calls[0] += 1
    if calls[0] <= after:
      return write(slot, group, rows)
    failed = concurrent.futures.Future()
    failed.set_exception(ValueError(ENOSPC_TENSORSTORE.format(
        path=store.chunk_file(slot, group, 0))))
    return failed

  store._write = full
  try:
    yield calls
  finally:
    store._write = write
