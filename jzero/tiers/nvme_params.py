"""ZeRO-Infinity's parameter tier: stage-3 parameter partitions on NVMe, streamed layer by layer.

``zero_optimization.offload_param: {"device": "nvme", "nvme_path": DIR}`` (stage 3) gives every
*partitioned* param the plan's ``param_tier == "nvme"`` (persistent and 0-d leaves stay on the
device, as with ``device: cpu``). Such a leaf lives in the NVMe store of
:mod:`jzero.tiers.nvme_store`, with its fp32 master and its optimizer state beside it (``state_tier
== "nvme"``: the update reads and writes all three in one request per sub-group -- reads, updates
and writes of the sub-groups overlapped (``pipeline_read`` / ``pipeline_write`` on; with
``offload_optimizer.device: nvme`` too, its flags decide) --, and the store's two slots and manifest
make the parameters crash-safe exactly as the optimizer state). The TrainState keeps a 0-byte
placeholder for the param (as for the NVMe master), so between steps the device holds none of its
bytes.

**With the optimizer state on the host** (``offload_optimizer.device: cpu``, the ZeRO-Infinity
paper's headline config: "CPU: optimizer states; NVMe: parameters"), the leaf's fp32 master and
optimizer state live in pinned host memory (``state_tier == "host"``) and are updated by the host
tier's update inside the step (:mod:`jzero.tiers.host_optimizer`); the store then holds a *copy* of
the param (:func:`jzero.tiers.where.param_copy_on_nvme`, fp32), which the engine writes
from the new masters after the step and commits as the step
(:meth:`jzero.tiers.nvme_store.NvmeStore.write_copies`). In fp32 the state's param is the master, so
it stays in the TrainState -- in host memory --; in mixed precision the param is a placeholder and
the master is the state's. Reads are the same.

**Forward and backward.** The leaf reaches the model as a :class:`~jzero.comm.zero_param.ZeroParam`
whose ``partition`` is a zero *gradient slot* on the device and whose ``source`` is this leaf's
:class:`ParamSource`. ``gather()`` first reads the partition with :func:`fetch`: a
``jax.pure_callback`` into this process's :class:`ParamReader` with the layer index (the scan slices
the ``layer`` child like every other child, so a stacked leaf is read one layer at a time inside
:func:`jzero.scan_layers`) and the device's partition index; the read value, in fp32, is cast to
the compute dtype on the device (the cast the no-offload step makes from the master, so values are
identical). ``fetch`` is a ``custom_jvp`` whose tangent is the slot's: the gradient lands in the
slot, is reduce-scattered as usual and goes to the store's update after the step
(:meth:`jzero.tiers.nvme_store.NvmeStore.update`), which reads master and moments, updates them on
the device and writes the new master -- the new param -- to the other slot. A pure callback is
rematerialised like any other op: the backward scan reads each layer again (no gathered parameter is
saved), so the device holds one layer's partitions and gathered params at a time.

**Why one jitted step with callbacks.** The alternative, the step split into one jit per layer group
with Python moving the bytes between them, would cut XLA's schedule at every group (no overlap of a
layer's all-gather with the previous layer's compute, a dispatch per group), and the rematerialised
backward would need the groups in reverse with their residuals carried between jits. Staging the
whole partition in host memory before the step (the host tier's step unchanged) would hold every
partition in host memory during the step, which is what ``max_in_cpu`` bounds. A callback keeps the
step one program; the reader overlaps the disk with compute by prefetching (below).

**The reader** (one per process, :class:`ParamReader`) serves a request from, in order: the *host
cache* -- leaves chosen in plan order while their partitions on this process's devices total at
most ``max_in_cpu`` elements, kept in host memory as fp32 rows, refreshed from the update's own
writes (write-through) so that they are never read from the disk --; a *staging buffer* filled by
a prefetch; else a read of the committed slot's file (``os.preadv`` of the byte range in the
group file's chunk, :meth:`jzero.tiers.nvme_store.NvmeStore.read_into`: the store's zarr3 chunks are
uncompressed little-endian rows, so one layer's partition is one contiguous range; tensorstore
would read the whole chunk). After serving layer
``l`` of a stacked leaf it prefetches layer ``l + 1`` (or ``l - 1``, the direction of the last two
requests: the backward scan runs in reverse) into one of ``buffer_count`` staging buffers of at
most ``buffer_size`` elements, per device (a layer's partition larger than ``buffer_size`` is
refused before any device work, as DeepSpeed refuses it). ``stage3_prefetch_bucket_size: 0`` turns
the prefetch off. Host bytes of the tier are therefore at most ``max_in_cpu * 4 + buffer_count *
buffer_size * 4`` per local device (fp32: the store keeps the master; the compute param is cast from
it on the device) plus the rows of one sub-group while it is updated, which the optimizer tier's
update holds anyway (:func:`host_bytes_bound`).

**What it does not do.** The store keeps fp32 values (the master, or the copy of it), not a
16-bit copy, so in bf16 a layer read moves 4 bytes per element where DeepSpeed moves 2.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jzero.errors import ConfigError

__all__ = ["ParamSource", "ParamReader", "fetch", "fetch_group",
           "host_bytes_bound", "NVME"]

NVME = "nvme"


@dataclasses.dataclass(frozen=True, eq=False)
class ParamSource:
  """Where one leaf's partitions come from inside the step: the process's reader and the leaf's
  path; the ``axes`` its partition index runs over. Static (part of a ZeroParam's tree
  structure); compared by identity."""

  reader: "ParamReader"
  path: str
  axes: tuple[str, ...]

  def fetch(self, slot: jax.Array, layer: jax.Array) -> jax.Array:
    """The partition (this device's; layer ``layer`` of a stack) in ``slot``'s dtype."""
    return fetch(self, slot, layer)

  @staticmethod
  def fetch_many(sources: tuple, slots: tuple, layers: tuple) -> tuple:
    """Several leaves' partitions in one host callback (:func:`fetch_group`)."""
    return fetch_group(sources, slots, layers)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def fetch(source: ParamSource, slot: jax.Array, layer: jax.Array) -> jax.Array:
  """Reads ``source``'s partition (layer ``layer``) from the NVMe tier onto the device; its
  gradient goes to ``slot`` (a zero array of the partition's shape and the compute dtype)."""
  return _read(source, slot, layer)


@fetch.defjvp
def _fetch_jvp(source, primals, tangents):
  slot, layer = primals
  return _read(source, slot, layer), tangents[0]


def _read(source: ParamSource, slot: jax.Array, layer: jax.Array) -> jax.Array:
  return _read_group((source,), (slot,), (layer,))[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def fetch_group(sources: tuple[ParamSource, ...], slots: tuple, layers: tuple) -> tuple:
  """:func:`fetch` for several leaves in one host callback (a scanned layer's, a unit's)."""
  return _read_group(sources, slots, layers)


@fetch_group.defjvp
def _fetch_group_jvp(sources, primals, tangents):
  slots, layers = primals
  return _read_group(sources, slots, layers), tangents[0]


def _read_group(sources: tuple, slots: tuple, layers: tuple) -> tuple:
  part = lax.axis_index(sources[0].axes)
  out = tuple(jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in slots)
  reader = sources[0].reader
  requests = tuple((s.path, tuple(slot.shape)) for s, slot in zip(sources, slots))

  def read(layers, part):
    return tuple(reader.read(path, l, part, shape) for (path, shape), l in zip(requests, layers))
  values = jax.pure_callback(read, out, layers, part)
  return tuple(v.astype(s.dtype) for v, s in zip(values, slots))


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One NVMe-tier param in the store: its master's group and offset (elements) in each device row,
  elements of one device's partition, and of one layer of it."""

  group: int
  offset: int
  numel: int
  layers: int  # 1 for a leaf that is not stacked
  stacked: bool

  @property
  def layer_numel(self) -> int:
    return self.numel // self.layers


def host_bytes_bound(settings: Any, local_devices: int) -> int:
  """Host bytes the parameter tier may hold in one process: the host cache (``max_in_cpu``
  elements) and each local device's staging buffers (fp32; DeepSpeed's buffers are per rank)."""
  return 4 * (settings.max_in_cpu
              + local_devices * settings.param_buffer_count * settings.param_buffer_size)


class ParamReader:
  """The NVMe-tier params of one process: reads, host cache, prefetch (module docstring).

  Attributes:
    cached: paths of the leaves kept in host memory (``max_in_cpu``).
    disk_reads, cache_hits, prefetch_hits: counters of served requests (per layer and device).
  """

  def __init__(self, store: Any):
    settings = store.settings
    self.store, self.settings = store, settings
    self.entries: dict[str, _Entry] = {}
    for s in store.stored:
      if s.what == "master" and s.leaf.param_tier == NVME:
        # a layer's partition is contiguous in a row: the plan never splits the layer axis
        assert not (s.leaf.stacked and s.leaf.shard_dim % len(s.leaf.padded_shape) == 0)
        layers = s.leaf.padded_shape[0] if s.leaf.stacked else 1
        self.entries[s.leaf.path] = _Entry(s.group, s.offset, s.numel, layers, s.leaf.stacked)
    largest = max((e.layer_numel for e in self.entries.values()), default=0)
    if largest > settings.param_buffer_size:
      path = max(self.entries, key=lambda p: self.entries[p].layer_numel)
      raise ConfigError(
          f"zero_optimization.offload_param.buffer_size={settings.param_buffer_size:,}: the "
          f"parameter {path} has {largest:,} elements per device and layer, more than one staging "
          f"buffer holds. Set buffer_size to at least {largest:,} (DeepSpeed needs a buffer of "
          f"the largest parameter too).")
    rows = len(store.devices)
    self.cached: set[str] = set()
    held = 0
    for path, e in self.entries.items():
      if held + e.numel * rows > settings.max_in_cpu:
        break
      self.cached.add(path)
      held += e.numel * rows
    self.row_of = store.partition_rows()
    self._cache: dict[tuple[str, int], np.ndarray] = {}
    self._pending: dict[tuple[str, int], np.ndarray] = {}
    self._lock = threading.Lock()
    self._prefetched: dict[tuple, concurrent.futures.Future] = {}
    self._buffers = [0] * rows  # staging buffers in use, per device (DeepSpeed's are per rank)
    self._last: dict[tuple[str, int], int] = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=settings.queue_depth, thread_name_prefix="jzero-param-nvme")
    self.disk_reads = self.cache_hits = self.prefetch_hits = 0

  # -- the host cache, refreshed by the store's writes ---------------------------------------------
  def stage(self, group: int, rows: np.ndarray) -> None:
    """The rows just written for ``group`` (not committed yet): the cached leaves' new values."""
    for path in self.cached:
      e = self.entries[path]
      if e.group == group:
        for r in range(rows.shape[0]):
          self._pending[(path, r)] = rows[r, e.offset:e.offset + e.numel].copy()

  def discard(self) -> None:
    """The store's write failed: the rows staged since its last commit go (their slot was not
    committed); the cache keeps the committed values."""
    with self._lock:
      self._pending = {}

  def committed(self) -> None:
    """The store committed a slot: the staged rows become the cache; stale prefetches go."""
    with self._lock:
      if self._pending:
        self._cache, self._pending = self._pending, {}
      self._prefetched.clear()
      self._buffers = [0] * len(self.store.devices)

  # -- serving a request ---------------------------------------------------------------------------
  def _pread(self, slot: str, path: str, layer: int, row: int) -> np.ndarray:
    e = self.entries[path]
    out = np.empty(e.layer_numel, np.float32)
    return self.store.read_into(slot, e.group, row, e.offset + layer * e.layer_numel, out)

  def _one(self, slot: str, path: str, layer: int, row: int) -> np.ndarray:
    e = self.entries[path]
    cached = self._cache.get((path, row))
    if cached is not None:
      self.cache_hits += 1
      return cached[layer * e.layer_numel:(layer + 1) * e.layer_numel]
    with self._lock:
      future = self._prefetched.pop((slot, path, layer, row), None)
      self._buffers[row] -= future is not None
      last = self._last.get((path, row))
      self._last[(path, row)] = layer
    if future is not None:
      self.prefetch_hits += 1
      data = future.result()
    else:
      self.disk_reads += 1
      data = self._pread(slot, path, layer, row)
    if self.settings.prefetch and e.stacked:
      # the forward scan runs up the stack, the rematerialised backward down it
      step = (1 if layer == 0 else -1 if layer == e.layers - 1
              else -1 if last is not None and layer < last else 1)
      ahead = layer + step
      if 0 <= ahead < e.layers:
        key = (slot, path, ahead, row)
        with self._lock:
          if key not in self._prefetched and self._buffers[row] < self.settings.param_buffer_count:
            self._buffers[row] += 1
            self._prefetched[key] = self._pool.submit(self._pread, slot, path, ahead, row)
    return data

  def read(self, path: str, layers: Any, partition: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The partition of the device with partition index ``partition``: layers ``layers`` (an
    index, or an array of them for a whole stack) of leaf ``path``, as fp32 of ``shape``."""
    slot, row = self.store.slot, self.row_of[int(partition)]
    layers = np.asarray(layers)
    parts = [self._one(slot, path, int(l), row) for l in layers.reshape(-1)]
    return np.concatenate(parts).reshape(shape) if len(parts) > 1 else parts[0].reshape(shape)

  def cache_bytes(self) -> int:
    """Host bytes of the host cache now."""
    return sum(a.nbytes for a in self._cache.values())

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

