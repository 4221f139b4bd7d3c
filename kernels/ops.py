"""The public operations: quantize, dequantize, dequantize-and-sum, and their collectives.

Each operation reshapes between the public layout (:mod:`jzero.kernels.layout`) and the block views
(:mod:`jzero.kernels.reference`) -- free reshapes, plus one zero-pad when a chunk does not fill its
last block -- and runs one kernel, picked by ``impl``:

* ``"auto"`` (default): the Pallas kernel when the computation is lowered for CUDA (Triton,
  :mod:`jzero.kernels.pallas`) or for TPU (Mosaic, :mod:`jzero.kernels.mosaic`), the jnp
  reference for every other platform. The choice is made per lowering platform
  (``lax.platform_dependent``), so a CPU run uses jnp and an export or an ahead-of-time compile
  for CUDA or a TPU slice gets the kernel, whatever ``jax.default_backend()`` is.
* ``"pallas"``: the Pallas kernel everywhere -- compiled on CUDA and TPU, the Triton kernel
  interpreted elsewhere (slow; for tests).
* ``"jnp"``: the reference everywhere.

Inside ``shard_map``, a :class:`~kernels.layout.Quantized` travels through collectives as a
pytree: :func:`all_gather` (qwZ: each device quantizes its partition, all devices receive every
partition's blocks) and :func:`all_to_all` (qgZ: chunk ``j`` of the leading stack axis goes to
device ``j``, the received chunks are then summed by :func:`dequantize_sum`). Never reduce int8
itself: XLA's reduce-scatter adds in the integer type and wraps.

qgZ's two hops over a ``node x local`` mesh (``N`` x ``L`` devices), for shape -- wiring it into
the step is the integrator's job. ``g`` is a device's full local gradient of ``N * L * m``
elements; device ``(n, l)`` ends with partition ``n * L + l`` of the sum, as
``lax.psum_scatter(g, ("node", "local"), tiled=True)`` would give::

  x = g.reshape(N, L, m).swapaxes(0, 1)        # [l, n]: partition n * L + l
  q = quantize(x, bits=4, batch_dims=2)        # stack (L destinations, N)
  q = all_to_all(q, "local")                   # stack (L sources, N)
  q = requantize_sum(q)                        # stack (N,): this node's partial sums, int4
  q = all_to_all(q, "node")                    # stack (N sources,)
  mine = dequantize_sum(q)                     # float32 (m,), unscaled (divide for a mean)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jzero.kernels import reference as _reference
from jzero.kernels.layout import (Quantized, _fail, check_bits, check_dtype,
                                  check_group_size, num_groups)

__all__ = ["quantize", "dequantize", "dequantize_sum", "requantize_sum", "all_gather",
           "all_to_all", "IMPLS", "RULES"]

IMPLS = ("auto", "pallas", "jnp")
RULES = ("deepspeed", "no_clip")


def _check_impl(impl: Any) -> str:
  if impl not in IMPLS:
    _fail(f"impl={impl!r}: pass 'auto' (Pallas on CUDA and TPU, jnp elsewhere), 'pallas' (the "
          f"Pallas kernel; interpreted off CUDA and TPU) or 'jnp' (the reference).")
  return impl


def _check_rule(rule: Any) -> str:
  if rule not in RULES:
    _fail(f"rule={rule!r}: pass 'deepspeed' (absmax maps to 2^(b-1) and the top clips, as "
          f"DeepSpeed) or 'no_clip' (absmax maps to 2^(b-1)-1).")
  return rule


def _run(impl: str, name: str, *args, **static) -> Any:
  """Runs block kernel ``name`` from the implementation ``impl`` picks (see the module doc)."""
  reference = functools.partial(getattr(_reference, name), **static)
  if impl == "jnp" or any(a.size == 0 for a in args):
    return reference(*args)
  try:
    # Pallas' Triton and Mosaic bindings only when needed
    from jzero.kernels import mosaic as _mosaic  # noqa: PLC0415
    from jzero.kernels import pallas as _pallas  # noqa: PLC0415
  except ImportError as e:  # a jaxlib built without Pallas' Triton backend
    if impl == "auto":
      return reference(*args)
    _fail(f"impl='pallas' needs Pallas' Triton backend, which this jaxlib lacks ({e}); install a "
          f"Linux jaxlib or pass impl='jnp'.")
  kernel, tpu_kernel = getattr(_pallas, name), getattr(_mosaic, name)
  cuda = functools.partial(kernel, **static, interpret=False)
  tpu = functools.partial(tpu_kernel, **static, interpret=False)
  interpreted = functools.partial(kernel, **static, interpret=True)
  return lax.platform_dependent(*args, cuda=cuda, tpu=tpu,
                                default=interpreted if impl == "pallas" else reference)


def _values_view(q: Quantized, lead: int) -> tuple[jax.Array, jax.Array]:
  """``q``'s arrays as stacked block views: values ``(lead, R, G * bits / 8)``, scales
  ``(lead, R)``."""
  rows = math.prod(q.scales.shape) // lead
  return q.values.reshape(lead, rows, q.values.shape[-1]), q.scales.reshape(lead, rows)


def _wrap(values: jax.Array, scales: jax.Array, stack: tuple[int, ...], shape: tuple[int, ...],
          dtype: Any, bits: int, group_size: int) -> Quantized:
  groups = num_groups(math.prod(shape), group_size)
  values = values.reshape(*stack, groups, group_size * bits // 8)
  return Quantized(values, scales.reshape(*stack, groups), shape, dtype, bits, group_size)


def _unblock(out: jax.Array, stack: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
  """``(R, G)`` blocks -> ``(*stack, *shape)``, dropping each chunk's padding."""
  n = math.prod(shape)
  out = out.reshape(*stack, -1)
  if out.shape[-1] != n:
    out = out[..., :n]
  return out.reshape(*stack, *shape)


