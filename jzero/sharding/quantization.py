"""Quantized collectives as small strategy objects, by name: :data:`WEIGHTS` (qwZ's parameter
gather: ``int8``, DeepSpeed's, and ``int4``) and :data:`GRADIENTS` (qgZ's gradient reduction:
``int4``, DeepSpeed's). A strategy is the plan's data about one way to move bytes and the
collective that moves them:

* its **name** is the config's value (``zero_quantized_weights: "int4"``; ``true`` is the first
  of its registry, DeepSpeed's) and what the plan records per leaf
  (:attr:`jzero.sharding.plan.LeafPlan.gather` / ``reduce``; "plain" for none);
* :meth:`~WeightQuantizer.block` says whether a leaf's per-layer partition uses it, and in blocks
  of how many elements (a small partition stays plain: its scales would cost more than the bits
  save);
* :meth:`~WeightQuantizer.wire_bytes` is what a chunk of elements costs on the wire, and
  ``bits`` what ``jzero plan``'s arithmetic prices a 16-bit gather at (``bits / 16`` of it);
  ``planned``: ``jzero plan`` tries it among its candidates;
* :meth:`WeightQuantizer.gather` / :meth:`GradientQuantizer.reduce_scatter` run the collective
  inside the step's ``shard_map`` (:mod:`jzero.comm.zeropp` calls them with the plan's
  :class:`~jzero.sharding.zeropp.Comm`).

A new quantized collective is one module with a strategy (a frozen dataclass with these members)
and one registry line: here, or :func:`register` from outside the package. The quantization rule (``rule="deepspeed"``) and the kernels are
:mod:`jzero.kernels`'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jzero import kernels

__all__ = ["WeightQuantizer", "GradientQuantizer", "WEIGHTS", "GRADIENTS", "RULE", "PLAIN",
           "QGZ_GROUP", "QWZ_MIN_NUMEL", "QGZ_MIN_NUMEL", "weights", "gradients", "register",
           "unregister", "concat_chunks"]

RULE = "deepspeed"  # the symmetric rule both of DeepSpeed's quantized collectives use
PLAIN = "plain"  # the plan's record of a leaf whose collective is not quantized
QGZ_GROUP = 256  # elements per int4 block of the gradient all-to-all (a power of two)
QWZ_MIN_NUMEL = kernels.layout.MIN_QWZ_GROUP  # smaller partitions are gathered in 16 bits
QGZ_MIN_NUMEL = 2 * QGZ_GROUP  # smaller gradient partitions are reduce-scattered plainly

Axes = tuple[str, ...]


def concat_chunks(y: jax.Array, d: int) -> jax.Array:
  """``(k, *shape)`` chunks -> ``shape`` with dimension ``d`` k times longer (chunk-major)."""
  y = jnp.moveaxis(y, 0, d)
  return y.reshape(*y.shape[:d], y.shape[d] * y.shape[d + 1], *y.shape[d + 2:])


@dataclasses.dataclass(frozen=True)
class WeightQuantizer:
  """qwZ: the parameter all-gather moves ``bits``-bit blocks and fp32 scales instead of 16-bit
  values; each device quantizes its partition, the blocks are gathered, every device dequantizes
  them to the compute dtype (never changing it). Blocks of DeepSpeed's group size
  (:func:`jzero.kernels.qwz_group_size`); a partition of fewer than
  :data:`jzero.kernels.layout.MIN_QWZ_GROUP` elements per layer stays plain."""

  name: str
  bits: int
  planned: bool = False  # ``jzero plan`` tries it (jzero.planning.candidates)
  kind: ClassVar[str] = "weights"

  def block(self, layer_shape: tuple[int, ...], part: int) -> int | None:
    """Elements per block for a leaf whose one layer has ``layer_shape`` and ``part`` elements per
    device, or None: the leaf's gather stays plain."""
    if part < QWZ_MIN_NUMEL:
      return None
    return kernels.qwz_group_size(part)

  def wire_bytes(self, elements: float, itemsize: int) -> float:
    """Bytes ``elements`` of ``itemsize`` bytes move as: the values' bits and a 4-byte scale per
    block of about 8,000."""
    return elements * self.bits / 8 + 4 * math.ceil(elements / kernels.layout.QWZ_TARGET_GROUP)

  def gather(self, shard: jax.Array, dim: int, axes: Axes, group: int, batch_dims: int = 0,
             impl: str = "auto") -> jax.Array:
    """All partitions on ``axes`` gathered as blocks, dequantized to ``shard``'s dtype and
    concatenated along ``dim``; the first ``batch_dims`` axes are quantized as separate chunks
    (the layers of a stacked leaf)."""
    d = dim % shard.ndim
    q = kernels.quantize(shard, self.bits, group, batch_dims=batch_dims, rule=RULE, impl=impl)
    g = kernels.all_gather(q, axes)
    return concat_chunks(kernels.dequantize(g, shard.dtype, impl=impl), d)


