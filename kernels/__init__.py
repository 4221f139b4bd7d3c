"""jzero's Pallas kernels: ZeRO++'s block quantization for the quantized collectives.

Installed as ``jzero.kernels`` (pyproject's ``package-dir``) from the repository's ``kernels/``
folder: no top-level ``kernels`` package, which would collide with an unrelated one on PyPI.

ZeRO++ (Wang et al., 2023) quantizes what crosses the slow links: the stage-3 weight all-gather
in int8 blocks (qwZ) and the gradient reduce-scatter in int4 blocks over two all-to-all hops
(qgZ). This package holds the kernels those collectives need, each a plain-jnp reference
(:mod:`jzero.kernels.reference`) and a Pallas kernel (:mod:`jzero.kernels.pallas`) held to it bit
for bit:

* :func:`quantize` -- float array -> :class:`Quantized` (int8 or packed int4 blocks + fp32 scales);
* :func:`dequantize` -- back to a float array of any of fp32 / bf16 / fp16;
* :func:`dequantize_sum` -- the fp32 sum of k stacked quantized chunks (qgZ after an all-to-all);
* :func:`requantize_sum` -- the same sum quantized again in one pass (qgZ's intra-node hop);
* :func:`all_gather`, :func:`all_to_all` -- a :class:`Quantized` through ``shard_map``
  collectives, chunk boundaries intact;
* :func:`qwz_group_size`, :func:`wire_bytes` -- DeepSpeed's block-size rule and the bytes a
  quantized chunk puts on the wire.

The format is documented in :mod:`jzero.kernels.layout`, the math in :mod:`jzero.kernels.reference`,
the choice of implementation (``impl="auto" | "pallas" | "jnp"``) in :mod:`jzero.kernels.ops`.
"""

from jzero.kernels.layout import (BITS, MAX_GROUP_SIZE, Quantized, num_groups,
                                  qwz_group_size, wire_bytes)
from jzero.kernels.ops import (IMPLS, RULES, all_gather, all_to_all, dequantize, dequantize_sum,
                               quantize, requantize_sum)

__all__ = [
    "Quantized", "quantize", "dequantize", "dequantize_sum", "requantize_sum", "all_gather",
    "all_to_all", "qwz_group_size", "wire_bytes", "num_groups", "BITS", "MAX_GROUP_SIZE",
    "IMPLS", "RULES",
]
