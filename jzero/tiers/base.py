"""The tier interface: :class:`Tier`, what a place for model state besides device memory answers,
:class:`Update`, one link of the step's optimizer update, and :data:`Resources`, what the tiers
own at run time.

A *tier* is a place model state lives besides device memory: ZeRO-Offload's host memory for the
optimizer state (:mod:`jzero.tiers.host_optimizer`) and for parameters
(:mod:`jzero.tiers.host_params`), ZeRO-Infinity's NVMe store (:mod:`jzero.tiers.nvme`). A tier is
a class of class methods -- it holds nothing; the registry (:mod:`jzero.tiers.registry`) lists
them, and a plan uses those that say so (:meth:`Tier.uses`). Every hook takes what it reads
explicitly: the plan, the resolved config, the optax transformation, and the tier's *resource*.

* **Where a leaf lives** is data: :meth:`Tier.place` records it in the plan
  (:attr:`jzero.sharding.plan.LeafPlan.state_tier` / ``param_tier`` and the memory kinds
  ``state_kind`` / ``param_kind``); :meth:`Tier.check_config` refuses what a tier cannot do,
  before any device work; :meth:`Tier.check_plan` says what a plan made of the tier's block. A
  leaf whose state (or param) a tier keeps *outside the train state's arrays*
  (:meth:`Tier.holds_state`, :meth:`Tier.holds_param`) has a 0-byte placeholder there; what the
  tier's resource keeps of a leaf (:meth:`Tier.keeps`) starts from its initial master.
* **What the config may ask of it** is data too: :attr:`Tier.answers` names the config values
  that select it (``offload_optimizer.device: nvme``), and :attr:`Tier.memory` the column its
  bytes go in; the config's accepted values, the estimator, the memory report and ``jzero plan``'s
  candidates read them (and :meth:`Tier.estimate`) from the registry.
* **What it owns at run time** -- the NVMe store and its reader -- it opens once per plan with
  :meth:`Tier.open` into the :data:`Resources` mapping (tier name -> resource). The step, the
  checkpoints, the memory report take ``(plan, state, resources)``; nothing takes the engine.
* **Where a stored partition comes from in the forward pass** (:meth:`Tier.grad_target`,
  :meth:`Tier.gather_inputs`): a param kept in host memory or on NVMe is differentiated through a
  device slot and read when its gather runs.
* **How the update runs**: :meth:`Tier.update` wraps the step's :class:`Update` (below);
  :meth:`Tier.after_step` is its work on the host after the jitted step.
* **The state outside a step**: what the tier keeps outside the arrays is written at init
  (:meth:`Tier.write_initial`), read into a full state for checkpoints (:meth:`Tier.full_state`)
  and taken back from one (:meth:`Tier.absorb`), and its bytes measured
  (:meth:`Tier.measured_bytes`, :meth:`Tier.held_bytes`).

**The update** is a chain of optax-shaped links, each an :class:`Update`: ``init`` (the train
state's fields it owns) and ``update`` (inside the jitted step). A link wraps the one it changes
(``inner``) and overrides only what it changes. What runs on the host after the jitted step is
one explicit list, the tiers' :meth:`Tier.after_step` hooks in :data:`jzero.tiers.registry.TIERS`'
order (:func:`jzero.tiers.registry.after_step`), each reading what its link handed out. The
registry composes the chain (:func:`jzero.tiers.registry.update`), outermost first::

    tiers that take leaves out of the step (Tier.wraps == "step": the NVMe store's update)
      -> ClipByFactor -> DelayedUpdate (the delayed parameter update, when on)
      -> SkipNonFinite (one mode: "cond" or "select")
      -> tiers that change where the step's state lives (Tier.wraps == "state": the host's)
      -> DeviceUpdate (optax on the device)

:mod:`jzero.tiers.updates` holds the root and the generic links.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping

import jax
import optax

__all__ = ["AfterStep", "Resources", "Tier", "Update"]

PyTree = Any

#: What the active tiers own at run time, by tier name (e.g. ``{"nvme": NvmeStore}``): opened once
#: per plan (:meth:`Tier.open`), handed to every hook that reads it.
Resources = Mapping[str, Any]

#: A tier's work on the host after a jitted step (:meth:`Tier.after_step`): (the state the step
#: returned, its metrics, what the update chain handed out of the jit by name) -> the state.
AfterStep = Callable[[Any, dict, dict], Any]


class Update:
  """One optax-shaped link of the step's optimizer update, wrapping the link it changes
  (``inner``; None for the root, :class:`jzero.tiers.updates.DeviceUpdate`). Every method
  delegates to ``inner``; a link overrides what it changes."""

  def __init__(self, inner: Update | None):
    self.inner = inner

  @property
  def skip_mode(self) -> str:
    """How a skipped step is written below the skip: "cond" -- a ``lax.cond`` whose skipping
    branch is :meth:`skipped` (host-memory state cannot be selected elementwise on the device,
    and fp16's overflow check keeps no second copy of the update); "select" -- one
    ``update(..., skip=flag)`` that selects the old state elementwise (a host computation cannot
    sit inside a conditional on the GPU)."""
    return self.inner.skip_mode

  @property
  def output_specs(self) -> dict:
    """PartitionSpecs of what :meth:`update` hands out of the jit, by name."""
    return self.inner.output_specs

  @property
  def output_kinds(self) -> dict:
    """Memory kinds of what :meth:`update` hands out (a prefix of :attr:`output_specs`; None or a
    missing name: the device's)."""
    return self.inner.output_kinds

  def init(self, layout: PyTree) -> dict:
    """The train state's fields this chain owns, fresh (``{"opt_state": ..., "delayed": ...}``),
    from the fp32 params in the state layout (``layout``; traced inside the init's jit, or under
    ``eval_shape`` for the abstract state)."""
    return self.inner.init(layout)

  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    """Inside the jitted step, on one device's blocks: (the new train state, what leaves the jit
    for :meth:`after` -- by name, ``{}``: nothing).

    Args:
      grads: fp32 gradients in the state layout, unscaled.
      state: the train state the step started from.
      skip: None (apply) or a traced bool (skip where true: the step's gradient was not
        finite); a step known to be skipped when it is traced is :meth:`skipped`.
      factor: the clipping factor, for the links outside the clipping (the tiers whose
        :attr:`Tier.wraps` is "step": they hand it out with their leaves' unclipped gradients);
        :class:`jzero.tiers.updates.ClipByFactor` applies it to the rest and hands None below.
    """
    return self.inner.update(grads, state, skip, factor)

  def skipped(self, state: Any) -> tuple[Any, dict]:
    """A skipped step's (train state, outputs) inside the jit: the old state, placed as
    :meth:`update` places its results (a ``lax.cond``'s branches agree on memory spaces), and
    outputs of :meth:`update`'s structure."""
    return self.inner.skipped(state)


class Tier:
  """One place for model state besides device memory (module docstring): class methods only.
  Subclasses set :attr:`name` and override :meth:`uses` and the hooks they change."""

  #: The tier's name: its resource's key in :data:`Resources`, its outputs' key.
  name: ClassVar[str] = ""
  #: Where its bytes go, off the device: the estimator's and the memory report's column ("host",
  #: "nvme"); "" for a tier that keeps nothing off the device.
  memory: ClassVar[str] = ""
  #: The config values that select it: (config block, its ``device`` value) pairs, e.g.
  #: ``(("offload_optimizer", "nvme"), ("offload_param", "nvme"))``.
  answers: ClassVar[tuple[tuple[str, str], ...]] = ()
  #: Where its update sits in the chain: "state" (it changes how the update of the state the step
  #: holds runs: inside the non-finite skip) or "step" (it takes its leaves' gradients out of the
  #: step before clipping and updates them after it, on the host).
  wraps: ClassVar[str] = "state"
  #: ``offload_optimizer.ratio`` below 1 is honoured (``jzero plan`` tries half).
  partial: ClassVar[bool] = False

  # -- config and plan -------------------------------------------------------------------------
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
    of the resolved ``zero_optimization`` block, where the user could not tell from the config."""

  @classmethod
  def uses(cls, plan: Any) -> bool:
    """Whether ``plan`` uses the tier (its hooks run for it)."""
    return False

  @classmethod
  def holds_state(cls, plan: Any, leaf: Any) -> bool:
    """The tier keeps ``leaf``'s master and optimizer state outside the train state's arrays
    (which hold 0-byte placeholders): its update is the tier's, after the step."""
    return False

  @classmethod
  def holds_param(cls, plan: Any, leaf: Any) -> bool:
    """The tier keeps ``leaf``'s compute param outside the train state's arrays (a 0-byte
    placeholder there); the step keeps the placeholder as it is."""
    return False

  @classmethod
  def keeps(cls, plan: Any, leaf: Any) -> bool:
    """The tier's resource keeps something of ``leaf`` -- its state, its param, or a copy of it
    -- and starts from its initial fp32 master (:meth:`write_initial`)."""
    return cls.holds_state(plan, leaf) or cls.holds_param(plan, leaf)

  @classmethod
  def estimate(cls, block: str, share: float, numbers: Any, tiers: dict) -> None:
    """The estimator's offload rule for the config block ``block`` (one of :attr:`answers`):
    moves ``share`` of its category's bytes from ``tiers["device"]`` to the tier's column in
    ``tiers`` (tier column -> category -> bytes), in place. ``numbers``: the estimate's inputs
    (:class:`jzero.analysis.estimate.Numbers`). The default moves the block's category
    ("optimizer" for ``offload_optimizer``, "params" for ``offload_param``) whole into
    :attr:`memory`; where the gradients are is the update's (:mod:`jzero.analysis.update_memory`)."""
    move_offloaded(block, cls.memory, share, numbers, tiers)

  # -- run time --------------------------------------------------------------------------------
  @classmethod
  def open(cls, plan: Any, config: Any, tx: optax.GradientTransformation) -> Any:
    """What the tier owns at run time for ``plan`` (None: nothing), opened before the first
    state (e.g. a store, its free space checked): its entry in :data:`Resources`."""
    return None

  @classmethod
  def grad_target(cls, plan: Any, leaf: Any, p: jax.Array) -> jax.Array | None:
    """What the step differentiates for a leaf whose param the tier holds (e.g. a zero gradient
    slot on the device for a param in host memory); None: not the tier's leaf."""
    return None

  @classmethod
  def gather_inputs(cls, plan: Any, resource: Any, leaf: Any, p: jax.Array) -> dict | None:
    """Extra :class:`jzero.comm.zero_param.ZeroParam` arguments for a partitioned leaf whose
    param the tier holds: ``source=`` (a :class:`jzero.comm.zero_param.PartitionSource`) and
    ``stored=`` (what it reads); None: not the tier's leaf."""
    return None

  @classmethod
  def update(cls, plan: Any, config: Any, tx: optax.GradientTransformation, resource: Any,
             inner: Update, *, elementwise: bool) -> Update:
    """The step's update with what the tier changes in it, wrapping ``inner``; ``inner`` itself:
    nothing. ``elementwise``: ``tx`` is the config's optimizer (leaf by leaf updates are valid;
    a client optax transformation may couple leaves)."""
    return inner

  @classmethod
  def after_step(cls, plan: Any, config: Any, tx: optax.GradientTransformation,
                 resource: Any) -> AfterStep | None:
    """The tier's work on the host after each jitted step (None: none), made once per plan: the
    update of the leaves whose gradients its :meth:`update` link handed out of the jit (under
    its name in the step's outputs), e.g. the NVMe store's."""
    return None

  # -- the state outside a step ----------------------------------------------------------------
  @classmethod
  def write_initial(cls, plan: Any, resource: Any, masters: dict[str, jax.Array]) -> None:
    """After the init's jit: the initial fp32 masters (state layout, by leaf path) of the leaves
    the tier holds (:meth:`holds_state` / :meth:`holds_param`), into its resource."""

  @classmethod
  def full_state(cls, plan: Any, resource: Any, state: Any) -> Any:
    """``state`` with the arrays the tier holds outside it read in (laid out by the plan)."""
    return state

  @classmethod
  def absorb(cls, plan: Any, resource: Any, state: Any) -> Any:
    """A full state (a restore) -> the tier's arrays written into its resource, placeholders in
    their place: the state as the step expects it."""
    return state

  @classmethod
  def measured_bytes(cls, plan: Any, resource: Any) -> dict[str, dict[str, int]]:
    """Bytes one device's share of what the tier holds outside the train state's arrays takes:
    category ("params", "master", "optimizer") -> memory kind or column -> bytes, measured; the
    memory report adds them to the live arrays'."""
    return {}

  @classmethod
  def held_bytes(cls, plan: Any, resource: Any) -> dict[str, int]:
    """Global bytes of what the tier holds outside the train state by category ("master",
    "optimizer"), as the arrays would take: the memory report's bytes per parameter count them."""
    return {}


def move_offloaded(block: str, column: str, share: float, numbers: Any, tiers: dict) -> None:
  """The plain offload rule (:meth:`Tier.estimate`): ``offload_optimizer`` moves ``share`` of the
  optimizer state into ``column``; ``offload_param`` moves stage 3's partitioned params."""
  device = tiers["device"]
  tiers.setdefault(column, {})
  tiers.setdefault("host", {})
  if block == "offload_optimizer":
    tiers[column]["optimizer"] = tiers[column].get("optimizer", 0.0) + share * numbers.optimizer
    device["optimizer"] = (1 - share) * numbers.optimizer
  elif block == "offload_param":
    tiers[column]["params"] = tiers[column].get("params", 0.0) + numbers.param_partition
    device["params"] = numbers.persistent
