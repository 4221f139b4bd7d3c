"""Saving: the train state as it lies, asynchronously, committed atomically, never lost at exit.

:class:`Checkpointer` writes the complete :class:`~jzero.train.state.TrainState` with Orbax's
``AsyncCheckpointer``: each process writes only the shards it holds (one replica of each); the call
returns once they are copied to host memory and the files are written by a background thread while
training goes on. Orbax writes a checkpoint into ``<tag>.orbax-checkpoint-tmp-*`` and renames it on
commit, so a save killed part-way leaves only a temporary directory, which the next
:class:`Checkpointer` of that directory removes. After the commit jzero (the primary process, still
in the background) records every file's size and checksum (``jzero_files.json``), then moves
``latest`` to it (write + rename), then deletes the checkpoints beyond ``keep``. ``latest``
therefore only ever names a complete, verified checkpoint. With several processes, waiting for a
save (:func:`wait_until_finished`, or the next save) ends with a barrier, so no process reads
``latest`` before the primary has moved it.

**Exit.** DeepSpeed's save is synchronous, so scripts end right after it. jzero's pending saves are
waited for when the main thread ends -- before Python shuts down the thread pools Orbax commits
with -- so such a script still leaves a finalized checkpoint. If a save fails then, the process
prints one line naming the checkpoint and exits with status 1.

**Faults.** A :class:`Checkpointer` claims its directory first (:mod:`jzero.checkpoint.claim`: one
writer per directory, a second run refused naming the first) and checks before each save that the
directory can be written, so a read-only or full disk is one error before Orbax starts. A save that
fails later -- the disk fills while Orbax writes -- is one :class:`~jzero.errors.CheckpointError`
naming the cause and the checkpoints kept: Orbax's writer threads are waited for and what the save
left (its temporary directory, a committed one without its file list) is removed; Orbax's own
error records about the directory are dropped (:class:`_OrbaxFailureLine`).

**Retention** (``keep``). After ``latest`` has moved, the newest ``keep`` complete checkpoints up to
the one just saved stay -- counting those of earlier runs in the directory, so a resumed job keeps
the newest ``keep`` overall -- and older ones are deleted; a checkpoint newer than the one just
saved, the one ``latest`` names and incomplete saves are never touched, so a save killed at any
point still has its complete predecessor. Which to keep is decided by Orbax's ``LatestN``
preservation policy, what ``CheckpointManager(max_to_keep=...)`` uses. Orbax's
``CheckpointManager`` itself does not fit this directory: it names checkpoints by integer step,
where DeepSpeed's tag is any name given per save (``"epoch_0"``); its ``latest_step`` is the
highest step on disk, where DeepSpeed's ``latest`` file names a tag and a ``save_latest=False``
save must not become it; and it chooses what to delete when a save starts, counting that save,
then deletes right after Orbax's commit -- before jzero records the file list that makes a
checkpoint complete, so with ``max_to_keep=1`` a save killed in between would have deleted its
only complete predecessor.

Beside the arrays goes one JSON document: format version, jzero / JAX / Orbax versions, the tag,
the step and the data position (the number of optimizer steps taken: batches are a pure function
of the step, see :mod:`jzero.runtime.data`), the stage, precision, mesh, the resolved DeepSpeed
config, every plan leaf (path, logical shape, how it was laid out), every stored array (name, stored
shape, dtype, plan leaf) and the user's JSON ``client_state``. Nothing in a checkpoint is
executable.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jzero.checkpoint import claim as claim_lib
from jzero.checkpoint import layout
from jzero.checkpoint.layout import (DELETING, FILES_FILE, FORMAT, FORMAT_VERSION, LATEST_FILE,
                                     META_FILE, ORBAX_TMP, WEIGHTS16)
from jzero.errors import CheckpointError, JZeroError, JZeroWarning, describe_io_error
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths
from jzero.tiers import registry
from jzero.tiers.base import Resources
from jzero.version import __version__

__all__ = ["Checkpointer", "save_checkpoint", "writer", "wait_until_finished", "weights_json"]


# --- the JSON document ---------------------------------------------------------------------------


def _leaf_json(leaf: LeafPlan, name: str) -> dict:
  return {"path": leaf.path, "name": name, "shape": list(leaf.shape), "dtype": "float32",
          "stacked": leaf.stacked, "shard_dim": leaf.shard_dim, "padded": leaf.padded,
          "param_partitioned": leaf.param_partitioned,
          "state_partitioned": leaf.state_partitioned}


def _mesh_json(mesh: Any) -> dict:
  return {"axes": {str(a): int(s) for a, s in mesh.mesh.shape.items()},
          "zero_axes": list(mesh.zero_axes), "batch_axes": list(mesh.batch_axes),
          "devices": mesh.size, "platform": mesh.mesh.devices.flat[0].platform,
          "processes": jax.process_count(), "description": mesh.describe()}


def _versions() -> dict:
  return {"jzero": __version__, "jax": jax.__version__, "orbax_checkpoint": ocp.__version__}


def _metadata(plan: Plan, config: Any, tx: Any, state: Any, tag: str,
              arrays: dict[str, jax.Array], weights16: np.dtype | None, client_state: dict | None,
              save_latest: bool) -> dict:
  leaves = layout.array_leaves(plan, tx, state)
  names = layout.module_names(plan.leaves)
  return {
      "format": FORMAT,
      "format_version": FORMAT_VERSION,
      "versions": _versions(),
      "tag": tag,
      "step": int(state.step),
      "data_position": {"step": int(state.step)},
      "stage": plan.stage,
      "precision": config.precision,
      "compute_dtype": str(np.dtype(plan.compute_dtype)),
      "has_master": plan.has_master,
      "mesh": _mesh_json(plan.mesh),
      "config": config.to_dict(),
      "global_batch_size": config.train_batch_size,
      "leaves": [_leaf_json(leaf, names[leaf.path]) for leaf in plan.leaf_list()],
      "arrays": {name: {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype)),
                        "leaf": leaves[name].path if leaves.get(name) is not None else None}
                 for name, x in arrays.items()},
      "weights16": None if weights16 is None else {"dtype": str(weights16), "item": WEIGHTS16},
      "client_state": client_state or {},
      "save_latest": save_latest,  # meant to become `latest` (layout.resume_tag)
  }


def weights_json(shapes: dict[str, tuple[tuple[int, ...], Any]], step: int, source: str) -> dict:
  """The description stored with plain weights (``weights16/`` and ``consolidate(orbax=...)``)."""
  return {"format": "jzero-weights", "step": step, "source": source,
          "leaves": {name: {"shape": list(shape), "dtype": str(np.dtype(dtype))}
                     for name, (shape, dtype) in shapes.items()}}


# --- consolidated 16-bit weights -----------------------------------------------------------------


def _weights16_dtype(plan: Plan, config: Any) -> np.dtype | None:
  """``stage3_gather_16bit_weights_on_model_save``: the model's compute dtype, as DeepSpeed saves
  the module's own dtype (so fp32 training writes fp32 weights, despite the key's name)."""
  if not config.zero_optimization.gather_16bit_weights_on_model_save:
    return None
  return np.dtype(plan.compute_dtype)


def _spread_sharding(mesh: Any, shape: tuple[int, ...]) -> NamedSharding:
  """Logical-shape arrays split over the ZeRO axes on their first evenly divisible dimension
  (JAX arrays cannot be split unevenly); replicated when none divides."""
  axes = mesh.zero_axes
  spec: list[Any] = [None] * len(shape)
  for d, size in enumerate(shape):
    if size % mesh.zero_size == 0:
      spec[d] = axes[0] if len(axes) == 1 else axes
      break
  return NamedSharding(mesh.mesh, P(*spec))


# --- retention ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SavedCheckpoint:
  """A complete checkpoint as Orbax's preservation policies see it (``PolicyCheckpointInfo``)."""

  step: int
  time: datetime.datetime  # when it became complete: its file list's modification time
  metrics: dict | None = None

  @classmethod
  def of(cls, directory: Path, tag: str) -> _SavedCheckpoint:
    written = (directory / tag / FILES_FILE).stat().st_mtime
    return cls(step=int(layout.read_metadata(directory, tag)["step"]),
               time=datetime.datetime.fromtimestamp(written, datetime.timezone.utc))


