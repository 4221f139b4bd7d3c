"""comm/param_array.py: a stage-3 ZeroParam used as the array it stands for, outside the gathers the
model arranges. Each use gathers once; the gradients of all uses are reduce-scattered into the one
partition and sum to the single-device gradient; what cannot work names the parameter's path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jzero.comm.zero_param import ZeroParam, one_pass
from jzero.errors import JZeroError

N = 8
ROWS, COLS = 12, 6  # 12 rows split 8 ways: padded to 16, two rows a device
PATH = "transformer/wte/embedding"


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:N]), ("data",))


def _padded(w: np.ndarray) -> np.ndarray:
  return np.pad(w, ((0, -ROWS % N), (0, 0)))


def _param(partition) -> ZeroParam:
  return ZeroParam(partition, -2, ROWS, ("data",), path=PATH)


def _uses(w, x):
  """Every kind of use a model makes of a weight ``w`` [12, 6] with activations ``x`` [b, 6], one
  use of ``w`` each: a list of arrays. Called with the full array (the reference) and with a
  ZeroParam."""
  return [
      x @ w.T, w @ x.T, jnp.dot(x, w.T), jnp.einsum("bd,vd->bv", x, w), jnp.matmul(x, w.mT),
      w + 1.0, 2.0 * w, w - x[:1], x[:1] - w, w / 3.0, 1.0 / (abs(w) + 1.0), w ** 2, -w, +w,
      jnp.tanh(w), jnp.asarray(w), w.reshape(-1), w.reshape(3, 4, 6).sum(1),
      w.astype(jnp.bfloat16).astype(jnp.float32), w.transpose(), w.swapaxes(0, 1), w.sum(),
      w.mean(axis=0), w.max(axis=1), w[2:5], w[jnp.array([0, 7, 11])], w.at[0].set(0.0),
      jnp.where(x[:1] > 0, w, 0.0), (w > 0.5) * 1.0, jnp.stack(list(w)[:3]),
  ]


def _count(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr``, sub-jaxprs included."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for sub in _subjaxprs(eqn.params):
      count += _count(sub, name)
  return count


def _subjaxprs(params):
  for v in params.values():
    for item in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


@functools.lru_cache(maxsize=None)
def _sharded_loss_and_grad():
  """(loss, gradient of the partition) over 8 devices, each with its own rows of ``x``: the
  weight's partitions [2, 6] per device become a ZeroParam used by :func:`_uses`. Jitted once."""

  def local(partition, x):
    def loss(p):
      outs = _uses(_param(p), x)
      return sum(jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(outs))
    value, grad = jax.value_and_grad(loss)(partition)
    return jax.lax.psum(value, "data"), grad

  fn = jax.shard_map(local, mesh=_mesh(), in_specs=(P("data", None), P("data", None)),
                     out_specs=(P(), P("data", None)), check_vma=False)
  return jax.jit(fn)


@jax.jit
def _reference(w, x):
  """The same loss of the full array on one device, summed over the 8 devices' rows of ``x``."""
  def loss(w):
    one = lambda xd: sum(jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(_uses(w, xd)))
    return jnp.sum(jax.vmap(one)(x.reshape(N, -1, x.shape[-1])))
  return jax.value_and_grad(loss)(w)


def test_every_use_matches_the_array_and_the_gradients_of_all_uses_sum_in_the_partition():
  """~30 uses (jnp functions, operators both sides, .T/.mT/.reshape/.astype, indexing, iteration,
  reductions, .at) of one weight in one loss, 8 devices each with its own rows of x: the loss and
  the gradient -- reduce-scattered into each device's partition -- equal the single-device
  loss and gradient of the same uses of the full array; every use is one all-gather and one
  reduce-scatter."""
  rng = np.random.default_rng(0)
  w = rng.normal(size=(ROWS, COLS)).astype(np.float32)
  x = rng.normal(size=(2 * N, COLS)).astype(np.float32)
  fn = _sharded_loss_and_grad()
  value, grad = fn(_padded(w), x)
  ref_value, ref_grad = _reference(w, x)
  # fp32 sums of ~30 uses over 8 devices in another order: rounding relative to the largest term
  np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
  scale = float(np.abs(ref_grad).max())
  np.testing.assert_allclose(np.asarray(grad)[:ROWS], ref_grad, rtol=0, atol=1e-5 * scale)
  np.testing.assert_array_equal(np.asarray(grad)[ROWS:], 0.0)  # the padding gets no gradient

  uses = len(jax.eval_shape(_uses, w, x[:2]))
  jaxpr = jax.make_jaxpr(fn)(_padded(w), x).jaxpr
  assert _count(jaxpr, "all_gather") == uses
  assert _count(jaxpr, "reduce_scatter") == uses - 1  # a comparison has no gradient


