"""One order of cross-device collectives on every process: :func:`in_one_order`.

Why. Two processes pair collectives by the order each one issues them: gloo (XLA's CPU collectives
across processes) has no per-collective tag, so the n-th collective one process sends meets the
n-th the other receives. XLA's CPU runtime does not promise that order. Its thunk executor links
the collectives of a program only by *scheduling* edges (start after the previous one started),
and a ``while`` or ``conditional`` thunk whose body holds collectives -- a ``lax.scan`` over layers
or micro-batches, the ``lax.map`` that gathers a stack layer by layer, the ``lax.cond`` that skips
an overflowed step -- counts as started the moment its first iteration goes asynchronous. The
collectives after it then run beside the ones still inside it, in an order that depends on thread
timing: two processes pair different collectives, and gloo aborts (``Received data size doesn't
match expected size``) when their sizes differ or silently adds the wrong buffers when they match.
A gradient clip happened to hide it: its global-norm ``psum`` needs every gradient first.

What. :func:`in_one_order` wraps the per-device body of a ``shard_map`` so that every
collective-bearing operation -- a collective, or a loop / branch / call / remat region holding one
-- reads one element of the previous one's output through an identity that XLA cannot fold: a real
data dependency, which the runtime honours as an execution edge (wait for completion). The chain
runs in the traced program's order (the same on every process) at every level: the top of the body
and inside each loop body and branch. ``lax.optimization_barrier`` would not do: XLA's CPU compiler
expands it away before the runtime sees it.

The identity: ``t`` is one element of the previous output, ``z = float(t != t) * 0.0`` is +0.0 for
every value of ``t`` (NaN included) and XLA does not fold ``x * 0.0`` for floats; the next
collective's smallest input ``x`` becomes ``x - z`` (floats: bitwise ``x``, -0.0 and NaN kept),
``x + int(z)`` (integers) or ``x | bool(z)``. Cost: one pass over that input (usually a scalar, a
layer's partition or a gradient XLA fuses it into); ``bench/collective_order.py`` measures the step.

Where. Only programs compiled for CPU need it: a GPU runs one stream schedule per program, the same
on every process, so NCCL pairs collectives in program order (:func:`needed`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core

__all__ = ["in_one_order", "needed", "COLLECTIVES"]

# Primitives that communicate across devices (jax.lax's parallel operators and their async halves).
COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
    "all_gather_reduced", "reduce_scatter", "all_to_all", "ragged_all_to_all", "ppermute",
    "pbroadcast", "psend", "precv", "unreduced_psum", "unreduced_reduce_scatter",
    "psum_start", "psum_invariant_start", "all_gather_start", "all_gather_reduced_start",
    "reduce_scatter_start", "all_to_all_start", "ppermute_start", "pbroadcast_start",
    "unreduced_psum_start", "unreduced_reduce_scatter_start",
})


def needed(platform: str) -> bool:
  """Whether programs compiled for ``platform`` need their collectives chained (CPU only)."""
  return platform == "cpu"


def in_one_order(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` (a ``shard_map`` body) with its collectives chained into one order (module docstring).

  Same arguments, results and values, bit for bit: ``fn`` is traced to a jaxpr, the chain is
  inserted, and the jaxpr is evaluated in the caller's trace."""

  @functools.wraps(fn)
  def ordered(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    chained = core.ClosedJaxpr(_chain(closed.jaxpr), closed.consts)
    out = core.jaxpr_as_fun(chained)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return ordered


# -- the rewrite --------------------------------------------------------------------------------------
def _chain(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """``jaxpr`` with each collective-bearing equation made to read the previous one's output."""
  if not _has_collective(jaxpr):
    return jaxpr
  eqns, token = [], None
  for eqn in jaxpr.eqns:
    if not _bears_collective(eqn):
      eqns.append(eqn)
      continue
    eqn = eqn.replace(params={k: _chain_param(v) for k, v in eqn.params.items()})
    if token is not None:
      eqn = _read_after(eqn, token, eqns)
    eqns.append(eqn)
    token = _token_of(eqn) or token
  return jaxpr.replace(eqns=eqns)


def _chain_param(value: Any) -> Any:
  if isinstance(value, core.ClosedJaxpr):
    return value.replace(jaxpr=_chain(value.jaxpr))
  if isinstance(value, core.Jaxpr):
    return _chain(value)
  if isinstance(value, tuple) and any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
    return tuple(_chain_param(v) for v in value)
  return value


def _has_collective(jaxpr: core.Jaxpr) -> bool:
  return any(_bears_collective(e) for e in jaxpr.eqns)


def _bears_collective(eqn: core.JaxprEqn) -> bool:
  return (eqn.primitive.name in COLLECTIVES
          or any(_has_collective(j) for j in core.jaxprs_in_params(eqn.params)))


def _is_array_var(v: Any) -> bool:
  aval = getattr(v, "aval", None)
  return (isinstance(v, core.Var) and not isinstance(v, core.DropVar)
          and isinstance(aval, jax.core.ShapedArray) and aval.size > 0
          and (jnp.issubdtype(aval.dtype, jnp.floating) or jnp.issubdtype(aval.dtype, jnp.integer)
               or aval.dtype == jnp.bool_))


def _size(v: core.Var) -> tuple[int, int]:
  """Sort key: float vars first (their identity is the cheapest), then by element count."""
  return (0 if jnp.issubdtype(v.aval.dtype, jnp.floating) else 1, v.aval.size)


def _token_of(eqn: core.JaxprEqn) -> core.Var | None:
  """The output of a collective-bearing equation that the next one will read: the smallest,
  preferring outputs computed inside its region over ones its body only passes through."""
  outs = [v for v in eqn.outvars if _is_array_var(v)]
  forwarded = _forwarded_outputs(eqn)
  computed = [v for v in outs if v not in forwarded]
  pool = computed or outs
  return min(pool, key=_size) if pool else None


def _forwarded_outputs(eqn: core.JaxprEqn) -> set:
  """Outputs of a region that its body returns unchanged from an input (a loop's untouched carry):
  XLA may hoist those out of the region, so they would not wait for it."""
  bodies = core.jaxprs_in_params(eqn.params)
  if eqn.primitive.name == "while":
    bodies = [eqn.params["body_jaxpr"].jaxpr]
  forwarded = set()
  for body in bodies:
    if len(body.outvars) != len(eqn.outvars):
      continue
    inputs = set(v for v in body.invars if isinstance(v, core.Var))
    forwarded |= {out for out, inner in zip(eqn.outvars, body.outvars)
                  if not isinstance(inner, core.Var) or inner in inputs
                  or inner in set(body.constvars)}
  return forwarded


def _read_after(eqn: core.JaxprEqn, token: core.Var, eqns: list) -> core.JaxprEqn:
  """``eqn`` with its smallest array input replaced by an identity of it that reads ``token``
  (its equations appended to ``eqns``)."""
  candidates = [(i, v) for i, v in enumerate(eqn.invars) if _is_array_var(v)]
  if not candidates:
    return eqn
  strong = [c for c in candidates if not c[1].aval.weak_type] or candidates
  index, x = min(strong, key=lambda c: _size(c[1]))
  template = jax.make_jaxpr(_identity_after)(x.aval, token.aval).jaxpr
  assert not template.constvars, template
  rename = {template.invars[0]: x, template.invars[1]: token}
  for e in template.eqns:
    eqns.append(e.replace(invars=[rename.get(v, v) if isinstance(v, core.Var) else v
                                  for v in e.invars]))
  invars = list(eqn.invars)
  invars[index] = template.outvars[0]
  return eqn.replace(invars=invars)


def _identity_after(x: jax.Array, token: jax.Array) -> jax.Array:
  """``x``, bit for bit, computed from one element of ``token`` as well (module docstring)."""
  t = token.reshape(-1)[0] if token.ndim else token
  if not jnp.issubdtype(t.dtype, jnp.floating):
    t = t.astype(jnp.float32)
  zero = (t != t).astype(jnp.float32) * 0.0
  if jnp.issubdtype(x.dtype, jnp.floating):
    return x - zero.astype(x.dtype)
  if x.dtype == jnp.bool_:
    return x | zero.astype(jnp.bool_)
  return x + zero.astype(x.dtype)
