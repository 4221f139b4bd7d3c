"""Model adapters: the three things the engine needs from a Flax model.

The engine keeps parameters as a plain nested dict (the model's parameter tree, ``nnx.Param`` values
or Linen's ``params`` collection) and needs to (1) know their shapes before creating them, (2)
create them inside ``jit`` so they are born in their ZeRO placement, and (3) turn a params dict back
into something the user's ``loss_fn(model, batch)`` can call.

* Flax NNX: pass a module, or a factory ``rngs -> module`` (preferred for big models: nothing is
  created on the host). ``loss_fn`` receives the module rebuilt from the params.
* Flax Linen: pass the module; ``loss_fn`` receives ``model(*args) = module.apply({"params": p},
  *args)``. ``init_inputs(batch) -> args`` says what to call ``module.init`` with (default:
  ``(batch,)``). Stacked layers built with :func:`jzero.linen_scan_layers` are gathered one layer at
  a time.

Each adapter also lists the model's modules (:meth:`ModelAdapter.modules`), from which
:mod:`jzero.modeling.gather_units` chooses the gather units, and ``bind`` makes those modules gather
as units.

jzero trains parameters only: a model with other mutable state (batch statistics, RNG counters held
in the module) is refused, since the engine would silently freeze that state.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import jax
from flax import linen as nn
from flax import nnx
from flax.errors import ScopeParamShapeError

from jzero.config.auto import HIDDEN_SIZE_NAMES
from jzero.errors import ConfigError, NotSupportedError
from jzero.modeling import gather_units as units_lib

__all__ = ["ModelAdapter", "NnxModel", "LinenModel", "as_model"]

PyTree = Any


class ModelAdapter(abc.ABC):
  """Interface the engine uses; see the module docstring."""

  hidden_size: int | None = None
  stacked_layers: Any = None  # the model's own `stacked_layers` attribute, if it declares one
  module: Any = None  # the model as given (NNX: the module, or the factory's abstract module)
  initial_params: PyTree | None = None  # concrete params when the model already holds them

  @abc.abstractmethod
  def abstract_params(self, rng: jax.Array, sample_batch: Any) -> PyTree:
    """ShapeDtypeStructs of the params dict (logical shapes)."""

  @abc.abstractmethod
  def init_params(self, rng: jax.Array, sample_batch: Any) -> PyTree:
    """The params dict, traceable under jit."""

  @abc.abstractmethod
  def bind(self, params: PyTree, units: frozenset[str] = frozenset()) -> Any:
    """What ``loss_fn`` receives as its model, built from a params dict whose leaves may be
    :class:`~jzero.comm.zero_param.ZeroParam`; the modules at the ``units`` paths gather as
    units."""

  @abc.abstractmethod
  def modules(self, rng: jax.Array, sample_batch: Any) -> list[units_lib.ModuleInfo]:
    """Every module of the model (path and class), for choosing the gather units."""

  def set_sample_batch(self, batch: Any) -> None:
    """A batch to create the parameters from when ``init`` gets none (Linen needs one)."""

  def evaluating(self, model: Any) -> Any:
    """``model`` (from :meth:`bind`) as ``engine.eval_loss`` calls it, with no rng: in evaluation
    mode. Linen: as it is -- ``deterministic`` is an argument of the user's call, which the loss
    sets from ``rng is None``."""
    return model


def _hidden_size(obj: Any) -> int | None:
  for owner in (obj, getattr(obj, "config", None), getattr(obj, "cfg", None)):
    for name in HIDDEN_SIZE_NAMES:
      value = getattr(owner, name, None) if owner is not None else None
      if isinstance(value, int):
        return value
  return None


def _check_only_params(rest: nnx.State, what: str) -> None:
  leaves = jax.tree_util.tree_flatten_with_path(rest)[0]
  if leaves:
    path = "/".join(str(getattr(k, "key", k)) for k in leaves[0][0])
    raise NotSupportedError(
        f"{what} holds non-parameter state (first at {path!r}); jzero trains nnx.Param variables "
        f"only and would leave that state frozen. Keep RNG streams out of the module (take `rng` in "
        f"loss_fn instead), and normalise without batch statistics: nnx.LayerNorm, nnx.RMSNorm "
        f"or nnx.GroupNorm instead of nnx.BatchNorm.")


class NnxModel(ModelAdapter):
  """Adapter for a Flax NNX module or a factory ``rngs -> module``."""

  def __init__(self, model: nnx.Module | Callable[[nnx.Rngs], nnx.Module]):
    if isinstance(model, nnx.Module):
      self._factory = None
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      _check_only_params(rest, type(model).__name__)
      self.initial_params = nnx.to_pure_dict(params)
      abstract_module = model
    else:
      self._factory = model
      abstract_module = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
      graphdef, params, rest = nnx.split(abstract_module, nnx.Param, ...)
      _check_only_params(rest, type(abstract_module).__name__)
    self._graphdef = graphdef
    self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    self.hidden_size = _hidden_size(abstract_module)
    self.stacked_layers = getattr(abstract_module, "stacked_layers", None)
    self._abstract = self.module = abstract_module

  def abstract_params(self, rng, sample_batch):
    return nnx.to_pure_dict(self._template)

  def init_params(self, rng, sample_batch):
    if self._factory is None:
      return self.initial_params
    return nnx.to_pure_dict(nnx.split(self._factory(nnx.Rngs(rng)), nnx.Param, ...)[1])

  def modules(self, rng, sample_batch):
    return units_lib.nnx_modules(self._abstract)

  def bind(self, params, units=frozenset()):
    state = jax.tree.map(lambda x: x, self._template)  # fresh Variables, template untouched
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(self._graphdef, state)
    units_lib.nnx_units(model, units)
    return model

  def evaluating(self, model):
    """nnx's ``model.eval()``: ``deterministic=True`` on every module that has it (Dropout,
    attention), ``use_running_average=True`` likewise. ``bind`` builds a new model each time, so
    the one training uses keeps its own mode."""
    model.eval()
    return model


class LinenModel(ModelAdapter):
  """Adapter for a Flax Linen module (parameters in the ``params`` collection).

  ``module.init`` needs inputs: a sample batch, given to ``initialize(sample_batch=...)`` (the
  model's variables are then checked there, before any device work) or to ``engine.init``.
  """

  def __init__(self, module: nn.Module, init_inputs: Callable[[Any], tuple] | None = None):
    self._module = self.module = module
    self._given_inputs = init_inputs is not None
    self._inputs = init_inputs or (lambda batch: (batch,))
    self._sample_batch = None
    self.hidden_size = _hidden_size(module)
    self.stacked_layers = getattr(module, "stacked_layers", None)

  def set_sample_batch(self, batch: Any) -> None:
    """Checks the module's variables with ``batch`` now (abstractly) and keeps it for ``init``."""
    self.abstract_params(jax.random.key(0), batch)
    self._sample_batch = batch

  def _batch(self, sample_batch: Any) -> Any:
    batch = self._sample_batch if sample_batch is None else sample_batch
    if batch is None:
      raise ConfigError(
          f"{type(self._module).__name__} is a Linen module: jzero creates its parameters with "
          f"module.init, which needs inputs. Pass a sample batch: engine.init(rng, batch), or "
          f"jzero.initialize(..., sample_batch=batch) (init_inputs=lambda batch: (...) says "
          f"which arguments module.init gets from it).")
    return batch

  def _variables(self, rng, batch):
    return self._module.init(rng, *self._inputs(batch))

  def abstract_params(self, rng, sample_batch):
    """Traces ``module.init`` (nothing is computed) and checks the variable collections; errors
    are raised outside the trace, so they read as jzero's."""
    name, batch = type(self._module).__name__, self._batch(sample_batch)
    try:
      variables = jax.eval_shape(self._variables, rng, batch)
    except Exception as e:  # pylint: disable=broad-except
      if self._given_inputs:
        raise
      keys = f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""
      raise ConfigError(
          f"{name}.init(rng, batch) failed ({type(e).__name__}: {str(e).splitlines()[0]}). "
          f"Without init_inputs jzero calls module.init with the whole batch (a "
          f"{type(batch).__name__}{keys}); if the module takes something else, say what: "
          f"jzero.initialize(..., init_inputs=lambda batch: (batch['x'],)) -- the positional "
          f"arguments of module.init after the rng.") from e
    extra = sorted(set(variables) - {"params"})
    if extra:
      hint = (" Normalise without batch statistics: nn.LayerNorm, nn.RMSNorm or nn.GroupNorm "
              "instead of nn.BatchNorm." if "batch_stats" in extra else "")
      raise NotSupportedError(
          f"{name} has variable collections {extra} besides 'params'; jzero trains parameters "
          f"only and would leave them frozen.{hint}")
    return variables["params"]

  def init_params(self, rng, sample_batch):
    return self._variables(rng, self._batch(sample_batch))["params"]

  def modules(self, rng, sample_batch):
    return units_lib.linen_modules(self._module, rng, *self._inputs(self._batch(sample_batch)))

  def bind(self, params, units=frozenset()):
    module = self._module
    name = type(module).__name__
    interceptor = units_lib.LinenUnits(set(units))

    def apply(*args, **kwargs):
      try:
        with nn.intercept_methods(interceptor):
          return module.apply({"params": params}, *args, **kwargs)
      except ScopeParamShapeError as e:
        if not units_lib.holds_partitions(params):
          raise
        raise NotSupportedError(
            f"{name}: a layer read its ZeRO-3 partition where it needs the full parameter ({e}). "
            f"Layers stacked under a scan must be listed in `stacked_layers` (jzero then never "
            f"splits the layer axis) and built with jzero.linen_scan_layers, or run as modules "
            f"jzero gathers when they are called.") from None
      except AttributeError as e:
        deferred = [f"{path} ({cls.__name__})" for path, cls in
                    interceptor.deferred_setup.items() if f'"{cls.__name__}" object' in str(e)]
        if not deferred:
          raise
        raise NotSupportedError(
            f"{name}: a module read an attribute that `setup` defines from outside that "
            f"module's methods ({e}). {', '.join(deferred)} is a ZeRO-3 gather unit: jzero "
            f"runs its `setup` inside each of its methods, where its parameters are gathered, so "
            f"what `setup` defines exists there only. Read it through a method of that module "
            f"(for a tied output layer, nn.Embed.attend), or name the module reading it in "
            f"zero_optimization.leaf_module so both gather as one unit.") from None

    return apply


def as_model(model: Any, init_inputs: Callable[[Any], tuple] | None = None) -> ModelAdapter:
  """Wraps a Flax NNX module / factory or a Linen module in its adapter."""
  if isinstance(model, ModelAdapter):
    return model
  if isinstance(model, nn.Module):
    return LinenModel(model, init_inputs)
  if isinstance(model, nnx.Module) or callable(model):
    return NnxModel(model)
  raise TypeError(f"model must be a Flax NNX module, a factory rngs -> nnx.Module, or a Linen "
                  f"module; got {type(model).__name__}.")
