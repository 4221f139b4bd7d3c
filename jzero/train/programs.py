"""The programs an engine builds for its plan, each once: :class:`Programs`, and the jitted step
as a function of its parts: :func:`build_step` (MaxText's ``train_step(model, config,
state_shardings, state, data)`` shape).

One optimizer step is one ``jax.jit`` with the plan's shardings as its in/out shardings and the
train state donated. Its per-device phases are :mod:`jzero.train.step`'s (forward, backward, the
reductions) and :mod:`jzero.train.update`'s, each inside a ``shard_map`` over the whole mesh
(:func:`jzero.comm.program.shard_map`), so every collective is explicit and the compiled HLO moves
exactly the bytes ZeRO says it should. In the update's partition view the whole step is one
``shard_map``; in the whole view (:mod:`jzero.sharding.opt_layout`) the reduced gradients leave
it and the update runs on global arrays (:func:`_whole_update`).

An engine's plan fixes what its programs compute with (:class:`jzero.train.step.StepParts`) and
the train state's layout (PartitionSpecs and memory kinds, :mod:`jzero.train.state`). For that
plan :class:`Programs` holds the fused step of every step variant asked for (the variant is the
delayed update's, written in the state: :class:`jzero.tiers.delayed.Variant`, None without it),
the two-jit step ``wall_clock_breakdown`` times, the evaluation, the hpZ refresh of the secondary
partitions, and the stage-3 gathered groups as the model runs (:func:`gathered_groups`, traced on
their own: tracing the step writes nothing outside it). A new plan gets new programs; nothing here
reads or writes the engine.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jzero.comm import layouts, program
from jzero.comm.zero_param import one_pass
from jzero.modeling.layer_scan import LayerPolicy, engine_context
from jzero.sharding.opt_layout import View
from jzero.sharding.plan import Plan
from jzero.train import aux_metrics
from jzero.train import state as state_lib
from jzero.train import update as update_lib
from jzero.train.step import StepParts, bind, grad_targets, local_grads
from jzero.train.state import TrainState

__all__ = ["Programs", "build_eval", "build_split_step", "build_step", "gathered_groups"]

PyTree = Any


class Programs:
  """The jitted programs of one plan (see the module docstring)."""

  def __init__(self, parts: StepParts):
    self.parts = parts
    self._fused: dict[Hashable, Any] = {}
    self._split: dict[Hashable, tuple[Any, Any]] = {}
    self._eval = self._refresh = None
    self._gathered: tuple[int, ...] | None = None

  def specs(self, variant: Any = None) -> TrainState:
    """PartitionSpecs of the train state (with the delayed update's carried state, for the step
    of ``variant``)."""
    parts = self.parts
    return state_lib.state_specs(parts.plan, parts.opt, parts.delayed, variant)

  def kinds(self, variant: Any = None) -> TrainState:
    """Memory kinds of the train state (as :meth:`specs`)."""
    parts = self.parts
    return state_lib.state_memory_kinds(parts.plan, parts.opt, parts.delayed, variant)

  def has(self, variant: Any, fused: bool = True) -> bool:
    """The step of ``variant`` is built (in one jit, or as two with ``fused=False``)."""
    return variant in (self._fused if fused else self._split)

  def fused(self, batch: PyTree, variant: Any = None) -> Any:
    """The jitted step ``(state, batch) -> (state, metrics, outputs)`` of ``variant``."""
    if variant not in self._fused:
      self._fused[variant] = build_step(self.parts, self.specs(variant),
                                                 self.kinds(variant), batch)
    return self._fused[variant]

  def split(self, batch: PyTree, variant: Any = None) -> tuple[Any, Any]:
    """The step of ``variant`` as two jits, ``(state, batch) -> grads`` and ``(state, *grads)
    -> (state, metrics, outputs)``."""
    if variant not in self._split:
      self._split[variant] = build_split_step(self.parts, self.specs(variant),
                                                       self.kinds(variant), batch)
    return self._split[variant]

  @property
  def variants(self) -> tuple:
    """The variants of the fused steps built so far."""
    return tuple(self._fused)

  def gathered(self, state: Any = None, batch: PyTree = None) -> tuple[int, ...] | None:
    """The groups stage 3 gathers at once as the model runs
    (:func:`gathered_groups`), measured from ``state`` and ``batch`` the first
    time both are given, then kept; None before."""
    if self._gathered is None and state is not None and batch is not None:
      variant = getattr(getattr(state, "delayed", None), "variant", None)
      self._gathered = gathered_groups(self.parts, self.specs(variant), state, batch)
    return self._gathered

  def evaluate(self) -> Any:
    """``(params, secondary, model_state, batch) -> (mean loss, mean aux)``
    (:func:`build_eval`)."""
    if self._eval is None:
      self._eval = build_eval(self.parts)
    return self._eval

  def refresh(self) -> Any:
    """``params -> secondary``: hpZ's secondary partitions, by the code the step refreshes them
    with (:func:`jzero.comm.layouts.refresh_program`)."""
    if self._refresh is None:
      self._refresh = layouts.refresh_program(self.parts.plan)
    return self._refresh


def gathered_groups(parts: StepParts, specs: TrainState, state: Any, batch: PyTree) -> tuple:
  """The full-parameter elements of each group stage 3 gathers together in the step's forward
  pass as the model really runs (:class:`jzero.modeling.layer_scan.TraceLog`: a scanned layer, a
  unit's call -- one layer's slice per call inside a model's own ``nn.scan``), measured by tracing
  one micro-batch's forward pass abstractly (``state`` and ``batch``: arrays or
  ShapeDtypeStructs with the step's ``specs``); no device work. A pure function: the traced
  forward returns one empty-valued array per group, whose length is the group's size."""
  plan, settings = parts.plan, parts.settings

  def forward(state, batch):
    mb = jax.tree.map(lambda x: x[:settings.micro_batch_size], batch)
    rng = jax.random.wrap_key_data(state.rng)  # a training pass's key (its value is not read)
    with engine_context(settings.layer_policy) as log, one_pass():
      model = bind(parts, grad_targets(parts, state.params), state.params, state.secondary,
                   state.model_state, rng)
      parts.call_loss(model, mb, rng)
    return tuple(jnp.zeros((n,), jnp.int8) for n in log.gathered)

  batch_specs = jax.tree.map(lambda _: plan.batch_spec(), batch)
  local = program.shard_map(plan, forward, (specs, batch_specs), P())
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
  return tuple(x.shape[0] for x in jax.eval_shape(local, *abstract))


# -- jit(shard_map(...)) ---------------------------------------------------------------------------
def _jit(plan: Plan, state_kinds: TrainState, fn, in_specs: tuple, out_specs: Any,
         donate: tuple[int, ...], per_device: bool = True):
  """jit(shard_map(fn)) with the plan's shardings as the jit's in/out shardings (TrainState
  arguments and results with their memory kinds ``state_kinds``); ``per_device`` False: ``fn``
  is a function of global arrays already (it calls its own ``shard_map``)."""
  kinds = lambda specs: tuple(state_kinds if isinstance(s, TrainState) else None for s in specs)
  out = out_specs if isinstance(out_specs, tuple) else (out_specs,)
  out_shardings = plan.shardings(out, kinds(out))
  body = program.shard_map(plan, fn, in_specs, out_specs) if per_device else fn
  return jax.jit(body, in_shardings=plan.shardings(in_specs, kinds(in_specs)),
                 out_shardings=out_shardings if isinstance(out_specs, tuple) else out_shardings[0],
                 donate_argnums=donate, compiler_options=program.compile_options(plan) or None)


def _out_specs(parts: StepParts, specs: TrainState) -> tuple:
  """(state, metrics, outputs) specs; outputs: what the update's work after the step reads."""
  return (specs, P(), parts.update.output_specs)


def _grad_specs(plan: Plan) -> PyTree:
  """Specs of the reduced gradients (state layout; None for a frozen leaf, which has none)."""
  return plan.map(lambda l: None if l.frozen else plan.state_spec(l))


def _whole_update(parts: StepParts, specs: TrainState):
  """The update phase in the whole view (:mod:`jzero.sharding.opt_layout`): the reduction of the
  gradients on each device's blocks, then the update chain on global arrays --
  ``(state, grads, loss, aux, model_state) -> (state, metrics, outputs)``."""
  plan = parts.plan
  reduce = program.shard_map(plan, functools.partial(update_lib.reduce_grads, parts),
                             (specs, _grad_specs(plan)), (_grad_specs(plan), P(), P()))

  def update(state, grads, loss, aux, model_state):
    grads, grad_norm, overflow = reduce(state, grads)
    return update_lib.apply_update(parts, state._replace(model_state=model_state), grads,
                                   grad_norm, overflow, loss, aux)
  return update


def build_step(parts: StepParts, specs: TrainState, kinds: TrainState, batch: PyTree):
  """The fused step ``(state, batch) -> (state, metrics, outputs)``, jitted with the state's
  ``specs`` and memory ``kinds`` (with the delayed update, of one variant: the state's) and the
  state donated; ``outputs``: what the update hands out of the jit for its work after it. In the
  partition view one ``shard_map`` is the whole step; in the whole view the gradients leave it
  and the update runs on global arrays (:func:`_whole_update`)."""
  plan = parts.plan
  batch_specs = jax.tree.map(lambda _: plan.batch_spec(), batch)
  if parts.opt.view is View.PARTITION:
    def local_step(state, batch):
      grads, loss, aux, model_state = local_grads(parts, state, batch)
      return update_lib.local_update(parts, state._replace(model_state=model_state), grads,
                                     loss, aux)
    return _jit(plan, kinds, local_step, (specs, batch_specs), _out_specs(parts, specs),
                donate=(0,))

  grads_of = program.shard_map(plan, functools.partial(local_grads, parts), (specs, batch_specs),
                               (_grad_specs(plan), P(), P(), P()))
  update = _whole_update(parts, specs)

  def step(state, batch):
    return update(state, *grads_of(state, batch))
  return _jit(plan, kinds, step, (specs, batch_specs), _out_specs(parts, specs), donate=(0,),
              per_device=False)


def build_split_step(parts: StepParts, specs: TrainState, kinds: TrainState,
                     batch: PyTree) -> tuple[Any, Any]:
  """The step as two jits -- forward+backward+reduction, then the update -- for timing them."""
  plan = parts.plan
  batch_specs = jax.tree.map(lambda _: plan.batch_spec(), batch)
  grad_specs = _grad_specs(plan)
  grads = _jit(plan, kinds, functools.partial(local_grads, parts), (specs, batch_specs),
               (grad_specs, P(), P(), P()), donate=())
  in_specs = (specs, grad_specs, P(), P(), P())
  if parts.opt.view is View.WHOLE:
    update = _jit(plan, kinds, _whole_update(parts, specs), in_specs, _out_specs(parts, specs),
                  donate=(0,), per_device=False)
    return grads, update

  def local_update(state, grads, loss, aux, model_state):
    return update_lib.local_update(parts, state._replace(model_state=model_state), grads, loss,
                                   aux)

  update = _jit(plan, kinds, local_update, in_specs, _out_specs(parts, specs), donate=(0,))
  return grads, update


def build_eval(parts: StepParts):
  """``(params, secondary, model_state, batch) -> (mean loss, mean aux)`` with no update: the
  model in its evaluation mode (BatchNorm on the running statistics of ``model_state``, which stay
  as they are) and a loss with an ``rng`` parameter given ``rng=None``."""
  plan = parts.plan

  def local_loss(params, secondary, model_state, mb):
    with engine_context(LayerPolicy()), one_pass():
      model = parts.model.evaluating(bind(parts, grad_targets(parts, params), params, secondary,
                                          model_state, None))
      out = parts.call_loss(model, mb, None)
    loss, aux = aux_metrics.split_loss(out)
    if aux is not None:
      aux = jax.tree.map(lambda x: x[None], aux_metrics.mark(aux, jax.tree.leaves(mb)[0].shape[0]))
      aux = aux_metrics.over_devices(aux_metrics.over_micro_batches(aux), plan.mesh.batch_axes)
    return lax.pmean(loss.astype(jnp.float32), plan.mesh.batch_axes), aux

  specs = (plan.param_specs(), plan.secondary_specs(), P(), plan.batch_spec())
  return jax.jit(program.shard_map(plan, local_loss, specs, P()))
