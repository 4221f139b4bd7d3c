"""The NVMe store's contents outside a step: in a TrainState (checkpoints, logical params) and
read back from disk after a crash.

``save_checkpoint`` and ``logical_params`` read the committed slot into arrays laid out by the plan
(:func:`full_state`); ``load_checkpoint`` restores them in their real shapes (the abstract state is
the full one) and writes them into the store (:func:`absorb`), so a checkpoint moves between tiers
exactly. :func:`open_committed` reads a process's store directory from its files alone --
what a crashed run left (see :mod:`jzero.tiers.nvme_store`, "Crash consistency"). The store's layout
itself in a TrainState is :func:`with_arrays`.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.tiers import where
from jzero.tiers.host_optimizer import split_state
from jzero.tiers.nvme_store import FORMAT, MANIFEST, NVME, NvmeStoreError

__all__ = ["full_state", "absorb", "with_arrays", "open_committed"]


def full_state(plan: Any, store: Any, state: Any) -> Any:
  """``state`` with the NVMe leaves' master and optimizer state read from ``store``'s committed
  slot (laid out by the plan); ``state`` itself without a store."""
  if store is None:
    return state
  arrays = store.read()
  dtype = plan.compute_dtype
  cast = jax.jit(lambda x: x.astype(dtype))
  return with_arrays(store, state, lambda s: arrays[s.name], lambda s: cast(arrays[s.name]))


def absorb(plan: Any, store: Any, state: Any) -> Any:
  """A TrainState with real NVMe-leaf arrays (a restore) -> written to ``store`` (committed as its
  step) and replaced by placeholders."""
  if store is None:
    return state
  store.write_state(state)
  return with_arrays(store, state, lambda s: store.placeholder(s, np.float32),
                     lambda s: store.placeholder(s, plan.compute_dtype))


def with_arrays(store: Any, state: Any, get: Any, get_param: Any) -> Any:
  """``state`` with each NVMe leaf's master / optimizer node replaced by ``get(stored)``, and
  each param the state holds as a placeholder by ``get_param(its stored master or copy)``: the
  layout of ``store`` (a :class:`jzero.tiers.nvme_store.NvmeStore`) in a TrainState."""
  plan = store.plan
  by_leaf = collections.defaultdict(dict)
  for s in store.stored:
    by_leaf[s.leaf.path][s.node] = s
  in_store = lambda l: l.state_tier == NVME  # (a param's copy: its master is in the state)
  master = state.master
  if plan.has_master:
    master = plan.map(lambda l, x: get(by_leaf[l.path][-1]) if in_store(l) else x, master)
  # params on the tier (jzero.tiers.nvme_params): the stored value in the compute dtype (the
  # step's cast)
  params = plan.map(lambda l, x: get_param(by_leaf[l.path][-1])
                    if where.param_placeholder(plan, l) else x, state.params)
  node_def, nodes, flags = split_state(state.opt_state, store.params_def)
  new_nodes = []
  for k, (node, f) in enumerate(zip(nodes, flags)):
    if f:
      j = store.param_nodes.index(k)
      node = [get(by_leaf[l.path][j]) if in_store(l) else x
              for l, x in zip(plan.leaf_list(), node)]
      node = jax.tree.unflatten(store.params_def, node)
    new_nodes.append(node)
  return state._replace(params=params, master=master,
                        opt_state=jax.tree.unflatten(node_def, new_nodes))


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
