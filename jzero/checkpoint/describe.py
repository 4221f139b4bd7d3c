"""``jzero inspect``: a readable description of a checkpoint, after checking its files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from jzero.checkpoint import layout

__all__ = ["describe"]


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def describe(directory: str | os.PathLike, tag: str | int | None = None) -> str:
  """A readable summary of a checkpoint: tag, step, stage, mesh, precision, every stored array
  (shape, dtype, bytes) and totals -- ``jzero inspect``. Every file is checked against its recorded
  size and checksum first (a damaged checkpoint is a CheckpointError naming the file); no array is
  read."""
  root = Path(directory).absolute()
  if tag is not None and not layout._is_checkpoint(root) and (root / str(tag)).is_dir() \
      and not layout.is_complete(root / str(tag)):
    return (f"checkpoint {root / str(tag)}: INCOMPLETE -- its save was cut off after Orbax's "
            f"commit and before jzero recorded its files ({layout.FILES_FILE}); it is never "
            f"restored, and the next save under this tag replaces it. Complete checkpoints in "
            f"{root}: {layout.all_tags(root)}.")
  step_dir, meta = layout.open_checkpoint(directory, tag)
  root = step_dir.parent
  versions, mesh, config = meta["versions"], meta["mesh"], meta["config"]
  master = "fp32 master" if meta["has_master"] else "no separate master (fp32 params)"
  scheduler = (config.get("scheduler") or {}).get("type", "constant lr")
  latest = layout.latest_tag(root)
  skipped = layout.incomplete_tags(root)
  incomplete = f"; INCOMPLETE, never restored: {skipped}" if skipped else ""
  lines = [
      f"checkpoint {step_dir}",
      f"  tag {step_dir.name!r}, step {meta['step']} (complete checkpoints in {root}: "
      f"{layout.all_tags(root)}; latest: {'none' if latest is None else repr(latest)}"
      f"{incomplete})",
      f"  data position: step {meta['data_position']['step']}",
      f"  ZeRO stage {meta['stage']}, precision {meta['precision']} (compute "
      f"{meta['compute_dtype']}, {master})",
      f"  mesh {mesh['description']}; written by {mesh['processes']} process(es)",
      f"  optimizer {layout.optimizer_name(config)}, scheduler {scheduler}",
      f"  written by jzero {versions['jzero']}, jax {versions['jax']}, orbax-checkpoint "
      f"{versions['orbax_checkpoint']}",
  ]
  if meta["weights16"]:
    lines.append(f"  consolidated 16-bit weights: {step_dir / layout.WEIGHTS16} "
                 f"({meta['weights16']['dtype']})")
  logical = {leaf["path"]: tuple(leaf["shape"]) for leaf in meta["leaves"]}
  rows, totals = [], {}
  for name, array in meta["arrays"].items():
    shape = tuple(array["shape"])
    nbytes = math.prod(shape) * np.dtype(array["dtype"]).itemsize
    group = name.split("/")[0]
    totals[group] = totals.get(group, 0) + nbytes
    leaf = array["leaf"]
    note = f"logical {logical[leaf]}" if leaf is not None and logical[leaf] != shape else ""
    rows.append((name, str(shape), array["dtype"], f"{nbytes:,}", note))
  header = ("array", "stored shape", "dtype", "bytes")
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
  lines.append("")
  lines.append(("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths))).rstrip())
  for row in rows:
    cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]),
             row[3].rjust(widths[3])]
    lines.append(("  " + "  ".join(cells) + ("  " + row[4] if row[4] else "")).rstrip())
  n_params = sum(math.prod(s) for s in logical.values())
  lines.append("")
  lines.append(f"  {len(logical)} weight leaves, {n_params:,} parameters")
  lines.append("  totals: " + ", ".join(f"{g} {_bytes(b)}" for g, b in totals.items()) +
               f"; all arrays {_bytes(sum(totals.values()))}")
  files = layout.recorded_files(step_dir)
  lines.append(f"  on disk: {_bytes(sum(files.values()))} in {len(files)} files, each matching the "
               f"size and {layout.CHECKSUM} checksum recorded when it was written"
               if files else "  on disk: no file list (save interrupted before jzero recorded it)")
  if meta.get("client_state"):
    lines.append(f"  client state: {json.dumps(meta['client_state'])[:200]}")
  return "\n".join(lines)
