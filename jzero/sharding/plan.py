"""The placement plan: where every leaf's compute param, gradient, fp32 master and optimizer state
live.

ZeRO is a placement plan. For each parameter leaf the plan decides, from the stage, the mesh and the
leaf's shape, how the four things are laid out over the ZeRO axes of the mesh:

==================  =============  ==========  ==========  ==========
thing               stage 0 (DDP)  stage 1     stage 2     stage 3
==================  =============  ==========  ==========  ==========
compute params      replicated     replicated  replicated  partitioned
gradients           replicated     replicated  partitioned partitioned
fp32 master         replicated     partitioned partitioned partitioned
optimizer state     replicated     partitioned partitioned partitioned
==================  =============  ==========  ==========  ==========

Everything else -- the train step, checkpoints, memory reports -- reads this plan; no other module
decides where an array lives.

**Layout of a partitioned leaf.** A partitioned leaf keeps its shape (so optimizer masks,
checkpoints and memory reports see real shapes) and is split along one dimension, its ``shard_dim``,
over the ZeRO axes. The dimension is the first one divisible by the ZeRO size; when none is, the one
that needs the least padding, padded with zeros up to a multiple of the ZeRO size. So every device
holds exactly the same number of elements (per-device bytes stay balanced) and at most ``N - 1``
slices of padding per leaf. Padding stays zero through the optimizer (its gradient is zero, so
Adam's moments and the decayed weight stay zero) and is sliced off whenever a full parameter is
rebuilt. Leaves stacked over a leading layer axis (layers under ``scan``) are never split along that
axis: each device holds a slice of *every* layer, so a scan can gather one layer at a time.
``shard_dim`` is stored as a negative index so that it stays right after ``scan`` drops the layer
axis. 0-d leaves cannot be split and stay replicated at every stage.

**Gradients.** Stage 0 and 1 accumulate each device's full local gradient over the micro-batches
and reduce once at the end: all-reduce (stage 0) or reduce-scatter into the partition (stage 1;
all-reduce then keep the own slice when ``reduce_scatter`` is false). Stage 2 reduce-scatters after
every micro-batch into a partitioned accumulator. Stage 3 partitioned params are gathered by a
collective whose backward is the reduce-scatter, so their gradients arrive partitioned.

**Gather units.** Stage-3 leaves are gathered where they are used: a stacked leaf one layer at a
time inside the layer scan, any other leaf by its *unit* -- the module whose calls gather it
(:mod:`jzero.modeling.gather_units` chooses them from the module tree; ``LeafPlan.unit``). A
partitioned leaf in no unit is gathered when the forward pass starts and kept until backward.

**Persistence.** In stage 3, leaves smaller than ``stage3_param_persistence_threshold`` elements
(per layer, for stacked leaves) keep a replicated compute param, as DeepSpeed's persistent params
do; their gradients, master and optimizer state are still partitioned (stage-2 treatment). Up to
``stage3_model_persistence_threshold`` elements in all are kept, smallest leaves first.

**ZeRO++** (:mod:`jzero.comm.zeropp`). The plan records, per stage-3 leaf, how its collectives move
bytes: ``gather`` ("plain", or the name of a qwZ strategy of :mod:`jzero.sharding.quantization`:
"int8", "int4"), ``secondary`` (hpZ: a secondary partition split over the node's local axes only,
which the forward and backward gathers read; refreshed across nodes after every update) and
``reduce`` ("plain", or a qgZ strategy's name: "int4", two all-to-all hops), with their block sizes; :attr:`Plan.zeropp` holds the node / local split of the ZeRO axes. The step
(``ZeroParam.comm``), the secondary's placement (:meth:`Plan.secondary_spec`), the memory
estimator and report read them from here. The primary layout is the same as without ZeRO++.

**Tiers.** Each leaf's master and optimizer state, and each stage-3 partitioned compute param,
has a tier (``state_tier``, ``param_tier``): "device", or the name of the tier that took it
(:meth:`jzero.tiers.base.Tier.place`; ZeRO-Offload's host memory, ZeRO-Infinity's NVMe store), with
the memory kind it is kept in when that is not the device's (``state_kind``, ``param_kind``). The
plan holds them as data (:class:`jzero.sharding.planner.Placement`, :meth:`Plan.placed`) and reads
only the memory kinds; what a tier's name means is the tiers' (:mod:`jzero.tiers.where`). A leaf
in another tier keeps its partitioning; with any leaf in another memory every other array gets an
explicit "device" (:attr:`Plan.device_kind`). Persistent and 0-d leaves always stay on the device.

**Precision.** fp32 training keeps no separate master: the optimizer updates the fp32 params (for a
replicated param in stage 1/2 each device updates its own slice, then all-gathers). bf16 / fp16
training keeps an fp32 master in the master layout and casts it to the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jzero.sharding import quantization
from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.quantization import PLAIN
from jzero.sharding.zeropp import Comm, ZeroPP

if TYPE_CHECKING:  # annotations only
  from jzero.sharding.planner import Placement

__all__ = ["LeafPlan", "Plan", "path_str", "flatten_paths", "pad_to"]

PyTree = Any


def path_str(path: Sequence[Any]) -> str:
  """'blocks/attn/kernel' for a jax key path."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def flatten_paths(tree: PyTree) -> dict[str, Any]:
  """{'/'-joined key path: leaf} of a pytree (None subtrees have no leaves)."""
  return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def pad_to(x: jax.Array, dim: int, padded: int) -> jax.Array:
  """Zero-pads dimension ``dim`` of ``x`` at its end to size ``padded``."""
  extra = padded - x.shape[dim]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[dim] = (0, extra)
  return jnp.pad(x, widths)



