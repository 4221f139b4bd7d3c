"""Where a plan's leaves live, read through one interface: the tiers' questions about a
:class:`jzero.sharding.plan.Plan`.

The plan records, per leaf, the tier its master and optimizer state live in and the tier of its
partitioned param (``LeafPlan.state_tier`` / ``param_tier``: "device", "host" or "nvme", set by the
tiers' :meth:`jzero.tiers.base.Tier.place`), and the memory kind each is stored in. What those
names mean -- which leaves are offloaded, which params are placeholders in the train state, which
copies the NVMe store holds -- is the tiers' knowledge, and lives here, not in the plan.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HOST", "NVME", "offloads", "param_offloads", "params_on_nvme", "uses_host", "has_nvme",
           "uses_nvme_store", "param_copy_on_nvme", "param_placeholder", "param_in_host_memory"]

HOST, NVME = "host", "nvme"  # the tiers' names in LeafPlan.state_tier / param_tier


def offloads(plan: Any) -> bool:
  """Some leaf's master / optimizer state lives on the host (:mod:`jzero.tiers.host_optimizer`)."""
  return any(l.state_tier == HOST for l in plan.leaf_list())


def param_offloads(plan: Any) -> bool:
  """Some leaf's compute param lives on the host (:mod:`jzero.tiers.host_params`)."""
  return any(l.param_tier == HOST for l in plan.leaf_list())


def params_on_nvme(plan: Any) -> bool:
  """Some leaf's compute param lives in the NVMe store (:mod:`jzero.tiers.nvme_params`)."""
  return any(l.param_tier == NVME for l in plan.leaf_list())


def uses_host(plan: Any) -> bool:
  """Some array of the train state lives in host memory."""
  return offloads(plan) or param_offloads(plan)


def has_nvme(plan: Any) -> bool:
  """Some leaf's master / optimizer state lives in the NVMe store
  (:mod:`jzero.tiers.nvme_store`)."""
  return any(l.state_tier == NVME for l in plan.leaf_list())


def uses_nvme_store(plan: Any) -> bool:
  """The engine has an NVMe store: for optimizer state, or for params."""
  return has_nvme(plan) or params_on_nvme(plan)


def param_copy_on_nvme(leaf: Any) -> bool:
  """The param is read from the NVMe store, which holds a copy of it written after each update;
  its master and optimizer state live on the host or the device (:mod:`jzero.tiers.nvme_params`)."""
  return leaf.param_tier == NVME and leaf.state_tier != NVME


def param_placeholder(plan: Any, leaf: Any) -> bool:
  """The TrainState holds a 0-byte placeholder for the leaf's param: it is on the NVMe tier, and
  no array of the state holds it (fp32 training's param *is* the master, so a param whose master
  lives on the host or the device stays in the state there)."""
  return leaf.param_tier == NVME and (leaf.state_tier == NVME or plan.has_master)


def param_in_host_memory(plan: Any, leaf: Any) -> bool:
  """The state's param of ``leaf`` lives in host memory: parameter offload, or fp32 training's
  param (its master) with the state on the host and a copy on the NVMe tier."""
  return leaf.param_tier == HOST or (param_copy_on_nvme(leaf) and not plan.has_master
                                     and leaf.state_tier == HOST)
