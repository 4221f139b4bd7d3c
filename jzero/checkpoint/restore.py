"""Restoring: a checkpoint of any stage, device count, mesh or precision into a plan.

:func:`load_checkpoint` rebuilds a TrainState for a plan, from what it is given explicitly: the
plan, the *target* (the abstract state as checkpoints hold it, each leaf with its sharding), the
tiers' resources, and the optax transformation, loss scaler and delayed update the state is for. A partitioned leaf is zero-padded
at the end of its shard dimension, and the padding stays zero through training, so a leaf laid out
for one plan becomes the leaf of another by taking its logical region and zero-padding for the new
plan. Orbax does exactly that per dimension when asked for a different global shape
(``ArrayRestoreArgs(strict=False)``: it reads the intersection of the stored and requested regions
into zeros), and it reads every array straight into its target sharding, so each device reads only
its own shard and no device ever holds a full copy. The checkpoint's *truth* -- the fp32 master in
mixed precision, the fp32 params in fp32 training -- becomes the new truth; in mixed precision the
compute params are cast from it as the train step would. Every file is checked against its recorded
size and checksum, and shapes, leaf paths and the optimizer-state structure against the engine,
before any device work. ``params_only=True`` restores weights alone, with a fresh optimizer state.
What a tier keeps outside the train state's arrays (the NVMe store) is restored in its real shape
and handed to the tier (:func:`jzero.tiers.registry.absorb`).
ZeRO++ hpZ's secondary partitions are not in a checkpoint: they are a function of the compute
params, recomputed after the restore by the code the step refreshes them with (the engine does),
so a resumed run is bit-exact. The delayed update's carried gradient (:mod:`jzero.tiers.delayed`) is restored like
the master when both the checkpoint and the engine have it; otherwise nothing is carried. The
model's state besides its parameters (``model_state``: BatchNorm's statistics) is replicated and
restored as it was saved, with the weights (``params_only`` too); it must be the model's.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from jzero.checkpoint import layout
from jzero.errors import CheckpointError, JZeroWarning
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths
from jzero.tiers import registry
from jzero.tiers.base import Resources

__all__ = ["load_checkpoint", "shardings_of", "compute_params", "carried"]

PyTree = Any


def shardings_of(target: PyTree) -> PyTree:
  """The shardings of ``target``'s ShapeDtypeStructs, in its structure."""
  return jax.tree.map(lambda x: x.sharding, target)


def _some(paths: list[str], shown: int = 5) -> str:
  """The first ``shown`` paths, and how many more."""
  more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
  return f"{paths[:shown]}{more}"


def _check_model(meta: dict, plan: Plan, model_state: dict[str, jax.ShapeDtypeStruct],
                 step_dir: Path) -> None:
  """The checkpoint's leaves are the model's: same paths, same logical shapes; so are the arrays
  of its model state (``model_state``: the engine's, by stored name)."""
  saved = {leaf["path"]: tuple(leaf["shape"]) for leaf in meta["leaves"]}
  saved.update((name, tuple(a["shape"])) for name, a in meta["arrays"].items()
               if name.startswith("model_state/"))
  want = {leaf.path: leaf.shape for leaf in plan.leaf_list()}
  want.update((name, x.shape) for name, x in model_state.items())
  missing, unexpected = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"the model's leaves {_some(missing)} are not in it")
    if unexpected:
      parts.append(f"it holds leaves {_some(unexpected)} the model does not have")
    raise CheckpointError(
        f"checkpoint {step_dir} was written for another model: {', and '.join(parts)}. Restore "
        f"it into the model it was saved from (jzero inspect {step_dir.parent} lists its leaves), "
        f"or import only the weights that match with checkpoint.load_weights.")
  bad = [f"{p}: {saved[p]} in the checkpoint, {want[p]} in the model" for p in want
         if saved[p] != want[p]]
  if bad:
    raise CheckpointError(f"checkpoint {step_dir} does not fit the model's shapes: "
                          f"{'; '.join(bad[:5])}.")


def _check_optimizer(meta: dict, config: Any, targets: dict[str, jax.ShapeDtypeStruct],
                     leaves: dict[str, LeafPlan | None], step_dir: Path) -> None:
  """The stored optimizer state has the structure and shapes of the run's optimizer (``config``:
  the run's resolved config)."""
  saved = {n: a for n, a in meta["arrays"].items() if n.startswith("opt_state/")}
  want = {n for n in targets if n.startswith("opt_state/")}
  hint = ("Pass params_only=True to restore the weights alone, with a fresh optimizer state "
          "starting at step 0.")
  if set(saved) != want:
    lacking, unused = sorted(want - set(saved)), sorted(set(saved) - want)
    found = ([f"it lacks {lacking[:4]}"] if lacking else []) + (
        [f"it holds {unused[:4]}, which this engine's optimizer does not use"] if unused else [])
    raise CheckpointError(
        f"checkpoint {step_dir} holds the state of another optimizer "
        f"({layout.optimizer_name(meta['config'])}; this engine: "
        f"{layout.optimizer_name(config.to_dict())}): {'; '.join(found)}. {hint}")
  for name in sorted(want):
    leaf, entry = leaves[name], saved[name]
    if (entry["leaf"] is None) != (leaf is None):
      raise CheckpointError(f"checkpoint {step_dir}: optimizer state {name} is laid out "
                            f"differently in the checkpoint and in the engine's optimizer. {hint}")
    if leaf is None and tuple(entry["shape"]) != targets[name].shape:
      raise CheckpointError(f"checkpoint {step_dir}: optimizer state {name} has shape "
                            f"{tuple(entry['shape'])}, the engine's optimizer "
                            f"{targets[name].shape}. {hint}")


