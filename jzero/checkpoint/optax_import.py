"""A plain Flax + optax run continued in jzero: its Orbax checkpoint read (:func:`read_optax`) and
its parameters and optax state placed in an engine's ZeRO plan (:func:`import_optax`).

**What a plain run saves.** Flax's examples and guides save with Orbax's ``CheckpointManager``:
one folder per step, holding either an item per part (``params/``, ``opt_state/``, and for a model
with batch statistics ``batch_stats/``) or one PyTree item holding them all (flax's
``TrainState``: ``{step, params, opt_state, batch_stats...}``). :func:`read_optax` reads either
into host numpy arrays, without a target structure: Orbax then gives an optax state as lists (for
``optax.chain``'s tuples) and dicts (for its NamedTuples), ``None`` for a state without arrays.

**Matching an optax state.** The engine's optimizer (the config's, :mod:`jzero.train.optim`, or
the one given to ``initialize(optimizer=...)``) fixes the state's structure. A given state is
matched to it leaf by leaf by key path, up to stateless stages: within a tuple (``optax.chain``),
positions that hold no array -- ``clip_by_global_norm``, ``add_decayed_weights``, ``identity``,
whose state is empty -- are skipped, and a tuple left with one stateful position is that position
(:func:`canonical_paths`). So ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(s))``
matches the config's AdamW with ``gradient_clipping`` and a scheduler, and ``optax.sgd(s,
momentum)`` the config's SGD, whose chain starts with a weight decay of 0. Anything else -- another
optimizer, a schedule whose count one side lacks, other shapes -- is a :class:`CheckpointError`
naming the first path that differs, before any device work.

**Placing.** :func:`placed_state` is the one place a TrainState is assembled from host trees (the
fp32 truth and a logical optax state, both in the model's shapes): the truth is laid out as the
plan's master (mixed precision; compute params cast from it as the step does) or params (fp32),
every param-like leaf of the optax state as its parameter's master (zero-padded and partitioned by
the plan), each straight into its sharding; the loss scaler starts fresh; then the tiers take what
they hold (:meth:`jzero.Engine.absorb`) and hpZ's secondary partitions are computed.
:mod:`jzero.checkpoint.deepspeed_import` builds its state through it too.

Inputs may be numpy arrays, jax arrays on the engine's devices, or jax arrays committed elsewhere
(plain Orbax restores a single-device run's arrays onto one device): the latter are read to the
host first (:func:`host_or_mesh`).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.core import meta as flax_meta
from jax.sharding import PartitionSpec as P
from jax.tree_util import SequenceKey

from jzero.checkpoint import layout
from jzero.checkpoint.restore import carried, compute_params, shardings_of
from jzero.errors import CheckpointError, JZeroWarning
from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths, path_str
from jzero.tiers import registry
from jzero.tiers.base import Resources

__all__ = ["read_optax", "import_optax", "canonical_paths", "match_tree", "match_optax",
           "opt_layout", "placed_state", "initial_model_state", "host_or_mesh", "pytree_items", "step_folder",
           "restore_numpy", "PYTREE_METADATA"]

PyTree = Any
PYTREE_METADATA = "_METADATA"  # an Orbax PyTree item's own file
_STEP_NAME = re.compile(r"^(?:.*_)?(\d+)$")  # CheckpointManager's "4", flax's "checkpoint_4"


# -- key paths up to stateless stages -------------------------------------------------------------
def canonical_paths(tree: PyTree) -> dict[str, Any]:
  """{path: leaf} of ``tree`` with its sequence positions counted among those holding arrays.

  Within a tuple or list, the positions that hold no leaf (an optax ``EmptyState``, Orbax's
  ``None`` for one) are dropped and the rest renumbered 0, 1, ...; a sequence left with one such
  position adds no path segment at all. Dict keys and NamedTuple fields are kept as they are, so
  an optax state and the lists / dicts Orbax restores it as without a target give the same paths.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  present: dict[tuple, set[int]] = {}
  for path, _ in flat:
    for i, key in enumerate(path):
      if isinstance(key, SequenceKey):
        present.setdefault(path[:i], set()).add(key.idx)
  rank = {prefix: {idx: n for n, idx in enumerate(sorted(found))}
          for prefix, found in present.items()}
  out = {}
  for path, x in flat:
    parts = []
    for i, key in enumerate(path):
      if not isinstance(key, SequenceKey):
        parts.append(path_str((key,)))
      elif len(rank[path[:i]]) > 1:
        parts.append(str(rank[path[:i]][key.idx]))
    out["/".join(parts)] = x
  return out


