"""Gather units: which parameters ZeRO-3 gathers together, and where -- for any Flax model.

DeepSpeed's ZeRO-3 works on a PyTorch model as written: a hook gathers a module's parameters just
before the module runs and frees them after; backward gathers them again. jzero does the same for
Flax models written the ordinary way (``for block in self.blocks: x = block(x)``), with no change
to the model's code. A *unit* is a module whose parameters are gathered together:

**How units are chosen** (from the module tree, before any device work; the plan records the unit
of every leaf, see :class:`jzero.sharding.plan.LeafPlan`):

1. A module named by ``zero_optimization.leaf_module`` -- by class (``classes``: the class name or
   its dotted path), by path (``names``) or by path suffix (``name_suffixes``) -- is one unit with
   its whole subtree: DeepSpeed's leaf modules, FSDP2's per-block ``fully_shard``.
2. With ``stage3_module_granularity_threshold`` > 0, a module whose granularity -- its parameter
   count / (1 + its number of descendant modules), DeepSpeed's formula -- is below the threshold
   is one unit with its subtree (many small modules fetched as one).
3. Otherwise every module that owns parameters and has no descendant owning parameters is a unit
   (``Linear``, ``Embed``, ``LayerNorm``...): DeepSpeed's default granularity.

Parameters owned directly by a module that also has units below it (a position table read by the
top-level module, a weight used as ``x @ self.w``) belong to no unit: they are gathered when the
forward pass starts and kept until backward; :func:`check_units` warns when they are large.
Leaves smaller than ``stage3_param_persistence_threshold`` are not gathered at all (persistent).

**A unit's parameter read from outside its methods** -- a tied LM head reading
``self.transformer.variables["params"]["wte"]["embedding"].T``, ``x @ self.embed.embedding.T`` in
NNX -- reaches the reader as the :class:`~jzero.comm.zero_param.ZeroParam` itself, which behaves
as the full array (:mod:`jzero.comm.param_array`): each use gathers it once and reduce-scatters
that use's gradient into the one partition. A Linen module handed the ZeroParam itself as its own
parameter (``nn.Dense(...).apply({"params": {"kernel": p}}, h)``) runs as a unit of its own
(:class:`LinenUnits`), since flax reads a parameter's shape from what it is handed.

**How a unit gathers.** Every method of the unit's module -- ``__call__`` and the other methods its
own class defines, such as ``Embed.attend`` for tied embeddings -- runs inside ``jax.checkpoint``
with the engine's layer policy, and the unit's partitions are gathered at the top of that region.
So the gathered parameters are never saved for backward: backward gathers the unit again just
before its own backward, and its gradient is reduce-scattered right after (the gather's
backward), one unit's full parameters and gradients alive at a time. With ``cpu_checkpointing``
the region's array inputs are what it keeps in ``pinned_host`` (see
:mod:`jzero.modeling.layer_scan`). A unit inside another unit, or inside a layer scan that already
gathered its layer, finds nothing left to gather and runs as is. NNX: the bound model's unit modules
get a subclass whose methods do this, on a copy of the module inside the region; what the call
writes to its other variables (BatchNorm's statistics, RNG counts) is written back to the module
after it. Linen: flax's ``nn.intercept_methods`` lifts each method as flax's own transforms do
(mutable collections included), so what the unit's ``setup`` creates (``nn.Embed``'s table) is
read gathered, inside the method's region (:class:`LinenUnits`).

The units' gathers read only the parameter partitions, never the previous unit's output, so XLA is
free to issue unit i+1's all-gather while unit i computes (``overlap_comm``: the GPU's
latency-hiding scheduler does; the CPU backend runs collectives in program order).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import types
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax import lax
from flax import linen as nn
from flax import nnx
from flax.core import lift

from jzero.comm.zero_param import ZeroParam, record_unit_inputs
from jzero.errors import JZeroWarning
from jzero.modeling.layer_scan import current_layer_policy, current_policy, gather, name_layer_inputs
from jzero.sharding.plan import path_str

__all__ = ["ModuleInfo", "UnitRules", "choose_units", "check_units", "prefetches", "nnx_units",
           "LinenUnits", "inside_unit", "holds_partitions"]


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
  """One module of a model: its '/'-joined path ('' for the model) and class."""

  path: str
  cls: type


@dataclasses.dataclass(frozen=True)
class UnitRules:
  """What the config says about units (``zero_optimization.leaf_module`` and
  ``stage3_module_granularity_threshold``)."""

  classes: tuple[str, ...] = ()
  names: tuple[str, ...] = ()
  name_suffixes: tuple[str, ...] = ()
  granularity_threshold: int = 0

  def names_module(self, module: ModuleInfo) -> bool:
    cls = module.cls
    dotted = f"{cls.__module__}.{cls.__qualname__}"
    by_class = any(c in (cls.__name__, cls.__qualname__, dotted) or fnmatch.fnmatchcase(dotted, c)
                   for c in self.classes)
    by_name = module.path in self.names or any(fnmatch.fnmatchcase(module.path, n)
                                               for n in self.names)
    by_suffix = any(module.path.endswith(s) for s in self.name_suffixes if module.path)
    return by_class or by_name or by_suffix


def _owner(leaf: str, modules: Sequence[str]) -> str:
  """The deepest module path that is a prefix of ``leaf``."""
  best = ""
  for path in modules:
    if path and (leaf == path or leaf.startswith(path + "/")) and len(path) > len(best):
      best = path
  return best


def _within(path: str, root: str) -> bool:
  return root == "" or path == root or path.startswith(root + "/")


def choose_units(modules: Sequence[ModuleInfo], leaf_sizes: dict[str, int],
                 rules: UnitRules = UnitRules()) -> dict[str, str]:
  """Leaf path -> the path of the module that gathers it (see the module docstring); leaves in
  no unit are left out.

  Args:
    modules: every module of the model.
    leaf_sizes: element count of every parameter leaf, by '/'-joined path.
    rules: leaf modules and the granularity threshold from the config.
  """
  paths = [m.path for m in modules]
  owner = {leaf: _owner(leaf, paths) for leaf in leaf_sizes}
  total = {m.path: sum(n for leaf, n in leaf_sizes.items() if _within(owner[leaf], m.path))
           for m in modules}
  descendants = {m.path: sum(1 for p in paths if p != m.path and _within(p, m.path))
                 for m in modules}

  def whole(m: ModuleInfo) -> bool:
    if rules.names_module(m):
      return True
    threshold = rules.granularity_threshold
    return threshold > 0 and total[m.path] / (1 + descendants[m.path]) < threshold

  units: dict[str, str] = {}
  # top-down: the shallowest module taken whole wins, then the leaf modules owning parameters
  for m in sorted(modules, key=lambda m: (m.path.count("/") + bool(m.path), m.path)):
    if any(_within(m.path, u) for u in set(units.values())):
      continue
    owns = [leaf for leaf in leaf_sizes if owner[leaf] == m.path]
    inner = any(owner[leaf] != m.path and _within(owner[leaf], m.path) for leaf in leaf_sizes)
    if whole(m) and total[m.path]:
      units.update({leaf: m.path for leaf in leaf_sizes if _within(owner[leaf], m.path)})
    elif owns and not inner:
      units.update({leaf: m.path for leaf in owns})
  return units


_WARN_MIN_NUMEL = 1_000_000  # below this a unit's size is no memory worth warning about


def check_units(plan: Any, max_live_parameters: int | str) -> None:
  """Warns when the model's structure keeps ZeRO-3 from gathering per unit: a unit or the
  parameters gathered at the start of the forward pass hold much of the model, or a unit or a
  scanned layer is larger than ``stage3_max_live_parameters`` (``"auto"``: no cap)."""
  leaves = [l for l in plan.leaf_list() if l.param_partitioned]
  total = sum(l.numel for l in leaves)
  if not total:
    return
  sizes: dict[str, int] = {}
  for leaf in leaves:
    if leaf.unit is not None and not leaf.stacked:
      sizes[leaf.unit] = sizes.get(leaf.unit, 0) + leaf.numel
  upfront = [l for l in leaves if l.unit is None and not l.stacked]
  kept = sum(l.numel for l in upfront)
  if upfront and kept > total / 4 and kept >= _WARN_MIN_NUMEL:
    names = ", ".join(l.path for l in sorted(upfront, key=lambda l: -l.numel)[:4])
    warnings.warn(
        f"ZeRO-3: {kept:,} of the model's {total:,} partitioned parameters ({kept / total:.0%}) are "
        f"read directly by a module that has submodules of its own ({names}), so they are "
        f"gathered when the forward pass starts and kept until backward. Put each in a "
        f"submodule of its own (e.g. nnx.Linear / nn.Dense, or nnx.Param inside a small module) "
        f"so it is gathered when used, or name the module in zero_optimization.leaf_module to "
        f"gather it as one unit.", JZeroWarning, stacklevel=3)
  if sizes:
    unit, biggest = max(sizes.items(), key=lambda kv: kv[1])
    if len(sizes) > 1 and biggest > total / 2 and biggest >= _WARN_MIN_NUMEL:
      warnings.warn(
          f"ZeRO-3: unit {unit or '<model>'} holds {biggest:,} of {total:,} partitioned parameters "
          f"({biggest / total:.0%}); it is gathered whole, so the step holds that much at once. "
          f"Split it into submodules, or choose smaller units (zero_optimization.leaf_module, "
          f"stage3_module_granularity_threshold).", JZeroWarning, stacklevel=3)
    if max_live_parameters != "auto" and biggest > max_live_parameters:
      warnings.warn(
          f"ZeRO-3: unit {unit or '<model>'} holds {biggest:,} parameters, more than "
          f"stage3_max_live_parameters = {max_live_parameters:,}; a unit is gathered whole, so "
          f"this cap cannot be kept. Choose smaller units (zero_optimization.leaf_module) or raise "
          f"the cap.", JZeroWarning, stacklevel=3)
  layer = sum(l.layer_numel for l in leaves if l.stacked)
  if max_live_parameters != "auto" and layer > max_live_parameters:
    warnings.warn(
        f"ZeRO-3: one layer of the scanned stack holds {layer:,} parameters, more than "
        f"stage3_max_live_parameters = {max_live_parameters:,}; the layer scan gathers a layer "
        f"whole, so this cap cannot be kept. Raise the cap (or use more, smaller layers).",
        JZeroWarning, stacklevel=3)


def prefetches(plan: Any, prefetch_bucket_size: int, max_live_parameters: int | str) -> bool:
  """Whether stage 3 gathers the next layer or unit while one computes (DeepSpeed's prefetch):
  ``stage3_prefetch_bucket_size`` > 0, and ``stage3_max_live_parameters`` holds the two groups
  alive then -- the one computing and the one arriving -- of the largest gathered group (a scanned
  layer, or a unit; :meth:`jzero.sharding.plan.Plan.gathered_working_set`). XLA's pipeliner
  prefetches one layer ahead, never more, so a cap of two groups or more allows it and a smaller
  one turns it off; ``"auto"`` caps nothing here (``jzero aot`` and ``jzero plan`` compile the
  step both ways and take the one that overlaps more within the memory:
  :mod:`jzero.planning.overlap`)."""
  if plan.stage != 3 or prefetch_bucket_size <= 0:
    return False
  largest, _ = plan.gathered_working_set()
  return max_live_parameters == "auto" or 2 * largest <= max_live_parameters


# --- running a unit -------------------------------------------------------------------------------

_IN_UNIT: contextvars.ContextVar[bool] = contextvars.ContextVar("jzero_in_unit", default=False)


@contextlib.contextmanager
def inside_unit() -> Iterator[None]:
  token = _IN_UNIT.set(True)
  try:
    yield
  finally:
    _IN_UNIT.reset(token)


def _is_param(x: Any) -> bool:
  return isinstance(x, ZeroParam)


def holds_partitions(tree: Any) -> bool:
  """Whether ``tree`` holds a stage-3 partition still to be gathered."""
  return any(_is_param(x) and x.partitioned for x in jax.tree.leaves(tree, is_leaf=_is_param))


def _split_args(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple[tuple, dict]]]:
  """(array leaves of (args, kwargs), rebuild): arrays become traced inputs of the unit's region,
  everything else (flags, None, Python numbers) stays static."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
  arrays = [x for x, d in zip(leaves, dynamic) if d]

  def rebuild(values: list) -> tuple[tuple, dict]:
    it = iter(values)
    return jax.tree.unflatten(treedef, [next(it) if d else x for x, d in zip(leaves, dynamic)])

  return arrays, rebuild


def _gather_after(arrays: list) -> Any:
  """What a unit's gather waits for: its own inputs, or -- with prefetch -- the inputs of the unit
  run before it at the same trace level, so it can proceed while that unit computes."""
  previous = record_unit_inputs(arrays)
  if current_layer_policy().prefetch and previous is not None:
    return previous
  return arrays


def run_unit(body: Callable[[Any, tuple, dict], Any], params: Any, args: tuple,
             kwargs: dict) -> Any:
  """``body(full_params, *args, **kwargs)`` in a rematerialised region whose inputs are the
  unit's partitions, gathered inside (so never saved for backward).

  The partitions pass through an optimization barrier with what the gather waits for
  (:func:`_gather_after`), so the all-gather is issued when the unit's inputs exist (or, with
  prefetch, the previous unit's): a scheduler that issues collectives as early as it can -- XLA's
  CPU backend does -- still holds one unit's full parameters at a time (two with prefetch). In
  backward JAX's own barrier ties the re-gather to the incoming gradient.
  """
  arrays, rebuild = _split_args(args, kwargs)
  after = _gather_after(arrays)
  same = after is arrays

  def region(params, arrays, after):
    arrays = name_layer_inputs(arrays)  # cpu_checkpointing: kept in pinned_host until backward
    params, _ = lax.optimization_barrier((params, arrays if same else name_layer_inputs(after)))
    a, kw = rebuild(arrays)
    with inside_unit():
      return body(gather(params), a, kw)

  return jax.checkpoint(region, policy=current_policy(), prevent_cse=True)(params, arrays, after)


# --- NNX -----------------------------------------------------------------------------------------

_BASES = tuple(c for c in nnx.Module.__mro__)
_UNIT_CLASSES: dict[type, type] = {}


def _own_methods(cls: type) -> dict[str, Callable]:
  """The methods a module's classes define themselves (``__call__`` and public ones)."""
  methods: dict[str, Callable] = {}
  for klass in reversed(cls.__mro__):
    if klass in _BASES:
      continue
    for name, value in vars(klass).items():
      if (callable(value) and not isinstance(value, (staticmethod, classmethod, type))
          and (name == "__call__" or not name.startswith("_"))):
        methods[name] = value
  return methods


def _unit_class(cls: type) -> type:
  """A subclass of ``cls`` whose own methods gather the module's partitions in a remat region."""
  cached = _UNIT_CLASSES.get(cls)
  if cached is not None:
    return cached

  def wrap(method: Callable) -> Callable:
    def gathered(self, *args, **kwargs):
      if _IN_UNIT.get():
        return method(self, *args, **kwargs)
      graphdef, state = nnx.split(self)
      if not holds_partitions(state):
        return method(self, *args, **kwargs)

      def body(s, a, kw):  # the call runs on a copy: what it writes (statistics) comes back
        module = nnx.merge(graphdef, s)
        return method(module, *a, **kw), nnx.state(module, nnx.Not(nnx.Param))

      out, written = run_unit(body, state, args, kwargs)
      nnx.update(self, written)
      return out
    gathered.__name__, gathered.__doc__ = method.__name__, method.__doc__
    return gathered

  methods = {name: wrap(m) for name, m in _own_methods(cls).items()}
  sub = types.new_class(cls.__name__, (cls,), exec_body=lambda ns: ns.update(methods))
  sub.__qualname__, sub.__module__ = cls.__qualname__, cls.__module__
  sub._jzero_unit_of = cls  # pylint: disable=protected-access
  _UNIT_CLASSES[cls] = sub
  return sub


def nnx_modules(model: nnx.Module) -> list[ModuleInfo]:
  """Every module of an NNX model (abstract or concrete)."""
  return [ModuleInfo(path_str(path),
                     getattr(type(m), "_jzero_unit_of", type(m)))
          for path, m in nnx.iter_modules(model)]


def nnx_units(model: nnx.Module, units: set[str]) -> None:
  """Makes the modules at the ``units`` paths of a bound NNX model gather as units (in place)."""
  if not units:
    return
  for path, module in nnx.iter_modules(model):
    if path_str(path) in units and not hasattr(type(module), "_jzero_unit_of"):
      object.__setattr__(module, "__class__", _unit_class(type(module)))


# --- Linen ---------------------------------------------------------------------------------------


def linen_modules(module: nn.Module, rng: jax.Array, *args: Any) -> list[ModuleInfo]:
  """Every module of a Linen model whose methods run during ``module.init(rng, *args)`` (traced
  abstractly)."""
  seen: dict[str, type] = {}

  def record(next_fun, a, kw, context):
    seen.setdefault(path_str(context.module.path), type(context.module))
    return next_fun(*a, **kw)

  def init():
    with nn.intercept_methods(record):
      return module.init(rng, *args)

  jax.eval_shape(init)
  return [ModuleInfo(path, cls) for path, cls in seen.items()]


def _gathered_scopes(fn: Callable[..., Any]) -> Callable[..., Any]:
  """A flax core transform (built on ``lift.pack``, as flax's own ``lift.checkpoint``):
  ``fn(scope, *args)`` runs as a unit (:func:`run_unit`) whose inputs are the scope's variables,
  gathered inside.
  The inner scope keeps the module's path and RNG counters, so ``make_rng`` (dropout) draws the
  same keys as an untransformed call."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    def body(groups, a, kw):
      scope = scope_fn(groups, rng_groups)
      return fn(scope, *a, **kw), repack_fn(scope)
    return run_unit(body, variable_groups, args, kwargs)

  return lift.pack(inner, (True,), (True,), (True,), name="zero3_unit", enable_kwargs=True)


def _handed_partitions(module: nn.Module, path: str) -> bool:
  """Whether ``module`` holds, as its own parameter, another leaf's stage-3 partition: a module
  applied to a parameter read elsewhere (``nn.Dense(...).apply({"params": {"kernel": p}}, x)``
  with ``p`` from another module's ``variables``). It then runs as a unit of its own."""
  own = module.variables.get("params", {})
  for name, value in own.items():
    if (isinstance(value, ZeroParam) and value.partitioned and value.path is not None
        and value.path != path_str([p for p in (path, name) if p])):
      return True
  return False


class LinenUnits:
  """A ``nn.intercept_methods`` interceptor that runs the methods of the unit modules (by path) as
  units, and those of a module handed another module's partition as its parameter
  (:func:`_handed_partitions`).

  Linen runs a module's ``setup`` before any interceptor sees the method that triggers it, so a
  unit holding partitions skips it there (its parameters would be read as partitions: ``nn.Embed``
  creates its table in ``setup``); each of its methods then runs through a lifted transform
  (:func:`_gathered_scopes`, as ``nn.remat`` would) on a clone of the module, whose ``setup`` and
  compact body read the gathered parameters. What ``setup`` defines thus exists inside the unit's
  methods only: ``deferred_setup`` (path -> class) lists the modules whose ``setup`` was skipped,
  so a parent reading such an attribute directly can be told why it is missing.
  """

  def __init__(self, units: set[str]):
    self.units = units
    self.deferred_setup: dict[str, type] = {}

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    path = path_str(module.path) if module.scope is not None else None
    if (_IN_UNIT.get() or path is None
        or (path not in self.units and not _handed_partitions(module, path))
        or not holds_partitions(module.variables.get("params", {}))):
      return next_fun(*args, **kwargs)
    if context.method_name == "setup":
      self.deferred_setup[path] = type(module)
      return None  # runs in the clone, inside each method's unit
    method = getattr(type(module), context.method_name)
    return nn.transforms.decorator_lift_transform(_gathered_scopes, method)(module, *args,
                                                                           **kwargs)
