"""Pallas kernels (Mosaic, the TPU backend) for the block views of :mod:`jzero.kernels.reference`.

Same inputs, outputs and math as the reference and as the Triton kernels of
:mod:`jzero.kernels.pallas`, bit for bit in interpret mode (the tests compare them); on a TPU each
is one pass over HBM: quantize reads the floats once and writes bytes + scales, dequantize-and-sum
reads the K chunks once and writes the sum (or its re-quantized bytes + scales).

**Tiles the TPU accepts.** A Mosaic block's last two dimensions must be divisible by the chip's
tile, (8, 128) for 32-bit and (32, 128) for 8-bit types, or equal the array's own. So a program
takes ``tg`` whole blocks (rows) of G elements: the last dimension is always the array's (any G,
no column masks), and ``tg`` is either all R rows or a multiple of 32 (:func:`tiling`), with the
last program's rows cut off by Pallas where R is ragged (its extra rows hold whatever the buffer
held; every row is computed on its own, and only the R real rows are written back). Scales travel
as ``(R, 1)`` arrays, ``(tg, 1)`` blocks: a column whose last dimension equals the array's, where
a 1-D ``(tg,)`` block would need ``tg`` divisible by 1024. The wrappers reshape them to the
reference's ``(R,)`` (``(K, R)`` for the stacked inputs) and back, and store int4 bytes as int8
bit-cast to uint8 outside the kernel, free reshapes and a free bit-cast.

Inside a program, int4's two half-blocks are static lane slices ``[:, :G/2]`` and ``[:, G/2:]``,
which Mosaic lowers at any offset (checked here for G/2 = 50, 1024, 3072 and 3972). Rounding is
:func:`jzero.kernels.reference.round_half_even` (truncation and compares), the same code as on CUDA;
a block's absmax is a lane reduction over its finite elements. Nothing here has run on a TPU: the
kernels compile for one (``jzero aot --tpu``, with libtpu, no TPU) and agree with the reference in
interpret mode; on the chip, float32 division is the TPU's, which the reference also uses there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jzero.kernels.reference import (F32_MAX, inverse, numerator, round_half_even, scaled,
                                     split_scale, tiny_absmax)

__all__ = ["quantize_blocks", "dequantize_sum_blocks", "requantize_sum_blocks", "tiling",
           "BLOCK_ELEMENTS", "ROW_TILE"]

BLOCK_ELEMENTS = 65536  # elements of G one program aims at (tg rows x G), per stacked chunk
ROW_TILE = 32  # rows of a partial block: the 8-bit sublane tile (32, 128) of the values


def tiling(rows: int, group_size: int, k: int = 1) -> int:
  """Rows per program for ``rows`` blocks of G (``k`` stacked chunks): all of them when they fit
  in :data:`BLOCK_ELEMENTS`, else the largest multiple of :data:`ROW_TILE` that does (at least
  one tile)."""
  per_row = k * group_size
  if rows * per_row <= BLOCK_ELEMENTS or rows <= ROW_TILE:
    return rows
  return max(ROW_TILE, BLOCK_ELEMENTS // per_row // ROW_TILE * ROW_TILE)


def _quantize_rows(x: jax.Array, bits: int, rule: str) -> tuple[jax.Array, jax.Array]:
  """float32 ``(tg, G)`` -> (int8 values ``(tg, G * bits / 8)``, float32 scales ``(tg, 1)``)."""
  numer = numerator(bits, rule)
  a = jnp.abs(x)
  finite = a <= F32_MAX
  bad = jnp.max(jnp.where(finite, 0.0, 1.0), axis=1, keepdims=True) > 0.0
  absmax = jnp.max(jnp.where(finite, a, 0.0), axis=1, keepdims=True)
  tiny = absmax < tiny_absmax(numer)
  r = numer / jnp.where(tiny, numer, absmax)
  scales = jnp.where(bad, jnp.nan, jnp.where(tiny, 1.0, absmax * inverse(numer)))
  lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  q = jnp.clip(round_half_even(jnp.where(bad, 0.0, x * r)), lo, hi)
  if bits == 8:
    return q.astype(jnp.int8), scales
  half = x.shape[1] // 2
  high, low = jnp.bitwise_and(q[:, :half], 15), jnp.bitwise_and(q[:, half:], 15)
  packed = jnp.left_shift(high, 4) + low  # 0..255: the uint8 byte, stored as its int8 bits
  return jnp.where(packed >= 128, packed - 256, packed).astype(jnp.int8), scales


def _dequantize_rows(v: jax.Array, s: jax.Array, bits: int) -> jax.Array:
  """int8 values ``(tg, G * bits / 8)`` and float32 scales ``(tg, 1)`` -> float32 ``(tg, G)``."""
  b = v.astype(jnp.int32)
  if bits == 8:
    q = b
  else:
    b = jnp.bitwise_and(b, 255)  # the uint8 byte
    q = jnp.concatenate([jnp.right_shift(b, 4), jnp.bitwise_and(b, 15)], axis=1)
    q = jnp.where(q >= 8, q - 16, q)
  hi, lo = split_scale(s)
  return scaled(q.astype(jnp.float32), hi, lo)


def _sum_rows(v_ref, s_ref, bits: int, k: int) -> jax.Array:
  """float32 ``(tg, G)`` sum over the K chunks of ``(K, tg, ...)`` block refs, chunk 0 first."""
  def chunk(j):
    return _dequantize_rows(v_ref[j], s_ref[j], bits)

  first = chunk(jnp.int32(0))  # a Python int index breaks interpret mode
  return lax.fori_loop(1, k, lambda j, acc: acc + chunk(j), first) if k > 1 else first


def _specs(tg: int, columns: int, stacked: int | None = None) -> tuple[pl.BlockSpec, ...]:
  """BlockSpecs of ``tg`` rows of values (``columns`` wide) and of their ``(tg, 1)`` scales,
  behind a whole leading axis of ``stacked`` chunks."""
  if stacked is None:
    return (pl.BlockSpec((tg, columns), lambda i: (i, 0)),
            pl.BlockSpec((tg, 1), lambda i: (i, 0)))
  return (pl.BlockSpec((stacked, tg, columns), lambda i: (0, i, 0)),
          pl.BlockSpec((stacked, tg, 1), lambda i: (0, i, 0)))


def _call(kernel, rows: int, tg: int, name: str, in_specs, out_specs, out_shape, interpret: bool):
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, tg),), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=interpret, name=name,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))


def _quantized_out(rows: int, group_size: int, bits: int) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct((rows, group_size * bits // 8), jnp.int8),
          jax.ShapeDtypeStruct((rows, 1), jnp.float32)]


def _public(values: jax.Array, scales: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Kernel outputs -> the reference's values (uint8 for int4) and ``(R,)`` scales."""
  if bits == 4:
    values = lax.bitcast_convert_type(values, jnp.uint8)
  return values, scales.reshape(-1)


