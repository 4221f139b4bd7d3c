"""What an engine builds once, before its first step: the plan of its config
(:func:`plan_from_config`: the layout, then the tiers' placement), what the plan's step computes
with (:func:`step_parts`), and a new train state created directly in that plan's placement
(:func:`initial_state`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero.config import Config
from jzero.config.blocks import DTYPES
from jzero.modeling.gather_units import UnitRules, check_units, choose_units
from jzero.modeling.model_adapter import ModelAdapter
from jzero.sharding.mesh import ZeroMesh
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths
from jzero.sharding.planner import CommSettings, Dtypes, Layout, make_plan
from jzero.sharding.zeropp import ZeroPP
from jzero.tiers import registry
from jzero.tiers.base import EngineView, Tier
from jzero.tiers.delayed import DelayedUpdate
from jzero.train import input_checks
from jzero.train import step as step_lib
from jzero.train.update import DeviceUpdate
from jzero.train.precision import LossScaler
from jzero.train.state import TrainState

__all__ = ["initial_state", "plan_from_config", "step_parts", "train_key"]

PyTree = Any


def train_key(rng: jax.Array) -> jax.Array:
  """The training PRNG key of a state created from ``rng`` (dropout etc.; the step folds in its
  number): ``split(rng)[1]``. The model's initialisation takes ``rng`` itself, as
  ``module.init(rng)`` does, so ``engine.init(key)`` gives the parameters a plain Flax loop gets
  from ``key``."""
  return jax.random.split(rng)[1]


def plan_from_config(config: Config, mesh: ZeroMesh, model: ModelAdapter,
                     stacked_layers: tuple[str, ...], zeropp: ZeroPP, rng: jax.Array,
                     sample_batch: Any) -> Plan:
  """The plan of a resolved config for ``model``'s parameters: stage-3 gather units from the
  model's module tree and ``leaf_module``, the layout, then where the tiers put leaves
  (:func:`jzero.tiers.registry.placement`); checked against ``max_live_parameters`` and said once
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
  plan = plan.placed(registry.placement(plan, zero))
  check_units(plan, zero.max_live_parameters)
  registry.check_plan(plan, zero)
  return plan


def step_parts(engine: Any) -> step_lib.StepParts:
  """What the step of ``engine``'s plan computes with: the engine's model, loss, optimizer and
  loss scaler, its active tiers, the device's update wrapped by theirs
  (:func:`jzero.tiers.registry.update`), its delayed update and the config's numbers."""
  plan, tiers = engine.plan, engine.tiers
  return step_lib.StepParts(
      plan=plan, model=engine.model, loss_fn=engine.loss_fn, tx=engine.tx,
      schedule=engine.schedule, scaler=engine.scaler, tiers=tiers,
      update=registry.update(tiers, engine, DeviceUpdate(plan, engine.tx)),
      delayed=engine.delayed, settings=step_lib.StepSettings.from_config(engine.config),
      tier_view=engine)


def initial_state(plan: Plan, model: ModelAdapter, tx: optax.GradientTransformation,
                  scaler: LossScaler, tiers: tuple[Tier, ...], delayed: DelayedUpdate | None,
                  view: EngineView,
                  shardings: TrainState, rng: jax.Array, sample_batch: Any = None,
                  params: PyTree = None) -> TrainState:
  """A new TrainState in ``shardings``: the model's initialisation (or ``params``, checked
  against the plan) laid out by the plan, fresh optimizer and loss-scaler state, nothing carried by
  the delayed update (``delayed``; None: it is off), each tier's
  :meth:`~jzero.tiers.base.Tier.initial_layout` and, outside an ``eval_shape``, its
  :meth:`~jzero.tiers.base.Tier.after_init` (e.g. the NVMe store's first write). Without the hpZ
  secondary partitions (the engine computes them)."""
  def to_layout(leaf: LeafPlan, x: jax.Array, partitioned: bool) -> jax.Array:
    if not partitioned:
      return leaf.to_logical(x)
    return x if x.shape == leaf.padded_shape else leaf.to_padded(x)  # given padded: as it is

  def make_state(rng, params):
    if params is None:
      params = model.init_params(rng, sample_batch)  # module.init(rng)'s parameters
    p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state_layout = plan.map(lambda l, x: to_layout(l, x, l.state_partitioned), p32)
    params = plan.map(lambda l, x: to_layout(l, x, l.param_partitioned).astype(
        plan.compute_dtype), p32)
    outputs = {}  # e.g. the NVMe store's initial masters; the state holds placeholders
    for tier in tiers:
      state_layout, params, out = tier.initial_layout(view, state_layout, params)
      if out is not None:
        outputs[tier.name] = out
    state = TrainState(
        step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32), params=params,
        master=state_layout if plan.has_master else None, opt_state=tx.init(state_layout),
        loss_scale=scaler.init(), rng=jax.random.key_data(train_key(rng)),
        delayed=delayed.init(state_layout) if delayed else None)
    return state, outputs

  out_shardings = (shardings._replace(secondary=None),
                   {t.name: s for t in tiers if (s := t.init_output_shardings(view)) is not None})
  params = model.initial_params if params is None else params
  if params is not None:
    input_checks.check_params(plan, params)
    state, outputs = jax.jit(make_state, out_shardings=out_shardings)(rng, params)
  else:
    state, outputs = jax.jit(lambda r: make_state(r, None), out_shardings=out_shardings)(rng)
  if not isinstance(state.step, jax.core.Tracer):  # not under eval_shape (a restore's shapes)
    for tier in tiers:
      if tier.name in outputs:
        tier.after_init(view, state, outputs[tier.name])
  return state