@dataclasses.dataclass(frozen=True)
class GradientQuantizer:
  """qgZ: the gradient reduce-scatter as two all-to-all hops of ``bits``-bit blocks -- inside
  the node, then across nodes -- with a dequantize-sum-requantize between them and a float32 sum
  at the end; never a reduce-scatter of integers (XLA would sum them in the integer type and
  wrap). A leaf that is one-dimensional per layer (DeepSpeed's rule), or whose per-device partition
  is below two blocks per layer, is reduced plainly."""

  name: str
  bits: int
  group: int = QGZ_GROUP
  planned: bool = False  # ``jzero plan`` tries it (jzero.planning.candidates)
  kind: ClassVar[str] = "gradients"

  def block(self, layer_shape: tuple[int, ...], part: int) -> int | None:
    """Elements per block for a leaf of ``layer_shape`` with ``part`` elements per device and
    layer, or None: its reduction stays plain."""
    return self.group if len(layer_shape) >= 2 and part >= 2 * self.group else None

  def wire_bytes(self, elements: float, itemsize: int) -> float:
    """Bytes ``elements`` move as: the values' bits and a 4-byte scale per block."""
    return elements * self.bits / 8 + 4 * math.ceil(elements / self.group)

  def reduce_scatter(self, full: jax.Array, dim: int, padded: int, comm: Any) -> jax.Array:
    """The float32 sum over all ZeRO devices of ``full`` (zero-padded to ``padded`` along
    ``dim``), this device's partition of it -- what ``psum_scatter`` over the ZeRO axes gives --,
    over ``comm``'s node and local axes."""
    d = dim % full.ndim
    nodes, local = lax.axis_size(comm.node_axes), lax.axis_size(comm.local_axes)
    widths = [(0, 0)] * full.ndim
    widths[d] = (0, padded - full.shape[d])
    x = jnp.moveaxis(jnp.pad(full, widths) if padded > full.shape[d] else full, d, 0)
    rest = x.shape[1:]
    part = padded // (nodes * local)
    x = x.reshape(nodes, local, part * math.prod(rest)).swapaxes(0, 1)  # [l, n]: partition n*L+l
    q = kernels.quantize(x, self.bits, comm.reduce_group, batch_dims=2, rule=RULE,
                         impl=comm.impl)
    q = kernels.all_to_all(q, comm.local_axes)  # [source l', n]: partitions n*L+l of the node
    q = kernels.requantize_sum(q, rule=RULE, impl=comm.impl)  # [n]: this node's partial sums
    q = kernels.all_to_all(q, comm.node_axes)  # [source n']: partition n*L+l of every node
    mine = kernels.dequantize_sum(q, impl=comm.impl)
    return jnp.moveaxis(mine.reshape(part, *rest), 0, d)


#: qwZ's strategies by name, DeepSpeed's first (``zero_quantized_weights: true``).
WEIGHTS: dict[str, Any] = {
    "int8": WeightQuantizer("int8", 8, planned=True),
    "int4": WeightQuantizer("int4", 4),
}

#: qgZ's strategies by name, DeepSpeed's first (``zero_quantized_gradients: true``).
GRADIENTS: dict[str, Any] = {
    "int4": GradientQuantizer("int4", 4, planned=True),
}


def _registry(strategy: Any) -> dict[str, Any]:
  kinds = {"weights": WEIGHTS, "gradients": GRADIENTS}
  if getattr(strategy, "kind", None) not in kinds:
    raise ValueError(f"{strategy!r}: a strategy's kind is 'weights' or 'gradients'")
  return kinds[strategy.kind]


def register(strategy: Any) -> Any:
  """Adds ``strategy`` (its :attr:`kind` says which registry: "weights", qwZ's, or "gradients",
  qgZ's) under its name; returns it."""
  registry = _registry(strategy)
  if strategy.name in registry or strategy.name == PLAIN:
    raise ValueError(f"a {strategy.kind} strategy named {strategy.name!r} is registered already")
  registry[strategy.name] = strategy
  return strategy


def unregister(strategy: Any) -> None:
  """Takes ``strategy`` out of its registry again."""
  _registry(strategy).pop(strategy.name, None)


def weights(name: str) -> Any:
  """The qwZ strategy ``name`` (the plan's record of a leaf's gather)."""
  return WEIGHTS[name]


def gradients(name: str) -> Any:
  """The qgZ strategy ``name`` (the plan's record of a leaf's reduction)."""
  return GRADIENTS[name]