def _check_batch_size(meta: dict, config: Any, step_dir: Path) -> None:
  """Resuming with another global batch size is allowed, and said (DeepSpeed's elastic rules)."""
  saved = meta.get("global_batch_size", meta["config"].get("train_batch_size"))
  size = config.train_batch_size
  if saved is not None and saved != size:
    warnings.warn(
        f"checkpoint {step_dir} was trained with a global batch of {saved} samples per step; "
        f"this engine uses {size}. Training continues from optimizer step "
        f"{meta['data_position']['step']}: the LR schedule and the data position count optimizer "
        f"steps, so from here on each step sees {size} samples instead of {saved}.",
        JZeroWarning, stacklevel=4)


def _root_cause(error: BaseException) -> str:
  """The innermost error's message: tensorstore's names the stored array and the file."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  return f"{type(error).__name__}: {error}"


def _restore_arrays(step_dir: Path, requests: dict[str, tuple[str, jax.ShapeDtypeStruct]]
                    ) -> dict[str, jax.Array]:
  """Reads stored arrays of the ``state`` item into target global shapes and shardings.

  Args:
    step_dir: the step directory.
    requests: target name -> (stored name, target ShapeDtypeStruct with its sharding).
  """
  by_source = {src: target for src, target in requests.values()}
  args = {src: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype,
                                    strict=False) for src, t in by_source.items()}
  try:
    restored = flatten_paths(ocp.Checkpointer(layout.array_handler()).restore(
        step_dir / "state", args=ocp.args.PyTreeRestore(
            item=layout.nest(by_source), restore_args=layout.nest(args), partial_restore=True)))
  except Exception as e:
    raise CheckpointError(f"checkpoint {step_dir}: its arrays cannot be read: "
                          f"{_root_cause(e)}") from e
  # Orbax may hand back device arrays for a host-memory target (marin#8441): move those leaf by
  # leaf into the target's memory kind (ZeRO-Offload's host tier, jzero.tiers.host_optimizer).
  def placed(x: jax.Array, want: jax.sharding.Sharding) -> jax.Array:
    same = getattr(x.sharding, "memory_kind", None) == getattr(want, "memory_kind", None)
    return x if same or want.memory_kind is None else jax.device_put(x, want)
  return {target: placed(restored[src], t.sharding) for target, (src, t) in requests.items()}


def compute_params(plan: Plan, master: PyTree, shardings: PyTree) -> PyTree:
  """Compute params cast from the fp32 master, laid out as the plan's params (as the step does)."""

  def to_param(leaf: LeafPlan, x: jax.Array) -> jax.Array:
    x = leaf.to_logical(x)
    return (leaf.to_padded(x) if leaf.param_partitioned else x).astype(plan.compute_dtype)

  return jax.jit(lambda m: plan.map(to_param, m), out_shardings=shardings)(master)


def _fresh_opt_state(plan: Plan, tx: Any, truth: PyTree, shardings: PyTree) -> PyTree:
  """``tx.init`` on the truth laid out as the master (params_only restores)."""

  def to_state(leaf: LeafPlan, x: jax.Array) -> jax.Array:
    x = leaf.to_logical(x)
    return leaf.to_padded(x) if leaf.state_partitioned else x

  return jax.jit(lambda t: tx.init(plan.map(to_state, t)), out_shardings=shardings)(truth)


def carried(delayed: Any, target: Any, read: dict, stored: dict, params_only: bool,
            where: Any) -> Any:
  """The restored state's carried field (``TrainState.delayed``): the delayed update's
  (:meth:`jzero.tiers.delayed.DelayedUpdate.restored`), or None -- with a warning when the
  checkpoint carries a gradient this run does not use."""
  if delayed is not None:
    return delayed.restored(target, read, stored, params_only)
  if not params_only and any(n.startswith("delayed/") for n in stored):
    warnings.warn(
        f"checkpoint {where} carries a delayed-update gradient (saved with "
        f"offload_optimizer.delayed_update: true) that this engine does not use: it is dropped, "
        f"and training continues with plain updates from the saved parameters.",
        JZeroWarning, stacklevel=4)
  return None