@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """The plan of one parameter leaf.

  Attributes:
    path: '/'-joined key path of the leaf in the params tree.
    shape: logical shape (the model's), including the leading layer axis when stacked.
    stacked: the leaf is stacked over a leading layer axis and gathered one layer at a time.
    shard_dim: negative index of the dimension split over the ZeRO axes; None for 0-d leaves.
    padded: size of ``shard_dim`` after zero-padding to a multiple of the ZeRO size.
    param_partitioned: the compute param is partitioned (stage 3, not persistent).
    state_partitioned: master and optimizer state are partitioned (stage >= 1).
    grad_partitioned: the gradient accumulator is partitioned (stage >= 2).
    unit: path of the module whose calls gather this leaf under stage 3 ('' for the model
      itself; see :mod:`jzero.modeling.gather_units`), or None when no module call gathers it alone.
    gather: how the partitioned param is gathered: "plain", or the name of its qwZ strategy
      (:data:`jzero.sharding.quantization.WEIGHTS`: "int8" blocks, DeepSpeed's).
    secondary: hpZ: the leaf keeps a secondary partition over the local axes, which its
      forward and backward gathers read.
    reduce: how the partitioned gradient is reduced: "plain" reduce-scatter, or the name of its
      qgZ strategy (:data:`jzero.sharding.quantization.GRADIENTS`: "int4" two-hop all-to-all).
    gather_group, reduce_group: block sizes (elements) of the quantized gather and reduction.
    state_tier, param_tier: the tier the fp32 master and optimizer state / the (partitioned)
      compute param live in between steps: "device", or the name a tier gave it
      (:meth:`jzero.tiers.base.Tier.place`; what the names mean: :mod:`jzero.tiers.where`).
    state_kind, param_kind: the memory kind they are stored in when a tier keeps them in another
      memory than the device's (e.g. "pinned_host"); None: the plan's ``device_kind``.
    frozen: the optimizer's update of the leaf is a constant zero (:mod:`jzero.sharding.tx_traits`):
      it has no gradient and no fp32 master (a 0-byte placeholder), and its param never changes.
  """

  path: str
  shape: tuple[int, ...]
  stacked: bool
  shard_dim: int | None
  padded: int
  param_partitioned: bool
  state_partitioned: bool
  grad_partitioned: bool
  unit: str | None = None
  gather: str = "plain"
  secondary: bool = False
  reduce: str = "plain"
  gather_group: int = 0
  reduce_group: int = 0
  state_tier: str = "device"
  param_tier: str = "device"
  state_kind: str | None = None
  param_kind: str | None = None
  frozen: bool = False

  @property
  def numel(self) -> int:
    return math.prod(self.shape)

  @property
  def layer_numel(self) -> int:
    """Elements per layer (the unit DeepSpeed thresholds apply to)."""
    return self.numel // self.shape[0] if self.stacked else self.numel

  @property
  def padded_shape(self) -> tuple[int, ...]:
    """Global shape of a partitioned array of this leaf (shard_dim padded)."""
    if self.shard_dim is None:
      return self.shape
    shape = list(self.shape)
    shape[self.shard_dim] = self.padded
    return tuple(shape)

  @property
  def pad(self) -> int:
    return 0 if self.shard_dim is None else self.padded - self.shape[self.shard_dim]

  def to_padded(self, x: jax.Array) -> jax.Array:
    """A logical-shape array zero-padded to :attr:`padded_shape`."""
    return x if self.pad == 0 else pad_to(x, self.shard_dim % x.ndim, self.padded)

  def to_logical(self, x: jax.Array) -> jax.Array:
    """An array of :attr:`padded_shape` (or the logical shape) cut back to the logical shape."""
    if self.shard_dim is None or x.shape[self.shard_dim] == self.shape[self.shard_dim]:
      return x
    return lax.slice_in_dim(x, 0, self.shape[self.shard_dim], axis=self.shard_dim % x.ndim)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-leaf placement of params, gradients, master and optimizer state (see module docstring).

  Attributes:
    stage: ZeRO stage 0..3.
    mesh: the mesh and its ZeRO / batch axes.
    leaves: a pytree with the structure of the params whose leaves are :class:`LeafPlan`.
    compute_dtype: dtype of the compute params (float32, bfloat16 or float16).
    grad_accum_dtype: dtype of the gradient accumulator.
    comm_dtype: dtype gradients are reduced in.
    reduce_scatter: stage 1/2 reduce gradients with reduce-scatter (else all-reduce + own slice).
    reduce_bucket_size: elements per gradient reduction bucket (DeepSpeed's reduce_bucket_size).
    gather_bucket_size: elements per parameter all-gather bucket (allgather_bucket_size in stage
      1/2, stage3_prefetch_bucket_size in stage 3).
    overlap_comm: overlap collectives with compute.
    prefetch: stage 3 gathers the next layer or unit while one computes (two gathered groups
      alive: ``stage3_prefetch_bucket_size`` > 0 and ``stage3_max_live_parameters`` holding two of
      the largest group; :func:`jzero.modeling.gather_units.prefetches`).
    zeropp: ZeRO++ settings and the node / local split of the ZeRO axes.
    device_kind: the memory kind of everything no tier keeps elsewhere: None (JAX's default)
      when every leaf is on the device, so plans without offload compile exactly as before;
      "device" once some leaf's ``state_kind`` or ``param_kind`` names another memory (every
      array then gets an explicit kind; see :mod:`jzero.tiers.host_optimizer`, donation).
  """

  stage: int
  mesh: ZeroMesh
  leaves: PyTree
  compute_dtype: Any
  grad_accum_dtype: Any
  comm_dtype: Any
  reduce_scatter: bool = True
  reduce_bucket_size: int = 500_000_000
  gather_bucket_size: int = 500_000_000
  overlap_comm: bool = False
  prefetch: bool = False
  zeropp: ZeroPP = ZeroPP()
  device_kind: str | None = None

  # -- what exists ---------------------------------------------------------------------------------
  @property
  def has_master(self) -> bool:
    """A separate fp32 master exists only in mixed precision (fp32 updates the params in place)."""
    return jnp.dtype(self.compute_dtype) != jnp.float32

  def leaf_list(self) -> list[LeafPlan]:
    return jax.tree.leaves(self.leaves, is_leaf=lambda x: isinstance(x, LeafPlan))

  def map(self, fn: Callable[..., Any], *trees: PyTree) -> PyTree:
    """``tree.map`` over (LeafPlan, the matching leaf of each of ``trees``)."""
    return jax.tree.map(fn, self.leaves, *trees, is_leaf=lambda x: isinstance(x, LeafPlan))

  def flat(self, tree: PyTree) -> list[Any]:
    """The subtrees of a params-structured ``tree`` at the plan's leaves, in :meth:`leaf_list`'s
    order (a leaf may be None)."""
    is_leaf = lambda x: isinstance(x, LeafPlan)
    return jax.tree_util.tree_structure(self.leaves, is_leaf=is_leaf).flatten_up_to(tree)

  def placed(self, placement: Placement) -> Plan:
    """This plan with its leaves in the tiers and memory kinds ``placement`` names. Only a
    partitioned param can leave the device (a replicated one is every device's whole copy)."""
    def place(leaf: LeafPlan) -> LeafPlan:
      param_tier = placement.param_tiers.get(leaf.path, "device")
      if param_tier != "device" and not leaf.param_partitioned:
        raise ValueError(f"{leaf.path}: only a partitioned param can be placed in a tier, not "
                         f"{param_tier!r}")
      return dataclasses.replace(leaf, state_tier=placement.state_tiers.get(leaf.path, "device"),
                                 param_tier=param_tier,
                                 state_kind=placement.state_kinds.get(leaf.path),
                                 param_kind=placement.param_kinds.get(leaf.path))
    elsewhere = bool(placement.state_kinds or placement.param_kinds or placement.explicit_kinds)
    return dataclasses.replace(self, leaves=self.map(place),
                               device_kind="device" if elsewhere else None)

  @property
  def frozen_paths(self) -> frozenset[str]:
    """Paths of the frozen leaves (:attr:`LeafPlan.frozen`): their master is a 0-byte
    placeholder in the train state."""
    return frozenset(l.path for l in self.leaf_list() if l.frozen)

  def with_frozen(self, paths: frozenset[str]) -> Plan:
    """This plan with the leaves of ``paths`` frozen (:attr:`LeafPlan.frozen`): no gradient is
    computed or reduced for them."""
    def freeze(leaf: LeafPlan) -> LeafPlan:
      if leaf.path not in paths:
        return leaf
      return dataclasses.replace(leaf, frozen=True, grad_partitioned=False, reduce=PLAIN)
    return dataclasses.replace(self, leaves=self.map(freeze))

  # -- memory kinds --------------------------------------------------------------------------------
  def memory_kind(self) -> str | None:
    """The memory kind of what stays on the device (:attr:`device_kind`)."""
    return self.device_kind

  def param_memory_kind(self, leaf: LeafPlan) -> str | None:
    """The memory kind of a leaf's stored compute param."""
    return leaf.param_kind or self.device_kind

  def state_memory_kind(self, leaf: LeafPlan) -> str | None:
    """The memory kind of a leaf's fp32 master and optimizer state."""
    return leaf.state_kind or self.device_kind

  # -- partition specs -----------------------------------------------------------------------------
  def _split_spec(self, leaf: LeafPlan) -> P:
    spec: list[Any] = [None] * len(leaf.shape)
    axes = self.mesh.zero_axes
    spec[leaf.shard_dim] = axes[0] if len(axes) == 1 else axes
    return P(*spec)

  def param_spec(self, leaf: LeafPlan) -> P:
    return self._split_spec(leaf) if leaf.param_partitioned else P()

  def state_spec(self, leaf: LeafPlan) -> P:
    return self._split_spec(leaf) if leaf.state_partitioned else P()

  def grad_spec(self, leaf: LeafPlan) -> P:
    return self._split_spec(leaf) if leaf.grad_partitioned else P()

  def secondary_spec(self, leaf: LeafPlan) -> P | None:
    """hpZ: the secondary partition's spec -- the padded leaf split along its shard dim over the
    local axes only (replicated across nodes); its global view is the padded parameter with its
    chunks in [local][node] order (:mod:`jzero.comm.zeropp`). None for a leaf without one."""
    if not leaf.secondary:
      return None
    spec: list[Any] = [None] * len(leaf.shape)
    axes = self.zeropp.hierarchy.local_axes
    spec[leaf.shard_dim] = axes[0] if len(axes) == 1 else axes
    return P(*spec)

  def secondary_specs(self) -> PyTree | None:
    """Specs of the train state's secondary partitions (None where a leaf has none), or None
    without hpZ."""
    if self.zeropp.hpz <= 1:
      return None
    return self.map(self.secondary_spec)

  def comm(self, leaf: LeafPlan) -> Comm | None:
    """The static ZeRO++ description of a leaf's collectives (None when they are all plain)."""
    if leaf.gather == PLAIN and not leaf.secondary and leaf.reduce == PLAIN:
      return None
    h = self.zeropp.hierarchy
    return Comm(gather=None if leaf.gather == PLAIN else quantization.weights(leaf.gather),
                secondary=leaf.secondary,
                reduce=None if leaf.reduce == PLAIN else quantization.gradients(leaf.reduce),
                gather_group=leaf.gather_group, reduce_group=leaf.reduce_group,
                zero_axes=self.mesh.zero_axes, node_axes=h.node_axes if h else (),
                local_axes=h.local_axes if h else (),
                impl="jnp" if self.mesh.mesh.devices.flat[0].platform == "cpu" else "auto")

  def param_shape(self, leaf: LeafPlan) -> tuple[int, ...]:
    """Global shape of the stored compute param."""
    return leaf.padded_shape if leaf.param_partitioned else leaf.shape

  def state_shape(self, leaf: LeafPlan) -> tuple[int, ...]:
    """Global shape of the master / optimizer-state leaves."""
    return leaf.padded_shape if leaf.state_partitioned else leaf.shape

  def param_specs(self) -> PyTree:
    return self.map(self.param_spec)

  def state_specs(self) -> PyTree:
    return self.map(self.state_spec)

  def abstract_master(self) -> PyTree:
    """ShapeDtypeStructs (global shapes) of the fp32 params in the master layout."""
    return self.map(lambda l: jax.ShapeDtypeStruct(self.state_shape(l), jnp.float32))

  def batch_spec(self) -> P:
    return self.mesh.batch_spec()

  def sharding(self, spec: P, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(self.mesh.mesh, spec, memory_kind=memory_kind or self.memory_kind())

  def shardings(self, specs: PyTree, kinds: PyTree = None) -> PyTree:
    """NamedShardings of a spec tree; ``kinds``: a prefix tree of memory kinds (None: the
    device's)."""
    is_spec = lambda x: isinstance(x, P)
    if kinds is None:
      return jax.tree.map(self.sharding, specs, is_leaf=is_spec)
    def expand(kind, sub):
      return jax.tree.map(lambda spec: self.sharding(spec, kind), sub, is_leaf=is_spec)
    return jax.tree.map(expand, kinds, specs, is_leaf=lambda x: x is None or isinstance(x, str))

  # -- per-device accounting -----------------------------------------------------------------------
  def gathered_working_set(self) -> tuple[int, int]:
    """Stage 3: (elements of the largest group gathered at once -- one layer of all stacked leaves,
    which the layer scan gathers together, or the largest unit --, elements gathered at the start
    of the forward pass and kept until backward). (0, 0) in other stages."""
    largest = stacked = upfront = 0
    units: dict[str, int] = {}
    for leaf in self.leaf_list():
      if not leaf.param_partitioned:
        continue
      if leaf.stacked:
        stacked += leaf.layer_numel
      elif leaf.unit is None:
        upfront += leaf.numel
      else:
        units[leaf.unit] = units.get(leaf.unit, 0) + leaf.numel
    largest = max([stacked, *units.values()])
    return largest, upfront

  def local_numel(self, leaf: LeafPlan, partitioned: bool) -> int:
    """Elements one device holds of a leaf laid out partitioned or replicated."""
    if partitioned:
      return math.prod(leaf.padded_shape) // self.mesh.zero_size
    return leaf.numel

  def secondary_numel(self, leaf: LeafPlan) -> int:
    """Elements one device holds of a leaf's hpZ secondary partition (0 without one)."""
    return math.prod(leaf.padded_shape) // self.zeropp.hpz if leaf.secondary else 0
