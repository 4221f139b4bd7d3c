"""ZeRO's collectives, spelled out for use inside ``shard_map``.

Every function here runs on one device's local arrays inside ``jax.shard_map`` over the ZeRO axes
(``axes``) and works on the layout of :mod:`jzero.plan`: a partitioned array is split along
``dim`` (a negative index) into equal slices, the full dimension zero-padded to ``padded``.

* :func:`gather` -- all-gather a partitioned parameter for compute. Its backward is a
  **reduce-scatter** (``psum_scatter``) of the full gradient back into the partition: this is how
  stage 3 gets partitioned gradients out of the backward pass without ever all-reducing a full
  gradient (on the CPU backend GSPMD would all-reduce and slice: 2x the bytes; see DESIGN.md).
* :func:`all_gather` -- rebuild a full array from partitions (stage 1/2 after the update).
* :func:`reduce_scatter` -- sum full local gradients over devices, keep the own partition.
* :func:`local_slice` -- this device's partition of a replicated array (no communication).

:class:`ZeroShard` wraps a stage-3 partition that is handed to the model *ungathered* (a layer stack
under ``scan``); :func:`jzero.layers.gather` turns it into the full parameter inside the scan body.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["ZeroShard", "gather", "all_gather", "reduce_scatter", "local_slice", "pad_to"]

Axes = tuple[str, ...]


def pad_to(x: jax.Array, dim: int, padded: int) -> jax.Array:
  """Zero-pads dimension ``dim`` of ``x`` at its end to size ``padded``."""
  extra = padded - x.shape[dim]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[dim] = (0, extra)
  return jnp.pad(x, widths)


def all_gather(shard: jax.Array, dim: int, size: int, axes: Axes) -> jax.Array:
  """Full array (``size`` along ``dim``) from the partitions of all devices on ``axes``."""
  full = lax.all_gather(shard, axes, axis=dim % shard.ndim, tiled=True)
  return lax.slice_in_dim(full, 0, size, axis=dim % shard.ndim)


def reduce_scatter(full: jax.Array, dim: int, padded: int, axes: Axes) -> jax.Array:
  """Sum of ``full`` over the devices on ``axes``, this device's partition of it."""
  return lax.psum_scatter(pad_to(full, dim % full.ndim, padded), axes,
                          scatter_dimension=dim % full.ndim, tiled=True)


def local_slice(full: jax.Array, dim: int, padded: int, axes: Axes) -> jax.Array:
  """This device's partition of a replicated array (no communication)."""
  d = dim % full.ndim
  step = padded // lax.axis_size(axes)
  return lax.dynamic_slice_in_dim(pad_to(full, d, padded), lax.axis_index(axes) * step, step, axis=d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(shard, dim, size, axes, comm_dtype):
  return all_gather(shard, dim, size, axes)


def _gather_fwd(shard, dim, size, axes, comm_dtype):
  return all_gather(shard, dim, size, axes), None


def _gather_bwd(dim, size, axes, comm_dtype, _, ct):
  n = lax.axis_size(axes)
  padded = -(-size // n) * n
  reduced = reduce_scatter(ct.astype(comm_dtype or ct.dtype), dim, padded, axes)
  return (reduced.astype(ct.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather(shard: jax.Array, dim: int, size: int, axes: Axes, comm_dtype: Any = None) -> jax.Array:
  """All-gather a partitioned parameter; backward reduce-scatters its gradient into the partition.

  Args:
    shard: this device's partition, split along ``dim``.
    dim: negative index of the partitioned dimension.
    size: logical (unpadded) size of ``dim``.
    axes: mesh axes the partition is split over.
    comm_dtype: dtype the gradient is reduce-scattered in (default: the gradient's dtype).
  """
  return _gather(shard, dim, size, axes, comm_dtype)


@jax.tree_util.register_pytree_node_class
class ZeroShard:
  """One device's partition of a stage-3 parameter, with the static facts needed to gather it.

  It is a pytree node whose only child is the partition, so ``lax.scan`` over a stack of them
  slices every layer's partition while the gather facts (a negative ``dim``, the logical ``size``,
  the ``axes``) stay valid for the sliced layer.
  """

  __slots__ = ("shard", "dim", "size", "axes", "comm_dtype")

  def __init__(self, shard: jax.Array, dim: int, size: int, axes: Axes, comm_dtype: Any = None):
    self.shard, self.dim, self.size, self.axes, self.comm_dtype = shard, dim, size, axes, comm_dtype

  def tree_flatten(self):
    return (self.shard,), (self.dim, self.size, self.axes, self.comm_dtype)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def gather(self) -> jax.Array:
    return gather(self.shard, self.dim, self.size, self.axes, self.comm_dtype)

  def __jax_array__(self):
    raise TypeError(
        "a ZeRO-3 parameter partition reached the model ungathered. Layers listed in "
        "`stacked_layers` must be run with jzero.scan_layers (Linen: built with "
        "jzero.linen_scan_layers), or call jzero.gather on each layer's parameters inside the scan "
        "body; otherwise leave them out of `stacked_layers`.")

  def __repr__(self):
    return f"ZeroShard(shape={getattr(self.shard, 'shape', None)}, dim={self.dim}, size={self.size})"
