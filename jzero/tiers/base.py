"""The tier interface: :class:`Tier`, and :class:`EngineView`, what a tier may ask of the engine.

A *tier* is a place model state lives besides device memory, or a change to when the state is
updated: ZeRO-Offload's host optimizer (:mod:`jzero.tiers.host_optimizer`), parameters in host
memory (:mod:`jzero.tiers.host_params`), ZeRO-Infinity's NVMe store for optimizer state and
parameters (:mod:`jzero.tiers.nvme`), the delayed parameter update (:mod:`jzero.tiers.delayed`).
The registry (:mod:`jzero.tiers.registry`) lists them; an engine asks each one
(:meth:`Tier.create`) whether its plan and config use it, and keeps those that say yes, in the
registry's order.

Where a leaf lives is the plan's (:attr:`jzero.sharding.plan.LeafPlan.state_tier` and
``param_tier``, memory kinds from :class:`jzero.sharding.plan.Plan`). What happens to it is the
tier's, through hooks the engine calls at fixed points; every hook of this base class does nothing,
so a tier overrides only the phases it changes:

* **config** (:meth:`Tier.check_config`, :meth:`Tier.place`, :meth:`Tier.check_plan`):
  refusals before any device work; which leaves the tier takes (placement data the plan records);
  what the plan, once built, made of the tier's block (said once).
* **the forward pass** (:meth:`Tier.grad_target`, :meth:`Tier.gather_inputs`): where a leaf's
  partition comes from when its gather runs.
* **step variants** (:meth:`Tier.variant`, :meth:`Tier.seen`): the engine compiles one step per
  distinct variant its tiers ask for (the delayed update's warm-up, prime and steady steps) and
  picks the variant on the host, so no step holds a ``lax.cond`` over it.
* **the update phase, inside the jitted step** (on one device's blocks, inside ``shard_map``), in
  this order: :meth:`Tier.take_outputs` (what leaves the jit for an update after it, and the
  gradients left to update here), :meth:`Tier.choose_gradient` (which gradient is applied,
  whether the update is skipped, what the state carries), :meth:`Tier.master_in`,
  :meth:`Tier.optimizer_update` (one tier may own the optimizer update; otherwise it runs on the
  device), :meth:`Tier.new_param` (per leaf), :meth:`Tier.place_params`, and for a skipped step
  :meth:`Tier.skipped`. :attr:`Tier.needs_cond` says the skip must be a ``lax.cond`` (host-memory
  arrays cannot be selected elementwise); :meth:`Tier.checks_finite` whether a non-finite fp32
  gradient skips the step; :meth:`Tier.applied_steps` corrects the lr schedule's step count.
* **after the jitted step** (:meth:`Tier.after_step`, on the host): e.g. the NVMe store's update
  of its leaves, committed as the step.
* **the state outside a step** (:meth:`Tier.full_state`, :meth:`Tier.expand_abstract`,
  :meth:`Tier.absorb`): the arrays a tier holds outside the TrainState, read into it (logical
  params, checkpoint saves), their real shapes (a restore's target), and a restored state's
  arrays taken back in.
* **bytes** (:meth:`Tier.measured_bytes`, :meth:`Tier.held_bytes`): what the tier holds outside
  the TrainState's arrays, for the memory report.
* **init** (:meth:`Tier.prepare`, :meth:`Tier.initial_layout`, :meth:`Tier.after_init`): e.g.
  placeholders in the TrainState, the real arrays written to a store.

A tier talks to the engine only through :class:`EngineView`: its plan, mesh, config, optimizer,
the NVMe settings and store, and the hpZ refresh; the layout changes a tier's update needs are
:mod:`jzero.comm.layouts`'. It never reads the engine's private attributes
(``tests/test_layout.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Hashable, Protocol

import jax
import optax

__all__ = ["EngineView", "Tier"]

PyTree = Any


class EngineView(Protocol):
  """What a tier may read from the engine (:class:`jzero.Engine` implements it)."""

  config: Any  # the resolved jzero.Config
  mesh: Any  # jzero.ZeroMesh
  plan: Any  # jzero.Plan
  tx: optax.GradientTransformation
  schedule: Any  # step -> lr of the config's schedule; None for a client optimizer
  # The NVMe tier's settings (from the config, at initialize) and its store, which the tier opens
  # in prepare(); public on the engine because users read the store's bytes and files.
  nvme_settings: Any
  nvme_store: Any

  def with_secondary(self, state: Any) -> Any:
    """``state`` with its hpZ secondary partitions recomputed from its params."""


class Tier:
  """One tier's hooks; see the module docstring for when each is called. Subclasses set
  :attr:`name` and override :meth:`create` and the hooks of the phases they change."""

  #: The tier's name: its key in a step's outputs and in its variants.
  name: ClassVar[str] = ""
  #: A skipped step must be a ``lax.cond``, not an elementwise select (host-memory arrays).
  needs_cond: ClassVar[bool] = False

  @classmethod
  def check_config(cls, config: Any) -> None:
    """Refuses (ConfigError) what the tier's config block asks and it cannot do, before any
    device work (``config``: the Config as given, "auto" values still in it)."""

  @classmethod
  def place(cls, plan: Any, zero: Any, placement: Any) -> Any:
    """``placement`` (a :class:`jzero.sharding.planner.Placement`) with the leaves of ``plan`` (all
    on the device) that the tier takes, by the resolved ``zero_optimization`` block ``zero``."""
    return placement

  @classmethod
  def check_plan(cls, plan: Any, zero: Any) -> None:
    """Says (a JZeroWarning, or jzero's log) what ``plan``, just built, makes of the tier's part
    of the resolved ``zero_optimization`` block, where the user could not tell from the config:
    e.g. a parameter offload that moves little. Called once per plan."""

  @classmethod
  def create(cls, engine: EngineView) -> Tier | None:
    """The tier for ``engine`` (its plan exists), or None when its plan and config do not use it."""
    return None

  # -- the train state's carried field (TrainState.delayed) ------------------------------------
  def carries(self) -> bool:
    """The tier carries state from one step to the next (:meth:`choose_gradient`'s third
    result; at most one tier does)."""
    return False

  def carried_specs(self, engine: EngineView) -> Any:
    """PartitionSpecs of the carried state."""
    return None

  def carried_memory_kinds(self, engine: EngineView, device: str | None) -> Any:
    """Memory kinds of the carried state (``device``: the device's)."""
    return None

  def initial_carried(self, state_layout: PyTree) -> Any:
    """Inside the init's jit: the carried state of a new TrainState."""
    return None

  def carried_restore_names(self, abstract: Any, stored: dict, params_only: bool) -> list[str]:
    """The checkpoint's array names a restore reads for the carried state (``stored``: the
    checkpoint's array table; ``abstract``: the engine's abstract TrainState)."""
    return []

  def restored_carried(self, abstract: Any, shardings: Any, read: dict, stored: dict,
                       params_only: bool) -> Any:
    """The carried state of a restore: from ``read`` (the arrays of
    :meth:`carried_restore_names`), or fresh when the checkpoint has none."""
    return None

  # -- the forward pass, inside the jitted step ------------------------------------------------
  def grad_target(self, engine: EngineView, leaf: Any, p: jax.Array) -> jax.Array | None:
    """What the step differentiates for a leaf whose param the tier holds (e.g. a zero gradient
    slot on the device for a param in host memory); None: not the tier's leaf."""
    return None

  def gather_inputs(self, engine: EngineView, leaf: Any, p: jax.Array) -> dict | None:
    """Extra :class:`jzero.comm.zero_param.ZeroParam` arguments for a partitioned leaf whose
    param the tier holds: ``source=`` (a :class:`jzero.comm.zero_param.PartitionSource`) and
    ``stored=`` (what it reads); None: not the tier's leaf."""
    return None

  # -- step variants (host side) ---------------------------------------------------------------
  def variant(self, engine: EngineView, state: Any, step: int | None, fused: bool) -> Hashable:
    """Which compiled step ``state`` needs at host step ``step`` (``state`` and ``step`` None:
    the steady step, e.g. for :meth:`jzero.Engine.jitted_step`); ``fused``: one jit (False: the
    timed two-jit step of ``wall_clock_breakdown``). None when the tier has one step."""
    return None

  def seen(self, state: Any, variant: Hashable) -> None:
    """The step of ``variant`` returned ``state``."""

  # -- the update phase, inside the jitted step ------------------------------------------------
  def take_outputs(self, engine: EngineView, state: Any, grads: PyTree,
                   factor: jax.Array | None) -> tuple[PyTree, Any]:
    """(gradients left for the update in the step, what the step returns for this tier --
    None: nothing). ``factor``: the clipping factor (None: no clipping)."""
    return grads, None

  def output_specs(self, engine: EngineView) -> Any:
    """PartitionSpecs of what :meth:`take_outputs` returns (None: nothing)."""
    return None

  def checks_finite(self, variant: Hashable) -> bool:
    """fp32: whether a non-finite global gradient norm skips the step in ``variant``."""
    return True

  def choose_gradient(self, state: Any, grads: PyTree, overflow: jax.Array, skip: Any,
                      carried: Any, variant: Hashable) -> tuple[PyTree, Any, Any]:
    """(gradient the update applies, skip -- a bool or a traced bool --, what the state carries
    to the next step); ``overflow``: this step's gradient was not finite."""
    return grads, skip, carried

  def master_in(self, engine: EngineView, master: PyTree) -> PyTree:
    """The masters the update in the step sees."""
    return master

  def owns_update(self) -> bool:
    """This tier runs the optimizer update (:meth:`optimizer_update`)."""
    return False

  def optimizer_update(self, engine: EngineView, grads: PyTree, opt_state: PyTree,
                       master: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    """(new master, the same on the device -- what compute params are cast from --, new optimizer
    state), for a tier whose :meth:`owns_update` is true."""
    raise NotImplementedError(f"{type(self).__name__}.owns_update() is true: it must implement "
                              f"optimizer_update")

  def new_param(self, engine: EngineView, leaf: Any, m_device: jax.Array, m: jax.Array,
                old: jax.Array) -> jax.Array | None:
    """A leaf's new param after the update, or None to leave it to the next tier (and at last to
    :func:`jzero.comm.layouts.compute_param` of ``m_device``). ``m``: the new master where it is
    stored; ``old``: the state's param."""
    return None

  def place_params(self, engine: EngineView, params: PyTree, master: PyTree) -> PyTree:
    """The new params, placed where they are stored between steps."""
    return params

  def skipped(self, engine: EngineView, params: PyTree, master: PyTree,
              opt_state: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    """A skipped step's (params, master, opt_state): the state's, placed as the update's results
    are (a ``lax.cond``'s branches agree on memory spaces)."""
    return params, master, opt_state

  def applied_steps(self, state: Any, applied: jax.Array) -> jax.Array:
    """The count of updates applied (the lr schedule's step), corrected for this tier."""
    return applied

  # -- after the jitted step (host side) -------------------------------------------------------
  def after_step(self, engine: EngineView, state: Any, metrics: dict, output: Any) -> Any:
    """The state after the tier's work outside the jit; ``output``: :meth:`take_outputs`'."""
    return state

  # -- the state outside a step ----------------------------------------------------------------
  def full_state(self, engine: EngineView, state: Any) -> Any:
    """``state`` with the arrays this tier holds outside it read in."""
    return state

  def expand_abstract(self, engine: EngineView, abstract: Any) -> Any:
    """An abstract TrainState with the real shapes of what :meth:`full_state` reads in."""
    return abstract

  def absorb(self, engine: EngineView, state: Any) -> Any:
    """A restored full state -> the tier's arrays taken in, the state as the step expects it."""
    return state

  # -- bytes the tier holds outside the live arrays --------------------------------------------
  def measured_bytes(self, engine: EngineView) -> dict[str, dict[str, int]]:
    """Bytes one device's share of what the tier holds outside the TrainState's arrays takes:
    category ("params", "master", "optimizer") -> memory kind or "nvme" -> bytes, measured (e.g.
    the store's files); the memory report adds them to the live arrays'."""
    return {}

  def held_bytes(self, engine: EngineView) -> dict[str, int]:
    """Global bytes of what the tier holds outside the TrainState by category ("master",
    "optimizer"), as the arrays would take: the memory report's bytes per parameter count them."""
    return {}

  # -- init ------------------------------------------------------------------------------------
  def prepare(self, engine: EngineView) -> None:
    """Before the first state is created (e.g. open a store, check its free space)."""

  def initial_layout(self, engine: EngineView, state_layout: PyTree,
                     params: PyTree) -> tuple[PyTree, PyTree, Any]:
    """Inside the init's jit: the (state-layout masters, params) the TrainState holds, and what the
    init returns for this tier (None: nothing; its shardings: :meth:`init_output_shardings`)."""
    return state_layout, params, None

  def init_output_shardings(self, engine: EngineView) -> Any:
    """Shardings of :meth:`initial_layout`'s output."""
    return None

  def after_init(self, engine: EngineView, state: Any, output: Any) -> None:
    """After the init's jit (not under ``eval_shape``): :meth:`initial_layout`'s output."""
