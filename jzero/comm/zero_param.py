""":class:`ZeroParam` is a parameter as the plan hands it to the model: ``gather()`` gives the full
parameter (through :func:`jzero.comm.collectives.gather` or :func:`~jzero.comm.collectives.attach`)
and the gradient comes back partitioned. It is a pytree whose children have the leaf's shape, so
``scan`` over a stack of them slices every layer; :mod:`jzero.modeling.layer_scan` and
:mod:`jzero.modeling.gather_units` decide *where* ``gather()`` runs on purpose (one layer of a
scan, one module call). Wherever else the model touches it, it behaves as the full array and each
use gathers (:mod:`jzero.comm.param_array`); it carries its leaf's path for the errors of what
cannot work.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Protocol

import jax
from jax import lax
from jax.extend.core import get_opaque_trace_state

from jzero.comm import collectives, zeropp
from jzero.comm.param_array import ArrayBehaviour
from jzero.errors import JZeroError

__all__ = ["PartitionSource", "Pass", "SlotTarget", "ZeroParam", "is_slot", "one_pass",
           "read_sources", "record_unit_inputs"]

Axes = tuple[str, ...]


class PartitionSource(Protocol):
  """Where a tier keeps a stage-3 partition between steps (static: part of a ZeroParam's tree
  structure). ``fetch(slot, stored)`` is the partition on the device, read from ``stored`` (the
  ZeroParam's child the tier gave it), in ``slot``'s shape, with ``slot`` receiving its gradient.
  A source class may also define ``fetch_many(sources, slots, stored) -> tuple``: several of its
  leaves read at once (:func:`read_sources`)."""

  def fetch(self, slot: jax.Array, stored: Any) -> jax.Array:
    ...


class SlotTarget(abc.ABC):
  """What the step differentiates for a leaf whose gradient a tier takes somewhere else as the
  backward produces it (a subclass: :class:`jzero.tiers.host_step.HostSlot`): a pytree whose
  :meth:`zero_param_args` are the leaf's :class:`ZeroParam`'s ``partition``, ``stored`` and
  ``source``, so the slot travels with the parameter (a scan over layers slices it with the
  rest). Its gradient is the reduced one, where the tier put it: the step reduces it no further."""

  @abc.abstractmethod
  def zero_param_args(self, value: jax.Array | None) -> dict:
    """``partition``, ``stored`` and ``source`` for the ZeroParam of a leaf whose device value
    is ``value`` (a stage-3 partition) or None (a replicated parameter's gradient slot)."""

  # gradient accumulation (the step's scan over micro-batches): the slot's gradient summed where
  # the tier keeps it
  @abc.abstractmethod
  def accumulator(self, dtype: Any) -> SlotTarget:
    """A zero sum of this slot's gradients, accumulated in ``dtype`` (called on the abstract
    shape of one micro-batch's gradient)."""

  @abc.abstractmethod
  def add(self, micro: SlotTarget) -> SlotTarget:
    """This sum plus one micro-batch's gradient."""

  @abc.abstractmethod
  def summed(self) -> SlotTarget:
    """The finished sum, with what the step reads from it (its sum of squares) made for the
    sum rather than for a micro-batch."""


def is_slot(x: Any) -> bool:
  """``x`` is a :class:`SlotTarget` (the ``is_leaf`` of a gradient tree that may hold slots)."""
  return isinstance(x, SlotTarget)


@dataclasses.dataclass(eq=False)
class ZeroParam(ArrayBehaviour):
  """One parameter as the ZeRO plan hands it to the model.

  ``gather()`` gives the full parameter for compute; its gradient flows back partitioned over the
  ZeRO axes. Two kinds:

  * partitioned (stage 3): holds this device's ``partition``; ``gather()`` all-gathers it and the
    backward reduce-scatters the gradient into it (:func:`jzero.comm.collectives.gather`).
  * replicated with a partitioned gradient (stage 2, stage-3 persistent leaves): holds the
    ``full`` parameter and a zero ``partition``-shaped gradient slot; ``gather()`` returns the
    parameter and the backward reduce-scatters its gradient into the slot
    (:func:`jzero.comm.collectives.attach`).

  With ZeRO++ (:mod:`jzero.comm.zeropp`) it also carries the leaf's static ``comm`` (how its gather
  and reduction move bytes) and, with hpZ, its ``secondary`` partition, which ``gather()`` reads
  instead of the partition.

  When a tier keeps the partition somewhere else (host memory, :mod:`jzero.tiers.host_params`;
  NVMe, :mod:`jzero.tiers.nvme_params`) it carries the tier's static ``source``
  (:class:`PartitionSource`) and the ``stored`` child the source reads from (the host partition;
  the stack's layer indices, which the scan slices with the rest): ``partition`` is then a zero
  gradient slot on the device, and ``gather()`` reads the partition through ``source.fetch``
  first (its gradient lands in the slot).

  It is a pytree node whose children are the arrays, so ``lax.scan`` over a stack of them slices
  every layer while the static facts (a negative ``dim``, its logical size ``dim_size``, the
  ``axes``, the leaf's '/'-joined ``path`` for messages, the :class:`Pass` it was made for) stay
  valid for the sliced layer. It
  behaves as the array it stands for (:class:`~jzero.comm.param_array.ArrayBehaviour`): ``shape``,
  ``dtype`` and ``ndim`` without gathering; ``jnp`` functions, operators, ``.T``, ``.reshape``,
  indexing and the rest of ``jax.Array``'s methods gather, once per use.
  """

  partition: jax.Array
  dim: int
  dim_size: int
  axes: Axes
  comm_dtype: Any = None
  full: jax.Array | None = None
  scatter: bool = True
  secondary: jax.Array | None = None
  comm: Any = None
  source: PartitionSource | None = None
  stored: Any = None
  path: str | None = None
  pass_: Pass | None = None
  rank: int | None = None  # the partition's rank as made: a scan over a stack slices one axis off

  def __post_init__(self):
    if self.pass_ is None:
      self.pass_ = _PASS.get()
    if self.rank is None:
      self.rank = self.partition.ndim
    elif self.partition.ndim < self.rank and self.dim % self.rank < self.rank - self.partition.ndim:
      raise self.sliced_on_its_shard_axis()

  def sliced_on_its_shard_axis(self) -> JZeroError:
    """The error for a partition a transformation slices on the axis ZeRO-3 splits it on (a
    stack of layers run by ``nnx.scan`` or ``lax.scan`` without ``stacked_layers``)."""
    top = (self.path or "?").split("/")[0]
    return JZeroError(
        f"{self.path or 'a parameter'} is run one slice of its leading axis at a time (its layers "
        f"stacked and run by nnx.scan, nnx.vmap or jax.lax.scan), and that axis is the one ZeRO-3 "
        f"partitions it on, so no device holds a whole layer's slice. Tell jzero which parameters "
        f"are stacked layers: jzero.initialize(..., stacked_layers=\"{top}\") (the path of the "
        f"stacked subtree; several as a list) -- each layer is then partitioned on another axis "
        f"and gathered as the scan reaches it.")

  def with_partition(self, partition: jax.Array) -> "ZeroParam":
    """This parameter with ``partition`` as its partition, read already (no ``source``)."""
    return dataclasses.replace(self, partition=partition, source=None, stored=None)

  @property
  def partitioned(self) -> bool:
    """True for a stage-3 partition, False for a replicated parameter with a gradient slot."""
    return self.full is None

  @property
  def shape(self) -> tuple[int, ...]:
    if self.full is not None:
      return tuple(self.full.shape)
    shape = list(self.partition.shape)
    shape[self.dim] = self.dim_size
    return tuple(shape)

  @property
  def dtype(self):
    return (self.partition if self.full is None else self.full).dtype

  def gather(self) -> jax.Array:
    """The full parameter (see the class docstring for what its backward does)."""
    try:
      return self._gather()
    except jax.errors.UnexpectedTracerError:
      raise self.outlived() from None
    except NameError as e:  # the ZeRO axes are bound inside the step's shard_map only
      if "unbound axis name" not in str(e):
        raise
      raise self.outlived() from None

  def use(self) -> jax.Array:
    """The full parameter for a use as an array outside the gathers the model arranges (what
    :class:`~jzero.comm.param_array.ArrayBehaviour` calls): ``gather()``, issued no earlier than
    the inputs of the gather unit run last at this trace level exist (:func:`record_unit_inputs`),
    so a scheduler that issues collectives as early as it can -- XLA's CPU backend does -- does not
    hold the full parameter from the start of the pass."""
    if self.pass_ is not None and self.pass_.over:
      raise self.outlived()
    last = _LAST_UNIT.get()
    if self.full is not None or last is None or last[0] != get_opaque_trace_state(
        convention="nnx"):
      return self.gather()
    children, treedef = jax.tree.flatten(self)
    children, _ = lax.optimization_barrier((children, last[1]))
    return jax.tree.unflatten(treedef, children).gather()

  def _gather(self) -> jax.Array:
    partition = self.partition
    if self.source is not None:  # a tier keeps the partition: read it onto the device first
      partition = self.source.fetch(self.partition, self.stored)
    if self.comm is not None:  # ZeRO++: quantized / hierarchical collectives
      if self.full is None:
        return zeropp.gather(partition, self.secondary, self.dim, self.dim_size, self.comm,
                             self.comm_dtype)
      return zeropp.attach(self.full, partition, self.dim, self.comm)
    if self.full is None:
      return collectives.gather(partition, self.dim, self.dim_size, self.axes, self.comm_dtype)
    return collectives.attach(self.full, partition, self.dim, self.axes, scatter=self.scatter)

  def __repr__(self):
    kind = "partition" if self.full is None else "full + gradient slot"
    return f"ZeroParam({self.path or '?'}: {kind}, shape={self.shape}, dim={self.dim})"


class Pass:
  """One forward/backward pass of the model over the parameters :func:`one_pass` hands it (static:
  part of every ZeroParam's tree structure, compared by identity). ``over`` once the pass is."""

  __slots__ = ("over",)

  def __init__(self):
    self.over = False


_PASS: contextvars.ContextVar[Pass | None] = contextvars.ContextVar("jzero_pass", default=None)


@contextlib.contextmanager
def one_pass() -> Iterator[Pass]:
  """The ZeroParams made inside belong to one pass of the model; used after it, they raise an
  error naming their path (JAX would reject the program only when it runs, naming a tracer)."""
  current = Pass()
  token = _PASS.set(current)
  try:
    yield current
  finally:
    current.over = True
    _PASS.reset(token)


_LAST_UNIT: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "jzero_last_unit", default=None)


def record_unit_inputs(arrays: Any) -> Any:
  """Records ``arrays`` as the inputs of the gather unit starting now at this trace level and
  returns those of the unit started before it at the same level (None if none): with prefetch a
  unit's gather waits for them (:mod:`jzero.modeling.gather_units`), and :meth:`ZeroParam.use`
  waits for the last unit's."""
  here = get_opaque_trace_state(convention="nnx")
  previous = _LAST_UNIT.get()
  _LAST_UNIT.set((here, arrays))
  return previous[1] if previous is not None and previous[0] == here else None


def read_sources(params: list) -> list:
  """Items of ``params`` (ZeroParams and anything else) with the partitions of every source class
  that reads several leaves at once (``fetch_many``) read together, one read per class: the
  gather of a group (:func:`jzero.modeling.layer_scan.gather`) pays one read, not one per leaf.
  Each read value's gradient still goes to its slot; other items are returned as they are."""
  out = list(params)
  by_kind: dict[type, list[int]] = {}
  for i, p in enumerate(params):
    if isinstance(p, ZeroParam) and hasattr(type(p.source), "fetch_many"):
      by_kind.setdefault(type(p.source), []).append(i)
  for kind, index in by_kind.items():
    if len(index) < 2:
      continue
    group = [params[i] for i in index]
    values = kind.fetch_many(tuple(p.source for p in group), tuple(p.partition for p in group),
                             tuple(p.stored for p in group))
    for i, p, v in zip(index, group, values):
      out[i] = p.with_partition(v)
  return out


_CHILDREN = ("partition", "full", "secondary", "stored")
_STATIC = ("dim", "dim_size", "axes", "comm_dtype", "scatter", "comm", "source", "path", "pass_",
           "rank")


def _flatten_with_keys(param: ZeroParam) -> tuple[tuple, tuple]:
  children, static = _flatten(param)
  return tuple(zip(map(jax.tree_util.GetAttrKey, _CHILDREN), children)), static


def _flatten(param: ZeroParam) -> tuple[tuple, tuple]:
  # A parameter flattened after its pass is over -- e.g. kept past the pass and handed to a jnp
  # function's own jit -- gets jzero's error, not JAX's leaked-tracer one.
  if param.pass_ is not None and param.pass_.over:
    raise param.outlived()
  return tuple(getattr(param, n) for n in _CHILDREN), tuple(getattr(param, n) for n in _STATIC)


def _unflatten(static: tuple, children: tuple) -> ZeroParam:
  return ZeroParam(**dict(zip(_STATIC, static)), **dict(zip(_CHILDREN, children)))


jax.tree_util.register_pytree_with_keys(ZeroParam, _flatten_with_keys, _unflatten, _flatten)
