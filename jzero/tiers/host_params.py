"""ZeRO-Infinity parameter offload: stage-3 parameter partitions in host memory.

``zero_optimization.offload_param.device: "cpu"`` (stage 3 only, as in DeepSpeed) gives every
*partitioned* compute param the host tier of the plan
(:attr:`jzero.sharding.plan.LeafPlan.param_tier`): the train state's partition keeps the plan's
layout and its sharding carries the memory kind ``pinned_host`` (``pin_memory: false``:
``unpinned_host``). Persistent leaves (below ``stage3_param_persistence_threshold``, kept replicated
on every device) and 0-d leaves stay on the device: they are read by every step whole, and DeepSpeed
offloads only the partitions too. Gradients stay on the device; the fp32 master and the optimizer
state follow ``offload_optimizer`` (:mod:`jzero.tiers.host_optimizer`) independently.

**Forward and backward.** A host partition reaches the model as a
:class:`~jzero.comm.zero_param.ZeroParam` whose ``host`` child is the host array and whose
``partition`` is a zero *gradient slot* on the device (the step differentiates the slots: a
gradient of a host-memory input would have to be a host array too). ``ZeroParam.gather()``
brings the partition to the device with :func:`fetch` -- ``jax.device_put(x,
jax.memory.Space.Device)`` whose backward sends the cotangent to the slot -- and then gathers as
without offload. Gathers run where they always do, so the transfers do too: a stacked leaf one
layer at a time inside :func:`jzero.scan_layers` / ``linen_scan_layers`` (the scan slices the host
stack; each layer's slice is moved to the device right before its all-gather, again in the
rematerialised backward), a unit's leaves when the unit is called
(:mod:`jzero.modeling.gather_units`), any other leaf when the forward pass starts. The device holds
one layer's (or unit's) partitions and gathered parameters at a time, plus what persists.

**The update** runs on the device copy of each host leaf (fp32 training: the param partition is
the optimizer's master; it is streamed through the device leaf by leaf by
:func:`jzero.tiers.host_optimizer.apply_update`), and the new partitions are written back to the
host tier at the end of the step (:meth:`jzero.tiers.host_optimizer.HostUpdate.store_params`).
So the values are the no-offload step's: the copies are exact.

**Donation.** As for the optimizer's host tier (:mod:`jzero.tiers.host_optimizer`,
openxla/xla#29270): with any host leaf every input and output of the step carries an explicit memory
kind and each host partition's output is again on the host, so every buffer keeps its kind and all
are donated.

**Not here.** ``device: "nvme"`` (the NVMe tier) is :mod:`jzero.tiers.nvme_params`;
``buffer_count``, ``buffer_size`` and ``max_in_cpu`` size its staging buffers and host cache and
have no effect with ``device: cpu`` (a warning). ZeRO++'s hpZ keeps a device copy of every
partition, which defeats parameter offload: the combination is refused.

**What it moves** (both devices) is said once, when the plan is built
(:meth:`HostParamsTier.check_plan`): how many parameters the offload moves, and how many stay on
the device as persistent. Like DeepSpeed's "Total persistent parameters" line it is logged; when
the offload moves less than half of the model -- every leaf of a small model is under the default
``stage3_param_persistence_threshold`` of 1e5, and nothing moves -- it is a JZeroWarning instead,
since the config then does not do what it asks.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jzero.config.messages import user_stacklevel
from jzero.errors import ConfigError, JZeroWarning, NotSupportedError
from jzero.sharding.planner import Placement
from jzero.tiers import host_optimizer, where
from jzero.tiers.base import Tier
from jzero.tiers.host_optimizer import to_device

__all__ = ["ParamOffloadSettings", "settings_from_config", "fetch", "HostParamsTier"]

PyTree = Any

logger = logging.getLogger("jzero")


@dataclasses.dataclass(frozen=True)
class ParamOffloadSettings:
  """What the config asks of the parameter tier.

  Attributes:
    memory_kind: "pinned_host" or "unpinned_host" (``pin_memory``).
    device: "cpu" (this module) or "nvme" (:mod:`jzero.tiers.nvme_params`).
  """

  memory_kind: str = "pinned_host"
  device: str = "cpu"

  @property
  def tier(self) -> str:
    """The plan's ``param_tier`` of a partitioned leaf: "host" or "nvme"."""
    return "nvme" if self.device == "nvme" else "host"


def settings_from_config(zero: Any) -> ParamOffloadSettings | None:
  """The parameter-offload settings of a ``zero_optimization`` block (None: no offload).

  Raises:
    ConfigError: ``offload_param`` with a device at a stage other than 3, or with ZeRO++ hpZ.
    NotSupportedError: together with the optimizer's NVMe tier.
  """
  block = zero.offload_param
  if block is None or block.device in ("none", "auto"):
    return None
  if zero.stage != 3 and zero.stage != "auto":
    raise ConfigError(
        f"zero_optimization.offload_param.device={block.device} needs ZeRO stage 3, got stage "
        f"{zero.stage}: only stage 3 partitions the parameters (DeepSpeed supports parameter "
        f"offload at stage 3 only). Set zero_optimization.stage to 3, or remove offload_param "
        f"(offload_optimizer moves the optimizer state at stages 1-3).")
  hpz = getattr(zero, "zero_hpz_partition_size", 1)
  if hpz not in (None, "auto") and int(hpz) > 1:
    raise ConfigError(
        f"zero_optimization.offload_param with zero_hpz_partition_size={hpz}: ZeRO++'s hpZ keeps "
        f"a device copy of every parameter partition, which defeats parameter offload; remove "
        f"one of the two.")
  optimizer = zero.offload_optimizer
  if block.device == "nvme":
    return ParamOffloadSettings(device="nvme")
  if optimizer is not None and optimizer.device == "nvme":
    raise NotSupportedError(
        "zero_optimization.offload_param.device=cpu with offload_optimizer.device=nvme: parameter "
        "offload is not implemented together with the NVMe tier yet. Use offload_optimizer.device: "
        "cpu with parameter offload, or the NVMe tier without offload_param.")
  pinned = block.pin_memory in (True, "auto")
  return ParamOffloadSettings(memory_kind="pinned_host" if pinned else "unpinned_host",
                              device="cpu")