def _skeleton(paths: list[str], params: set[str]) -> list[str]:
  """``paths`` with every parameter path at their end written ``<params>``, each once: the shape
  of an optax state (``['0/count', '0/mu/<params>', '0/nu/<params>', '1/count']``)."""
  out = []
  for path in paths:
    parts = path.split("/")
    cut = next((i for i in range(len(parts)) if "/".join(parts[i:]) in params), None)
    shown = path if cut is None else "/".join(parts[:cut] + ["<params>"])
    if shown not in out:
      out.append(shown)
  return out


def match_tree(want: dict[str, Any], got: dict[str, Any], what: str, where: str, hint: str,
               params: set[str] | None = None,
               sides: tuple[str, str] = ("the engine's", "the one given"),
               keys: bool = False) -> list[Any]:
  """``got``'s leaves (``keys``: their paths) in ``want``'s order ({path: leaf with a shape}
  both), or a CheckpointError naming the first path that differs (in ``want``'s order, then
  ``got``'s) and ``hint``; with ``params`` (the parameters' paths, for an optimizer state), both
  trees' shapes beside it. ``sides`` name ``want`` and ``got`` in the message."""
  mine, theirs = sides
  differ = None
  for path, x in want.items():
    if path not in got:
      differ = f"{path} {tuple(np.shape(x))} is in {mine} {what}, not in {theirs}"
    elif tuple(np.shape(got[path])) != tuple(np.shape(x)):
      differ = (f"{path} is {tuple(np.shape(got[path]))} in {theirs}, {tuple(np.shape(x))} in "
                f"{mine}")
    if differ:
      break
  extra = [p for p in got if p not in want]
  if differ is None and extra:
    differ = f"{extra[0]} {tuple(np.shape(got[extra[0]]))} is in {theirs}, not in {mine} {what}"
  if differ is not None:
    if params is not None:
      shapes = (f" ({mine}: {_skeleton(list(want), params)}; {theirs}: "
                f"{_skeleton(list(got), params)})")
    else:
      shapes = f" ({mine}: {list(want)[:6]}{' ...' if len(want) > 6 else ''})"
    raise CheckpointError(f"{where}: the {what} does not match {mine}: {differ}{shapes}. {hint}")
  return list(want) if keys else [got[p] for p in want]


def _is_schedule(x: Any) -> bool:
  return isinstance(x, optax.ScaleByScheduleState)


def _without_schedules(tree: PyTree) -> PyTree:
  """``tree`` with its schedules' states (``ScaleByScheduleState``) empty."""
  return jax.tree.map(lambda x: None if _is_schedule(x) else x, tree, is_leaf=_is_schedule)


def match_optax(want: PyTree, got: PyTree, where: str, hint: str, params: set[str],
                sides: tuple[str, str] = ("the engine's", "the one given")) -> list[int | None]:
  """For each leaf of the optax state ``want``, in order, the position of the leaf of ``got``
  that is it (matched by :func:`canonical_paths`), or a CheckpointError naming the first path
  that differs (``params``: the parameters' paths, ``sides``: both trees' names, for the message).

  A learning-rate schedule's count is the one leaf that may be on one side only: jzero's chain
  always ends in ``scale_by_learning_rate(schedule)`` (a constant learning rate is a constant
  schedule), where a plain run with a float learning rate keeps no count. A schedule count ``want``
  has and ``got`` lacks comes out as None (the caller knows the step); one ``got`` has and
  ``want`` lacks is left out.
  """
  numbered = jax.tree.unflatten(jax.tree.structure(got), range(jax.tree.structure(got).num_leaves))

  def attempt(drop: str | None) -> list[int | None]:
    mine = _without_schedules(want) if drop == "mine" else want
    theirs, numbers = ((_without_schedules(got), _without_schedules(numbered)) if drop == "theirs"
                       else (got, numbered))
    found = canonical_paths(numbers)
    order = iter(found[p] for p in match_tree(
        canonical_paths(mine), canonical_paths(theirs), "optimizer state", where, hint, params,
        sides, keys=True))
    gone = jax.tree.leaves(jax.tree.map(
        lambda x: jax.tree.map(lambda _: drop == "mine" and _is_schedule(x), x), want,
        is_leaf=_is_schedule))
    return [None if lacking else next(order) for lacking in gone]

  try:
    return attempt(None)
  except CheckpointError as error:
    for drop in ("mine", "theirs"):  # a schedule count on one side only
      try:
        return attempt(drop)
      except CheckpointError:
        pass
    raise error