def test_shape_dtype_and_size_read_without_gathering():
  """What a shape-dependent branch reads is the full parameter's, and reading it gathers nothing."""
  seen = {}

  def local(partition):
    p = _param(partition)
    seen.update(shape=p.shape, ndim=p.ndim, size=p.size, dtype=p.dtype, nbytes=p.nbytes,
                len=len(p), jnp_shape=jnp.shape(p), np_shape=np.shape(p))
    return partition

  fn = jax.shard_map(local, mesh=_mesh(), in_specs=P("data"), out_specs=P("data"),
                     check_vma=False)
  jaxpr = jax.make_jaxpr(fn)(np.zeros((16, COLS), np.float32)).jaxpr
  assert seen == dict(shape=(ROWS, COLS), ndim=2, size=ROWS * COLS, dtype=np.float32,
                      nbytes=ROWS * COLS * 4, len=ROWS, jnp_shape=(ROWS, COLS),
                      np_shape=(ROWS, COLS))
  assert _count(jaxpr, "all_gather") == 0


def _one_element(p: ZeroParam) -> ZeroParam:
  """A [1, 1] parameter from ``p``'s partition (what Python could convert, were it concrete)."""
  return ZeroParam(p.partition[:1, :1], -2, 1, ("data",), path=PATH)


def _inside(use):
  """Traces ``use(ZeroParam)`` inside a shard_map over the 8 devices."""
  fn = jax.shard_map(lambda part: jnp.sum(use(_param(part))) * jnp.ones(()), mesh=_mesh(),
                     in_specs=P("data"), out_specs=P(), check_vma=False)
  return jax.make_jaxpr(fn)(np.zeros((16, COLS), np.float32))


@pytest.mark.parametrize("use, what", [
    (np.asarray, "numpy asked for the values"),
    (lambda p: np.array(p), "numpy asked for the values"),
    (lambda p: bool(_one_element(p)), "Python asked for the value"),
    (lambda p: 1 if _one_element(p) else 0, "Python asked for the value"),
    (lambda p: _one_element(p).item(), "Python asked for the value"),
])
def test_what_needs_concrete_values_names_the_path_and_the_fix(use, what):
  with pytest.raises(JZeroError, match=rf"{what} of the ZeRO-3 parameter '{PATH}'.*traced value"
                     r".*jnp.*engine\.logical_params\(state\)"):
    _inside(use)


def test_placement_attributes_are_not_an_array_of_the_parameter():
  """``.sharding`` / ``.device`` are not forwarded (there is no one placed array): an
  AttributeError naming the path, so ``getattr(p, "sharding", None)`` is None."""
  def use(p):
    assert getattr(p, "sharding", None) is None
    with pytest.raises(AttributeError, match=rf"'{PATH}'.*engine\.plan"):
      _ = p.device
    with pytest.raises(AttributeError, match=rf"'{PATH}'.*has no attribute 'no_such'"):
      _ = p.no_such
    return p
  _inside(use)


def test_a_parameter_kept_past_its_pass_names_the_path_and_the_fix():
  """A ZeroParam stored in a Python container during one pass (the engine makes each pass
  ``one_pass()``) and used in another or outside the step, by an operator, a method or a jnp
  function (which takes it through its own jit): the error names the path. Within its own pass it
  works, twice."""
  kept = []

  def keep(p):
    kept.append(p)
    return jnp.sum(p) + jnp.sum(kept[0])
  with one_pass():
    _inside(keep)
  for use in (lambda: _inside(lambda p: p + kept[0]), lambda: _inside(lambda p: jnp.sum(kept[0])),
              lambda: jnp.asarray(kept[0]), lambda: kept[0].T):
    with pytest.raises(JZeroError, match=rf"ZeRO-3 parameter '{PATH}' was used after the "
                       r"forward/backward pass that received it.*engine\.logical_params"):
      use()
