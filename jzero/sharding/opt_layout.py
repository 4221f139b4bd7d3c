"""Where an optimizer's state lives and what its update sees: :class:`OptLayout`.

**Two views of the update** (:class:`View`). The fp32 master is stored partitioned over the ZeRO
axes, each leaf zero-padded on its shard dimension to a multiple of the ZeRO size
(:mod:`jzero.sharding.plan`). An optax transformation can see it in one of two ways:

* ``PARTITION``: inside the step's ``shard_map``, each device's partition as it is stored -- what
  DeepSpeed's optimizers see, and what jzero's update has always run on. It is right for an
  elementwise transformation (:mod:`jzero.sharding.tx_traits` reads that off the update) and
  costs nothing: the state was created from the same partitions.
* ``WHOLE``: outside the ``shard_map``, on whole arrays of the parameters' logical shapes -- the
  plain loop's view. The master, the gradient and every state leaf laid out like a parameter are
  cut to their logical shape before the update (the padding dropped) and padded after it, each
  kept on its partitioned sharding, and XLA's SPMD partitioner inserts the collectives the
  update's reductions need (a global norm's all-reduce, a factored moment's row sums). Any
  transformation gives the plain loop's numbers in this view.

A plan's transformation gets the partition view when it is elementwise, the whole view otherwise
(:meth:`OptLayout.of`). At stage 0 nothing is partitioned and both views are one.

**The state's layout.** The state is created by the transformation's own ``init`` on the view's
parameters. A state leaf whose key path ends with a parameter's and whose shape is that
parameter's (in the view) is that parameter's *twin* -- Adam's moments, a momentum, an
accumulated gradient -- and is stored exactly as the master is: partitioned and padded, in the
memory kind of the parameter's state tier. Every other leaf is stored in its own shape on the
device: split over the ZeRO axes on its largest dimension the ZeRO size divides when it has at
least :data:`SPLIT_MIN_NUMEL` elements (adafactor's factored rows and columns, a muon or sm3
statistic), replicated otherwise (step counts, small vectors). :meth:`OptLayout.bytes_per_device`
says which leaves are which, with their bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jzero.sharding.plan import LeafPlan, Plan, path_str
from jzero.sharding.tx_traits import TxTraits, traits

__all__ = ["SPLIT_MIN_NUMEL", "OptLayout", "StateLeaf", "View", "partition_shapes", "tx_traits_of"]

PyTree = Any

#: A state leaf that is no parameter's twin is split over the ZeRO axes from this many elements on
#: (when a dimension divides); a smaller one is replicated.
SPLIT_MIN_NUMEL = 4096


class View(enum.Enum):
  """The arrays an optimizer's update sees (module docstring)."""

  PARTITION = "partition"
  WHOLE = "whole"


@dataclasses.dataclass(frozen=True)
class StateLeaf:
  """One leaf of an optimizer's state.

  Attributes:
    path: its '/'-joined key path in the state.
    shape: its shape as the update sees it (the view's).
    dtype: its dtype.
    twin: the parameter it is laid out like (stored as the master is), or None.
    split_dim: a leaf that is no twin: the dimension split over the ZeRO axes, or None
      (replicated).
  """

  path: str
  shape: tuple[int, ...]
  dtype: Any
  twin: LeafPlan | None = None
  split_dim: int | None = None

  @property
  def numel(self) -> int:
    return math.prod(self.shape)


def partition_shapes(plan: Plan) -> PyTree:
  """ShapeDtypeStructs of one device's partition of each fp32 master leaf (the partition view's
  shapes)."""
  n = plan.mesh.zero_size
  def local(leaf: LeafPlan):
    shape = list(plan.state_shape(leaf))
    if leaf.state_partitioned:
      shape[leaf.shard_dim] //= n
    return jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
  return plan.map(local)