# -- inputs anywhere ------------------------------------------------------------------------------
def host_or_mesh(tree: PyTree, devices: Any, what: str) -> PyTree:
  """``tree`` with every jax.Array committed to other devices than exactly ``devices`` read to the
  host (numpy): an array plain Orbax restored onto one device, or one of another mesh. Arrays on
  ``devices`` (in any sharding), uncommitted arrays and host values pass as they are; the
  engine's jits place them."""
  devices = set(devices)

  def fetch(path, x):
    if (not isinstance(x, jax.Array) or not x.committed
        or set(x.sharding.device_set) == devices):
      return x  # host values and uncommitted arrays go wherever the jit puts them
    if not x.is_fully_addressable:
      raise CheckpointError(
          f"{what} {path_str(path) or 'leaf'} is a jax.Array on devices of other processes that "
          f"are not the engine's; give it as numpy, or on the engine's devices.")
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: its raw data moves
      return jax.random.wrap_key_data(np.asarray(jax.random.key_data(x)),
                                      impl=jax.random.key_impl(x))
    return np.asarray(x)

  return jax.tree_util.tree_map_with_path(fetch, tree)


# -- a plain run's Orbax folder -------------------------------------------------------------------
def pytree_items(step_dir: Path) -> dict[str, Path]:
  """The PyTree items of a CheckpointManager step folder, by name."""
  return {p.name: p for p in sorted(step_dir.iterdir())
          if p.is_dir() and (p / PYTREE_METADATA).is_file()}


def step_folder(directory: str | os.PathLike, step: int | None = None) -> tuple[Path, int | None]:
  """(the step folder, its step) of an Orbax checkpoint: ``directory`` itself when it holds
  PyTree items or is one PyTree, else its step folder ``step`` (default: the highest) of a
  ``CheckpointManager`` directory (folders named by the step, ``4`` or ``checkpoint_4``)."""
  root = Path(directory).absolute()
  if not root.is_dir():
    raise CheckpointError(f"Orbax checkpoint {str(directory)!r} does not exist.")
  named = _STEP_NAME.match(root.name)
  if pytree_items(root) or (root / PYTREE_METADATA).is_file():
    if step is not None and (named is None or int(named.group(1)) != step):
      raise CheckpointError(f"{root} is one checkpoint's folder, not step {step}'s.")
    return root, int(named.group(1)) if named else None
  steps = {int(m.group(1)): p for p in root.iterdir()
           if p.is_dir() and (m := _STEP_NAME.match(p.name)) and ".orbax-checkpoint-tmp" not in
           p.name and (pytree_items(p) or (p / PYTREE_METADATA).is_file())}
  if not steps:
    listed = sorted(p.name for p in root.iterdir())[:12]
    raise CheckpointError(
        f"{root} is not an Orbax checkpoint: no PyTree item ({PYTREE_METADATA}) in it or in a "
        f"step folder of it. It holds {listed}. Give a CheckpointManager's directory or one of "
        f"its step folders.")
  if step is None:
    step = max(steps)
  if step not in steps:
    raise CheckpointError(f"{root} has no step {step}; its steps: {sorted(steps)}.")
  return steps[step], step


