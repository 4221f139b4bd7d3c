"""Checkpoints: sharded asynchronous save / restore of the train state, resharding, conversion.

**Saving.** :func:`save_checkpoint` writes the complete :class:`~jzero.engine.TrainState` -- compute
params, fp32 master, optimizer state, step, skipped steps, loss-scaler state and training RNG -- as
it lies on the devices, in the plan's layout, with Orbax's ``CheckpointManager``. Each process
writes only the shards it holds (one replica of each); the call returns once they are copied to
host memory and the files are written by a background thread while training goes on. Orbax writes
a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it on commit, so a save killed part-way
leaves only a temporary directory, which the next :class:`Checkpointer` on that directory removes.
After the commit jzero (the primary process, still in the background) records the size of every
file of the step (``jzero_files.json``), then moves ``latest`` to it (write + rename), then deletes
the steps beyond ``keep``. ``latest`` therefore only ever names a complete, verified step.
With several processes, waiting for a save (:func:`wait_until_finished`, or the next save) ends
with a barrier, so no process reads ``latest`` before the primary has moved it.

Beside the arrays goes one JSON document: format version, jzero / JAX / Orbax versions, the step and
the data position (the number of optimizer steps taken: batches are a pure function of the step,
see :mod:`jzero.data`), the stage, precision, mesh, the resolved DeepSpeed config, every plan leaf
(path, logical shape, how it was laid out) and every stored array (name, stored shape, dtype, plan
leaf). Nothing in a checkpoint is executable: JSON, and Orbax's OCDBT / zarr array store, whose
metadata is JSON too (no pickle anywhere).

**Restoring and resharding.** :func:`load_checkpoint` rebuilds a TrainState for *this* engine: any
stage (0-3), device count, mesh or precision. A partitioned leaf is zero-padded at the end of its
shard dimension, and the padding stays zero through training, so a leaf laid out for one plan
becomes the leaf of another by taking its logical region and zero-padding for the new plan. Orbax
does exactly that per dimension when asked for a different global shape (``ArrayRestoreArgs(
strict=False)``: it reads the intersection of the stored and requested regions into zeros), and it
reads every array straight into its target sharding, so each device reads only its own shard and no
device ever holds a full copy. The checkpoint's *truth* -- the fp32 master in mixed precision, the
fp32 params in fp32 training -- becomes the new truth; in mixed precision the compute params are
cast from it as the train step would. Shapes, leaf paths and the optimizer-state structure are
checked against the engine from the JSON before any device work; file sizes against
``jzero_files.json``. ``params_only=True`` restores weights alone, with a fresh optimizer state.

**Conversion.** :func:`consolidate` is DeepSpeed's ``zero_to_fp32``: it turns a training checkpoint
into plain weights of logical shape -- a safetensors file, streamed leaf by leaf so the host holds
about one leaf at a time, and / or a params-only Orbax checkpoint (which Orbax writes in one call,
so that one holds every leaf). With ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
a save also writes the consolidated 16-bit weights as a params-only Orbax checkpoint inside the
step. :func:`load_weights` reads either form back into a params tree for ``engine.init(rng,
params=...)``, to fine-tune under any stage. :func:`describe` is ``jzero inspect``.

On-disk layout::

  DIR/
    latest                      text: the newest finalized step, e.g. "20"
    20/                         one step (written as 20.orbax-checkpoint-tmp-*/, renamed on commit)
      state/                    Orbax PyTree (OCDBT + zarr3): the TrainState as nested dicts:
                                  step, skipped, rng, loss_scale/<field>, params/<leaf>,
                                  master/<leaf> (bf16 / fp16 only), opt_state/<optax path>/<leaf>
      meta/jzero.json           the JSON document described above
      weights16/                with gather_16bit_weights_on_model_save: params-only Orbax PyTree
      jzero_files.json          written after the commit: relative path -> size of every file
      _CHECKPOINT_METADATA, commit_success.txt      Orbax's own

A params-only Orbax checkpoint (``consolidate(orbax=...)`` and ``weights16/``) is a plain Orbax
PyTree of the model's logical weights as nested dicts (``ocp.PyTreeCheckpointer().restore(path)``
reads it without jzero), with jzero's description in the PyTree's ``custom_metadata``. A safetensors
file names its tensors by the '/'-joined leaf paths of the plan.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import shutil
import struct
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jzero.engine import Engine, TrainState
from jzero.errors import CheckpointError, JZeroWarning
from jzero.plan import LeafPlan, Plan, flatten_paths, path_str
from jzero.precision import DTYPES

__all__ = [
    "Checkpointer", "save_checkpoint", "load_checkpoint", "wait_until_finished", "latest_step",
    "all_steps", "read_metadata", "consolidate", "load_weights", "read_weights", "describe",
]

PyTree = Any
FORMAT = "jzero-checkpoint"
FORMAT_VERSION = 1
META_FILE = "jzero.json"
FILES_FILE = "jzero_files.json"
LATEST_FILE = "latest"
WEIGHTS16 = "weights16"
_DELETING = ".jzero-deleting"
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_WRITE_CHUNK_BYTES = 1 << 20
_REPLICA_PARALLEL_MIN_BYTES = 1 << 20


# --- names of the stored arrays ------------------------------------------------------------------


def _nest(flat: dict[str, Any]) -> dict:
  """The nested dict of a {'a/b/c': leaf} mapping (what Orbax stores and restores)."""
  out: dict = {}
  for name, x in flat.items():
    *parents, last = name.split("/")
    node = out
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = x
  return out


def _broadcast(prefix: PyTree, tree: PyTree) -> PyTree:
  """A prefix tree of shardings (``engine.state_shardings()``) expanded to ``tree``'s leaves."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), prefix, tree,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def _opt_leaves(engine: Engine, opt_state: PyTree) -> dict[str, LeafPlan | None]:
  """For each optimizer-state array name: the plan leaf it is laid out like, or None (counts...)."""
  plan = engine.plan
  marked = optax.tree_utils.tree_map_params(
      engine.tx, lambda _, leaf: leaf, opt_state, plan.leaves, transform_non_params=lambda x: x,
      is_leaf=lambda x: isinstance(x, LeafPlan))
  flat = jax.tree_util.tree_flatten_with_path(marked, is_leaf=lambda x: isinstance(x, LeafPlan))[0]
  return {"opt_state/" + path_str(p): (x if isinstance(x, LeafPlan) else None) for p, x in flat}


