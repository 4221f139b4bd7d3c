"""ZeRO++ quantization kernels: error bounds, inf/nan, int4 packing, Pallas == jnp bit for bit,
dequantize-and-sum, collectives in shard_map, bytes, group sizes, errors, CUDA lowering."""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jzero import kernels
from jzero.errors import ConfigError
from jzero.kernels import reference as kref

TRITON_CALL = "__gpu$xla.gpu.triton"


def _blocky(key: int, shape: tuple[int, ...], group_size: int, dtype=jnp.float32) -> jax.Array:
  """Normal noise whose scale changes from block to block (1e-3 .. 1e3); blocks 3, 8, 13, ... are
  zero, and even blocks have their absmax at a positive element (the one DeepSpeed's rule clips)."""
  n = math.prod(shape)
  rng = np.random.default_rng(key)
  flat = np.pad(rng.standard_normal(n), (0, -n % group_size)).reshape(-1, group_size)
  scale = 10.0 ** rng.uniform(-3, 3, size=(flat.shape[0], 1))
  scale[3::5] = 0.0
  top = flat[np.arange(flat.shape[0]), np.abs(flat).argmax(axis=1)]
  sign = np.where(np.arange(flat.shape[0]) % 2 == 0, np.sign(top), 1.0)[:, None]
  return jnp.asarray((flat * scale * sign).reshape(-1)[:n].reshape(shape), dtype)


