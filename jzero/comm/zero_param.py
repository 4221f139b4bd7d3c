""":class:`ZeroParam` is a parameter as the plan hands it to the model: ``gather()`` gives the full
parameter (through :func:`jzero.comm.collectives.gather` or :func:`~jzero.comm.collectives.attach`)
and the gradient comes back partitioned. It is a pytree whose children have the leaf's shape, so
``scan`` over a stack of them slices every layer; :mod:`jzero.modeling.layer_scan` decides *where*
``gather()`` runs (one layer of a scan, one module call).
"""

from __future__ import annotations

from typing import Any

import jax

from jzero.comm import collectives, zeropp
from jzero.tiers import host_params

__all__ = ["ZeroParam"]

Axes = tuple[str, ...]


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

  With parameter offload (:mod:`jzero.tiers.host_params`) a partitioned one also carries ``host``,
  the partition in host memory: ``partition`` is then a zero gradient slot on the device, and
  ``gather()`` moves ``host`` to the device first (its gradient lands in the slot).

  With parameters on NVMe (:mod:`jzero.tiers.nvme_params`) it carries the leaf's static ``source``
  and a ``layer`` index child (the stack's layer indices; the scan slices them with the rest):
  ``partition`` is again a zero gradient slot, and ``gather()`` reads the partition through
  ``source.fetch`` first.

  It is a pytree node whose children are the arrays, so ``lax.scan`` over a stack of them slices
  every layer while the static facts (a negative ``dim``, the logical ``size``, the ``axes``) stay
  valid for the sliced layer. It reads like the array it stands for: ``shape``, ``dtype``,
  ``x[...]`` and ``jnp.asarray(x)`` (both gather).
  """

  __slots__ = ("partition", "full", "dim", "size", "axes", "comm_dtype", "scatter", "secondary",
               "comm", "host", "source", "layer")

  def __init__(self, partition: jax.Array, dim: int, size: int, axes: Axes, comm_dtype: Any = None,
               *, full: jax.Array | None = None, scatter: bool = True,
               secondary: jax.Array | None = None, comm: Any = None,
               host: jax.Array | None = None, source: Any = None,
               layer: jax.Array | None = None):
    self.partition, self.full, self.dim, self.size = partition, full, dim, size
    self.axes, self.comm_dtype, self.scatter = axes, comm_dtype, scatter
    self.secondary, self.comm, self.host = secondary, comm, host
    self.source, self.layer = source, layer

  def tree_flatten(self):
    return (self.partition, self.full, self.secondary, self.host, self.layer), (
        self.dim, self.size, self.axes, self.comm_dtype, self.scatter, self.comm, self.source)

  @classmethod
  def tree_unflatten(cls, aux, children):
    dim, size, axes, comm_dtype, scatter, comm, source = aux
    return cls(children[0], dim, size, axes, comm_dtype, full=children[1], scatter=scatter,
               secondary=children[2], comm=comm, host=children[3], source=source,
               layer=children[4])

  def with_partition(self, partition: jax.Array) -> "ZeroParam":
    """This parameter with ``partition`` as its partition, read already (no ``source``)."""
    return ZeroParam(partition, self.dim, self.size, self.axes, self.comm_dtype, full=self.full,
                     scatter=self.scatter, secondary=self.secondary, comm=self.comm,
                     host=self.host)

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
    if self.source is not None:  # parameters on NVMe: read the partition first
      partition = self.source.fetch(self.partition, self.layer)
    if self.host is not None:  # parameter offload: the partition comes from the host first
      partition = host_params.fetch(self.host, self.partition)
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
