"""What an engine builds once, before its first step: the plan of its config
(:func:`plan_from_config`: the layout, then the tiers' placement), what the plan's step computes
with (:func:`step_parts`: the tiers' resources and the update chain among it), a new train state
created directly in that plan's placement (:func:`initial_state`), and its shapes without one
(:func:`abstract_state`, a pure function of the plan).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero.comm import layouts
from jzero.config import Config
from jzero.config.blocks import DTYPES
from jzero.errors import JZeroWarning
from jzero.modeling.gather_units import UnitRules, check_units, choose_units, prefetches
from jzero.modeling.model_adapter import ModelAdapter
from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.opt_layout import OptLayout, tx_traits_of
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths
from jzero.sharding.planner import CommSettings, Dtypes, Layout, make_plan
from jzero.sharding.zeropp import ZeroPP
from jzero.tiers import registry
from jzero.tiers.base import Resources, Tier, Update
from jzero.tiers.host_step import HOST_STEP
from jzero.tiers.delayed import DelayedUpdate
from jzero.train import input_checks
from jzero.train import step as step_lib
from jzero.train.optim import host_adam_settings, plain_block
from jzero.train.precision import LossScaler
from jzero.tiers.updates import Held, shrink
from jzero.train.state import TrainState

__all__ = ["abstract_state", "initial_state", "plan_from_config", "step_parts", "train_key"]

PyTree = Any


def train_key(rng: jax.Array) -> jax.Array:
  """The training PRNG key of a state created from ``rng`` (dropout etc.; the step folds in its
  number): ``split(rng)[1]``. The model's initialisation takes ``rng`` itself, as
  ``module.init(rng)`` does, so ``engine.init(key)`` gives the parameters a plain Flax loop gets
  from ``key``."""
  return jax.random.split(rng)[1]


def plan_from_config(config: Config, mesh: ZeroMesh, model: ModelAdapter,
                     stacked_layers: tuple[str, ...], zeropp: ZeroPP, rng: jax.Array,
                     sample_batch: Any, tx: optax.GradientTransformation | None = None) -> Plan:
  """The plan of a resolved config for ``model``'s parameters: stage-3 gather units from the
  model's module tree and ``leaf_module``, the layout, the leaves ``tx`` never changes frozen
  (:mod:`jzero.sharding.tx_traits`; None: none), then where the tiers put leaves
  (:func:`jzero.tiers.registry.placement`); prefetching when ``stage3_prefetch_bucket_size`` and
  ``stage3_max_live_parameters`` allow it (:func:`jzero.modeling.gather_units.prefetches`);
  checked against ``max_live_parameters`` and said once
  by each tier (:meth:`jzero.tiers.base.Tier.check_plan`)."""
  zero, types = config.zero_optimization, config.data_types
  abstract = model.abstract_params(rng, sample_batch)
  units = None
  if zero.stage == 3:
    rules = UnitRules(classes=tuple(zero.leaf_module.classes), names=tuple(zero.leaf_module.names),
                      name_suffixes=tuple(zero.leaf_module.name_suffixes),
                      granularity_threshold=zero.module_granularity_threshold)
    sizes = {path: math.prod(np.shape(x)) for path, x in flatten_paths(abstract).items()}
    units = choose_units(model.modules(rng, sample_batch), sizes, rules)
  stacked = lambda path: any(path == s or path.startswith(s + "/") for s in stacked_layers)
  layout = Layout(stage=zero.stage, mesh=mesh, stacked=stacked,
                  persistence_threshold=zero.param_persistence_threshold,
                  model_persistence_threshold=zero.model_persistence_threshold, units=units)
  accum, comm = types.grad_accum_dtype, config.communication_data_type
  dtypes = Dtypes(compute=DTYPES[config.precision],
                  grad_accum=DTYPES[accum] if accum else jnp.float32,
                  comm=DTYPES[comm] if comm else None)
  moves = CommSettings(
      reduce_scatter=zero.reduce_scatter, reduce_bucket_size=zero.reduce_bucket_size,
      gather_bucket_size=zero.prefetch_bucket_size if zero.stage == 3 else
      zero.allgather_bucket_size, overlap_comm=bool(zero.overlap_comm), zeropp=zeropp)
  plan = make_plan(abstract, layout, dtypes, moves)
  if tx is not None:
    plan = plan.with_frozen(tx_traits_of(plan, tx).frozen)
  plan = dataclasses.replace(plan, prefetch=prefetches(plan, zero.prefetch_bucket_size,
                                                       zero.max_live_parameters))
  _say_auto_prefetch(plan, zero.max_live_parameters)
  plan = plan.placed(registry.placement(plan, zero))
  check_units(plan, zero.max_live_parameters)
  registry.check_plan(plan, zero)
  return plan


def _say_auto_prefetch(plan: Plan, max_live_parameters: int | str) -> None:
  """On GPUs present, ``stage3_max_live_parameters: "auto"`` prefetches; what would overlap more
  within the memory is found by compiling (``jzero aot``), which a run does not do: said."""
  device = plan.mesh.mesh.devices.flat[0]
  if (max_live_parameters == "auto" and plan.prefetch and device.platform == "gpu"
      and device in jax.devices()):
    warnings.warn(
        'zero_optimization.stage3_max_live_parameters "auto": this run prefetches (two gathered '
        "layers alive). Whether the step overlaps more within the memory without the prefetch is "
        "found by compiling it both ways: jzero aot --config ... does, and prints the number to "
        "set here for the better one.", JZeroWarning, stacklevel=3)


def step_parts(plan: Plan, config: Config, model: ModelAdapter, loss_fn: Any,
               tx: optax.GradientTransformation, schedule: Any, scaler: LossScaler,
               delayed: DelayedUpdate | None, resources: Resources) -> step_lib.StepParts:
  """What the step of ``plan`` computes with: the model, loss, optimizer (``schedule``: the
  config's, None for a client optax transformation) and loss scaler, the plan's tiers and their
  ``resources``, the update chain (:func:`jzero.tiers.registry.update`) with the delayed update
  in it, the host's work after the step (:func:`jzero.tiers.registry.after_step`), and the
  config's numbers."""
  tiers = registry.active(plan)
  opt = OptLayout.of(plan, tx)
  if HOST_STEP in resources and schedule is not None:  # the host step runs the config's Adam
    settings = host_adam_settings(plain_block(config.optimizer))
    if settings is not None:
      resources[HOST_STEP].configure(settings, schedule)
  return step_lib.StepParts(
      plan=plan, model=model, loss_fn=loss_fn, tx=tx, opt=opt, schedule=schedule, scaler=scaler,
      tiers=tiers, resources=resources,
      update=registry.update(tiers, plan, config, tx, opt, resources,
                             elementwise=schedule is not None, delayed=delayed),
      after_step=registry.after_step(tiers, plan, config, tx, resources),
      delayed=delayed,
      settings=step_lib.StepSettings.from_config(config, prefetch=plan.prefetch))


def _to_layout(leaf: LeafPlan, x: jax.Array, partitioned: bool) -> jax.Array:
  """A logical (or, partitioned, already padded) fp32 leaf in the plan's layout."""
  if not partitioned:
    return leaf.to_logical(x)
  return x if x.shape == leaf.padded_shape else leaf.to_padded(x)  # given padded: as it is


def _master(plan: Plan, layout: PyTree) -> PyTree:
  """The train state's fp32 master from the state layout: None in fp32 training; a frozen leaf's
  a 0-byte placeholder (it has none; its optimizer state, if any, was made from the layout)."""
  return shrink(plan, layout, plan.frozen_paths) if plan.has_master else None


def abstract_state(plan: Plan, model: ModelAdapter, update: Update, scaler: LossScaler,
                   sample_batch: Any = None, held: Held | None = None) -> TrainState:
  """The TrainState of ``plan`` as ShapeDtypeStructs (global shapes): as checkpoints hold it --
  every array in its real shape, also what a tier keeps outside the state, and no hpZ secondary
  --, or with ``held`` (:func:`jzero.tiers.registry.held`) as the step takes it: placeholders
  for what the tiers hold, and the secondary partitions. A pure function of the plan: the model's
  shapes and the update chain's ``init``, traced abstractly."""
  def make():
    layout = plan.abstract_master()
    layout = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout)
    params = plan.map(lambda l: jnp.zeros(plan.param_shape(l), plan.compute_dtype))
    if held is not None:
      layout, params = shrink(plan, layout, held.state), shrink(plan, params, held.param)
    return TrainState(
        step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32), params=params,
        master=_master(plan, layout), loss_scale=scaler.init(),
        rng=jax.random.key_data(train_key(jax.random.key(0))), model_state={},
        **update.init(layout))
  abstract = jax.eval_shape(make)._replace(
      model_state=model.abstract_model_state(jax.random.key(0), sample_batch))
  if held is not None and plan.zeropp.hpz > 1:
    abstract = abstract._replace(secondary=jax.eval_shape(layouts.refresh_program(plan),
                                                          abstract.params))
  return abstract