def load_checkpoint(plan: Plan, target: Any, resources: Resources,
                    directory: str | os.PathLike, tag: str | int | None = None, *, config: Any,
                    tx: Any, scaler: Any, delayed: Any = None, params_only: bool = False,
                    with_client_state: bool = False) -> Any:
  """Restores a checkpoint into ``plan``'s placement, whatever stage / mesh / precision wrote it.

  Every array is read directly into its target sharding (each device reads only its shard). The
  checkpoint's fp32 truth (master in mixed precision, params in fp32) becomes the state's;
  compute params are cast from it. The loss-scaler state is kept when both runs use the same
  precision, else it starts fresh. A checkpoint written with another global batch size restores
  with a warning naming both sizes (the data position and the LR schedule count optimizer steps).

  Args:
    plan: the plan to restore into.
    target: the abstract TrainState as checkpoints hold it, each leaf a ShapeDtypeStruct with its
      sharding (``engine.abstract_state()``; no hpZ secondary).
    resources: the plan's tiers' resources (what they keep outside the state is written there).
    directory: a checkpoint directory (or one checkpoint's directory); may be relative.
    tag: the checkpoint to restore (its directory name, e.g. a step or "epoch_3"; default: the
      one ``latest`` names).
    config: the run's resolved config (its precision, optimizer and batch size are checked).
    tx: the run's optax transformation (a ``params_only`` restore's fresh state).
    scaler: the run's loss scaler (a fresh loss scale).
    delayed: the run's delayed update (its carried gradient is restored), or None.
    params_only: restore the weights (and the model state, e.g. BatchNorm's statistics) alone:
      optimizer state, step, skipped count and loss scale start fresh (as after
      ``engine.init``); the training RNG is the checkpoint's. For another optimizer, or
      fine-tuning from a training checkpoint.
    with_client_state: return ``(state, client_state)``, the dict given to ``save_checkpoint``.

  Returns:
    The state (without hpZ's secondary partitions), or ``(state, client_state)``.

  Raises:
    CheckpointError: missing / incomplete / corrupt checkpoint (naming the file), another model
      (leaf paths or shapes), or another optimizer without ``params_only`` -- before any device
      work.
  """
  step_dir, meta = layout.open_checkpoint(directory, tag)
  shardings = shardings_of(target)
  targets = flatten_paths(target)
  model_state = {n: x for n, x in targets.items() if n.startswith("model_state/")}
  _check_model(meta, plan, model_state, step_dir)
  leaves = layout.opt_leaves(plan, tx)
  if not params_only:
    _check_optimizer(meta, config, targets, leaves, step_dir)
    _check_batch_size(meta, config, step_dir)

  truth = "master" if meta["has_master"] else "params"
  into = "master" if plan.has_master else "params"
  requests = {f"{into}/{leaf.path}": (f"{truth}/{leaf.path}", targets[f"{into}/{leaf.path}"])
              for leaf in plan.leaf_list()}
  replicated = plan.sharding(P())
  stored = meta["arrays"]
  rng = stored["rng"]
  requests["rng"] = ("rng", jax.ShapeDtypeStruct(tuple(rng["shape"]), np.dtype(rng["dtype"]),
                                                  sharding=replicated))
  requests.update((name, (name, t)) for name, t in model_state.items())
  same_precision = meta["precision"] == config.precision
  if not params_only:
    for name, t in targets.items():
      if name in ("step", "skipped") or name.startswith("opt_state/") or (
          name.startswith("loss_scale/") and same_precision):
        requests[name] = (name, t)
  for name in (delayed.restore_names(target, stored, params_only) if delayed else []):
    requests[name] = (name, targets[name])
  restored = _restore_arrays(step_dir, requests)

  def group(prefix: str, tree: PyTree) -> PyTree:
    names = [n for n in targets if n.startswith(prefix + "/")]
    return jax.tree.unflatten(jax.tree.structure(tree), [restored[n] for n in names])

  weights = group(into, getattr(target, into))
  if plan.has_master:
    master, params = weights, compute_params(plan, weights, shardings.params)
  else:
    master, params = None, weights
  if params_only:
    zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), replicated)  # two buffers: donated
    state = type(target)(step=zero(), skipped=zero(), params=params, master=master,
                         opt_state=_fresh_opt_state(plan, tx, weights, shardings.opt_state),
                         loss_scale=jax.device_put(scaler.init(), replicated),
                         rng=restored["rng"],
                         model_state=group("model_state", target.model_state),
                         delayed=carried(delayed, target, restored, stored, True, step_dir))
  else:
    loss_scale = (group("loss_scale", target.loss_scale) if same_precision
                  else jax.device_put(scaler.init(), replicated))
    state = type(target)(step=restored["step"], skipped=restored["skipped"], params=params,
                         master=master, opt_state=group("opt_state", target.opt_state),
                         loss_scale=loss_scale, rng=restored["rng"],
                         model_state=group("model_state", target.model_state),
                         delayed=carried(delayed, target, restored, stored, False, step_dir))
  # e.g. the NVMe tier: into the store, placeholders in the state
  state = registry.absorb(registry.active(plan), plan, resources, state)
  return (state, meta["client_state"]) if with_client_state else state
