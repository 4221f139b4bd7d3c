"""A jzero checkpoint written out as a plain Flax + optax run's: :func:`export_optax`.

The output is what flax's examples save with Orbax's ``CheckpointManager``: ``OUT/<step>/`` with
the items ``params`` (the fp32 truth -- the master in mixed precision -- in the model's logical
shapes, named as the module names its parameters) and ``opt_state`` (the optax state, param-like
leaves cut to their parameter's logical shape), each a ``StandardSave`` PyTree. A script that never
imports jzero restores it with its own target, ``mngr.restore(step, args=ocp.args.Composite(
params=ocp.args.StandardRestore(params), opt_state=ocp.args.StandardRestore(tx.init(params))))``,
and continues the run: the optax state is written in the structure of ``like`` -- the plain
script's own optax transformation, matched to the run's up to stateless stages
(:func:`jzero.checkpoint.optax_import.canonical_paths`) -- or, by default, of the run's optimizer.
A run's other variable collections go beside ``params`` as items of their own.

:func:`jzero.checkpoint.import_optax` reads it back bit for bit (``jzero convert DIR --optax OUT``
then ``engine.import_optax(**read_optax(OUT))``). The host holds the whole state once while it is
written (Orbax writes one PyTree in one call).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from jzero.checkpoint import layout
from jzero.checkpoint.optax_import import match_optax
from jzero.checkpoint.restore import _root_cause
from jzero.errors import CheckpointError
from jzero.sharding.plan import flatten_paths

__all__ = ["export_optax"]

PyTree = Any


def _stored_opt_names(meta: dict, optimizer: optax.GradientTransformation, by_path: PyTree,
                      step_dir: Path) -> list[str]:
  """The stored array names of ``optimizer``'s state, in its leaves' order, checked against the
  arrays the checkpoint holds (the run's optimizer must be ``optimizer``)."""
  stored = [n for n in meta["arrays"] if n.startswith("opt_state/")]
  names = ["opt_state/" + p for p in flatten_paths(jax.eval_shape(optimizer.init, by_path))]
  if set(names) != set(stored):
    lacking = sorted(set(stored) - set(names))[:4]
    unused = sorted(set(names) - set(stored))[:4]
    raise CheckpointError(
        f"checkpoint {step_dir} holds the state of another optimizer than the one given "
        f"({layout.optimizer_name(meta['config'])} in its config): "
        + "; ".join(([f"it holds {lacking}, which the optimizer does not make"] if lacking else [])
                    + ([f"it lacks {unused}"] if unused else []))
        + ". Give the optax transformation the run trained with (engine.tx).")
  return names


def _read(step_dir: Path, names: list[str]) -> dict[str, np.ndarray]:
  """The stored arrays ``names`` of the checkpoint's ``state`` item, whole, as numpy."""
  args = ocp.args.PyTreeRestore(
      item=layout.nest({n: 0 for n in names}), partial_restore=True,
      restore_args=layout.nest({n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}))
  try:
    return flatten_paths(ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
        step_dir / "state", args=args))
  except Exception as e:
    raise CheckpointError(f"checkpoint {step_dir}: its arrays cannot be read: "
                          f"{_root_cause(e)}") from e


def export_optax(directory: str | os.PathLike, out: str | os.PathLike,
                 optimizer: optax.GradientTransformation, *, tag: str | int | None = None,
                 like: optax.GradientTransformation | None = None) -> Path:
  """Writes a jzero checkpoint as a plain run's ``CheckpointManager`` step ``OUT/<step>``:
  items ``params`` and ``opt_state`` (module docstring); returns the step folder.

  Args:
    directory: a jzero checkpoint directory (or one checkpoint's directory).
    out: the ``CheckpointManager`` directory to write into (created if needed); its step folder
      for the checkpoint's step must not exist yet.
    optimizer: the optax transformation the run trained with (``engine.tx``: the config's
      optimizer, or the one given to ``initialize(optimizer=...)``).
    tag: the checkpoint (default: ``latest``).
    like: the optax transformation of the script that will restore it, whose state structure to
      write (default: ``optimizer``'s); its state must match the run's up to stateless stages.

  Raises:
    CheckpointError: the checkpoint is damaged, its optimizer state is not ``optimizer``'s, or
      ``like``'s state differs -- before anything is written.
  """
  step_dir, meta = layout.open_checkpoint(directory, tag)
  step = int(meta["step"])
  target = Path(out).absolute() / str(step)
  if target.exists():
    raise CheckpointError(f"{target} already exists; remove it or choose another output path.")
  leaves = meta["leaves"]
  shapes = {leaf["path"]: tuple(leaf["shape"]) for leaf in leaves}
  names = {leaf["path"]: leaf.get("name", leaf["path"]) for leaf in leaves}
  spec = lambda shape: jax.ShapeDtypeStruct(shape, np.float32)
  by_path = layout.nest({p: spec(s) for p, s in shapes.items()})
  by_name = layout.nest({names[p]: spec(s) for p, s in shapes.items()})
  stored = _stored_opt_names(meta, optimizer, by_path, step_dir)
  plain = jax.eval_shape((like or optimizer).init, by_name)
  run = jax.eval_shape(optimizer.init, by_name)  # ``stored``'s leaves, params unboxed
  positions = match_optax(
      plain, run, f"checkpoint {step_dir}",
      "like= must be an optax transformation whose state is the run's (up to stateless stages "
      "such as clip_by_global_norm).", set(names.values()), ("like's", "the checkpoint's"))
  if None in positions:  # like's schedule count, which the run's optimizer does not keep
    raise CheckpointError(f"checkpoint {step_dir}: like= keeps a learning-rate schedule's count, "
                          f"which the run's optimizer does not; give like= as the run trained.")
  opt_names = [stored[i] for i in positions]
  truth = "master" if meta["has_master"] else "params"
  # model_state seam: the model's other variable collections, stored as `model_state/<collection>/
  # <path>` once TrainState has `model_state`, are written as items beside params.
  collections = [n for n in meta["arrays"] if n.startswith("model_state/")]
  arrays = _read(step_dir, [f"{truth}/{p}" for p in shapes] + opt_names + collections)

  def logical(name: str) -> np.ndarray:  # a partitioned leaf's padding cut off
    leaf = meta["arrays"][name]["leaf"]
    x = arrays[name]
    return x if leaf is None else x[tuple(slice(0, n) for n in shapes[leaf])]

  params = layout.nest({names[p]: logical(f"{truth}/{p}") for p in shapes})
  opt_state = jax.tree.unflatten(jax.tree.structure(plain), [logical(n) for n in opt_names])
  items = {"params": ocp.args.StandardSave(params), "opt_state": ocp.args.StandardSave(opt_state)}
  items.update((c, ocp.args.StandardSave(tree)) for c, tree in layout.nest(
      {n.removeprefix("model_state/"): arrays[n] for n in collections}).items())
  manager = ocp.CheckpointManager(Path(out).absolute())
  try:
    manager.save(step, args=ocp.args.Composite(**items))
    manager.wait_until_finished()
  finally:
    manager.close()
  return target
