"""The NVMe store's run directories on disk: who owns each, which are stale, and what a failed
write says.

Every store lives in ``<nvme_path>/zero_stage_<n>/<host>-<pid>-<UTC time>-<uuid>/`` (one
``process_<i>/`` per process of the run, :mod:`jzero.tiers.nvme_store`), so its name tells the
host and process that owns it. A process removes its run directory when it exits normally; a
killed process, or one whose step could not be written (the store keeps its last committed step
for the resume, :class:`jzero.errors.StepNotCommitted`), leaves it. Such a directory is *stale*
once its process is gone: :func:`find_runs` lists them (a process of this host is gone when its
pid is not running, or runs a process started after the store was made: the pid was reused; a
store of another host cannot be checked here and is never called stale), a new store warns about
them when it opens (their bytes, their age, the step each process committed), and
:func:`reclaim` -- ``jzero nvme-stores NVME_PATH --reclaim`` -- removes them. Stores of running
processes and of other hosts are never touched.

A failed write (:func:`jzero.errors.describe_io_error` tells a disk's error -- an ``OSError``, or
tensorstore's ``ValueError`` carrying an error code -- from a bug) becomes one paragraph
(:func:`write_failure`): the path, the cause, the bytes a step writes and those free, and how to
finish the step or resume.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

__all__ = ["RunDirectory", "run_name", "host_name", "find_runs", "stale_runs", "reclaim",
           "describe", "describe_stale", "write_failure", "remove_unless_kept"]

_NAME = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)-(?P<time>\d{8}T\d{6})-(?P<uuid>[0-9a-f]{12})$")
_TIME = "%Y%m%dT%H%M%S"


def host_name() -> str:
  """This machine's short host name, as run directories record it."""
  return socket.gethostname().split(".")[0] or "host"


def run_name() -> str:
  """A new run directory's name: ``<host>-<pid>-<UTC time>-<uuid>`` (unique between two engines
  of one process, two processes and two runs)."""
  now = datetime.datetime.now(datetime.timezone.utc).strftime(_TIME)
  return f"{host_name()}-{os.getpid()}-{now}-{uuid.uuid4().hex[:12]}"


def _dir_bytes(path: Path) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


def _started_after(pid: int, when: float) -> bool:
  """Whether process ``pid`` started after ``when`` (seconds since the epoch): its pid was reused.
  Linux only (``/proc``); False where it cannot be told."""
  try:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError, StopIteration):
    return False
  return started > when + 1.0  # the clock tick's rounding


def _alive(pid: int, created: float) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    pass
  return not _started_after(pid, created)


@dataclasses.dataclass(frozen=True)
class RunDirectory:
  """One run directory under an ``nvme_path``.

  Attributes:
    path: the directory (``.../zero_stage_<n>/<host>-<pid>-<time>-<uuid>``).
    host, pid: the process that made it; created: when (seconds since the epoch, UTC).
    state: "running" (its process runs on this host), "stale" (its process is gone) or "other
      host" (cannot be checked from here).
    bytes: its files' bytes; age_s: seconds since its last write.
    steps: process directory name -> the step its manifest commits (None: none committed).
  """

  path: Path
  host: str
  pid: int
  created: float
  state: str
  bytes: int
  age_s: float
  steps: dict[str, int | None]