def quantize(x: jax.Array, bits: int = 8, group_size: int = 2048, *, batch_dims: int = 0,
             rule: str = "deepspeed", impl: str = "auto") -> Quantized:
  """Block-wise symmetric quantization of ``x`` (fp32, bf16 or fp16).

  Args:
    x: the array; its first ``batch_dims`` axes index independent chunks (each chunk is
      flattened and cut into its own blocks), the rest is the chunk shape.
    bits: 8 (int8) or 4 (int4, two per byte).
    group_size: G, elements per block (even, 2..8192; see :func:`jzero.kernels.qwz_group_size`).
    batch_dims: how many leading axes of ``x`` are stack axes.
    rule: ``"deepspeed"`` (scale 2^(b-1)/absmax; +absmax clips to 2^(b-1)-1) or ``"no_clip"``
      (scale (2^(b-1)-1)/absmax; error at most absmax/(2^(b-1)-1)/2 for every element).
    impl: ``"auto"``, ``"pallas"`` or ``"jnp"`` (module docstring).

  Returns:
    A :class:`Quantized` with stack ``x.shape[:batch_dims]`` and chunk shape
    ``x.shape[batch_dims:]``.
  """
  bits, group_size = check_bits(bits), check_group_size(group_size)
  rule, impl = _check_rule(rule), _check_impl(impl)
  x = jnp.asarray(x)
  dtype = check_dtype(x.dtype, "x.dtype")
  if isinstance(batch_dims, bool) or not isinstance(batch_dims, int) or not (
      0 <= batch_dims <= x.ndim):
    _fail(f"batch_dims={batch_dims!r}: the number of leading stack axes of x, from 0 to "
          f"x.ndim = {x.ndim}.")
  stack, shape = x.shape[:batch_dims], x.shape[batch_dims:]
  n = math.prod(shape)
  groups = num_groups(n, group_size)
  flat = x.reshape(math.prod(stack), n)
  if groups * group_size != n:
    flat = jnp.pad(flat, ((0, 0), (0, groups * group_size - n)))
  blocks = flat.reshape(math.prod(stack) * groups, group_size)
  values, scales = _run(impl, "quantize_blocks", blocks, bits=bits, rule=rule)
  return _wrap(values, scales, stack, shape, dtype, bits, group_size)


