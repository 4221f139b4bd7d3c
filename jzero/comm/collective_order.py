"""Collectives across CPU processes that every process runs alike: :func:`in_one_order`.

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
and inside each loop body and branch. ``lax.optimization_barrier`` would not do: it passes each
value through on its own, so nothing waits for the values it is grouped with.

The identity: ``t`` is one element of the previous output (an integer's bits read as a float: XLA
folds ``i != i`` for integers, also through a lossless convert); ``w = t * 0.0`` is +-0.0 or NaN
(XLA does not fold ``t * 0.0`` for floats), ``z = -0.0 if w != w else -|w|`` is -0.0 whatever
``t`` is, and XLA cannot know it; the input ``x`` becomes ``x + int(z)`` (integers; a float
``x`` on its bits, since float arithmetic on CPU flushes subnormals) or ``x | (z != 0)``: the
same bits, NaN payloads and subnormals included. (An
arithmetic XLA can see through -- ``float(t != t) * 0``, a full-size dynamic slice -- is folded
away and orders nothing.) Cost: one pass over that input (usually a scalar, a
layer's partition or a gradient XLA fuses it into); ``bench/collective_order.py`` measures the step.

No reduce-scatter. XLA's CPU reduce-scatter across processes is gloo's
``ReduceScatterHalvingDoubling``, which races with itself: a rank starts sending part of its buffer
to its peer and, once it has received and reduced the peer's part, copies its own result over the
start of that buffer without waiting for its send to complete. A send that did not fit the socket
at once still has its tail there, so the peer adds the overwritten tail (measured with two
processes and a [1024, 256] fp32 gradient: in some runs the last 118 elements of process 0's
partition were its own gradient plus process 1's *result*, not process 1's gradient; the smaller
leaves never raced). :func:`in_one_order` therefore replaces every reduce-scatter
(``lax.psum_scatter``) by what it computes, with the same bytes on the wire: an all-to-all (gloo
send / receive, waited for), then each device sums the slices it received.

Where. Only programs over the CPU devices of several processes need it (:func:`needed`): within one
process the CPU runtime pairs collectives by id and reduce-scatters in memory, and a GPU runs one
stream schedule per program, the same on every process, so NCCL pairs collectives in program order.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core

__all__ = ["in_one_order", "needed", "identity_after", "COLLECTIVES"]

# Primitives that communicate across devices (jax.lax's parallel operators and their async halves).
COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
    "all_gather_reduced", "reduce_scatter", "all_to_all", "ragged_all_to_all", "ppermute",
    "pbroadcast", "psend", "precv", "unreduced_psum", "unreduced_reduce_scatter",
    "psum_start", "psum_invariant_start", "all_gather_start", "all_gather_reduced_start",
    "reduce_scatter_start", "all_to_all_start", "ppermute_start", "pbroadcast_start",
    "unreduced_psum_start", "unreduced_reduce_scatter_start",
})


def needed(mesh: jax.sharding.Mesh) -> bool:
  """Whether programs over ``mesh`` need their collectives chained: CPU devices of more than one
  process. (Within one process XLA's CPU collectives meet at a rendezvous keyed by the collective's
  id, so running them at once cannot pair the wrong ones; the chain would only constrain the
  schedule -- in stage 3 it keeps gathered layers alive longer.)"""
  devices = mesh.devices.flat
  return devices[0].platform == "cpu" and len({d.process_index for d in mesh.devices.flat}) > 1


def in_one_order(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` (a ``shard_map`` body) with its collectives chained into one order and its
  reduce-scatters done as all-to-all + a local sum (module docstring).

  Same arguments and results: ``fn`` is traced to a jaxpr, rewritten, and the jaxpr is evaluated in
  the caller's trace. The chain keeps every value bit for bit; a reduce-scatter's sum is the same
  up to the order of its terms (exactly the same with two)."""

  @functools.wraps(fn)
  def ordered(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    chained = core.ClosedJaxpr(_chain(_without_reduce_scatter(closed.jaxpr)), closed.consts)
    out = core.jaxpr_as_fun(chained)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return ordered


# -- the rewrite -----------------------------------------------------------------------------------
def _chain(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """``jaxpr`` with each collective-bearing equation made to wait for the previous one's output."""
  if not _has_collective(jaxpr):
    return jaxpr
  eqns, tokens = [], []
  for eqn in jaxpr.eqns:
    if not _bears_collective(eqn):
      eqns.append(eqn)
      continue
    eqn = eqn.replace(params={k: _map_jaxprs(_chain, v) for k, v in eqn.params.items()})
    if tokens:
      eqn = _read_after(eqn, tokens, eqns)
    eqns.append(eqn)
    tokens = _exit_tokens(eqn) or tokens
  return jaxpr.replace(eqns=eqns)


def _map_jaxprs(rewrite: Callable[[core.Jaxpr], core.Jaxpr], value: Any) -> Any:
  """An equation parameter with ``rewrite`` applied to the jaxprs it holds (a loop's body, a
  cond's branches, a call's jaxpr); any other parameter unchanged."""
  if isinstance(value, core.ClosedJaxpr):
    return value.replace(jaxpr=rewrite(value.jaxpr))
  if isinstance(value, core.Jaxpr):
    return rewrite(value)
  if isinstance(value, tuple) and any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
    return tuple(_map_jaxprs(rewrite, v) for v in value)
  return value


def _has_collective(jaxpr: core.Jaxpr) -> bool:
  return any(_bears_collective(e) for e in jaxpr.eqns)


def _bears_collective(eqn: core.JaxprEqn) -> bool:
  return (eqn.primitive.name in COLLECTIVES
          or any(_has_collective(j) for j in list(core.jaxprs_in_params(eqn.params))))


# -- reduce-scatter as all-to-all -----------------------------------------------------------------
def _without_reduce_scatter(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """``jaxpr`` with every reduce-scatter, at every level, replaced by
  :func:`_reduce_scatter_by_all_to_all` (module docstring: gloo's reduce-scatter races)."""
  if not _has_collective(jaxpr):
    return jaxpr
  eqns = []
  for eqn in jaxpr.eqns:
    eqn = eqn.replace(params={k: _map_jaxprs(_without_reduce_scatter, v)
                              for k, v in eqn.params.items()})
    if eqn.primitive.name == "reduce_scatter" and eqn.params["axis_index_groups"] is None:
      params = {k: eqn.params[k] for k in ("axis_name", "scatter_dimension", "axis_size", "tiled")}
      _inline(functools.partial(_reduce_scatter_by_all_to_all, **params), eqn.invars, eqns,
              eqn.outvars)
    else:
      eqns.append(eqn)
  return jaxpr.replace(eqns=eqns)


def _reduce_scatter_by_all_to_all(x: jax.Array, *, axis_name: Any, scatter_dimension: int,
                                  axis_size: int, tiled: bool) -> jax.Array:
  """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)``: device i receives
  every device's i-th slice of ``x`` (one all-to-all, the bytes of a reduce-scatter) and sums
  them."""
  d = scatter_dimension
  if tiled:
    x = x.reshape(x.shape[:d] + (axis_size, x.shape[d] // axis_size) + x.shape[d + 1:])
  return lax.all_to_all(x, axis_name, d, d, tiled=False).sum(d)


# -- which inputs a region's first collective waits for, which outputs its last one feeds ----------
#
# XLA inlines calls (jit, remat, custom derivatives, nested shard_map) into their caller, and may
# inline a loop that runs once, so a dependency on *some* input of a region does not make the
# collectives inside it wait. The chain therefore enters a region through an input its first
# collective really reads (:func:`_entry_inputs`) and leaves it through the outputs its last
# collective really feeds (:func:`_exit_tokens`). "Really" is a precise data-flow analysis
# (:func:`_flow`), which never claims a dependency that is not there.


def _bodies(eqn: core.JaxprEqn) -> list[tuple[core.Jaxpr, Callable[[int], int], int]]:
  """(body, body input index -> equation input index, number of body outputs that are equation
  outputs, in order) for each body that runs when ``eqn`` runs; [] for an unknown region."""
  name, params = eqn.primitive.name, eqn.params
  if name == "while":
    n = params["cond_nconsts"]
    return [(params["body_jaxpr"].jaxpr, lambda j, n=n: j + n, len(eqn.outvars))]
  if name == "cond":
    return [(b.jaxpr, lambda j: j + 1, len(eqn.outvars)) for b in params["branches"]]
  out = []
  for body in list(core.jaxprs_in_params(params)):
    if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
      out.append((body, lambda j: j, len(eqn.outvars)))
  return out[:1]


def _flow(jaxpr: core.Jaxpr, sources: dict) -> dict:
  """{var: frozenset of source labels it depends on} through ``jaxpr`` from ``sources`` (var ->
  frozenset of labels: its inputs, or the outputs of one of its equations). Precise through
  regions; a plain primitive's outputs read all inputs."""
  env = dict(sources)
  get = lambda v: env.get(v, frozenset()) if isinstance(v, core.Var) else frozenset()
  for eqn in jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    for v, d in zip(eqn.outvars, _eqn_flow(eqn, ins)):
      env[v] = get(v) | d  # a source keeps its own label
  return env


def _eqn_flow(eqn: core.JaxprEqn, ins: list[frozenset]) -> list[frozenset]:
  """What each output of ``eqn`` depends on, given what each input depends on."""
  name = eqn.primitive.name
  if name == "optimization_barrier":  # a tuple passed through: no output waits for another input
    return list(ins)
  if name not in ("scan", "while", "cond") and not _bodies(eqn):
    # a primitive (scatter's or a reduction's jaxpr is not a region): every output reads every input
    every = frozenset().union(*ins)
    return [every] * len(eqn.outvars)
  if name in ("scan", "while"):
    if name == "scan":
      body = eqn.params["jaxpr"].jaxpr
      consts, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
      head, carry, tail = ins[:consts], ins[consts:consts + ncarry], ins[consts + ncarry:]
    else:
      body = eqn.params["body_jaxpr"].jaxpr
      skip, consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      ncarry = len(eqn.outvars)
      head, carry, tail = ins[skip:skip + consts], ins[skip + consts:], []
    while True:  # the carry after any number of iterations (a fixed point: sets only grow)
      outs = _through(body, head + carry + tail)
      grown = [c | o for c, o in zip(carry, outs[:ncarry])]
      if grown == carry:
        break
      carry = grown
    return carry + outs[ncarry:]
  if name == "cond":  # whichever branch runs; and the branch waits for the predicate
    per_branch = [_through(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
    return [ins[0] | frozenset.intersection(*outs) for outs in zip(*per_branch)]
  return _through(_bodies(eqn)[0][0], ins)


def _through(body: core.Jaxpr, ins: list[frozenset]) -> list[frozenset]:
  env = _flow(body, dict(zip(body.invars, ins)))
  return [env.get(v, frozenset()) if isinstance(v, core.Var) else frozenset()
          for v in body.outvars]


def _entry_inputs(eqn: core.JaxprEqn) -> set[int]:
  """Indices of inputs of a collective-bearing ``eqn`` such that delaying any one of them delays
  its first collective."""
  if eqn.primitive.name in COLLECTIVES:
    return set(range(len(eqn.invars)))
  found = None
  for body, to_outer, _ in _bodies(eqn):
    first = next((e for e in body.eqns if _bears_collective(e)), None)
    if first is None:
      continue
    env = _flow(body, {v: frozenset([j]) for j, v in enumerate(body.invars)})
    reads = set()
    for i in _entry_inputs(first):
      v = first.invars[i]
      if isinstance(v, core.Var):
        reads |= {to_outer(j) for j in env.get(v, ())}
    found = reads if found is None else found & reads  # a cond: whichever branch runs
  if eqn.primitive.name == "cond":
    return (found or set()) | {0}  # every branch waits for the predicate
  return found or set()


def _exit_tokens(eqn: core.JaxprEqn) -> list[core.Var]:
  """Outputs of a collective-bearing ``eqn`` that, read together, make the reader wait for its
  last collective: the smallest of each of :func:`_exit_groups`."""
  return [min(group, key=_size) for group in _exit_groups(eqn)]


def _exit_groups(eqn: core.JaxprEqn) -> list[list[core.Var]]:
  """Groups of outputs of a collective-bearing ``eqn``: reading any one output of every group
  waits for its last collective (one group per branch of a cond that holds one)."""
  outs = [(k, v) for k, v in enumerate(eqn.outvars) if _is_array_var(v)]
  if eqn.primitive.name in COLLECTIVES:  # every output is there when it completes
    return [[v for _, v in outs]] if outs else []
  groups = []
  for body, _, _ in _bodies(eqn):
    last = next((e for e in reversed(body.eqns) if _bears_collective(e)), None)
    if last is None:
      continue
    for inner in _exit_groups(last):
      env = _flow(body, {v: frozenset([0]) for v in inner})
      fed = [v for (k, v) in outs
             if isinstance(body.outvars[k], core.Var) and env.get(body.outvars[k])]
      groups.append(fed or [v for _, v in outs])  # none fed: read them all (best effort)
  if not groups and outs:
    groups.append([v for _, v in outs])
  return groups


def _is_array_var(v: Any) -> bool:
  aval = getattr(v, "aval", None)
  return (isinstance(v, core.Var) and not isinstance(v, core.DropVar)
          and isinstance(aval, jax.core.ShapedArray) and aval.size > 0
          and (jnp.issubdtype(aval.dtype, jnp.floating) or jnp.issubdtype(aval.dtype, jnp.integer)
               or aval.dtype == jnp.bool_))


def _size(v: core.Var) -> tuple[int, int]:
  """Sort key: float vars first (their identity is the cheapest), then by element count."""
  return (0 if jnp.issubdtype(v.aval.dtype, jnp.floating) else 1, v.aval.size)


def _read_after(eqn: core.JaxprEqn, tokens: list[core.Var], eqns: list) -> core.JaxprEqn:
  """``eqn`` with one input its first collective waits for replaced by an identity of it that reads
  ``tokens`` (the identity's equations appended to ``eqns``)."""
  entry = _entry_inputs(eqn)
  candidates = [(i, v) for i, v in enumerate(eqn.invars) if i in entry and _is_array_var(v)]
  if not candidates:
    return eqn
  strong = [c for c in candidates if not c[1].aval.weak_type] or candidates
  index, x = min(strong, key=lambda c: _size(c[1]))
  invars = list(eqn.invars)
  [invars[index]] = _inline(identity_after, [x, *tokens], eqns)
  return eqn.replace(invars=invars)


def _inline(fn: Callable[..., Any], invars: list, eqns: list, outvars: list | None = None) -> list:
  """Appends to ``eqns`` the equations of ``fn`` traced on the avals of ``invars`` and reading
  them; its results are ``outvars`` when given (else new variables). Returns the results.

  Traced in the caller's context, so ``fn`` may use the mesh axes of the ``shard_map`` being
  traced."""
  template = jax.make_jaxpr(fn)(*(v.aval for v in invars)).jaxpr
  assert not template.constvars, template
  rename = dict(zip(template.invars, invars))
  if outvars is not None:
    rename.update(zip(template.outvars, outvars))
  for e in template.eqns:
    eqns.append(e.replace(
        invars=[rename.get(v, v) if isinstance(v, core.Var) else v for v in e.invars],
        outvars=[rename.get(v, v) for v in e.outvars]))
  return [rename.get(v, v) for v in template.outvars]


def identity_after(x: jax.Array, *tokens: jax.Array) -> jax.Array:
  """``x``, bit for bit, computed from one element of each token as well (module docstring): a
  data dependency XLA cannot fold away, so whatever reads the result runs after the tokens exist.
  Also what lets the step's skip-on-non-finite update its state in place
  (:mod:`jzero.train.step`)."""
  zero = jnp.asarray(-0.0, jnp.float32)
  for token in tokens:
    t = token.reshape(-1)[0] if token.ndim else token
    if not jnp.issubdtype(t.dtype, jnp.floating):  # its bits as a float: XLA folds int == int
      t = lax.bitcast_convert_type(t.astype(jnp.uint32), jnp.float32)
    w = t.astype(jnp.float32) * 0.0  # +-0.0, or NaN
    zero = zero + jnp.where(w != w, -0.0, -jnp.abs(w))  # -0.0
  if jnp.issubdtype(x.dtype, jnp.floating):  # on its bits: float arithmetic flushes subnormals
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits) + zero.astype(bits), x.dtype)
  if x.dtype == jnp.bool_:
    return x | (zero != 0)
  return x + zero.astype(x.dtype)
