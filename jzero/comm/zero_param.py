""":class:`ZeroParam` is a parameter as the plan hands it to the model: ``gather()`` gives the full
parameter (through :func:`jzero.comm.collectives.gather` or :func:`~jzero.comm.collectives.attach`)
and the gradient comes back partitioned. It is a pytree whose children have the leaf's shape, so
``scan`` over a stack of them slices every layer; :mod:`jzero.modeling.layer_scan` decides *where*
``gather()`` runs (one layer of a scan, one module call).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jzero.comm import collectives, zeropp

__all__ = ["PartitionSource", "ZeroParam", "read_sources"]

Axes = tuple[str, ...]


class PartitionSource(Protocol):
  """Where a tier keeps a stage-3 partition between steps (static: part of a ZeroParam's tree
  structure). ``fetch(slot, stored)`` is the partition on the device, read from ``stored`` (the
  ZeroParam's child the tier gave it), in ``slot``'s shape, with ``slot`` receiving its gradient.
  A source class may also define ``fetch_many(sources, slots, stored) -> tuple``: several of its
  leaves read at once (:func:`read_sources`)."""

  def fetch(self, slot: jax.Array, stored: Any) -> jax.Array:
    ...


@jax.tree_util.register_pytree_node_class
class ZeroParam:
  """One parameter as the ZeRO plan hands it to the model.

  ``gather()`` gives the full parameter for compute; its gradient flows back partitioned over the
  ZeRO axes. Two kinds:

  * partitioned (stage 3): holds this device's ``partition``; ``gather()`` all-gathers it and the
    backward reduce-scatters the gradient into it (:func:`jzero.comm.collectives.gather`).
  * replicated with a partitioned gradient (stage 2, stage-3 persistent leaves): holds the
    ``full`` parameter and a zero ``partition``-shaped gradient slot; ``gather()`` returns the
    parameter and the backward reduce-scatters its gradient into the slot
    (:func:`jzero.comm.collectives.attach`).

  With ZeRO++ (:mod:`jzero.comm.zeropp`) it also carries the leaf's static ``comm`` (how its gather
  and reduction move bytes) and, with hpZ, its ``secondary`` partition, which ``gather()`` reads
  instead of the partition.

  When a tier keeps the partition somewhere else (host memory, :mod:`jzero.tiers.host_params`;
  NVMe, :mod:`jzero.tiers.nvme_params`) it carries the tier's static ``source``
  (:class:`PartitionSource`) and the ``stored`` child the source reads from (the host partition;
  the stack's layer indices, which the scan slices with the rest): ``partition`` is then a zero
  gradient slot on the device, and ``gather()`` reads the partition through ``source.fetch``
  first (its gradient lands in the slot).

  It is a pytree node whose children are the arrays, so ``lax.scan`` over a stack of them slices
  every layer while the static facts (a negative ``dim``, the logical ``size``, the ``axes``) stay
  valid for the sliced layer. It reads like the array it stands for: ``shape``, ``dtype``,
  ``x[...]`` and ``jnp.asarray(x)`` (both gather).
  """

  __slots__ = ("partition", "full", "dim", "size", "axes", "comm_dtype", "scatter", "secondary",
               "comm", "source", "stored")

  def __init__(self, partition: jax.Array, dim: int, size: int, axes: Axes, comm_dtype: Any = None,
               *, full: jax.Array | None = None, scatter: bool = True,
               secondary: jax.Array | None = None, comm: Any = None,
               source: PartitionSource | None = None, stored: Any = None):
    self.partition, self.full, self.dim, self.size = partition, full, dim, size
    self.axes, self.comm_dtype, self.scatter = axes, comm_dtype, scatter
    self.secondary, self.comm = secondary, comm
    self.source, self.stored = source, stored

  def tree_flatten(self):
    return (self.partition, self.full, self.secondary, self.stored), (
        self.dim, self.size, self.axes, self.comm_dtype, self.scatter, self.comm, self.source)

  @classmethod
  def tree_unflatten(cls, aux, children):
    dim, size, axes, comm_dtype, scatter, comm, source = aux
    return cls(children[0], dim, size, axes, comm_dtype, full=children[1], scatter=scatter,
               secondary=children[2], comm=comm, source=source, stored=children[3])

  def with_partition(self, partition: jax.Array) -> "ZeroParam":
    """This parameter with ``partition`` as its partition, read already (no ``source``)."""
    return ZeroParam(partition, self.dim, self.size, self.axes, self.comm_dtype, full=self.full,
                     scatter=self.scatter, secondary=self.secondary, comm=self.comm)

  @property
  def partitioned(self) -> bool:
    """True for a stage-3 partition, False for a replicated parameter with a gradient slot."""
    return self.full is None

  @property
  def shape(self) -> tuple[int, ...]:
    if self.full is not None:
      return tuple(self.full.shape)
    shape = list(self.partition.shape)
    shape[self.dim] = self.size
    return tuple(shape)

  @property
  def dtype(self):
    return (self.partition if self.full is None else self.full).dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def gather(self) -> jax.Array:
    """The full parameter (see the class docstring for what its backward does)."""
    partition = self.partition
    if self.source is not None:  # a tier keeps the partition: read it onto the device first
      partition = self.source.fetch(self.partition, self.stored)
    if self.comm is not None:  # ZeRO++: quantized / hierarchical collectives
      if self.full is None:
        return zeropp.gather(partition, self.secondary, self.dim, self.size, self.comm,
                             self.comm_dtype)
      return zeropp.attach(self.full, self.partition, self.dim, self.comm)
    if self.full is None:
      return collectives.gather(partition, self.dim, self.size, self.axes, self.comm_dtype)
    return collectives.attach(self.full, self.partition, self.dim, self.axes, scatter=self.scatter)

  def __getitem__(self, key):
    return self.gather()[key]

  def __jax_array__(self):
    return self.gather()

  def __repr__(self):
    kind = "partition" if self.full is None else "full + gradient slot"
    return f"ZeroParam({kind}, shape={self.shape}, dim={self.dim})"


def read_sources(params: list) -> list:
  """Items of ``params`` (ZeroParams and anything else) with the partitions of every source class
  that reads several leaves at once (``fetch_many``) read together, one read per class: the
  gather of a group (:func:`jzero.modeling.layer_scan.gather`) pays one read, not one per leaf.
  Each read value's gradient still goes to its slot; other items are returned as they are."""
  out = list(params)
  by_kind: dict[type, list[int]] = {}
  for i, p in enumerate(params):
    if isinstance(p, ZeroParam) and hasattr(type(p.source), "fetch_many"):
      by_kind.setdefault(type(p.source), []).append(i)
  for kind, index in by_kind.items():
    if len(index) < 2:
      continue
    group = [params[i] for i in index]
    values = kind.fetch_many(tuple(p.source for p in group), tuple(p.partition for p in group),
                             tuple(p.stored for p in group))
    for i, p, v in zip(index, group, values):
      out[i] = p.with_partition(v)
  return out
