"""ZeRO's collectives, spelled out for use inside ``shard_map``.

Every function here runs on one device's local arrays inside ``jax.shard_map`` over the ZeRO axes
(``axes``) and works on the layout of :mod:`jzero.sharding.plan`: a partitioned array is split along
``dim`` (a negative index) into equal slices, the full dimension zero-padded to ``padded``.

* :func:`gather` -- all-gather a partitioned parameter for compute. Its backward is a
  **reduce-scatter** (``psum_scatter``) of the full gradient back into the partition: this is how
  stage 3 gets partitioned gradients out of the backward pass without ever all-reducing a full
  gradient (on the CPU backend GSPMD would all-reduce and slice: 2x the bytes; see DESIGN.md).
* :func:`attach` -- the identity on a replicated parameter whose backward reduce-scatters its
  gradient into a partition-shaped "gradient slot": stage 2 (and stage 3's persistent leaves) get
  each gradient partitioned the moment backward has produced it, so the full gradient never
  exists at once (DeepSpeed's bucketed reduce-scatter during backward).
* :func:`all_gather` -- rebuild a full array from partitions (stage 1/2 after the update).
* :func:`reduce_scatter` -- sum full local gradients over devices, keep the own partition.
* :func:`local_slice` -- this device's partition of a replicated array (no communication).

The parameter the model sees, whose ``gather()`` calls these, is
:class:`jzero.comm.zero_param.ZeroParam`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jzero.sharding.plan import pad_to

__all__ = ["gather", "attach", "all_gather", "reduce_scatter", "local_slice"]

Axes = tuple[str, ...]


def all_gather(shard: jax.Array, dim: int, size: int, axes: Axes) -> jax.Array:
  """Full array (``size`` along ``dim``) from the partitions of all devices on ``axes``.

  16-bit floats travel as their bits (uint16): a gather only moves data, and XLA's CPU backend
  would otherwise carry bf16 / fp16 collectives out in fp32 -- twice the bytes of every gathered
  parameter alive in the step. The same bytes on GPU, where they are native.
  """
  d = dim % shard.ndim
  if jnp.issubdtype(shard.dtype, jnp.floating) and jnp.dtype(shard.dtype).itemsize == 2:
    bits = lax.all_gather(lax.bitcast_convert_type(shard, jnp.uint16), axes, axis=d, tiled=True)
    full = lax.bitcast_convert_type(bits, shard.dtype)
  else:
    full = lax.all_gather(shard, axes, axis=d, tiled=True)
  return lax.slice_in_dim(full, 0, size, axis=d)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _attach(full, slot, dim, padded, axes, scatter, slot_dtype):
  return full


def _attach_fwd(full, slot, dim, padded, axes, scatter, slot_dtype):
  return full, None


def _attach_bwd(dim, padded, axes, scatter, slot_dtype, _, ct):
  ct = ct.astype(slot_dtype)
  if scatter:
    part = reduce_scatter(ct, dim, padded, axes)
  else:  # reduce_scatter: false -- all-reduce, keep the own slice
    part = local_slice(lax.psum(ct, axes), dim, padded, axes)
  return None, part


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach(full: jax.Array, slot: jax.Array, dim: int, axes: Axes, *,
           scatter: bool = True) -> jax.Array:
  """``full``, unchanged; the gradient of the result, summed over the devices on ``axes``, comes
  back as the gradient of ``slot``: this device's partition (split along ``dim``, padded to
  ``slot``'s size times the axes' size), in ``slot``'s dtype (the communication dtype).

  ``scatter=False`` all-reduces and keeps the own slice (DeepSpeed's ``reduce_scatter: false``).
  """
  padded = slot.shape[dim] * lax.axis_size(axes)
  return _attach(full, slot, dim, padded, axes, scatter, jnp.dtype(slot.dtype))
