"""The tiers, in the order their hooks run: :data:`TIERS`, and what the rest of jzero asks of all
of them at once.

A new tier is one line here (or :func:`register`, from outside the package) plus its own module
(a :class:`~jzero.tiers.base.Tier` subclass).
Everything that depends on which tiers exist reads this tuple when it runs: the config's accepted
``device`` values (:func:`devices`, :func:`check_config`), the plan's placement
(:func:`placement`), the resources (:func:`open_resources`), the step's update chain
(:func:`update`) and the host's work after it (:func:`after_step`), the state outside a step
(:func:`full_state`, :func:`absorb`), the estimator's offload rules and columns and the memory
report's (:func:`answering`, :func:`columns`, :func:`value_of`), and ``jzero plan``'s candidates
(:func:`devices`).
The order matters where updates compose: the host tier replaces the device's update of what lives
in host memory; the NVMe tier's update, outside the step's clipping, takes its leaves out of it.
"""

from __future__ import annotations

from typing import Any

import optax

from jzero.config import blocks as config_blocks
from jzero.errors import ConfigError
from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.plan import Plan
from jzero.sharding.planner import Placement
from jzero.tiers import delayed as delayed_lib
from jzero.tiers.base import AfterStep, Resources, Tier, Update
from jzero.tiers.host_optimizer import HostOptimizerTier
from jzero.tiers.host_params import HostParamsTier
from jzero.tiers.host_step import HostStepTier
from jzero.tiers.nvme import NvmeTier
from jzero.tiers.updates import ClipByFactor, DeviceUpdate, Held, SkipNonFinite

__all__ = ["TIERS", "OFFLOAD_BLOCKS", "register", "unregister", "named", "value_of", "active",
           "answering", "check_config", "columns", "devices", "placement", "check_plan", "held",
           "open_resources", "update", "after_step", "write_initial", "kept", "full_state",
           "absorb"]

TIERS: tuple[type[Tier], ...] = (
    HostOptimizerTier,
    HostParamsTier,
    NvmeTier,
    HostStepTier,
)

#: The config blocks whose ``device`` value picks a tier (besides "none" and "auto").
OFFLOAD_BLOCKS = ("offload_optimizer", "offload_param")


def register(tier: type[Tier]) -> type[Tier]:
  """Adds ``tier`` at the end of :data:`TIERS` (a tier kept outside jzero's package: its module
  calls this once); returns it, so it serves as a class decorator."""
  global TIERS
  if any(t.name == tier.name for t in TIERS):
    raise ValueError(f"a tier named {tier.name!r} is registered already")
  TIERS = (*TIERS, tier)
  return tier


def unregister(tier: type[Tier]) -> None:
  """Takes ``tier`` out of :data:`TIERS` again."""
  global TIERS
  TIERS = tuple(t for t in TIERS if t is not tier)


def named(name: str) -> type[Tier] | None:
  """The registered tier called ``name`` (:attr:`Tier.name`, also what it records in a plan's
  ``state_tier`` / ``param_tier``), or None."""
  return next((t for t in TIERS if t.name == name), None)


def value_of(block: str, name: str) -> str | None:
  """The ``device`` value of ``zero_optimization.<block>`` that selects the tier called ``name``
  (the first it answers), or None."""
  tier = named(name)
  return next((v for b, v in tier.answers if b == block), None) if tier is not None else None


# -- the config ------------------------------------------------------------------------------------
def devices(block: str) -> tuple[str, ...]:
  """The ``device`` values of ``zero_optimization.<block>`` a tier answers, in :data:`TIERS`'
  order (without "none" and "auto")."""
  out: list[str] = []
  for tier in TIERS:
    out += [value for b, value in tier.answers if b == block and value not in out]
  return tuple(out)


config_blocks.accept_devices_from(devices)  # an offload block's device: a value a tier answers


def answering(block: str, value: str) -> type[Tier] | None:
  """The tier that answers ``zero_optimization.<block>.device: <value>`` (the first, in
  :data:`TIERS`' order), or None."""
  return next((t for t in TIERS if (block, value) in t.answers), None)


def columns() -> tuple[str, ...]:
  """The memory columns off the device the tiers put bytes in ("host", "nvme", ...), in
  :data:`TIERS`' order."""
  out: list[str] = []
  for tier in TIERS:
    if tier.memory and tier.memory not in out:
      out.append(tier.memory)
  return tuple(out)


def check_config(config: Any) -> None:
  """Every tier's refusals of a config and the delayed update's, before any device work; an
  offload ``device`` no tier answers is refused, naming the values that are."""
  zero = config.zero_optimization
  for block in OFFLOAD_BLOCKS:
    given = getattr(zero, block)
    value = getattr(given, "device", "none")
    accepted = ("none", "auto", *devices(block))
    if value not in accepted:
      raise ConfigError(f"zero_optimization.{block}.device={value!r}: no tier keeps state there; "
                        f"give one of {', '.join(map(repr, accepted))}.")
  for tier in TIERS:
    tier.check_config(config)
  delayed_lib.enabled(zero)


