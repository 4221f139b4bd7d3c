"""The tier interface: :class:`Tier`, :class:`Update`, and :class:`EngineView`, what a tier may ask
of the engine.

A *tier* is a place model state lives besides device memory: ZeRO-Offload's host memory for the
optimizer state (:mod:`jzero.tiers.host_optimizer`) and for parameters
(:mod:`jzero.tiers.host_params`), ZeRO-Infinity's NVMe store (:mod:`jzero.tiers.nvme`). The
registry (:mod:`jzero.tiers.registry`) lists them; an engine asks each one (:meth:`Tier.create`)
whether its plan and config use it, and keeps those that say yes, in the registry's order.

What varies between tiers, and how each varies:

* **Where a leaf lives** is data: :meth:`Tier.place` records it in the plan
  (:attr:`jzero.sharding.plan.LeafPlan.state_tier` / ``param_tier`` and the memory kinds
  ``state_kind`` / ``param_kind``); what those names mean is read through one module,
  :mod:`jzero.tiers.where`. :meth:`Tier.check_config` refuses what a tier cannot do, before any
  device work; :meth:`Tier.check_plan` says what a plan made of the tier's config block.
* **Where a stored partition comes from in the forward pass** (:meth:`Tier.grad_target`,
  :meth:`Tier.gather_inputs`): a param kept in host memory or on NVMe is differentiated through a
  device slot and read when its gather runs.
* **How the update runs** is one small protocol, :class:`Update`, composed like optax's
  wrappers: the step starts from the update on the device (:class:`jzero.train.update.
  DeviceUpdate`) and each active tier may wrap it (:meth:`Tier.update`) -- the host tier runs it
  streamed from host memory or on the host, the NVMe tier hands its leaves out of the jit and
  updates them from the store after it. An update that changes nothing for a leaf leaves it to
  the update it wraps.
* **Arrays held outside the train state** (the NVMe store): their init (:meth:`Tier.prepare`,
  :meth:`Tier.initial_layout`, :meth:`Tier.after_init`), the full state read back for
  checkpoints (:meth:`Tier.full_state`, :meth:`Tier.expand_abstract`, :meth:`Tier.absorb`) and
  their bytes for the memory report (:meth:`Tier.measured_bytes`, :meth:`Tier.held_bytes`).

*When* the update applies is not a tier's: the delayed parameter update is a transformation of the
step's gradient with its own carried state (:class:`jzero.tiers.delayed.DelayedUpdate`), and the
skip of a non-finite step is the update's (``keep`` / :meth:`Update.skipped`).

A tier talks to the engine only through :class:`EngineView`: its plan, mesh, config, optimizer,
the NVMe settings and store, and the hpZ refresh; the layout changes a tier's update needs are
:mod:`jzero.comm.layouts`'. It never reads the engine's private attributes
(``tests/test_layout.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax
import optax

__all__ = ["EngineView", "Tier", "Update"]

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


class Update:
  """How the step's optimizer update runs, wrapping the update it changes (``inner``).

  Every method delegates to ``inner``; a wrapper overrides what it changes. The root,
  :class:`jzero.train.update.DeviceUpdate`, runs optax on the device. Inside the jitted step, on
  one device's blocks (inside ``shard_map``), the step calls, in this order:
  :meth:`hand_out` (before clipping), :meth:`apply` -- or for a skipped step :meth:`skipped` --,
  :meth:`new_param` per leaf, :meth:`store_params`; on the host after the jitted step,
  :meth:`after_step`.
  """

  def __init__(self, inner: Update | None):
    self.inner = inner

  @property
  def skip_by(self) -> str | None:
    """How a skipped step must be written: "cond" -- a ``lax.cond`` around the update choosing
    :meth:`skipped` (host-memory arrays cannot be selected elementwise on the device); "select"
    -- :meth:`apply` with ``keep`` (a host computation cannot sit inside a conditional on the
    GPU); None -- either, the step chooses (a ``lax.cond`` where the loss scale checks
    overflow, else the select)."""
    return self.inner.skip_by

  def hand_out(self, state: Any, grads: PyTree, factor: jax.Array | None) -> tuple[PyTree, dict]:
    """(the gradients left for :meth:`apply`, what leaves the jit for work after it -- by name,
    ``{}``: nothing); ``factor``: the clipping factor (None: no clipping), not yet applied."""
    return self.inner.hand_out(state, grads, factor)

  def output_specs(self) -> dict:
    """PartitionSpecs of :meth:`hand_out`'s second result."""
    return self.inner.output_specs()

  def apply(self, grads: PyTree, opt_state: PyTree, master: PyTree,
            keep: jax.Array | None = None) -> tuple[PyTree, PyTree, PyTree]:
    """(new master where it is stored, the same on the device -- what compute params are cast
    from --, new optimizer state) from the clipped ``grads``. ``keep`` (a traced bool, only where
    :attr:`skip_by` allows it): keep the old master and state where it is true."""
    return self.inner.apply(grads, opt_state, master, keep)

  def skipped(self, params: PyTree, master: PyTree,
              opt_state: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    """A skipped step's (params, master, opt_state): the state's, placed as :meth:`apply`'s
    results are (a ``lax.cond``'s branches agree on memory spaces)."""
    return self.inner.skipped(params, master, opt_state)

  def new_param(self, leaf: Any, m_device: jax.Array, m: jax.Array, old: jax.Array) -> jax.Array:
    """A leaf's new param: ``m_device`` (the new master on the device) cast and gathered as the
    stage lays it out; ``m``: the new master where it is stored; ``old``: the state's param."""
    return self.inner.new_param(leaf, m_device, m, old)

  def store_params(self, params: PyTree, master: PyTree) -> PyTree:
    """The new params, placed where they are stored between steps."""
    return self.inner.store_params(params, master)

  def after_step(self, state: Any, metrics: dict, outputs: dict) -> Any:
    """On the host, after the jitted step: the state after the work on :meth:`hand_out`'s
    ``outputs``."""
    return self.inner.after_step(state, metrics, outputs)


class Tier:
  """One tier's hooks; see the module docstring for when each is called. Subclasses set
  :attr:`name` and override :meth:`create` and the hooks of the phases they change."""

  #: The tier's name.
  name: ClassVar[str] = ""

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

  # -- the update ------------------------------------------------------------------------------
  def update(self, engine: EngineView, inner: Update) -> Update:
    """The step's update with what the tier changes in it, wrapping ``inner`` (the update of the
    tiers before it in the registry, at first the device's); ``inner`` itself: nothing."""
    return inner

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