@jax.custom_jvp
def fetch(host: jax.Array, slot: jax.Array) -> jax.Array:
  """The host partition ``host`` on the device; its gradient goes to ``slot`` (a device array of
  the same shape and dtype), since a host input's cotangent would have to live on the host.

  A ``custom_jvp`` whose tangent is the slot's: the host input's tangent is never used, so no
  cotangent is ever formed for it (remat regions and optimization barriers instantiate zero
  tangents in device memory, which a ``custom_vjp``'s host-typed zero would not match)."""
  return to_device(host)


@fetch.defjvp
def _fetch_jvp(primals, tangents):
  host, _ = primals
  _, slot_dot = tangents
  return to_device(host), slot_dot


@dataclasses.dataclass(frozen=True)
class HostSource:
  """The :class:`jzero.comm.zero_param.PartitionSource` of a partition in host memory: the
  ZeroParam stores the host partition, :func:`fetch` moves it to the device."""

  def fetch(self, slot: jax.Array, host: jax.Array) -> jax.Array:
    return fetch(host, slot)


FROM_HOST = HostSource()


class HostParamsTier(Tier):
  """Stage-3 partitions in host memory (module docstring): the step differentiates a zero slot on
  the device, the gather fetches the host partition; the update of what lives in host memory,
  which puts the new partitions back there, is :class:`jzero.tiers.host_optimizer.HostUpdate`."""

  name = "host_params"
  memory = "host"
  answers = (("offload_param", "cpu"),)

  @classmethod
  def check_config(cls, config: Any) -> None:
    settings_from_config(config.zero_optimization)

  @classmethod
  def place(cls, plan: Any, zero: Any, placement: Placement) -> Placement:
    """Every partitioned param in the offload's tier. A partition on the NVMe tier keeps its
    master and optimizer state in the store beside it, unless offload_optimizer put them in host
    memory (the store then holds a copy of the param: :mod:`jzero.tiers.nvme_params`)."""
    settings = settings_from_config(zero)
    if settings is None:
      return placement
    moved = [l.path for l in plan.leaf_list() if l.param_partitioned]
    states = dict(placement.state_tiers)
    optimizer = host_optimizer.settings_from_config(zero)
    if settings.tier == "nvme" and not (optimizer.ratio > 0 and optimizer.tier == "host"):
      states.update(dict.fromkeys(moved, "nvme"))
    if settings.tier == "host":
      kinds = dict.fromkeys(moved, settings.memory_kind)
    elif not plan.has_master:  # fp32: the param whose copy the store holds is the master, kept
      kinds = {p: placement.state_kinds[p] for p in moved if p in placement.state_kinds}
    else:
      kinds = {}
    return dataclasses.replace(
        placement, state_tiers=states,
        param_tiers={**placement.param_tiers, **dict.fromkeys(moved, settings.tier)},
        param_kinds={**placement.param_kinds, **kinds})

  @classmethod
  def check_plan(cls, plan: Any, zero: Any) -> None:
    """How many parameters the offload moves, and how many stay persistent (module docstring)."""
    settings = settings_from_config(zero)
    if settings is None:
      return
    leaves = plan.leaf_list()
    total = sum(l.numel for l in leaves)
    moved = sum(l.numel for l in leaves if l.param_tier != "device")
    kept = [l for l in leaves if l.param_tier == "device"]
    where = "host memory" if settings.tier == "host" else "the NVMe store"
    message = f"offload_param (device: {settings.device}) moves "
    if not kept:
      logger.info(f"{message}all {total:,} parameters of the model to {where}.")
      return
    message += (
        f"{moved:,} of the model's {total:,} parameters ({moved / total:.0%}) to {where}; the "
        f"other {total - moved:,} ({len(kept)} leaves) stay on the device, persistent: leaves "
        f"under stage3_param_persistence_threshold={zero.param_persistence_threshold:,} elements "
        f"(per layer) are kept whole on every device, as in DeepSpeed.")
    if 2 * moved >= total:
      logger.info(message)
      return
    warnings.warn(f"{message} Lower stage3_param_persistence_threshold (0: every leaf but "
                  f"scalars is offloaded) to offload more.", JZeroWarning,
                  stacklevel=user_stacklevel())

  @classmethod
  def uses(cls, plan: Any) -> bool:
    return where.param_offloads(plan)

  @classmethod
  def grad_target(cls, plan: Any, leaf: Any, p: jax.Array) -> jax.Array | None:
    return jnp.zeros(p.shape, p.dtype) if leaf.param_tier == "host" else None

  @classmethod
  def gather_inputs(cls, plan: Any, resource: Any, leaf: Any, p: jax.Array) -> dict | None:
    return {"source": FROM_HOST, "stored": p} if leaf.param_tier == "host" else None
