"""The tiers an engine may use, in the order their hooks run: :data:`TIERS`.

The order matters where updates compose (:func:`update`): the host tier replaces the device's
update of whatever lives in host memory; the NVMe tier wraps that, taking its leaves out of the
step. A new tier is one line here plus its own module (a :class:`Tier` subclass) and its config
block (:mod:`jzero.config.blocks`).
"""

from __future__ import annotations

from typing import Any

from jzero.sharding.plan import Plan
from jzero.sharding.planner import Placement
from jzero.tiers import delayed
from jzero.tiers.base import EngineView, Tier, Update
from jzero.tiers.host_optimizer import HostOptimizerTier
from jzero.tiers.host_params import HostParamsTier
from jzero.tiers.nvme import NvmeTier

__all__ = ["TIERS", "active", "check_config", "placement", "check_plan", "through", "update"]

TIERS: tuple[type[Tier], ...] = (
    HostOptimizerTier,
    HostParamsTier,
    NvmeTier,
)


def check_config(config: Any) -> None:
  """Every tier's refusals of a resolved config, and the delayed update's, before any device
  work."""
  for tier in TIERS:
    tier.check_config(config)
  delayed.enabled(config.zero_optimization)


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


def active(engine: EngineView) -> tuple[Tier, ...]:
  """The tiers ``engine``'s plan and config use, in :data:`TIERS`' order."""
  return tuple(t for t in (cls.create(engine) for cls in TIERS) if t is not None)


def through(tiers: tuple[Tier, ...], hook: str, engine: EngineView, state: Any) -> Any:
  """``state`` passed through every tier's ``hook`` in turn: ``full_state``, ``expand_abstract``
  or ``absorb``."""
  for tier in tiers:
    state = getattr(tier, hook)(engine, state)
  return state


def update(tiers: tuple[Tier, ...], engine: EngineView, device: Update) -> Update:
  """The step's update: ``device`` (the update on the device) wrapped by every tier's
  :meth:`Tier.update` in turn."""
  step_update = device
  for tier in tiers:
    step_update = tier.update(engine, step_update)
  return step_update
