"""The quantized format: the :class:`Quantized` pytree, its block layout, group sizes and bytes.

Block-wise symmetric quantization as DeepSpeed's ZeRO++ does it (``csrc/includes/
quantization_utils.h``): a tensor is flattened (row-major) and cut into blocks ("groups") of
``group_size`` = G consecutive elements; each block gets one fp32 scale from its absolute maximum.

**Layout.** A chunk of ``n`` elements (the logical ``shape``) becomes ``groups = ceil(n / G)``
blocks; the last one is zero-padded (zeros never change a block's absmax, and the padding is
dropped again on dequantize). Leading *stack* axes hold independent chunks -- devices after an
all-gather, destinations before an all-to-all -- so block boundaries never cross a chunk::

  values  int8  (*stack, groups, G)       bits=8: one signed byte per element
          uint8 (*stack, groups, G // 2)  bits=4: byte j of a block holds element j in its high
                                          nibble and element j + G/2 in its low nibble
  scales  fp32  (*stack, groups)          DeepSpeed's stored value absmax / 2^(b-1)
                                          (absmax / (2^(b-1) - 1) with rule="no_clip")

DeepSpeed packs int4 as adjacent pairs; jzero pairs the two halves of a block instead, so the
kernels pack and unpack with two contiguous slices (the wire size is the same). Both arrays have
the stack axes in front, so ``lax.all_gather(..., tiled=False)`` and ``lax.all_to_all`` along axis
0 move whole chunks, and a :class:`Quantized` goes through them as a pytree (see
:mod:`jzero.kernels.ops`).

**Bytes.** A chunk costs ``groups * G * bits / 8`` value bytes plus ``4 * groups`` scale bytes
(:func:`wire_bytes`): int8 with G = 2048 sends 1 + 4/2048 = 1.00195 bytes per element, int4
0.50195 -- against 2 for bf16 and 4 for fp32.

**Group size.** :func:`qwz_group_size` is DeepSpeed's adaptive rule for the quantized weight
gather (``partition_parameters.CUDAQuantizer``); where DeepSpeed asserts (a size that is not a
multiple of 8 times the group count, DeepSpeed issue #4386, or a group of 16k or more) or picks a
group so small that scales would cost more than 1.5% of the int8 bytes, jzero pads the last block
instead of failing.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Quantized", "BITS", "FLOAT_DTYPES", "MAX_GROUP_SIZE", "QWZ_TARGET_GROUP", "MIN_QWZ_GROUP",
    "qwz_group_size", "wire_bytes", "num_groups", "check_bits", "check_group_size", "check_dtype",
]

BITS = (4, 8)
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_GROUP_SIZE = 8192  # DeepSpeed's qwZ rule never exceeds 8000
QWZ_TARGET_GROUP = 8000  # DeepSpeed: "the optimal size is 4k, so we set the target to be below 8k"
MIN_QWZ_GROUP = 256  # below this, fp32 scales cost more than 1.5% of the int8 bytes: jzero pads


def _fail(message: str) -> NoReturn:
  # Imported here, not at module level: ``jzero`` imports ``jzero.kernels``, and an error path runs
  # only after both are loaded.
  from jzero.errors import ConfigError  # noqa: PLC0415
  raise ConfigError(message)


def check_bits(bits: Any) -> int:
  """``bits`` as an int, or a ConfigError naming the argument."""
  if isinstance(bits, bool) or bits not in BITS:
    _fail(f"bits={bits!r}: jzero quantizes to 8 bits (int8) or 4 bits (int4, two per byte), as "
          f"DeepSpeed's ZeRO++ does; pass bits=8 or bits=4.")
  return int(bits)


def check_group_size(group_size: Any) -> int:
  """``group_size`` as an int, or a ConfigError naming the argument and the allowed range."""
  if (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
      or not 2 <= group_size <= MAX_GROUP_SIZE or group_size % 2):
    _fail(f"group_size={group_size!r}: a quantization block must hold an even number of elements "
          f"from 2 to {MAX_GROUP_SIZE} (int4 packs the two halves of a block into one byte); "
          f"use kernels.qwz_group_size(numel) for DeepSpeed's choice, or a power of two such as "
          f"2048.")
  return int(group_size)


def check_dtype(dtype: Any, argument: str) -> jnp.dtype:
  """A float dtype the kernels read or write (fp32, bf16, fp16), or a ConfigError."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in FLOAT_DTYPES:
    name = dt.name if dt is not None else repr(dtype)
    _fail(f"{argument}={name}: the quantization kernels read and write float32, bfloat16 or "
          f"float16 arrays; cast it first (x.astype(jnp.float32)) or pass one of those.")
  return dt


