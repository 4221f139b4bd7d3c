"""Pallas kernels (Triton backend) for the block views of :mod:`kernels.reference`.

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

* every array a kernel operates on must have a power-of-two size: a block is ``TG`` rows of
  ``Wp = next_pow2(W)`` columns, loads and stores are masked at the ragged edges (plain ``ref[...]``
  loads are not bounds-checked on GPU);
* there is no ``round``: :func:`round_half_even` builds it from truncation (the magic-number trick
  ``(y + 1.5 * 2^23) - 1.5 * 2^23`` is folded to ``y`` by XLA, so interpret mode would truncate);
* ``max`` lowers to ``maxnumf``, which drops nans: absmax is taken over finite elements only and
  non-finite elements are counted separately, which is also what the reference does;
* float32 division lowers to ``div.full.f32`` (within 2 ulp), as XLA's own GPU division does, so
  on a GPU the kernel and the jnp reference still agree; on CPU both divide exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from kernels.reference import F32_MAX, inverse, numerator, tiny_absmax

__all__ = ["quantize_blocks", "dequantize_sum_blocks", "requantize_sum_blocks",
           "round_half_even", "tiling", "BLOCK_ELEMENTS"]

BLOCK_ELEMENTS = 4096  # elements one program handles (rows x planes x padded columns)


def round_half_even(y: jax.Array) -> jax.Array:
  """int32 round-half-to-even of float32 ``y`` (``|y| < 2^31``), from truncation.

  ``t = trunc(y)`` (float-to-int conversion), ``f = y - t`` is exact (Sterbenz), and ``t`` moves
  one step away from zero when ``|f| > 1/2``, or ``|f| = 1/2`` and ``t`` is odd. Unlike the
  ``(y + 1.5 * 2^23) - 1.5 * 2^23`` trick, no compiler may simplify it away: XLA folds that one to
  ``y``, which breaks interpret mode.
  """
  t = y.astype(jnp.int32)
  f = y - t.astype(jnp.float32)
  odd = jnp.bitwise_and(t, 1) == 1
  up = (f > 0.5) | ((f == 0.5) & odd)
  down = (f < -0.5) | ((f == -0.5) & odd)
  return t + up.astype(jnp.int32) - down.astype(jnp.int32)


def tiling(rows: int, planes: int, width: int) -> tuple[int, int, int]:
  """(rows per program, padded width, num_warps) for blocks of ``planes`` x ``width``."""
  padded = pl.next_power_of_2(width)
  per_row = planes * padded
  tg = max(1, min(BLOCK_ELEMENTS // per_row, pl.next_power_of_2(max(rows, 1))))
  warps = max(4, min(16, tg * per_row // 1024))
  return tg, padded, warps


class _Tile:
  """Static facts of one program's tile and its masks at the ragged edges."""

  def __init__(self, rows: int, planes: int, width: int):
    self.rows, self.planes, self.width = rows, planes, width
    self.tg, self.padded, self.warps = tiling(rows, planes, width)
    self.ragged_rows = rows % self.tg != 0
    self.ragged_cols = self.padded != width

  def row_mask(self) -> jax.Array | None:
    if not self.ragged_rows:
      return None
    return pl.program_id(0) * self.tg + lax.broadcasted_iota(jnp.int32, (self.tg,), 0) < self.rows

  def mask(self, shape: tuple[int, ...]) -> jax.Array | None:
    """Mask of a ``(tg, [1,] padded)`` tile: rows and columns inside the array, or None."""
    if not (self.ragged_rows or self.ragged_cols):
      return None
    row_dim, col_dim = 0, len(shape) - 1
    ok = jnp.ones(shape, jnp.bool_)
    if self.ragged_rows:
      ok &= (pl.program_id(0) * self.tg + lax.broadcasted_iota(jnp.int32, shape, row_dim)
             < self.rows)
    if self.ragged_cols:
      ok &= lax.broadcasted_iota(jnp.int32, shape, col_dim) < self.width
    return ok

  def load(self, ref, other) -> jax.Array:
    mask = self.mask(tuple(ref.shape))
    return pltr.load(ref, mask=mask, other=None if mask is None else other)

  def load_rows(self, ref, other) -> jax.Array:
    mask = self.row_mask()
    return pltr.load(ref, mask=mask, other=None if mask is None else other)

  def store(self, ref, value: jax.Array) -> None:
    pltr.store(ref, value, mask=self.mask(tuple(ref.shape)))

  def store_rows(self, ref, value: jax.Array) -> None:
    pltr.store(ref, value, mask=self.row_mask())