def _array_leaves(engine: Engine, state: TrainState) -> dict[str, LeafPlan | None]:
  """Stored array name -> its plan leaf (params, master, param-like optimizer state) or None."""
  leaves = {}
  for leaf in engine.plan.leaf_list():
    leaves[f"params/{leaf.path}"] = leaf
    if state.master is not None:
      leaves[f"master/{leaf.path}"] = leaf
  leaves.update(_opt_leaves(engine, state.opt_state))
  return leaves


def _abstract_state(engine: Engine, sample_batch: Any) -> TrainState:
  """The engine's TrainState as ShapeDtypeStructs (global shapes); creates the plan if needed."""
  return jax.eval_shape(lambda rng: engine.init(rng, sample_batch), jax.random.key(0))


# --- the JSON document ---------------------------------------------------------------------------


def _leaf_json(leaf: LeafPlan) -> dict:
  return {"path": leaf.path, "shape": list(leaf.shape), "dtype": "float32",
          "stacked": leaf.stacked, "shard_dim": leaf.shard_dim, "padded": leaf.padded,
          "param_partitioned": leaf.param_partitioned,
          "state_partitioned": leaf.state_partitioned}


def _mesh_json(engine: Engine) -> dict:
  mesh = engine.mesh
  return {"axes": {str(a): int(s) for a, s in mesh.mesh.shape.items()},
          "zero_axes": list(mesh.zero_axes), "batch_axes": list(mesh.batch_axes),
          "devices": mesh.size, "platform": mesh.mesh.devices.flat[0].platform,
          "processes": jax.process_count(), "description": mesh.describe()}


def _versions() -> dict:
  import jzero  # at call time: jzero/__init__.py may import this module
  return {"jzero": jzero.__version__, "jax": jax.__version__, "orbax_checkpoint": ocp.__version__}


def _metadata(engine: Engine, state: TrainState, step: int, arrays: dict[str, jax.Array],
              weights16: np.dtype | None, extra: dict | None) -> dict:
  plan = engine.plan
  leaves = _array_leaves(engine, state)
  return {
      "format": FORMAT,
      "format_version": FORMAT_VERSION,
      "versions": _versions(),
      "step": step,
      "data_position": {"step": int(state.step)},
      "stage": plan.stage,
      "precision": engine.config.precision,
      "compute_dtype": str(np.dtype(plan.compute_dtype)),
      "has_master": plan.has_master,
      "mesh": _mesh_json(engine),
      "config": engine.config.to_dict(),
      "leaves": [_leaf_json(leaf) for leaf in plan.leaf_list()],
      "arrays": {name: {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype)),
                        "leaf": leaves[name].path if leaves.get(name) is not None else None}
                 for name, x in arrays.items()},
      "weights16": None if weights16 is None else {"dtype": str(weights16), "item": WEIGHTS16},
      "extra": extra or {},
  }


# --- directories, steps and files ----------------------------------------------------------------


def _is_step_dir(path: Path) -> bool:
  return (path / "meta" / META_FILE).is_file()


