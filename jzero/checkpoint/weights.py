"""Plain weights: DeepSpeed's ``zero_to_fp32`` (consolidation) and importing weights for
fine-tuning.

:func:`consolidate` turns a training checkpoint into plain weights of logical shape -- a safetensors
file, streamed leaf by leaf so the host holds about one leaf at a time, and / or a params-only Orbax
checkpoint (which Orbax writes in one call, so that one holds every leaf). With
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` a save also writes the consolidated
weights in the model's compute dtype as a params-only Orbax checkpoint inside the checkpoint
(``weights16/``). :func:`load_weights` reads either form back into a params tree for
``engine.init(rng, params=...)``, to fine-tune under any stage.

A params-only Orbax checkpoint is a plain Orbax PyTree of the model's logical weights as nested
dicts (``ocp.PyTreeCheckpointer().restore(path)`` reads it without jzero), with jzero's description
in the PyTree's ``custom_metadata``. A safetensors file names its tensors by the '/'-joined leaf
paths of the model's parameters, as the module names them: Linen's metadata boxes
(``nn.with_logical_partitioning``) are unboxed on the way out (``.../kernel``, not
``.../kernel/value``), so the weights load into the module built with or without them.
"""

from __future__ import annotations

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
from jzero.checkpoint.restore import _root_cause
from jzero.checkpoint.save import weights_json
from jzero.errors import CheckpointError
from jzero.sharding.plan import flatten_paths
from jzero.train.precision import DTYPES

__all__ = ["ConsolidateReport", "consolidate", "read_weights", "load_weights"]

PyTree = Any
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_WRITE_CHUNK_BYTES = 1 << 20


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
  """

  tag: str
  step: int
  dtype: str
  leaves: int
  total_bytes: int
  largest_leaf_bytes: int
  outputs: tuple[str, ...]


def _stored_leaves(meta: dict) -> list[tuple[str, tuple[int, ...], str]]:
  """(the module's name, logical shape, stored array name) of the weights' truth, in plan order.
  Checkpoints before the names were recorded give the plan path."""
  group = "master" if meta["has_master"] else "params"
  return [(leaf.get("name", leaf["path"]), tuple(leaf["shape"]), f"{group}/{leaf['path']}")
          for leaf in meta["leaves"]]


def _read_leaves(step_dir: Path, meta: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(path, logical-shape view of the stored fp32 array) one leaf at a time, read as numpy.

  The stored array (in the saving plan's layout, possibly padded) is read whole, its logical
  region sliced out as a view and cast chunk by chunk when written, so about one stored leaf is
  alive at a time.
  """
  handler = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  for path, shape, name in _stored_leaves(meta):
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
                        metadata: dict[str, str]) -> bytes:
  """The 8-byte length + JSON header of a safetensors file (tensors stored in dict order)."""
  header: dict[str, Any] = {"__metadata__": metadata}
  offset = 0
  for name, shape in shapes.items():
    size = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": _SAFETENSORS_DTYPES[str(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text