def _plane(ref, h: int, *lead):
  """The ``(tg, 1, padded)`` view of plane ``h`` of a ``(*lead, tg, H, padded)`` block ref; one
  indexer only (the Triton lowering takes no chained ones)."""
  return ref.at[(*lead, slice(None), pl.ds(h, 1), slice(None))]


def _load_float_planes(tile: _Tile, x_ref) -> list[jax.Array]:
  return [tile.load(_plane(x_ref, h), 0.0).astype(jnp.float32) for h in range(tile.planes)]


def _load_q_planes(tile: _Tile, v_ref, bits: int, *lead) -> list[jax.Array]:
  """int32 planes ``(tg, 1, padded)`` of a values block ref: int8 ``(*lead, tg, H, padded)``,
  uint8 ``(*lead, tg, padded)``."""
  if bits == 8:
    return [tile.load(_plane(v_ref, h, *lead), 0).astype(jnp.int32) for h in range(tile.planes)]
  b = tile.load(v_ref.at[lead] if lead else v_ref, 0).astype(jnp.int32)[:, None, :]
  planes = [jnp.right_shift(b, 4), jnp.bitwise_and(b, 15)]
  return [jnp.where(p >= 8, p - 16, p) for p in planes]


def _store_q_planes(tile: _Tile, v_ref, q: list[jax.Array], bits: int) -> None:
  if bits == 8:
    for h, plane in enumerate(q):
      tile.store(_plane(v_ref, h), plane.astype(jnp.int8))
    return
  hi, lo = jnp.bitwise_and(q[0], 15), jnp.bitwise_and(q[1], 15)
  tile.store(v_ref, (jnp.left_shift(hi, 4) + lo).astype(jnp.uint8)[:, 0, :])


def _block_max(planes: list[jax.Array]) -> jax.Array:
  """Per-row max over planes of ``(tg, 1, padded)`` arrays -> ``(tg,)``."""
  out = None
  for p in planes:
    m = jnp.max(p[:, 0, :], axis=1)
    out = m if out is None else jnp.maximum(out, m)
  return out


def _quantize_planes(x: list[jax.Array], bits: int, rule: str
                     ) -> tuple[list[jax.Array], jax.Array]:
  """float32 planes -> (int32 planes in range, float32 scales ``(tg,)``), as the reference."""
  numer = numerator(bits, rule)
  a = [jnp.abs(p) for p in x]
  finite = [v <= F32_MAX for v in a]
  bad = _block_max([jnp.where(f, 0.0, 1.0) for f in finite]) > 0.0
  absmax = _block_max([jnp.where(f, v, 0.0) for f, v in zip(finite, a)])
  tiny = absmax < tiny_absmax(numer)
  r = numer / jnp.where(tiny, numer, absmax)
  scales = jnp.where(bad, jnp.nan, jnp.where(tiny, 1.0, absmax * inverse(numer)))
  lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  q = []
  for p in x:
    y = jnp.where(bad[:, None, None], 0.0, p * r[:, None, None])
    q.append(jnp.clip(round_half_even(y), lo, hi))
  return q, scales


def _sum_planes(tile: _Tile, v_ref, s_ref, bits: int, k: int) -> list[jax.Array]:
  """float32 planes of the sum over the K chunks of stacked block refs, chunk 0 first."""
  def chunk(j):
    j = jnp.int32(j) if isinstance(j, int) else j  # a Python int index breaks interpret mode
    scale = tile.load_rows(s_ref.at[j], 0.0)[:, None, None]
    return [q.astype(jnp.float32) * scale for q in _load_q_planes(tile, v_ref, bits, j)]

  def body(j, acc):
    return [a + c for a, c in zip(acc, chunk(j))]

  return lax.fori_loop(1, k, body, chunk(0)) if k > 1 else chunk(0)


def _params(tile: _Tile):
  return pltr.CompilerParams(num_warps=tile.warps, num_stages=1)