def dequantize(q: Quantized, dtype: Any = None, *, concat_axis: int | None = None,
               impl: str = "auto") -> jax.Array:
  """The float array ``q`` encodes: ``(*q.stack_shape, *q.shape)`` in ``dtype`` (default
  ``q.dtype``).

  With ``concat_axis``, ``q`` must have exactly one stack axis (devices, after
  :func:`all_gather`) and the chunks are concatenated along that axis of the chunk shape instead,
  as ``lax.all_gather(..., axis=concat_axis, tiled=True)`` would place them: partitions split
  along dimension ``d`` of a parameter come back as the full parameter with ``concat_axis=d``.
  """
  impl = _check_impl(impl)
  _check_quantized(q, "q")
  dtype = check_dtype(q.dtype if dtype is None else dtype, "dtype")
  stack = q.stack_shape
  values, scales = _values_view(q, 1)
  out = _run(impl, "dequantize_sum_blocks", values, scales, bits=q.bits, dtype=dtype)
  out = _unblock(out, stack, q.shape)
  if concat_axis is None:
    return out
  if (len(stack) != 1 or isinstance(concat_axis, bool) or not isinstance(concat_axis, int)
      or not -len(q.shape) <= concat_axis < len(q.shape)):
    _fail(f"concat_axis={concat_axis!r} needs a Quantized with one stack axis (it has "
          f"{len(stack)}) and an axis of its chunk shape {q.shape}.")
  axis = concat_axis % len(q.shape)
  out = jnp.moveaxis(out, 0, axis)
  return out.reshape(*q.shape[:axis], stack[0] * q.shape[axis], *q.shape[axis + 1:])


def dequantize_sum(q: Quantized, dtype: Any = jnp.float32, *, impl: str = "auto") -> jax.Array:
  """Sum over ``q``'s first stack axis of the dequantized chunks, added in float32 (chunk 0
  first), returned as ``(*q.stack_shape[1:], *q.shape)`` in ``dtype``. This is qgZ's reduction
  after an all-to-all: the k received chunks of one destination, summed.
  """
  impl = _check_impl(impl)
  _check_quantized(q, "q", stacked=True)
  dtype = check_dtype(dtype, "dtype")
  values, scales = _values_view(q, q.stack_shape[0])
  out = _run(impl, "dequantize_sum_blocks", values, scales, bits=q.bits, dtype=dtype)
  return _unblock(out, q.stack_shape[1:], q.shape)


def requantize_sum(q: Quantized, bits: int | None = None, *, rule: str = "deepspeed",
                   impl: str = "auto") -> Quantized:
  """:func:`dequantize_sum` quantized again in the same pass (qgZ's intra-node hop), with the
  same group size and ``bits`` (default ``q.bits``); the stack loses its first axis."""
  impl, rule = _check_impl(impl), _check_rule(rule)
  _check_quantized(q, "q", stacked=True)
  out_bits = q.bits if bits is None else check_bits(bits)
  values, scales = _values_view(q, q.stack_shape[0])
  values, scales = _run(impl, "requantize_sum_blocks", values, scales, bits=q.bits,
                        out_bits=out_bits, rule=rule)
  return _wrap(values, scales, q.stack_shape[1:], q.shape, q.dtype, out_bits, q.group_size)


def _check_quantized(q: Any, argument: str, stacked: bool = False) -> None:
  if not isinstance(q, Quantized):
    _fail(f"{argument} must be a jzero.kernels.Quantized (from jzero.kernels.quantize), not "
          f"{type(q).__name__}.")
  q.check()
  if stacked and not q.stack_shape:
    _fail(f"{argument} has no stack axis to sum over: quantize with batch_dims >= 1, or gather "
          f"/ all-to-all it first (kernels.all_gather, kernels.all_to_all).")


def all_gather(q: Quantized, axis_name: Any) -> Quantized:
  """Inside ``shard_map``: every device's ``q`` stacked along a new leading axis (device order
  of ``axis_name``, a mesh axis or a tuple of them). Dequantize with ``concat_axis`` to get the
  full array."""
  _check_quantized(q, "q")
  return jax.tree.map(lambda a: lax.all_gather(a, axis_name, axis=0, tiled=False), q)


def all_to_all(q: Quantized, axis_name: Any) -> Quantized:
  """Inside ``shard_map``: chunk ``j`` of ``q``'s first stack axis goes to device ``j`` of
  ``axis_name``; the result's first stack axis indexes the sending device. The first stack axis
  must be as long as ``axis_name`` has devices."""
  _check_quantized(q, "q", stacked=True)
  size = lax.axis_size(axis_name)
  if q.stack_shape[0] != size:
    _fail(f"all_to_all over {axis_name!r} ({size} devices) needs a Quantized whose first stack "
          f"axis has {size} chunks, one per destination; it has {q.stack_shape[0]}.")
  return jax.tree.map(lambda a: lax.all_to_all(a, axis_name, 0, 0, tiled=True), q)