# --- the checkpointer ----------------------------------------------------------------------------


class Checkpointer:
  """Asynchronous checkpoints of one directory (see the module docstring).

  Args:
    directory: where the checkpoints go (created by the first save; relative to the current
      directory).
    keep: keep only the newest ``keep`` finalized checkpoints (None: keep all).
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = None):
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise CheckpointError(f"keep must be a positive number of checkpoints or None, got {keep!r}.")
    self.directory = layout.check_path(directory)
    self.keep = keep
    self._primary = jax.process_index() == 0
    error = None
    if self._primary:  # created, checked and locked before anything in it is touched
      try:
        claim_lib.claim(self.directory)
      except CheckpointError as e:
        error = e
    _agree(error, f"claiming {self.directory}")
    if self._primary:
      for leftover in [*self.directory.glob(f"*{DELETING}"), *self.directory.glob(f"*{ORBAX_TMP}*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    _quiet_orbax_failures()
    self._orbax = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler(
        state=layout.array_handler(), meta=ocp.JsonCheckpointHandler(filename=META_FILE),
        **{WEIGHTS16: layout.array_handler()}))
    self._finalizer: threading.Thread | None = None
    self._pending: str | None = None
    self._failure: tuple[str, BaseException] | None = None
    self._cast_fns: dict[int, tuple[Plan, Any]] = {}
    _wait_at_exit()

  def save(self, plan: Plan, state: Any, resources: Resources, tag: str | int | None = None, *,
           config: Any, tx: Any, client_state: dict | None = None,
           save_latest: bool = True) -> str:
    """Starts writing ``state`` as checkpoint ``tag``; returns the tag once the state is on host.

    Waits for the previous save of this directory to be finalized first (and raises its error).

    Args:
      plan: the plan ``state`` is laid out by (recorded with its mesh).
      state: the train state; it may be donated to the next train step right after this returns.
      resources: the plan's tiers' resources (what they keep outside the state is read in).
      config: the run's resolved config (recorded).
      tx: the run's optax transformation (names the optimizer state's leaves).
      tag: the checkpoint's directory name (DeepSpeed's ``tag``), default: the state's step.
      client_state: JSON-serialisable user data stored in the checkpoint's JSON
        (``load_checkpoint(..., with_client_state=True)`` gives it back).
      save_latest: move ``latest`` to this checkpoint once it is finalized.
    """
    self.wait_until_finished()
    tag = layout.check_tag(int(state.step) if tag is None else tag)
    self._clear_slot(tag)
    try:
      json.dumps(client_state)
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"client_state must be JSON-serialisable (it is stored in "
                            f"{META_FILE}): {e}.") from None
    # what the tiers hold outside it, e.g. the NVMe store's
    state = registry.full_state(registry.active(plan), plan, resources, state)
    arrays = flatten_paths(state._replace(secondary=None))  # hpZ's copy: recomputed on restore
    dtype16 = _weights16_dtype(plan, config)
    items = {"state": ocp.args.PyTreeSave(layout.nest(arrays)),
             "meta": ocp.args.JsonSave(_metadata(plan, config, tx, state, tag, arrays, dtype16,
                                                 client_state, save_latest))}
    if dtype16 is not None:
      weights = self._weights16(plan, state, dtype16)
      items[WEIGHTS16] = ocp.args.PyTreeSave(
          layout.nest(weights), custom_metadata={"jzero": weights_json(
              {k: (v.shape, v.dtype) for k, v in weights.items()}, int(state.step), "save")})
    try:
      self._orbax.save(self.directory / tag, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except  (said in one message, as below)
      self._discard(tag)
      raise self._failed(tag, e) from None
    self._pending = tag
    self._finalizer = threading.Thread(target=self._finalize, args=(tag, save_latest),
                                       name=f"jzero-checkpoint-{tag}")
    self._finalizer.start()
    return tag

  def _clear_slot(self, tag: str) -> None:
    """Refuses a tag that names a complete checkpoint; checks that the directory can be written
    (:func:`jzero.checkpoint.claim.check_writable`: a read-only or full disk is one error before
    Orbax starts); removes an incomplete checkpoint under the tag (renamed away first, so a
    removal cut short never looks like a checkpoint). Only the primary writes; every process then
    learns whether it could."""
    path = self.directory / tag
    if layout.is_complete(path):
      raise CheckpointError(f"{path} already exists; checkpoints are never overwritten. Save under "
                            f"another tag or remove it first.")
    error = None
    if self._primary:
      try:
        claim_lib.check_writable(self.directory)
        if path.exists():
          warnings.warn(f"{path} is an incomplete checkpoint (a save cut off before jzero recorded "
                        f"its files); replacing it.", JZeroWarning, stacklevel=3)
          _remove(path)
      except CheckpointError as e:
        error = e
    _agree(error, f"saving checkpoint {tag!r} in {self.directory}")

  def _weights16(self, plan: Plan, state: Any, dtype: np.dtype) -> dict[str, jax.Array]:
    """The logical weights in ``dtype`` by the module's names (:func:`layout.module_names`), each
    split over the devices (see _spread_sharding)."""
    cached = self._cast_fns.get(id(plan))
    if cached is None:
      shardings = plan.map(lambda leaf: _spread_sharding(plan.mesh, leaf.shape))
      fn = jax.jit(lambda t: plan.map(lambda leaf, x: leaf.to_logical(x).astype(dtype), t),
                   out_shardings=shardings)
      cached = self._cast_fns[id(plan)] = (plan, fn)
    truth = state.master if plan.has_master else state.params
    names = layout.module_names(plan.leaves)
    return {names[path]: x for path, x in flatten_paths(cached[1](truth)).items()}

  def _finalize(self, tag: str, save_latest: bool) -> None:
    """Background: wait for Orbax's commit, then record the files, move ``latest``, prune. A save
    that fails before it is complete leaves nothing: its temporary directory, or its committed
    directory without a file list, is removed (the primary's; the previous checkpoints are not
    touched)."""
    try:
      self._orbax.wait_until_finished()
      if self._primary:
        layout.record_files(self.directory / tag)
        if save_latest:
          layout.write_atomic(self.directory / LATEST_FILE, f"{tag}\n")
        self._prune(tag)
    except BaseException as e:  # re-raised by wait_until_finished in the caller's thread
      self._failure = (tag, e)
      self._discard(tag)

  def _discard(self, tag: str) -> None:
    """What a failed save of ``tag`` left -- Orbax's temporary directory, or a committed directory
    without its file list -- removed by the primary, once Orbax's writers have stopped."""
    if not self._primary:
      return
    try:
      _wait_for_orbax_threads()
      for left in self.directory.glob(f"{tag}{ORBAX_TMP}*"):
        shutil.rmtree(left, ignore_errors=True)
      if (self.directory / tag).is_dir() and not layout.is_complete(self.directory / tag):
        _remove(self.directory / tag)
    except OSError:  # what cannot be removed stays; the next Checkpointer removes it
      pass

  def _failed(self, tag: str, error: BaseException) -> CheckpointError:
    """The one message of a failed save: its cause, what was kept, the checkpoints intact."""
    kept = ("it is complete, but 'latest' could not be moved to it" if layout.is_complete(
        self.directory / tag) else "nothing of it was kept")
    return CheckpointError(f"saving checkpoint {tag!r} to {self.directory} failed: "
                           f"{_cause(error)}; {kept}. The checkpoints saved before are intact: "
                           f"{layout.all_tags(self.directory)}.")

  def _prune(self, newest: str) -> None:
    """Deletes the checkpoints older than the newest ``keep`` (module docstring, *Retention*).

    Runs after ``newest`` is complete and ``latest`` has moved. Orbax's ``LatestN`` (what
    ``CheckpointManager``'s ``max_to_keep`` becomes) decides among the complete checkpoints up to
    ``newest``, oldest first; those after it and the one ``latest`` names are never deleted. A
    checkpoint is renamed away first, so a deletion cut short never leaves something that looks
    like a checkpoint.
    """
    if self.keep is None:
      return
    tags = layout.all_tags(self.directory)
    candidates = tags[:tags.index(newest) + 1]
    preserve = ocp.checkpoint_managers.LatestN(n=self.keep).should_preserve(
        [_SavedCheckpoint.of(self.directory, tag) for tag in candidates],
        context=ocp.checkpoint_managers.PreservationContext())
    named = layout.latest_tag(self.directory)
    for tag, kept in zip(candidates, preserve):
      if not kept and tag != named:
        _remove(self.directory / tag)

  def wait_until_finished(self, *, sync_processes: bool = True) -> None:
    """Blocks until the last save is committed and ``latest`` names it; raises if it failed.

    With several processes it ends with a barrier (only the primary moves ``latest``), unless
    ``sync_processes`` is False (at interpreter exit, when JAX's distributed runtime may be gone).
    """
    if self._finalizer is not None:
      self._finalizer.join()
      self._finalizer = None
      self._pending = None
      if sync_processes and jax.process_count() > 1:
        multihost_utils.sync_global_devices("jzero-checkpoint-finalized")
    if self._failure is not None:
      tag, error = self._failure
      self._failure = None
      raise self._failed(tag, error) from None

  def close(self) -> None:
    """Waits for the last save and releases Orbax's resources and the directory's claim."""
    try:
      self.wait_until_finished()
    finally:
      self._orbax.close()
      if _CHECKPOINTERS.get(self.directory) is self:
        del _CHECKPOINTERS[self.directory]
      if self._primary:
        claim_lib.release(self.directory)