def initial_state(plan: Plan, model: ModelAdapter, update: Update, scaler: LossScaler,
                  tiers: tuple[type[Tier], ...], resources: Resources, shardings: TrainState,
                  rng: jax.Array, sample_batch: Any = None, params: PyTree = None,
                  model_state: PyTree = None) -> TrainState:
  """A new TrainState in ``shardings``: the model's initialisation (or ``params``, checked
  against the plan) laid out by the plan, the model's initial state (or ``model_state``, checked
  against the model's), the update chain's fresh state (``update.init``: optimizer state, nothing
  carried by the delayed update), placeholders where a tier keeps state outside the arrays, and
  -- after the jit -- each tier's initial masters written into its resource
  (:func:`jzero.tiers.registry.write_initial`, e.g. the NVMe store's first slot). Without the hpZ
  secondary partitions (the engine computes them)."""
  held, kept = registry.held(tiers, plan), registry.kept(tiers, plan)

  def make_state(rng, params, model_state):
    if params is None or model_state is None:  # module.init(rng)'s variables
      fresh_params, fresh_state = model.init_variables(rng, sample_batch)
      params = fresh_params if params is None else params
      model_state = fresh_state if model_state is None else model_state
    p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state_layout = plan.map(lambda l, x: _to_layout(l, x, l.state_partitioned), p32)
    params = plan.map(lambda l, x: _to_layout(l, x, l.param_partitioned).astype(
        plan.compute_dtype), p32)
    # what a tier's resource keeps starts from the full masters; the state holds placeholders
    masters = {l.path: x for l, x in zip(plan.leaf_list(), jax.tree.leaves(state_layout))
               if l.path in kept}
    state_layout = shrink(plan, state_layout, held.state)
    params = shrink(plan, params, held.param)
    state = TrainState(
        step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32), params=params,
        master=_master(plan, state_layout), loss_scale=scaler.init(),
        rng=jax.random.key_data(train_key(rng)),
        model_state=jax.tree.map(jnp.asarray, model_state), **update.init(state_layout))
    return state, masters

  masters_shardings = {l.path: plan.sharding(plan.state_spec(l)) for l in plan.leaf_list()
                       if l.path in kept}
  out_shardings = (shardings._replace(secondary=None), masters_shardings)
  params = model.initial_params if params is None else params
  if model_state is not None:
    input_checks.check_model_state(model_state, model.abstract_model_state(rng, sample_batch))
  elif params is not None and not jax.tree.leaves(model.abstract_model_state(rng, sample_batch)):
    model_state = {}  # nothing to initialise
  else:
    model_state = model.initial_model_state
  if params is not None:
    input_checks.check_params(plan, params)
  given = (params, model_state)
  state, masters = jax.jit(lambda r, g: make_state(r, *g), out_shardings=out_shardings)(rng, given)
  registry.write_initial(tiers, plan, resources, masters)
  return state
