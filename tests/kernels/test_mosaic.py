"""ZeRO++'s TPU (Mosaic) kernels: equal to the jnp reference bit for bit in interpret mode, with
TPU-legal tiles, and compiled for a compile-only v5e chip (libtpu, no TPU) through
``impl="auto"``, one Mosaic custom call per operation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jzero import kernels
from jzero.kernels import mosaic, reference
from jzero.runtime import quiet_start

needs_libtpu = pytest.mark.skipif(
    not quiet_start.tpu_compiler_installed(),
    reason="libtpu is not installed: pip install -e '.[tpu-aot]' compiles for TPU without a TPU")


def _blocks(key: int, rows: int, group_size: int, dtype=jnp.float32) -> jax.Array:
  """``(rows, G)`` noise whose scale changes per row (1e-3 .. 1e3); row 0 is zero, row 1 holds an
  inf, row 2 a nan, row 3 is all 3e38 (a float32 sum of two such chunks overflows)."""
  rng = np.random.default_rng(key)
  x = rng.standard_normal((rows, group_size)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
  x[0], x[1, 7], x[2, -1], x[3] = 0.0, np.inf, np.nan, 3e38
  return jnp.asarray(x.astype(np.float32), dtype)


def _same(a, b) -> bool:
  """Same dtype, shape and bits, any nan equal to any nan."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  bits = a.view(f"uint{8 * a.dtype.itemsize}"), b.view(f"uint{8 * b.dtype.itemsize}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    return bool(np.array_equal(*bits))
  nan = np.isnan(a.astype(np.float32))
  return bool(np.array_equal(nan, np.isnan(b.astype(np.float32)))
              and np.array_equal(bits[0][~nan], bits[1][~nan]))


def test_tiles_are_whole_rows_in_multiples_of_the_int8_tile():
  assert mosaic.tiling(5, 100) == 5  # all rows: the block is the array
  assert mosaic.tiling(70, 1024) == 64  # 2 programs, the second ragged
  assert mosaic.tiling(70, 1024, k=3) == 32 and mosaic.tiling(1000, 8192) == 32
  assert mosaic.tiling(31, 8192, k=8) == 31


@pytest.mark.parametrize("rows, group_size, dtype, bits, rule", [
    (70, 1024, jnp.float32, 8, "deepspeed"),  # 64-row tiles, a ragged last program
    (5, 100, jnp.bfloat16, 4, "no_clip"),  # one program; half-blocks of 50 lanes
    (40, 1024, jnp.float32, 4, "deepspeed"),
])
def test_mosaic_quantize_equals_reference_in_interpret_mode(rows, group_size, dtype, bits, rule):
  x = _blocks(rows, rows, group_size, dtype)
  got = jax.jit(lambda x: mosaic.quantize_blocks(x, bits, rule, interpret=True))(x)
  want = reference.quantize_blocks(x, bits, rule)
  assert _same(got[0], want[0]) and _same(got[1], want[1])
  assert np.isnan(np.asarray(got[1])[1:3]).all() and np.asarray(got[1])[0] == 1.0


@pytest.mark.parametrize("bits, out_bits, k", [(8, 4, 3), (4, 4, 2), (4, 8, 1)])
def test_mosaic_sums_equal_reference_in_interpret_mode(bits, out_bits, k):
  x = jnp.stack([_blocks(j, 70, 1024) * (j + 1) for j in range(k)])
  values, scales = jax.vmap(lambda c: reference.quantize_blocks(c, bits))(x)
  for dtype in (jnp.float32, jnp.bfloat16):
    got = jax.jit(lambda v, s: mosaic.dequantize_sum_blocks(v, s, bits, dtype, interpret=True))(
        values, scales)
    assert _same(got, reference.dequantize_sum_blocks(values, scales, bits, dtype))
  got = jax.jit(lambda v, s: mosaic.requantize_sum_blocks(v, s, bits, out_bits, interpret=True))(
      values, scales)
  want = reference.requantize_sum_blocks(values, scales, bits, out_bits)
  assert _same(got[0], want[0]) and _same(got[1], want[1])


@needs_libtpu
def test_every_operation_compiles_to_one_mosaic_kernel_for_a_v5e_chip():
  """impl="auto" lowered for TPU picks the Mosaic kernels: each operation's compiled program
  holds one tpu_custom_call, named after its kernel; a ragged group size (G = 7944, half-blocks
  of 3972 lanes) and row tiles with a ragged last program (70 blocks of 2048) included."""
  from jzero.planning.aot import pallas_calls  # noqa: PLC0415
  from jzero.planning.tpu_specs import tpu_devices  # noqa: PLC0415

  chip = SingleDeviceSharding(tpu_devices("v5e", "2x4")[0])

  def compiled(f, shape, dtype=jnp.float32) -> str:
    spec = jax.ShapeDtypeStruct(shape, dtype, sharding=chip)
    return jax.jit(f).trace(spec).lower().compile().as_text()

  for n, group in ((70 * 2048, 2048), (5 * 7944 + 17, 7944)):
    for bits in (8, 4):
      programs = {
          f"jzero_quantize_int{bits}": compiled(
              lambda x: kernels.quantize(x, bits, group, batch_dims=1), (4, n), jnp.bfloat16),
          f"jzero_dequantize_sum_int{bits}": compiled(
              lambda x: kernels.dequantize(kernels.quantize(x, bits, group, impl="jnp"),
                                           jnp.bfloat16), (n,)),
          f"jzero_requantize_sum_int{bits}_int4": compiled(
              lambda x: kernels.requantize_sum(
                  kernels.quantize(x, bits, group, batch_dims=1, impl="jnp"), 4), (3, n)),
      }
      for name, hlo in programs.items():
        assert pallas_calls(hlo) == 1 and name in hlo, (name, group)
