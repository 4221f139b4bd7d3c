"""A ZeRO parameter used as the array it stands for: every use gathers.

:class:`jzero.comm.zero_param.ZeroParam` is what a model holds in place of a parameter inside the
step. Where ZeRO-3 gathers it on purpose -- a gather unit's call, a layer of
:func:`jzero.scan_layers` -- the model sees the full array. Anywhere else (a tied LM head reading
``self.transformer.variables["params"]["wte"]["embedding"].T`` from another module, an NNX model
doing ``x @ self.embed.embedding.T``, a loss adding ``jnp.sum(p ** 2)``) the model holds the
ZeroParam itself, and :class:`ArrayBehaviour` makes it behave as the full array there:

* every ``jnp`` function (``__jax_array__``: ``jnp.asarray``, ``jnp.dot``, ``jnp.einsum`` ...),
  ``lax.convert_element_type`` and the arithmetic of jax arrays with it on the other side;
* Python's operators (``+ - * / // % ** @``, comparisons, bitwise, unary), on either side;
* indexing, ``len``, iteration, and every public method and property of ``jax.Array`` that is
  about the values (``.T``, ``.mT``, ``.reshape``, ``.astype``, ``.sum``, ``.at`` ...);
* ``shape``, ``dtype``, ``ndim``, ``size``, ``itemsize`` and ``nbytes`` of the array, without
  gathering (a shape-dependent branch never sees the partition).

Each use gathers once (``use()``: :meth:`jzero.comm.zero_param.ZeroParam.gather`, issued no
earlier than the last gather unit's inputs exist): an all-gather of the partition whose backward
reduce-scatters the use's gradient back into it (:func:`jzero.comm.collectives.gather`). A
parameter used twice -- a tied embedding read by its own unit for the lookup and by the LM head
through ``variables`` -- is gathered once per use, and its gradient is the sum of both uses'
reduce-scattered gradients, in its one partition: the same number a single device computes.

Where the gathered value lives for backward depends on where the use is:

* inside a gather unit or a scanned layer: in that rematerialised region (backward gathers again
  if it needs the value);
* anywhere else it is an ordinary value of the forward pass, which the operation using it keeps
  for backward if its gradient needs it (``h @ p.T``: one full copy of ``p`` from that use until
  its backward). For a tied LM head -- Hugging Face's ``self.lm_head.apply({"params": {"kernel":
  embedding.T}}, h)`` -- that is the loss alone: on GPT-2 small's shape compiled for 8 H100s,
  keeping it takes less memory than gathering it again in backward, as an untied head's unit
  does (``bench/tied_weights.py``, docs/coming-from-flax.md "Tied weights");
* a Linen module handed the ZeroParam itself as its own parameter
  (``nn.Dense(...).apply({"params": {"kernel": p}}, h)``) runs as a unit of its own
  (:mod:`jzero.modeling.gather_units`): flax needs the full array in a parameter's place.

``jax.lax`` primitives take arrays, not objects with ``__jax_array__`` (JAX 0.10 and later refuse
them with their own error): ``lax.dot_general(x, jnp.asarray(p), ...)``; ``jnp`` converts itself.
A ``jnp`` function that is itself jitted receives the ZeroParam as a pytree and gathers it inside.

What cannot work raises :class:`jzero.errors.JZeroError` naming the parameter's path and the fix:

* ``np.asarray`` / ``bool()`` / ``.item()`` of a parameter: inside the step it is a traced value,
  as every array under ``jit`` -- use ``jnp``, ``jnp.where`` or ``lax.cond``, and
  ``engine.logical_params(state)`` for its values outside the step;
* a ZeroParam kept past the pass that received it (a Python container, a module attribute) and
  used later: a parameter exists for its pass only (:func:`jzero.comm.zero_param.one_pass`).

Attributes of where an array is placed (``.sharding``, ``.device``, ``.addressable_shards`` ...)
are not forwarded: the parameter is not placed as one array (``getattr(p, "sharding", None)`` is
None).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import jax

from jzero.errors import JZeroError

__all__ = ["ArrayBehaviour"]

#: jax.Array's attributes about where an array is placed: a ZeroParam is not one placed array, so
#: these are not forwarded (``getattr(p, "sharding", None)`` is None) and do not gather.
_PLACEMENT = frozenset({
    "addressable_data", "addressable_shards", "committed", "copy_to_host_async", "delete",
    "device", "devices", "global_shards", "is_deleted", "is_fully_addressable",
    "is_fully_replicated", "on_device_size_in_bytes", "sharding", "to_device", "traceback",
    "unsafe_buffer_pointer", "block_until_ready", "format"})
#: What ``p.<name>`` forwards to the gathered array: jax.Array's public API (this JAX's).
_ARRAY_API = frozenset(n for n in dir(jax.Array) if not n.startswith("_")) - _PLACEMENT

_CONCRETE_FIX = ("inside the step every parameter is a traced value (as every array under jit): "
                 "use jnp in the model (jnp.asarray(p) gathers it; jnp.where / lax.cond for a "
                 "branch on values), and read its values outside the step with "
                 "engine.logical_params(state).")


#: What JAX raises when Python asks a traced value for a concrete one.
_NOT_CONCRETE = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                 jax.errors.TracerArrayConversionError)


def _full(x: Any) -> Any:
  return x.use() if isinstance(x, ArrayBehaviour) else x


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable, Callable]:
  def forward(self, other):
    return op(self.use(), _full(other))

  def reflected(self, other):
    return op(_full(other), self.use())

  return forward, reflected


def _unary(op: Callable[[Any], Any]) -> Callable:
  return lambda self: op(self.use())


class ArrayBehaviour:
  """What a :class:`~jzero.comm.zero_param.ZeroParam` does when used as an array (see the module
  docstring). A subclass defines ``use()`` (the full array for one use, differentiable),
  ``shape``, ``dtype`` and ``path`` (the parameter's '/'-joined path, or None)."""

  __slots__ = ()
  __array_ufunc__ = None  # numpy's operators defer to ours (a ufunc of it cannot work)
  path: str | None

  def use(self) -> jax.Array:
    """The full array for one use."""
    raise NotImplementedError

  # -- what it is, without gathering ---------------------------------------------------------------

  def what(self) -> str:
    """'the ZeRO-3 parameter <path>' for messages."""
    try:
      path = object.__getattribute__(self, "path")
    except AttributeError:
      path = None
    return f"the ZeRO-3 parameter {path!r}" if path else "a ZeRO-3 parameter"

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    size = 1
    for n in self.shape:
      size *= n
    return size

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def nbytes(self) -> int:
    return self.size * self.itemsize

  def __len__(self) -> int:
    if not self.shape:
      raise TypeError(f"len() of {self.what()}, a 0-d array")
    return self.shape[0]

  # -- every use gathers ---------------------------------------------------------------------------

  def __jax_array__(self):
    return self.use()

  def __getitem__(self, key):
    return self.use()[key]

  def __iter__(self):
    return iter(self.use())

  def __getattr__(self, name: str):
    if name in _ARRAY_API:
      return getattr(self.use(), name)
    if name.startswith("_"):
      raise AttributeError(name)
    placed = (" It is not placed as one array: where its partitions live is the engine's plan "
              "(engine.plan)." if name in _PLACEMENT else "")
    raise AttributeError(f"{type(self).__name__} ({self.what()}) has no attribute {name!r}; it "
                         f"behaves as the jax.Array it stands for.{placed}")

  __add__, __radd__ = _binary(operator.add)
  __sub__, __rsub__ = _binary(operator.sub)
  __mul__, __rmul__ = _binary(operator.mul)
  __matmul__, __rmatmul__ = _binary(operator.matmul)
  __truediv__, __rtruediv__ = _binary(operator.truediv)
  __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
  __mod__, __rmod__ = _binary(operator.mod)
  __divmod__, __rdivmod__ = _binary(divmod)
  __pow__, __rpow__ = _binary(operator.pow)
  __lshift__, __rlshift__ = _binary(operator.lshift)
  __rshift__, __rrshift__ = _binary(operator.rshift)
  __and__, __rand__ = _binary(operator.and_)
  __or__, __ror__ = _binary(operator.or_)
  __xor__, __rxor__ = _binary(operator.xor)
  __lt__, __gt__ = _binary(operator.lt)[0], _binary(operator.gt)[0]
  __le__, __ge__ = _binary(operator.le)[0], _binary(operator.ge)[0]
  __eq__, __ne__ = _binary(operator.eq)[0], _binary(operator.ne)[0]
  __hash__ = object.__hash__  # one object: hashable by identity, as a module attribute is
  __neg__, __pos__ = _unary(operator.neg), _unary(operator.pos)
  __abs__, __invert__ = _unary(operator.abs), _unary(operator.invert)

  # -- what cannot work ----------------------------------------------------------------------------

  def __array__(self, dtype=None, copy=None):
    raise JZeroError(f"numpy asked for the values of {self.what()} (np.asarray, np.array or a "
                     f"numpy function); {_CONCRETE_FIX}")

  def _concrete(self, convert: Callable[[Any], Any]) -> Any:
    try:
      return convert(self.use())
    except _NOT_CONCRETE as e:
      raise JZeroError(f"Python asked for the value of {self.what()} ({type(e).__name__}); "
                       f"{_CONCRETE_FIX}") from None

  def __bool__(self) -> bool:
    return self._concrete(bool)

  def __float__(self) -> float:
    return self._concrete(float)

  def __int__(self) -> int:
    return self._concrete(int)

  def __complex__(self) -> complex:
    return self._concrete(complex)

  def __index__(self) -> int:
    return self._concrete(operator.index)

  def item(self, *args):
    return self._concrete(lambda x: x.item(*args))

  def outlived(self) -> JZeroError:
    """The error for a parameter used after the pass that received it."""
    return JZeroError(
        f"{self.what()} was used after the forward/backward pass that received it (kept in a "
        f"Python container, a global or a module attribute and read later): inside the step a "
        f"parameter exists for its pass only. Read it again from the model each time it is "
        f"needed, inside loss_fn or the model's call; outside the step read its values with "
        f"engine.logical_params(state).")
