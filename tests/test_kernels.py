"""ZeRO++ quantization kernels: error bounds, inf/nan, int4 packing, Pallas == jnp bit for bit,
dequantize-and-sum, collectives in shard_map, bytes, group sizes, errors, CUDA lowering."""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import kernels
from jzero.errors import ConfigError
from kernels import pallas as kpallas
from kernels import reference as kref

TRITON_CALL = "__gpu$xla.gpu.triton"


def _blocky(key: int, shape: tuple[int, ...], group_size: int, dtype=jnp.float32) -> jax.Array:
  """Normal noise whose scale changes from block to block (1e-3 .. 1e3), every 5th block zero."""
  n = math.prod(shape)
  rng = np.random.default_rng(key)
  flat = rng.standard_normal(n)
  block = np.arange(n) // group_size
  scale = 10.0 ** rng.uniform(-3, 3, size=block.max() + 1)
  scale[::5] = 0.0
  return jnp.asarray((flat * scale[block]).reshape(shape), dtype)


def _per_block(x: np.ndarray, group_size: int) -> np.ndarray:
  """float64 ``(groups, G)`` of a chunk, zero-padded like the kernels pad it."""
  flat = np.asarray(x, np.float64).reshape(-1)
  groups = -(-flat.size // group_size)
  return np.pad(flat, (0, groups * group_size - flat.size)).reshape(groups, group_size)


def _same(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
      a.view(np.uint8) if a.dtype.itemsize == 1 else a, b.view(np.uint8)
      if b.dtype.itemsize == 1 else b, equal_nan=a.dtype.kind == "f")


def _same_q(a: kernels.Quantized, b: kernels.Quantized) -> bool:
  return (a.shape, a.dtype, a.bits, a.group_size) == (b.shape, b.dtype, b.bits, b.group_size) and (
      _same(a.values, b.values) and _same(a.scales, b.scales))


# ------------------------------------------------------------------------------------------------
# Rounding: the kernels' round-half-to-even is jnp.round, bit for bit.


def test_round_half_even_matches_jnp_round():
  ties = np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)
  near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                         np.nextafter(ties, np.float32(-np.inf))])
  rng = np.random.default_rng(0)
  y = np.concatenate([ties, near, np.arange(-300, 301, dtype=np.float32),
                      rng.uniform(-200, 200, 20000).astype(np.float32),
                      rng.uniform(-1, 1, 2000).astype(np.float32), [0.0, -0.0, 0.5, -0.5]])
  y = jnp.asarray(y, jnp.float32)
  want = jnp.round(y).astype(jnp.int32)
  assert _same(jax.jit(kpallas.round_half_even)(y), want)
  assert _same(kpallas.round_half_even(y), want)
  # ties go to the even neighbour, not away from zero
  assert np.asarray(kpallas.round_half_even(jnp.asarray([0.5, 1.5, 2.5, -2.5, -3.5]))).tolist() == [
      0, 2, 2, -2, -4]


# ------------------------------------------------------------------------------------------------
# Error bounds.


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, group_size", [
    ((4096,), 2048), ((3, 5, 7), 16), ((129, 33), 256), ((1000,), 998), ((7,), 2048),
    ((64, 64), 4096)])
def test_roundtrip_error_bound(bits, dtype, shape, group_size):
  x = _blocky(hash((shape, group_size)) % 1000, shape, group_size, dtype)
  blocks = _per_block(x, group_size)
  absmax = np.abs(blocks).max(axis=1, keepdims=True)
  top = 2.0 ** (bits - 1)
  slack = 1e-5 * absmax / top  # float32 rounding of x * r and of q * scale

  q = kernels.quantize(x, bits, group_size, impl="jnp")
  assert q.dtype == jnp.dtype(dtype) and q.shape == shape
  out = kernels.dequantize(q, jnp.float32, impl="jnp")
  assert out.shape == shape and out.dtype == jnp.float32
  err = np.abs(_per_block(out, group_size) - blocks)
  # DeepSpeed's rule: half a step (absmax / 2^b) everywhere but at the top, where +absmax lands
  # on 2^(b-1) and clips to 2^(b-1) - 1: one full step there.
  clipped = blocks * (top / np.where(absmax == 0, 1, absmax)) >= top - 0.5
  assert np.all(err[~clipped] <= (absmax / (2 * top) + slack)[np.broadcast_to(~clipped, err.shape)
                                                             .nonzero()[0]])
  assert np.all(err <= absmax / top + slack)
  assert clipped.any()  # the bound above is really exercised

  q = kernels.quantize(x, bits, group_size, rule="no_clip", impl="jnp")
  out = _per_block(kernels.dequantize(q, jnp.float32, impl="jnp"), group_size)
  # issue 10's bound, every element: absmax / (2^(b-1) - 1) / 2
  assert np.all(np.abs(out - blocks) <= absmax / (top - 1) / 2 + slack)

  zero = (absmax == 0)[:, 0]
  assert zero.any() and np.all(np.asarray(q.scales).reshape(-1)[zero] == 1.0)
  assert np.all(out[zero] == 0)


