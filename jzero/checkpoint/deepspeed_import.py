"""A DeepSpeed checkpoint placed in an engine's ZeRO plan: the run continues in jzero.

:func:`import_deepspeed` builds the complete TrainState a jzero checkpoint restore would (the same
path as :func:`jzero.checkpoint.restore.load_checkpoint`, from host arrays instead of Orbax): the
user's ``convert`` maps torch names to the model's params tree and is applied alike to the fp32
master and to each Adam moment; each tree is laid out as the plan's master / optimizer state and
placed straight into its shardings, on any stage and device count, by the assembly a plain optax
run's import uses (:func:`jzero.checkpoint.optax_import.placed_state`).

What carries over, and how it maps to optax (:mod:`jzero.train.optim` builds the optimizer):

* torch ``exp_avg`` / ``exp_avg_sq`` are optax ``ScaleByAdamState.mu`` / ``nu``, and torch's
  ``step`` is its ``count``. Both increment the count before the bias correction
  ``1 - beta ** count``, and both divide by ``sqrt(v_hat) + eps`` with eps outside the root.
  torch AdamW's ``p *= 1 - lr * wd`` before the Adam step is ``add_decayed_weights`` after
  ``scale_by_adam`` (the decay reads the same old ``p``).
* The schedule reads ``ScaleByScheduleState.count``: optax count k uses DeepSpeed's ``get_lr()``
  at ``last_batch_iteration = k - 1``, so it is the scheduler's ``last_batch_iteration + 1``.
* ``TrainState.step`` is DeepSpeed's ``global_steps``, ``skipped`` its ``skipped_steps``. The loss
  scaler starts fresh (static in fp32 and bf16); the training RNG comes from ``rng``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero.checkpoint.deepspeed import DeepSpeedCheckpoint
from jzero.checkpoint.optax_import import initial_model_state, opt_layout, placed_state
from jzero.checkpoint.restore import shardings_of
from jzero.errors import CheckpointError, JZeroWarning
from jzero.sharding.plan import Plan, flatten_paths
from jzero.tiers.base import Resources

__all__ = ["import_deepspeed"]

PyTree = Any


def _converted(adapter: Any, ds: DeepSpeedCheckpoint, convert: Callable[[dict], PyTree],
               sample_batch: Any) -> tuple[PyTree, PyTree, PyTree]:
  """``convert`` of the master and of each moment, each checked against the model's leaves."""
  model = adapter.abstract_params(jax.random.key(0), sample_batch)
  want = flatten_paths(model)
  trees = []
  for what, named in (("params", ds.params), ("exp_avg", ds.exp_avg),
                      ("exp_avg_sq", ds.exp_avg_sq)):
    tree = convert(dict(named))
    got = flatten_paths(tree)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = [f"{p}: {tuple(np.shape(got[p]))} from convert, {tuple(want[p].shape)} in the model"
           for p in want if p in got and tuple(np.shape(got[p])) != tuple(want[p].shape)]
    if missing or extra or bad:
      raise CheckpointError(
          f"convert(ds.{what}) of {ds.directory} does not give the model's params tree: "
          + "; ".join(([f"the model's leaves {missing[:5]} are missing"] if missing else [])
                      + ([f"{extra[:5]} are not in the model"] if extra else []) + bad[:5])
          + ". convert maps {torch name: array} to the tree engine.init(rng, params=...) takes "
            "(names, and a torch Linear's [out, in] weight transposed to a Flax [in, out] kernel).")
    trees.append(jax.tree.unflatten(jax.tree.structure(model),
                                    [np.asarray(got[p], np.float32) for p in want]))
  return tuple(trees)


def _check_optimizer(config: Any, ds: DeepSpeedCheckpoint) -> None:
  """Warns where the config's optimizer differs from the checkpoint's (the run would not be a
  continuation); a client optax optimizer is the user's to match."""
  block = config.optimizer
  if block is None:
    return
  params, kind = dict(block.params or {}), str(block.type).lower()
  engine_decoupled = kind == "adamw" or (kind == "adam" and params.get("adam_w_mode", True))
  ours = {"betas": tuple(params.get("betas", (0.9, 0.999))), "eps": params.get("eps", 1e-8),
          "weight_decay": params.get("weight_decay", 0.0)}
  differ = []
  if ds.optimizer in ("Adam", "AdamW") and (ds.optimizer == "AdamW") != engine_decoupled:
    differ.append(f"type {ds.optimizer} in the checkpoint, {block.type}"
                  f"{'' if kind == 'adamw' else f' (adam_w_mode {engine_decoupled})'} here")
  for g, group in enumerate(ds.param_groups):
    for key, value in ours.items():
      if not np.allclose(group[key], value, rtol=1e-6, atol=0):
        differ.append(f"{key} {group[key]} in param group {g}, {value} here")
  if differ:
    warnings.warn(
        f"the DeepSpeed checkpoint {ds.directory} was trained with other optimizer settings than "
        f"this engine's config: {'; '.join(differ)}. The moments are imported as they are, but the "
        f"run continues with this engine's optimizer: set optimizer.params as in the DeepSpeed "
        f"run for a continuation.", JZeroWarning, stacklevel=3)