@dataclasses.dataclass(frozen=True, eq=False)
class OptLayout:
  """The layout of a transformation's state over a plan and the view its update runs in (module
  docstring). Make it with :meth:`of`."""

  plan: Plan
  view: View
  traits: TxTraits
  treedef: Any
  leaves: tuple[StateLeaf, ...]

  @classmethod
  def of(cls, plan: Plan, tx: optax.GradientTransformation,
         found: TxTraits | None = None) -> OptLayout:
    """The layout of ``tx``'s state over ``plan``: the partition view when ``tx`` is
    elementwise (``found``: its :func:`jzero.sharding.tx_traits.traits`, traced here when
    None), else the whole view."""
    if found is None:
      found = tx_traits_of(plan, tx)
    layout = cls._made(plan, tx, found, View.PARTITION if found.elementwise else View.WHOLE)
    if layout.view is View.PARTITION and any(l.twin is None and l.shape for l in layout.leaves):
      # a state array laid out like no parameter: a device's partition has no part of it
      layout = cls._made(plan, tx, found, View.WHOLE)
    return layout

  @classmethod
  def _made(cls, plan: Plan, tx: optax.GradientTransformation, found: TxTraits,
            view: View) -> OptLayout:
    abstract = jax.eval_shape(tx.init, _view_params(plan, view))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    by_path = _param_paths(plan)
    leaves = []
    for keys, x in flat:
      shape = tuple(np.shape(x))
      twin = _twin_of(keys, shape, by_path, plan, view)
      split = None if twin is not None else _split_dim(shape, plan)
      leaves.append(StateLeaf(path=path_str(keys), shape=shape, dtype=x.dtype, twin=twin,
                              split_dim=split))
    return cls(plan=plan, view=view, traits=found, treedef=treedef, leaves=tuple(leaves))

  # -- the stored state ----------------------------------------------------------------------
  def _tree(self, values: list) -> PyTree:
    return jax.tree.unflatten(self.treedef, values)

  def spec(self, leaf: StateLeaf) -> P:
    """A state leaf's PartitionSpec as stored."""
    if leaf.twin is not None:
      return self.plan.state_spec(leaf.twin)
    if leaf.split_dim is None:
      return P()
    spec: list[Any] = [None] * len(leaf.shape)
    axes = self.plan.mesh.zero_axes
    spec[leaf.split_dim] = axes[0] if len(axes) == 1 else axes
    return P(*spec)

  def specs(self) -> PyTree:
    """PartitionSpecs of the stored state (the state's structure)."""
    return self._tree([self.spec(l) for l in self.leaves])

  def leaf_kind(self, leaf: StateLeaf) -> str | None:
    """A state leaf's memory kind as stored: a twin's follows its parameter's state tier (a 0-d
    one stays on the device); the others are on the device."""
    if leaf.twin is not None and leaf.shape:
      return self.plan.state_memory_kind(leaf.twin)
    return self.plan.memory_kind()

  def memory_kinds(self) -> PyTree:
    """Memory kinds of the stored state (:meth:`leaf_kind`)."""
    return self._tree([self.leaf_kind(l) for l in self.leaves])

  def stored_shape(self, leaf: StateLeaf) -> tuple[int, ...]:
    """A state leaf's global shape as stored (a twin: padded like the master)."""
    return self.plan.state_shape(leaf.twin) if leaf.twin is not None else leaf.shape

  def twins(self) -> PyTree:
    """The state's structure with each twin's parameter (a LeafPlan) and None elsewhere."""
    return self._tree([l.twin for l in self.leaves])

  def bytes_per_device(self) -> dict[str, int]:
    """One device's bytes of the stored state: "partitioned" (twins and split leaves),
    "replicated" (the others)."""
    n = self.plan.mesh.zero_size
    out = {"partitioned": 0, "replicated": 0}
    for leaf in self.leaves:
      nbytes = math.prod(self.stored_shape(leaf)) * np.dtype(leaf.dtype).itemsize
      split = (leaf.twin.state_partitioned if leaf.twin is not None
               else leaf.split_dim is not None)
      out["partitioned" if split else "replicated"] += nbytes // n if split else nbytes
    return out

  # -- the view, inside a jit (the whole view: at the jit's level, on global arrays) ----------
  def _constrain(self, x: jax.Array, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self.plan.sharding(spec))

  def params_to_view(self, tree: PyTree) -> PyTree:
    """A tree in the state layout (master, gradients) as the update sees it."""
    if self.view is View.PARTITION:
      return tree
    plan = self.plan
    return plan.map(lambda l, x: self._constrain(l.to_logical(x), plan.state_spec(l)), tree)

  def params_from_view(self, tree: PyTree) -> PyTree:
    """The update's params-structured result back in the state layout."""
    if self.view is View.PARTITION:
      return tree
    plan = self.plan
    return plan.map(lambda l, x: self._constrain(l.to_padded(x), plan.state_spec(l)), tree)

  def state_to_view(self, state: PyTree) -> PyTree:
    """The stored state as the update sees it (twins cut to their logical shapes)."""
    if self.view is View.PARTITION:
      return state
    return self._tree([self._constrain(leaf.twin.to_logical(x), self.spec(leaf))
                       if leaf.twin is not None else x
                       for leaf, x in zip(self.leaves, self.treedef.flatten_up_to(state))])

  def state_from_view(self, state: PyTree) -> PyTree:
    """The update's new state as stored (twins padded), each leaf on its sharding."""
    if self.view is View.PARTITION:
      return state
    return self._tree([self._constrain(leaf.twin.to_padded(x) if leaf.twin is not None else x,
                                       self.spec(leaf))
                       for leaf, x in zip(self.leaves, self.treedef.flatten_up_to(state))])

  def map_twins(self, fn: Callable[[jax.Array, jax.Array], jax.Array], state: PyTree,
                params: PyTree) -> PyTree:
    """``state`` with ``fn(x, p)`` applied to each twin ``x`` (``p``: its parameter's leaf of
    ``params``, a params-structured tree); the other leaves as they are."""
    by_path = {l.path: x for l, x in zip(self.plan.leaf_list(), self.plan.flat(params))}
    return self._tree([fn(x, by_path[leaf.twin.path]) if leaf.twin is not None else x
                       for leaf, x in zip(self.leaves, self.treedef.flatten_up_to(state))])