def latest_step(directory: str | os.PathLike) -> int | None:
  """The step named by ``DIR/latest`` (the newest finalized save), or None if there is none."""
  path = Path(directory) / LATEST_FILE
  if not path.is_file():
    return None
  text = path.read_text().strip()
  if not text.isdigit():
    raise CheckpointError(f"{path} should hold a step number, but holds {text[:40]!r}. Rewrite it "
                          f"with the step to restore (one of {all_steps(directory)}) or pass the "
                          f"step explicitly.")
  return int(text)


def all_steps(directory: str | os.PathLike) -> list[int]:
  """Finalized steps in ``directory`` (committed by Orbax and recorded by jzero), ascending."""
  root = Path(directory)
  if not root.is_dir():
    return []
  return sorted(int(p.name) for p in root.iterdir()
                if p.name.isdigit() and (p / FILES_FILE).is_file())


def _step_dir(directory: str | os.PathLike, step: int | None) -> Path:
  """The directory of ``step`` (default: ``latest``); ``directory`` may be a step directory."""
  root = Path(directory)
  if not root.is_dir():
    raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist.")
  if _is_step_dir(root):
    if step is not None and root.name != str(step):
      raise CheckpointError(f"{root} is the checkpoint of step {root.name}, not step {step}.")
    return root
  if step is None:
    step = latest_step(root)
    if step is None:
      steps = all_steps(root)
      hint = (f"finalized steps present: {steps}; pass one explicitly" if steps else
              "it holds no finalized checkpoint")
      raise CheckpointError(f"{root} has no '{LATEST_FILE}' file ({hint}).")
    if not (root / str(step)).is_dir():
      raise CheckpointError(f"{root / LATEST_FILE} names step {step}, but {root / str(step)} does "
                            f"not exist (finalized steps present: {all_steps(root)}).")
    return root / str(step)
  path = root / str(int(step))
  if not path.is_dir():
    unfinished = sorted(p.name for p in root.glob(f"{int(step)}.orbax-checkpoint-tmp*"))
    why = " (its save never finished)" if unfinished else ""
    raise CheckpointError(f"{root} has no checkpoint of step {step}{why}; finalized steps: "
                          f"{all_steps(root)}.")
  return path


def _list_files(step_dir: Path) -> dict[str, int]:
  return {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*"))
          if p.is_file() and p.name != FILES_FILE}


def _write_atomic(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _verify_files(step_dir: Path) -> None:
  """Each file the save wrote exists with its size; else raises naming the first that does not."""
  listing = step_dir / FILES_FILE
  if not listing.is_file():
    warnings.warn(f"{step_dir} has no {FILES_FILE}: its save was interrupted after Orbax committed "
                  f"it and before jzero recorded it, so its files cannot be checked before "
                  f"reading.", JZeroWarning, stacklevel=3)
    return
  try:
    files = json.loads(listing.read_text())["files"]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{listing} is not a valid file list ({e}); the checkpoint was modified "
                          f"after it was written.") from None
  for rel, size in files.items():
    path = step_dir / rel
    if not path.is_file():
      raise CheckpointError(f"checkpoint {step_dir} is incomplete: file {rel} is missing. The "
                            f"checkpoint was damaged after it was written; restore another step "
                            f"(finalized: {all_steps(step_dir.parent)}).")
    if path.stat().st_size != size:
      raise CheckpointError(f"checkpoint {step_dir} is corrupt: file {rel} has "
                            f"{path.stat().st_size} bytes but {size} were written (truncated or "
                            f"overwritten). Restore another step (finalized: "
                            f"{all_steps(step_dir.parent)}).")