def _schedule_count(ds: DeepSpeedCheckpoint) -> int:
  """The optax count the schedule reads: DeepSpeed's ``last_batch_iteration + 1``."""
  if ds.lr_scheduler is None:
    return ds.step
  if "last_batch_iteration" not in ds.lr_scheduler:
    raise CheckpointError(
        f"{ds.directory}: its LR scheduler state {sorted(ds.lr_scheduler)} is not one of "
        f"DeepSpeed's schedules (no last_batch_iteration), so its position cannot be mapped to "
        f"jzero's schedule. jzero builds WarmupLR, WarmupDecayLR, WarmupCosineLR and LRRangeTest.")
  return int(ds.lr_scheduler["last_batch_iteration"]) + 1


def _with_adam_state(opt_state: PyTree, mu: PyTree, nu: PyTree, adam_count: int,
                     schedule_count: int, where: str) -> PyTree:
  """``opt_state`` with its Adam moments and count, and every schedule's count, replaced."""
  found = []

  def replace(x):
    if isinstance(x, optax.ScaleByAdamState):
      found.append(x)
      return x._replace(count=jnp.asarray(adam_count, x.count.dtype), mu=mu, nu=nu)
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=jnp.asarray(schedule_count, x.count.dtype))
    return x

  state = jax.tree.map(replace, opt_state, is_leaf=lambda x: isinstance(
      x, (optax.ScaleByAdamState, optax.ScaleByScheduleState)))
  if len(found) != 1:
    raise CheckpointError(
        f"the engine's optimizer has {len(found)} Adam states (optax.scale_by_adam), where the "
        f"moments of {where} go into exactly one: use an Adam / AdamW optimizer block, or a "
        f"client optax.adam / optax.adamw.")
  return state


def _fresh_model_state(plan: Plan, adapter: Any, abstract: Any, key: jax.Array,
                       sample_batch: Any, where: Any) -> PyTree:
  """The model's initial state (``{}`` for a model without one): DeepSpeed's module buffers
  (BatchNorm's running statistics) are not read, which a warning says."""
  if jax.tree.leaves(abstract.model_state):
    warnings.warn(
        f"{where}: the model has state besides its parameters ({sorted(abstract.model_state)}, "
        f"BatchNorm statistics); the DeepSpeed run's module buffers are not imported, so it "
        f"starts at the model's initial values; state._replace(model_state={{...}}) sets the "
        f"run's (a dict by collection, as state.model_state is).", JZeroWarning, stacklevel=3)
  return initial_model_state(plan, adapter, abstract, key, sample_batch)


def import_deepspeed(plan: Plan, target: Any, resources: Resources, ds: DeepSpeedCheckpoint,
                     convert: Callable[[dict], PyTree], *, model: Any, config: Any,
                     tx: optax.GradientTransformation, scaler: Any, delayed: Any = None,
                     rng: jax.Array | None = None, sample_batch: Any = None) -> Any:
  """A TrainState that continues the DeepSpeed run ``ds`` (:func:`read_deepspeed`) in ``plan``.

  The fp32 master becomes the state's truth (its master in mixed precision, its params in fp32;
  compute params are cast from it as the step does), Adam's moments and update count the optax
  Adam state, the scheduler's position the schedule's count, ``global_steps`` the state's step --
  each laid out and sharded by the plan (any stage, any device count, its memory tiers).

  Args:
    plan, target, resources: the plan, the abstract state as checkpoints hold it (leaves with
      their shardings, ``engine.abstract_state()``) and the tiers' resources.
    ds: the DeepSpeed checkpoint.
    convert: ``{torch name: fp32 array} -> params tree`` of the model (names, transposes);
      applied to ``ds.params``, ``ds.exp_avg`` and ``ds.exp_avg_sq`` alike.
    model: the model (:class:`jzero.modeling.model_adapter.ModelAdapter`).
    config: the run's resolved config (its optimizer block is compared with the checkpoint's).
    tx, scaler, delayed: the run's optax transformation, loss scaler and delayed update.
    rng: the key of the training RNG (dropout); default ``jax.random.key(0)``.
    sample_batch: for Linen models, as in ``engine.init``.

  Returns:
    The state, without hpZ's secondary partitions (the engine computes them).

  Raises:
    CheckpointError: ``convert`` does not give the model's tree, or the optimizer has no single
      Adam state -- before any device work.
  """
  master, mu, nu = _converted(model, ds, convert, sample_batch)
  _check_optimizer(config, ds)
  adam_count, schedule_count = ds.step, _schedule_count(ds)

  def opt_state(master, mu, nu):
    fresh = tx.init(master)
    return opt_layout(plan, tx, _with_adam_state(fresh, mu, nu, adam_count, schedule_count,
                                                 ds.directory))

  optimizer = jax.jit(opt_state, out_shardings=shardings_of(target.opt_state))(master, mu, nu)
  model_state = _fresh_model_state(plan, model, target,
                                   jax.random.key(0) if rng is None else rng, sample_batch,
                                   ds.directory)
  return placed_state(plan, target, resources, master, optimizer, scaler=scaler, delayed=delayed,
                      step=ds.global_steps, skipped=ds.skipped_steps, rng=rng,
                      model_state=model_state, where=ds.directory)