def _committed(process_dir: Path) -> int | None:
  try:
    return int(json.loads((process_dir / "manifest.json").read_text())["step"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _last_write(path: Path) -> float:
  times = [path.stat().st_mtime]
  for child in path.glob("process_*/manifest.json"):
    try:
      times.append(child.stat().st_mtime)
    except OSError:
      pass
  return max(times)


def find_runs(nvme_path: str | os.PathLike) -> list[RunDirectory]:
  """Every run directory under ``nvme_path`` (``zero_stage_*/<host>-<pid>-<time>-<uuid>``),
  oldest first; other names are not jzero's and are left out."""
  root, here, now = Path(nvme_path), host_name(), time.time()
  out = []
  for path in sorted(root.glob("zero_stage_*/*")):
    match = _NAME.match(path.name)
    if not match or not path.is_dir():
      continue
    created = datetime.datetime.strptime(match["time"], _TIME).replace(
        tzinfo=datetime.timezone.utc).timestamp()
    pid = int(match["pid"])
    if match["host"] != here:
      state = "other host"
    else:
      state = "running" if _alive(pid, created) else "stale"
    try:
      age = now - _last_write(path)
    except OSError:  # removed meanwhile
      continue
    out.append(RunDirectory(path, match["host"], pid, created, state, _dir_bytes(path), age,
                            {p.name: _committed(p) for p in sorted(path.glob("process_*"))}))
  return sorted(out, key=lambda r: r.created)


def stale_runs(nvme_path: str | os.PathLike) -> list[RunDirectory]:
  """The run directories under ``nvme_path`` whose process (on this host) is gone."""
  return [r for r in find_runs(nvme_path) if r.state == "stale"]


def reclaim(nvme_path: str | os.PathLike) -> list[RunDirectory]:
  """Removes the stale run directories under ``nvme_path`` (never a running process's, nor
  another host's); returns those removed."""
  removed = []
  for run in stale_runs(nvme_path):
    shutil.rmtree(run.path, ignore_errors=True)
    if not run.path.exists():
      removed.append(run)
  return removed


def _size(n: float) -> str:
  for unit in ("bytes", "KB", "MB", "GB", "TB"):
    if n < 1000 or unit == "TB":
      return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
    n /= 1000
  return f"{n:.1f} TB"


def _age(seconds: float) -> str:
  if seconds < 120:
    return f"{seconds:.0f} s"
  if seconds < 7200:
    return f"{seconds / 60:.0f} min"
  if seconds < 172800:
    return f"{seconds / 3600:.1f} h"
  return f"{seconds / 86400:.1f} days"


def describe(run: RunDirectory) -> str:
  """One run directory in a line: path, owner, bytes, age, committed steps."""
  steps = ", ".join(f"{name}: {'none' if s is None else f'step {s}'}"
                    for name, s in run.steps.items()) or "no process directory"
  return (f"{run.path} ({run.state}; {run.host} pid {run.pid}; {_size(run.bytes)}; last written "
          f"{_age(run.age_s)} ago; committed {steps})")


def describe_stale(nvme_path: str | os.PathLike, stale: list[RunDirectory]) -> str:
  """The warning a new store gives about ``stale`` run directories under ``nvme_path``."""
  shown = "; ".join(describe(r) for r in stale[:5])
  more = f"; and {len(stale) - 5} more" if len(stale) > 5 else ""
  total = sum(r.bytes for r in stale)
  return (f"{nvme_path} holds {len(stale)} NVMe store(s) of processes that are gone, "
          f"{_size(total)} in all: {shown}{more}. A killed run, or one whose step could not be "
          f"written, leaves its store; it is scratch space (training resumes from checkpoints, "
          f"and jzero.tiers.nvme_state.open_committed reads a store's committed step). "
          f"Remove them with `jzero nvme-stores {nvme_path} --reclaim` (stores of running "
          f"processes and of other hosts are never touched).")


def write_failure(directory: Path, run_directory: Path, nvme_path: Path, step: int,
                  committed: int | None, cause: str, step_bytes: int) -> str:
  """The paragraph of a step whose writes to the store failed (:class:`StepNotCommitted`)."""
  try:
    free = f"{shutil.disk_usage(directory).free:,}"
  except OSError:
    free = "an unknown number of"
  held = (f"the store still holds step {committed}, committed" if committed is not None else
          "the store has no step committed yet")
  return (f"the NVMe tier could not write step {step} into {directory}: {cause}. Nothing is lost: "
          f"{held}, and this error holds the computed step. A step writes up to "
          f"{step_bytes:,} bytes there (one slot of the store), and the file system has {free} "
          f"bytes free: free space there (`jzero nvme-stores {nvme_path}` lists stores of gone "
          f"processes, `--reclaim` removes them) or fix the disk, then call error.finish(), which "
          f"writes the step and returns (state, metrics) as train_step would have, and train on. "
          f"If this process ends instead, its store stays on disk ({run_directory}) and the run "
          f"resumes from its last checkpoint.")


def remove_unless_kept(path: str, kept: list[bool]) -> None:
  """The store's finalizer: removes its run directory unless a failed step keeps it
  (``kept[0]``)."""
  if not kept[0]:
    shutil.rmtree(path, ignore_errors=True)