def tx_traits_of(plan: Plan, tx: optax.GradientTransformation) -> TxTraits:
  """:func:`jzero.sharding.tx_traits.traits` of ``tx`` on ``plan``'s parameters: their logical
  shapes against one device's partitions (None at stage 0, where nothing is partitioned)."""
  logical = plan.map(lambda l: jax.ShapeDtypeStruct(l.shape, jnp.float32))
  split = any(l.state_partitioned for l in plan.leaf_list())
  return traits(tx, logical, partition_shapes(plan) if split else None)


def _view_params(plan: Plan, view: View) -> PyTree:
  """ShapeDtypeStructs of the params the update sees, global shapes: the state layout
  (partition view) or the logical shapes (whole view)."""
  if view is View.PARTITION:
    return plan.abstract_master()
  return plan.map(lambda l: jax.ShapeDtypeStruct(l.shape, jnp.float32))


def _param_paths(plan: Plan) -> list[tuple[tuple, LeafPlan]]:
  """(key path, LeafPlan) of every parameter, longest path first."""
  flat = jax.tree_util.tree_flatten_with_path(plan.leaves,
                                              is_leaf=lambda x: isinstance(x, LeafPlan))[0]
  return sorted(((tuple(k), leaf) for k, leaf in flat), key=lambda kv: -len(kv[0]))


def _twin_of(keys: tuple, shape: tuple[int, ...], by_path: list, plan: Plan,
             view: View) -> LeafPlan | None:
  """The parameter a state leaf at ``keys`` of ``shape`` is laid out like: the longest parameter
  path its key path ends with, when the shapes agree in the view."""
  keys = tuple(keys)
  for pkeys, leaf in by_path:
    if len(pkeys) <= len(keys) and keys[len(keys) - len(pkeys):] == pkeys:
      expected = plan.state_shape(leaf) if view is View.PARTITION else leaf.shape
      return leaf if shape == tuple(expected) else None
  return None


def _split_dim(shape: tuple[int, ...], plan: Plan) -> int | None:
  """The dimension a state leaf that is no twin is split on (module docstring), or None."""
  n = plan.mesh.zero_size
  if n <= 1 or math.prod(shape) < SPLIT_MIN_NUMEL:
    return None
  dims = [d for d in range(len(shape)) if shape[d] % n == 0]
  return max(dims, key=lambda d: (shape[d], -d)) if dims else None
