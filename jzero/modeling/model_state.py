"""A model's state besides its parameters: what the train state carries as ``model_state``, how
BatchNorm's statistics span the data-parallel devices, and the RNG streams an NNX module holds.

**What is carried.** ``TrainState.model_state`` is a dict by collection name, Linen's layout:

* Linen: every collection ``module.init`` returns besides ``params`` -- ``{"batch_stats": {...}}``
  for ``nn.BatchNorm`` -- as ``module.init`` nests it.
* NNX: the variables that are neither ``nnx.Param`` nor RNG state, grouped by flax's Linen name
  for their type (:func:`collection_name`: ``nnx.BatchStat`` -> ``"batch_stats"``, ``nnx.Cache`` ->
  ``"cache"``, ``nnx.Intermediate`` -> ``"intermediates"``, another Variable type by its class
  name), each a pure dict by the variables' paths (``nnx.to_pure_dict``'s form): a Linen model and
  its NNX port store their statistics alike.
* ``{}`` for a model with none (its step is the program it always was).

It is replicated over the mesh (a few bytes beside the parameters). Each micro-batch's forward
pass starts from the state the previous one left -- the accumulation scan carries it, as a
single-device loop over the same micro-batches would -- and the step's new state is what the
last one left. A skipped step (fp16 overflow, a non-finite gradient) skips the optimizer update,
not the forward pass: its statistics are kept, as PyTorch's BatchNorm keeps its buffers then.

**Batch statistics over the global batch (SyncBatchNorm).** Every BatchNorm -- ``nn.BatchNorm``,
``nnx.BatchNorm`` and their subclasses -- computes its mean and variance over the global
(micro-)batch: inside the step its ``axis_name`` is set to jzero's data axes
(``plan.mesh.batch_axes``), so flax's own ``lax.pmean`` averages each device's statistics over
all of them, and its backward sums the statistics' gradients over them (the device slices are of
equal size, so the mean of means is the global mean). Whatever axis name the model gave --
flax's ResNet ``axis_name="batch"``, a name from its ``pmap`` days -- or none (``nnx.BatchNorm``'s
default) maps to the data axes: a model names its axes for the devices it expected, not for
jzero's mesh, and only global statistics make every stage and device count equal a single-device
loop over the same batch. That is torch's ``SyncBatchNorm``; torch DDP's plain ``BatchNorm``
normalises each rank's slice by its own statistics (and keeps rank 0's running averages), which
jzero does not do. The cost is one all-reduce of 2 x features floats per BatchNorm call, and one
in its backward. ``axis_index_groups`` (statistics over subsets of devices) is refused. JAX has no
alias for an axis name inside ``shard_map`` (an unbound name is a ``NameError``; ``pmean`` takes
the tuple of mesh axes), so the module's own attribute is what changes: NNX -- the bound model's
``BatchNorm`` modules get ``axis_name`` set (:func:`sync_nnx_batch_norms`); Linen -- an
``nn.intercept_methods`` interceptor sets the field for the duration of each BatchNorm call
(:class:`LinenBatchNormAxes`). Outside the step (``engine.bind``, an abstract trace) the
statistics are the local batch's (``axis_name=None``). Normalisation layers whose ``axis_name``
means a split feature axis (LayerNorm, GroupNorm) are left alone.

**RNG streams held in an NNX module** (``nnx.Dropout(rate, rngs=rngs)``, what NNX users write)
are not carried: a replicated stream would draw the same mask on every device. Each call of the
loss reseeds them (``nnx.reseed``) from the key the step gives that device's micro-batch (the
loss's ``rng``): the streams of tag ``t`` from ``fold_in(rng, crc32(t))``, one key each in graph
order as ``nnx.reseed`` does. In evaluation (no rng) from a fixed key; ``model.eval()`` makes
Dropout deterministic there. A resumed run draws the same keys (the training key is in the
checkpoint).
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from flax import traverse_util

from jzero.errors import JZeroError, NotSupportedError
from jzero.sharding.plan import path_str

__all__ = ["NON_PARAM", "LinenBatchNormAxes", "collection_name", "explain_unbound_axis",
           "fill_nnx_state", "group_nnx_state", "reseed_nnx_streams", "rng_placeholders",
           "stream_key", "sync_nnx_batch_norms"]

PyTree = Any

#: NNX variables carried as model state: neither parameters nor RNG streams.
NON_PARAM = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


def collection_name(var_type: type) -> str:
  """The Linen collection an NNX variable type's values are carried in: flax's own registry
  (``nnx.variable_name_from_type``, what its Linen bridge uses), else the class name."""
  try:
    return nnx.variable_name_from_type(var_type)
  except ValueError:
    return var_type.__name__


def _key(path: tuple) -> tuple:
  return tuple(getattr(p, "key", p) for p in path)


def group_nnx_state(state: nnx.State) -> dict[str, PyTree]:
  """An NNX state of non-parameter variables -> ``{collection: pure dict by path}``."""
  flat: dict[str, dict[tuple, Any]] = {}
  for path, var in nnx.to_flat_state(state):
    flat.setdefault(collection_name(type(var)), {})[_key(path)] = var.get_value()
  return {name: traverse_util.unflatten_dict(values) for name, values in flat.items()}


def fill_nnx_state(template: nnx.State, model_state: dict[str, PyTree]) -> nnx.State:
  """A copy of ``template`` (non-parameter variables) holding the values of ``model_state``
  (:func:`group_nnx_state`'s form)."""
  values = {path: x for tree in model_state.values()
            for path, x in traverse_util.flatten_dict(tree).items()}
  state = jax.tree.map(lambda x: x, template)  # fresh Variables, template untouched
  for path, var in nnx.to_flat_state(state):
    var.set_value(values[_key(path)])
  return state


def stream_key(rng: jax.Array | None, tag: str) -> jax.Array:
  """The key the RNG streams of ``tag`` are reseeded from: ``fold_in(rng, crc32(tag))`` (a
  fixed key when ``rng`` is None, in evaluation)."""
  base = jax.random.key(0) if rng is None else rng
  return jax.random.fold_in(base, zlib.crc32(tag.encode()))


def rng_placeholders(template: nnx.State) -> nnx.State:
  """RNG variables of ``template``'s shapes holding placeholder keys and counts, which
  :func:`reseed_nnx_streams` replaces (a factory's template holds no values)."""
  def fill(var: nnx.Variable) -> nnx.Variable:
    value = var.get_value()
    if isinstance(var, nnx.RngKey):
      return var.replace(jax.random.split(jax.random.key(0), value.shape) if value.shape
                         else jax.random.key(0))
    return var.replace(jax.numpy.zeros(value.shape, value.dtype))
  return jax.tree.map(fill, template, is_leaf=lambda x: isinstance(x, nnx.Variable))


def reseed_nnx_streams(model: nnx.Module, tags: tuple[str, ...], rng: jax.Array | None) -> None:
  """Reseeds the RNG streams of ``tags`` in ``model`` (in place) from ``rng`` (module
  docstring)."""
  if tags:
    nnx.reseed(model, policy="match_shape", **{t: stream_key(rng, t) for t in tags})


def _check_groups(path: str, module: Any) -> None:
  if module.axis_index_groups is not None:
    raise NotSupportedError(
        f"BatchNorm {path or type(module).__name__!r} sets axis_index_groups: jzero computes "
        f"batch statistics over the whole global batch (every data-parallel device, torch's "
        f"SyncBatchNorm), not over groups of devices. Remove axis_index_groups.")


def sync_nnx_batch_norms(model: nnx.Module, batch_axes: tuple[str, ...] | None) -> None:
  """Sets ``axis_name`` of every ``nnx.BatchNorm`` of a bound model to ``batch_axes`` (None:
  local statistics), in place."""
  for path, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm):
      _check_groups(path_str(path), module)
      module.axis_name = batch_axes


