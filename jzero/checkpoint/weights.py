"""Plain weights: DeepSpeed's ``zero_to_fp32`` (consolidation) and importing weights for
fine-tuning.

:func:`consolidate` turns a training checkpoint into plain weights of logical shape -- a safetensors
file, streamed leaf by leaf so the host holds about one leaf at a time, and / or a params-only Orbax
checkpoint (which Orbax writes in one call, so that one holds every leaf). With
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` a save also writes the consolidated
weights in the model's compute dtype as a params-only Orbax checkpoint inside the checkpoint
(``weights16/``). :func:`load_weights` reads either form -- or a Hugging Face index of several
safetensors files -- into a params tree for ``engine.init(rng, params=...)``, to fine-tune under any
stage; :func:`read_weights` reads them whole into numpy.

A params-only Orbax checkpoint is a plain Orbax PyTree of the model's logical weights as nested
dicts (``ocp.PyTreeCheckpointer().restore(path)`` reads it without jzero), with jzero's description
in the PyTree's ``custom_metadata``.

**Model state.** A model with state besides its parameters (BatchNorm's statistics,
``TrainState.model_state``) converts with it: the safetensors file holds each of its arrays as
``<collection>/<path>`` (``batch_stats/bn_init/mean``) after the parameters, and the Orbax
checkpoint is Linen's variables dict, ``{"params": ..., "batch_stats": ...}`` -- what
``module.apply`` takes (NNX: ``nnx.replace_by_pure_dict(nnx.state(model, nnx.BatchStat),
restored["batch_stats"])``). Floating-point state is written in the chosen dtype, other state in
its own. :func:`load_weights` takes the parameters of either form and :func:`load_model_state`
the statistics. A safetensors file names its tensors by the '/'-joined leaf
paths of the model's parameters, as the module names them: Linen's metadata boxes
(``nn.with_logical_partitioning``) are unboxed on the way out (``.../kernel``, not
``.../kernel/value``), so the weights load into the module built with or without them.

**Loading by shard.** :func:`load_weights` never reads the model into one process: it places every
leaf straight into the engine's plan (``jax.make_array_from_callback`` with the leaf's param
sharding), and the callback reads only the block a device of this process holds, through
safetensors' slice API, from a file mapped only while that leaf is read. Under ZeRO-3 each of N
processes so holds about 1/N of the params, plus one leaf in flight; replicated leaves (stages
0-2, persistent ZeRO-3 leaves) are read whole by every process, as they are held whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from jzero.checkpoint import layout
from jzero.checkpoint.optax_import import PYTREE_METADATA, pytree_items, step_folder
from jzero.checkpoint.restore import _root_cause
from jzero.checkpoint.save import weights_json
from jzero.errors import CheckpointError
from jzero.sharding.plan import Plan, flatten_paths, path_str
from jzero.config.blocks import DTYPES

__all__ = ["ConsolidateReport", "consolidate", "read_weights", "load_weights", "load_model_state"]

PyTree = Any
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32",
                       "uint32": "U32", "int64": "I64"}
_MODEL_STATE = "model_state/"  # the stored arrays of TrainState.model_state
_PARAMS = "params/"  # an Orbax variables dict's parameters
_WRITE_CHUNK_BYTES = 1 << 20
INDEX_FILE = "model.safetensors.index.json"  # a Hugging Face model directory's names
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class ConsolidateReport:
  """What :func:`consolidate` wrote.

  Attributes:
    tag: the checkpoint converted.
    step: the optimizer step it holds.
    dtype: the dtype written.
    leaves: number of weight leaves.
    total_bytes: bytes of all weights in ``dtype``.
    largest_leaf_bytes: bytes of the largest leaf in ``dtype``.
    outputs: the files / directories written.
    model_state: the model state's arrays written beside the weights, by name
      (``batch_stats/...``; empty for a model without state).
  """

  tag: str
  step: int
  dtype: str
  leaves: int
  total_bytes: int
  largest_leaf_bytes: int
  outputs: tuple[str, ...]
  model_state: tuple[str, ...] = ()


def _stored_leaves(meta: dict) -> list[tuple[str, tuple[int, ...], str]]:
  """(the module's name, logical shape, stored array name) of the weights' truth, in plan order.
  Checkpoints before the names were recorded give the plan path."""
  group = "master" if meta["has_master"] else "params"
  return [(leaf.get("name", leaf["path"]), tuple(leaf["shape"]), f"{group}/{leaf['path']}")
          for leaf in meta["leaves"]]


def _stored_state(meta: dict) -> list[tuple[str, tuple[int, ...], str]]:
  """(``<collection>/<path>``, shape, stored array name) of the model state's arrays."""
  return [(name[len(_MODEL_STATE):], tuple(a["shape"]), name)
          for name, a in meta["arrays"].items() if name.startswith(_MODEL_STATE)]


def _read_leaves(step_dir: Path, entries: list[tuple[str, tuple[int, ...], str]]
                 ) -> Iterator[tuple[str, np.ndarray]]:
  """(path, logical-shape view of the stored array) of each (path, logical shape, stored name)
  entry, one at a time, read as numpy.

  The stored array (in the saving plan's layout, possibly padded) is read whole, its logical
  region sliced out as a view and cast chunk by chunk when written, so about one stored leaf is
  alive at a time.
  """
  handler = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  for path, shape, name in entries:
    try:
      args = ocp.args.PyTreeRestore(
          item=layout.nest({name: 0}), partial_restore=True,
          restore_args=layout.nest({name: ocp.RestoreArgs(restore_type=np.ndarray)}))
      stored = flatten_paths(handler.restore(step_dir / "state", args=args))[name]
    except Exception as e:
      raise CheckpointError(f"checkpoint {step_dir}: array {name} cannot be read: "
                            f"{_root_cause(e)}") from e
    yield path, stored[tuple(slice(0, s) for s in shape)]


def _write_chunks(f, x: np.ndarray, dtype: np.dtype) -> None:
  """Writes ``x`` cast to ``dtype`` in C order, about _WRITE_CHUNK_BYTES at a time (a contiguous
  array already in ``dtype`` is written without a copy)."""
  x = x.reshape(1) if x.ndim == 0 else x
  rows = max(1, _WRITE_CHUNK_BYTES // max(1, math.prod(x.shape[1:]) * dtype.itemsize))
  for i in range(0, x.shape[0], rows):
    f.write(np.ascontiguousarray(x[i:i + rows], dtype=dtype).reshape(-1).view(np.uint8))


def _safetensors_header(shapes: dict[str, tuple[int, ...]], dtype: np.dtype,
                        metadata: dict[str, str], dtypes: dict[str, np.dtype] | None = None
                        ) -> bytes:
  """The 8-byte length + JSON header of a safetensors file (tensors stored in dict order), each
  tensor in ``dtype`` unless ``dtypes`` names another."""
  header: dict[str, Any] = {"__metadata__": metadata}
  offset = 0
  for name, shape in shapes.items():
    stored = (dtypes or {}).get(name, dtype)
    size = math.prod(shape) * stored.itemsize
    header[name] = {"dtype": _SAFETENSORS_DTYPES[str(stored)], "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text


def consolidate(directory: str | os.PathLike, *, tag: str | int | None = None,
                safetensors: str | os.PathLike | None = None,
                orbax: str | os.PathLike | None = None, dtype: str = "fp32") -> ConsolidateReport:
  """Writes a training checkpoint's weights as plain logical-shape weights (``zero_to_fp32``).

  Reads the fp32 truth (master in mixed precision, params in fp32) one leaf at a time, and the
  model state (BatchNorm's statistics), written as the module docstring says. The safetensors
  file is streamed: its header is computed from the checkpoint's JSON, then each leaf
  is read, cut to its logical shape, cast and appended, so peak host memory stays near the largest
  stored leaf, not the model. The params-only Orbax checkpoint is written by Orbax in one call, so
  it holds all leaves (in ``dtype``) at once. Both are written to a temporary name and renamed.

  Args:
    directory: a training checkpoint directory (or one checkpoint's directory); may be relative.
    tag: the checkpoint (default: ``latest``).
    safetensors: path of the safetensors file to write (tensor names: '/'-joined parameter paths
      as the module names them, see the module docstring).
    orbax: directory of the params-only Orbax checkpoint to write.
    dtype: "fp32", "bf16" or "fp16".
  """
  if dtype not in DTYPES:
    raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
  if safetensors is None and orbax is None:
    raise CheckpointError("nothing to write: give a safetensors file and / or an Orbax directory.")
  for out in (safetensors, orbax):
    if out is not None and Path(out).exists():
      raise CheckpointError(f"{out} already exists; remove it or choose another output path.")
  step_dir, meta = layout.open_checkpoint(directory, tag)
  out_dtype = DTYPES[dtype]
  weights, state = _stored_leaves(meta), _stored_state(meta)
  shapes = {path: shape for path, shape, _ in weights}
  sizes = [math.prod(s) * out_dtype.itemsize for s in shapes.values()]
  stored_dtype = lambda name: np.dtype(meta["arrays"][name]["dtype"])
  dtypes = {path: out_dtype if np.issubdtype(stored_dtype(name), np.floating) else
            stored_dtype(name) for path, _, name in state}
  dtypes.update((path, out_dtype) for path in shapes)
  tensors = {path: (shape, dtypes[path]) for path, shape, _ in [*weights, *state]}
  collected: dict[str, np.ndarray] = {}
  outputs = []
  leaves = _read_leaves(step_dir, [*weights, *state])
  if safetensors is not None:
    target = Path(safetensors)
    tmp = target.with_name(target.name + ".tmp")
    description = {"format": "flax", "jzero_step": str(meta["step"]), "jzero_source": str(step_dir)}
    if state:
      description["jzero_model_state"] = ",".join(sorted({p.split("/")[0] for p, _, _ in state}))
    try:
      with open(tmp, "wb") as f:
        f.write(_safetensors_header({p: s for p, (s, _) in tensors.items()}, out_dtype,
                                    description, dtypes))
        for path, x in leaves:
          _write_chunks(f, x, dtypes[path])
          if orbax is not None:
            collected[path] = np.array(x, dtypes[path])
    except BaseException:
      tmp.unlink(missing_ok=True)
      raise
    os.replace(tmp, target)
    outputs.append(str(target))
  if orbax is not None:
    if not collected:
      collected = {path: np.array(x, dtypes[path]) for path, x in leaves}
    if state:  # Linen's variables dict: {"params": ..., "batch_stats": ...}
      collected = {(_PARAMS + p if p in shapes else p): x for p, x in collected.items()}
      tensors = {(_PARAMS + p if p in shapes else p): t for p, t in tensors.items()}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
        Path(orbax).absolute(), args=ocp.args.PyTreeSave(layout.nest(collected), custom_metadata={
            "jzero": weights_json(tensors, meta["step"], str(step_dir))}))
    outputs.append(str(orbax))
  return ConsolidateReport(tag=step_dir.name, step=meta["step"], dtype=str(out_dtype),
                           leaves=len(shapes), total_bytes=sum(sizes),
                           largest_leaf_bytes=max(sizes), outputs=tuple(outputs),
                           model_state=tuple(path for path, _, _ in state))


# -- reading plain weights ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Stored:
  """Where one safetensors tensor lies: its file and its shape (from the file's header)."""

  file: Path
  shape: tuple[int, ...]


@contextlib.contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
  """``safe_open`` of ``file`` (memory-mapped until the block ends), its errors as
  :class:`CheckpointError` naming the file."""
  from safetensors import SafetensorError, safe_open
  def unreadable(e: Exception) -> CheckpointError:
    return CheckpointError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}")

  try:
    opened = safe_open(str(file), framework="numpy")  # reads and checks the header
  except (SafetensorError, OSError, ValueError) as e:
    raise unreadable(e) from None
  with opened as f:
    try:
      yield f
    except (SafetensorError, OSError) as e:  # a tensor's data
      raise unreadable(e) from None


def _header(file: Path) -> dict[str, tuple[int, ...]]:
  """{tensor name: shape} of a safetensors file, read from its header alone."""
  with _open_safetensors(file) as f:
    return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _index_tensors(index: Path) -> dict[str, _Stored]:
  """The tensors of a Hugging Face index (``model.safetensors.index.json``): its ``weight_map``
  names each tensor's file, relative to the index's directory; every file must hold its tensors."""
  try:
    weight_map = json.loads(index.read_text())["weight_map"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
      raise TypeError("its names and files must be strings")
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(
        f"{index} is not a safetensors index: expected JSON with a \"weight_map\" of {{tensor "
        f"name: file name}}, as Hugging Face's {INDEX_FILE} ({type(e).__name__}: {e}).") from None
  by_file: dict[str, list[str]] = {}
  for name, file in weight_map.items():
    by_file.setdefault(file, []).append(name)
  tensors = {}
  for file, names in by_file.items():
    path = index.parent / file
    if not path.is_file():
      raise CheckpointError(f"{index} places {len(names)} tensors (e.g. {names[0]!r}) in {path}, "
                            f"which does not exist: copy the index with all its files.")
    header = _header(path)
    absent = [n for n in names if n not in header]
    if absent:
      raise CheckpointError(f"{index} places tensors {absent[:5]} in {path}, which does not hold "
                            f"them: the index and its files are from different models.")
    tensors.update((n, _Stored(path, header[n])) for n in names)
  return {name: tensors[name] for name in weight_map}


def _source(path: str | os.PathLike) -> tuple[str, Path, str | None]:
  """(kind, path, subtree) of the weights at ``path``: ("safetensors", a file), ("index", an
  index file) or ("orbax", a PyTree item, and the key of the params within it or None) -- a
  safetensors file, an index, a params-only Orbax checkpoint, a Hugging Face model directory (its
  index, else its one ``model.safetensors``), or a plain run's ``CheckpointManager`` directory or
  step folder (:func:`_manager_params`)."""
  if not Path(path).exists():
    raise CheckpointError(f"weights {str(path)!r} do not exist.")
  path = Path(path).absolute()
  if path.is_file():
    return ("index" if path.name.endswith(".index.json") else "safetensors"), path, None
  if (path / PYTREE_METADATA).is_file():
    return "orbax", path, None
  if (path / INDEX_FILE).is_file():
    return "index", path / INDEX_FILE, None
  if (path / SINGLE_FILE).is_file():
    return "safetensors", path / SINGLE_FILE, None
  if (path / layout.LATEST_FILE).exists() or (path / layout.FILES_FILE).exists():
    raise CheckpointError(f"{path} is a jzero training checkpoint, not plain weights: use "
                          f"load_checkpoint(..., params_only=True), or convert it first.")
  try:
    return ("orbax", *_manager_params(path))
  except CheckpointError as e:
    raise CheckpointError(
        f"{path} is neither a params-only Orbax checkpoint (no {PYTREE_METADATA}) nor a Hugging "
        f"Face model directory (no {INDEX_FILE} or {SINGLE_FILE}) nor a CheckpointManager's: "
        f"{e}") from None


def _manager_params(path: Path) -> tuple[Path, str | None]:
  """The params of a ``CheckpointManager`` directory (its latest step) or step folder: its
  ``params`` item, or the ``params`` entry of its one PyTree item (flax's TrainState)."""
  folder, _ = step_folder(path)
  items = pytree_items(folder)
  if "params" in items:
    return items["params"], None
  if len(items) == 1:
    item = next(iter(items.values()))
    tree = _metadata_tree(item)
    if isinstance(tree, dict) and "params" in tree:
      return item, "params"
    raise CheckpointError(f"its one item {item.name!r} holds "
                          f"{sorted(tree) if isinstance(tree, dict) else type(tree).__name__}, "
                          f"no params.")
  raise CheckpointError(f"the step folder {folder} holds the items {sorted(items)}, none of them "
                        f"params.")


def _safetensors(kind: str, path: Path) -> dict[str, _Stored]:
  """The tensors of a safetensors file or index, from the headers alone."""
  if kind == "index":
    return _index_tensors(path)
  return {name: _Stored(path, shape) for name, shape in _header(path).items()}


def _metadata_tree(path: Path) -> PyTree:
  """The structure of an Orbax PyTree item, from its metadata."""
  try:
    return ocp.PyTreeCheckpointHandler().metadata(path).tree
  except Exception as e:
    raise CheckpointError(f"{path}: the Orbax checkpoint cannot be read: {type(e).__name__}: "
                          f"{e}") from e


def _orbax_shapes(path: Path, subtree: str | None) -> dict[str, tuple[int, ...]]:
  """{'/'-joined leaf path: shape} of a params-only Orbax checkpoint (or of its ``subtree``),
  from its metadata."""
  structure = _metadata_tree(path)
  structure = structure if subtree is None else structure[subtree]
  return {name: tuple(m.shape) for name, m in flatten_paths(structure).items()}


def _restore_orbax(path: Path, subtree: str | None, args: Any) -> dict[str, Any]:
  """An Orbax PyTree (or its ``subtree``) restored with ``args(leaf path) -> RestoreArgs``,
  flattened by leaf path."""
  handler = ocp.PyTreeCheckpointHandler()
  structure = _metadata_tree(path)
  if subtree is not None:
    structure = {subtree: structure[subtree]}
  restore_args = jax.tree_util.tree_map_with_path(
      lambda p, _: args(path_str(p[1:] if subtree is not None else p)), structure)
  try:
    tree = ocp.Checkpointer(handler).restore(path, args=ocp.args.PyTreeRestore(
        item=structure, restore_args=restore_args, partial_restore=subtree is not None))
  except Exception as e:
    raise CheckpointError(f"{path}: the Orbax checkpoint cannot be read: {type(e).__name__}: "
                          f"{e}") from e
  return flatten_paths(tree if subtree is None else tree[subtree])


def read_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Plain weights, whole, as ``{'/'-joined leaf path: numpy array}``.

  ``path`` is a safetensors file, a Hugging Face index of several (``model.safetensors.index.json``,
  or the directory holding it or one ``model.safetensors``), or a params-only Orbax checkpoint
  (from :func:`consolidate`, a step's ``weights16/``, or any Orbax PyTree of arrays). Only data is
  read: safetensors' JSON headers and raw tensors, Orbax's JSON metadata and zarr arrays. Every
  tensor is read into this process; :func:`load_weights` reads only what its devices hold.
  """
  kind, path, subtree = _source(path)
  if kind == "orbax":
    return _restore_orbax(path, subtree, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
  tensors = _safetensors(kind, path)
  out = {}
  for file in dict.fromkeys(t.file for t in tensors.values()):
    with _open_safetensors(file) as f:
      out.update((n, f.get_tensor(n)) for n, t in tensors.items() if t.file == file)
  return {name: out[name] for name in tensors}


def _read_region(f: Any, name: str, region: tuple[slice, ...], shape: tuple[int, ...]
                 ) -> np.ndarray:
  """``region`` (slices within ``shape``) of tensor ``name`` of the open file ``f``, read through
  safetensors' slice API: the only read of tensor data :func:`load_weights` makes."""
  if all(s.start == 0 and s.stop == n for s, n in zip(region, shape)):
    return f.get_tensor(name)
  return f.get_slice(name)[region]


def _read_block(f: Any, name: str, shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...],
                dtype: Any) -> np.ndarray:
  """The block ``bounds`` ((start, stop) per dimension of the plan's global shape) of the stored
  tensor ``name`` of logical ``shape``, in ``dtype``: the part within ``shape`` read from the file,
  the rest -- a partitioned leaf's padding at the end of its shard dimension -- zeros."""
  region = tuple(slice(min(a, n), min(b, n)) for (a, b), n in zip(bounds, shape))
  stored = tuple(s.stop - s.start for s in region)
  wanted = tuple(b - a for a, b in bounds)
  part = _read_region(f, name, region, shape) if all(stored) else None
  if stored == wanted:
    return np.asarray(part, dtype)
  block = np.zeros(wanted, dtype)
  if part is not None:
    block[tuple(slice(0, n) for n in stored)] = part
  return block


def _placed(tensor: _Stored, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
  """Tensor ``name`` as a global array of ``target``'s shape, dtype and sharding: each block this
  process's devices hold read alone (once, when several of them hold it), with the file mapped only
  while this leaf is read (its pages leave the resident set when it closes)."""
  blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
  with _open_safetensors(tensor.file) as f:
    def block(index: tuple[slice, ...]) -> np.ndarray:
      bounds = tuple(s.indices(n)[:2] for s, n in zip(index, target.shape))
      if bounds not in blocks:
        blocks[bounds] = _read_block(f, name, tensor.shape, bounds, target.dtype)
      return blocks[bounds]

    return jax.make_array_from_callback(target.shape, target.sharding, block)


def _parameters(stored: dict[str, tuple[int, ...]], params: PyTree, model_state: dict
                ) -> tuple[dict[str, tuple[int, ...]], str]:
  """(the parameters' entries of stored weights by their names within the parameters, the prefix
  their stored names carry): entries of the model's state collections (``batch_stats/...``) are
  not parameters, and an Orbax variables dict nests the parameters under ``params/``."""
  found = {n: s for n, s in stored.items() if n.split("/", 1)[0] not in model_state}
  if found and all(n.startswith(_PARAMS) for n in found) and not any(
      p.startswith(_PARAMS) for p in flatten_paths(params)):
    return {n[len(_PARAMS):]: s for n, s in found.items()}, _PARAMS
  return found, ""


def load_model_state(model: Any, path: str | os.PathLike, *, sample_batch: Any = None
                     ) -> dict[str, PyTree]:
  """The model state (BatchNorm's statistics) of plain weights that hold it -- what ``jzero
  convert`` writes for such a model (module docstring) -- as numpy arrays for
  ``engine.init(rng, params=engine.load_weights(path), model_state=...)``
  (:meth:`jzero.Engine.load_model_state`); ``{}`` for a model without state. ``model``: the
  model (:class:`jzero.modeling.model_adapter.ModelAdapter`).

  Raises:
    CheckpointError: the weights lack the model's state (converted from another model, or
      written by hand for the parameters only) or hold it in other shapes.
  """
  want = flatten_paths(model.abstract_model_state(jax.random.key(0), sample_batch))
  if not want:
    return {}
  kind, path, _ = _source(path)  # an Orbax item's state sits beside its params, at its top level
  tensors = _safetensors(kind, path) if kind != "orbax" else {}
  stored = (_orbax_shapes(path, None) if kind == "orbax"
            else {n: t.shape for n, t in tensors.items()})
  missing = sorted(set(want) - set(stored))
  if missing:
    raise CheckpointError(
        f"weights {path} do not hold the model's state {missing[:5]} (its BatchNorm statistics, "
        f"named '<collection>/<path>'): they are another model's, or its parameters alone. Start "
        f"the statistics fresh: engine.init(rng, params=...) without model_state.")
  bad = [f"{n}: {stored[n]} in the weights, {tuple(x.shape)} in the model" for n, x in want.items()
         if tuple(stored[n]) != tuple(x.shape)]
  if bad:
    raise CheckpointError(f"weights {path}: the model state does not fit the model's shapes: "
                          f"{'; '.join(bad[:5])}.")
  if kind == "orbax":
    read = flatten_paths(ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
        path, args=ocp.args.PyTreeRestore(
            item=layout.nest(dict.fromkeys(want, 0)), partial_restore=True,
            restore_args=layout.nest({n: ocp.RestoreArgs(restore_type=np.ndarray)
                                      for n in want}))))
  else:
    read = {}
    for n in want:
      with _open_safetensors(tensors[n].file) as f:
        read[n] = f.get_tensor(n)
  return layout.nest({n: np.asarray(read[n], want[n].dtype) for n in want})


def load_weights(plan: Plan, model: Any, path: str | os.PathLike, *,
                 sample_batch: Any = None) -> PyTree:
  """Plain weights as a params tree for ``engine.init(rng, params=...)`` (fine-tuning, any stage;
  :meth:`jzero.Engine.load_weights`), each process reading only what its devices hold.

  Checks every leaf of the model is present with its logical shape (from the files' headers /
  metadata alone; a model state written beside the parameters is left to
  :func:`load_model_state`), then places each leaf as ``plan`` lays out its compute param: a global
  ``jax.Array`` in ``plan.param_spec``'s sharding, cast to the model's parameter dtype. A
  partitioned leaf (ZeRO-3) is built block by block from safetensors' slice API, each process
  reading only the blocks its devices hold, and comes padded to the plan's shape with zeros (as
  ``engine.init`` accepts it); a replicated leaf (stages 0-2, ZeRO-3's persistent leaves) is read
  whole by each process. So a process's host memory peaks near its share of the params plus one
  leaf, not the model (``bench/weights_rss.py``). An Orbax source is read by Orbax into the same
  shardings, each process reading its own blocks too.

  Args:
    plan: the plan the weights are placed by.
    model: the model they are for (:class:`jzero.modeling.model_adapter.ModelAdapter`).
    path: a safetensors file, a Hugging Face index of several (``model.safetensors.index.json``,
      or its directory), or a params-only Orbax checkpoint (see :func:`read_weights`).
    sample_batch: for Linen models, as in ``engine.init``.

  Raises:
    CheckpointError: unreadable weights, or weights of another model (naming the leaves) --
      before any tensor is read.
  """
  kind, path, subtree = _source(path)
  tensors = _safetensors(kind, path) if kind != "orbax" else {}
  stored = (_orbax_shapes(path, subtree) if kind == "orbax"
            else {n: t.shape for n, t in tensors.items()})
  adapter, model = model, model.abstract_params(jax.random.key(0), sample_batch)
  stored, prefix = _parameters(stored, model, adapter.abstract_model_state(
      jax.random.key(0), sample_batch))
  # by the module's names; a file written with the boxes' names (before they were unboxed) too
  names = layout.leaf_names(model, stored)
  want = {names[p]: x for p, x in flatten_paths(model).items()}
  missing, unexpected = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
  if missing or unexpected:
    raise CheckpointError(f"weights {path} are for another model: the model's leaves {missing[:5]} "
                          f"are not in them, and their leaves {unexpected[:5]} are not in the "
                          f"model.")
  bad = [f"{n}: {stored[n]} in the weights, {tuple(want[n].shape)} in the model"
         for n in want if stored[n] != tuple(want[n].shape)]
  if bad:
    raise CheckpointError(f"weights {path} do not fit the model's shapes: {'; '.join(bad[:5])}.")
  leaves = {leaf.path: leaf for leaf in plan.leaf_list()}
  targets = {names[p]: jax.ShapeDtypeStruct(
      plan.param_shape(leaves[p]), x.dtype, sharding=plan.sharding(plan.param_spec(leaves[p])))
             for p, x in flatten_paths(model).items()}
  if kind == "orbax":
    placed = _restore_orbax(path, subtree, lambda n: ocp.ArrayRestoreArgs(
        sharding=targets[n[len(prefix):]].sharding, global_shape=targets[n[len(prefix):]].shape,
        dtype=targets[n[len(prefix):]].dtype, strict=False) if n.startswith(prefix) and
        n[len(prefix):] in targets else ocp.RestoreArgs(restore_type=np.ndarray))
    placed = {n[len(prefix):]: x for n, x in placed.items()}  # the plan's padding: zeros
  else:
    placed = {n: _placed(tensors[n], n, target) for n, target in targets.items()}
  return jax.tree.unflatten(jax.tree.structure(model), [placed[n] for n in want])