def consolidate(directory: str | os.PathLike, *, tag: str | int | None = None,
                safetensors: str | os.PathLike | None = None,
                orbax: str | os.PathLike | None = None, dtype: str = "fp32") -> ConsolidateReport:
  """Writes a training checkpoint's weights as plain logical-shape weights (``zero_to_fp32``).

  Reads the fp32 truth (master in mixed precision, params in fp32) one leaf at a time. The
  safetensors file is streamed: its header is computed from the checkpoint's JSON, then each leaf
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
  shapes = {path: shape for path, shape, _ in _stored_leaves(meta)}
  sizes = [math.prod(s) * out_dtype.itemsize for s in shapes.values()]
  collected: dict[str, np.ndarray] = {}
  outputs = []
  leaves = _read_leaves(step_dir, meta)
  if safetensors is not None:
    target = Path(safetensors)
    tmp = target.with_name(target.name + ".tmp")
    description = {"format": "flax", "jzero_step": str(meta["step"]), "jzero_source": str(step_dir)}
    try:
      with open(tmp, "wb") as f:
        f.write(_safetensors_header(shapes, out_dtype, description))
        for path, x in leaves:
          _write_chunks(f, x, out_dtype)
          if orbax is not None:
            collected[path] = np.array(x, out_dtype)
    except BaseException:
      tmp.unlink(missing_ok=True)
      raise
    os.replace(tmp, target)
    outputs.append(str(target))
  if orbax is not None:
    if not collected:
      collected = {path: np.array(x, out_dtype) for path, x in leaves}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
        Path(orbax).absolute(), args=ocp.args.PyTreeSave(layout.nest(collected), custom_metadata={
            "jzero": weights_json({p: (s, out_dtype) for p, s in shapes.items()}, meta["step"],
                                   str(step_dir))}))
    outputs.append(str(orbax))
  return ConsolidateReport(tag=step_dir.name, step=meta["step"], dtype=str(out_dtype), leaves=len(shapes),
                           total_bytes=sum(sizes), largest_leaf_bytes=max(sizes),
                           outputs=tuple(outputs))


def read_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Plain weights as ``{'/'-joined leaf path: numpy array}``.

  ``path`` is a safetensors file or a params-only Orbax checkpoint (from :func:`consolidate`, a
  step's ``weights16/``, or any Orbax PyTree of arrays). Only data is read: safetensors' JSON
  header and raw tensors, Orbax's JSON metadata and zarr arrays.
  """
  if not Path(path).exists():
    raise CheckpointError(f"weights {str(path)!r} do not exist.")
  path = Path(path).absolute()
  if path.is_file():
    from safetensors import SafetensorError, safe_open
    try:
      with safe_open(str(path), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
  if not (path / "_METADATA").is_file():
    hint = ("; for a training checkpoint use load_checkpoint(..., params_only=True) or "
            "convert it first" if (path / layout.LATEST_FILE).exists() or (path / layout.FILES_FILE).exists() else "")
    raise CheckpointError(f"{path} is not a params-only Orbax checkpoint (no _METADATA){hint}.")
  handler = ocp.PyTreeCheckpointHandler()
  try:
    structure = handler.metadata(path).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), structure)
    tree = ocp.Checkpointer(handler).restore(path, args=ocp.args.PyTreeRestore(
        item=structure, restore_args=args))
  except Exception as e:
    raise CheckpointError(f"{path}: the Orbax checkpoint cannot be read: {type(e).__name__}: "
                          f"{e}") from e
  return flatten_paths(tree)


def load_weights(engine: Any, path: str | os.PathLike, *, sample_batch: Any = None) -> PyTree:
  """Plain weights as a params tree for ``engine.init(rng, params=...)`` (fine-tuning, any stage).

  Checks every leaf of the model is present with its logical shape, and casts to the model's
  parameter dtypes.

  Args:
    engine: the engine whose model the weights are for.
    path: a safetensors file or a params-only Orbax checkpoint (see :func:`read_weights`).
    sample_batch: for Linen models, as in ``engine.init``.

  Raises:
    CheckpointError: unreadable weights, or weights of another model (naming the leaves).
  """
  flat = read_weights(path)
  model = engine.model.abstract_params(jax.random.key(0), sample_batch)
  # by the module's names; a file written with the boxes' names (before they were unboxed) too
  names = {path: (path if path in flat and name not in flat else name)
           for path, name in layout.module_names(model).items()}
  want = {names[path]: x for path, x in flatten_paths(model).items()}
  missing, unexpected = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
  if missing or unexpected:
    raise CheckpointError(f"weights {path} are for another model: the model's leaves {missing[:5]} "
                          f"are not in them, and their leaves {unexpected[:5]} are not in the "
                          f"model.")
  bad = [f"{p}: {tuple(flat[p].shape)} in the weights, {tuple(want[p].shape)} in the model"
         for p in want if tuple(flat[p].shape) != tuple(want[p].shape)]
  if bad:
    raise CheckpointError(f"weights {path} do not fit the model's shapes: {'; '.join(bad[:5])}.")
  leaves = [np.asarray(flat[p], want[p].dtype) for p in want]
  return jax.tree.unflatten(jax.tree.structure(model), leaves)