def restore_numpy(item: Path) -> PyTree:
  """An Orbax PyTree item as it was saved, every array as numpy (no target structure: tuples
  come back as lists, NamedTuples as dicts, empty states as None)."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    structure = handler.metadata(item).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), structure)
    return ocp.Checkpointer(handler).restore(item, args=ocp.args.PyTreeRestore(
        item=structure, restore_args=args))
  except Exception as e:
    raise CheckpointError(f"{item}: the Orbax checkpoint cannot be read: {type(e).__name__}: "
                          f"{e}") from e


def read_optax(directory: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
  """A plain Flax + optax run's Orbax checkpoint as ``{"params", "opt_state", "step", ...}``, host
  numpy arrays: what :func:`import_optax` (``engine.import_optax(**read_optax(dir))``) takes.

  ``directory`` is a ``CheckpointManager`` directory (its ``step``, default the latest) or one
  step's folder: items ``params`` and ``opt_state`` (and others beside them, e.g.
  ``batch_stats``), or one PyTree item holding a dict with them (flax's ``TrainState`` saved with
  ``StandardSave``), or a step folder that is itself one PyTree (flax's older
  ``checkpoints.save_checkpoint``). ``step`` is the tree's own ``step`` where it has one, else the
  step folder's number. Every other top-level entry that holds arrays is returned beside them
  (the model's variable collections, for ``import_optax``'s ``collections``).
  """
  folder, number = step_folder(directory, step)
  if layout.is_complete(folder) or (folder / layout.FILES_FILE).exists():
    raise CheckpointError(f"{folder} is a jzero checkpoint, not a plain run's: restore it with "
                          f"engine.load_checkpoint.")
  items = pytree_items(folder)
  if "params" in items:
    tree = {name: restore_numpy(path) for name, path in items.items()}
  elif (folder / PYTREE_METADATA).is_file() or len(items) == 1:
    tree = restore_numpy(folder if not items else next(iter(items.values())))
  else:
    tree = None
  if not isinstance(tree, dict) or "params" not in tree or "opt_state" not in tree:
    found = sorted(tree) if isinstance(tree, dict) else sorted(items)
    raise CheckpointError(
        f"{folder} holds {found}, not a plain run's params and opt_state: save them as items "
        f"(ocp.args.Composite(params=..., opt_state=...)) or as one PyTree holding both.")
  out = {"params": tree["params"], "opt_state": tree["opt_state"]}
  step = tree.get("step", number)
  if step is not None:
    out["step"] = int(np.asarray(step))
  out.update((k, v) for k, v in tree.items()  # collections; empty entries (None) dropped
             if k not in ("params", "opt_state", "step") and jax.tree.leaves(v))
  return out


# -- placing host trees in the plan ---------------------------------------------------------------
def opt_layout(plan: Plan, tx: optax.GradientTransformation, opt_state: PyTree) -> PyTree:
  """A logical optax state of ``tx`` (traced) laid out as ``plan``'s optimizer state: every
  parameter's twin (:mod:`jzero.sharding.opt_layout`) as its parameter's master (zero-padded where
  partitioned); counts and other leaves as they are."""
  opt = OptLayout.of(plan, tx)
  leaves = opt.treedef.flatten_up_to(opt_state)
  return jax.tree.unflatten(opt.treedef, [
      l.twin.to_padded(x) if l.twin is not None and l.twin.state_partitioned else x
      for l, x in zip(opt.leaves, leaves)])


def train_rng(rng: jax.Array | None) -> jax.Array:
  """Raw key data of the training key ``engine.init(rng)`` would hold (``split(rng)[1]``, see
  :func:`jzero.train.setup.train_key`); ``rng`` defaults to ``jax.random.key(0)``."""
  return jax.random.key_data(jax.random.split(jax.random.key(0) if rng is None else rng)[1])


def placed_state(plan: Plan, target: Any, resources: Resources, master: PyTree,
                 optimizer: PyTree, *, scaler: Any, delayed: Any, step: int, skipped: int,
                 rng: jax.Array | None, model_state: PyTree, where: Any) -> Any:
  """The TrainState of ``plan`` from its fp32 truth and its placed optimizer state.

  Args:
    plan: the plan.
    target: the abstract TrainState as checkpoints hold it, its leaves with their shardings
      (``engine.abstract_state()``).
    resources: the plan's tiers' resources (what they keep outside the state goes there).
    master: the fp32 truth in the model's params structure and logical shapes (numpy or jax).
    optimizer: the optimizer state, already laid out and placed (:func:`opt_layout`).
    scaler, delayed: the run's loss scaler (a fresh scale) and delayed update (None: off).
    step, skipped: the state's counts.
    rng: the key of the training RNG (default ``jax.random.key(0)``).
    model_state: the model's non-parameter state (``{collection: tree}``, ``{}`` for none), in
      the abstract state's structure; placed replicated.
    where: what the state comes from, for messages.

  Returns:
    The state, without hpZ's secondary partitions (the engine computes them).
  """
  shardings = shardings_of(target)
  to_f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

  def state_layout(leaf: LeafPlan, x: jax.Array) -> jax.Array:
    return leaf.to_padded(x) if leaf.state_partitioned else x

  def param_layout(leaf: LeafPlan, x: jax.Array) -> jax.Array:
    return leaf.to_padded(x) if leaf.param_partitioned else x

  if plan.has_master:
    master = jax.jit(lambda m: plan.map(state_layout, to_f32(m)),
                     out_shardings=shardings.master)(master)
    params = compute_params(plan, master, shardings.params)
  else:
    params = jax.jit(lambda m: plan.map(param_layout, to_f32(m)),
                     out_shardings=shardings.params)(master)
    master = None
  replicated = plan.sharding(P())
  scalar = lambda n: jax.device_put(jnp.asarray(n, jnp.int32), replicated)
  state = type(target)(
      step=scalar(step), skipped=scalar(skipped), params=params, master=master,
      opt_state=optimizer, loss_scale=jax.device_put(scaler.init(), replicated),
      rng=jax.device_put(train_rng(rng), replicated),
      model_state=jax.device_put(jax.tree.map(jnp.asarray, model_state), replicated),
      delayed=carried(delayed, target, {}, {}, True, where))
  # e.g. the NVMe tier: into the store, placeholders in the state
  return registry.absorb(registry.active(plan), plan, resources, state)


# -- import_optax ---------------------------------------------------------------------------------
_HINT = ("Give the state of the optax optimizer the engine runs: engine.tx (the config's "
         "optimizer and scheduler blocks build it, jzero/train/optim.py; "
         "docs/coming-from-flax.md, 'Continue a Flax or optax run', lists the optax call of "
         "each), or pass your own to jzero.initialize(optimizer=...). Stateless stages "
         "(clip_by_global_norm, add_decayed_weights, identity) may differ.")


def _truth(model: PyTree, params: PyTree, where: str) -> PyTree:
  """``params`` (by the module's names or the params tree's own paths) in ``model``'s structure."""
  got = flatten_paths(params)
  names = layout.leaf_names(model, got)
  want = {names[p]: x for p, x in flatten_paths(model).items()}
  leaves = match_tree(want, got, "params tree", where,
                      "Give the model's parameters (its params collection, as module.init "
                      "returns it, or nnx.to_pure_dict of its nnx.Param state).")
  return jax.tree.unflatten(jax.tree.structure(model), leaves)