def _per_block(x: np.ndarray, group_size: int) -> np.ndarray:
  """float64 ``(groups, G)`` of a chunk, zero-padded like the kernels pad it."""
  flat = np.asarray(x, np.float64).reshape(-1)
  groups = -(-flat.size // group_size)
  return np.pad(flat, (0, groups * group_size - flat.size)).reshape(groups, group_size)


def _same(a, b) -> bool:
  """Same dtype, shape and bits -- except that any nan equals any nan (payloads may differ)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  bits = np.dtype(f"uint{8 * a.dtype.itemsize}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    return bool(np.array_equal(a.view(bits), b.view(bits)))
  nan = np.isnan(a.astype(np.float32))
  return bool(np.array_equal(nan, np.isnan(b.astype(np.float32)))
              and np.array_equal(a.view(bits)[~nan], b.view(bits)[~nan]))


def _same_q(a: kernels.Quantized, b: kernels.Quantized) -> bool:
  return (a.shape, a.dtype, a.bits, a.group_size) == (b.shape, b.dtype, b.bits, b.group_size) and (
      _same(a.values, b.values) and _same(a.scales, b.scales))


# jitted entry points (eager dispatch compiles every small op of the wrappers one by one)
_quantize = jax.jit(kernels.quantize, static_argnames=("bits", "group_size", "batch_dims", "rule",
                                                       "impl"))
_dequantize = jax.jit(kernels.dequantize, static_argnames=("dtype", "concat_axis", "impl"))
_dequantize_sum = jax.jit(kernels.dequantize_sum, static_argnames=("dtype", "impl"))
_requantize_sum = jax.jit(kernels.requantize_sum, static_argnames=("bits", "rule", "impl"))


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
  want = np.round(np.asarray(y)).astype(np.int32)  # numpy rounds half to even too
  assert _same(jax.jit(kref.round_half_even)(y), want)
  # ties go to the even neighbour, not away from zero
  assert np.asarray(jax.jit(kref.round_half_even)(
      jnp.asarray([0.5, 1.5, 2.5, -2.5, -3.5]))).tolist() == [0, 2, 2, -2, -4]


# ------------------------------------------------------------------------------------------------
# Error bounds.


@functools.partial(jax.jit, static_argnums=(1, 2))
def _roundtrip(x, bits, group_size):
  """(Quantized, float32 dequantized) for rule "deepspeed", then for rule "no_clip"."""
  out = []
  for rule in kernels.RULES:
    q = kernels.quantize(x, bits, group_size, rule=rule, impl="jnp")
    out += [q, kernels.dequantize(q, jnp.float32, impl="jnp")]
  return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_roundtrip_error_bound(bits, dtype):
  top = 2.0 ** (bits - 1)
  for shape, group_size in [((8192,), 2048), ((3, 5, 7), 16), ((1000,), 98)]:
    x = _blocky(len(shape) + group_size, shape, group_size, dtype)
    blocks = _per_block(x, group_size)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    slack = 1e-5 * absmax / top  # float32 rounding of x * r and of q * scale

    q, out, q_no_clip, out_no_clip = _roundtrip(x, bits, group_size)
    assert q.dtype == jnp.dtype(dtype) and q.shape == shape == out.shape
    err = np.abs(_per_block(out, group_size) - blocks)
    # DeepSpeed's rule: half a step (absmax / 2^b) everywhere but at the top, where +absmax lands
    # on 2^(b-1) and clips to 2^(b-1) - 1: one full step there.
    clipped = blocks * (top / np.where(absmax == 0, 1, absmax)) >= top - 0.5
    half_step = np.broadcast_to(absmax / (2 * top) + slack, err.shape)
    assert np.all(err[~clipped] <= half_step[~clipped])
    assert np.all(err <= absmax / top + slack)
    assert np.any(err[clipped] > half_step[clipped])  # the top really clips

    q, out = q_no_clip, _per_block(out_no_clip, group_size)
    # issue 10's bound, every element: absmax / (2^(b-1) - 1) / 2
    assert np.all(np.abs(out - blocks) <= absmax / (top - 1) / 2 + slack)

    zero = (absmax == 0)[:, 0]
    assert zero.any() and np.all(np.asarray(q.scales).reshape(-1)[zero] == 1.0)
    assert np.all(out[zero] == 0)


def test_scales_are_deepspeeds_stored_value():
  x = jnp.asarray([[0.0] * 8, [1.0, -3.0, 0.5, 2.0, 0, 0, 0, 0], [-5.0, 5.0, 1, 1, 1, 1, 1, 1]])
  q8 = _quantize(x, bits=8, group_size=8)
  np.testing.assert_array_equal(np.asarray(q8.scales), [1.0, 3.0 / 128, 5.0 / 128])
  # +absmax maps to 128 and clips to 127; -absmax is -128 exactly
  assert np.asarray(q8.values)[2, :2].tolist() == [-128, 127]
  assert np.asarray(q8.values)[1, :4].tolist() == [43, -128, 21, 85]
  q4 = _quantize(x, bits=4, group_size=8, rule="no_clip")
  np.testing.assert_array_equal(np.asarray(q4.scales), [1.0, np.float32(3) * np.float32(1 / 7),
                                                        np.float32(5) * np.float32(1 / 7)])


def test_tiny_blocks_quantize_to_zero_with_scale_one():
  # absmax below 2^(b-1) * 2^-100 (about 1e-28): scale 1, zeros, as an all-zero block
  x = jnp.asarray([1e-29, -2e-29, 0, 0, 1.0, 0.5, 0, 0], jnp.float32)
  q = _quantize(x, bits=8, group_size=4)
  np.testing.assert_array_equal(np.asarray(q.scales), [1.0, 1.0 / 128])
  np.testing.assert_array_equal(np.asarray(_dequantize(q))[:4], 0.0)


# ------------------------------------------------------------------------------------------------
# inf / nan: a block holding one dequantizes to nan everywhere, so an overflow check sees it.


def _poisoned(x: jax.Array, group_size: int) -> np.ndarray:
  """``x`` with an inf in block 1, a -inf in block 2, a nan in block 4 and block 5 all 3e38
  (finite, but two of them overflow float32 when summed)."""
  flat = np.array(x, np.float32).reshape(-1)
  flat[group_size + 17], flat[2 * group_size], flat[5 * group_size - 1] = np.inf, -np.inf, np.nan
  flat[5 * group_size: 6 * group_size] = 3e38
  return flat.reshape(x.shape)


def test_inf_nan_poison_their_block():
  """The Pallas kernels do the same: their bit-for-bit tests below run on these inputs too."""
  impl = "jnp"
  x = _poisoned(_blocky(1, (6, 64), 64), 64)
  poisoned = np.array([False, True, True, False, True, False])
  q = _quantize(jnp.asarray(x, jnp.bfloat16), bits=8, group_size=64, impl=impl)
  scales = np.asarray(q.scales)
  assert np.isnan(scales[poisoned]).all() and np.isfinite(scales[~poisoned]).all()
  assert np.all(np.asarray(q.values)[poisoned] == 0)
  out = np.asarray(_dequantize(q, jnp.float16, impl=impl), np.float32)
  assert np.isnan(out[poisoned]).all() and not np.isnan(out[~poisoned]).any()
  # ... through the sums; a float32 sum that overflows is inf, and re-quantized it poisons too
  stacked = _quantize(jnp.asarray(np.stack([x, x])), bits=4, group_size=64, batch_dims=1,
                      impl=impl)
  total = np.asarray(_dequantize_sum(stacked, impl=impl))
  assert np.isnan(total[poisoned]).all() and np.isinf(total[5]).all()
  assert np.isfinite(total[[0, 3]]).all()
  again = _requantize_sum(stacked, impl=impl)
  assert np.isnan(np.asarray(_dequantize(again, impl=impl))[[1, 2, 4, 5]]).all()


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
  q = _quantize(x, bits=4, group_size=g, impl=impl)
  assert q.values.dtype == jnp.uint8 and q.values.shape == (3, g // 2)
  np.testing.assert_array_equal(np.asarray(q.scales), scale)
  nib = codes & 15
  want = (nib[:, : g // 2] << 4) | nib[:, g // 2:]  # element j high nibble, j + G/2 low nibble
  np.testing.assert_array_equal(np.asarray(q.values), want.astype(np.uint8))
  np.testing.assert_array_equal(np.asarray(_dequantize(q, impl=impl)), np.asarray(x))


# ------------------------------------------------------------------------------------------------
# Pallas (interpret mode) == jnp reference, bit for bit.


@pytest.mark.parametrize("shape, group_size, dtype, rule, bits, out_dtype", [
    ((37, 100), 64, jnp.float32, "deepspeed", 8, jnp.float16),  # ragged rows: 58 blocks, 32/program
    ((3, 1000), 100, jnp.bfloat16, "deepspeed", 4, jnp.bfloat16),  # ragged halves: 50 -> 64 lanes
    ((2, 5000), 1024, jnp.float16, "no_clip", 8, jnp.float32),  # 2 blocks per program, padding
    ((9,), 2, jnp.float32, "deepspeed", 4, jnp.float32),  # the smallest block
])
def test_pallas_equals_reference(shape, group_size, dtype, rule, bits, out_dtype):
  x = _blocky(7, shape, group_size)
  if x.size >= 6 * group_size:
    x = _poisoned(x, group_size)
  x = jnp.asarray(x).astype(dtype)  # in XLA: 3e38 becomes inf in float16 without a warning
  q = _quantize(x, bits=bits, group_size=group_size, rule=rule, impl="jnp")
  assert _same_q(q, _quantize(x, bits=bits, group_size=group_size, rule=rule, impl="pallas"))
  assert _same(_dequantize(q, out_dtype, impl="jnp"), _dequantize(q, out_dtype, impl="pallas"))


@pytest.mark.parametrize("bits, out_bits, k", [(8, 4, 3), (4, 4, 2)])
def test_sums_pallas_equal_reference(bits, out_bits, k):
  # 7 blocks a chunk (ragged rows), with inf, -inf, nan and float32 overflow in the sum
  x = jnp.stack([_poisoned(_blocky(j, (4, 150), 96), 96) for j in range(k)])
  q = _quantize(x, bits=bits, group_size=96, batch_dims=1, impl="jnp")
  assert _same(_dequantize_sum(q, impl="jnp"), _dequantize_sum(q, impl="pallas"))
  assert _same_q(_requantize_sum(q, out_bits, impl="jnp"),
                 _requantize_sum(q, out_bits, impl="pallas"))


# ------------------------------------------------------------------------------------------------
# Dequantize-and-sum.


def test_dequantize_sum_is_the_fp32_sum_of_dequantized_chunks():
  x = jnp.stack([_blocky(j, (5, 3, 40), 64, jnp.bfloat16) for j in range(6)]).reshape(
      3, 2, 5, 3, 40)
  q = _quantize(x, bits=4, group_size=64, batch_dims=2)
  assert q.stack_shape == (3, 2) and q.shape == (5, 3, 40)
  total = _dequantize_sum(q)
  assert total.shape == (2, 5, 3, 40) and total.dtype == jnp.float32
  parts = np.asarray(_dequantize(q, jnp.float32))
  want = (parts[0] + parts[1]) + parts[2]  # chunk 0 first, in float32
  assert _same(total, want)
  # three same-signed float32 terms summed in float32: two roundings, <= 2u = 1.2e-7 of the sum
  np.testing.assert_allclose(np.asarray(total), parts.astype(np.float64).sum(0), rtol=1e-6)
  assert _same(_dequantize_sum(q, jnp.bfloat16), jnp.asarray(want).astype(jnp.bfloat16))
  # requantize_sum is quantize(dequantize_sum) in one pass, with the remaining stack axis kept
  again = _requantize_sum(q)
  assert again.stack_shape == (2,) and again.bits == 4 and again.group_size == 64
  assert again.dtype == jnp.bfloat16  # the chunks' dtype stays dequantize's default
  ref = _quantize(jnp.asarray(want), bits=4, group_size=64, batch_dims=1)
  assert _same(again.values, ref.values) and _same(again.scales, ref.scales)


# ------------------------------------------------------------------------------------------------
# Collectives inside shard_map on 8 simulated CPU devices.


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _stack_map(fn, q: kernels.Quantized) -> kernels.Quantized:
  """Applies ``fn`` to both arrays of ``q`` (stack axes only: both have them in front)."""
  return jax.tree.map(fn, q)


def test_quantized_all_gather(impl="auto"):
  """qwZ: each device quantizes its partition (columns 8d..8d+8 of a 24 x 64 weight), the int8
  blocks are all-gathered, and dequantizing with concat_axis rebuilds the full weight."""
  mesh = _mesh((8,), ("data",))
  w = _blocky(5, (24, 64), 64, jnp.bfloat16)

  def gather(shard):
    q = kernels.quantize(shard, 8, 64, impl=impl)
    full = kernels.all_gather(q, "data")
    assert full.stack_shape == (8,) and full.shape == (24, 8)
    return (kernels.dequantize(full, concat_axis=-1, impl=impl),
            kernels.dequantize(full, jnp.float32, concat_axis=-1, impl=impl))

  fn = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P(None, "data"), out_specs=P(),
                             check_vma=False))
  out, out32 = fn(w)
  assert out.shape == w.shape and out.dtype == jnp.bfloat16  # bf16 stays bf16
  # the same as quantizing the 8 partitions block-aligned on one device
  parts = jnp.stack(jnp.split(w, 8, axis=1))
  want = _dequantize(_quantize(parts, bits=8, group_size=64, batch_dims=1), jnp.float32,
                     concat_axis=-1)
  assert _same(out32, want) and _same(out, want.astype(jnp.bfloat16))
  blocks = np.asarray(parts, np.float32).reshape(8, 3, 64)
  err = np.abs(np.asarray(jnp.stack(jnp.split(out32, 8, axis=1))).reshape(8, 3, 64) - blocks)
  assert np.all(err <= np.abs(blocks).max(axis=2, keepdims=True) / 128 * (1 + 1e-5))
  # what crosses the wire is int8 + fp32 scales: 8 x (192 + 4 * 3) bytes
  hlo = fn.lower(w).compile().as_text()
  gathers = [line for line in hlo.splitlines()
             if "all-gather(" in line or "all-gather-start(" in line]
  assert any("s8[8,3,64]" in line for line in gathers), gathers
  assert any("f32[8,3]" in line for line in gathers), gathers
  assert kernels.wire_bytes(24 * 8, 8, 64) == 3 * 64 + 3 * 4
  # on a GPU the same step runs the Pallas kernels inside shard_map
  if importlib.util.find_spec("jax.experimental.pallas.triton") is not None:
    spec = jax.ShapeDtypeStruct(w.shape, w.dtype,
                                sharding=jax.NamedSharding(mesh, P(None, "data")))
    exported = jax.export.export(
        fn, platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(spec)
    assert exported.mlir_module().count(TRITON_CALL) == 3 and exported.nr_devices == 8


def test_qgz_two_hops():
  """qgZ over node (2) x local (4): int4 all-to-all inside the node, dequantize-sum-requantize,
  int4 all-to-all across nodes, dequantize-sum. Bit for bit what the same kernels give when the
  hops are emulated on one device, and close to the exact reduce-scatter."""
  nodes, local, m, g = 2, 4, 96, 32
  mesh = _mesh((nodes, local), ("node", "local"))
  grads = jnp.stack([_blocky(d, (nodes * local * m,), g) for d in range(8)])

  def reduce(gd):  # gd: (1, P * m), this device's full gradient; partition p = n * L + l
    x = gd[0].reshape(nodes, local, m).transpose(1, 0, 2)  # (local dest, node dest, m)
    q = kernels.quantize(x, 4, g, batch_dims=2)
    q = kernels.all_to_all(q, "local")  # stack (local source, node dest)
    q = kernels.requantize_sum(q)  # stack (node dest,)
    q = kernels.all_to_all(q, "node")  # stack (node source,)
    return kernels.dequantize_sum(q)[None]

  fn = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P(("node", "local")),
                             out_specs=P(("node", "local")), check_vma=False))
  out = np.asarray(fn(grads)).reshape(nodes, local, m)

  @jax.jit
  def emulate(grads):  # device (n, s) quantizes; destination (n0, l0) sums over s, then nodes
    x = grads.reshape(nodes, local, nodes, local, m).transpose(0, 1, 3, 2, 4)
    q = kernels.quantize(x, 4, g, batch_dims=4, impl="jnp")  # stack (n, s, l0, node dest)
    q = _stack_map(lambda a: jnp.moveaxis(a, 1, 0), q)  # (s, n, l0, node dest)
    partial = kernels.requantize_sum(q, impl="jnp")  # (n', l0, n0): node n' partial of (n0, l0)
    partial = _stack_map(lambda a: jnp.moveaxis(a, 2, 1), partial)  # (n', n0, l0)
    return kernels.dequantize_sum(partial, impl="jnp")

  assert _same(out, emulate(grads))
  exact = np.asarray(grads, np.float64).sum(0).reshape(nodes, local, m)
  bound = 2 * float(jnp.max(jnp.abs(grads)))  # 8 chunks + 2 partials, each within absmax / 8
  assert np.abs(out - exact).max() <= bound

  with pytest.raises(ConfigError, match="one per destination"):
    jax.jit(jax.shard_map(lambda gd: kernels.all_to_all(
        kernels.quantize(gd.reshape(3, -1), 4, g, batch_dims=1), "local").values, mesh=mesh,
        in_specs=P(("node", "local")), out_specs=P(("node", "local")), check_vma=False)).trace(
            grads)


# ------------------------------------------------------------------------------------------------
# Bytes and group sizes.


def test_wire_bytes():
  # int8 + one fp32 scale per block of 2048: 1 + 4/2048 bytes per element; int4 half that + 4/2048
  assert kernels.wire_bytes(2048 * 10, 8, 2048) / (2048 * 10) == 1.001953125
  assert kernels.wire_bytes(2048 * 10, 4, 2048) / (2048 * 10) == 0.501953125
  assert kernels.wire_bytes(5000, 8, 2048) == 3 * 2048 + 3 * 4  # the last block is padded
  q = _quantize(jnp.ones((3, 5000), jnp.bfloat16), bits=4, group_size=2048, batch_dims=1)
  assert q.nbytes == 3 * kernels.wire_bytes(5000, 4, 2048) == 3 * (3 * 1024 + 12)
  assert q.values.shape == (3, 3, 1024) and q.scales.shape == (3, 3)


@pytest.mark.parametrize("numel, group_size", [
    (4096 * 4096 // 8, 4096),  # DeepSpeed: 263 groups -> 512 (first with 8 * groups | numel)
    (768 * 3072 // 8, 6144),  # 37 -> 48 groups
    (8000 * 3, 8000),
    (699051, 7944),  # 4096^2 / 24 devices, odd: DeepSpeed asserts (#4386); jzero pads 21
    (8 * 10007, 7280),  # numel / 8 prime: DeepSpeed takes groups of 8; jzero 11 padded groups
    (6, 8),  # smaller than a group: one padded group
])
def test_qwz_group_size(numel, group_size):
  assert kernels.qwz_group_size(numel) == group_size
  groups = kernels.num_groups(numel, group_size)
  assert group_size % 8 == 0 and group_size <= 8000
  assert groups * group_size - numel < 8 * groups  # padding stays under 8 per group


# ------------------------------------------------------------------------------------------------
# Errors name the argument and the fix.


def test_errors():
  x = jnp.ones((4, 64))
  q = _quantize(x, bits=8, group_size=64)
  stacked = _quantize(x, bits=8, group_size=64, batch_dims=1)
  cases = [
      (lambda: kernels.quantize(x, bits=3), "bits=3"),
      (lambda: kernels.quantize(x, bits=True), "bits=True"),
      (lambda: kernels.quantize(x, group_size=7), "group_size=7"),
      (lambda: kernels.quantize(x, group_size=16384), "group_size=16384"),
      (lambda: kernels.quantize(x, group_size=0), "group_size=0"),
      (lambda: kernels.quantize(x.astype(jnp.int32)), "x.dtype=int32"),
      (lambda: kernels.quantize(x, impl="cuda"), "impl='cuda'"),
      (lambda: kernels.quantize(x, rule="round"), "rule='round'"),
      (lambda: kernels.quantize(x, batch_dims=3), "batch_dims=3"),
      (lambda: kernels.dequantize(q, jnp.int8), "dtype=int8"),
      (lambda: kernels.dequantize(q, concat_axis=0), "concat_axis=0"),
      (lambda: kernels.dequantize_sum(q), "no stack axis"),
      (lambda: kernels.dequantize(x), "must be a jzero.kernels.Quantized"),
      (lambda: kernels.requantize_sum(stacked, bits=2), "bits=2"),
      (lambda: kernels.qwz_group_size(0), "numel=0"),
  ]
  for call, text in cases:
    with pytest.raises(ConfigError) as info:
      call()
    assert text in str(info.value), (text, str(info.value))
  # what a tiled all-gather (blocks of all devices run together) would hand over
  tiled = kernels.Quantized(jnp.concatenate([q.values] * 2), jnp.concatenate([q.scales] * 2),
                            q.shape, q.dtype, q.bits, q.group_size)
  with pytest.raises(ConfigError, match="tiled=False"):
    kernels.dequantize(tiled)


# ------------------------------------------------------------------------------------------------
# CUDA: every kernel lowers (export) and compiles to PTX (compile-only H100) without a GPU.


def _kernel_cases():
  x = jax.ShapeDtypeStruct((37, 1000), jnp.bfloat16)
  stacked = jax.ShapeDtypeStruct((3, 37, 1000), jnp.float32)
  cases = {}
  for bits, g in [(8, 2048), (4, 100)]:
    q = jax.eval_shape(lambda x: kernels.quantize(x, bits, g, impl="jnp"), x)
    qs = jax.eval_shape(lambda x: kernels.quantize(x, bits, g, batch_dims=1, impl="jnp"), stacked)
    # name: (function, argument, the Pallas kernel it runs)
    cases[f"quantize_int{bits}"] = (lambda x, b=bits, g=g: kernels.quantize(x, b, g), x,
                                    f"jzero_quantize_int{bits}")
    cases[f"dequantize_int{bits}"] = (lambda q: kernels.dequantize(q, jnp.bfloat16), q,
                                      f"jzero_dequantize_sum_int{bits}")
    cases[f"dequantize_sum_int{bits}"] = (lambda q: kernels.dequantize_sum(q), qs,
                                          f"jzero_dequantize_sum_int{bits}")
    cases[f"requantize_sum_int{bits}"] = (lambda q: kernels.requantize_sum(q, bits=4), qs,
                                          f"jzero_requantize_sum_int{bits}_int4")
  return cases


def _triton_or_skip():
  try:
    from jax.experimental.pallas import triton  # noqa: F401, PLC0415
  except ImportError as e:  # pragma: no cover - jaxlib builds without Triton bindings
    pytest.skip(f"this jaxlib has no Pallas Triton backend ({e}); install a Linux jaxlib")


@pytest.mark.parametrize("name", list(_kernel_cases()))
def test_kernel_exports_for_cuda(name):
  _triton_or_skip()
  fn, arg, kernel = _kernel_cases()[name]
  exported = jax.export.export(
      jax.jit(fn), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(arg)
  text = exported.mlir_module()
  assert text.count(TRITON_CALL) == 1 and kernel in text  # impl="auto" picked the Pallas kernel
  assert exported.platforms == ("cuda",)


def test_kernels_compile_to_ptx_for_h100():
  _triton_or_skip()
  from jzero.runtime import quiet_start
  if not quiet_start.cuda_plugin_installed():
    pytest.skip("compiling for a GPU that is not present needs the CUDA compiler plugin: "
                "pip install 'jax[cuda12-local]' (the test extra)")
  from jzero.planning import aot  # noqa: PLC0415
  device = aot.gpu_devices("h100", 1)[0]  # loads the plugin's compiler where it is kept unloaded
  sharding = jax.sharding.SingleDeviceSharding(device)
  for name, (fn, arg, _) in _kernel_cases().items():
    arg = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), arg)
    compiled = jax.jit(fn).trace(arg).lower().compile()  # XLA runs Triton down to PTX here
    assert TRITON_CALL in compiled.as_text(), name
