"""The NVMe store's contents outside a step: in a TrainState (checkpoints, logical params) and
read back from disk after a crash.

``save_checkpoint`` and ``logical_params`` read the committed slot into arrays laid out by the plan
(:func:`full_state`); ``load_checkpoint`` restores them in their real shapes (the abstract state is
the full one) and writes them into the store (:func:`absorb`), so a checkpoint moves between tiers
exactly. :func:`open_committed` reads a process's store directory from its files alone --
what a crashed run left (see :mod:`jzero.tiers.nvme_store`, "Crash consistency"). The store's layout
itself is :meth:`jzero.tiers.nvme_store.NvmeStore.with_arrays`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.tiers.nvme_store import FORMAT, MANIFEST, NvmeStoreError

__all__ = ["full_state", "absorb", "open_committed"]


def full_state(plan: Any, store: Any, state: Any) -> Any:
  """``state`` with the NVMe leaves' master and optimizer state read from ``store``'s committed
  slot (laid out by the plan); ``state`` itself without a store."""
  if store is None:
    return state
  arrays = store.read()
  dtype = plan.compute_dtype
  cast = jax.jit(lambda x: x.astype(dtype))
  return store.with_arrays(state, lambda s: arrays[s.name], lambda s: cast(arrays[s.name]))


def absorb(plan: Any, store: Any, state: Any) -> Any:
  """A TrainState with real NVMe-leaf arrays (a restore) -> written to ``store`` (committed as its
  step) and replaced by placeholders."""
  if store is None:
    return state
  store.write_state(state)
  return store.with_arrays(state, lambda s: store.placeholder(s, np.float32),
                           lambda s: store.placeholder(s, plan.compute_dtype))


def open_committed(directory: str | os.PathLike) -> tuple[int, dict[str, np.ndarray], dict]:
  """(committed step, stored name -> array of shape (local devices, *partition), manifest) of one
  process's store directory (``.../process_<i>``), read from its files alone.

  Raises:
    NvmeStoreError: no manifest (the process stopped before its first step was committed), or
      the slot it names lacks a file.
  """
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  directory = Path(directory)
  manifest = directory / MANIFEST
  if not manifest.exists():
    raise NvmeStoreError(
        f"{directory} has no {MANIFEST}: the process stopped before its first step was committed, "
        f"so this store holds no consistent optimizer state. Nothing to resume from here; restore "
        f"the last checkpoint (engine.load_checkpoint) instead.")
  doc = json.loads(manifest.read_text())
  if doc.get("format") != FORMAT:
    raise NvmeStoreError(f"{manifest} is not a jzero NVMe manifest.")
  slot = directory / f"slot_{doc['slot']}"
  out = {}
  for group in doc["groups"]:
    path = slot / group["name"]
    missing = [r for r in range(group["shape"][0]) if not (path / "c" / str(r) / "0").is_file()]
    if missing:
      raise NvmeStoreError(
          f"{path}: the files of device rows {missing} are missing, though {MANIFEST} names step "
          f"{doc['step']} in slot {doc['slot']} as committed; the store is damaged. Restore the "
          f"last checkpoint (engine.load_checkpoint) instead of resuming from it.")
    rows = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}},
                   open=True).result().read().result()
    for name, m in group["members"].items():
      part = rows[:, m["offset"]:m["offset"] + m["numel"]]
      out[name] = part.reshape((rows.shape[0], *m["partition"]))
  return int(doc["step"]), out, doc