def _opt_state(tx: optax.GradientTransformation, model: PyTree, opt_state: PyTree,
               step: int | None, where: str) -> tuple[PyTree, int]:
  """(``opt_state``'s leaves in the structure of ``tx.init(params)``, logical shapes; the step).
  A schedule count the given state lacks (a constant learning rate) is the step."""
  structure = jax.eval_shape(tx.init, model)
  plain = jax.eval_shape(tx.init, flax_meta.unbox(model))  # the same leaves, by names
  given = jax.tree.leaves(opt_state)
  positions = match_optax(plain, opt_state, where, _HINT,
                          set(flatten_paths(flax_meta.unbox(model))))
  step = _count(opt_state, where) if step is None else int(np.asarray(step))
  leaves = [np.asarray(step, np.int32) if i is None else given[i] for i in positions]
  return jax.tree.unflatten(jax.tree.structure(structure), leaves), step


def _count(opt_state: PyTree, where: str) -> int:
  """The optax state's update count: every ``count`` leaf of it, which must agree (0: none)."""
  counts = {int(np.asarray(x)) for p, x in canonical_paths(opt_state).items()
            if p.rsplit("/", 1)[-1] == "count" and np.ndim(x) == 0}
  if len(counts) > 1:
    raise CheckpointError(f"{where}: the optimizer state's counts {sorted(counts)} differ; pass "
                          f"the steps the run took as step=.")
  return counts.pop() if counts else 0


def initial_model_state(plan: Plan, adapter: Any, target: Any, key: jax.Array,
                        sample_batch: Any) -> PyTree:
  """The model's initial non-parameter state (``module.init(key)``'s, ``{}`` for a model without
  one), replicated; ``adapter``: the model (:class:`jzero.modeling.model_adapter.ModelAdapter`)."""
  if not jax.tree.leaves(target.model_state):
    return {}
  return jax.jit(lambda k: adapter.init_variables(k, sample_batch)[1],
                 out_shardings=plan.sharding(P()))(key)


