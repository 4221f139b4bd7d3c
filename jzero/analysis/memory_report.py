"""Memory a live train state holds, measured, beside the estimator's prediction
(:mod:`jzero.analysis.estimate`).

**Measured accounting** (:func:`memory_report`, from the plan, the state and the tiers'
resources -- not the engine) reads, for the first device of the plan's mesh, the bytes of every
shard that device holds of the compute params, the fp32 master and the optimizer state
(``arr.addressable_shards``), by memory kind (``device``, ``pinned_host``, ``unpinned_host``; a
tier outside JAX's memory kinds, such as NVMe, adds its own key). The gradient buffer lives only
inside the compiled step, so it is counted from the plan (its layout times the compute dtype), as
ZeRO's accounting does. Given the compiled step, the report adds its ``memory_analysis()``, and it
sets the estimator's prediction for the same model beside the measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jzero.analysis import update_memory
from jzero.analysis.estimate import CATEGORIES, Estimate, estimate
from jzero.analysis.tables import byte_cell, format_bytes, html_table, require_pyplot, text_table
from jzero.comm import program
from jzero.sharding.plan import Plan
from jzero.tiers import registry, where
from jzero.tiers.base import Resources
from jzero.tiers.host_step import HOST_STEP
from jzero.tiers.nvme_params import host_bytes_bound

__all__ = ["REPORT_CATEGORIES", "live_bytes", "state_report", "plan_gradient_bytes",
           "CompiledMemory", "MemoryReport", "memory_report", "report_rows",
           "format_memory_report"]


# -- measured accounting ---------------------------------------------------------------------------
REPORT_CATEGORIES = ("params", "grads", "master", "optimizer")
_KIND_ORDER = ("device", "pinned_host", "unpinned_host", "nvme")


def live_bytes(tree: Any, device: jax.Device | None = None) -> dict[str, int]:
  """Bytes of the shards of ``tree``'s arrays that live on ``device``, by memory kind.

  Args:
    tree: a pytree of ``jax.Array`` (other leaves are ignored).
    device: the device to count (default: the first device of the first array).
  """
  out: dict[str, int] = collections.defaultdict(int)
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array):
      continue
    device = device or x.addressable_shards[0].device
    for shard in x.addressable_shards:
      if shard.device == device:
        out[x.sharding.memory_kind or "device"] += shard.data.nbytes
  return dict(out)


def state_report(plan: Plan, state: Any, resources: Resources,
                 gradient_accumulation: int = 1) -> dict[str, dict[str, int]]:
  """Bytes the first device of the plan's mesh holds: category -> memory kind -> bytes.

  Categories are :data:`REPORT_CATEGORIES`, plus "secondary" (ZeRO++ hpZ's copy) and
  "delayed_grads" (the delayed update's carried gradient) when the state has them; params, master,
  optimizer and secondary are measured from the live arrays, grads counted from the plan (``{}``
  where a category has no arrays; what a tier holds outside the arrays, such as the NVMe store's
  files, from its resource in ``resources``); ``gradient_accumulation``: the config's micro-batches
  per step (the host step sums them in the accumulation dtype).
  """
  device = plan.mesh.mesh.devices.flat[0]
  report = {
      "params": live_bytes(state.params, device),
      "grads": plan_gradient_bytes(plan, delayed=getattr(state, "delayed", None) is not None,
                                   accumulating=gradient_accumulation > 1),
      "master": live_bytes(state.master, device),
      "optimizer": live_bytes(state.opt_state, device),
  }
  if getattr(state, "secondary", None) is not None:
    report["secondary"] = live_bytes(state.secondary, device)
  for tier in registry.active(plan):  # what tiers hold outside the arrays (the NVMe store)
    for category, kinds in tier.measured_bytes(plan, resources.get(tier.name)).items():
      for kind, nbytes in kinds.items():
        report[category][kind] = report[category].get(kind, 0) + nbytes
  if getattr(state, "delayed", None) is not None:  # the carried gradient (jzero.tiers.delayed)
    report["delayed_grads"] = live_bytes(state.delayed.grads, device)
  return report


def plan_gradient_bytes(plan: Plan, *, delayed: bool = False,
                        accumulating: bool = False) -> dict[str, int]:
  """The step's gradient bytes on the first device, counted from the plan (the report's
  "grads (plan)" row), by memory kind: as the stage lays them out on the device -- except the
  leaves the host step updates (:mod:`jzero.tiers.host_step`), whose gradient leaves the device
  in the backward pass: stage 1 reduces their full local gradient at the end, stages 2/3 hold one
  layer of them in flight (:func:`jzero.analysis.update_memory.in_flight_elements`), and their
  reduced partitions arrive in pinned host memory (two with the delayed update; summed in the
  accumulation dtype when ``accumulating`` micro-batches)."""
  trained = [l for l in plan.leaf_list() if not l.frozen]
  streamed = [l for l in trained if l.state_tier == HOST_STEP]
  on_device = sum(plan.local_numel(l, l.grad_partitioned) for l in trained
                  if l.state_tier != HOST_STEP)
  if plan.stage < 2:
    on_device += sum(plan.local_numel(l, False) for l in streamed)
  else:
    on_device += update_memory.in_flight_elements(
        sum(l.layer_numel for l in streamed if l.stacked),
        sum(l.numel for l in streamed if not l.stacked), plan.mesh.zero_size)
  out = {"device": round(on_device * jnp.dtype(plan.compute_dtype).itemsize)}
  if streamed:
    host = sum(plan.local_numel(l, True) for l in streamed) * (2 if delayed else 1)
    dtype = plan.grad_accum_dtype if accumulating else plan.comm_dtype
    out["pinned_host"] = host * jnp.dtype(dtype).itemsize
  return out


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """One device's bytes of a compiled step, from XLA's ``memory_analysis()``."""

  argument: int
  output: int
  temp: int
  alias: int
  generated_code: int

  @classmethod
  def of(cls, compiled: Any) -> CompiledMemory:
    """Reads ``compiled.memory_analysis()`` of a ``jax.stages.Compiled``."""
    a = compiled.memory_analysis()
    return cls(argument=a.argument_size_in_bytes, output=a.output_size_in_bytes,
               temp=a.temp_size_in_bytes, alias=a.alias_size_in_bytes,
               generated_code=a.generated_code_size_in_bytes)

  @property
  def peak(self) -> int:
    """Peak bytes, argument + output + temp - alias (donated buffers reused for outputs count
    once)."""
    return self.argument + self.output + self.temp - self.alias


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Measured and predicted model-state bytes of one device holding a train state.

  Attributes:
    device: the device measured (the first of the mesh).
    precision: "fp32", "bf16" or "fp16".
    measured: category (:data:`REPORT_CATEGORIES`) -> memory kind -> bytes.
    predicted: category -> bytes the estimator puts on the device.
    estimate: the estimator's answer for this model (Ψ, Ψr, N, stage).
    optimizer_bytes: K, optimizer-state bytes per param read from the live state (master included).
    compiled: the compiled step's memory analysis, when a batch was given.
    prefetch: the plan gathers the next unit while one computes.
  """

  device: str
  precision: str
  measured: dict[str, dict[str, int]]
  predicted: dict[str, float]
  estimate: Estimate
  optimizer_bytes: float
  compiled: CompiledMemory | None = None
  prefetch: bool = False
  notes: tuple[str, ...] = ()

  @property
  def categories(self) -> tuple[str, ...]:
    """:data:`REPORT_CATEGORIES`, plus "secondary" with ZeRO++ hpZ and "delayed_grads" with the
    delayed update."""
    return REPORT_CATEGORIES + tuple(c for c in ("secondary", "delayed_grads")
                                     if c in self.measured)

  def measured_bytes(self, category: str | None = None) -> int:
    """Measured bytes of one category, over all memory kinds (None: all categories)."""
    names = self.categories if category is None else (category,)
    return sum(sum(self.measured[c].values()) for c in names)

  def predicted_bytes(self, category: str | None = None) -> float:
    """Predicted bytes of one category (None: all categories)."""
    names = self.categories if category is None else (category,)
    return sum(self.predicted[c] for c in names)

  def __str__(self) -> str:
    return format_memory_report(self)

  def _repr_html_(self) -> str:
    title, header, rows, notes = report_rows(self)
    return html_table(header, rows, caption=title, notes=notes)

  def to_records(self) -> list[dict[str, Any]]:
    """One dict per category: bytes measured per memory kind, measured, predicted."""
    return [{"category": c, **{f"measured_{k}": float(v) for k, v in self.measured[c].items()},
             "measured": float(self.measured_bytes(c)), "predicted": float(self.predicted_bytes(c))}
            for c in self.categories]

  def plot(self, ax: Any = None) -> Any:
    """Measured and predicted bytes per category (MB), side by side. Returns the Axes."""
    plt = require_pyplot()
    if ax is None:
      _, ax = plt.subplots(figsize=(6, 3.2))
    records = self.to_records()
    x = range(len(records))
    ax.bar([i - 0.2 for i in x], [r["measured"] / 1e6 for r in records], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["predicted"] / 1e6 for r in records], 0.4, label="predicted")
    ax.set_xticks(list(x), [r["category"] for r in records])
    ax.set_ylabel("MB per device")
    ax.set_title(self.estimate.name, fontsize="medium")
    ax.legend(fontsize="small")
    return ax

  def ratio(self, category: str | None = None) -> float:
    """measured / predicted for one category (None: the total); nan where nothing is predicted."""
    predicted = self.predicted_bytes(category)
    return self.measured_bytes(category) / predicted if predicted else math.nan