def _stacked_inputs(values: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
  if values.dtype == jnp.uint8:
    values = lax.bitcast_convert_type(values, jnp.int8)
  return values, scales.reshape(*scales.shape, 1)


def quantize_blocks(x: jax.Array, bits: int, rule: str = "deepspeed", *, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
  """Mosaic :func:`jzero.kernels.reference.quantize_blocks`: float ``(R, G)`` -> values,
  scales."""
  rows, group_size = x.shape
  tg = tiling(rows, group_size)

  def kernel(x_ref, v_ref, s_ref):
    v_ref[...], s_ref[...] = _quantize_rows(x_ref[...].astype(jnp.float32), bits, rule)

  call = _call(kernel, rows, tg, f"jzero_quantize_int{bits}",
               [pl.BlockSpec((tg, group_size), lambda i: (i, 0))],
               list(_specs(tg, group_size * bits // 8)), _quantized_out(rows, group_size, bits),
               interpret)
  return _public(*call(x), bits)


def dequantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, dtype: jnp.dtype, *,
                          interpret: bool = False) -> jax.Array:
  """Mosaic :func:`jzero.kernels.reference.dequantize_sum_blocks`: ``(K, R, ...)`` ->
  ``(R, G)``."""
  k, rows, width = values.shape
  group_size = width * 8 // bits
  tg = tiling(rows, group_size, k)

  def kernel(v_ref, s_ref, o_ref):
    o_ref[...] = _sum_rows(v_ref, s_ref, bits, k).astype(dtype)

  call = _call(kernel, rows, tg, f"jzero_dequantize_sum_int{bits}", list(_specs(tg, width, k)),
               pl.BlockSpec((tg, group_size), lambda i: (i, 0)),
               jax.ShapeDtypeStruct((rows, group_size), dtype), interpret)
  return call(*_stacked_inputs(values, scales))


def requantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, out_bits: int,
                          rule: str = "deepspeed", *, interpret: bool = False
                          ) -> tuple[jax.Array, jax.Array]:
  """Mosaic :func:`jzero.kernels.reference.requantize_sum_blocks`: the sum, quantized again."""
  k, rows, width = values.shape
  group_size = width * 8 // bits
  tg = tiling(rows, group_size, k)

  def kernel(v_ref, s_ref, ov_ref, os_ref):
    ov_ref[...], os_ref[...] = _quantize_rows(_sum_rows(v_ref, s_ref, bits, k), out_bits, rule)

  call = _call(kernel, rows, tg, f"jzero_requantize_sum_int{bits}_int{out_bits}",
               list(_specs(tg, width, k)), list(_specs(tg, group_size * out_bits // 8)),
               _quantized_out(rows, group_size, out_bits), interpret)
  return _public(*call(*_stacked_inputs(values, scales)), out_bits)