def _remove(path: Path) -> None:
  """A directory removed, renamed away first (a removal cut short never looks like a
  checkpoint)."""
  doomed = path.with_name(path.name + DELETING)
  os.rename(path, doomed)
  shutil.rmtree(doomed)


def _agree(error: CheckpointError | None, what: str) -> None:
  """Raises ``error`` (the primary's) in every process: with several processes the primary's
  outcome is broadcast, so no process waits for a save the primary refused."""
  if jax.process_count() > 1:
    failed = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if failed and error is None:
      raise CheckpointError(f"{what} failed in process 0 (the primary, which writes the "
                            f"checkpoint's directory); its log says why.")
  if error is not None:
    raise error


def _cause(error: BaseException) -> str:
  """The innermost cause of a failed save, in a line (a disk's error as
  :func:`jzero.errors.describe_io_error` says it)."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  return describe_io_error(error) or (
      f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def _wait_for_orbax_threads(timeout_s: float = 60.0) -> None:
  """After a failed save: waits (at most ``timeout_s``) for Orbax's writer threads still running
  -- its commit raises at the first failed write while the others go on, and tensorstore creates
  the directories a late write needs -- so that what the save left can be removed for good."""
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if type(thread).__name__ == "_SignalingThread" and thread is not threading.current_thread():
      try:
        thread.join(max(0.0, deadline - time.monotonic()))
      except Exception:  # pylint: disable=broad-except  (its join re-raises its failure)
        pass


class _OrbaxFailureLine(logging.Filter):
  """Orbax logs a failed background save, each of its writer threads with a traceback; jzero
  raises the cause itself in one message (:meth:`Checkpointer.wait_until_finished`). So Orbax's
  error records about a directory a :class:`Checkpointer` writes are dropped, and its other error
  records keep their one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and "orbax" in record.pathname:
      message = record.getMessage()
      if any(str(directory) in message for directory in _CHECKPOINTERS):
        return False
      record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def _quiet_orbax_failures() -> None:
  """Installs :class:`_OrbaxFailureLine` on the logger Orbax writes to (absl's), once."""
  logger = logging.getLogger("absl")
  if not any(isinstance(f, _OrbaxFailureLine) for f in logger.filters):
    logger.addFilter(_OrbaxFailureLine())


