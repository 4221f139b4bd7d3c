"""Where each optimizer update keeps the gradients, its buffers and the new params: the rules
:func:`jzero.analysis.estimate.estimate` (``jzero estimate``), the step's peak
(:func:`jzero.analysis.step_memory.step_peak`) and ``jzero plan`` share, so that the three count
the same bytes in the same place.

A tier's offload rule (:meth:`jzero.tiers.base.Tier.estimate`) says where its *state* lives (the
optimizer state and master in host memory or on NVMe, stage 3's param partition). The update
says where the *gradients* are while it runs -- that is the update's, not the tier's: the same
host tier keeps them on the device under one update and streams them to the host under another.
Per process, with Ψ/N the partition's elements, g / p bytes per gradient / compute param, K bytes
of optimizer state per param, and ``share`` the offloaded fraction:

* **no offload** -- the gradients as the stage lays them out, on the device.
* ``"stream"`` (``device: cpu`` with a client optimizer or another optimizer than Adam) and a
  registered tier's own update -- the
  gradients stay on the device, the update streams the host state through it one leaf at a time
  (:mod:`jzero.tiers.host_optimizer`); nothing of the gradient is on the host.
* ``"host"`` -- the same on the device; the host computation also reads the fp32 gradient
  partition, 4Ψ/N in host memory.
* ``"store"`` (``offload_optimizer.device: nvme``, :mod:`jzero.tiers.nvme_store`) -- the gradients
  stay on the device (the jitted step hands their fp32 partitions out), and the store updates one
  sub-group at a time: K x min(``sub_group_size``, Ψ/N) bytes read into host memory and updated on
  the device (:func:`jzero.analysis.step_memory.step_peak` counts the device's copy).
* ``"cpu_adam"`` (:data:`jzero.config.blocks.CPU_ADAM`; ZeRO-Offload's schedule) -- each layer's
  reduced gradient partition leaves the device in the backward pass, Adam runs on the host's cores
  outside the jitted step, and the new 16-bit params are uploaded (stages 1/2: the partitions,
  then all-gathered on the device; stage 3: the partitions). The device keeps no fp32 master,
  moments or fp32 gradient and no update phase; of the gradient, stage 1 its full local gradient
  gΨ (reduced once at the end, as DeepSpeed's stage 1 does) and stages 2/3 what is *in flight*
  (:func:`in_flight_elements`): the layer being reduced (its g-byte gradient, whole, and its
  partition on its way to the host) and the leaves outside the layer stack (the embedding's
  gradient collects the output head's and the lookup's parts across the backward pass). The
  gradient the host Adam reads lives *where the optimizer state lives* (DeepSpeed's rule): the
  reduced partition as it arrives, gΨ/N, with one micro-batch, or its fp32 sum, 4Ψ/N, with gradient
  accumulation -- in host memory for the host tier, in the NVMe store for the NVMe tier (whose
  host memory then holds the sub-group the host Adam works on, (K + g or 4) x min(sub_group, Ψ/N)).
  The new 16-bit params wait in host memory before their upload, pΨ/N (none when stage 3's params
  live on NVMe: they go to the store); with ``offload_param: cpu`` that is beside the host param
  partition the step reads. With ``delayed_update`` the host step N runs while the device computes
  step N+1: the tier holds the carried gradient partition too, twice the gradient bytes. The
  upload (:func:`upload_bytes`) is the only device phase after the backward pass.
"""

from __future__ import annotations

from typing import Any

from jzero.config.blocks import CPU_ADAM, STREAM, cpu_offload_update
from jzero.errors import ConfigError

__all__ = ["CPU_ADAM", "STREAM", "HOST", "STORE", "TIER", "default_update", "update_choices",
           "streams_gradients",
           "in_flight_elements", "place_update", "upload_bytes", "host_gradient_bytes"]

HOST = "host"  # jzero.tiers.host_optimizer's update modes: STREAM and HOST
STORE = "store"  # the NVMe store's own update (jzero.tiers.nvme_store)
TIER = "tier"  # a registered tier's own update (its Tier.estimate says it all)


