"""Making a plan: :func:`make_plan` and the settings it takes.

:func:`make_plan` lays out every leaf of a params pytree over the mesh's ZeRO axes by the stage
(:mod:`jzero.sharding.plan` describes the layouts), all on the device, from three settings objects:
:class:`Layout` (stage, mesh, which leaves are stacked layers, stage 3's persistence thresholds,
the gather units), :class:`Dtypes` and :class:`CommSettings` (reduction, buckets, overlap, ZeRO++).
The tiers then say where leaves leave the device, as a :class:`Placement` (data), which
:meth:`jzero.sharding.plan.Plan.placed` applies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.plan import LeafPlan, Plan, path_str
from jzero.sharding import quantization
from jzero.sharding.zeropp import ZeroPP

__all__ = ["CommSettings", "Dtypes", "Layout", "Placement", "make_plan"]

PyTree = Any


def _choose_shard_dim(shape: tuple[int, ...], stacked: bool, n: int) -> tuple[int | None, int]:
  """(negative shard dim, padded size) for a leaf; see the module docstring."""
  first = 1 if stacked else 0
  dims = list(range(first, len(shape)))
  if not dims:
    return None, 0
  for d in dims:
    if shape[d] % n == 0:
      return d - len(shape), shape[d]
  def padded_numel(d):
    return math.ceil(shape[d] / n) * n * (math.prod(shape) // shape[d])
  d = min(dims, key=padded_numel)
  return d - len(shape), math.ceil(shape[d] / n) * n


def _nothing_stacked(path: str) -> bool:
  return False


@dataclasses.dataclass(frozen=True)
class Layout:
  """How leaves are split: the ZeRO ``stage`` and ``mesh``; ``stacked``: path -> whether the leaf
  carries a leading layer axis gathered per layer by a scan; stage-3 leaves with fewer elements
  per layer than ``persistence_threshold`` keep a replicated param, at most
  ``model_persistence_threshold`` elements in all (None: no cap); ``units``: leaf path -> path of
  the module that gathers it (:func:`jzero.modeling.gather_units.choose_units`)."""

  stage: int
  mesh: ZeroMesh
  stacked: Callable[[str], bool] = _nothing_stacked
  persistence_threshold: int = 100_000
  model_persistence_threshold: int | None = None
  units: Mapping[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Dtypes:
  """The compute params' dtype, the gradient accumulator's, and the one gradients are reduced in
  (None: the compute dtype)."""

  compute: Any
  grad_accum: Any = jnp.float32
  comm: Any | None = None


@dataclasses.dataclass(frozen=True)
class CommSettings:
  """How gradients and params move: stage 1/2 reduce with reduce-scatter (False: all-reduce, keep
  the own slice); the bucket sizes and overlap (:func:`jzero.comm.program.compile_options`);
  ZeRO++ resolved against the mesh (:func:`jzero.sharding.zeropp.resolve`; stage 3)."""

  reduce_scatter: bool = True
  reduce_bucket_size: int = 500_000_000
  gather_bucket_size: int = 500_000_000
  overlap_comm: bool = False
  zeropp: ZeroPP = ZeroPP()


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the tiers put leaves (data; :func:`jzero.tiers.registry.placement` computes it from a
  plan and the config): leaf path -> tier of its master and optimizer state / of its partitioned
  param (absent: "device"), and leaf path -> the memory kind its state / its stored param is kept
  in when that is not the device's (absent: the device's)."""

  state_tiers: Mapping[str, str] = dataclasses.field(default_factory=dict)
  param_tiers: Mapping[str, str] = dataclasses.field(default_factory=dict)
  state_kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
  param_kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
  explicit_kinds: bool = False  # a step output lives in another memory: every array names its kind


def make_plan(abstract_params: PyTree, layout: Layout, dtypes: Dtypes,
              comm: CommSettings = CommSettings()) -> Plan:
  """The plan of a params pytree (arrays or ShapeDtypeStructs in the model's logical shapes), with
  every leaf on the device; :meth:`Plan.placed` moves leaves to the tiers."""
  stage, zeropp, n = layout.stage, comm.zeropp, layout.mesh.zero_size
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
  if zeropp.enabled and stage != 3:
    raise ValueError(f"ZeRO++ needs ZeRO stage 3, got stage {stage}")
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
  drafts = []
  for path, x in flat:
    p = path_str(path)
    shape = tuple(x.shape)
    is_stacked = bool(layout.stacked(p)) and len(shape) >= 1
    dim, padded = _choose_shard_dim(shape, is_stacked, n)
    drafts.append((p, shape, is_stacked, dim, padded))

  persistent: set[str] = set()
  if stage == 3:
    cap = layout.model_persistence_threshold
    budget = math.inf if cap is None else cap
    small = []
    for p, shape, is_stacked, dim, _ in drafts:
      numel = math.prod(shape)
      per_layer = numel // shape[0] if is_stacked else numel
      if dim is not None and per_layer < layout.persistence_threshold:
        small.append((numel, p))
    for numel, p in sorted(small):
      if numel > budget:
        break
      persistent.add(p)
      budget -= numel

  leaves = []
  for p, shape, is_stacked, dim, padded in drafts:
    splittable = dim is not None and stage >= 1
    leaf = LeafPlan(
        path=p, shape=shape, stacked=is_stacked, shard_dim=dim if splittable else None,
        padded=padded if splittable else 0,
        param_partitioned=splittable and stage == 3 and p not in persistent,
        state_partitioned=splittable,
        grad_partitioned=splittable and stage >= 2,
        unit=(layout.units or {}).get(p))
    leaves.append(_zeropp_leaf(leaf, zeropp, n) if zeropp.enabled else leaf)
  return Plan(stage=stage, mesh=layout.mesh, leaves=jax.tree_util.tree_unflatten(treedef, leaves),
              compute_dtype=jnp.dtype(dtypes.compute),
              grad_accum_dtype=jnp.dtype(dtypes.grad_accum),
              comm_dtype=jnp.dtype(dtypes.comm or dtypes.compute),
              reduce_scatter=comm.reduce_scatter, reduce_bucket_size=comm.reduce_bucket_size,
              gather_bucket_size=comm.gather_bucket_size, overlap_comm=comm.overlap_comm,
              zeropp=zeropp)


def _zeropp_leaf(leaf: LeafPlan, zeropp: ZeroPP, n: int) -> LeafPlan:
  """A stage-3 leaf with its ZeRO++ collectives chosen (see :mod:`jzero.sharding.zeropp`, "What
  stays plain"): block sizes come from the per-layer partition, the unit a scan or a gather unit
  moves."""
  if not leaf.grad_partitioned:
    return leaf
  layer_shape = leaf.padded_shape[1:] if leaf.stacked else leaf.padded_shape
  part = math.prod(layer_shape) // n  # elements per device per layer
  changes: dict[str, Any] = {}
  if leaf.param_partitioned:
    changes["secondary"] = zeropp.hpz > 1
    if zeropp.quantized_weights:  # blocks of one layer's partition
      group = quantization.weights(zeropp.quantized_weights).block(layer_shape, part)
      if group is not None:
        changes["gather"], changes["gather_group"] = zeropp.quantized_weights, group
  if zeropp.quantized_gradients:
    group = quantization.gradients(zeropp.quantized_gradients).block(layer_shape, part)
    if group is not None:
      changes["reduce"], changes["reduce_group"] = zeropp.quantized_gradients, group
  return dataclasses.replace(leaf, **changes)