def _state_bytes_per_param(plan: Plan, state: Any, resources: Resources,
                           tx: Any) -> tuple[float, float, float]:
  """(fp32 master, partitioned optimizer state) bytes per trainable parameter, from the live
  state's global arrays, and the bytes of the optimizer state every device holds whole (its
  replicated leaves but scalars: a client transformation's small statistics)."""
  numel = sum(math.prod(plan.state_shape(l)) for l in plan.leaf_list() if not l.frozen)
  master = sum(x.nbytes for x in jax.tree.leaves(state.master))
  split = lambda x: any(a is not None for a in x.sharding.spec)  # noqa: E731
  leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  optimizer = sum(x.nbytes for x in leaves if split(x))
  replicated = sum(x.nbytes for x in leaves if not split(x))
  for tier in registry.active(plan):  # e.g. NVMe leaves: 0-byte placeholders in the state
    held = tier.held_bytes(plan, resources.get(tier.name))
    master, optimizer = master + held.get("master", 0), optimizer + held.get("optimizer", 0)
  return master / max(numel, 1), optimizer / max(numel, 1), replicated


def memory_report(plan: Plan, state: Any, resources: Resources, *, config: Any, tx: Any,
                  compiled: Any = None, gathered: tuple[int, int] | None = None) -> MemoryReport:
  """Measured bytes of the first device of the plan's mesh beside the estimator's prediction
  (:meth:`jzero.Engine.memory_report` gives it the engine's plan, state, resources, config and
  optimizer, and with a batch the compiled step).

  The prediction uses the plan's leaves (Ψ, stacked layers), the mesh's ZeRO size as N, the
  config's stage and persistence thresholds, the compute dtype's bytes for params and grads, and K
  read from the live state (fp32 master + param-like optimizer leaves per param: 8 for Adam in
  fp32, 12 in bf16 / fp16).

  Args:
    plan: the plan the state is laid out by.
    state: a train state of the plan.
    resources: what the plan's tiers opened (:class:`jzero.tiers.base.Resources`).
    config: the DeepSpeed config (its ZeRO block's persistence thresholds, the precision).
    tx: the optax optimizer (which of its state's leaves are per parameter).
    compiled: the compiled step (``jax.stages.Compiled``): adds its memory analysis.
    gathered: stage 3's (largest group gathered at once, elements gathered at the start) as the
      model runs (default: the plan's).
  """
  zero = config.zero_optimization
  compiled_memory = CompiledMemory.of(compiled) if compiled is not None else None
  master_k, opt_k, replicated = _state_bytes_per_param(plan, state, resources, tx)
  leaves = plan.leaf_list()
  host = sum(l.numel for l in leaves if l.state_tier == "host")
  on_nvme = sum(l.numel for l in leaves if l.state_tier == "nvme")
  store = resources.get(where.NVME)
  reader = store.reader if store is not None else None
  # params on NVMe (jzero.tiers.nvme_params): the store holds their fp32 master (counted in master)
  # or, with their state on the host, an fp32 copy (counted in params, below); the host cache holds
  # max_in_cpu of them in fp32
  cached = (sum(e.numel for p, e in reader.entries.items() if p in reader.cached)
            if reader is not None else 0)
  optimizer_tier = ("nvme" if on_nvme and (where.params_on_nvme(plan) or not host)
                    else "cpu" if host else None)
  offloaded = on_nvme if optimizer_tier == "nvme" else host
  # a registered tier's (jzero.tiers.registry): its config value, its share of the elements
  others = collections.Counter()
  for leaf in leaves:
    if leaf.state_tier not in ("device", where.HOST, where.NVME):
      others[leaf.state_tier] += leaf.numel
  if optimizer_tier is None and others:
    name, offloaded = others.most_common(1)[0]
    optimizer_tier = registry.value_of("offload_optimizer", name)
  block = zero.offload_optimizer
  est = estimate(leaves, plan.stage, plan.mesh.zero_size, offload_optimizer=optimizer_tier,
                 # the update the engine runs (initialize resolved it: jzero.tiers.host_step)
                 offload_update=block.update if optimizer_tier == "cpu" and block else None,
                 gradient_accumulation=config.gradient_accumulation_steps,
                 offload_param=("nvme" if where.params_on_nvme(plan) else
                                "cpu" if where.param_offloads(plan) else None),
                 param_cache_elements=cached,
                 offload_ratio=offloaded / sum(l.numel for l in leaves),
                 param_bytes=jnp.dtype(plan.compute_dtype).itemsize,
                 optimizer_bytes=master_k + opt_k,
                 persistence_threshold=zero.param_persistence_threshold,
                 model_persistence_threshold=zero.model_persistence_threshold,
                 gathered=gathered if gathered is not None else plan.gathered_working_set(),
                 prefetch=program.prefetches(plan),
                 hpz_partition_size=plan.zeropp.hpz,
                 delayed_update=getattr(state, "delayed", None) is not None,
                 replicated_optimizer=replicated)
  # Offload: master + optimizer state are predicted over the tiers they live on, and the
  # gradients where the engine's update keeps them (jzero.analysis.update_memory: on the device
  # under the streamed update and the NVMe store's); the report's gradients are the plan's
  # gradient buffer, summed over the tiers here.
  total = {c: sum(est.bytes[t][c] for t in est.bytes) for c in CATEGORIES}
  if reader is not None:  # the cache in fp32 (see above)
    total["params"] = est.bytes["device"]["params"] + 4 * cached
    # params whose master is on the host or the device: the store holds an fp32 copy of each
    # (counted as params), and fp32 training's state holds the param itself (its master)
    copies = 4 * sum(plan.local_numel(l, True) for l in leaves if where.param_copy_on_nvme(l))
    total["params"] += copies * (1 if plan.has_master else 2)
  partitioned = total["optimizer"] - replicated
  per_k = partitioned / (master_k + opt_k) if master_k + opt_k else 0.0
  predicted = {"params": total["params"], "grads": total["grads"], "master": per_k * master_k,
               "optimizer": per_k * opt_k + replicated}
  if est.hpz > 1:
    predicted["secondary"] = est.bytes["device"]["secondary"]
  if getattr(state, "delayed", None) is not None:  # the host step carries its leaves' gradient on
    # the host (counted in grads): the state's carried gradient holds the others'
    predicted["delayed_grads"] = est.bytes["device"].get("delayed_grads", 0.0)
  notes = ()
  if reader is not None:
    held = ("fp32 copy, written after each update (counted in params; the master and "
            "optimizer state are on the host or the device)" if store.copies
            else "fp32 master (counted in master)")
    notes += (f"params on NVMe: read layer by layer from the store's {held}; host cache "
              f"{format_bytes(reader.cache_bytes())} in this process ({len(reader.cached)} of {len(reader.entries)} leaves), host bound "
              f"{format_bytes(host_bytes_bound(store.settings, len(store.devices)))} (max_in_cpu "
              f"+ buffer_count x buffer_size per device, fp32); reads so far: "
              f"{reader.disk_reads} from disk, {reader.prefetch_hits} prefetched, "
              f"{reader.cache_hits} from the cache",)
  if store is not None:
    notes += (f"NVMe store of process {jax.process_index()}: {store.directory} -- "
             f"{format_bytes(store.bytes_per_slot)} per slot ({len(store.devices)} devices), "
             f"{format_bytes(store.disk_bytes())} on disk (two slots and metadata), step "
             f"{store.step} committed in slot {store.slot}",)
  return MemoryReport(device=str(plan.mesh.mesh.devices.flat[0]),
                      precision=config.precision, measured=state_report(
                          plan, state, resources, config.gradient_accumulation_steps),
                      predicted=predicted, estimate=est, optimizer_bytes=master_k + opt_k,
                      compiled=compiled_memory, prefetch=program.prefetches(plan), notes=notes)