def read_metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
  """The JSON document of a checkpoint (default: the ``latest`` step) plus ``"path"``."""
  step_dir = _step_dir(directory, step)
  path = step_dir / "meta" / META_FILE
  try:
    meta = json.loads(path.read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{step_dir} is not a jzero checkpoint: {path} is missing.") from None
  except ValueError as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt.") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CheckpointError(f"{path} is not a jzero checkpoint description.")
  if meta.get("format_version", 0) > FORMAT_VERSION:
    raise CheckpointError(f"{step_dir} was written in checkpoint format "
                          f"{meta['format_version']} by jzero {meta['versions']['jzero']}; this "
                          f"jzero reads format {FORMAT_VERSION}. Upgrade jzero.")
  meta["path"] = str(step_dir)
  return meta


def _open(directory: str | os.PathLike, step: int | None) -> tuple[Path, dict]:
  meta = read_metadata(directory, step)
  step_dir = Path(meta["path"])
  _verify_files(step_dir)
  return step_dir, meta


# --- saving --------------------------------------------------------------------------------------


def _weights16_dtype(engine: Engine) -> np.dtype | None:
  if not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
    return None
  compute = np.dtype(engine.plan.compute_dtype)
  return compute if compute.itemsize == 2 else DTYPES["bf16"]


def _spread_sharding(engine: Engine, shape: tuple[int, ...]) -> NamedSharding:
  """Logical-shape arrays split over the ZeRO axes on their first evenly divisible dimension
  (JAX arrays cannot be split unevenly); replicated when none divides."""
  axes = engine.mesh.zero_axes
  spec: list[Any] = [None] * len(shape)
  for d, size in enumerate(shape):
    if size % engine.mesh.zero_size == 0:
      spec[d] = axes[0] if len(axes) == 1 else axes
      break
  return NamedSharding(engine.mesh.mesh, P(*spec))


def _array_tree_handler() -> ocp.PyTreeCheckpointHandler:
  """Orbax's PyTree handler for trees of jax.Arrays, without replica-parallel writes in one process.

  Replica-parallel saving splits a replicated array among the processes that hold a replica; in a
  single process it only adds a slicing op per array, which JAX compiles on the first save (seconds
  for a model's worth of shapes). Across processes it is kept for slices of at least 1 MiB.
  """
  handler = ocp.type_handlers.ArrayHandler(
      use_replica_parallel=jax.process_count() > 1,
      min_slice_bytes_for_replica_parallel=_REPLICA_PARALLEL_MIN_BYTES)
  return ocp.PyTreeCheckpointHandler(
      type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, handler)))


class Checkpointer:
  """Asynchronous checkpoints of one directory (see the module docstring).

  Args:
    directory: where the steps go (created if missing).
    keep: keep only the newest ``keep`` finalized steps (None: keep all).
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = None):
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise CheckpointError(f"keep must be a positive number of checkpoints or None, got {keep!r}.")
    self.directory = Path(directory).absolute()
    self.keep = keep
    self._primary = jax.process_index() == 0
    if self._primary and self.directory.is_dir():
      for leftover in self.directory.glob(f"*{_DELETING}"):
        shutil.rmtree(leftover, ignore_errors=True)
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={"state": _array_tree_handler(),
                       "meta": ocp.JsonCheckpointHandler(filename=META_FILE),
                       WEIGHTS16: _array_tree_handler()},
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True,
                                             cleanup_tmp_directories=True, create=True))
    self._finalizer: threading.Thread | None = None
    self._failure: tuple[int, BaseException] | None = None
    self._cast_fns: dict[int, tuple[Plan, Any]] = {}

  def save(self, engine: Engine, state: TrainState, step: int | None = None, *,
           extra: dict | None = None) -> None:
    """Starts writing ``state`` as ``step`` (default ``state.step``); returns once it is on host.

    Waits for the previous save of this directory to be finalized first (and raises its error).

    Args:
      engine: the engine that produced ``state`` (its plan, config and mesh are recorded).
      state: the train state; it may be donated to the next train step right after this returns.
      step: the checkpoint's name, a non-negative integer.
      extra: JSON-serialisable user data stored in the checkpoint's JSON under ``"extra"``.
    """
    self.wait_until_finished()
    if engine.plan is None:
      raise CheckpointError("the engine has no plan: save a state made by engine.init / "
                            "engine.train_step of this engine.")
    step = int(state.step) if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
      raise CheckpointError(f"a checkpoint step is a non-negative integer, got {step!r}.")
    if (self.directory / str(step)).exists():
      raise CheckpointError(f"{self.directory / str(step)} already exists; checkpoints are never "
                            f"overwritten. Save under another step or remove it first.")
    try:
      json.dumps(extra)
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"extra must be JSON-serialisable (it is stored in {META_FILE}): "
                            f"{e}.") from None
    arrays = flatten_paths(state)
    dtype16 = _weights16_dtype(engine)
    items = {"state": ocp.args.PyTreeSave(_nest(arrays)),
             "meta": ocp.args.JsonSave(_metadata(engine, state, step, arrays, dtype16, extra))}
    if dtype16 is not None:
      weights = self._weights16(engine, state, dtype16)
      items[WEIGHTS16] = ocp.args.PyTreeSave(
          _nest(weights), custom_metadata={"jzero": _weights_json(
              {k: (v.shape, v.dtype) for k, v in weights.items()}, step, "save")})
    self._manager.save(step, args=ocp.args.Composite(**items))
    self._finalizer = threading.Thread(target=self._finalize, args=(step,),
                                       name=f"jzero-checkpoint-{step}")
    self._finalizer.start()

  def _weights16(self, engine: Engine, state: TrainState, dtype: np.dtype) -> dict[str, jax.Array]:
    """The logical weights in ``dtype``, each split over the devices (see _spread_sharding)."""
    plan = engine.plan
    cached = self._cast_fns.get(id(plan))
    if cached is None:
      shardings = plan.map(lambda leaf: _spread_sharding(engine, leaf.shape))
      fn = jax.jit(lambda t: plan.map(lambda leaf, x: leaf.to_logical(x).astype(dtype), t),
                   out_shardings=shardings)
      cached = self._cast_fns[id(plan)] = (plan, fn)
    truth = state.master if plan.has_master else state.params
    return flatten_paths(cached[1](truth))

  def _finalize(self, step: int) -> None:
    """Background: wait for Orbax's commit, then record the files, move ``latest``, prune."""
    try:
      self._manager.wait_until_finished()
      if self._primary:
        step_dir = self.directory / str(step)
        _write_atomic(step_dir / FILES_FILE, json.dumps({"files": _list_files(step_dir)}))
        _write_atomic(self.directory / LATEST_FILE, f"{step}\n")
        self._prune(step)
    except BaseException as e:  # re-raised by wait_until_finished in the caller's thread
      self._failure = (step, e)

  def _prune(self, latest: int) -> None:
    """Deletes the steps older than the newest ``keep`` (never ``latest``); a step is renamed
    away first, so a deletion cut short never leaves something that looks like a step."""
    if self.keep is None:
      return
    kept = [s for s in all_steps(self.directory) if s <= latest][-self.keep:]
    for path in self.directory.iterdir():
      if path.name.isdigit() and int(path.name) < kept[0]:
        doomed = path.with_name(path.name + _DELETING)
        os.rename(path, doomed)
        shutil.rmtree(doomed)

  def wait_until_finished(self, *, sync_processes: bool = True) -> None:
    """Blocks until the last save is committed and ``latest`` names it; raises if it failed.

    With several processes it ends with a barrier (only the primary moves ``latest``), unless
    ``sync_processes`` is False (at interpreter exit, when JAX's distributed runtime may be gone).
    """
    if self._finalizer is not None:
      self._finalizer.join()
      self._finalizer = None
      if sync_processes and jax.process_count() > 1:
        multihost_utils.sync_global_devices("jzero-checkpoint-finalized")
    if self._failure is not None:
      step, error = self._failure
      self._failure = None
      raise CheckpointError(f"saving step {step} to {self.directory} failed: "
                            f"{type(error).__name__}: {error}") from error

  def close(self) -> None:
    """Waits for the last save and releases Orbax's resources."""
    try:
      self.wait_until_finished()
    finally:
      self._manager.close()


