"""What tracing an optax transformation tells about it: :func:`traits`.

The step can run an optimizer's update in one of two views (:mod:`jzero.sharding.opt_layout`):
on each device's partition of the state, as DeepSpeed's optimizers run, or on whole arrays, with
XLA's SPMD partitioner inserting the collectives the update's reductions need. The partition view
gives the plain loop's numbers only for a transformation that is **elementwise**: every element of
every output is a function of the same element of its array inputs and of scalars (step counts,
learning rates), and nothing it computes depends on the arrays' shapes. Global-norm clipping,
factored moments (adafactor, sm3), trust ratios (lamb, lars, novograd), orthogonalisation (muon)
and a finiteness check over the tree (``apply_if_finite``) are not.

Whether a transformation is elementwise is read off its ``update`` traced on the parameters'
shapes (a jaxpr, no device work): every equation must be one of :data:`ELEMENTWISE`, a broadcast
of a scalar, or a computation on scalars alone; control flow (``cond``, nested jits, custom
derivatives) is looked into. The same update is traced a second time on other shapes (one
device's partitions) and must give the same equations and constants -- a constant derived from a
shape (``1 / numel``) is not elementwise either. Anything not recognised counts as not
elementwise: the whole view is always right, the partition view only faster.

The same trace says which parameters are **frozen**: those whose update is a constant zero
(``optax.set_to_zero`` under ``optax.multi_transform`` or ``optax.masked``). A frozen parameter
has no fp32 master and no gradient (:attr:`jzero.sharding.plan.LeafPlan.frozen`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.extend import core as jcore

from jzero.sharding.plan import flatten_paths

__all__ = ["ELEMENTWISE", "TxTraits", "traits"]

PyTree = Any

#: Primitives that compute each output element from the same element of their operands.
ELEMENTWISE = frozenset("""
abs acos acosh add asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p
cos cosh digamma div erf erf_inv erfc exp exp2 expm1 floor integer_pow is_finite lgamma log log1p
logistic max min mul neg nextafter pow reduce_precision rem round rsqrt select_n sign sin sinh sqrt
square sub tan tanh eq ne lt le gt ge and or not xor stop_gradient real imag conj
""".split())

#: Primitives whose work is in the jaxprs they carry (looked into).
_NESTED = frozenset("pjit jit closed_call core_call custom_jvp_call custom_vjp_call remat "
                    "checkpoint cond".split())


@dataclasses.dataclass(frozen=True)
class TxTraits:
  """What :func:`traits` found.

  Attributes:
    elementwise: the update may run on each device's partition (module docstring).
    coupling: why it may not (the first equation that couples elements, or "" when it may).
    frozen: paths of the parameters whose update is a constant zero.
  """

  elementwise: bool
  coupling: str = ""
  frozen: frozenset[str] = frozenset()


def traits(tx: optax.GradientTransformation, params: PyTree,
           partitions: PyTree | None = None) -> TxTraits:
  """Traces ``tx``'s init and update on ``params`` (ShapeDtypeStructs, the logical shapes) and,
  when given, on ``partitions`` (one device's partition shapes, same structure), and reads the
  two traces (module docstring). ``partitions`` None: the update would see the whole arrays in
  either view (nothing is partitioned), so it is elementwise for the step's purposes."""
  whole = _trace(tx, params)
  frozen = _frozen(whole, params)
  if partitions is None:
    return TxTraits(elementwise=True, frozen=frozen)
  coupling = _coupling(whole.jaxpr)
  if not coupling:
    local = _trace(tx, partitions)
    if _signature(whole.jaxpr) != _signature(local.jaxpr):
      coupling = "its constants or equations depend on the arrays' shapes"
  return TxTraits(elementwise=not coupling, coupling=coupling, frozen=frozen)


def _trace(tx: optax.GradientTransformation, params: PyTree) -> jcore.ClosedJaxpr:
  """The jaxpr of ``tx.update(grads, tx.init(params), params)``: its outputs are the updates'
  leaves, then the new state's; its inputs the gradients' leaves, then the params'."""
  def update(grads, params):
    return tx.update(grads, tx.init(params), params)
  return jax.make_jaxpr(update)(params, params)


def _scalar(v: Any) -> bool:
  return not np.shape(getattr(v, "aval", v))


def _coupling(jaxpr: Any) -> str:
  """The first equation of ``jaxpr`` (a Jaxpr or ClosedJaxpr) that is not elementwise, as text;
  "" when there is none."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if all(_scalar(v) for v in (*eqn.invars, *eqn.outvars)):
      continue  # a computation on scalars: step counts, schedules
    if name in ELEMENTWISE:
      continue
    if name == "broadcast_in_dim" and _scalar(eqn.invars[0]):
      continue
    if name in _NESTED:
      if name == "cond" and not _scalar(eqn.invars[0]):
        return "a cond on an array"
      for sub in jcore.jaxprs_in_params(eqn.params):
        if found := _coupling(sub):
          return found
      continue
    shapes = ", ".join(str(getattr(v, "aval", v)) for v in eqn.invars)
    return f"{name}({shapes})"
  return ""


def _signature(jaxpr: Any) -> list:
  """The equations' primitives and literal constants, recursively: what two traces on different
  shapes must share for the update to be independent of the shapes."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  out: list = []
  for eqn in jaxpr.eqns:
    literals = tuple(np.asarray(v.val).tobytes() for v in eqn.invars  # NaN equals NaN
                     if isinstance(v, jcore.Literal))
    out.append((eqn.primitive.name, literals))
    for sub in jcore.jaxprs_in_params(eqn.params):
      out.append(_signature(sub))
  return out


def _frozen(closed: jcore.ClosedJaxpr, params: PyTree) -> frozenset[str]:
  """Paths of the parameters whose update is a constant zero and whose gradient nothing the
  update returns depends on (a global norm over the tree before a ``multi_transform`` reads
  every gradient: none of them is frozen then)."""
  paths = list(flatten_paths(params))
  jaxpr, n = closed.jaxpr, len(paths)
  if len(jaxpr.outvars) < n or len(jaxpr.invars) != 2 * n:  # updates shaped otherwise: none known
    return frozenset()
  zero = [p for p, v in zip(paths, jaxpr.outvars[:n]) if _is_zero(v, jaxpr)]
  if not zero:
    return frozenset()
  read = _inputs_read(jaxpr)
  return frozenset(p for p in zero if not read[paths.index(p)])


def _inputs_read(jaxpr: Any) -> list[bool]:
  """Per input of ``jaxpr``: some output depends on it (nested jaxprs followed where there is
  one; elsewhere an equation's outputs depend on all its inputs)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  needed = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
  for eqn in reversed(jaxpr.eqns):
    if not any(v in needed for v in eqn.outvars):
      continue
    subs = list(jcore.jaxprs_in_params(eqn.params))
    operands = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if eqn.primitive.name in ("pjit", "jit", "closed_call") and len(subs) == 1:
      inner = getattr(subs[0], "jaxpr", subs[0])
      outs = [v in needed for v in eqn.outvars]
      inner_read = _inputs_read(_restricted(inner, outs))
      needed.update(v for v, r in zip(eqn.invars, inner_read)
                    if r and not isinstance(v, jcore.Literal))
    else:
      needed.update(operands)
  return [v in needed for v in jaxpr.invars]


def _restricted(jaxpr: Any, keep: list[bool]) -> Any:
  """``jaxpr`` with only the outputs ``keep`` marks (for :func:`_inputs_read`)."""
  return jaxpr.replace(outvars=[v for v, k in zip(jaxpr.outvars, keep) if k])


def _is_zero(v: Any, jaxpr: Any) -> bool:
  """``v`` is a zero constant in ``jaxpr``: a literal zero, or a broadcast or conversion of one
  (also inside a nested jit)."""
  if isinstance(v, jcore.Literal):
    return not np.any(np.asarray(v.val))
  producer = next((e for e in jaxpr.eqns if v in e.outvars), None)
  if producer is None:
    return False
  name = producer.primitive.name
  if name in ("broadcast_in_dim", "convert_element_type", "copy", "copy_p"):
    return _is_zero(producer.invars[0], jaxpr)
  if name in ("pjit", "jit", "closed_call"):
    inner = list(jcore.jaxprs_in_params(producer.params))
    if len(inner) == 1:
      inner = getattr(inner[0], "jaxpr", inner[0])
      out = inner.outvars[producer.outvars.index(v)]
      return _is_zero(out, inner)
  return False
