"""Plain-jnp reference of the block kernels: the definition the Pallas kernels are held to.

Every function here works on *block views* (see :mod:`jzero.kernels.layout` for the public layout):
float ``x`` is ``(R, G)``, R blocks of G elements; int8 values are ``(R, G)``; int4 values are
uint8 ``(R, G/2)``, byte j holding element j in its high nibble and element j + G/2 in its low
one; scales are float32 ``(R,)``; the stacked inputs of the sums carry a leading ``K`` axis on
values and scales.

Every step is written in a form XLA's algebraic simplifier leaves alone (it turns ``a / c`` into
``a * (1 / c)``, ``1 / (c / m)`` into ``m * (1 / c)`` and a division by a broadcast into a
multiplication by its reciprocal -- each a different rounding), so the reference, the kernel in
interpret mode and the kernel on a GPU compute the same float32 operations.

The math per block (DeepSpeed's symmetric quantizer, ``quantization_utils.h``), in float32:

* ``absmax`` = the largest ``|x|`` of the block's finite elements; ``numer`` = 2^(b-1)
  (``rule="deepspeed"``: +absmax lands on 2^(b-1) and clips to 2^(b-1) - 1) or 2^(b-1) - 1
  (``rule="no_clip"``: absmax lands exactly on the top level);
* ``r = numer / absmax`` and stored scale ``absmax * (1 / numer)`` -- or both 1 when
  ``absmax < numer * 2^-100`` (all-zero blocks, as DeepSpeed, and blocks so small, below about
  1e-28, that their scale would be near the subnormal range, which GPUs may flush to zero: they
  quantize to zeros);
* ``q = clip(round_half_even(x * r), -2^(b-1), 2^(b-1) - 1)``, exactly DeepSpeed's product. The
  stored scale is exactly ``absmax / 2^(b-1)`` for DeepSpeed's rule, the value its reference
  describes (DeepSpeed computes it as ``1 / r``, which can differ in the last bit);
* a block holding an inf or a nan stores q = 0 and scale nan, so it dequantizes to nan everywhere
  and a loss-scale overflow check still sees it (DeepSpeed's kernel would turn a nan block into
  finite numbers: its half-precision max drops nans);
* dequantize ``q * scale`` in float32 (correctly rounded, see :func:`scaled`), cast to the
  requested dtype; sums add the K dequantized chunks one after another, in float32, chunk 0
  first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["quantize_blocks", "dequantize_sum_blocks", "requantize_sum_blocks", "numerator",
           "inverse", "tiny_absmax", "split_scale", "scaled", "round_half_even", "F32_MAX",
           "TINY_SCALE"]

F32_MAX = float(np.finfo(np.float32).max)


def numerator(bits: int, rule: str) -> float:
  """What ``absmax`` maps to: 2^(b-1) (DeepSpeed) or 2^(b-1) - 1 (``no_clip``)."""
  top = float(2 ** (bits - 1))
  return top if rule == "deepspeed" else top - 1.0


def inverse(numer: float) -> float:
  """``1 / numer`` rounded to float32 (exact for DeepSpeed's power-of-two numerators)."""
  return float(np.float32(1.0 / numer))


TINY_SCALE = 2.0 ** -100  # smallest stored scale; both of its parts (split_scale) stay normal


def tiny_absmax(numer: float) -> float:
  """Blocks whose absmax is below this are stored with scale 1 and quantize to zeros."""
  return float(np.float32(numer) * np.float32(TINY_SCALE))


def split_scale(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``scales`` as ``hi + lo``: ``hi`` its top 16 significant bits, ``lo`` the other 8, exactly."""
  bits = jax.lax.bitcast_convert_type(scales, jnp.int32)
  hi = jax.lax.bitcast_convert_type(jnp.bitwise_and(bits, -256), jnp.float32)
  return hi, scales - hi


def scaled(q: jax.Array, hi: jax.Array, lo: jax.Array) -> jax.Array:
  """float32 ``q * scale``, correctly rounded, for integer-valued float32 ``|q| <= 128``.

  Both partial products are exact (7 + 16 and 7 + 8 significant bits), so their sum is rounded
  once whether or not a compiler contracts a multiply and an add into an FMA -- XLA:CPU does so
  in some fusions and not in others, which would otherwise change the last bit of a sum of
  dequantized chunks between the reference, interpret mode and the GPU kernel.
  """
  return q * hi + q * lo


def round_half_even(y: jax.Array) -> jax.Array:
  """int32 round-half-to-even of float32 ``y`` (``|y| < 2^22``), from truncation: the kernels' round
  (Triton and Mosaic have none that interpret mode keeps).

  ``t = trunc(y)`` (float-to-int conversion); ``t`` moves one step away from zero when ``y`` lies
  beyond ``t +- 1/2``, or on it with ``t`` odd (``t +- 1/2`` is exact). ``y`` is only converted
  and compared, never added to, so no compiler can fuse the product that made it into an FMA;
  and unlike the ``(y + 1.5 * 2^23) - 1.5 * 2^23`` trick nothing here simplifies away (XLA folds
  that one to ``y``, which would make interpret mode truncate).
  """
  t = y.astype(jnp.int32)
  tf = t.astype(jnp.float32)
  odd = jnp.bitwise_and(t, 1) == 1
  up = (y > tf + 0.5) | ((y == tf + 0.5) & odd)
  down = (y < tf - 0.5) | ((y == tf - 0.5) & odd)
  return t + up.astype(jnp.int32) - down.astype(jnp.int32)


def _unpack_int4(values: jax.Array) -> jax.Array:
  """uint8 ``(..., G/2)`` -> int32 ``(..., G)``: the high nibbles, then the low ones, signed."""
  b = values.astype(jnp.int32)
  q = jnp.concatenate([jnp.right_shift(b, 4), jnp.bitwise_and(b, 15)], axis=-1)
  return jnp.where(q >= 8, q - 16, q)


def _pack_int4(q: jax.Array) -> jax.Array:
  """int32 ``(R, G)`` in [-8, 7] -> uint8 ``(R, G/2)``."""
  half = q.shape[-1] // 2
  hi, lo = jnp.bitwise_and(q[:, :half], 15), jnp.bitwise_and(q[:, half:], 15)
  return (jnp.left_shift(hi, 4) + lo).astype(jnp.uint8)


def _quantize_f32(x: jax.Array, bits: int, rule: str) -> tuple[jax.Array, jax.Array]:
  """float32 ``(R, G)`` -> (int32 q in range, float32 scales ``(R,)``)."""
  numer = numerator(bits, rule)
  a = jnp.abs(x)
  finite = a <= F32_MAX
  bad = jnp.max(jnp.where(finite, 0.0, 1.0), axis=1) > 0.0
  absmax = jnp.max(jnp.where(finite, a, 0.0), axis=1)
  tiny = absmax < tiny_absmax(numer)
  r = numer / jnp.where(tiny, numer, absmax)
  scales = jnp.where(bad, jnp.nan, jnp.where(tiny, 1.0, absmax * inverse(numer)))
  y = jnp.where(bad[:, None], 0.0, x * r[:, None])
  lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  q = jnp.clip(jnp.round(y), lo, hi).astype(jnp.int32)
  return q, scales.astype(jnp.float32)


def _store(q: jax.Array, bits: int) -> jax.Array:
  return q.astype(jnp.int8) if bits == 8 else _pack_int4(q)


def _dequantize_sum_f32(values: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
  """Stacked ``(K, R, ...)`` values and ``(K, R)`` scales -> float32 ``(R, G)`` sum."""
  total = None
  for j in range(values.shape[0]):
    q = values[j].astype(jnp.int32) if bits == 8 else _unpack_int4(values[j])
    hi, lo = split_scale(scales[j][:, None])
    chunk = scaled(q.astype(jnp.float32), hi, lo)
    total = chunk if total is None else total + chunk
  return total


def quantize_blocks(x: jax.Array, bits: int, rule: str = "deepspeed"
                    ) -> tuple[jax.Array, jax.Array]:
  """Float ``(R, G)`` -> (values, float32 scales ``(R,)``)."""
  q, scales = _quantize_f32(x.astype(jnp.float32), bits, rule)
  return _store(q, bits), scales


def dequantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int,
                          dtype: jnp.dtype) -> jax.Array:
  """Sum over the leading K axis of dequantized blocks, ``(R, G)`` in ``dtype``."""
  return _dequantize_sum_f32(values, scales, bits).astype(dtype)


def requantize_sum_blocks(values: jax.Array, scales: jax.Array, bits: int, out_bits: int,
                          rule: str = "deepspeed") -> tuple[jax.Array, jax.Array]:
  """The float32 sum of :func:`dequantize_sum_blocks`, quantized again to ``out_bits``."""
  q, out_scales = _quantize_f32(_dequantize_sum_f32(values, scales, bits), out_bits, rule)
  return _store(q, out_bits), out_scales