_CHECKPOINTERS: dict[Path, Checkpointer] = {}


def _checkpointer(directory: str | os.PathLike, keep: int | None) -> Checkpointer:
  path = Path(directory).absolute()
  ckpt = _CHECKPOINTERS.get(path)
  if ckpt is None:
    ckpt = _CHECKPOINTERS[path] = Checkpointer(path, keep=keep)
  elif keep is not None:
    ckpt.keep = keep
  return ckpt


def save_checkpoint(engine: Engine, state: TrainState, directory: str | os.PathLike,
                    step: int | None = None, *, keep: int | None = None,
                    extra: dict | None = None) -> None:
  """Starts an asynchronous save of ``state`` into ``directory/<step>`` (see :class:`Checkpointer`).

  One :class:`Checkpointer` per directory is kept for the life of the process, so consecutive
  saves overlap training; :func:`wait_until_finished` (also run at exit) waits for them.

  Args:
    engine: the engine that produced ``state``.
    state: the train state; it may be donated to the next train step right after this returns.
    directory: the checkpoint directory (created if missing).
    step: the checkpoint's step (default ``state.step``).
    keep: keep only the newest ``keep`` steps in ``directory`` (None: all, or as set before).
    extra: JSON-serialisable user data stored with the checkpoint (``read_metadata(...)["extra"]``).
  """
  _checkpointer(directory, keep).save(engine, state, step, extra=extra)


def wait_until_finished(directory: str | os.PathLike | None = None) -> None:
  """Blocks until the saves started by :func:`save_checkpoint` (in ``directory``, default all) are
  finalized, with ``latest`` naming them; raises :class:`CheckpointError` if one failed."""
  paths = list(_CHECKPOINTERS) if directory is None else [Path(directory).absolute()]
  for path in paths:
    if path in _CHECKPOINTERS:
      _CHECKPOINTERS[path].wait_until_finished()


@atexit.register
def _finish_at_exit() -> None:
  """A process never exits with a save half-written (no barrier: the runtime may be shut down)."""
  for ckpt in _CHECKPOINTERS.values():
    ckpt.wait_until_finished(sync_processes=False)


# --- restoring -----------------------------------------------------------------------------------


