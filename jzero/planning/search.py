"""``jzero plan``'s search: every candidate priced, the plausible ones compiled, the fitting ones
ranked by the cost model, the best written as a DeepSpeed config.

1. **Candidates** (:func:`jzero.planning.candidates.candidates`): ZeRO stage 0-3, ZeRO++ (more than
   one node), optimizer and parameter offload, activation checkpointing, micro-batch.
2. **Pruning by arithmetic** (:func:`jzero.planning.candidates.estimated`): a candidate whose
   estimated device bytes (model states, stage 3's gathered layers, activations, logits -- a lower
   bound of the compiled peak) exceed the device's usable memory, or whose host / NVMe bytes per
   node exceed the node's (less the margin), is pruned with the numbers that rule it out.
3. **Compiling the plausible ones** (:mod:`jzero.planning.compiled`): the ``compile_top``
   estimator-fitting candidates with the least predicted time, compiled for the target (cached).
   A compiled candidate *fits* when its peak is within the usable memory less the margin.
4. **Ranking** (:mod:`jzero.planning.cost`): the compiled candidates that fit, by predicted step
   time with the compiled FLOPs, collective bytes and overlap; the first is chosen.

:func:`plan_for` is the Python entry point (``jzero.planning.plan_for``; it lives in ``planning``,
above ``analysis`` in the package order, because it builds engines). Its :class:`Plan` prints as
``jzero plan``'s table (:mod:`jzero.planning.plan_report`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from jzero.errors import ConfigError
from jzero.planning.candidates import (CHECKPOINTING, Candidate, Estimated, Job, _leaves,
                                       candidates, estimated, gpt_for_params)
from jzero.planning.compiled import Compiled, compile_candidate
from jzero.planning.cost import Hardware, Prediction, Resources, gpu_hardware, predict

__all__ = ["Row", "Plan", "plan_for", "DEFAULT_MARGIN", "DEFAULT_COMPILE_TOP"]

DEFAULT_MARGIN = 0.05  # share of the usable memory (device, host, NVMe) a plan leaves free
DEFAULT_COMPILE_TOP = 8  # estimator-fitting candidates compiled, least predicted time first


@dataclasses.dataclass(frozen=True)
class Row:
  """One candidate's line of the plan.

  Attributes:
    status: "fits" (compiled, ranked), "too big" (compiled, over memory), "pruned" (ruled out by
      arithmetic), or "not compiled" (plausible, beyond ``compile_top``).
    reason: why it does not fit or was pruned ("" when it fits).
    device_bytes: per device: the compiled peak (less offloaded bytes on a GPU), or the estimate.
    host_bytes, nvme_bytes: per node (arithmetic).
  """

  candidate: Candidate
  status: str
  reason: str
  device_bytes: float
  host_bytes: float
  nvme_bytes: float
  resources: Resources
  prediction: Prediction
  compiled: Compiled | None = None

  @property
  def name(self) -> str:
    return self.candidate.name


@dataclasses.dataclass(frozen=True)
class Plan:
  """The answer of :func:`plan_for`: every row, ranked fitting rows first; see plan_report."""

  job: Job
  hardware: Hardware
  target: str
  margin: float
  rows: list[Row]

  @property
  def ranked(self) -> list[Row]:
    """The rows that fit, least predicted time first."""
    return [r for r in self.rows if r.status == "fits"]

  @property
  def chosen(self) -> Row | None:
    return self.ranked[0] if self.ranked else None

  @property
  def runner_up(self) -> Row | None:
    return self.ranked[1] if len(self.ranked) > 1 else None

  def deepspeed_config(self, nvme_path: str | None = None) -> dict:
    """The chosen candidate as a DeepSpeed config (``jzero train`` / ``jzero.initialize``).

    Raises:
      ConfigError: nothing fits (the table says why each candidate does not).
    """
    if self.chosen is None:
      raise ConfigError("no candidate fits this target: see the plan's table for each one's "
                        "numbers; add devices or nodes, host memory or NVMe, or shrink the batch.")
    kwargs = {} if nvme_path is None else {"nvme_path": nvme_path}
    return self.chosen.candidate.deepspeed_config(self.job, self.hardware.devices, **kwargs)

  def __str__(self) -> str:
    from jzero.planning.plan_report import format_plan  # noqa: PLC0415

    return format_plan(self)

  def _repr_html_(self) -> str:
    from jzero.planning.plan_report import html_plan  # noqa: PLC0415

    return html_plan(self)

  def to_json(self) -> dict[str, Any]:
    from jzero.planning.plan_report import plan_json  # noqa: PLC0415

    return plan_json(self)


def _model(model: Any) -> Any:
  from jzero.models.gpt import GPTConfig, preset  # noqa: PLC0415

  if isinstance(model, GPTConfig):
    return model
  if isinstance(model, str):
    return preset(model)
  if isinstance(model, (int, float)) and not isinstance(model, bool):
    return gpt_for_params(model)
  raise ConfigError(f"plan_for(model={model!r}): give a GPT preset name ('default', '7b'), a "
                    f"parameter count such as 7e9, or a jzero.models.GPTConfig.")


def _fit_problem(device: float, host: float, nvme: float, hw: Hardware, margin: float,
                 what: str) -> str:
  """Why these bytes do not fit ``hw`` ("" when they do)."""
  from jzero.analysis.tables import format_bytes as fb  # noqa: PLC0415

  usable = hw.usable_device_memory * (1 - margin)
  problems = []
  if device > usable:
    problems.append(f"device {fb(device)} ({what}) > {fb(usable)} usable")
  if host > hw.host_memory.value * (1 - margin):
    problems.append(f"host {fb(host)}/node > {fb(hw.host_memory.value * (1 - margin))}")
  if nvme > hw.nvme_bytes.value * (1 - margin):
    problems.append(f"NVMe {fb(nvme)}/node > {fb(hw.nvme_bytes.value * (1 - margin))}")
  return "; ".join(problems)


def _offloaded(cand: Candidate, e: Estimated, job: Job, hw: Hardware, leaves: list) -> float:
  """Device bytes the offload of ``cand`` saves, by arithmetic: its device twin's estimate less
  its own (a GPU target compiles the twin; :mod:`jzero.planning.compiled`)."""
  twin = dataclasses.replace(cand, offload_optimizer=None, offload_ratio=1.0, offload_param=None,
                             checkpointing="block" if cand.checkpointing == "offload"
                             else cand.checkpointing)
  return estimated(twin, job, hw, leaves).device_bytes - e.device_bytes


def _with_compiled(e: Estimated, c: Compiled) -> Resources:
  """The estimator's resources with the compiled FLOPs, memory bytes, collectives and overlap.
  The compiled memory bytes less the update the host tier runs (its bytes are the host term's;
  on a GPU target the compiled twin runs the whole update on the device). The FLOPs are
  the larger of the compiled count and the arithmetic: in XLA's GPU program of a stage-3 step the
  HLO count misses about half the matmuls (gemms inside loops whose trip count the scheduled
  program no longer states), so it is a lower bound there."""
  return dataclasses.replace(e.resources, flops=max(c.flops, e.resources.flops),
                             memory_bytes=max(c.memory_bytes - e.host_update_share,
                                              e.resources.memory_bytes),
                             intra_node_bytes=c.intra_node_bytes,
                             inter_node_bytes=c.inter_node_bytes, overlap=c.overlap,
                             source="compiled")


def plan_for(model: Any = "default", *, gpu: str | None = "h100", devices: int = 8,
             nodes: int = 1, global_batch: int | None = None, precision: str = "bf16",
             hardware: Hardware | None = None, host_memory: float | None = None,
             nvme_bytes: float | None = None, nvme_bandwidth: float | None = None,
             compile: bool = True, compile_top: int = DEFAULT_COMPILE_TOP,
             margin: float = DEFAULT_MARGIN, stages: tuple[int, ...] = (0, 1, 2, 3),
             micro_batches: tuple[int, ...] | None = None,
             offload_tiers: tuple[str, ...] = ("cpu", "nvme"),
             checkpointing: tuple[str, ...] = CHECKPOINTING, base_config: dict | None = None,
             cache_dir: str | Path | None = None,
             progress: Callable[[Any], Any] | None = None) -> Plan:
  """Plans a job: which ZeRO config runs it fastest on the target (see the module docstring).

  Args:
    model: a GPT preset name, a parameter count
      (:func:`~jzero.planning.candidates.gpt_for_params`), or a ``GPTConfig``.
    gpu: the target GPU ("h100", "a100", ...); ``None`` with ``hardware`` for this machine's CPU
      devices (:func:`jzero.planning.cost.cpu_hardware`).
    devices: devices per node; nodes: nodes.
    global_batch: sequences per step (default 4 per device).
    precision: "bf16", "fp16" or "fp32".
    hardware: the target's rates (default: :func:`~jzero.planning.cost.gpu_hardware` of ``gpu``
      with ``host_memory``, ``nvme_bytes`` and ``nvme_bandwidth`` per node when given).
    compile: compile the plausible candidates (False: rank by arithmetic alone).
    compile_top: how many estimator-fitting candidates to compile, least predicted time first.
    margin: share of each memory left free.
    stages, micro_batches, offload_tiers, checkpointing: narrow the candidates.
    base_config: the config blocks the plan keeps (optimizer, scheduler, clipping).
    cache_dir: where compiles are cached (:func:`jzero.planning.compiled.default_cache_dir`).
    progress: wraps the list of candidates to compile (e.g. ``tqdm.tqdm``).

  Raises:
    ConfigError: an unknown GPU, a nonsense size or batch (one paragraph naming the flag).
  """
  for flag, value in (("--devices", devices), ("--nodes", nodes)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f"{flag} {value!r}: give a positive whole number, e.g. {flag} 8.")
  if not 0 <= margin < 1:
    raise ConfigError(f"--margin {margin}: give the share of memory left free, in [0, 1).")
  if precision not in ("bf16", "fp16", "fp32"):
    raise ConfigError(f"--precision {precision!r}: give bf16, fp16 or fp32.")
  target = "cpu" if gpu is None else gpu
  if hardware is None:
    if gpu is None:
      raise ConfigError("plan_for(gpu=None) plans for this machine's CPU devices: pass "
                        "hardware=jzero.planning.cost.cpu_hardware(devices).")
    hardware = gpu_hardware(gpu, devices, nodes, precision=precision, host_memory=host_memory,
                            nvme_bytes=nvme_bytes, nvme_bandwidth=nvme_bandwidth)
  gpt = _model(model)
  n = hardware.devices
  job = Job(gpt, global_batch or 4 * n, precision,
            **({} if base_config is None else {"base_config": base_config}))
  leaves = _leaves(gpt)
  priced = []
  for cand in candidates(job, n, hardware.nodes, stages=stages, micro_batches=micro_batches,
                         offload_tiers=offload_tiers, checkpointing=checkpointing):
    e = estimated(cand, job, hardware, leaves)
    problem = _fit_problem(e.device_bytes, e.host_bytes, e.nvme_bytes, hardware, 0.0,
                           "estimate") or _fit_problem(0, e.host_bytes, e.nvme_bytes, hardware,
                                                       margin, "estimate")
    priced.append((cand, e, problem, predict(e.resources, hardware)))
  plausible = sorted((p for p in priced if not p[2]), key=lambda p: p[3].seconds)
  to_compile = {id(p[0]) for p in plausible[:compile_top]} if compile else set()
  compiled = {}
  todo = [p for p in plausible if id(p[0]) in to_compile]
  for cand, e, _, _ in (progress(todo) if progress else todo):
    config = cand.deepspeed_config(job, n)
    compiled[id(cand)] = compile_candidate(config, target, n, hardware.nodes, gpt,
                                           cache_dir=cache_dir,
                                           memory_fraction=hardware.memory_fraction.value)
  rows = []
  for cand, e, problem, pred in priced:
    c = compiled.get(id(cand))
    if c is None:
      status = "pruned" if problem else ("not compiled" if compile else "fits")
      rows.append(Row(cand, status, problem, e.device_bytes, e.host_bytes, e.nvme_bytes,
                      e.resources, pred))
      continue
    device = c.peak - (0.0 if target == "cpu" else _offloaded(cand, e, job, hardware, leaves))
    problem = _fit_problem(device, e.host_bytes, e.nvme_bytes, hardware, margin, "compiled peak")
    resources = _with_compiled(e, c)
    rows.append(Row(cand, "too big" if problem else "fits", problem, device, e.host_bytes,
                    e.nvme_bytes, resources, predict(resources, hardware), c))
  order = {"fits": 0, "not compiled": 1, "too big": 2, "pruned": 3}
  # ties (a step bound by the same term) go to the candidate with less work in all its terms
  rows.sort(key=lambda r: (order[r.status], round(r.prediction.seconds, 9),
                           sum(r.prediction.terms.values()), r.device_bytes))
  return Plan(job=job, hardware=hardware, target=target, margin=margin, rows=rows)
