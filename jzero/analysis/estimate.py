"""Memory you can see: what ZeRO predicts per device, and what a live engine holds.

**The estimator** (:func:`estimate`) is the ZeRO paper's arithmetic. With Ψ parameters, ``N``
ZeRO partitions (devices x nodes), ``p`` / ``g`` bytes per parameter of compute params and
gradients (2 in fp16 / bf16, 4 in fp32) and ``K`` bytes per parameter of optimizer state (Adam
with an fp32 master: K = 12 = 4 master + 8 moments; jzero's fp32 training keeps no master, K = 8),
one device holds:

=========  ====================  =========  =========  =========================
stage      params                grads      optimizer  total (p = g = 2)
=========  ====================  =========  =========  =========================
0 (DDP)    pΨ                    gΨ         KΨ         (4 + K)Ψ
1          pΨ                    gΨ         KΨ/N       4Ψ + KΨ/N
2          pΨ                    gΨ/N       KΨ/N       2Ψ + (2 + K)Ψ/N
3          p(Ψ - Ψr)/N + pΨr     gΨ/N       KΨ/N       (4 + K)Ψ/N + 2Ψr(1 - 1/N)
=========  ====================  =========  =========  =========================

ZeRO++'s hpZ (``zero_hpz_partition_size`` = s) adds a *secondary* copy of the stage-3
partitioned params, split over the s devices of a node only: p(Ψ - Ψr)/s more on every device
(its own column, "hpZ secondary"). DeepSpeed's hpZ costs the same (``ds_secondary_tensor``,
≈ M/s per GPU). qwZ and qgZ change what moves, not what is held.

Ψr is the stage-3 *persistent* parameters (see :mod:`jzero.sharding.plan`): leaves with fewer than
``persistence_threshold`` elements (per layer for leaves stacked over a layer axis) keep a
replicated compute param; their gradients and optimizer state stay partitioned. Ψr needs the
leaves' shapes (pass them instead of a count). A plan's leaves (:class:`jzero.sharding.plan.LeafPlan`)
also give the padding of their partitions (to a multiple of N) and which of them are frozen (no
gradient, master or optimizer state); plain shapes have neither.

Offload moves a category off the device, per process (one process per device):

* ``offload_optimizer`` (stages 1-3; ZeRO-Offload): the optimizer state and fp32 master
  (KΨ/N) and their update go to ``"cpu"`` (host memory), or to ``"nvme"`` (ZeRO-Infinity;
  DeepSpeed swaps to NVMe in stage 3 only, jzero's store works in stages 1-3,
  :mod:`jzero.tiers.nvme_store`). The gradient partition the update reads (gΨ/N) goes to host memory
  with it, as in ZeRO-Offload, so stage 2 and 3 keep no gradients on the device; stage 1 still
  accumulates the full local gradient (gΨ) on the device before reducing it.
* ``offload_param`` (stage 3 only; ZeRO-Infinity): the partitioned compute params,
  p(Ψ - Ψr)/N, go to ``"cpu"`` or ``"nvme"``; persistent params stay on the device. With
  ``"nvme"``, ``max_in_cpu`` of those elements stay in host memory (the host cache) and the host
  also holds the staging buffers (``buffer_count`` x ``buffer_size`` elements) every partition
  passes through on its way to the device; the rest lives on NVMe only.

Counted are the model states that live across steps. Two temporaries of the step are added when
given: activations (:func:`activation_bytes`) and stage 3's *gathered working set* -- the full
parameters alive at once: the largest gather unit or one layer of the layer scan (twice when the
next one is prefetched) plus the parameters gathered at the start of the forward pass
(:meth:`jzero.sharding.plan.Plan.gathered_working_set`, :mod:`jzero.modeling.gather_units`; ``jzero
estimate`` takes the layer from ``--model``, ``--hidden`` or ``--largest-layer``). Not counted:
communication buckets, allocator slack; :func:`memory_report` shows the compiled step's
``memory_analysis()`` beside the prediction.

How this relates to DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs``), which assume fp16 and Adam:

* GPU, no offload: DeepSpeed's ZeRO-2 2Ψ + 18Ψ/N and ZeRO-3 4·L + 18Ψ/N count an fp32 copy of
  the gradient partition (18 = 2 fp16 grads + 4 fp32 grads + 12), which jzero forms only inside
  the step, and 4·L for the largest layer L gathered in stage 3 (a temporary here). jzero:
  2Ψ + 14Ψ/N and 16Ψ/N + 2Ψr(1 - 1/N).
* GPU with offload: DeepSpeed's ZeRO-2 2Ψ, ZeRO-3 4·L + 2Ψ/N (optimizer) and 4·L (params too)
  are jzero's pΨ, p(Ψ - Ψr)/N + pΨr and pΨr without the 4·L.
* CPU: DeepSpeed gives bytes per node, times an ``additional_buffer_factor`` of 1.5
  (:attr:`Estimate.deepspeed_host_per_node`, which ``jzero estimate`` prints beside jzero's). ZeRO-2
  offload: Ψ·max(4·N, 16)·1.5, i.e. the whole optimizer state plus fp32 gradients (16Ψ) on every
  node, or each process's fp32 copy of the model at load time (4Ψ per process). ZeRO-3:
  16Ψ/nodes·1.5 (optimizer) and 18Ψ/nodes·1.5 (params too). jzero creates the state directly in
  its placement, so per node it counts devices_per_node x the per-process bytes:
  (2 + 12)Ψ/nodes and (2 + 2 + 12)Ψ/nodes, with no buffer factor. That is the state alone:
  a script that builds the model before ``initialize`` (an ``nnx.Module`` instance, as a
  DeepSpeed script builds its torch module) holds its fp32 copy, 4Ψ per process, until the state
  is placed, and the host allocator needs headroom; DeepSpeed's figure counts both, so size host
  memory with the larger of the two.

The measured side -- what a live engine holds next to this prediction -- is
:mod:`jzero.analysis.memory_report`.

**Why one module of over 500 lines.** The estimator is one model: the per-stage arithmetic, the
persistence, gathered-layer and activation terms it adds, the offload rules, and the
recommendation that inverts it read the same constants and are checked together
(tests/analysis/test_memory.py); the last 70 lines print it as a table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax

from jzero.analysis import update_memory
from jzero.analysis.tables import byte_cell, format_bytes, html_table, require_pyplot, text_table
from jzero.config.blocks import DTYPES
from jzero.errors import ConfigError
from jzero.sharding.plan import path_str
from jzero.tiers import registry

__all__ = [
    "PRECISION_BYTES", "CATEGORIES", "DEFAULT_PERSISTENCE_THRESHOLD", "DEEPSPEED_HOST_BUFFER",
    "DEFAULT_SUB_GROUP",
    "ParamShape", "param_shapes", "persistent_numel", "largest_gathered_numel", "Numbers",
    "columns",
    "transformer_layer_numel", "Estimate", "estimate",
    "activation_bytes", "Recommendation", "recommend", "format_bytes", "format_estimates",
    "estimate_rows", "EstimateTable", "offload_problem",
]

PRECISION_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
CATEGORIES = ("params", "grads", "optimizer")
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold
DEEPSPEED_HOST_BUFFER = 1.5  # DeepSpeed's estimators' additional_buffer_factor (host bytes)
DEFAULT_SUB_GROUP = 1_000_000_000  # DeepSpeed's sub_group_size: the NVMe store's update groups


# -- model shapes ----------------------------------------------------------------------------------
class ParamShape(NamedTuple):
  """Shape of one parameter leaf; ``stacked``: it has a leading layer axis (run under scan).

  A plan's :class:`jzero.sharding.plan.LeafPlan` has the same two fields and can be used in its
  place.
  """

  shape: tuple[int, ...]
  stacked: bool = False


def param_shapes(abstract_params: Any, stacked_layers: Sequence[str] = ()) -> list[ParamShape]:
  """The :class:`ParamShape` of every leaf of a params pytree (arrays or ShapeDtypeStructs).

  Args:
    abstract_params: the params pytree.
    stacked_layers: '/'-joined path prefixes of the subtrees stacked over a layer axis.
  """
  def is_stacked(path: str) -> bool:
    return any(path == s or path.startswith(s + "/") for s in stacked_layers)

  flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
  return [ParamShape(tuple(x.shape), is_stacked(path_str(p)) and len(x.shape) >= 1)
          for p, x in flat]


def largest_gathered_numel(leaves: Sequence[ParamShape],
                           threshold: int = DEFAULT_PERSISTENCE_THRESHOLD) -> int:
  """Stage 3's largest group gathered at once, from the leaves' shapes alone: one layer of all
  stacked leaves (the layer scan gathers them together) or the largest other leaf; leaves below
  the persistence threshold (per layer) are not gathered."""
  per_layer = [(math.prod(l.shape) // l.shape[0] if l.stacked else math.prod(l.shape), l.stacked)
               for l in leaves if _splittable(l)]
  gathered = [(n, stacked) for n, stacked in per_layer if n >= threshold]
  return max([sum(n for n, stacked in gathered if stacked),
              *(n for n, stacked in gathered if not stacked)])


def transformer_layer_numel(hidden: int) -> int:
  """Parameters of one GPT layer of width h: attention 4h² + 4h, MLP 8h² + 5h, two LayerNorms 4h."""
  return 12 * hidden * hidden + 13 * hidden


def _splittable(leaf: ParamShape) -> bool:
  """A leaf can be partitioned: it has a dimension other than its layer axis."""
  return len(leaf.shape) > (1 if leaf.stacked else 0)


def persistent_numel(leaves: Sequence[ParamShape], threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
                     model_threshold: int | None = None) -> int:
  """Elements of the stage-3 params that stay replicated (Ψr), chosen as :func:`make_plan` does.

  Leaves with fewer than ``threshold`` elements per layer, smallest first, up to
  ``model_threshold`` elements in all (None: no cap); leaves that cannot be split (0-d) too.
  """
  budget = math.inf if model_threshold is None else model_threshold
  fixed, small = 0, []
  for leaf in leaves:
    numel = math.prod(leaf.shape)
    if not _splittable(leaf):
      fixed += numel
    elif (numel // leaf.shape[0] if leaf.stacked else numel) < threshold:
      small.append(numel)
  kept = 0
  for numel in sorted(small):
    if numel > budget:
      break
    kept += numel
    budget -= numel
  return fixed + kept


# -- the estimator ---------------------------------------------------------------------------------
def columns() -> tuple[str, ...]:
  """The memory columns of an estimate: "device", then each registered tier's
  (:func:`jzero.tiers.registry.columns`: "host", "nvme", ...)."""
  return ("device", *(c for c in registry.columns() if c != "device"))


@dataclasses.dataclass(frozen=True)
class Numbers:
  """What a tier's offload rule (:meth:`jzero.tiers.base.Tier.estimate`) reads: per-device bytes
  of one ZeRO configuration before any offload, and the element counts behind them.

  Attributes:
    stage: ZeRO stage.
    optimizer: the optimizer state and master, KΨ/N (stage >= 1).
    grad_partition: the gradient partition, gΨ/N.
    grads_local: stage 1's full local gradient, gΨ.
    param_partition: stage 3's partitioned compute params, p(Ψ - Ψr)/N.
    persistent: stage 3's replicated params, pΨr.
    param_bytes: p.
    partition_elements: (Ψ - Ψr)/N.
    param_cache: elements of the partition a tier may keep in host memory (``max_in_cpu``).
    param_buffers: host staging buffer elements every partition passes through.
    grad_bytes: g.
    optimizer_bytes: K.
    state_elements: elements of the gradient / optimizer-state partition (Ψ/N, padding
      included, frozen leaves not).
    gradient_accumulation: micro-batches per step.
    in_flight_elements: gradient elements a streamed backward holds on the device
      (:func:`jzero.analysis.update_memory.in_flight_elements`).
    sub_group_elements: ``sub_group_size``, the NVMe store's elements per update group.
  """

  stage: int
  optimizer: float
  grad_partition: float
  grads_local: float
  param_partition: float
  persistent: float
  param_bytes: int
  partition_elements: float
  param_cache: float = 0.0
  param_buffers: float = 0.0
  grad_bytes: int = 2
  optimizer_bytes: float = 12.0
  state_elements: float = 0.0
  gradient_accumulation: int = 1
  in_flight_elements: float = 0.0
  sub_group_elements: float = DEFAULT_SUB_GROUP


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes one process (one device) needs for one ZeRO configuration; see the module docstring.

  Attributes:
    stage: ZeRO stage 0..3.
    offload_optimizer: where the optimizer state went: None, or the ``device`` value of the tier
      that holds it ("cpu", "nvme", ...: :func:`jzero.tiers.registry.devices`).
    offload_param: where the stage-3 partitioned params went: None, "cpu", "nvme", ....
    num_params: Ψ.
    persistent_params: Ψr, stage-3 params kept replicated (0 in other stages).
    devices: N, the number of ZeRO partitions (devices per node x nodes).
    devices_per_node: processes per node (host bytes per node = per process x this).
    param_bytes: bytes per compute param (p).
    bytes: column (:func:`columns`: "device", "host", "nvme", a registered tier's) -> category
      ("params", "grads", "optimizer") -> bytes.
    activations: activation bytes per device (0: not estimated).
    gathered: stage 3's gathered working set: the full parameters alive at once on the device
      (the largest unit or layer, twice when the next one is prefetched, plus the parameters
      gathered at the start; DeepSpeed's estimator counts the largest layer the same way). 0:
      not estimated.
    hpz: ZeRO++ hpZ's secondary group size (1: off); its copy is ``bytes["device"]["secondary"]``.
    update: the optimizer offload's update (:mod:`jzero.analysis.update_memory`: "stream",
      "host", "store", "cpu_adam", ...; None without optimizer offload).
    offload_ratio: the fraction of the optimizer state offloaded.
    gradient_accumulation: micro-batches per step.
    largest_leaf: elements of the largest parameter leaf (0: a parameter count was given).
    sub_group: the NVMe store's elements per update group (``sub_group_size``).
  """

  stage: int
  offload_optimizer: str | None
  offload_param: str | None
  num_params: int
  persistent_params: int
  devices: int
  devices_per_node: int
  param_bytes: int
  bytes: dict[str, dict[str, float]]
  activations: float = 0.0
  gathered: float = 0.0
  hpz: int = 1
  update: str | None = None
  offload_ratio: float = 1.0
  gradient_accumulation: int = 1
  largest_leaf: float = 0.0
  sub_group: float = DEFAULT_SUB_GROUP

  @property
  def secondary(self) -> float:
    """hpZ's secondary copy on the device (0 without hpZ)."""
    return self.bytes["device"].get("secondary", 0.0)

  @property
  def name(self) -> str:
    """'DDP (stage 0)', 'ZeRO-2', 'ZeRO-3 + optimizer->cpu, params->nvme', ...; an update other
    than the engine's default for the tier named: 'ZeRO-2 + optimizer->cpu (stream)'."""
    name = "DDP (stage 0)" if self.stage == 0 else f"ZeRO-{self.stage}"
    if self.hpz > 1:
      name += f" + hpZ({self.hpz})"
    optimizer = self.offload_optimizer
    if optimizer and self.update != update_memory.default_update(optimizer, self.offload_param):
      optimizer += f" ({self.update})"
    moved = [f"{what}->{where}" for what, where in
             (("optimizer", optimizer), ("params", self.offload_param)) if where]
    return f"{name} + {', '.join(moved)}" if moved else name

  def tier_total(self, tier: str) -> float:
    """Model-state bytes per process on one tier's column ("device", "host", "nvme", or a
    registered tier's :attr:`~jzero.tiers.base.Tier.memory`; 0 for a column it does not have)."""
    return sum(self.bytes.get(tier, {}).values())

  @property
  def model_states(self) -> float:
    """Model-state bytes on the device, params + grads + optimizer state."""
    return self.tier_total("device")

  @property
  def device_total(self) -> float:
    """Bytes on the device, model states + the gathered working set + activations."""
    return self.model_states + self.gathered + self.activations

  @property
  def host_per_node(self) -> float:
    return self.tier_total("host") * self.devices_per_node

  @property
  def deepspeed_host_per_node(self) -> float | None:
    """Host bytes per node as DeepSpeed's estimator counts them for this configuration (None
    where it has no rule: the NVMe tiers, another tier): its ``additional_buffer_factor`` of
    1.5 over the larger of the offloaded state (ZeRO-2: the whole 16Ψ on every node; ZeRO-3:
    16Ψ or 18Ψ per node's share) and the fp32 model each process loads before partitioning (4Ψ
    per process; ``zero_init=False``, a model built before ``initialize``)."""
    psi, n = self.num_params, self.devices_per_node
    nodes = max(1, self.devices // n)
    if {self.offload_optimizer, self.offload_param} - {None, "cpu"}:
      return None
    if self.offload_optimizer is None:
      need = 4 * n
    elif self.stage < 3:
      need = max(4 * self.devices, 16)  # estimate_zero2_model_states_mem_needs
    else:
      need = max(4 * n, (18 if self.offload_param else 16) / nodes)
    return psi * need * DEEPSPEED_HOST_BUFFER


def offload_problem(stage: int, offload_optimizer: str | None,
                     offload_param: str | None) -> str | None:
  """Why a stage cannot have these offload settings (None: it can)."""
  for key, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
    if value is not None and registry.answering(key, value) is None:
      accepted = ", ".join(map(repr, registry.devices(key)))
      return f"{key} must be None or a tier's value ({accepted}), got {value!r}."
  if offload_optimizer and stage == 0:
    return ("offload_optimizer needs ZeRO stage 1, 2 or 3 (stage 0 does not partition the "
            "optimizer state).")
  if offload_param and stage != 3:
    return f"offload_param needs ZeRO stage 3, got stage {stage}: only stage 3 partitions params."
  return None


def estimate(params: float | Sequence[ParamShape], stage: int, devices: int = 1, nodes: int = 1, *,
             param_bytes: int = 2, grad_bytes: int | None = None, optimizer_bytes: float = 12,
             offload_optimizer: str | None = None, offload_param: str | None = None,
             offload_ratio: float = 1.0, persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
             model_persistence_threshold: int | None = None, activations: float = 0.0,
             gathered: tuple[int, int] = (0, 0), prefetch: bool = False,
             hpz_partition_size: int = 1, delayed_update: bool = False,
             param_buffer_elements: float = 0.0, param_cache_elements: float = 0.0,
             trainable: float | None = None, replicated_optimizer: float = 0.0,
             offload_update: str | None = None, gradient_accumulation: int = 1,
             sub_group_size: float = DEFAULT_SUB_GROUP) -> Estimate:
  """Per-device bytes of one ZeRO configuration (formulas and offload rules: module docstring).

  Args:
    params: the parameter count Ψ, or the leaves' shapes (:func:`param_shapes`, or a plan's
      ``leaf_list()``), which add stage-3 persistence.
    stage: ZeRO stage 0..3.
    devices: devices per node.
    nodes: nodes; N = devices x nodes.
    param_bytes: bytes per compute param (p).
    grad_bytes: bytes per gradient (g; default ``param_bytes``).
    optimizer_bytes: optimizer-state bytes per param, fp32 master included (K).
    offload_optimizer: None, or a tier's ``device`` value ("cpu", "nvme", ...), whose
      :meth:`~jzero.tiers.base.Tier.estimate` moves the bytes.
    offload_param: None, or a tier's ``device`` value (stage 3).
    offload_ratio: the fraction of the optimizer state (and its gradient partition) that
      ``offload_optimizer`` moves (DeepSpeed's partial offload, ``offload_optimizer.ratio``).
    persistence_threshold: with shapes: stage-3 leaves with fewer elements per layer stay
      replicated.
    model_persistence_threshold: with shapes: cap on the persistent elements (None: no cap).
    activations: activation bytes per device to add to the device total.
    gathered: stage 3: (elements of the largest unit or layer gathered at once, elements gathered
      at the start of the forward pass), as :meth:`jzero.sharding.plan.Plan.gathered_working_set`
      gives.
    prefetch: the next unit or layer is gathered while one computes (two alive).
    hpz_partition_size: ZeRO++ hpZ's group size s (stage 3): a secondary copy of the
      partitioned params, p(Ψ - Ψr)/s per device.
    delayed_update: ZeRO-Offload's delayed parameter update (:mod:`jzero.tiers.delayed`): the step
      carries its fp32 gradient partition to the next step, 4Ψ/N on the device
      (``bytes["device"]["delayed_grads"]``; with ``"cpu_adam"`` the optimizer's tier holds the
      carried partition, :mod:`jzero.analysis.update_memory`); needs ``offload_optimizer``.
    param_buffer_elements: ``offload_param: "nvme"``: the host staging buffers every partition
      passes through on its way NVMe -> host -> device (DeepSpeed's ``buffer_count`` x
      ``buffer_size`` elements), counted in host params.
    param_cache_elements: ``offload_param: "nvme"``: partitioned elements kept in host memory
      (``max_in_cpu``); the rest of the partition lives on NVMe only.
    trainable: with a parameter count: the parameters the optimizer changes (default: all); the
      others are frozen (no gradient, no master, no optimizer state). A plan's leaves say it
      themselves (:attr:`jzero.sharding.plan.LeafPlan.frozen`).
    replicated_optimizer: bytes of optimizer state every device holds whole (a client
      transformation's small statistics, :meth:`jzero.sharding.opt_layout.OptLayout.bytes_per_device`),
      beside the K bytes per trainable parameter that are partitioned.
    offload_update: the optimizer offload's update (``offload_optimizer.update``, or "store" for
      the NVMe store's own); None: the engine's default for ``offload_optimizer``
      (:func:`jzero.analysis.update_memory.default_update`). Where the gradients, the update's
      buffers and the new params live follows it (:mod:`jzero.analysis.update_memory`).
    gradient_accumulation: micro-batches per step (with ``"cpu_adam"`` the host sums them in
      fp32).
    sub_group_size: the NVMe store's elements per update group.

  Raises:
    ConfigError: an offload setting the stage does not have, or hpZ outside stage 3.
  """
  if stage not in (0, 1, 2, 3):
    raise ConfigError(f"ZeRO stage must be 0..3, got {stage}.")
  problem = offload_problem(stage, offload_optimizer, offload_param)
  if problem:
    raise ConfigError(problem)
  hpz = int(hpz_partition_size)
  if hpz > 1 and stage != 3:
    raise ConfigError(f"hpz_partition_size={hpz} needs ZeRO stage 3 (ZeRO++), got stage {stage}.")
  n, g, k = devices * nodes, param_bytes if grad_bytes is None else grad_bytes, optimizer_bytes
  update = offload_update or update_memory.default_update(offload_optimizer, offload_param)
  if update and not offload_optimizer:
    raise ConfigError(f"offload_update={update!r} needs offload_optimizer.")
  if isinstance(params, (int, float)):
    psi, persistent, largest = int(params), 0, 0
    local = held = psi if trainable is None else trainable
    layer, others = gathered[0], 0  # the layer, when given; nothing outside it
  else:
    psi = sum(math.prod(leaf.shape) for leaf in params)
    persistent = (persistent_numel(params, persistence_threshold, model_persistence_threshold)
                  if stage == 3 else 0)
    trained = [leaf for leaf in params if not getattr(leaf, "frozen", False)]
    local = sum(math.prod(leaf.shape) for leaf in trained)
    held = sum(_state_numel(leaf, stage) for leaf in trained)
    largest = max((math.prod(leaf.shape) for leaf in params), default=0)
    layer = sum(math.prod(l.shape) // l.shape[0] for l in trained if _stacked(l))
    others = sum(math.prod(l.shape) for l in trained if not _stacked(l))
  tiers = {tier: dict.fromkeys(CATEGORIES, 0.0) for tier in columns()}
  device = tiers["device"]
  device["params"] = (param_bytes * (psi - persistent) / n + param_bytes * persistent
                      if stage == 3 else param_bytes * psi)
  device["grads"] = g * held / n if stage >= 2 else g * local
  device["optimizer"] = (k * held / n if stage >= 1 else k * held) + replicated_optimizer
  numbers = Numbers(stage=stage, optimizer=k * held / n + replicated_optimizer,
                    grad_partition=g * held / n,
                    grads_local=g * local, param_partition=param_bytes * ((psi - persistent) / n),
                    persistent=float(param_bytes * persistent), param_bytes=param_bytes,
                    partition_elements=(psi - persistent) / n, param_cache=param_cache_elements,
                    param_buffers=param_buffer_elements, grad_bytes=g, optimizer_bytes=k,
                    state_elements=held / n, gradient_accumulation=gradient_accumulation,
                    in_flight_elements=update_memory.in_flight_elements(layer, others, n),
                    sub_group_elements=sub_group_size)
  # each offload by the rule of the tier its value selects (jzero.tiers.registry)
  if offload_optimizer:
    registry.answering("offload_optimizer", offload_optimizer).estimate(
        "offload_optimizer", offload_ratio, numbers, tiers)
  if offload_param:
    registry.answering("offload_param", offload_param).estimate("offload_param", 1.0, numbers,
                                                                tiers)
  if delayed_update and not offload_optimizer:
    raise ConfigError("delayed_update needs offload_optimizer (ZeRO-Offload's delayed "
                      "parameter update hides the host optimizer step).")
  if offload_optimizer:  # where the update keeps the gradients, its buffers, the new params
    tier = registry.answering("offload_optimizer", offload_optimizer)
    update_memory.place_update(update, numbers, tiers, column=tier.memory or "host",
                               share=offload_ratio, delayed_update=delayed_update,
                               params_on_nvme=offload_param == "nvme")
  if hpz > 1:
    device["secondary"] = param_bytes * (psi - persistent) / hpz
  if delayed_update and not update_memory.streams_gradients(update):
    device["delayed_grads"] = 4 * psi / n
  return Estimate(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
                  num_params=psi, persistent_params=persistent, devices=n,
                  devices_per_node=devices, param_bytes=param_bytes, bytes=tiers,
                  activations=activations, hpz=hpz,
                  gathered=(param_bytes * (gathered[0] * (1 + prefetch) + gathered[1])
                            if stage == 3 else 0.0), update=update,
                  offload_ratio=offload_ratio if offload_optimizer else 0.0,
                  gradient_accumulation=gradient_accumulation, largest_leaf=largest,
                  sub_group=sub_group_size)


def _stacked(leaf: Any) -> bool:
  return bool(getattr(leaf, "stacked", False)) and len(leaf.shape) >= 1


def _state_numel(leaf: Any, stage: int) -> int:
  """Elements of a leaf's gradient / optimizer-state arrays: a plan's leaf partitioned at
  ``stage`` >= 1 counts its padding (:attr:`jzero.sharding.plan.LeafPlan.padded_shape`)."""
  if stage >= 1 and getattr(leaf, "state_partitioned", False):
    return math.prod(leaf.padded_shape)
  return math.prod(leaf.shape)


def activation_bytes(micro_batch: int, seq_len: int, hidden: int, layers: int, heads: int, *,
                     bytes_per_element: int = 2, checkpointing: bool = False) -> float:
  """Activation bytes per device of a transformer's layers (Korthikanti et al. 2022, Table 2).

  Without recomputation a layer keeps s·b·h·(34 + 5·a·s/h) bytes in fp16 (the 34 counts 2-byte
  tensors and 1-byte dropout masks; 5·a·s/h the attention scores, softmax and its dropout); with
  full activation checkpointing only its 2-byte input, 2·s·b·h. Both scale by
  ``bytes_per_element / 2``. Not counted: embeddings, the output logits and the one layer being
  recomputed during the backward pass.

  Args:
    micro_batch: b, sequences per device per micro-batch.
    seq_len: s.
    hidden: h.
    layers: L.
    heads: a.
    bytes_per_element: 2 (fp16 / bf16) or 4 (fp32).
    checkpointing: full activation checkpointing (keep each layer's input only).
  """
  sbh = seq_len * micro_batch * hidden
  per_layer = 2 * sbh if checkpointing else sbh * (34 + 5 * heads * seq_len / hidden)
  return layers * per_layer * bytes_per_element / 2


_OFFLOAD_VARIANTS = ((2, "cpu", None), (3, "cpu", None), (3, "cpu", "cpu"), (3, "nvme", "cpu"),
                     (3, "nvme", "nvme"))


def _offload_variants() -> list[tuple[int, str, str | None, str | None]]:
  """(stage, offload_optimizer, offload_param, update) the recommendation tries after plain
  stages 0-3, least offload first: each of :data:`_OFFLOAD_VARIANTS` with the engine's default
  update (for the config's Adam, ``device: cpu`` sends the gradients to the host: the least
  device memory), then the others of :func:`jzero.analysis.update_memory.update_choices`."""
  return [(stage, opt, param, update) for stage, opt, param in _OFFLOAD_VARIANTS
          for update in update_memory.update_choices(opt)]


@dataclasses.dataclass(frozen=True)
class Recommendation:
  """The answer of :func:`recommend`; ``str()`` says it in one line.

  Attributes:
    budget: device memory in bytes.
    headroom: fraction of ``budget`` kept free.
    choice: the configuration that fits, or None.
    devices_needed: when none fits, the devices at which plain ZeRO-3 would (None: at no count,
      since persistent params and activations alone exceed the budget).
  """

  budget: float
  headroom: float
  choice: Estimate | None
  devices_needed: int | None

  @property
  def usable(self) -> float:
    return self.budget * (1 - self.headroom)

  def __str__(self) -> str:
    limit = (f"{format_bytes(self.usable)} usable per device ({format_bytes(self.budget)} budget, "
             f"{self.headroom:.0%} headroom)")
    if self.choice is not None:
      return f"{self.choice.name} fits: {format_bytes(self.choice.device_total)} of {limit}"
    if self.devices_needed is None:
      return (f"does not fit at any device count: persistent params and activations alone exceed "
              f"{limit}")
    return f"does not fit: needs {self.devices_needed} devices (ZeRO-3) for {limit}"


def recommend(params: float | Sequence[ParamShape], budget: float, devices: int = 1,
              nodes: int = 1, *, headroom: float = 0.1, host_budget: float | None = None,
              **kwargs: Any) -> Recommendation:
  """Which stage? The smallest that fits the device budget, else an offload variant, else how many
  devices plain ZeRO-3 needs.

  A configuration fits when its device total (model states + activations) is at most
  ``budget * (1 - headroom)`` and, with ``host_budget``, its host bytes per node at most
  ``host_budget * (1 - headroom)``. Stages 0-3 are tried in order, then, from the least offload
  to the most: ZeRO-2 and ZeRO-3 with the optimizer on the host, ZeRO-3 with the params on the
  host too, then the optimizer on NVMe, then both on NVMe -- each with the engine's default
  update, then with the gradients streamed to the host (``"cpu_adam"``). Like :func:`estimate` it counts model
  states and activations only: leave room in ``headroom`` for the step's temporaries (the stage-3
  gathered layer, communication buffers).

  Args:
    params, devices, nodes: as for :func:`estimate`.
    budget: device memory in bytes.
    headroom: fraction of each budget kept free.
    host_budget: host memory per node in bytes (None: not checked).
    **kwargs: the other arguments of :func:`estimate` (bytes per param, thresholds, activations).
  """
  usable = budget * (1 - headroom)
  host_usable = math.inf if host_budget is None else host_budget * (1 - headroom)
  candidates = [(s, None, None, None) for s in range(4)] + _offload_variants()
  for stage, opt, param, update in candidates:
    est = estimate(params, stage, devices, nodes, offload_optimizer=opt, offload_param=param,
                   offload_update=update, **kwargs)
    if est.device_total <= usable and est.host_per_node <= host_usable:
      return Recommendation(budget, headroom, est, None)
  zero3 = estimate(params, 3, devices, nodes, **kwargs)
  return Recommendation(budget, headroom, None, _devices_needed(zero3, usable))


def _devices_needed(zero3: Estimate, usable: float) -> int | None:
  """Devices at which a plain ZeRO-3 estimate's device total drops to ``usable``: everything but
  the persistent params and the activations is divided by N."""
  fixed = zero3.param_bytes * zero3.persistent_params + zero3.activations
  if fixed >= usable:
    return None
  return math.ceil((zero3.device_total - fixed) * zero3.devices / (usable - fixed))


# -- tables ----------------------------------------------------------------------------------------
def estimate_rows(estimates: Sequence[Estimate]) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of a table of estimates: device bytes by category and in total, offloaded
  bytes per process (and per node when a node has several processes)."""
  acts = any(e.activations for e in estimates)
  gathered = any(e.gathered for e in estimates)
  secondary = any(e.secondary for e in estimates)
  per_node = any(e.devices_per_node > 1 and e.tier_total("host") for e in estimates)
  # the tiers' columns (jzero.tiers.registry): host and nvme always, another where it holds bytes
  others = [c for c in columns() if c not in ("device", "host", "nvme")
            and any(e.tier_total(c) for e in estimates)]
  header = (["configuration", *CATEGORIES] + ["hpZ secondary"] * secondary
            + ["gathered"] * gathered + ["activations"] * acts
            + ["device total", "host/process"] + ["host/node"] * per_node + ["nvme/process"]
            + [f"{c}/process" for c in others])
  rows = []
  for e in estimates:
    rows.append([e.name, *(byte_cell(e.bytes["device"][c]) for c in CATEGORIES)]
                + [byte_cell(e.secondary)] * secondary
                + [byte_cell(e.gathered)] * gathered + [byte_cell(e.activations)] * acts
                + [format_bytes(e.device_total), byte_cell(e.tier_total("host"))]
                + [byte_cell(e.host_per_node)] * per_node + [byte_cell(e.tier_total("nvme"))]
                + [byte_cell(e.tier_total(c)) for c in others])
  return header, rows


def format_estimates(estimates: Sequence[Estimate]) -> str:
  """A table of estimates as text (see :func:`estimate_rows`)."""
  return text_table(*estimate_rows(estimates))


class EstimateTable(tuple):
  """Several estimates that show themselves: ``str()`` is ``jzero estimate``'s table, a notebook
  renders it as HTML, :meth:`to_records` gives plain dicts and :meth:`plot` stacked bars.

  ``EstimateTable(estimate(psi, s, 8) for s in range(4))``
  """

  def __str__(self) -> str:
    return format_estimates(self)

  def _repr_html_(self) -> str:
    return html_table(*estimate_rows(self), caption="bytes per device (host and NVMe: per "
                      "process; GB = 1e9 bytes)")

  def to_records(self) -> list[dict[str, Any]]:
    """One dict per estimate: its name, the device bytes by category (params, grads, optimizer,
    gathered, activations, and hpZ's secondary / the delayed update's gradient when present), the
    device total and the host and NVMe bytes per process."""
    return [{"configuration": e.name, **{c: float(v) for c, v in e.bytes["device"].items()},
             "gathered": float(e.gathered), "activations": float(e.activations),
             "device_total": float(e.device_total),
             **{c: float(e.tier_total(c)) for c in e.bytes if c != "device"}} for e in self]

  def plot(self, ax: Any = None, budget: float | None = None) -> Any:
    """Stacked bars of the device bytes per configuration (GB), by category; ``budget`` (bytes)
    draws the device's memory as a line. Returns the matplotlib Axes."""
    plt = require_pyplot()
    if ax is None:
      _, ax = plt.subplots(figsize=(1.6 + 1.1 * len(self), 3.6))
    records = self.to_records()
    parts = [c for c in (*CATEGORIES, "secondary", "delayed_grads", "gathered", "activations")
             if any(r.get(c, 0) for r in records)]
    bottom = [0.0] * len(records)
    for part in parts:
      heights = [r.get(part, 0.0) / 1e9 for r in records]
      ax.bar(range(len(records)), heights, bottom=bottom, label=part)
      bottom = [b + h for b, h in zip(bottom, heights)]
    if budget is not None:
      ax.axhline(budget / 1e9, color="k", linestyle="--", label="device memory")
    ax.set_xticks(range(len(records)), [r["configuration"] for r in records], rotation=30,
                  ha="right")
    ax.set_ylabel("GB per device")
    ax.legend(fontsize="small")
    return ax