def _check_model(meta: dict, plan: Plan, step_dir: Path) -> None:
  """The checkpoint's leaves are the model's: same paths, same logical shapes."""
  saved = {leaf["path"]: tuple(leaf["shape"]) for leaf in meta["leaves"]}
  want = {leaf.path: leaf.shape for leaf in plan.leaf_list()}
  missing, unexpected = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
  if missing or unexpected:
    raise CheckpointError(
        f"checkpoint {step_dir} was written for another model: the model's leaves {missing[:5]} "
        f"are not in it, and its leaves {unexpected[:5]} are not in the model.")
  bad = [f"{p}: {saved[p]} in the checkpoint, {want[p]} in the model" for p in want
         if saved[p] != want[p]]
  if bad:
    raise CheckpointError(f"checkpoint {step_dir} does not fit the model's shapes: "
                          f"{'; '.join(bad[:5])}.")


def _optimizer_name(config: dict) -> str:
  opt = config.get("optimizer") or {}
  return str(opt.get("type", "a client optimizer"))


def _check_optimizer(meta: dict, engine: Engine, targets: dict[str, jax.ShapeDtypeStruct],
                     leaves: dict[str, LeafPlan | None], step_dir: Path) -> None:
  """The stored optimizer state has the engine optimizer's structure and shapes."""
  saved = {n: a for n, a in meta["arrays"].items() if n.startswith("opt_state/")}
  want = {n for n in targets if n.startswith("opt_state/")}
  hint = ("Pass params_only=True to restore the weights alone, with a fresh optimizer state "
          "starting at step 0.")
  if set(saved) != want:
    lacking, unused = sorted(want - set(saved)), sorted(set(saved) - want)
    found = ([f"it lacks {lacking[:4]}"] if lacking else []) + (
        [f"it holds {unused[:4]}, which this engine's optimizer does not use"] if unused else [])
    raise CheckpointError(
        f"checkpoint {step_dir} holds the state of another optimizer "
        f"({_optimizer_name(meta['config'])}; this engine: "
        f"{_optimizer_name(engine.config.to_dict())}): {'; '.join(found)}. {hint}")
  for name in sorted(want):
    leaf, entry = leaves[name], saved[name]
    if (entry["leaf"] is None) != (leaf is None):
      raise CheckpointError(f"checkpoint {step_dir}: optimizer state {name} is laid out "
                            f"differently in the checkpoint and in the engine's optimizer. {hint}")
    if leaf is None and tuple(entry["shape"]) != targets[name].shape:
      raise CheckpointError(f"checkpoint {step_dir}: optimizer state {name} has shape "
                            f"{tuple(entry['shape'])}, the engine's optimizer "
                            f"{targets[name].shape}. {hint}")


def _root_cause(error: BaseException) -> str:
  """The innermost error's message: tensorstore's names the stored array and the file."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  return f"{type(error).__name__}: {error}"


def _restore_arrays(step_dir: Path, requests: dict[str, tuple[str, jax.ShapeDtypeStruct]]
                    ) -> dict[str, jax.Array]:
  """Reads stored arrays of the ``state`` item into target global shapes and shardings.

  Args:
    step_dir: the step directory.
    requests: target name -> (stored name, target ShapeDtypeStruct with its sharding).
  """
  by_source = {src: target for src, target in requests.values()}
  args = {src: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype,
                                    strict=False) for src, t in by_source.items()}
  try:
    restored = flatten_paths(ocp.Checkpointer(_array_tree_handler()).restore(
        step_dir / "state", args=ocp.args.PyTreeRestore(
            item=_nest(by_source), restore_args=_nest(args), partial_restore=True)))
  except Exception as e:
    raise CheckpointError(f"checkpoint {step_dir}: its arrays cannot be read: "
                          f"{_root_cause(e)}") from e
  return {target: restored[src] for target, (src, _) in requests.items()}


def _compute_params(engine: Engine, master: PyTree, shardings: PyTree) -> PyTree:
  """Compute params cast from the fp32 master, laid out as the plan's params (as the step does)."""
  plan = engine.plan

  def to_param(leaf: LeafPlan, x: jax.Array) -> jax.Array:
    x = leaf.to_logical(x)
    return (leaf.to_padded(x) if leaf.param_partitioned else x).astype(plan.compute_dtype)

  return jax.jit(lambda m: plan.map(to_param, m), out_shardings=shardings)(master)


def _fresh_opt_state(engine: Engine, truth: PyTree, shardings: PyTree) -> PyTree:
  """``tx.init`` on the truth laid out as the master (params_only restores)."""
  plan = engine.plan

  def to_state(leaf: LeafPlan, x: jax.Array) -> jax.Array:
    x = leaf.to_logical(x)
    return leaf.to_padded(x) if leaf.state_partitioned else x

  return jax.jit(lambda t: engine.tx.init(plan.map(to_state, t)), out_shardings=shardings)(truth)