def default_update(offload_optimizer: str | None, offload_param: str | None = None) -> str | None:
  """The update the engine runs for ``offload_optimizer.device`` when the config names none, with
  the config's Adam (None: no optimizer offload): ``device: cpu`` runs the host step
  (:data:`CPU_ADAM`), as DeepSpeed runs its CPU Adam and counts the gradients on the host -- beside
  params on NVMe the streamed update (:data:`STREAM`), which keeps their state in host memory
  (:func:`jzero.tiers.host_step.resolve_update`, which also names what else streams)."""
  if not offload_optimizer:
    return None
  if offload_optimizer == "cpu":
    return cpu_offload_update(offload_param)
  return {"nvme": STORE}.get(offload_optimizer, TIER)


def update_choices(offload_optimizer: str | None) -> tuple[str | None, ...]:
  """The updates ``jzero plan`` and the estimator's recommendation try for an optimizer offload,
  in order: the engine's default (None: not written into the config), then -- where that is the
  host's Adam -- the streamed update, which holds less in host memory (no gradient, no new params
  there)."""
  return (None, STREAM) if default_update(offload_optimizer) == CPU_ADAM else (None,)


def streams_gradients(update: str | None) -> bool:
  """The update takes the gradients off the device in the backward pass (``"cpu_adam"``)."""
  return update == CPU_ADAM


def in_flight_elements(layer: float, others: float, devices: int) -> float:
  """Gradient elements a ``"cpu_adam"`` backward holds on the device in stages 2/3: one layer of
  the stack whole and its partition (``layer`` x (1 + 1/N)), and the leaves outside the stack
  (``others``, whole). With a parameter count alone (no layer given) both are 0."""
  return layer * (1 + 1 / devices) + others


def host_gradient_bytes(grad_bytes: int, gradient_accumulation: int) -> int:
  """Bytes per element of the gradient the host Adam reads: the partition as it arrives (g), or
  its fp32 sum over the micro-batches."""
  return grad_bytes if gradient_accumulation == 1 else 4


def upload_bytes(stage: int, param_bytes: int, partition_elements: float, devices: int,
                 params_on_device: bool) -> float:
  """Device bytes the ``"cpu_adam"`` upload holds beside the state: the new param partition
  (stages 1/2: gathered in place into the donated params, so only the partition is extra, and
  nothing with one device; stage 3: the new partition before the old is dropped; none when the
  params live off the device)."""
  if not params_on_device or (stage < 3 and devices == 1):
    return 0.0
  return param_bytes * partition_elements


def place_update(update: str | None, numbers: Any, tiers: dict, *, column: str, share: float,
                 delayed_update: bool, params_on_nvme: bool) -> None:
  """Moves the bytes of ``update`` (module docstring) in ``tiers`` (tier column -> category ->
  bytes), in place, after the tiers' offload rules moved the state. ``numbers``
  (:class:`jzero.analysis.estimate.Numbers`): the configuration's bytes and elements; ``column``:
  the optimizer tier's column ("host", "nvme"); ``share``: the offloaded fraction."""
  if update in (None, STREAM, TIER):
    return
  device = tiers["device"]
  host = tiers.setdefault("host", {})
  moved = share * numbers.state_elements
  group = min(numbers.sub_group_elements, moved)
  if update == HOST:
    _add(host, "grads", 4 * moved)
  elif update == STORE:
    _add(host, "optimizer", numbers.optimizer_bytes * group)
  elif update == CPU_ADAM:
    if numbers.stage >= 2:
      device["grads"] = ((1 - share) * numbers.grad_partition
                         + share * numbers.grad_bytes * numbers.in_flight_elements)
    g = host_gradient_bytes(numbers.grad_bytes, numbers.gradient_accumulation)
    _add(tiers.setdefault(column, {}), "grads", g * moved * (2 if delayed_update else 1))
    if not params_on_nvme:
      _add(host, "params", numbers.param_bytes * moved)
    if column != "host":
      _add(host, "optimizer", (numbers.optimizer_bytes + g) * group)
  else:
    raise ConfigError(f"offload_optimizer.update={update!r}: give one of "
                      f"{', '.join(map(repr, (STREAM, HOST, CPU_ADAM)))}.")


def _add(column: dict, category: str, nbytes: float) -> None:
  column[category] = column.get(category, 0.0) + nbytes