def test_scales_are_deepspeeds_stored_value():
  x = jnp.asarray([[0.0] * 8, [1.0, -3.0, 0.5, 2.0, 0, 0, 0, 0], [-5.0, 5.0, 1, 1, 1, 1, 1, 1]])
  q8 = kernels.quantize(x, 8, 8, impl="jnp")
  np.testing.assert_array_equal(np.asarray(q8.scales), [1.0, 3.0 / 128, 5.0 / 128])
  # +absmax maps to 128 and clips to 127; -absmax is -128 exactly
  assert np.asarray(q8.values)[2, :2].tolist() == [-128, 127]
  assert np.asarray(q8.values)[1, :4].tolist() == [43, -128, 21, 85]
  q4 = kernels.quantize(x, 4, 8, rule="no_clip", impl="jnp")
  np.testing.assert_array_equal(np.asarray(q4.scales), np.float32([1.0, 3.0, 5.0]) * np.float32(
      1 / 7))


def test_tiny_blocks_quantize_to_zero_with_scale_one():
  # absmax below 2^(b-1) * 2^-126: the stored scale would be subnormal (flushed to zero on GPUs)
  x = jnp.asarray([1e-37, -2e-37, 0, 0, 1.0, 0.5, 0, 0], jnp.float32)
  q = kernels.quantize(x, 8, 4, impl="jnp")
  np.testing.assert_array_equal(np.asarray(q.scales), [1.0, 1.0 / 128])
  np.testing.assert_array_equal(np.asarray(kernels.dequantize(q))[:4], 0.0)


# ------------------------------------------------------------------------------------------------
# inf / nan: a block holding one dequantizes to nan everywhere, so an overflow check sees it.


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_inf_nan_poison_their_block(bad, impl):
  x = np.asarray(_blocky(1, (4, 64), 64))
  x[1, 17] = bad
  q = kernels.quantize(jnp.asarray(x, jnp.bfloat16), 8, 64, impl=impl)
  scales = np.asarray(q.scales)
  assert np.isnan(scales[1]) and np.isfinite(scales[[0, 2, 3]]).all()
  assert np.all(np.asarray(q.values)[1] == 0)
  out = np.asarray(kernels.dequantize(q, jnp.float16, impl=impl), np.float32)
  assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2, 3]]).all()
  # ... through the sums, and when the fp32 sum itself overflows
  stacked = kernels.quantize(jnp.asarray(np.stack([x, x]), jnp.float32), 4, 64, batch_dims=1,
                             impl=impl)
  assert np.isnan(np.asarray(kernels.dequantize_sum(stacked, impl=impl))[1]).all()
  assert np.isnan(np.asarray(kernels.requantize_sum(stacked, impl=impl).scales)[1])
  huge = jnp.full((2, 64), 3e38, jnp.float32)
  total = kernels.requantize_sum(kernels.quantize(huge, 8, 64, batch_dims=1, impl=impl), impl=impl)
  assert np.isnan(np.asarray(kernels.dequantize(total, impl=impl))).all()
  assert np.isinf(np.asarray(kernels.dequantize_sum(
      kernels.quantize(huge, 8, 64, batch_dims=1, impl=impl), impl=impl))).all()