def load_checkpoint(engine: Engine, directory: str | os.PathLike, step: int | None = None, *,
                    params_only: bool = False, sample_batch: Any = None) -> TrainState:
  """Restores a checkpoint into ``engine``'s placement, whatever stage / mesh / precision wrote it.

  Every array is read directly into its target sharding (each device reads only its shard). The
  checkpoint's fp32 truth (master in mixed precision, params in fp32) becomes the engine's;
  compute params are cast from it. The loss-scaler state is kept when both runs use the same
  precision, else it starts fresh.

  Args:
    engine: the engine to restore into (its plan is created if it has none).
    directory: a checkpoint directory (or one step's directory).
    step: the step to restore (default: the one ``latest`` names).
    params_only: restore the weights alone: optimizer state, step, skipped count and loss scale
      start fresh (as after ``engine.init``); the training RNG is the checkpoint's. For another
      optimizer, or fine-tuning from a training checkpoint.
    sample_batch: needed for Linen models when the engine has no plan yet (as ``engine.init``).

  Raises:
    CheckpointError: missing / incomplete / corrupt checkpoint, another model (leaf paths or
      shapes), or another optimizer without ``params_only`` -- before any device work.
  """
  step_dir, meta = _open(directory, step)
  abstract = _abstract_state(engine, sample_batch)
  plan = engine.plan
  _check_model(meta, plan, step_dir)
  shardings = _broadcast(engine.state_shardings(), abstract)
  targets = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for (name, x), s in
             zip(flatten_paths(abstract).items(), jax.tree.leaves(shardings))}
  leaves = _opt_leaves(engine, abstract.opt_state)
  if not params_only:
    _check_optimizer(meta, engine, targets, leaves, step_dir)

  truth = "master" if meta["has_master"] else "params"
  into = "master" if plan.has_master else "params"
  requests = {f"{into}/{leaf.path}": (f"{truth}/{leaf.path}", targets[f"{into}/{leaf.path}"])
              for leaf in plan.leaf_list()}
  replicated = plan.sharding(P())
  stored = meta["arrays"]
  rng = stored["rng"]
  requests["rng"] = ("rng", jax.ShapeDtypeStruct(tuple(rng["shape"]), np.dtype(rng["dtype"]),
                                                  sharding=replicated))
  same_precision = meta["precision"] == engine.config.precision
  if not params_only:
    for name, target in targets.items():
      if name in ("step", "skipped") or name.startswith("opt_state/") or (
          name.startswith("loss_scale/") and same_precision):
        requests[name] = (name, target)
  restored = _restore_arrays(step_dir, requests)

  def group(prefix: str, tree: PyTree) -> PyTree:
    names = [n for n in targets if n.startswith(prefix + "/")]
    return jax.tree.unflatten(jax.tree.structure(tree), [restored[n] for n in names])

  weights = group(into, getattr(abstract, into))
  if plan.has_master:
    master, params = weights, _compute_params(engine, weights, shardings.params)
  else:
    master, params = None, weights
  if params_only:
    zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), replicated)  # two buffers: donated
    return TrainState(step=zero(), skipped=zero(), params=params, master=master,
                      opt_state=_fresh_opt_state(engine, weights, shardings.opt_state),
                      loss_scale=jax.device_put(engine.scaler.init(), replicated),
                      rng=restored["rng"])
  loss_scale = (group("loss_scale", abstract.loss_scale) if same_precision
                else jax.device_put(engine.scaler.init(), replicated))
  return TrainState(step=restored["step"], skipped=restored["skipped"], params=params,
                    master=master, opt_state=group("opt_state", abstract.opt_state),
                    loss_scale=loss_scale, rng=restored["rng"])


# --- plain weights: consolidation and import -----------------------------------------------------


def _weights_json(shapes: dict[str, tuple[tuple[int, ...], Any]], step: int, source: str) -> dict:
  return {"format": "jzero-weights", "step": step, "source": source,
          "leaves": {name: {"shape": list(shape), "dtype": str(np.dtype(dtype))}
                     for name, (shape, dtype) in shapes.items()}}


@dataclasses.dataclass(frozen=True)
class ConsolidateReport:
  """What :func:`consolidate` wrote.

  Attributes:
    step: the checkpoint step converted.
    dtype: the dtype written.
    leaves: number of weight leaves.
    total_bytes: bytes of all weights in ``dtype``.
    largest_leaf_bytes: bytes of the largest leaf in ``dtype``.
    outputs: the files / directories written.
  """

  step: int
  dtype: str
  leaves: int
  total_bytes: int
  largest_leaf_bytes: int
  outputs: tuple[str, ...]