def num_groups(numel: int, group_size: int) -> int:
  """Blocks one chunk of ``numel`` elements takes (the last one zero-padded)."""
  return -(-int(numel) // int(group_size))


def wire_bytes(numel: int, bits: int = 8, group_size: int = 2048) -> int:
  """Bytes one quantized chunk of ``numel`` elements occupies: values (padded blocks) + scales."""
  bits, group_size = check_bits(bits), check_group_size(group_size)
  groups = num_groups(numel, group_size)
  return groups * group_size * bits // 8 + 4 * groups


def _deepspeed_qwz_groups(numel: int) -> int | None:
  """DeepSpeed's group count for a weight of ``numel`` elements, or None where it asserts."""
  groups = math.ceil(numel / QWZ_TARGET_GROUP)
  while groups < numel:
    if numel % (8 * groups) == 0:
      break
    groups += 1
  while numel % (8 * groups * 2) == 0 and numel / groups > QWZ_TARGET_GROUP:
    groups *= 2
  if numel % (8 * groups) or numel / groups >= 16000 or numel <= groups:
    return None
  return groups


def qwz_group_size(numel: int) -> int:
  """Block size for the quantized weight all-gather (qwZ) of a partition of ``numel`` elements.

  DeepSpeed's rule: start at ``ceil(numel / 8000)`` groups, add one until ``numel`` is a multiple
  of ``8 * groups``, then double while ``numel`` is a multiple of ``16 * groups`` and groups hold
  more than 8000 elements; the group size ``numel / groups`` divides ``numel`` exactly (a multiple
  of 8, below 16000). Where DeepSpeed fails instead ("Qantized weight requires the number of
  weights be a multiple of 8", issue #4386, e.g. 24 devices), or finds only groups smaller than
  :data:`MIN_QWZ_GROUP` (``numel / 8`` prime: DeepSpeed would use groups of 8, half the int8 bytes
  again in scales), jzero keeps ``ceil(numel / 8000)`` groups of ``ceil(numel / groups)`` elements
  rounded up to a multiple of 8 and zero-pads the last group: at most ``8 * groups`` padded
  elements, under 0.1% of the bytes.
  """
  numel = int(numel)
  if numel < 1:
    _fail(f"numel={numel}: a quantized weight needs at least one element.")
  groups = _deepspeed_qwz_groups(numel)
  if groups is not None and numel // groups >= MIN_QWZ_GROUP:
    return numel // groups
  groups = math.ceil(numel / QWZ_TARGET_GROUP)
  return max(8, -(-math.ceil(numel / groups) // 8) * 8)


@jax.tree_util.register_pytree_node_class
class Quantized:
  """Block-quantized chunks: ``values`` and ``scales`` (children) with static facts (aux data).

  Attributes:
    values: int8 ``(*stack, groups, G)`` or, for 4 bits, uint8 ``(*stack, groups, G // 2)``.
    scales: float32 ``(*stack, groups)``: the dequantization multiplier of each block.
    shape: the logical shape of one chunk (the stack axes are not part of it).
    dtype: the dtype the chunk had; :func:`jzero.kernels.dequantize` returns it unless told
    otherwise. bits: 8 or 4.
    group_size: G, elements per block.

  The children keep the stack axes in front, so ``jax.tree.map(lambda a: lax.all_gather(a, ax),
  q)`` (``tiled=False``) gives a Quantized whose new leading axis indexes devices, and ``lax.scan``
  or ``vmap`` over a stack slice both arrays alike while the aux data stays valid.
  """

  __slots__ = ("values", "scales", "shape", "dtype", "bits", "group_size")

  def __init__(self, values: Any, scales: Any, shape: Sequence[int], dtype: Any, bits: int,
               group_size: int):
    self.values, self.scales = values, scales
    self.shape, self.dtype = tuple(int(d) for d in shape), jnp.dtype(dtype)
    self.bits, self.group_size = int(bits), int(group_size)

  def tree_flatten(self):
    return (self.values, self.scales), (self.shape, self.dtype, self.bits, self.group_size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)
    obj.values, obj.scales = children
    obj.shape, obj.dtype, obj.bits, obj.group_size = aux
    return obj

  @property
  def numel(self) -> int:
    """Elements of one chunk."""
    return math.prod(self.shape)

  @property
  def groups(self) -> int:
    """Blocks per chunk."""
    return num_groups(self.numel, self.group_size)

  @property
  def stack_shape(self) -> tuple[int, ...]:
    """The leading axes that index chunks (devices, destinations, ...)."""
    return tuple(self.scales.shape[:-1])

  @property
  def nbytes(self) -> int:
    """Bytes of values and scales together: what a collective moves for this object."""
    return self.values.size * self.values.dtype.itemsize + self.scales.size * 4

  def check(self) -> None:
    """Raises a ConfigError if the arrays do not have the layout the aux data describes."""
    width = self.group_size * self.bits // 8
    want_values = jnp.dtype(jnp.int8 if self.bits == 8 else jnp.uint8)
    values_shape, scales_shape = tuple(self.values.shape), tuple(self.scales.shape)
    if (len(values_shape) < 2 or values_shape[-2:] != (self.groups, width)
        or scales_shape != values_shape[:-1] or jnp.dtype(self.values.dtype) != want_values
        or jnp.dtype(self.scales.dtype) != jnp.dtype(jnp.float32)):
      _fail(f"a Quantized of {self.numel} elements in groups of {self.group_size} ({self.bits} "
            f"bits) needs values {want_values.name} (*stack, {self.groups}, {width}) and "
            f"float32 scales (*stack, {self.groups}); got values {self.values.dtype} "
            f"{values_shape} and scales {self.scales.dtype} {scales_shape}. Gather a Quantized "
            f"with tiled=False (kernels.all_gather) so each device's blocks stay a chunk of "
            f"its own.")

  def __repr__(self):
    return (f"Quantized(shape={self.shape}, stack={self.stack_shape}, dtype={self.dtype.name}, "
            f"bits={self.bits}, group_size={self.group_size})")
