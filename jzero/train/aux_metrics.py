"""What a loss returns, read: the loss and its ``aux`` reduced over the global batch as the step's
metrics (:func:`split_loss`, :func:`over_micro_batches`, :func:`over_devices`, :func:`into_metrics`),
and the markers that say how an ``aux`` value is reduced (:class:`Mean`, :class:`Sum`,
:class:`Max`, :class:`Min`).

A loss returns a scalar, or ``(loss, aux)`` with ``aux`` any pytree -- a dict of metrics, or what
flax's tutorials return beside the loss (``(loss, logits)``). Each leaf of ``aux`` is reduced over
the global batch (the micro-batches of gradient accumulation and the devices' slices of each) by
what it is:

* a scalar: its mean. Each micro-batch's value is the mean over that micro-batch's examples, so the
  mean over micro-batches and devices is the global batch's mean -- what a plain loop's loss on the
  whole batch returns;
* ``jzero.Sum(x)``, ``jzero.Max(x)``, ``jzero.Min(x)`` or ``jzero.Mean(x)``, ``x`` a scalar or an
  array: that reduction, elementwise (a count of correct predictions is a ``Sum``, the largest
  logit a ``Max``);
* an array whose leading dimension is the micro-batch's size: one value per example, gathered in
  the global batch's order (``[train_batch_size, ...]``, as the batch was given);
* any other array: refused, naming its place in ``aux`` (wrap it in one of the markers).

A dict ``aux``'s keys join the step's metrics (``metrics["accuracy"]``; a key jzero's own metrics
use is refused); any other ``aux`` is ``metrics["aux"]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jzero.errors import JZeroError

__all__ = ["Max", "Mean", "Min", "Sum", "STEP_METRICS", "into_metrics", "over_devices",
           "over_micro_batches", "split_loss"]

PyTree = Any

#: The metrics every step reports; an ``aux`` dict may not use their names.
STEP_METRICS = ("loss", "grad_norm", "lr", "loss_scale", "overflow", "skipped",
                "min_scale_overflow")


@dataclasses.dataclass(frozen=True)
class _Reduced:
  """An ``aux`` value with the reduction over the global batch it asks for (:attr:`op`)."""

  value: Any
  op: ClassVar[str] = ""


class Mean(_Reduced):
  """``aux`` value averaged over the global batch (the default for a scalar)."""

  op = "mean"


class Sum(_Reduced):
  """``aux`` value summed over the global batch's micro-batches and devices."""

  op = "sum"


class Max(_Reduced):
  """The largest ``aux`` value over the global batch's micro-batches and devices."""

  op = "max"


class Min(_Reduced):
  """The smallest ``aux`` value over the global batch's micro-batches and devices."""

  op = "min"


class _PerExample(_Reduced):
  """An array with one value per example of the micro-batch: gathered, not reduced."""

  op = "gather"


for _cls in (Mean, Sum, Max, Min, _PerExample):
  jax.tree_util.register_dataclass(_cls, data_fields=["value"], meta_fields=[])

_is_marked = lambda x: isinstance(x, _Reduced)  # noqa: E731


def split_loss(out: Any) -> tuple[jax.Array, Any]:
  """What a loss_fn returned -> (scalar floating loss, aux or None); anything else is an error
  naming the fix (value_and_grad would raise JAX's own error deep in the step, or a constant loss
  would train nothing in silence)."""
  if isinstance(out, tuple):
    if len(out) != 2:
      raise JZeroError(
          f"loss_fn returned a tuple of {len(out)} values; jzero takes the loss alone or "
          f"(loss, aux), aux any pytree: return (loss, ({', '.join(['...'] * (len(out) - 1))})) "
          f"to keep the others as aux.")
    loss, aux = out
  else:
    loss, aux = out, None
  if isinstance(loss, (bool, int, float, complex)) or not hasattr(loss, "dtype"):
    raise JZeroError(
        f"loss_fn returned a {type(loss).__name__} ({loss!r:.40}) as its loss; jzero needs a JAX "
        f"array computed from the model's output (a Python number is a constant: nothing would "
        f"train).")
  if jnp.ndim(loss) != 0:
    raise JZeroError(
        f"loss_fn returned a loss of shape {tuple(jnp.shape(loss))}; jzero needs a scalar, the "
        f"mean over the batch it is given (as DeepSpeed's loss.backward() does): return "
        f"loss.mean().")
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise JZeroError(
        f"loss_fn returned a loss of dtype {loss.dtype}; jzero differentiates it, so it must be "
        f"floating point: return loss.astype(jnp.float32).")
  return loss, aux


def mark(aux: PyTree, micro_batch: int) -> PyTree:
  """``aux`` with every leaf marked by its reduction (module docstring); an array that is neither
  marked nor one value per example is refused, naming its place."""
  def leaf(path, x):
    if _is_marked(x):
      return type(x)(jnp.asarray(x.value))
    x = jnp.asarray(x)
    if x.ndim == 0:
      return Mean(x)
    if x.shape[0] == micro_batch:
      return _PerExample(x)
    raise JZeroError(
        f"loss_fn's aux{jax.tree_util.keystr(path)} has shape {x.shape}: an aux array is one "
        f"value per example (leading dimension the micro-batch, {micro_batch}), gathered over "
        f"the global batch; reduce it to a scalar, or wrap it in jzero.Sum / jzero.Mean / "
        f"jzero.Max / jzero.Min to reduce it elementwise over the batch.")
  return jax.tree_util.tree_map_with_path(leaf, aux, is_leaf=_is_marked)


def over_micro_batches(stacked: PyTree) -> PyTree:
  """Marked ``aux`` values stacked over the micro-batches (leading axis) -> one per device."""
  def leaf(x):
    v = x.value
    if x.op == "gather":
      return type(x)(v.reshape((-1,) + v.shape[2:]))
    reduce = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max, "min": jnp.min}[x.op]
    return type(x)(reduce(v.astype(jnp.float32) if x.op == "mean" else v, axis=0))
  return jax.tree.map(leaf, stacked, is_leaf=_is_marked)


def over_devices(aux: PyTree, axes: tuple[str, ...]) -> PyTree:
  """One device's marked ``aux`` (inside a ``shard_map``) -> the global batch's plain values,
  replicated: means averaged in fp32, sums, maxima and minima over ``axes`` (the batch axes),
  per-example arrays gathered in the batch's order."""
  def leaf(x):
    v = x.value
    if x.op == "mean":
      return lax.pmean(v.astype(jnp.float32), axes)
    if x.op == "sum":
      return lax.psum(v, axes)
    if x.op == "max":
      return lax.pmax(v, axes)
    if x.op == "min":
      return lax.pmin(v, axes)
    return lax.all_gather(v, axes, axis=0, tiled=True)
  return jax.tree.map(leaf, aux, is_leaf=_is_marked)


def into_metrics(metrics: dict, aux: PyTree) -> dict:
  """The step's ``metrics`` with the reduced ``aux``: a dict's keys joined (one of
  :data:`STEP_METRICS` refused), anything else as ``metrics["aux"]``, None as nothing."""
  if aux is None:
    return metrics
  if not isinstance(aux, dict):
    return {**metrics, "aux": aux}
  taken = sorted(set(aux) & set(metrics))
  if taken:
    raise JZeroError(
        f"loss_fn's aux dict has the key(s) {taken}, which the step's own metrics use "
        f"({', '.join(STEP_METRICS)}); rename them.")
  return {**metrics, **aux}
