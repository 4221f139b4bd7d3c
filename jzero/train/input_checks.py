"""Checks of what a user hands the engine, before any device work: initial parameters, a train
state (not donated already), a batch (arrays, not Python lists; its structure and leading
dimension; trailing dimensions the model takes), integer inputs (within the model's embedding
table). Each raises an error that names the leaf and the fix."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.tree_util import SequenceKey, keystr

from jzero.errors import ConfigError, DataError, JZeroError
from jzero.sharding.plan import Plan, flatten_paths

__all__ = ["check_params", "check_model_state", "check_live", "check_arrays", "check_batch",
           "check_new_shapes", "check_input_ids", "IGNORE_INDEX", "explain_trace_error"]

PyTree = Any


def check_params(plan: Plan, params: PyTree) -> None:
  """Given parameters must have the model's tree structure and logical shapes; a jax.Array may
  also have the shape the plan stores the param in (a partitioned leaf zero-padded, as
  ``checkpoint.load_weights`` places it)."""
  flat = flatten_paths(params)
  got = {path: np.shape(x) for path, x in flat.items()}
  want = {l.path: l.shape for l in plan.leaf_list()}
  laid_out = {l.path: plan.param_shape(l) for l in plan.leaf_list()}
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing or extra:
    raise ConfigError(f"parameters do not match the model: missing {missing[:5]}, unexpected "
                      f"{extra[:5]} (paths are '/'-joined keys of the params tree).")
  bad = [f"{p}: {got[p]} (model: {want[p]})" for p in want if tuple(got[p]) != want[p] and not (
      isinstance(flat[p], jax.Array) and tuple(got[p]) == laid_out[p])]
  if bad:
    raise ConfigError(f"parameters do not match the model's shapes: {'; '.join(bad[:5])}.")


def check_model_state(given: PyTree, want: PyTree) -> None:
  """A given model state (``engine.init(model_state=...)``) must have the model's collections,
  paths and shapes (``want``: the adapter's abstract model state)."""
  got = {path: np.shape(x) for path, x in flatten_paths(given).items()}
  expected = {path: tuple(x.shape) for path, x in flatten_paths(want).items()}
  missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
  if missing or extra:
    raise ConfigError(f"model_state does not match the model's: missing {missing[:5]}, "
                      f"unexpected {extra[:5]} (paths are '/'-joined keys, the collection "
                      f"first, e.g. 'batch_stats/bn/mean').")
  bad = [f"{p}: {got[p]} (model: {expected[p]})" for p in expected if tuple(got[p]) != expected[p]]
  if bad:
    raise ConfigError(f"model_state does not match the model's shapes: {'; '.join(bad[:5])}.")


def check_live(state: Any, where: str) -> None:
  """Raises JZeroError if ``state`` was donated to a train step (its arrays are deleted).

  ``train_step`` donates the state it is given: its buffers become the new state's, so the old
  one must not be used again (with several CPU devices XLA would read freed memory).
  """
  for x in jax.tree.leaves(state):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise JZeroError(
          f"{where}: this train state was donated to engine.train_step, which reuses its memory "
          f"for the new state, so its arrays are deleted. Keep the state train_step returns: "
          f"`state, metrics = engine.train_step(state, batch)`, and use that one.")


def check_arrays(batch: PyTree) -> None:
  """Every leaf of ``batch`` an array: a Python list (or tuple) of numbers -- a tokenizer's output
  -- is a tree of scalars to JAX, so it is named here with the conversion."""
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if isinstance(x, (bool, int, float, complex)) and path and isinstance(path[-1], SequenceKey):
      while path and isinstance(path[-1], SequenceKey):
        path = path[:-1]
      name = keystr(path)
      what = f"batch leaf {name}" if name else "the batch"
      raise DataError(
          f"{what} is a Python list (or tuple) of numbers; the engine takes arrays, one per "
          f"leaf: np.asarray(batch{name}) (rows padded to one length; a tokenizer gives arrays "
          f"with return_tensors='np').")


def check_batch(batch: PyTree, first: Any, batch_size: int, micro: int, gas: int,
                dp_size: int) -> None:
  """A global batch of arrays (:func:`check_arrays` first): the structure of the engine's first
  batch (``first``) and ``batch_size`` rows in every leaf."""
  if jax.tree.structure(batch) != first:
    first_keys = set(flatten_paths(jax.tree.unflatten(first, [0] * first.num_leaves)))
    now = set(flatten_paths(batch))
    raise DataError(
        f"the batch's structure changed after the first train step: keys "
        f"{sorted(now - first_keys)} are new and {sorted(first_keys - now)} are gone (first "
        f"batch: {sorted(first_keys)}). The step is compiled for the first batch's keys; give "
        f"every batch the same keys (drop the extra ones before engine.train_step, or build a new "
        f"engine for the new layout).")
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if not np.shape(x) or np.shape(x)[0] != batch_size:
      name = jax.tree_util.keystr(path) or "batch"
      raise DataError(
          f"batch leaf {name} has shape {tuple(np.shape(x))}; its leading dimension must be "
          f"train_batch_size = {batch_size} (train_micro_batch_size_per_gpu {micro} x "
          f"gradient_accumulation_steps {gas} x data-parallel size {dp_size}).")


def check_new_shapes(batch: PyTree, seen: list[dict[str, tuple]],
                     trace: Callable[[PyTree], Any]) -> None:
  """A batch whose trailing dimensions differ from those of every batch in ``seen`` (the shapes
  the step was compiled for, first batch first; ``batch`` is added once it passes): ``trace(batch)``
  runs the model on it abstractly, and a failure there -- the model cannot take the new shape, as
  a layer given another feature width -- is a DataError naming the leaves that changed and both
  shapes. More positions or another sequence length pass: the step is traced anew for them."""
  shapes = {keystr(path): tuple(np.shape(x))
            for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]}
  trailing = lambda s: {path: shape[1:] for path, shape in s.items()}
  if any(trailing(shapes) == trailing(s) for s in seen):
    return
  if seen:
    try:
      trace(batch)
    except JZeroError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (the model's own error, quoted)
      first = seen[0]
      changed = [f"batch leaf {path or 'batch'} has shape {shape}; the step was compiled for "
                 f"{first[path]}" for path, shape in shapes.items()
                 if path in first and shape[1:] != first[path][1:]]
      changed = changed or [f"the batch's leaves have shapes {shapes}; the step was compiled for "
                            f"{first}"]
      cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
      raise DataError(
          f"{'; '.join(changed)}, and the model cannot take the new shape ({type(e).__name__}: "
          f"{cause}). Give every batch the trailing dimensions of the first (pad or crop), or "
          f"build a new engine for the new shape.") from None
  seen.append(shapes)


#: torch's ``CrossEntropyLoss(ignore_index=-100)``, which Hugging Face's collators put in labels:
#: the one negative id :func:`check_input_ids` lets through.
IGNORE_INDEX = -100


def check_input_ids(plan: Plan, batch: PyTree) -> None:
  """Host batches only (one pass per integer leaf, no device read): negative ids (but
  :data:`IGNORE_INDEX`) and ids past the rows of the model's largest embedding table (a param
  named ``embedding``, NNX's and Linen's)."""
  rows = _embedding_rows(plan)
  if not rows:
    return
  limit = max(rows)
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if isinstance(x, jax.Array) or not np.size(x):
      continue
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
      continue
    negative = x[(x < 0) & (x != IGNORE_INDEX)]
    if negative.size:
      raise DataError(
          f"batch leaf {jax.tree_util.keystr(path) or 'batch'} holds the id {int(negative.min())}, "
          f"but ids index the model's embedding table from 0 (ids 0..{limit - 1}): JAX wraps a "
          f"negative index to another row instead of failing, so the step would train on "
          f"another token. Map padding or ignored positions to a valid id and mask them in the "
          f"loss ({IGNORE_INDEX}, torch's ignore_index, is let through for labels), or set "
          f"engine.check_input_ids = False if this leaf does not index an embedding.")
    if (top := int(x.max())) >= limit:
      raise DataError(
          f"batch leaf {jax.tree_util.keystr(path) or 'batch'} holds the id {top}, but the "
          f"model's largest embedding table has {limit} rows (ids 0..{limit - 1}): a lookup "
          f"out of range gives NaN and the step would be skipped. Match the tokenizer's "
          f"vocabulary to the model's vocab size, or set engine.check_input_ids = False if "
          f"this leaf does not index an embedding.")


def _embedding_rows(plan: Plan) -> list[int]:
  """Rows of the model's embedding tables (params named ``embedding``, NNX's and Linen's)."""
  return [leaf.shape[0] for leaf in plan.leaf_list()
          if leaf.path.rsplit("/", 1)[-1] == "embedding" and len(leaf.shape) == 2]


def explain_trace_error(plan: Plan, batch: PyTree, trace: Callable[[PyTree], Any],
                        error: BaseException) -> None:
  """A step failed before it ran (``error``, raised while it was traced, so the state was not
  donated): when the model alone fails on ``batch`` too (``trace(batch)``, the loss traced
  abstractly), raises a DataError naming the batch's leaves -- their shapes and dtypes -- and the
  model's own message; returns otherwise (the caller re-raises ``error``). Float token ids are
  the common case: flax's embedding says only "Input type must be an integer"."""
  try:
    trace(batch)
  except JZeroError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (the model's own error, quoted)
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    shown = "; ".join(f"{keystr(path) or 'batch'}: {np.dtype(x.dtype).name} "
                      f"{tuple(np.shape(x))}" for path, x in leaves)
    floats = [keystr(path) or "batch" for path, x in leaves
              if np.issubdtype(np.dtype(x.dtype), np.floating)]
    hint = ""
    if floats and _embedding_rows(plan):
      hint = (f" If {', '.join(floats)} holds token ids, give integers (np.int32): the model's "
              f"embedding table looks ids up by index.")
    cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise DataError(
        f"the model cannot take this batch ({type(e).__name__}: {cause}); its leaves are {shown}."
        f"{hint} Nothing was computed and the state passed in is still usable.") from None
