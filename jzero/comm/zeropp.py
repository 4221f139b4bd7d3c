"""ZeRO++ (Wang et al., 2023): qwZ, hpZ and qgZ as collectives of jzero's stage-3 step.

ZeRO-3 moves 3Ψ per step across the data-parallel group: the forward all-gather of the
parameters, the backward re-gather and the gradient reduce-scatter. On a cluster most of those
bytes cross the slow links between nodes. ZeRO++ cuts what crosses them, with three independent
switches of ``zero_optimization`` (all stage 3 only, as in DeepSpeed):

* **qwZ** (``zero_quantized_weights``): the parameter all-gather moves int8 blocks (or int4, or
  another strategy of :mod:`jzero.sharding.quantization`) and fp32 scales instead of 16-bit
  values -- each device quantizes its partition
  (:func:`jzero.kernels.quantize`, DeepSpeed's group size
  :func:`jzero.kernels.qwz_group_size`), the blocks
  are gathered, every device dequantizes them to the compute dtype. The gather's backward stays a
  full-precision (or qgZ) reduce-scatter of the gradient; the compute dtype is never changed, so
  bf16 training stays bf16 (DeepSpeed #7775 cast bf16 weights to fp16).
* **hpZ** (``zero_hpz_partition_size`` = s devices per group): besides its primary partition
  (Ψ/N, over every ZeRO device), each device keeps a *secondary* partition, Ψ/s, split only
  inside its group of s devices (a node). The parameter gathers of the forward and the backward
  pass read the secondary over the intra-node axes; only refreshing it crosses nodes.
* **qgZ** (``zero_quantized_gradients``): the gradient reduce-scatter becomes two all-to-all
  hops of int4 blocks -- inside the node, then across nodes -- with a dequantize-sum-requantize
  between them (:func:`jzero.kernels.requantize_sum`) and a float32 sum at the end
  (:func:`jzero.kernels.dequantize_sum`). Never a reduce-scatter of integers: XLA would sum them in
  the integer type and wrap.

**hpZ's secondary partition.** Gathering the primary partitions over the node axes gives each
device the chunks ``{n * L + l : n}`` of its local index ``l``: that is its secondary partition
(``N`` primary chunks, concatenated in node order along the leaf's shard dimension). Gathering the
secondary partitions over the local axes then gives ``[l][n]``-ordered chunks, which a local
transpose puts back in the natural ``[n][l]`` order: the full parameter, bit for bit what plain
ZeRO-3's gather gives. Only data moves, so in full precision hpZ changes no number: the gradient
is still reduce-scattered over all ZeRO axes into the primary partition, exactly as in ZeRO-3.
The secondary is held in the train state (``TrainState.secondary``, compute dtype, Ψ/s per
device; its global view is the padded parameter with its chunks in ``[l][n]`` order) and is
refreshed inside the step right after the optimizer update, by one cross-node gather of the new
primary partitions (int8 with qwZ). So the forward *and* the backward gathers -- the
rematerialised regions of :mod:`jzero.modeling.layer_scan` and :mod:`jzero.modeling.gather_units`
recompute the forward gather in backward -- never cross nodes, and a step with gradient accumulation
crosses nodes for the parameters once, not once per micro-batch. DeepSpeed instead gathers over all
ranks in the forward pass and keeps the secondary from that; jzero's order needs the secondary at
step start, and costs the cross-node gather Ψ/s per device instead of Ψ. The secondary is never
saved: it is a function of the primary, recomputed by the same code after ``engine.init`` and
``engine.load_checkpoint``, so a resumed run is bit-exact (DeepSpeed #4851, #7164, #7606 lost
exactly this: the loss jumped after loading a checkpoint with hpZ).

**Quantization rule.** Both quantized collectives use DeepSpeed's symmetric rule
(``rule="deepspeed"``: scale 2^(b-1)/absmax, +absmax clips to 2^(b-1)-1), which keeps the lower rms
error of the two rules (kernels/README.md); ``"no_clip"`` bounds every element's error but is
coarser on average. With qwZ and hpZ together the weights are quantized once, by the refresh;
the intra-node gathers of the secondary then move its 16-bit values (a second quantization
would only add error, and the intra-node links are the fast ones).

**qgZ's scaling.** jzero's loss is divided by the data-parallel size before the backward pass, so
a plain reduce-scatter already gives the mean gradient, and qgZ gives the same quantity: the
float32 sum of the quantized partial sums, not divided again. DeepSpeed's
``all_to_all_quant_reduce`` divides by the number of nodes only (its intra-node reduction sums),
where its plain ``reduce_scatter_coalesced`` divides by the world size: the two DeepSpeed paths
differ by the devices per node. jzero's qgZ and plain paths give the same mean.

The settings -- which of the three the config asks for, the node / local hierarchy, each leaf's
static :class:`~jzero.sharding.zeropp.Comm` -- are data: :mod:`jzero.sharding.zeropp`; the
quantized collectives themselves are strategy objects by name, :mod:`jzero.sharding.quantization`
(a ``Comm``'s ``gather`` / ``reduce``): this module calls them, never compares names.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jzero.comm.collectives import all_gather, reduce_scatter
from jzero.sharding.zeropp import Comm

__all__ = ["gather", "attach", "refresh_secondary", "gather_secondary"]

Axes = tuple[str, ...]


# --- the collectives (inside shard_map) -----------------------------------------------------------


def _as_bits(x: jax.Array) -> jax.Array:
  """16-bit floats as uint16 for a gather (XLA's CPU backend widens 16-bit collectives)."""
  if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
    return lax.bitcast_convert_type(x, jnp.uint16)
  return x


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
  return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def refresh_secondary(primary: jax.Array, dim: int, comm: Comm, batch_dims: int = 0) -> jax.Array:
  """hpZ: this device's secondary partition from the primary partitions of its node axes (int8
  blocks with qwZ). ``primary`` may be a stacked leaf (``batch_dims=1``: one chunk per layer)."""
  if comm.gather is not None:  # quantized once, by the refresh
    return comm.gather.gather(primary, dim, comm.node_axes, comm.gather_group, batch_dims,
                              comm.impl)
  d = dim % primary.ndim
  full = lax.all_gather(_as_bits(primary), comm.node_axes, axis=d, tiled=True)
  return _from_bits(full, primary.dtype)


def gather_secondary(secondary: jax.Array, dim: int, size: int, comm: Comm) -> jax.Array:
  """hpZ: the full parameter (``size`` along ``dim``) from the secondary partitions on the local
  axes -- the only collective of the forward and backward gathers, inside the node."""
  d = dim % secondary.ndim
  n = lax.axis_size(comm.node_axes)
  g = lax.all_gather(_as_bits(secondary), comm.local_axes, axis=d, tiled=False)
  local, chunk = g.shape[d], g.shape[d + 1] // n
  g = g.reshape(*g.shape[:d], local, n, chunk, *g.shape[d + 2:])
  g = jnp.swapaxes(g, d, d + 1)  # [l][n] -> [n][l]: natural order
  g = g.reshape(*g.shape[:d], local * n * chunk, *g.shape[d + 3:])
  return lax.slice_in_dim(_from_bits(g, secondary.dtype), 0, size, axis=d)


def _reduce(ct: jax.Array, dim: int, padded: int, comm: Comm, comm_dtype: Any) -> jax.Array:
  """A full gradient -> its reduce-scattered partition, in ``ct``'s dtype."""

  if comm.reduce is not None:
    return comm.reduce.reduce_scatter(ct, dim, padded, comm).astype(ct.dtype)
  return reduce_scatter(ct.astype(comm_dtype or ct.dtype), dim, padded,
                        comm.zero_axes).astype(ct.dtype)


def _forward(partition: jax.Array, secondary: jax.Array | None, dim: int, size: int,
             comm: Comm) -> jax.Array:
  if comm.secondary:
    return gather_secondary(secondary, dim, size, comm)
  if comm.gather is not None:
    full = comm.gather.gather(partition, dim, comm.zero_axes, comm.gather_group, impl=comm.impl)
    return lax.slice_in_dim(full, 0, size, axis=dim % full.ndim)

  return all_gather(partition, dim, size, comm.zero_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _gather(partition, secondary, dim, size, comm, comm_dtype):
  return _forward(partition, secondary, dim, size, comm)


def _gather_fwd(partition, secondary, dim, size, comm, comm_dtype):
  return _forward(partition, secondary, dim, size, comm), None


def _gather_bwd(dim, size, comm, comm_dtype, _, ct):
  n = lax.axis_size(comm.zero_axes)
  return _reduce(ct, dim, -(-size // n) * n, comm, comm_dtype), None


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather(partition: jax.Array, secondary: jax.Array | None, dim: int, size: int, comm: Comm,
           comm_dtype: Any = None) -> jax.Array:
  """The full parameter of a stage-3 partition, gathered as ``comm`` says (from the secondary
  over the local axes with hpZ, int8 blocks with qwZ, plain otherwise); the backward
  reduce-scatters the gradient into ``partition`` (int4 two-hop with qgZ, else in
  ``comm_dtype``). :func:`jzero.comm.collectives.gather` with ZeRO++."""
  return _gather(partition, secondary, dim, size, comm, comm_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _attach(full, slot, dim, padded, comm):
  return full


def _attach_fwd(full, slot, dim, padded, comm):
  return full, None


def _attach_bwd(dim, padded, comm, _, ct):
  return None, comm.reduce.reduce_scatter(ct, dim, padded, comm)


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach(full: jax.Array, slot: jax.Array, dim: int, comm: Comm) -> jax.Array:
  """:func:`jzero.comm.collectives.attach` with qgZ: ``full`` unchanged; its gradient comes back as
  ``slot``'s partition through the int4 two-hop reduction (in ``slot``'s dtype)."""
  padded = slot.shape[dim] * lax.axis_size(comm.zero_axes)
  return _attach(full, slot.astype(jnp.float32), dim, padded, comm)
