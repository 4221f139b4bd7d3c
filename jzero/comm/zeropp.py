"""ZeRO++ (Wang et al., 2023): qwZ, hpZ and qgZ as collectives of jzero's stage-3 step.

ZeRO-3 moves 3Ψ per step across the data-parallel group: the forward all-gather of the
parameters, the backward re-gather and the gradient reduce-scatter. On a cluster most of those
bytes cross the slow links between nodes. ZeRO++ cuts what crosses them, with three independent
switches of ``zero_optimization`` (all stage 3 only, as in DeepSpeed):

* **qwZ** (``zero_quantized_weights``): the parameter all-gather moves int8 blocks and fp32
  scales instead of 16-bit values -- each device quantizes its partition
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

**The hierarchy.** All three read a split of the ZeRO axes into *node* axes (across nodes) and
*local* axes (inside a node), :class:`Hierarchy`. With hpZ the local axes are the trailing ZeRO
axes whose sizes multiply to s; without hpZ (qgZ alone) the last ZeRO axis is local and the
others are nodes. A mesh file says which axes those are (``configs/mesh/node2x4.yaml``:
``axes: {node: 2, local: 4}``); without one, jzero lays the default one-axis mesh out as
``node = N / s`` x ``local = s`` (devices in process order, so a node is a run of consecutive
processes' devices), or, for qgZ without hpZ in several processes, ``node`` = processes x
``local`` = devices per process, and logs it (:func:`resolve`). The ZeRO axes stay in mesh order,
node axes first, so the primary partition of device (n, l) is partition ``n * L + l`` -- the
same layout as plain ZeRO-3, which is why checkpoints and the optimizer do not change.

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
rematerialised regions of :mod:`jzero.sharding.layer_scan` and :mod:`jzero.sharding.gather_units`
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

**What stays plain** (per leaf, decided by :func:`jzero.sharding.plan.make_plan` and recorded in the
plan): the qwZ gather of a partition of fewer than :data:`QWZ_MIN_NUMEL` elements per layer
(fp32 scales would cost more than the int8 saves, e.g. a LayerNorm scale); the qgZ reduction of
a leaf that is one-dimensional per layer (DeepSpeed's rule) or whose per-device partition is
below :data:`QGZ_MIN_NUMEL` elements per layer. Sizes never have to divide: a partitioned leaf is
already padded to a multiple of the ZeRO size, and a last block is zero-padded. Node counts need
not be powers of two (DeepSpeed #5054): nothing here depends on it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jzero import kernels
from jzero.comm.collectives import all_gather, pad_to, reduce_scatter
from jzero.errors import ConfigError, JZeroWarning
from jzero.sharding.mesh import MeshSpec, ZeroMesh

__all__ = ["Hierarchy", "ZeroPP", "Comm", "resolve", "gather", "attach", "refresh_secondary",
           "gather_secondary", "quantized_gather", "quantized_reduce_scatter", "QWZ_BITS",
           "QGZ_BITS", "QGZ_GROUP", "QWZ_MIN_NUMEL", "QGZ_MIN_NUMEL", "RULE"]

logger = logging.getLogger("jzero")

Axes = tuple[str, ...]

QWZ_BITS = 8  # DeepSpeed's qwZ
QGZ_BITS = 4  # DeepSpeed's qgZ, both hops
QGZ_GROUP = 256  # elements per int4 block of the gradient all-to-all (a power of two)
QWZ_MIN_NUMEL = kernels.layout.MIN_QWZ_GROUP  # smaller partitions are gathered in 16 bits
QGZ_MIN_NUMEL = 2 * QGZ_GROUP  # smaller gradient partitions are reduce-scattered plainly
RULE = "deepspeed"


# --- what the config asks, against the mesh -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """The ZeRO axes split into node axes (across nodes) and local axes (inside a node)."""

  node_axes: Axes
  local_axes: Axes
  nodes: int
  local: int


@dataclasses.dataclass(frozen=True)
class ZeroPP:
  """ZeRO++ as the config asks for it, resolved against the mesh.

  Attributes:
    quantized_weights: qwZ.
    quantized_gradients: qgZ.
    hpz: the secondary group size s (1: hpZ off).
    hierarchy: the node / local split of the ZeRO axes (None when nothing needs one).
  """

  quantized_weights: bool = False
  quantized_gradients: bool = False
  hpz: int = 1
  hierarchy: Hierarchy | None = None

  @property
  def enabled(self) -> bool:
    return self.quantized_weights or self.quantized_gradients or self.hpz > 1

  def describe(self) -> str:
    parts = []
    if self.quantized_weights:
      parts.append("qwZ (int8 weight gather)")
    if self.hpz > 1:
      parts.append(f"hpZ (secondary partition over {self.hpz} devices)")
    if self.quantized_gradients:
      parts.append("qgZ (int4 two-hop gradient all-to-all)")
    h = self.hierarchy
    where = (f"; nodes {list(h.node_axes)} = {h.nodes}, local {list(h.local_axes)} = {h.local}"
             if h else "")
    return "ZeRO++: " + (", ".join(parts) or "off") + where


_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def _trailing(mesh: ZeroMesh, size: int) -> Axes | None:
  """The trailing ZeRO axes whose sizes multiply to ``size`` (None when no such run exists)."""
  prod = 1
  axes: list[str] = []
  for axis in reversed(mesh.zero_axes):
    if prod == size:
      break
    prod *= mesh.mesh.shape[axis]
    axes.insert(0, axis)
  return tuple(axes) if prod == size else None


def _hierarchy(mesh: ZeroMesh, local_axes: Axes) -> Hierarchy:
  node_axes = tuple(a for a in mesh.zero_axes if a not in local_axes)
  size = lambda axes: math.prod(mesh.mesh.shape[a] for a in axes)  # noqa: E731
  return Hierarchy(node_axes=node_axes, local_axes=local_axes, nodes=size(node_axes),
                   local=size(local_axes))


def _relayout(mesh: ZeroMesh, nodes: int, local: int, why: str) -> ZeroMesh:
  """The default one-axis mesh as node x local (same devices, same order)."""
  spec = MeshSpec(axes=(("node", nodes), ("local", local)), zero_axes=("node", "local"),
                  batch_axes=("node", "local"))
  laid = spec.build(list(mesh.mesh.devices.flat))
  logger.info("ZeRO++: %s; the default mesh is laid out as node=%d x local=%d (give a mesh file "
              "with node and local axes to choose otherwise)", why, nodes, local)
  return laid


def resolve(zero: Any, mesh: ZeroMesh, *, default_mesh: bool = False) -> tuple[ZeroMesh, ZeroPP]:
  """Checks the ZeRO++ keys of a resolved ``zero_optimization`` block against the mesh.

  DeepSpeed's rules, as ConfigErrors naming the key and the sizes, before any device work: ZeRO++
  needs stage 3; the hpZ group must divide the ZeRO world size; qgZ needs more than one node. An
  hpZ group as large as the ZeRO world does nothing (its secondary partition would be the
  primary): it is turned off with a warning.

  Args:
    zero: the resolved ``zero_optimization`` block (:class:`jzero.config.schema.ZeroConfig`).
    mesh: the mesh the engine runs on.
    default_mesh: ``mesh`` is jzero's default one-axis mesh, which may be laid out again as
      node x local (see the module docstring); a mesh the user gave is never changed.

  Returns:
    (the mesh to run on, the resolved settings).
  """
  qw, qg = bool(zero.zero_quantized_weights), bool(zero.zero_quantized_gradients)
  s = int(zero.zero_hpz_partition_size)
  asked = [f"{k}={v}" for k, v in zip(_KEYS, ("true" if qw else None, "true" if qg else None,
                                              s if s > 1 else None)) if v is not None]
  if not asked:
    return mesh, ZeroPP()
  keys = ", ".join(f"zero_optimization.{a}" for a in asked)
  if zero.stage != 3:
    raise ConfigError(f"{keys}: ZeRO++ works on stage 3's parameter gathers and gradient "
                      f"reduce-scatters, and this config has zero_optimization.stage="
                      f"{zero.stage}. Set stage 3, or remove the ZeRO++ keys (as DeepSpeed, "
                      f"which acts on them in stage 3 only).")
  world = mesh.zero_size
  where = (f"the mesh's ZeRO axes {list(mesh.zero_axes)} "
           f"({' x '.join(str(mesh.mesh.shape[a]) for a in mesh.zero_axes)} = {world} devices)")
  hierarchy = None
  if s > 1:
    if s > world or world % s:
      raise ConfigError(
          f"zero_optimization.zero_hpz_partition_size={s}: the hpZ group must divide the ZeRO "
          f"world size, and {where} is not a multiple of {s}. Use a group size that divides "
          f"{world} -- the devices per node, e.g. {_divisors_hint(world)}.")
    if s == world:
      import warnings  # noqa: PLC0415
      warnings.warn(
          f"zero_optimization.zero_hpz_partition_size={s} equals the ZeRO world size ({world}): "
          f"the secondary partition would be the primary one, so hpZ has nothing to save and is "
          f"off. Set it to the devices per node of a multi-node job.", JZeroWarning, stacklevel=3)
      s = 1
  if s > 1:
    local = _trailing(mesh, s)
    if local is None and default_mesh and len(mesh.zero_axes) == 1:
      mesh = _relayout(mesh, world // s, s, f"zero_hpz_partition_size={s}")
      local = ("local",)
    if local is None:
      sizes = ", ".join(f"{a}={mesh.mesh.shape[a]}" for a in mesh.zero_axes)
      raise ConfigError(
          f"zero_optimization.zero_hpz_partition_size={s}: hpZ keeps the secondary partition "
          f"over the trailing ZeRO axes whose sizes multiply to {s}, and {where} has none "
          f"({sizes}). Give a mesh file with a node and a local axis, e.g. axes: "
          f"{{node: {world // s}, local: {s}}} (configs/mesh/node2x4.yaml), or no mesh "
          f"(jzero then lays the devices out so).")
    hierarchy = _hierarchy(mesh, local)
  elif qg:
    if len(mesh.zero_axes) >= 2:
      hierarchy = _hierarchy(mesh, mesh.zero_axes[-1:])
    elif default_mesh and jax.process_count() > 1 and world % jax.process_count() == 0:
      procs = jax.process_count()
      mesh = _relayout(mesh, procs, world // procs, "qgZ without hpZ: one node per process")
      hierarchy = _hierarchy(mesh, ("local",))
  if qg and (hierarchy is None or hierarchy.nodes == 1):
    raise ConfigError(
        f"zero_optimization.zero_quantized_gradients=true: qgZ reduces gradients in two hops, "
        f"inside a node and across nodes, and {where} is one node. DeepSpeed uses it only with "
        f"more than one node: turn it off, or give a mesh file with a node and a local axis "
        f"(configs/mesh/node2x4.yaml) -- with hpZ, zero_hpz_partition_size smaller than {world}.")
  return mesh, ZeroPP(quantized_weights=qw, quantized_gradients=qg, hpz=s, hierarchy=hierarchy)


def _divisors_hint(n: int) -> str:
  return ", ".join(str(d) for d in range(2, n) if n % d == 0) or "none below it"


# --- per-leaf static choices ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comm:
  """How one leaf's collectives move bytes: the static part of a ZeRO++ ``ZeroParam``.

  Attributes:
    gather: "plain" or "int8" (qwZ) -- the gather over all ZeRO axes, or with hpZ the refresh
      of the secondary over the node axes.
    secondary: hpZ: the forward / backward gathers read the secondary over the local axes.
    reduce: "plain" or "int4" (qgZ) -- the gradient reduce-scatter.
    gather_group: int8 block size (elements) of the qwZ gather.
    reduce_group: int4 block size of the qgZ hops.
    zero_axes, node_axes, local_axes: the mesh axes.
    impl: the kernels' implementation (:mod:`jzero.kernels.ops`): "jnp" on a CPU mesh (the Pallas
      kernels would only be traced to be dropped: seconds of tracing per step compile), "auto"
      elsewhere (Pallas where the step is lowered for CUDA, also ahead of time).
  """

  gather: str
  secondary: bool
  reduce: str
  gather_group: int
  reduce_group: int
  zero_axes: Axes
  node_axes: Axes
  local_axes: Axes
  impl: str = "auto"


# --- the collectives (inside shard_map) -----------------------------------------------------------


def _as_bits(x: jax.Array) -> jax.Array:
  """16-bit floats as uint16 for a gather (XLA's CPU backend widens 16-bit collectives)."""
  if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
    return lax.bitcast_convert_type(x, jnp.uint16)
  return x


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
  return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _concat_chunks(y: jax.Array, d: int) -> jax.Array:
  """``(k, *shape)`` chunks -> ``shape`` with dimension ``d`` k times longer (chunk-major)."""
  y = jnp.moveaxis(y, 0, d)
  return y.reshape(*y.shape[:d], y.shape[d] * y.shape[d + 1], *y.shape[d + 2:])


def quantized_gather(shard: jax.Array, dim: int, axes: Axes, group: int,
                     batch_dims: int = 0, impl: str = "auto") -> jax.Array:
  """qwZ: all partitions on ``axes`` gathered as int8 blocks, dequantized to ``shard``'s dtype and
  concatenated along ``dim``; the first ``batch_dims`` axes are quantized as separate chunks (the
  layers of a stacked leaf)."""
  d = dim % shard.ndim
  q = kernels.quantize(shard, QWZ_BITS, group, batch_dims=batch_dims, rule=RULE, impl=impl)
  g = kernels.all_gather(q, axes)
  return _concat_chunks(kernels.dequantize(g, shard.dtype, impl=impl), d)


def refresh_secondary(primary: jax.Array, dim: int, comm: Comm, batch_dims: int = 0) -> jax.Array:
  """hpZ: this device's secondary partition from the primary partitions of its node axes (int8
  blocks with qwZ). ``primary`` may be a stacked leaf (``batch_dims=1``: one chunk per layer)."""
  if comm.gather == "int8":
    return quantized_gather(primary, dim, comm.node_axes, comm.gather_group, batch_dims,
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


def quantized_reduce_scatter(full: jax.Array, dim: int, padded: int, comm: Comm) -> jax.Array:
  """qgZ: the float32 sum over all ZeRO devices of ``full`` (zero-padded to ``padded`` along
  ``dim``), this device's partition of it -- what ``psum_scatter`` over the ZeRO axes gives, as
  two int4 all-to-all hops (local, then node) with a float32 requantized sum between them."""

  d = dim % full.ndim
  nodes, local = lax.axis_size(comm.node_axes), lax.axis_size(comm.local_axes)
  x = jnp.moveaxis(pad_to(full, d, padded), d, 0)
  rest = x.shape[1:]
  part = padded // (nodes * local)
  x = x.reshape(nodes, local, part * math.prod(rest)).swapaxes(0, 1)  # [l, n]: partition n*L+l
  q = kernels.quantize(x, QGZ_BITS, comm.reduce_group, batch_dims=2, rule=RULE, impl=comm.impl)
  q = kernels.all_to_all(q, comm.local_axes)  # [source l', n]: partitions n*L+l of the node
  q = kernels.requantize_sum(q, rule=RULE, impl=comm.impl)  # [n]: this node's partial sums
  q = kernels.all_to_all(q, comm.node_axes)  # [source n']: partition n*L+l of every node
  mine = kernels.dequantize_sum(q, impl=comm.impl)
  return jnp.moveaxis(mine.reshape(part, *rest), 0, d)


def _reduce(ct: jax.Array, dim: int, padded: int, comm: Comm, comm_dtype: Any) -> jax.Array:
  """A full gradient -> its reduce-scattered partition, in ``ct``'s dtype."""

  if comm.reduce == "int4":
    return quantized_reduce_scatter(ct, dim, padded, comm).astype(ct.dtype)
  return reduce_scatter(ct.astype(comm_dtype or ct.dtype), dim, padded,
                        comm.zero_axes).astype(ct.dtype)


def _forward(partition: jax.Array, secondary: jax.Array | None, dim: int, size: int,
             comm: Comm) -> jax.Array:
  if comm.secondary:
    return gather_secondary(secondary, dim, size, comm)
  if comm.gather == "int8":
    full = quantized_gather(partition, dim, comm.zero_axes, comm.gather_group, impl=comm.impl)
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
  return None, quantized_reduce_scatter(ct, dim, padded, comm)


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach(full: jax.Array, slot: jax.Array, dim: int, comm: Comm) -> jax.Array:
  """:func:`jzero.comm.collectives.attach` with qgZ: ``full`` unchanged; its gradient comes back as
  ``slot``'s partition through the int4 two-hop reduction (in ``slot``'s dtype)."""
  padded = slot.shape[dim] * lax.axis_size(comm.zero_axes)
  return _attach(full, slot.astype(jnp.float32), dim, padded, comm)
