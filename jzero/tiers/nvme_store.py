"""ZeRO-Infinity's NVMe tier: fp32 master and optimizer state of chosen leaves in a tensorstore
store.

``zero_optimization.offload_optimizer: {"device": "nvme", "nvme_path": DIR}`` (stages 1-3) gives the
chosen leaves (all of them, or ``ratio`` of the parameters, largest first, as the host tier's
:func:`jzero.tiers.host_optimizer.choose_offloaded`) the *NVMe tier* of the plan
(``LeafPlan.state_tier == "nvme"``): their optimizer state -- and in bf16 / fp16 training their fp32
master -- lives only in a tensorstore store on disk. DeepSpeed needs a libaio build for this
(DeepSpeed #6972, #6920); tensorstore's ``file`` kvstore needs nothing.

**Where.** One store per process and plan, under
``<nvme_path>/zero_stage_<n>/<host>-<pid>-<UTC time>-<uuid>/process_<i>/`` (DeepSpeed's
``zero_stage_3/`` layout): the pid and a fresh uuid make the name unique between two engines of one
process, two processes and two runs. Each sub-group (below) is, per slot, one zarr3 array of shape
``(local devices, elements)`` with one uncompressed chunk per row -- one file per device, written
in one request and fsync'ed, the devices' files in parallel: a row is one device's partitions of
the group's arrays (a leaf's master, then its optimizer moments) end to end, so the process writes
exactly the shards its devices hold, and the disk sees few large files instead of one small file
per array and device (that layout measured 0.03 of the disk's raw write bandwidth, fsync per small
file dominating; one file for all rows 0.42, bench/nvme.py). The directory
is removed when the store is garbage-collected or the process exits normally; a killed process, or
one that ends on a step it could not write (below), leaves it, and the next store opened under the
same ``nvme_path`` warns about it (:mod:`jzero.tiers.nvme_runs`). Paths are checked before any device work: a missing
``nvme_path``, a path that is not a writable directory (a probe file is written and fsync'ed), and,
when the plan exists, too little free space for both slots (``shutil.disk_usage``) are a
:class:`~jzero.errors.ConfigError` naming the path and the fix.

**The TrainState** keeps, for an NVMe leaf, *placeholders*: its master / optimizer-moment arrays
have the leaf's layout with the shard dimension of size 0 (0 bytes; the tree structure and
partition specs are those of every other plan, so optax, the step's ``shard_map`` and the donation
machinery see nothing new). Compute params and gradients stay on the device.

**The step** splits in two. The jitted step (:mod:`jzero.train.step`) computes, reduces, unscales
and clips the gradients of every leaf, updates device-tier leaves, and returns for the NVMe leaves
their fp32 gradient partitions, (fp32 training) their master partitions -- the params' own slices
-- and the optimizer state's non-parameter leaves (Adam's count) *before* the step. Then
:meth:`NvmeStore.update` walks the NVMe leaves in sub-groups of at most ``sub_group_size``
elements per device (whole leaves; a larger leaf is a group of its own): the group's arrays are read
from the committed slot (futures of parallel row reads), updated by a jitted ``shard_map`` running
the same optax ``tx.update`` on the same partitions as the device path (so fp32 results equal the
non-offloaded step; tests: 1e-6), which also casts (and in stages 1/2 all-gathers) the group's new
compute params, and written to the other slot. With ``pipeline_read`` the reads of the next
``buffer_count - 1`` groups are in flight while a group is updated; with ``pipeline_write`` a
group's writes proceed while the next groups are read and updated (at most ``buffer_count`` groups'
writes pending); without them each read / write is waited for. :meth:`NvmeStore.update` returns
once every write is committed and the manifest names the new step: that is the step's commit point;
the engine's ``train_step`` returns after it. A skipped step (its gradient not finite) writes nothing and
moves the manifest's step only.

**Crash consistency.** Two slots, ``slot_a`` and ``slot_b``: step t reads the slot the manifest
names and writes the other; the manifest (``manifest.json``: step, slot, arrays) is replaced
atomically (write, fsync, ``os.replace``, fsync of the directory) only after every write of the step
is committed (tensorstore's ``file`` kvstore writes each chunk to a temporary file, renames it and,
with ``file_io_sync``, fsyncs); reads go to the committed chunk files directly (``os.preadv`` of
each row, the rows in parallel, :func:`read_file_into`): zarr3 chunks with only the ``bytes``
codec are the raw rows, and this measured faster than tensorstore's read of them. A process killed
during a step therefore leaves a store whose manifest names the last completed step and a slot
nobody was writing. :func:`jzero.tiers.nvme_state.open_committed` reads
it back (or refuses clearly: no manifest -- killed before the first commit --, or a slot with
missing files). Resuming training goes through checkpoints (below), as in DeepSpeed, whose swap
files are scratch space too.

**A write that fails** (a full disk, an I/O error; :func:`jzero.errors.describe_io_error` tells it
from a bug) loses nothing. During a step the update waits for every read and write still in
flight, drops what it staged for the parameter reader, leaves the manifest as it was -- the store
still commits the previous step -- and raises :class:`~jzero.errors.StepNotCommitted` naming the
path, the cause, the bytes a step writes and those free; the run directory is then kept at exit
until a step commits. The jitted step's outputs are whole: the group update donates only what it
read from the disk, never the gradients or fp32 training's masters. So the error's ``finish()``,
once there is room, runs the update again from the committed slot and those outputs -- the same
numbers bitwise -- and returns the step's state and metrics. Outside a step (the initial state, a
restore) a failed write is an :class:`NvmeStoreError` naming the path and the cause.

**Settings** (:mod:`jzero.tiers.nvme_settings`; DeepSpeed's names -> tensorstore):
``aio.queue_depth`` -> the context's ``file_io_concurrency`` limit (concurrent file operations) and
the reading threads, ``aio.intra_op_parallelism`` -> ``data_copy_concurrency`` (threads copying /
encoding chunks); ``buffer_count``, ``pipeline_read``, ``pipeline_write`` and ``sub_group_size`` as
above; the cache pool is 0 bytes (every read goes to the disk, nothing is held twice in host
memory); tensorstore's ``file_io_mode`` stays ``default`` (:data:`IO_MODE`: O_DIRECT and memmap
measured no better for writes, bench/nvme.py). ``aio.block_size``, ``single_submit`` and
``overlap_events`` tune libaio requests that tensorstore does not make (each file is written in
one request): a warning each. DeepSpeed's default ``intra_op_parallelism`` of 1 leaves one thread
to copy the chunks; the disk's bandwidth needs several (bench/nvme.py sets 8). ``aio.use_gds``
(GPUDirect Storage) is refused. ``offload_param.device: nvme`` puts the stage-3 parameters in this
store too (:mod:`jzero.tiers.nvme_params`: their masters are stored even in fp32, and the update
writes no compute param for them). A client optax optimizer (``initialize(optimizer=...)``) is
refused: the group update needs an elementwise optimizer (jzero's Adam, AdamW, Lion, SGD).

**Checkpoints and reports** read the store: ``save_checkpoint`` reads the committed slot into
arrays laid out by the plan and saves them with Orbax like the rest
(:func:`jzero.tiers.nvme_state.full_state`); ``load_checkpoint`` restores them in their real shapes
(:func:`~jzero.tiers.nvme_state.expand_abstract`) and writes them into the store
(:func:`~jzero.tiers.nvme_state.absorb`), so a checkpoint moves between tiers (nvme <-> device /
host) exactly. ``logical_params`` reads the master from the store. The memory report measures the
NVMe bytes from the committed slot's files (per device: a file's size over its rows, split into
master and optimizer by the layout) next to the estimator's ``nvme`` tier, and prints the process's
store directory and its bytes on disk.

**Why one module of 700 lines.** The store's write, read and commit protocol is one piece: the
two slots, the manifest that commits a step, the reads that trust it and what a failed write
leaves are correct only together -- a process killed in any phase must leave the last committed
step readable (tests/tiers/test_nvme.py kills it in each one), a failed write must leave it
committed (tests/tiers/test_nvme_faults.py) -- so :class:`NvmeStore` is kept whole; what the step
hands it is :mod:`jzero.tiers.nvme`'s, its layout in a TrainState :mod:`jzero.tiers.nvme_state`'s,
its directories on disk :mod:`jzero.tiers.nvme_runs`'.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import shutil
import warnings
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jzero.comm import layouts, program
from jzero.errors import (ConfigError, JZeroError, JZeroWarning, StepNotCommitted,
                          describe_io_error)
from jzero.tiers.nvme_settings import (IO_MODE, NVME, NvmeSettings, check_directory, io_context,
                                 settings_from_config)
from jzero.tiers import nvme_runs, where
from jzero.tiers.host_optimizer import split_state
from jzero.tiers.nvme_params import ParamReader
from jzero.tiers.updates import placeholder_shape

__all__ = ["NVME", "NvmeSettings", "NvmeStoreError", "NvmeStore", "params_def", "settings_from_config",
           "check_directory", "IO_MODE", "io_context", "MANIFEST",
           "SLOTS", "FORMAT", "read_file_into"]

PyTree = Any
MANIFEST = "manifest.json"
SLOTS = ("a", "b")
FORMAT = "jzero-nvme"


class NvmeStoreError(JZeroError):
  """An NVMe store cannot be read back (no committed step, or a committed slot is incomplete)."""


def read_file_into(path: str | os.PathLike, out: np.ndarray, offset: int = 0) -> np.ndarray:
  """Fills the contiguous array ``out`` with the bytes of ``path`` from byte ``offset`` on
  (``os.preadv`` into its memory, no copy); OSError on a short file."""
  view, done, size = memoryview(out).cast("B"), 0, out.nbytes
  fd = os.open(path, os.O_RDONLY)
  try:
    while done < size:
      n = os.preadv(fd, [view[done:]], offset + done)
      if n <= 0:
        raise OSError(f"{path}: {size - done} bytes missing at byte {offset + done}")
      done += n
  finally:
    os.close(fd)
  return out


def params_def(plan: Any) -> Any:
  """The tree structure of ``plan``'s params (what the optimizer state's param-like nodes have)."""
  return jax.tree.structure(plan.map(lambda _: 0))


# -- the store -------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_manifest(directory: Path, doc: dict) -> None:
  tmp = directory / (MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(doc, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, directory / MANIFEST)
  _fsync_dir(directory)


def _dir_bytes(path: Path, data_only: bool = False) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      if data_only and (name == "zarr.json" or name.startswith(MANIFEST)):
        continue
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


@dataclasses.dataclass(frozen=True)
class _Stored:
  """One stored array: a leaf's master (node -1) or its k-th param-like optimizer node, at
  ``offset`` (elements) of each device's row of its group's file."""

  name: str
  leaf: Any  # LeafPlan
  what: str  # "master" or "state<k>"
  node: int
  group: int
  offset: int
  numel: int  # elements of one device's partition


class NvmeStore:
  """The NVMe tier of one plan in this process (see the module docstring): ``plan``'s leaves on the
  tier, kept as ``settings`` say, updated by ``tx`` (an elementwise optax transformation).

  Attributes:
    directory: this process's store directory (``.../process_<i>``).
    run_directory: the run's directory (``.../zero_stage_<n>/<unique>``), removed at exit.
    groups: the sub-groups, lists of indices into ``leaves``.
    step: the committed step (None before the first commit); slot: the committed slot.
  """

  def __init__(self, plan: Any, settings: NvmeSettings, tx: optax.GradientTransformation):
    import tensorstore as ts  # pylint: disable=import-outside-toplevel
    self._ts = ts
    self.settings, self.plan, self.tx = settings, plan, tx
    # the leaves whose state is here, and the params here (their state here too, or a copy of
    # the param whose master and state live on the host or the device: jzero.tiers.nvme_params)
    self.leaves = [l for l in plan.leaf_list() if l.state_tier == NVME or l.param_tier == NVME]
    self.copies = any(where.param_copy_on_nvme(l) for l in self.leaves)
    self._position = {l.path: i for i, l in enumerate(plan.leaf_list())}
    abstract = jax.eval_shape(tx.init, plan.abstract_master())
    self.params_def = params_def(plan)
    self._node_def, _, self._flags = split_state(abstract, self.params_def)
    self.param_nodes = [k for k, f in enumerate(self._flags) if f]
    mesh = plan.mesh.mesh
    self.devices = sorted((d for d in mesh.devices.flat if d.process_index == jax.process_index()),
                          key=lambda d: d.id)
    self._sharding = {l.path: plan.sharding(plan.state_spec(l)) for l in self.leaves}
    self._shard_shape = {l.path: tuple(self._sharding[l.path].shard_shape(l.padded_shape))
                         for l in self.leaves}
    self.groups = self._make_groups()
    stored, self.group_numel = [], []
    for g, group in enumerate(self.groups):
      offset = 0
      for i in group:
        l = self.leaves[i]
        pos, numel = self._position[l.path], math.prod(self._shard_shape[l.path])
        stores_master = plan.has_master or l.param_tier == NVME
        stores_state = l.state_tier == NVME
        names = ([(f"{pos:05d}.master", "master", -1)] if stores_master else []) + [
            (f"{pos:05d}.state{j}", f"state{j}", j)
            for j in range(len(self.param_nodes) if stores_state else 0)]
        for name, what, node in names:
          stored.append(_Stored(name, l, what, node, g, offset, numel))
          offset += numel
      self.group_numel.append(offset)
    self.stored = stored
    # the parameters on the tier (jzero.tiers.nvme_params), read inside the step by this reader; it
    # checks its buffers against the largest layer before anything is written
    self.reader = ParamReader(self) if where.params_on_nvme(plan) else None
    self.bytes_per_slot = len(self.devices) * sum(self.group_numel) * 4
    stale = nvme_runs.stale_runs(settings.path)  # stores of gone processes (nvme_runs)
    free = shutil.disk_usage(settings.path).free
    if 2 * self.bytes_per_slot > free:
      held = sum(r.bytes for r in stale)
      reclaim = (f" ({held:,} bytes of it are held by {len(stale)} stores of gone processes: "
                 f"`jzero nvme-stores {settings.path} --reclaim` removes them)" if stale else "")
      raise ConfigError(
          f"{settings.key}={settings.path}: the NVMe tier needs {2 * self.bytes_per_slot:,} bytes in this "
          f"process (two slots of {self.bytes_per_slot:,}: fp32 master and optimizer state of "
          f"{len(self.leaves)} leaves), and the file system has {free:,} free{reclaim}. Free "
          f"space there, point nvme_path at a larger drive, or lower offload_optimizer.ratio.")
    if stale:
      warnings.warn(nvme_runs.describe_stale(settings.path, stale), JZeroWarning, stacklevel=2)
    self.run_directory = (settings.path / f"zero_stage_{plan.stage}" / nvme_runs.run_name())
    self.directory = self.run_directory / f"process_{jax.process_index()}"
    self.directory.mkdir(parents=True, exist_ok=False)
    # removed at exit or garbage collection, unless a step that could not be written keeps it
    self._kept = [False]
    self._cleanup = weakref.finalize(self, nvme_runs.remove_unless_kept, str(self.run_directory),
                                     self._kept)
    self._context = ts.Context(io_context(settings))
    self._io = concurrent.futures.ThreadPoolExecutor(max_workers=settings.queue_depth,
                                                     thread_name_prefix="jzero-nvme-read")
    self._arrays = {slot: [self._open(slot, g) for g in range(len(self.groups))]
                    for slot in SLOTS}
    self.step: int | None = None
    self.slot: str | None = None
    self._fns: dict[int, Any] = {}
    self._init_fns: dict[int, Any] = {}
    self._refresh: Any = None  # hpZ: the secondary partitions' program

  # -- layout --------------------------------------------------------------------------------------
  def _make_groups(self) -> list[list[int]]:
    groups: list[list[int]] = []
    used = 0
    for i, l in enumerate(self.leaves):
      numel = math.prod(self._shard_shape[l.path])
      if groups and used + numel <= self.settings.sub_group_size:
        groups[-1].append(i)
        used += numel
      else:
        groups.append([i])
        used = numel
    return groups

  def _open(self, slot: str, g: int):
    """Group ``g``'s array in a slot: (local devices, elements), one file per device's row."""
    shape = [len(self.devices), self.group_numel[g]]
    spec = {"driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(self.directory / f"slot_{slot}" / f"group_{g}")},
            "metadata": {"shape": shape, "data_type": "float32",
                         "chunk_grid": {"name": "regular",
                                        "configuration": {"chunk_shape": [1, shape[1]]}},
                         "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]},
            # every row is a file, also an all-zero one (padding, fresh moments): a committed
            # slot is complete, and its files' sizes are what the memory report counts
            "store_data_equal_to_fill_value": True}
    return self._ts.open(spec, create=True, delete_existing=True, context=self._context).result()

  def chunk_file(self, slot: str, g: int, row: int) -> Path:
    """The file of device row ``row`` of group ``g`` in a slot (zarr3's chunk key ``c/<row>/0``;
    uncompressed little-endian fp32, the row's elements in order)."""
    return self.directory / f"slot_{slot}" / f"group_{g}" / "c" / str(row) / "0"

  def partition_rows(self) -> dict[int, int]:
    """Partition index along the ZeRO axes -> the row of a local device holding that partition."""
    leaf = self.leaves[0]
    d = leaf.shard_dim % len(leaf.padded_shape)
    length = self._shard_shape[leaf.path][d]
    index_map = self._sharding[leaf.path].devices_indices_map(leaf.padded_shape)
    out: dict[int, int] = {}
    for row, device in enumerate(self.devices):
      out.setdefault((index_map[device][d].start or 0) // length, row)
    return out

  def _read_rows(self, slot: str, g: int) -> "concurrent.futures.Future[np.ndarray]":
    """Starts reading group ``g``'s rows from a slot: a future of the (local devices, elements)
    array. Each row is its chunk file's bytes (zarr3, uncompressed little-endian), read with
    ``os.preadv`` straight into the array, the rows in parallel: what the disk gives a plain read
    of the same files (tensorstore's own read measured 0.63 of that, bench/nvme.py)."""
    out = np.empty((len(self.devices), self.group_numel[g]), np.float32)
    rows = [self._io.submit(read_file_into, self.chunk_file(slot, g, r), out[r])
            for r in range(len(self.devices))]
    done = concurrent.futures.Future()

    def gather(_):
      if all(f.done() for f in rows) and not done.done():
        errors = [f.exception() for f in rows if f.exception() is not None]
        if errors:
          done.set_exception(errors[0])
        else:
          done.set_result(out)
    for f in rows:
      f.add_done_callback(gather)
    return done

  def read_into(self, slot: str, g: int, row: int, start: int, out: np.ndarray) -> np.ndarray:
    """Fills ``out`` (fp32) from device row ``row`` of group ``g`` in a slot, from element
    ``start`` on (the parameter tier's layer reads, jzero.tiers.nvme_params)."""
    return read_file_into(self.chunk_file(slot, g, row), out, start * 4)

  def _pending_rows(self, g: int, rows: np.ndarray) -> None:
    if self.reader is not None:
      self.reader.stage(g, rows)

  def _members(self, g: int) -> list[_Stored]:
    return [s for s in self.stored if s.group == g]

  # -- host <-> device -----------------------------------------------------------------------------
  def _to_global(self, s: _Stored, rows: np.ndarray) -> jax.Array:
    """Group rows (local devices, elements) -> the stored array ``s`` laid out by the plan."""
    leaf, shape = s.leaf, self._shard_shape[s.leaf.path]
    part = rows[:, s.offset:s.offset + s.numel]
    return jax.make_array_from_single_device_arrays(
        leaf.padded_shape, self._sharding[leaf.path],
        [jax.device_put(part[r].reshape(shape), d) for r, d in enumerate(self.devices)])

  def _pack(self, g: int, values: dict[str, jax.Array]) -> np.ndarray:
    """Group ``g``'s stored arrays (name -> global array) as its file's rows."""
    buf = np.empty((len(self.devices), self.group_numel[g]), np.float32)
    for s in self._members(g):
      x = jax.device_put(values[s.name], self._sharding[s.leaf.path])
      by_device = {shard.device: shard.data for shard in x.addressable_shards}
      for r, d in enumerate(self.devices):
        buf[r, s.offset:s.offset + s.numel] = np.asarray(by_device[d]).reshape(-1)
    return buf

  def _write(self, slot: str, g: int, buf: np.ndarray):
    """Starts writing group ``g``'s rows into a slot; the commit future."""
    return self._arrays[slot][g].write(buf).commit

  def _commit(self, step: int, slot: str) -> None:
    doc = {"format": FORMAT, "version": 1, "step": int(step), "slot": slot,
           "devices": [str(d) for d in self.devices],
           "groups": [{"name": f"group_{g}", "shape": [len(self.devices), self.group_numel[g]],
                       "members": {s.name: {"leaf": s.leaf.path, "what": s.what,
                                            "offset": s.offset, "numel": s.numel,
                                            "partition": list(self._shard_shape[s.leaf.path])}
                                   for s in self._members(g)}}
                      for g in range(len(self.groups))]}
    _write_manifest(self.directory, doc)
    self.step, self.slot = int(step), slot
    self._kept[0] = False  # consistent again: removed at exit
    if self.reader is not None:
      self.reader.committed()

  @property
  def _other(self) -> str:
    return SLOTS[1] if self.slot == SLOTS[0] else SLOTS[0]

  # -- writing a whole state -----------------------------------------------------------------------
  def write_masters(self, step: int, masters: dict[str, jax.Array]) -> None:
    """Fresh optimizer state (``tx.init``) for the NVMe leaves from their fp32 masters (state
    layout), written with the masters (mixed precision) into a slot and committed as ``step``."""
    def group_values(g: int) -> dict[str, jax.Array]:
      group = self.groups[g]
      if g not in self._init_fns:
        def init(ms):
          nodes = self._node_def.flatten_up_to(self.tx.init(ms))
          return [n for n, f in zip(nodes, self._flags) if f]
        self._init_fns[g] = jax.jit(init)
      ms = [masters[self.leaves[i].path] for i in group]
      stores_state = any(s.node >= 0 for s in self._members(g))
      states = self._init_fns[g](ms) if stores_state else None  # (copies of params: no state)
      index = {self.leaves[i].path: j for j, i in enumerate(group)}
      return {s.name: ms[index[s.leaf.path]] if s.node < 0 else states[s.node][index[s.leaf.path]]
              for s in self._members(g)}
    self._outside_step(f"the initial state (step {step})",
                       lambda: self._write_slot(step, group_values))

  def write_state(self, state: Any) -> None:
    """Writes a TrainState whose NVMe leaves hold real arrays (a restore) and commits its step."""
    self._outside_step(f"the restored state (step {int(state.step)})",
                       lambda: self._write_state(state))

  def _write_state(self, state: Any) -> None:
    # the masters: fp32 training's are the params (stored here for the NVMe-tier params only)
    source = state.master if self.plan.has_master else state.params
    flat_m = dict(zip([l.path for l in self.plan.leaf_list()], jax.tree.leaves(source)))
    _, nodes, _ = split_state(state.opt_state, self.params_def)
    self._write_slot(int(state.step), lambda g: {
        s.name: flat_m[s.leaf.path] if s.node < 0
        else nodes[self.param_nodes[s.node]][self._position[s.leaf.path]]
        for s in self._members(g)})

  def _write_slot(self, step: int, group_values: Any) -> None:
    """Every group's arrays (``group_values(g)``: stored name -> array) written into the slot not
    committed now (the first slot for a new store), then committed as ``step``."""
    slot = self._other if self.slot is not None else SLOTS[0]
    futures = []
    try:
      for g in range(len(self.groups)):
        rows = self._pack(g, group_values(g))
        futures.append(self._write(slot, g, rows))
        self._pending_rows(g, rows)
      for f in futures:
        f.result()
      self._commit(step, slot)
    except BaseException:
      self._abandon(futures)
      raise

  def _abandon(self, futures: Any) -> None:
    """After a failed write: every I/O still in flight is waited for (its error dropped: the
    first one is being raised), so none lands after a retry's writes; the rows staged for the
    parameter reader go (the slot they were written to is not committed)."""
    for f in futures:
      try:
        f.result()
      except Exception:  # pylint: disable=broad-except
        pass
    if self.reader is not None:
      self.reader.discard()

  def _outside_step(self, what: str, write: Any) -> None:
    """``write()`` (a whole state into the store, outside a step); a disk's failure there is an
    NvmeStoreError naming the path and the cause (nothing else changed: the source of the state --
    the initial params, a checkpoint -- is where it was)."""
    try:
      write()
    except Exception as e:  # pylint: disable=broad-except  (describe_io_error sorts it)
      cause = describe_io_error(e)
      if cause is None:
        raise
      raise NvmeStoreError(
          f"the NVMe tier could not write {what} into {self.directory}: {cause}. It needs "
          f"{self.bytes_per_slot:,} bytes there per slot (two slots); nothing else was changed. "
          f"Free space there (or fix the disk) and try again.") from None

  def _step_write(self, state: Any, metrics: dict, write: Any) -> Any:
    """``write()``, the store's share of the step that made ``state``; a disk's failure there is a
    :class:`~jzero.errors.StepNotCommitted` whose ``finish()`` runs ``write()`` again (the step's
    outputs are kept whole for it: :meth:`_group_fn` donates only what it read from the disk),
    and the run directory is kept at exit until a step commits."""
    step, committed = int(state.step), (self.step, self.slot)
    try:
      return write()
    except Exception as e:  # pylint: disable=broad-except  (describe_io_error sorts it)
      cause = describe_io_error(e)
      if cause is None:
        raise
    self._kept[0] = True

    def finish() -> tuple[Any, dict]:
      if (self.step, self.slot) != committed:
        raise NvmeStoreError(
            f"step {step} can no longer be finished: the NVMe store in {self.directory} has "
            f"committed step {self.step} since (a restore or another step). Train on from the "
            f"state that step belongs to.")
      return self._step_write(state, metrics, write), metrics

    raise StepNotCommitted(
        nvme_runs.write_failure(self.directory, self.run_directory, self.settings.path, step,
                                self.step, cause, self.bytes_per_slot),
        step=step, committed=self.step, path=str(self.directory), finish=finish)

  def write_copies(self, state: Any, metrics: dict) -> Any:
    """After a step whose params are copies on the tier (:func:`jzero.tiers.where.
    param_copy_on_nvme`): their new values, the state's masters, written to the other slot and
    committed as the step (a skipped step commits the unchanged slot under the new step).
    Returns ``state``; a failed write is a :class:`~jzero.errors.StepNotCommitted`."""
    def write() -> Any:
      if bool(metrics["overflow"]):
        self._commit(int(state.step), self.slot)
      else:
        self._write_state(state)
      return state
    return self._step_write(state, metrics, write)

  def read(self) -> dict[str, jax.Array]:
    """The committed slot's arrays as global arrays laid out by the plan: name -> array."""
    futures = [self._read_rows(self.slot, g) for g in range(len(self.groups))]
    out = {}
    for g, f in enumerate(futures):
      rows = f.result()
      out.update({s.name: self._to_global(s, rows) for s in self._members(g)})
    return out

  # -- the step ------------------------------------------------------------------------------------
  def _group_fn(self, g: int):
    if g in self._fns:
      return self._fns[g]
    plan = self.plan
    leaves = [self.leaves[i] for i in self.groups[g]]
    sspec = [plan.state_spec(l) for l in leaves]
    pspec = [plan.param_spec(l) for l in leaves]
    flags, node_def = self._flags, self._node_def
    n_nodes = len(self.param_nodes)
    n_other = len(flags) - n_nodes

    in_state = [l.param_tier != NVME for l in leaves]  # (the store keeps the others' params)
    read = self._masters_read(g)

    def body(g_list, factor, m_read, m_kept, s_lists, others):
      it_r, it_k = iter(m_read), iter(m_kept)
      m_list = [next(it_r) if r else next(it_k) for r in read]
      g_list = [g * factor for g in g_list]
      it_s, it_o = iter(s_lists), iter(others)
      state = jax.tree.unflatten(node_def, [next(it_s) if f else next(it_o) for f in flags])
      updates, state = self.tx.update(g_list, state, m_list)
      new_m = optax.apply_updates(m_list, updates)
      out = node_def.flatten_up_to(state)
      params = [layouts.compute_param(plan, l, x)
                for l, x, keep in zip(leaves, new_m, in_state) if keep]
      return new_m, [n for n, f in zip(out, flags) if f], params

    pspec = [s for s, keep in zip(pspec, in_state) if keep]
    in_specs = (sspec, P(), [s for s, r in zip(sspec, read) if r],
                [s for s, r in zip(sspec, read) if not r], [sspec] * n_nodes, [P()] * n_other)
    # what was read from the disk is donated; the step's outputs (gradients, fp32 training's
    # masters) are not: a failed write runs the group again from them (_step_write)
    fn = jax.jit(program.shard_map(plan, body, in_specs, (sspec, [sspec] * n_nodes, pspec)),
                 donate_argnums=(2, 4), compiler_options=program.compile_options(plan) or None)
    self._fns[g] = fn
    return fn

  def _masters_read(self, g: int) -> list[bool]:
    """Per leaf of group ``g``: whether its master is read from the store (else it is the step's
    output, fp32 training's param)."""
    stored = {s.leaf.path for s in self._members(g) if s.node < 0}
    return [self.leaves[i].path in stored for i in self.groups[g]]

  def update(self, state: Any, metrics: dict, io: dict) -> Any:
    """The NVMe leaves' update after the jitted step (module docstring); returns the state with
    the NVMe leaves' new compute params (and, with hpZ, the secondary partitions refreshed from
    them), after the step's writes are committed. A write that fails is a
    :class:`~jzero.errors.StepNotCommitted` (:meth:`_step_write`): the committed step stays, and
    its ``finish()`` runs this update again."""
    return self._step_write(state, metrics, lambda: self._update(state, metrics, io))

  def _update(self, state: Any, metrics: dict, io: dict) -> Any:
    settings, plan = self.settings, self.plan
    new_step = int(state.step)
    if bool(metrics["overflow"]):  # skipped step: the stored state is unchanged
      self._commit(new_step, self.slot)
      return state
    src, dst = self.slot, self._other
    ahead = settings.buffer_count - 1 if settings.pipeline_read else 0
    limit = settings.buffer_count if settings.pipeline_write else 0
    reads: dict[int, Any] = {}
    writes: collections.deque = collections.deque()  # commit futures, one per group
    new_params: dict[str, jax.Array] = {}
    try:
      self._update_groups(src, dst, io, reads, writes, new_params, ahead, limit)
      self._commit(new_step, dst)
    except BaseException:
      self._abandon([*writes, *reads.values()])
      raise
    params = plan.map(lambda l, p: new_params.get(l.path, p), state.params)
    state = state._replace(params=params)
    if plan.zeropp.hpz > 1:  # the secondary partitions of the new params, as the step makes them
      if self._refresh is None:
        self._refresh = layouts.refresh_program(plan)
      state = state._replace(secondary=self._refresh(params))
    return state

  def _update_groups(self, src: str, dst: str, io: dict, reads: dict, writes: Any,
                     new_params: dict, ahead: int, limit: int) -> None:
    """The sub-groups read from ``src``, updated and written to ``dst`` (``reads`` / ``writes``:
    the futures in flight, which the caller waits for if this raises); the new compute params
    into ``new_params``."""
    groups = self.groups
    for g, group in enumerate(groups):
      for k in range(g, min(len(groups), g + 1 + ahead)):
        if k not in reads:
          reads[k] = self._read_rows(src, k)
      rows = reads.pop(g).result()
      data = {s.name: self._to_global(s, rows) for s in self._members(g)}
      leaves = [self.leaves[i] for i in group]
      pos = [self._position[l.path] for l in leaves]
      g_list = [io["grads"][l.path] for l in leaves]
      read = self._masters_read(g)
      m_read = [data[f"{p:05d}.master"] for p, r in zip(pos, read) if r]
      m_kept = [io["master"][l.path] for l, r in zip(leaves, read) if not r]
      s_lists = [[data[f"{p:05d}.state{j}"] for p in pos] for j in range(len(self.param_nodes))]
      new_m, new_s, params = self._group_fn(g)(g_list, io["factor"], m_read, m_kept, s_lists,
                                               io["nodes"])
      index = {l.path: j for j, l in enumerate(leaves)}
      values = {s.name: new_m[index[s.leaf.path]] if s.node < 0
                else new_s[s.node][index[s.leaf.path]] for s in self._members(g)}
      rows = self._pack(g, values)
      writes.append(self._write(dst, g, rows))
      self._pending_rows(g, rows)
      new_params.update({l.path: p for l, p in zip(
          [l for l in leaves if l.param_tier != NVME], params)})
      while len(writes) > limit:
        writes.popleft().result()
    while writes:
      writes.popleft().result()

  # -- the store's arrays in a TrainState (jzero.tiers.nvme_state.with_arrays) ------------------
  def placeholder(self, s: _Stored, dtype: Any) -> jax.Array:
    """A 0-byte placeholder for the stored array ``s`` (its leaf's layout, shard dim 0)."""
    return jax.device_put(np.zeros(placeholder_shape(s.leaf), dtype), self._sharding[s.leaf.path])

  # -- accounting ----------------------------------------------------------------------------------
  def measured_per_device(self) -> dict[str, int]:
    """Bytes of one device's partitions in the committed slot, from the group files' sizes (each
    file holds one row per local device), split by category along the layout: category
    ("master", "optimizer", "params": copies of params whose master lives elsewhere) -> bytes."""
    out = {"master": 0, "optimizer": 0, "params": 0}
    if self.slot is None:
      return out
    for g in range(len(self.groups)):
      per_device = _dir_bytes(self.directory / f"slot_{self.slot}" / f"group_{g}",
                              data_only=True) / len(self.devices)
      for s in self._members(g):
        out[_category(s)] += per_device * s.numel / self.group_numel[g]
    return {k: int(round(v)) for k, v in out.items()}

  def logical_bytes(self) -> dict[str, int]:
    """Global bytes of the stored arrays (all devices, as the TrainState's arrays count them)."""
    out = {"master": 0, "optimizer": 0, "params": 0}
    for s in self.stored:
      out[_category(s)] += math.prod(s.leaf.padded_shape) * 4
    return out

  def disk_bytes(self) -> int:
    """Bytes of every file of this process's store (both slots, metadata, manifest)."""
    return _dir_bytes(self.directory)

  def close(self) -> None:
    """Removes the run's directory now (it is removed at exit or garbage collection anyway)."""
    if self.reader is not None:
      self.reader.close()
    self._io.shutdown(wait=False, cancel_futures=True)
    self._cleanup()


def _category(s: _Stored) -> str:
  """The model-state category of a stored array (what the memory report counts it as)."""
  if where.param_copy_on_nvme(s.leaf):
    return "params"
  return "master" if s.node < 0 else "optimizer"