class LinenBatchNormAxes:
  """An ``nn.intercept_methods`` interceptor: each ``nn.BatchNorm`` call computes its statistics
  over ``batch_axes`` (None: local), whatever its ``axis_name`` field says. The field is set on
  the (frozen) module for the duration of the call and restored after it."""

  def __init__(self, batch_axes: tuple[str, ...] | None):
    self.batch_axes = batch_axes

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if not isinstance(module, nn.BatchNorm) or context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    _check_groups(path_str(module.path) if module.scope is not None else "", module)
    given = module.axis_name
    object.__setattr__(module, "axis_name", self.batch_axes)
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "axis_name", given)


def explain_unbound_axis(error: NameError, batch_axes: tuple[str, ...]) -> JZeroError | None:
  """A JZeroError for a collective over an axis name the step's mesh does not have (a model's own
  ``lax.pmean(x, "batch")``), or None for another NameError."""
  if "unbound axis name" not in str(error):
    return None
  return JZeroError(
      f"the model runs a collective over an axis name jzero's mesh does not have "
      f"({str(error).splitlines()[0]}). jzero maps the axis_name of BatchNorm modules to its data "
      f"axes {list(batch_axes)} itself (docs/coming-from-flax.md, 'Models with batch statistics'); "
      f"a collective the model writes itself must name those axes "
      f"(engine.plan.mesh.batch_axes), or be left out.")
