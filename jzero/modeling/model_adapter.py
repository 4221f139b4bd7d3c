"""Model adapters: what the engine needs from a Flax model.

The engine keeps parameters as a plain nested dict (the model's parameter tree, ``nnx.Param`` values
or Linen's ``params`` collection) and needs to (1) know their shapes before creating them, (2)
create them inside ``jit`` so they are born in their ZeRO placement, (3) turn a params dict back
into something the user's ``loss_fn(model, batch)`` can call, and (4) carry the model's other
state -- BatchNorm's statistics -- from one call to the next (:mod:`jzero.modeling.model_state`).

* Flax NNX: pass a module, or a factory ``rngs -> module`` (preferred for big models: nothing is
  created on the host). ``loss_fn`` receives the module rebuilt from the params and the model
  state; RNG streams it holds (``nnx.Dropout(rate, rngs=rngs)``) are reseeded from the step's key.
* Flax Linen: pass the module; ``loss_fn`` receives ``model(*args) = module.apply({"params": p,
  **model_state}, *args)``, the model state's collections mutable (:class:`BoundLinen`).
  ``init_inputs(batch) -> args`` says what to call ``module.init`` with (default: ``(batch,)``).
  Stacked layers built with :func:`jzero.linen_scan_layers` are gathered one layer at a time.

Each adapter also lists the model's modules (:meth:`ModelAdapter.modules`), from which
:mod:`jzero.modeling.gather_units` chooses the gather units, and ``bind`` makes those modules gather
as units. After the loss ran, :meth:`ModelAdapter.model_state` reads the state the model left
(``{}`` for a model with none); inside the step every BatchNorm computes its statistics over the
data axes ``bind`` is given (torch's SyncBatchNorm, :mod:`jzero.modeling.model_state`).
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import jax
from flax import linen as nn
from flax import nnx
from flax.errors import ScopeParamShapeError

from jzero.config.auto import HIDDEN_SIZE_NAMES
from jzero.errors import ConfigError, JZeroError, NotSupportedError
from jzero.modeling import gather_units as units_lib
from jzero.modeling import model_state as state_lib

__all__ = ["BoundLinen", "ModelAdapter", "NnxModel", "LinenModel", "as_model"]

PyTree = Any


class ModelAdapter(abc.ABC):
  """Interface the engine uses; see the module docstring."""

  hidden_size: int | None = None
  stacked_layers: Any = None  # the model's own `stacked_layers` attribute, if it declares one
  module: Any = None  # the model as given (NNX: the module, or the factory's abstract module)
  initial_params: PyTree | None = None  # concrete params when the model already holds them
  initial_model_state: PyTree | None = None  # likewise its model state

  @abc.abstractmethod
  def abstract_params(self, rng: jax.Array, sample_batch: Any) -> PyTree:
    """ShapeDtypeStructs of the params dict (logical shapes)."""

  @abc.abstractmethod
  def abstract_model_state(self, rng: jax.Array, sample_batch: Any) -> dict[str, PyTree]:
    """ShapeDtypeStructs of the model state (``{collection: tree}``; ``{}``: none)."""

  @abc.abstractmethod
  def init_variables(self, rng: jax.Array, sample_batch: Any) -> tuple[PyTree, dict[str, PyTree]]:
    """(the params dict, the model state), traceable under jit."""

  @abc.abstractmethod
  def bind(self, params: PyTree, units: frozenset[str] = frozenset(),
           model_state: dict[str, PyTree] | None = None, *, rng: jax.Array | None = None,
           batch_axes: tuple[str, ...] | None = None) -> Any:
    """What ``loss_fn`` receives as its model, built from a params dict whose leaves may be
    :class:`~jzero.comm.zero_param.ZeroParam` and the model state (needed when the model has
    one); the modules at the ``units`` paths gather as units. ``rng``: the key NNX RNG streams
    held in the model are reseeded from (None: evaluation); ``batch_axes``: the mesh axes
    BatchNorm statistics are averaged over (inside the step's ``shard_map``; None: the local
    batch)."""

  @abc.abstractmethod
  def model_state(self, model: Any) -> dict[str, PyTree]:
    """The model state a model from :meth:`bind` holds now (after the loss called it)."""

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


def _missing_state(name: str, collections: list[str]) -> JZeroError:
  return JZeroError(
      f"{name} has model state ({collections}) besides its parameters: bind it with the state's "
      f"model_state as well (engine.bind(params, state.model_state)).")


def _shapes(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class NnxModel(ModelAdapter):
  """Adapter for a Flax NNX module or a factory ``rngs -> module``: ``nnx.Param`` variables are
  the parameters, RNG streams are reseeded at each call, every other variable is model state."""

  def __init__(self, model: nnx.Module | Callable[[nnx.Rngs], nnx.Module]):
    if isinstance(model, nnx.Module):
      self._factory = None
      abstract_module = model
    else:
      self._factory = model
      abstract_module = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
    graphdef, params, rngs, rest = nnx.split(abstract_module, nnx.Param, nnx.RngState, ...)
    if self._factory is None:
      self.initial_params = nnx.to_pure_dict(params)
      self.initial_model_state = state_lib.group_nnx_state(rest)
    self._graphdef = graphdef
    self._template = _shapes(params)
    self._rng_template, self._state_template = _shapes(rngs), _shapes(rest)
    self._stream_tags = tuple(sorted({var.tag for _, var in nnx.to_flat_state(rngs)
                                      if isinstance(var, nnx.RngKey)}))
    self.hidden_size = _hidden_size(abstract_module)
    self.stacked_layers = getattr(abstract_module, "stacked_layers", None)
    self._abstract = self.module = abstract_module

  def abstract_params(self, rng, sample_batch):
    return nnx.to_pure_dict(self._template)

  def abstract_model_state(self, rng, sample_batch):
    return state_lib.group_nnx_state(self._state_template)

  def init_variables(self, rng, sample_batch):
    if self._factory is None:
      return self.initial_params, self.initial_model_state
    _, params, _, rest = nnx.split(self._factory(nnx.Rngs(rng)), nnx.Param, nnx.RngState, ...)
    return nnx.to_pure_dict(params), state_lib.group_nnx_state(rest)

  def modules(self, rng, sample_batch):
    return units_lib.nnx_modules(self._abstract)

  def bind(self, params, units=frozenset(), model_state=None, *, rng=None, batch_axes=None):
    state = jax.tree.map(lambda x: x, self._template)  # fresh Variables, template untouched
    nnx.replace_by_pure_dict(state, params)
    states = [state, state_lib.rng_placeholders(self._rng_template)]
    if jax.tree.leaves(self._state_template):
      if model_state is None:
        raise _missing_state(type(self._abstract).__name__,
                             sorted(self.abstract_model_state(None, None)))
      states.append(state_lib.fill_nnx_state(self._state_template, model_state))
    model = nnx.merge(self._graphdef, *states)
    state_lib.reseed_nnx_streams(model, self._stream_tags, rng)
    state_lib.sync_nnx_batch_norms(model, batch_axes)
    units_lib.nnx_units(model, units)
    return model

  def model_state(self, model):
    return state_lib.group_nnx_state(nnx.state(model, state_lib.NON_PARAM))

  def evaluating(self, model):
    """nnx's ``model.eval()``: ``deterministic=True`` on every module that has it (Dropout,
    attention), ``use_running_average=True`` likewise. ``bind`` builds a new model each time, so
    the one training uses keeps its own mode."""
    model.eval()
    return model


class LinenModel(ModelAdapter):
  """Adapter for a Flax Linen module: the ``params`` collection is the parameters, every other
  collection ``module.init`` returns (``batch_stats``) is model state.

  ``module.init`` needs inputs: a sample batch, given to ``initialize(sample_batch=...)`` (the
  model's variables are then checked there, before any device work) or to ``engine.init``.
  """

  def __init__(self, module: nn.Module, init_inputs: Callable[[Any], tuple] | None = None):
    self._module = self.module = module
    self._given_inputs = init_inputs is not None
    self._inputs = init_inputs or (lambda batch: (batch,))
    self._sample_batch = None
    self._state_shapes: dict[str, PyTree] | None = None  # from the last abstract init
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
    """Traces ``module.init`` (nothing is computed); errors are raised outside the trace, so they
    read as jzero's."""
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
    self._state_shapes = {k: v for k, v in variables.items() if k != "params"}
    return variables["params"]

  def abstract_model_state(self, rng, sample_batch):
    if self._state_shapes is None or sample_batch is not None:
      self.abstract_params(jax.random.key(0) if rng is None else rng, sample_batch)
    return self._state_shapes

  def init_variables(self, rng, sample_batch):
    variables = dict(self._variables(rng, self._batch(sample_batch)))
    return variables.pop("params"), variables

  def modules(self, rng, sample_batch):
    return units_lib.linen_modules(self._module, rng, *self._inputs(self._batch(sample_batch)))

  def bind(self, params, units=frozenset(), model_state=None, *, rng=None, batch_axes=None):
    if model_state is None and self._state_shapes:
      raise _missing_state(type(self._module).__name__, sorted(self._state_shapes))
    return BoundLinen(self._module, params, dict(model_state or {}), set(units), batch_axes)

  def model_state(self, model):
    return model.model_state


class BoundLinen:
  """What ``loss_fn`` receives for a Linen model: ``model(*args, **kwargs)`` is
  ``module.apply({"params": params, **model_state}, *args, **kwargs)``, the model state's
  collections mutable; what a call writes is the state the next call reads (``model_state``, which
  the step carries on). The modules at the ``units`` paths gather as ZeRO-3 units
  (:class:`jzero.modeling.gather_units.LinenUnits`); every BatchNorm averages its statistics over
  ``batch_axes`` (:class:`jzero.modeling.model_state.LinenBatchNormAxes`)."""

  def __init__(self, module: nn.Module, params: PyTree, model_state: dict[str, PyTree],
               units: set[str], batch_axes: tuple[str, ...] | None):
    self.module, self.params, self.model_state = module, params, model_state
    self._units = units_lib.LinenUnits(units)
    self._sync = state_lib.LinenBatchNormAxes(batch_axes)

  def __call__(self, *args, **kwargs):
    name = type(self.module).__name__
    if self.model_state and "mutable" in kwargs:
      raise JZeroError(
          f"{name} was called with mutable={kwargs['mutable']!r}: jzero makes the model's "
          f"collections {sorted(self.model_state)} mutable itself and carries what each call "
          f"writes to the next one. Call model(...) without mutable; it returns the output only.")
    try:
      with nn.intercept_methods(self._units), nn.intercept_methods(self._sync):
        if not self.model_state:
          return self.module.apply({"params": self.params}, *args, **kwargs)
        out, written = self.module.apply({"params": self.params, **self.model_state}, *args,
                                         mutable=list(self.model_state), **kwargs)
    except ScopeParamShapeError as e:
      if not units_lib.holds_partitions(self.params):
        raise
      raise NotSupportedError(
          f"{name}: a layer read its ZeRO-3 partition where it needs the full parameter ({e}). "
          f"Layers stacked under a scan must be listed in `stacked_layers` (jzero then never "
          f"splits the layer axis) and built with jzero.linen_scan_layers, or run as modules "
          f"jzero gathers when they are called.") from None
    except AttributeError as e:
      deferred = [f"{path} ({cls.__name__})" for path, cls in
                  self._units.deferred_setup.items() if f'"{cls.__name__}" object' in str(e)]
      if not deferred:
        raise
      raise NotSupportedError(
          f"{name}: a module read an attribute that `setup` defines from outside that "
          f"module's methods ({e}). {', '.join(deferred)} is a ZeRO-3 gather unit: jzero "
          f"runs its `setup` inside each of its methods, where its parameters are gathered, so "
          f"what `setup` defines exists there only. Read it through a method of that module "
          f"(for a tied output layer, nn.Embed.attend), or name the module reading it in "
          f"zero_optimization.leaf_module so both gather as one unit.") from None
    self.model_state = {**self.model_state, **written}
    return out


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