_CHECKPOINTERS: dict[Path, Checkpointer] = {}


def writer(directory: str | os.PathLike, keep: int | None = None) -> Checkpointer:
  """This process's :class:`Checkpointer` of ``directory``, made (the directory created, checked
  and claimed: :mod:`jzero.checkpoint.claim`) on first use and kept for the life of the process.
  ``jzero.train.loop.init_or_resume`` calls it before anything else, so a second run given a
  directory in use is refused at its start."""
  path = layout.check_path(directory)
  ckpt = _CHECKPOINTERS.get(path)
  if ckpt is None:
    ckpt = _CHECKPOINTERS[path] = Checkpointer(path, keep=keep)
  elif keep is not None:
    ckpt.keep = keep
  return ckpt


def save_checkpoint(plan: Plan, state: Any, resources: Resources, directory: str | os.PathLike,
                    tag: str | int | None = None, *, config: Any, tx: Any,
                    keep: int | None = None, client_state: dict | None = None,
                    save_latest: bool = True) -> str:
  """Starts an asynchronous save of ``state`` into ``directory/<tag>`` (see :class:`Checkpointer`).

  One :class:`Checkpointer` per directory is kept for the life of the process, so consecutive
  saves overlap training; :func:`wait_until_finished` waits for them, and so does the end of the
  program. Returns the tag.

  Args:
    plan: the plan ``state`` is laid out by.
    state: the train state; it may be donated to the next train step right after this returns.
    resources: the plan's tiers' resources (:data:`jzero.tiers.base.Resources`).
    directory: the checkpoint directory (created if missing; may be relative).
    tag: the checkpoint's name (default: the state's step), e.g. ``"epoch_0"``.
    keep: keep only the newest ``keep`` checkpoints in ``directory`` (None: all, or as set before).
    client_state: JSON-serialisable user data stored with the checkpoint.
    save_latest: move ``latest`` to this checkpoint (DeepSpeed's ``save_latest``).
    config, tx: the run's resolved config and optax transformation (recorded, as
      :meth:`Checkpointer.save` says).
  """
  if directory is None or not hasattr(state, "opt_state"):  # DeepSpeed's (save_dir, tag)
    given = f"{state!r}" if isinstance(state, (str, os.PathLike)) else type(state).__name__
    raise JZeroError(
        f"save_checkpoint({given}, ...): jzero saves the state you pass, first: "
        f"engine.save_checkpoint(state, directory, tag) (DeepSpeed's save_checkpoint(save_dir, "
        f"tag) saves the engine's own state; jzero's state is what train_step returned).")
  return writer(directory, keep).save(plan, state, resources, tag, config=config, tx=tx,
                                             client_state=client_state, save_latest=save_latest)


