"""Pallas kernels (Triton backend) for the block views of :mod:`jzero.kernels.reference`.

Same inputs, outputs and math as the reference, bit for bit (the tests compare them in interpret
mode); on an NVIDIA GPU they compile to one fused pass over memory each: quantize reads the
floats once and writes bytes + scales, dequantize-and-sum reads the K chunks once and writes the
sum (or its re-quantized bytes + scales).

**Why Triton and not Mosaic GPU.** On jax 0.10.2 ``pl.pallas_call`` without compiler params picks
Mosaic GPU, and that route is deprecated in favour of ``plgpu.kernel``, which asks for explicit
shared-memory staging and warpgroup layouts and targets Hopper and newer. ``pallas_call`` with
``triton.CompilerParams`` keeps the plain block programming model, runs on Ampere as well, and --
what decides it here -- XLA compiles its Triton custom call to PTX at ``compile()`` time, so a
compile-only H100 topology (no GPU present) proves each kernel compiles all the way (Mosaic GPU
kernels are compiled only when first run). The Triton lowering's limits shape the code:

* every array a kernel operates on must have a power-of-two size. A program takes ``tg`` blocks
  and handles each as its two halves of G/2 elements (the halves int4 packs into one byte), each
  loaded as a ``(tg, next_pow2(G/2))`` array; loads and stores are masked at ragged edges (plain
  ``ref[...]`` loads are not bounds-checked on GPU). Keep tiles 2-D: the same kernel written
  on ``(tg, 1, width)`` tiles took ptxas 35 s for G = 4096 and minutes for 16384, this one a
  second;
* there is no ``round``: :func:`~jzero.kernels.reference.round_half_even` builds it from
  truncation (the magic-number trick ``(y + 1.5 * 2^23) - 1.5 * 2^23`` is folded to ``y`` by XLA,
  so interpret mode would truncate);
* ``max`` lowers to ``maxnumf``, which drops nans: absmax is taken over finite elements only and
  non-finite elements are counted separately, which is also what the reference does;
* float32 division lowers to ``div.full.f32`` (within 2 ulp), as XLA's own GPU division does, so
  on a GPU the kernel and the jnp reference still agree; on CPU both divide exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jzero.kernels.reference import (F32_MAX, inverse, numerator, round_half_even, scaled,
                                     split_scale, tiny_absmax)

__all__ = ["quantize_blocks", "dequantize_sum_blocks", "requantize_sum_blocks",
           "tiling", "BLOCK_ELEMENTS"]

BLOCK_ELEMENTS = 4096  # elements one program handles: blocks x padded block width


def tiling(rows: int, group_size: int) -> tuple[int, int, int]:
  """(blocks per program, padded half-block width, num_warps) for ``rows`` blocks of G."""
  padded = pl.next_power_of_2(group_size // 2)
  tg = max(1, min(BLOCK_ELEMENTS // (2 * padded), pl.next_power_of_2(max(rows, 1))))
  warps = 4 if tg * 2 * padded <= BLOCK_ELEMENTS else 8
  return tg, padded, warps


class _Tile:
  """One program's tile: ``tg`` blocks, each handled as two halves of ``width`` = G/2 elements
  loaded as ``(tg, padded)`` arrays, with the masks at the ragged edges."""

  def __init__(self, rows: int, group_size: int):
    self.rows, self.width = rows, group_size // 2
    self.tg, self.padded, self.warps = tiling(rows, group_size)
    self.ragged_rows = rows % self.tg != 0
    self.ragged_cols = self.padded != self.width

  def _rows_ok(self, shape: tuple[int, ...]) -> jax.Array:
    return pl.program_id(0) * self.tg + lax.broadcasted_iota(jnp.int32, shape, 0) < self.rows

  def mask(self) -> jax.Array | None:
    """``(tg, padded)``: inside the array and inside the half-block, or None if all are."""
    shape = (self.tg, self.padded)
    ok = None
    if self.ragged_rows:
      ok = self._rows_ok(shape)
    if self.ragged_cols:
      cols = lax.broadcasted_iota(jnp.int32, shape, 1) < self.width
      ok = cols if ok is None else ok & cols
    return ok

  def row_mask(self) -> jax.Array | None:
    return self._rows_ok((self.tg,)) if self.ragged_rows else None

  def half(self, ref, h: int, *lead):
    """The ``(tg, padded)`` view of half ``h`` of ``(*lead, tg, >= G)`` block refs; a single
    indexer (the Triton lowering takes no chained ones)."""
    return ref.at[(*lead, slice(None), pl.ds(h * self.width, self.padded))]

  def load(self, ref, other, mask) -> jax.Array:
    return pltr.load(ref, mask=mask, other=None if mask is None else other)

  def block_spec(self, columns: int, stacked: int | None = None) -> pl.BlockSpec:
    """BlockSpec of ``tg`` rows of ``columns``, behind a whole leading axis of ``stacked``."""
    if stacked is None:
      return pl.BlockSpec((self.tg, columns), lambda i: (i, 0))
    return pl.BlockSpec((stacked, self.tg, columns), lambda i: (0, i, 0))

  def rows_spec(self, stacked: int | None = None) -> pl.BlockSpec:
    if stacked is None:
      return pl.BlockSpec((self.tg,), lambda i: (i,))
    return pl.BlockSpec((stacked, self.tg), lambda i: (0, i))

  def values_spec(self, bits: int, stacked: int | None = None) -> pl.BlockSpec:
    return self.block_spec(self.width + self.padded if bits == 8 else self.padded, stacked)


def _load_q(tile: _Tile, v_ref, bits: int, mask: jax.Array | None, *lead) -> list[jax.Array]:
  """int32 halves ``(tg, padded)`` of a values block ref (int8 ``(*lead, tg, G)``, uint8
  ``(*lead, tg, G/2)``)."""
  if bits == 8:
    return [tile.load(tile.half(v_ref, h, *lead), 0, mask).astype(jnp.int32) for h in (0, 1)]
  b = tile.load(tile.half(v_ref, 0, *lead), 0, mask).astype(jnp.int32)
  halves = [jnp.right_shift(b, 4), jnp.bitwise_and(b, 15)]
  return [jnp.where(q >= 8, q - 16, q) for q in halves]


def _store_q(tile: _Tile, v_ref, q: list[jax.Array], bits: int) -> None:
  mask = tile.mask()
  if bits == 8:
    for h in (0, 1):
      pltr.store(tile.half(v_ref, h), q[h].astype(jnp.int8), mask=mask)
    return
  hi, lo = jnp.bitwise_and(q[0], 15), jnp.bitwise_and(q[1], 15)
  pltr.store(tile.half(v_ref, 0), (jnp.left_shift(hi, 4) + lo).astype(jnp.uint8), mask=mask)


def _quantize_halves(x: list[jax.Array], bits: int, rule: str
                     ) -> tuple[list[jax.Array], jax.Array]:
  """float32 halves -> (int32 halves in range, float32 scales ``(tg,)``), as the reference."""
  numer = numerator(bits, rule)
  a = [jnp.abs(v) for v in x]
  finite = [v <= F32_MAX for v in a]
  bad = jnp.maximum(*[jnp.max(jnp.where(f, 0.0, 1.0), axis=1) for f in finite]) > 0.0
  absmax = jnp.maximum(*[jnp.max(jnp.where(f, v, 0.0), axis=1) for f, v in zip(finite, a)])
  tiny = absmax < tiny_absmax(numer)
  r = numer / jnp.where(tiny, numer, absmax)
  scales = jnp.where(bad, jnp.nan, jnp.where(tiny, 1.0, absmax * inverse(numer)))
  lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  q = [jnp.clip(round_half_even(jnp.where(bad[:, None], 0.0, v * r[:, None])), lo, hi)
       for v in x]
  return q, scales


def _sum_halves(tile: _Tile, v_ref, s_ref, bits: int, k: int) -> list[jax.Array]:
  """float32 halves of the sum over the K chunks of stacked block refs, chunk 0 first."""
  # Masks are built here, not in the loop: interpret mode has no program_id inside a loop body.
  mask, row_mask = tile.mask(), tile.row_mask()

  def chunk(j):
    j = jnp.int32(j) if isinstance(j, int) else j  # a Python int index breaks interpret mode
    hi, lo = split_scale(tile.load(s_ref.at[j], 0.0, row_mask)[:, None])
    return [scaled(q.astype(jnp.float32), hi, lo) for q in _load_q(tile, v_ref, bits, mask, j)]

  def body(j, acc):
    return [a + c for a, c in zip(acc, chunk(j))]

  return lax.fori_loop(1, k, body, chunk(0)) if k > 1 else chunk(0)


def _call(kernel, tile: _Tile, name: str, in_specs, out_specs, out_shape, interpret: bool):
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(tile.rows, tile.tg),), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=pltr.CompilerParams(num_warps=tile.warps,
                                                               num_stages=1),
      interpret=interpret, name=name)


def _values_shape(rows: int, group_size: int, bits: int) -> jax.ShapeDtypeStruct:
  if bits == 8:
    return jax.ShapeDtypeStruct((rows, group_size), jnp.int8)
  return jax.ShapeDtypeStruct((rows, group_size // 2), jnp.uint8)


def quantize_blocks(x: jax.Array, bits: int, rule: str = "deepspeed", *, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
  """Pallas :func:`jzero.kernels.reference.quantize_blocks`: float ``(R, G)`` -> values, scales."""
  rows, group_size = x.shape
  tile = _Tile(rows, group_size)

  def kernel(x_ref, v_ref, s_ref):
    mask = tile.mask()
    halves = [tile.load(tile.half(x_ref, h), 0.0, mask).astype(jnp.float32) for h in (0, 1)]
    q, scales = _quantize_halves(halves, bits, rule)
    _store_q(tile, v_ref, q, bits)
    pltr.store(s_ref, scales, mask=tile.row_mask())

  call = _call(kernel, tile, f"jzero_quantize_int{bits}",
               [tile.block_spec(tile.width + tile.padded)],
               [tile.values_spec(bits), tile.rows_spec()],
               [_values_shape(rows, group_size, bits),
                jax.ShapeDtypeStruct((rows,), jnp.float32)], interpret)
  return tuple(call(x))


def _stacked_shape(values: jax.Array, bits: int) -> tuple[int, int, int]:
  k, rows, width = values.shape
  return k, rows, width if bits == 8 else 2 * width


def dequantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, dtype: jnp.dtype, *,
                          interpret: bool = False) -> jax.Array:
  """Pallas :func:`jzero.kernels.reference.dequantize_sum_blocks`: ``(K, R, ...)`` -> ``(R, G)``."""
  k, rows, group_size = _stacked_shape(values, bits)
  tile = _Tile(rows, group_size)

  def kernel(v_ref, s_ref, o_ref):
    total = _sum_halves(tile, v_ref, s_ref, bits, k)
    for h in (0, 1):
      pltr.store(tile.half(o_ref, h), total[h].astype(dtype), mask=tile.mask())

  call = _call(kernel, tile, f"jzero_dequantize_sum_int{bits}",
               [tile.values_spec(bits, k), tile.rows_spec(k)],
               tile.block_spec(tile.width + tile.padded),
               jax.ShapeDtypeStruct((rows, group_size), dtype), interpret)
  return call(values, scales)


def requantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, out_bits: int,
                          rule: str = "deepspeed", *, interpret: bool = False
                          ) -> tuple[jax.Array, jax.Array]:
  """Pallas :func:`jzero.kernels.reference.requantize_sum_blocks`: the sum, quantized again."""
  k, rows, group_size = _stacked_shape(values, bits)
  tile = _Tile(rows, group_size)

  def kernel(v_ref, s_ref, ov_ref, os_ref):
    total = _sum_halves(tile, v_ref, s_ref, bits, k)
    q, out_scales = _quantize_halves(total, out_bits, rule)
    _store_q(tile, ov_ref, q, out_bits)
    pltr.store(os_ref, out_scales, mask=tile.row_mask())

  call = _call(kernel, tile, f"jzero_requantize_sum_int{bits}_int{out_bits}",
               [tile.values_spec(bits, k), tile.rows_spec(k)],
               [tile.values_spec(out_bits), tile.rows_spec()],
               [_values_shape(rows, group_size, out_bits),
                jax.ShapeDtypeStruct((rows,), jnp.float32)], interpret)
  return tuple(call(values, scales))
