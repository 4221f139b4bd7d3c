"""``jzero nvme-stores NVME_PATH [--reclaim]``: the NVMe stores under an ``nvme_path`` -- whose
they are, their bytes, age and committed steps -- and the stale ones (their process is gone:
killed, or ended after a step that could not be written) removed with ``--reclaim``
(:mod:`jzero.tiers.nvme_runs`). Stores of running processes and of other hosts are never
touched."""

from __future__ import annotations

import argparse
from pathlib import Path

from jzero.errors import ConfigError
from jzero.tiers import nvme_runs

__all__ = ["add_parser", "stores"]


def stores(args: argparse.Namespace) -> int:
  path = Path(args.nvme_path)
  if not path.is_dir():
    raise ConfigError(f"{path} is not a directory: give the nvme_path of a run's config.")
  runs = nvme_runs.find_runs(path)
  if not runs:
    print(f"jzero: no NVMe store under {path}")
    return 0
  for run in runs:
    print(nvme_runs.describe(run))
  stale = [r for r in runs if r.state == "stale"]
  if args.reclaim:
    removed = nvme_runs.reclaim(path)
    print(f"jzero: removed {len(removed)} stale store(s), "
          f"{sum(r.bytes for r in removed):,} bytes")
  elif stale:
    print(f"jzero: {len(stale)} stale store(s), {sum(r.bytes for r in stale):,} bytes: "
          f"`jzero nvme-stores {path} --reclaim` removes them")
  return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("nvme-stores", help="list the NVMe tier's stores under an nvme_path; "
                     "--reclaim removes those of processes that are gone")
  p.add_argument("nvme_path", help="the nvme_path of the runs' configs")
  p.add_argument("--reclaim", action="store_true",
                 help="remove the stores whose process (on this host) is gone")
  p.set_defaults(func=stores)