def report_rows(report: MemoryReport) -> tuple[str, list[str], list[list[str]], list[str]]:
  """(title, header, rows, notes) of :func:`format_memory_report`'s table: per category the
  measured bytes by memory kind, measured, predicted and their ratio; the notes are the
  prediction per tier, the gathered working set, the NVMe store and the compiled step's memory
  analysis."""
  est = report.estimate
  present = {k for kinds in report.measured.values() for k in kinds}
  kinds = [k for k in _KIND_ORDER if k in present] + sorted(present - set(_KIND_ORDER))
  persistent = f" ({est.persistent_params:,} persistent)" if est.persistent_params else ""
  title = (f"memory per device ({report.device}): {est.name}, {report.precision}, N = "
           f"{est.devices}, {est.num_params:,} params{persistent}, optimizer state K = "
           f"{report.optimizer_bytes:g} B/param")
  header = ["model states", *kinds, "measured", "predicted", "measured/predicted"]
  rows = []
  for name in (*report.categories, None):
    ratio = report.ratio(name)
    label = name or "total"
    label = {"grads": "grads (plan)", "secondary": "hpZ secondary",
             "delayed_grads": "delayed grads (DPU)"}.get(label, label)
    rows.append([label]
                + [byte_cell(report.measured[name].get(k, 0)) if name else "" for k in kinds]
                + [byte_cell(report.measured_bytes(name)), byte_cell(report.predicted_bytes(name)),
                   "-" if math.isnan(ratio) else f"{ratio:.4f}"])
  notes = []
  if est.offload_optimizer or est.offload_param:
    notes.append("predicted per tier (estimator): " + ", ".join(
        f"{tier} {format_bytes(est.tier_total(tier))}" for tier in est.bytes
        if est.tier_total(tier)) + " (per device's share: a process holds the shares of its "
        "local devices" + ("; the gradients on the host: the reduced partitions the host's "
                           "Adam reads, a temporary of the step" if any(
                               est.bytes[t].get("grads") for t in est.bytes if t != "device")
                           else "") + ")")
  if est.gathered:
    source = "traced step" if report.compiled is not None else "plan"
    notes.append(f"ZeRO-3 gathered working set ({source}): {format_bytes(est.gathered)} -- the "
                 f"largest unit or layer{' twice (prefetch)' if report.prefetch else ''} plus the "
                 f"parameters gathered at the start; a temporary of the compiled step")
  notes.extend(report.notes)
  c = report.compiled
  if c is not None:
    notes.append(f"compiled step (XLA memory_analysis): argument {format_bytes(c.argument)}, "
                 f"output {format_bytes(c.output)}, temp {format_bytes(c.temp)}, alias "
                 f"{format_bytes(c.alias)}, generated code {format_bytes(c.generated_code)}; "
                 f"peak {format_bytes(c.peak)}")
  return title, header, rows, notes


def format_memory_report(report: MemoryReport) -> str:
  """:func:`report_rows` as text (what ``jzero train`` prints at its end)."""
  title, header, rows, notes = report_rows(report)
  compiled = [n for n in notes if n.startswith("compiled step")]
  return "\n".join([title, text_table(header, rows, indent="  "),
                    *(f"  {n}" for n in notes if n not in compiled), *compiled])