def _specs(tile: _Tile, bits: int, stacked: int | None = None):
  """BlockSpecs of (values, scales) blocks, with a leading unblocked axis of ``stacked``."""
  if bits == 8:
    v_block, v_index = (tile.tg, tile.planes, tile.padded), (lambda i: (i, 0, 0))
  else:
    v_block, v_index = (tile.tg, tile.padded), (lambda i: (i, 0))
  s_block, s_index = (tile.tg,), (lambda i: (i,))
  if stacked is not None:
    v_block, s_block = (stacked, *v_block), (stacked, *s_block)
    v_index = functools.partial(lambda f, i: (0, *f(i)), v_index)
    s_index = functools.partial(lambda f, i: (0, *f(i)), s_index)
  return pl.BlockSpec(v_block, v_index), pl.BlockSpec(s_block, s_index)


def _q_shape(rows: int, planes: int, width: int, bits: int) -> jax.ShapeDtypeStruct:
  if bits == 8:
    return jax.ShapeDtypeStruct((rows, planes, width), jnp.int8)
  return jax.ShapeDtypeStruct((rows, width), jnp.uint8)


def quantize_blocks(x: jax.Array, bits: int, rule: str = "deepspeed", *, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
  """Pallas :func:`kernels.reference.quantize_blocks`: float ``(R, H, W)`` -> values, scales."""
  rows, planes, width = x.shape
  tile = _Tile(rows, planes, width)

  def kernel(x_ref, v_ref, s_ref):
    q, scales = _quantize_planes(_load_float_planes(tile, x_ref), bits, rule)
    _store_q_planes(tile, v_ref, q, bits)
    tile.store_rows(s_ref, scales)

  v_spec, s_spec = _specs(tile, bits)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, tile.tg),),
      in_specs=[pl.BlockSpec((tile.tg, planes, tile.padded), lambda i: (i, 0, 0))],
      out_specs=[v_spec, s_spec],
      out_shape=[_q_shape(rows, planes, width, bits), jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=_params(tile), interpret=interpret, name=f"jzero_quantize_int{bits}",
  )(x)


def dequantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, dtype: jnp.dtype, *,
                          interpret: bool = False) -> jax.Array:
  """Pallas :func:`kernels.reference.dequantize_sum_blocks`: ``(K, R, ...)`` -> ``(R, H, W)``."""
  k, rows = scales.shape
  planes, width = (values.shape[2], values.shape[3]) if bits == 8 else (2, values.shape[2])
  tile = _Tile(rows, planes, width)

  def kernel(v_ref, s_ref, o_ref):
    total = _sum_planes(tile, v_ref, s_ref, bits, k)
    for h, plane in enumerate(total):
      tile.store(_plane(o_ref, h), plane.astype(dtype))

  v_spec, s_spec = _specs(tile, bits, stacked=k)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, tile.tg),), in_specs=[v_spec, s_spec],
      out_specs=pl.BlockSpec((tile.tg, planes, tile.padded), lambda i: (i, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, planes, width), dtype),
      compiler_params=_params(tile), interpret=interpret,
      name=f"jzero_dequantize_sum_int{bits}",
  )(values, scales)


def requantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, out_bits: int,
                          rule: str = "deepspeed", *, interpret: bool = False
                          ) -> tuple[jax.Array, jax.Array]:
  """Pallas :func:`kernels.reference.requantize_sum_blocks`: the sum, quantized again."""
  k, rows = scales.shape
  planes, width = (values.shape[2], values.shape[3]) if bits == 8 else (2, values.shape[2])
  tile = _Tile(rows, planes, width)

  def kernel(v_ref, s_ref, ov_ref, os_ref):
    q, out_scales = _quantize_planes(_sum_planes(tile, v_ref, s_ref, bits, k), out_bits, rule)
    _store_q_planes(tile, ov_ref, q, out_bits)
    tile.store_rows(os_ref, out_scales)

  in_v, in_s = _specs(tile, bits, stacked=k)
  out_v, out_s = _specs(tile, out_bits)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, tile.tg),), in_specs=[in_v, in_s], out_specs=[out_v, out_s],
      out_shape=[_q_shape(rows, planes, width, out_bits),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=_params(tile), interpret=interpret,
      name=f"jzero_requantize_sum_int{bits}_int{out_bits}",
  )(values, scales)