def _model_state(plan: Plan, adapter: Any, abstract: Any, collections: dict[str, PyTree],
                 where: str, key: jax.Array, sample_batch: Any) -> PyTree:
  """The model's non-parameter variables (Linen collections such as ``batch_stats``) given beside
  params and opt_state, matched to the model's (``abstract.model_state``, ``{collection: tree}``)
  leaf by leaf; a collection the model has and the checkpoint lacks starts at its initial values,
  which a warning says."""
  want = abstract.model_state
  extra = sorted(set(collections) - set(want))
  if extra:
    have = f"its collections are {sorted(want)}" if want else "it has none besides params"
    raise CheckpointError(
        f"{where}: holds {extra} beside params and opt_state, which are not the model's "
        f"variable collections ({have}). Drop what is not the model's (e.g. flax's "
        f"DynamicScale: jzero's loss scaler starts fresh).")
  missing = sorted(set(want) - set(collections))
  fresh = initial_model_state(plan, adapter, abstract, key, sample_batch) if missing else {}
  if missing:
    warnings.warn(
        f"{where}: no {missing} given for the model's state; it starts at the model's initial "
        f"values. Pass them beside params (import_optax(params, opt_state, batch_stats=...)).",
        JZeroWarning, stacklevel=3)
  out = {}
  for name, tree in want.items():
    if name not in collections:
      out[name] = fresh[name]
      continue
    leaves = match_tree(flatten_paths(tree), flatten_paths(collections[name]),
                        f"{name!r} collection", where,
                        f"Give the model's {name!r} collection as module.init returns it.")
    out[name] = jax.tree.unflatten(jax.tree.structure(tree),
                                   [np.asarray(x, t.dtype) for x, t in
                                    zip(leaves, jax.tree.leaves(tree))])
  return out


def import_optax(plan: Plan, target: Any, resources: Resources, params: PyTree,
                 opt_state: PyTree, *, model: Any, tx: optax.GradientTransformation, scaler: Any,
                 delayed: Any = None, step: int | None = None, rng: jax.Array | None = None,
                 sample_batch: Any = None, **collections: PyTree) -> Any:
  """A TrainState that continues a plain optax run in ``plan``, at any stage and device count.

  ``params`` become the state's fp32 truth (its master in mixed precision, its params in fp32;
  compute params are cast from it as the step does), ``opt_state`` its optimizer state -- each
  laid out and sharded by the plan, so the next step's update is the one the plain loop would
  have made (the schedule reads the optax state's own count).

  Args:
    plan, target, resources: the plan, the abstract state as checkpoints hold it (leaves with
      their shardings, ``engine.abstract_state()``) and the tiers' resources.
    params: the model's parameters, by the module's names (numpy, or jax arrays anywhere).
    opt_state: the state of the optax optimizer the run uses (``tx``), as optax made it or as
      Orbax restored it without a target; matched up to stateless stages (module docstring).
    model: the model (:class:`jzero.modeling.model_adapter.ModelAdapter`).
    tx, scaler, delayed: the run's optax transformation, loss scaler (it starts fresh) and
      delayed update (None: off; nothing is carried).
    step: the optimizer steps the run took (the state's ``step``; checkpoints and the data loader
      count from it). Default: the optax state's update count, 0 if it has none.
    rng: the key of the training RNG (dropout), as ``engine.init``'s; default
      ``jax.random.key(0)``.
    sample_batch: for Linen models, as in ``engine.init``.
    **collections: the model's other variable collections (e.g. ``batch_stats``), as a plain
      checkpoint holds them beside ``params``.

  Returns:
    The state, without hpZ's secondary partitions (the engine computes them).

  Raises:
    CheckpointError: a params tree or optimizer state that does not match the run's (naming the
      first path that differs) -- before any device work.
  """
  where = "import_optax"
  abstract_params = model.abstract_params(jax.random.key(0), sample_batch)
  devices = list(plan.mesh.mesh.devices.flat)
  master = _truth(abstract_params, host_or_mesh(params, devices, "params"), where)
  given = host_or_mesh(opt_state, devices, "opt_state")
  optimizer, step = _opt_state(tx, abstract_params, given, step, where)
  model_state = _model_state(plan, model, target,
                             host_or_mesh(collections, devices, "model state"), where,
                             jax.random.key(0) if rng is None else rng, sample_batch)
  dtypes = jax.tree.map(lambda x: x.dtype, target.opt_state)
  placed = jax.jit(lambda o: jax.tree.map(lambda x, d: x.astype(d), opt_layout(plan, tx, o),
                                          dtypes),
                   out_shardings=shardings_of(target.opt_state))(optimizer)
  return placed_state(plan, target, resources, master, placed, scaler=scaler, delayed=delayed,
                      step=step, skipped=0, rng=rng, model_state=model_state, where=where)