# ------------------------------------------------------------------------------------------------
# int4 packing.


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_int4_packing_roundtrip(impl):
  g = 32
  codes = np.resize(np.arange(-8, 8), (3, g))  # every code, in both halves of a block
  codes[:, 0] = -8  # so every block's absmax is 8 * scale
  codes = np.random.default_rng(0).permuted(codes, axis=1)
  codes[:, 0], codes[:, 1] = -8, 7
  scale = np.float32([0.5, 2.0, 0.125])
  x = jnp.asarray(codes * scale[:, None], jnp.float32)
  q = kernels.quantize(x, 4, g, impl=impl)
  assert q.values.dtype == jnp.uint8 and q.values.shape == (3, g // 2)
  np.testing.assert_array_equal(np.asarray(q.scales), scale)
  nib = codes & 15
  want = (nib[:, : g // 2] << 4) | nib[:, g // 2:]  # element j high nibble, j + G/2 low nibble
  np.testing.assert_array_equal(np.asarray(q.values), want.astype(np.uint8))
  np.testing.assert_array_equal(np.asarray(kernels.dequantize(q, impl=impl)), np.asarray(x))


# ------------------------------------------------------------------------------------------------
# Pallas (interpret mode) == jnp reference, bit for bit.


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape, group_size, dtype, rule", [
    ((37, 100), 64, jnp.float32, "deepspeed"),  # ragged rows: 58 blocks, 64 per program
    ((3, 1000), 100, jnp.bfloat16, "deepspeed"),  # ragged columns: 100 -> 128 lanes
    ((2, 5000), 4096, jnp.float16, "no_clip"),  # one block per program, padded last block
    ((9,), 2, jnp.float32, "deepspeed"),
])
def test_pallas_equals_reference(bits, shape, group_size, dtype, rule):
  x = _blocky(7, shape, group_size, dtype)
  qr = kernels.quantize(x, bits, group_size, rule=rule, impl="jnp")
  qp = kernels.quantize(x, bits, group_size, rule=rule, impl="pallas")
  assert _same_q(qr, qp)
  for out_dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    assert _same(kernels.dequantize(qr, out_dtype, impl="jnp"),
                 kernels.dequantize(qr, out_dtype, impl="pallas"))


@pytest.mark.parametrize("bits, out_bits, k", [(8, 8, 3), (4, 4, 4), (8, 4, 2), (4, 8, 1)])
def test_sums_pallas_equal_reference(bits, out_bits, k):
  x = jnp.stack([_blocky(j, (2, 150), 96) for j in range(k)])
  q = kernels.quantize(x, bits, 96, batch_dims=1, impl="jnp")
  assert _same(kernels.dequantize_sum(q, impl="jnp"), kernels.dequantize_sum(q, impl="pallas"))
  assert _same_q(kernels.requantize_sum(q, out_bits, impl="jnp"),
                 kernels.requantize_sum(q, out_bits, impl="pallas"))


# ------------------------------------------------------------------------------------------------
# Dequantize-and-sum.


def test_dequantize_sum_is_the_fp32_sum_of_dequantized_chunks():
  x = jnp.stack([_blocky(j, (5, 3, 40), 64, jnp.bfloat16) for j in range(6)]).reshape(
      3, 2, 5, 3, 40)
  q = kernels.quantize(x, 4, 64, batch_dims=2, impl="jnp")
  assert q.stack_shape == (3, 2) and q.shape == (5, 3, 40)
  total = kernels.dequantize_sum(q, impl="jnp")
  assert total.shape == (2, 5, 3, 40) and total.dtype == jnp.float32
  parts = kernels.dequantize(q, jnp.float32, impl="jnp")
  want = parts[0] + parts[1] + parts[2]  # chunk 0 first, in float32
  assert _same(total, want)
  np.testing.assert_allclose(np.asarray(total), np.asarray(parts).sum(0), rtol=1e-6, atol=1e-6)
  assert _same(kernels.dequantize_sum(q, jnp.bfloat16, impl="jnp"), want.astype(jnp.bfloat16))
  # requantize_sum is quantize(dequantize_sum) in one pass, with the remaining stack axis kept
  again = kernels.requantize_sum(q, impl="jnp")
  assert again.stack_shape == (2,) and again.bits == 4 and again.group_size == 64
  ref = kernels.quantize(want, 4, 64, batch_dims=1, impl="jnp")
  assert _same(again.values, ref.values) and _same(again.scales, ref.scales)
  assert again.dtype == jnp.bfloat16  # the chunks' dtype is kept for dequantize's default
