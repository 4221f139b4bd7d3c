"""The compiled loops of :class:`jzero.tiers.host_adam.HostAdam`: a chunk of an Adam step, in place.

Importing this module needs numba (the ``host-adam`` extra); numba compiles the loops for the
host's CPU at their first call with the LLVM its wheel ships, and caches them beside the module
(``__pycache__``, or ``NUMBA_CACHE_DIR``). Every function here is a module-level function so
that the cache finds it again in the next process.

:func:`adam_chunk` is what :mod:`jzero.tiers.host_adam` calls, from several threads at once (it
holds no GIL): the step over blocks of :data:`BLOCK` elements, each block's Adam loop and then,
if asked, its 16-bit cast, two loops that each vectorise (one loop doing both does not).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.core.extending import intrinsic

__all__ = ["BLOCK", "adam_chunk"]

#: Elements per block (8 KiB of each fp32 array): the cast reads the new params back from L1.
BLOCK = 2048
_F32 = ir.FloatType()


@intrinsic
def _fma(typingctx, a, b, c):
  """float32 ``a * b + c`` rounded once (what XLA:CPU's contraction of ``a * b + c`` gives)."""
  def codegen(context, builder, signature, args):
    fn = builder.module.declare_intrinsic("llvm.fma", [_F32], ir.FunctionType(_F32, [_F32] * 3))
    return builder.call(fn, args)

  return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _bits(typingctx, x):
  """A float32's bit pattern as a uint32."""
  def codegen(context, builder, signature, args):
    return builder.bitcast(args[0], ir.IntType(32))

  return types.uint32(types.float32), codegen


@intrinsic
def _from_bits(typingctx, u):
  """The float32 of a uint32 bit pattern."""
  def codegen(context, builder, signature, args):
    return builder.bitcast(args[0], _F32)

  return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def _to_bf16(u):
  """Round-to-nearest-even float32 bits -> bfloat16 bits; a NaN becomes the quiet NaN of its sign
  (what XLA's convert gives)."""
  if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
    return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
  return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                   >> np.uint32(16))


@numba.njit(inline="always")
def _to_fp16(u):
  """Round-to-nearest-even float32 bits -> float16 bits (subnormals, overflow to inf, and a NaN
  quieted with its sign and top payload bits, as XLA's convert gives them)."""
  sign = (u >> np.uint32(16)) & np.uint32(0x8000)
  a = u & np.uint32(0x7FFFFFFF)
  if a >= np.uint32(0x47800000):  # |x| >= 65536 (or inf / NaN)
    h = np.uint32(0x7C00)
    if a > np.uint32(0x7F800000):
      h = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
  elif a < np.uint32(0x38800000):  # a float16 subnormal or zero: align the bits by adding 0.5
    magic = np.uint32(0x3F000000)
    h = _bits(_from_bits(np.uint32(a)) + _from_bits(magic)) - magic
  else:  # rebias the exponent, round the 13 dropped bits to nearest even
    h = (a + np.uint32(0xC8000FFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
  return np.uint16(h | sign)


@numba.njit(nogil=True, fastmath=False, error_model="numpy", cache=True)
def _adam_block(p, m, v, g, b1, c1, b2, c2, r1, r2, eps, wd, neg_lr, l2, decoupled):
  # The fused multiply-adds sit where XLA:CPU (jax 0.10, default optimisation level) contracts
  # the optax chain's multiply-adds; any other placement changes the last bit of about 1 element
  # in 10.
  for i in range(p.size):
    pi = p[i]
    gi = g[i]
    if l2:
      gi = _fma(wd, pi, gi)
    mi = _fma(c1, gi, b1 * m[i])
    gg = gi * gi
    if l2:
      vi = _fma(b2, v[i], c2 * gg)
    else:
      vi = _fma(c2, gg, b2 * v[i])
    u = (mi * r1) / (np.sqrt(vi * r2) + eps)
    if decoupled:
      p[i] = _fma(_fma(wd, pi, u), neg_lr, pi)
    else:
      p[i] = _fma(u, neg_lr, pi)
    m[i] = mi
    v[i] = vi


@numba.njit(nogil=True, fastmath=False, error_model="numpy", cache=True)
def adam_chunk(p, m, v, g, out, bf16, fp16, b1, c1, b2, c2, r1, r2, eps, wd, neg_lr, l2,
               decoupled):
  """One chunk of the step, in place: ``p``, ``m``, ``v``, ``g`` float32 1-D arrays of one size,
  ``out`` the uint16 bits of the bf16 (``bf16``) or fp16 (``fp16``) output of that size, or
  unused; the float32 constants as :mod:`jzero.tiers.host_adam` rounds them; ``l2`` /
  ``decoupled`` the weight decay's form (both false: none)."""
  for lo in range(0, p.size, BLOCK):
    hi = min(lo + BLOCK, p.size)
    pb = p[lo:hi]
    _adam_block(pb, m[lo:hi], v[lo:hi], g[lo:hi], b1, c1, b2, c2, r1, r2, eps, wd, neg_lr, l2,
                decoupled)
    if bf16:
      ob = out[lo:hi]
      for i in range(pb.size):
        ob[i] = _to_bf16(_bits(pb[i]))
    elif fp16:
      ob = out[lo:hi]
      for i in range(pb.size):
        ob[i] = _to_fp16(_bits(pb[i]))