# -- the plan --------------------------------------------------------------------------------------
def placement(plan: Plan, zero: Any) -> Placement:
  """Where the tiers put ``plan``'s leaves (all on the device), by the resolved
  ``zero_optimization`` block: every tier's :meth:`Tier.place`, in :data:`TIERS`' order."""
  placed = Placement()
  for tier in TIERS:
    placed = tier.place(plan, zero, placed)
  return placed


def check_plan(plan: Any, zero: Any) -> None:
  """Every tier's :meth:`Tier.check_plan` of a plan just built."""
  for tier in TIERS:
    tier.check_plan(plan, zero)


def active(plan: Plan) -> tuple[type[Tier], ...]:
  """The tiers ``plan`` uses, in :data:`TIERS`' order."""
  return tuple(t for t in TIERS if t.uses(plan))


def held(tiers: tuple[type[Tier], ...], plan: Plan) -> Held:
  """The leaves whose state / param the tiers keep outside the train state's arrays."""
  leaves = plan.leaf_list()
  return Held(state=frozenset(l.path for l in leaves for t in tiers if t.holds_state(plan, l)),
              param=frozenset(l.path for l in leaves for t in tiers if t.holds_param(plan, l)))


def kept(tiers: tuple[type[Tier], ...], plan: Plan) -> dict[str, tuple[str, ...]]:
  """Leaf path -> the tiers whose resource keeps something of it (its state, its param or a
  copy), whose initial master :func:`write_initial` hands them."""
  out: dict[str, tuple[str, ...]] = {}
  for leaf in plan.leaf_list():
    names = tuple(t.name for t in tiers if t.keeps(plan, leaf))
    if names:
      out[leaf.path] = names
  return out


# -- run time ----------------------------------------------------------------------------------
def open_resources(tiers: tuple[type[Tier], ...], plan: Plan, config: Any,
                   tx: optax.GradientTransformation) -> Resources:
  """What the tiers own at run time for ``plan`` (:meth:`Tier.open`), by name."""
  opened = {t.name: t.open(plan, config, tx) for t in tiers}
  return {name: r for name, r in opened.items() if r is not None}


def update(tiers: tuple[type[Tier], ...], plan: Plan, config: Any,
           tx: optax.GradientTransformation, opt: OptLayout, resources: Resources, *,
           elementwise: bool, delayed: delayed_lib.DelayedUpdate | None = None) -> Update:
  """The step's update chain (:mod:`jzero.tiers.base`): the device's update (``opt``: its
  state's layout and view), wrapped by the tiers that change where the step's state lives, the
  non-finite skip, the delayed update (when on), the clipping, then the tiers that take leaves
  out of the step."""
  chain: Update = DeviceUpdate(plan, tx, opt, held(tiers, plan),
                               checks_overflow=config.checks_overflow)
  wrap = lambda t, inner: t.update(plan, config, tx, resources.get(t.name), inner,
                                   elementwise=elementwise)
  for tier in tiers:
    if tier.wraps == "state":
      chain = wrap(tier, chain)
  chain = SkipNonFinite(chain)
  if delayed is not None:
    chain = delayed.wrap(chain)
  chain = ClipByFactor(chain)
  for tier in tiers:
    if tier.wraps == "step":
      chain = wrap(tier, chain)
  return chain


def after_step(tiers: tuple[type[Tier], ...], plan: Plan, config: Any,
               tx: optax.GradientTransformation, resources: Resources) -> tuple[AfterStep, ...]:
  """The host's work after each jitted step: the tiers' :meth:`Tier.after_step` hooks, in
  :data:`TIERS`' order (the step runs them one after another on the state it returned)."""
  hooks = (t.after_step(plan, config, tx, resources.get(t.name)) for t in tiers)
  return tuple(h for h in hooks if h is not None)


def write_initial(tiers: tuple[type[Tier], ...], plan: Plan, resources: Resources,
                  masters: dict[str, Any]) -> None:
  """After the init's jit: each tier's initial masters (:func:`kept`) into its resource."""
  owners = kept(tiers, plan)
  for tier in tiers:
    mine = {p: m for p, m in masters.items() if tier.name in owners.get(p, ())}
    if mine:
      tier.write_initial(plan, resources.get(tier.name), mine)


def full_state(tiers: tuple[type[Tier], ...], plan: Plan, resources: Resources,
               state: Any) -> Any:
  """``state`` with what every tier holds outside it read in (what checkpoints save)."""
  for tier in tiers:
    state = tier.full_state(plan, resources.get(tier.name), state)
  return state


def absorb(tiers: tuple[type[Tier], ...], plan: Plan, resources: Resources, state: Any) -> Any:
  """A full state (a restore, an import) -> what every tier holds taken in, as the step expects
  the state."""
  for tier in tiers:
    state = tier.absorb(plan, resources.get(tier.name), state)
  return state