def wait_until_finished(directory: str | os.PathLike | None = None) -> None:
  """Blocks until the saves started by :func:`save_checkpoint` (in ``directory``, default all) are
  finalized, with ``latest`` naming them; raises :class:`CheckpointError` if one failed."""
  paths = list(_CHECKPOINTERS) if directory is None else [Path(directory).absolute()]
  for path in paths:
    if path in _CHECKPOINTERS:
      _CHECKPOINTERS[path].wait_until_finished()


# --- exit ----------------------------------------------------------------------------------------

_EXIT_HOOK = threading.Lock()
_exit_hook_installed = False


def _wait_at_exit() -> None:
  """Installs (once) the wait for pending saves at the end of the main thread.

  ``threading._register_atexit`` callbacks run when the main thread has finished, before Python
  joins the other threads and, last registered first, before ``concurrent.futures`` stops
  accepting work -- Orbax's commit needs its thread pools, so a plain ``atexit`` hook is too late
  ("cannot schedule new futures after shutdown"). Installed after Orbax is imported, so it runs
  first.
  """
  global _exit_hook_installed
  with _EXIT_HOOK:
    if not _exit_hook_installed:
      threading._register_atexit(_finish_at_exit)  # pylint: disable=protected-access
      _exit_hook_installed = True


def _finish_at_exit() -> None:
  """No process exits with a save half-written; a failed one makes the exit status 1."""
  for ckpt in list(_CHECKPOINTERS.values()):
    finalizer, tag = ckpt._finalizer, ckpt._pending  # pylint: disable=protected-access
    if finalizer is not None:
      finalizer.join(timeout=1.0)
      if finalizer.is_alive():
        print(f"jzero: writing checkpoint {tag!r} in {ckpt.directory} before exiting...",
              file=sys.stderr, flush=True)
    try:
      ckpt.wait_until_finished(sync_processes=False)
    except CheckpointError as e:
      print(f"jzero: error: {e}", file=sys.stderr, flush=True)
      sys.stdout.flush()
      claim_lib.release(ckpt.directory)
      os._exit(1)
    claim_lib.release(ckpt.directory)  # (a process that claimed nothing releases nothing)