def _stored_leaves(meta: dict) -> list[tuple[str, tuple[int, ...], str]]:
  """(leaf path, logical shape, stored array name) of the weights' truth, in plan order."""
  group = "master" if meta["has_master"] else "params"
  return [(leaf["path"], tuple(leaf["shape"]), f"{group}/{leaf['path']}")
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
          item=_nest({name: 0}), partial_restore=True,
          restore_args=_nest({name: ocp.RestoreArgs(restore_type=np.ndarray)}))
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


def consolidate(directory: str | os.PathLike, *, step: int | None = None,
                safetensors: str | os.PathLike | None = None,
                orbax: str | os.PathLike | None = None, dtype: str = "fp32") -> ConsolidateReport:
  """Writes a training checkpoint's weights as plain logical-shape weights (``zero_to_fp32``).

  Reads the fp32 truth (master in mixed precision, params in fp32) one leaf at a time. The
  safetensors file is streamed: its header is computed from the checkpoint's JSON, then each leaf
  is read, cut to its logical shape, cast and appended, so peak host memory stays near the largest
  stored leaf, not the model. The params-only Orbax checkpoint is written by Orbax in one call, so
  it holds all leaves (in ``dtype``) at once. Both are written to a temporary name and renamed.

  Args:
    directory: a training checkpoint directory (or one step's directory).
    step: the step (default: ``latest``).
    safetensors: path of the safetensors file to write (tensor names: '/'-joined leaf paths).
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
  step_dir, meta = _open(directory, step)
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
        Path(orbax).absolute(), args=ocp.args.PyTreeSave(_nest(collected), custom_metadata={
            "jzero": _weights_json({p: (s, out_dtype) for p, s in shapes.items()}, meta["step"],
                                   str(step_dir))}))
    outputs.append(str(orbax))
  return ConsolidateReport(step=meta["step"], dtype=str(out_dtype), leaves=len(shapes),
                           total_bytes=sum(sizes), largest_leaf_bytes=max(sizes),
                           outputs=tuple(outputs))


def read_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Plain weights as ``{'/'-joined leaf path: numpy array}``.

  ``path`` is a safetensors file or a params-only Orbax checkpoint (from :func:`consolidate`, a
  step's ``weights16/``, or any Orbax PyTree of arrays). Only data is read: safetensors' JSON
  header and raw tensors, Orbax's JSON metadata and zarr arrays.
  """
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"weights {str(path)!r} do not exist.")
  if path.is_file():
    from safetensors import SafetensorError, safe_open
    try:
      with safe_open(str(path), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
  if not (path / "_METADATA").is_file():
    hint = ("; for a training checkpoint use load_checkpoint(..., params_only=True) or "
            "convert it first" if (path / LATEST_FILE).exists() or _is_step_dir(path) else "")
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


def load_weights(engine: Engine, path: str | os.PathLike, *, sample_batch: Any = None) -> PyTree:
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
  want = flatten_paths(model)
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


# --- inspection ----------------------------------------------------------------------------------


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def describe(directory: str | os.PathLike, step: int | None = None) -> str:
  """A readable summary of a checkpoint: step, stage, mesh, precision, every stored array (shape,
  dtype, bytes) and totals -- ``jzero inspect``. Reads only JSON."""
  meta = read_metadata(directory, step)
  step_dir = Path(meta["path"])
  root = step_dir.parent
  versions, mesh, config = meta["versions"], meta["mesh"], meta["config"]
  master = "fp32 master" if meta["has_master"] else "no separate master (fp32 params)"
  scheduler = (config.get("scheduler") or {}).get("type", "constant lr")
  latest = latest_step(root)
  lines = [
      f"checkpoint {step_dir}",
      f"  step {meta['step']} (finalized steps in {root}: {all_steps(root)}; latest: "
      f"{'none' if latest is None else latest})",
      f"  data position: step {meta['data_position']['step']}",
      f"  ZeRO stage {meta['stage']}, precision {meta['precision']} (compute "
      f"{meta['compute_dtype']}, {master})",
      f"  mesh {mesh['description']}; written by {mesh['processes']} process(es)",
      f"  optimizer {_optimizer_name(config)}, scheduler {scheduler}",
      f"  written by jzero {versions['jzero']}, jax {versions['jax']}, orbax-checkpoint "
      f"{versions['orbax_checkpoint']}",
  ]
  if meta["weights16"]:
    lines.append(f"  consolidated 16-bit weights: {step_dir / WEIGHTS16} "
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
  files = _list_files(step_dir)
  lines.append(f"  on disk: {_bytes(sum(files.values()))} in {len(files)} files")
  return "\n".join(lines)
