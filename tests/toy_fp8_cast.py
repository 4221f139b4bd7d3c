"""A quantized collective written outside jzero (tests/tiers/test_toy_tier.py adds it): qwZ's
parameter gather as an fp8 cast, ``zero_optimization.zero_quantized_weights: "fp8"``.

One module, one registry line (``quantization.register(FP8)``), no library file: the strategy
has the members :mod:`jzero.sharding.quantization` names -- its name, ``bits``, ``planned``
(``jzero plan`` tries it), :meth:`Fp8Cast.block`, :meth:`Fp8Cast.wire_bytes` and
:meth:`Fp8Cast.gather` -- and the plan records it per leaf like DeepSpeed's int8 blocks. Each
device casts its partition to float8_e4m3fn (no scales: values beyond 448 saturate, which a small
model's weights do not reach), the bytes are gathered, every device casts them back to the
compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Fp8Cast:
  """qwZ by a cast to float8_e4m3fn: one byte per element on the wire."""

  name: str = "fp8"
  bits: int = 8
  planned: bool = True
  kind: ClassVar[str] = "weights"

  def block(self, layer_shape: tuple[int, ...], part: int) -> int | None:
    """Every partitioned leaf, as one block of its partition (the cast has no scales)."""
    return part

  def wire_bytes(self, elements: float, itemsize: int) -> float:
    return float(elements)

  def gather(self, shard: jax.Array, dim: int, axes: tuple[str, ...], group: int,
             batch_dims: int = 0, impl: str = "auto") -> jax.Array:
    """All partitions on ``axes`` concatenated along ``dim``, moved as fp8 bytes."""
    d = dim % shard.ndim
    bits = lax.bitcast_convert_type(shard.astype(FP8), jnp.uint8)
    full = lax.all_gather(bits, axes, axis=d, tiled=True)
    return lax.bitcast_convert_type(full, FP8).astype(shard.dtype)


FP8_CAST = Fp8Cast()
