"""``jzero plan``'s search: every candidate priced, compiled in order of predicted time until the
fastest one that fits is proven by its compile, the best written as a DeepSpeed config.

1. **Candidates** (:func:`jzero.planning.candidates.candidates`): ZeRO stage 0-3, ZeRO++ (more than
   one node), optimizer and parameter offload, activation checkpointing, micro-batch.
2. **One budget.** Each GPU's *usable* memory is its memory times ``mem_fraction`` (what
   ``XLA_PYTHON_CLIENT_MEM_FRACTION`` makes JAX preallocate;
   :data:`~jzero.planning.cost.DEFAULT_MEM_FRACTION`) less the ``margin``; host memory and NVMe per
   node less the margin. Every row, the pruning and the compiled fit use these same figures
   (:attr:`Plan.usable`).
3. **Pricing by arithmetic** (:func:`jzero.planning.candidates.estimated`): the compiled step's
   peak device bytes as :mod:`jzero.analysis.step_memory` models them, the host and NVMe bytes
   per node, and the predicted step time. A candidate whose estimate exceeds a budget is *pruned*
   with the numbers that rule it out; the others are *predicted to fit*.
4. **Compiling in order** (:mod:`jzero.planning.compiled`): the candidates predicted to fit, least
   predicted time first, are compiled for the target one after another until one *fits* by its
   compile (the fastest candidate predicted to fit, proven) and at least ``compile_top`` were
   compiled -- or the ``time_budget`` is spent, which the plan says. Candidates that compile to
   the same device program (an offload candidate's device twin on a GPU target,
   :mod:`jzero.planning.compiled`) share one compile. A compiled candidate fits when its device
   bytes are within the usable memory; on a GPU target an offload candidate's device bytes are
   its twin's compiled peak less the state its offload keeps off the device, labelled so.
   Nothing is "too big" unless compiled, and "nothing fits" is said only when no candidate
   predicted to fit is left untried; when none is predicted to fit, the one with the fewest
   device bytes is compiled, so that the shortfall is a compiled figure.
5. **Ranking** (:mod:`jzero.planning.cost`): the compiled candidates that fit, by predicted step
   time with the compiled FLOPs, collective bytes and overlap; the first is chosen.

:func:`plan_for` is the Python entry point (``jzero.planning.plan_for``; it lives in ``planning``,
above ``analysis`` in the package order, because it builds engines). Its :class:`Plan` prints as
``jzero plan``'s table (:mod:`jzero.planning.plan_report`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

from jzero.errors import ConfigError, JZeroError
from jzero.planning.candidates import (CHECKPOINTING, Candidate, Estimated, Job, _leaves,
                                       activation_bytes_of, candidates, estimated, gpt_for_params)
from jzero.planning.compiled import Compiled, compile_candidate, program_config
from jzero.planning.cost import (DEFAULT_MEM_FRACTION, Hardware, Prediction, Resources,
                                 gpu_hardware, predict, tpu_hardware)

__all__ = ["Row", "Plan", "SearchLog", "plan_for", "DEFAULT_MARGIN", "DEFAULT_COMPILE_TOP",
           "DEFAULT_TIME_BUDGET", "MODEL", "MORE_NODES", "remedies"]

DEFAULT_MARGIN = 0.05  # share of the usable memory (device, host, NVMe) a plan leaves free
DEFAULT_COMPILE_TOP = 1  # candidates compiled at least, least predicted time first
DEFAULT_TIME_BUDGET = 600.0  # seconds of compiling a search may spend
# where a streamed-gradient candidate's device bytes come from on a target whose compile cannot
# place host memory (its twin compiled for FLOPs and collectives)
MODEL = "model (cpu_adam)"
MORE_NODES = 64  # when nothing fits, remedies tries up to this many times the nodes


@dataclasses.dataclass(frozen=True)
class Row:
  """One candidate's line of the plan.

  Attributes:
    status: "fits" (compiled, within the budgets), "too big" (compiled, over one), "pruned" (the
      estimate is over a budget), "not compiled" (predicted to fit, left untried), or "compile
      failed" (XLA refused its program: the reason is XLA's error, and the search goes on).
    reason: why it does not fit or was pruned ("" when it fits).
    device_bytes: per device: the compiled figure when compiled (see ``device_from``), else the
      estimate.
    estimate_bytes: per device: the estimator's figure (:mod:`jzero.analysis.step_memory`).
    device_from: where ``device_bytes`` comes from: "compiled" (the compiled step's peak),
      "twin - offload" (a GPU target's offload candidate: its device twin's compiled peak less the
      state its offload keeps on the host), "update phase (estimate)" (such a candidate whose
      update phase, by arithmetic, holds more than that), :data:`MODEL` (a candidate whose
      gradients leave the device in the backward pass, on a target whose compile cannot place
      host memory: the memory model's bytes, its twin compiled for FLOPs and collectives), or
      "estimate".
    host_bytes, nvme_bytes: per node (arithmetic).
    parts: the estimate's device bytes by part, of the phase its peak is in
      (:meth:`jzero.analysis.step_memory.StepMemory.parts`).
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
  estimate_bytes: float = 0.0
  device_from: str = "estimate"
  parts: dict = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    return self.candidate.name

  @property
  def estimate_ratio(self) -> float | None:
    """Estimate over compiled device bytes (None: not compiled, or device bytes from the model)."""
    measured = self.compiled and self.device_from != MODEL
    return self.estimate_bytes / self.device_bytes if measured and self.device_bytes else None


@dataclasses.dataclass(frozen=True)
class SearchLog:
  """What the search compiled and why it stopped.

  Attributes:
    compiled: device programs compiled (cached ones included); cached: of those, from the cache.
    seconds: wall time spent compiling.
    stop: "proven" (a candidate fits by its compile and ``compile_top`` were compiled),
      "exhausted" (every candidate predicted to fit was compiled), "shortfall" (none was
      predicted to fit: the one with the fewest device bytes was compiled, to measure its
      shortfall), "budget" (``time_budget`` ran out first) or "arithmetic" (``compile=False``).
    time_budget: the budget, seconds; untried: candidates predicted to fit left uncompiled.
  """

  compiled: int
  cached: int
  seconds: float
  stop: str
  time_budget: float
  untried: int


@dataclasses.dataclass(frozen=True)
class Plan:
  """The answer of :func:`plan_for`: every row, ranked fitting rows first; see plan_report."""

  job: Job
  hardware: Hardware
  target: str
  margin: float
  rows: list[Row]
  search: SearchLog | None = None
  remedies: tuple[str, ...] | None = None  # when nothing fits: what would (:func:`remedies`)

  @property
  def usable(self) -> float:
    """Usable bytes per device, the one figure every row is measured against -- the device's
    memory x ``memory_fraction`` x (1 - margin)."""
    return self.hardware.usable_device_memory * (1 - self.margin)

  @property
  def ranked(self) -> list[Row]:
    """The rows that fit, least predicted time first."""
    return [r for r in self.rows if r.status == "fits"]

  @property
  def chosen(self) -> Row | None:
    return self.ranked[0] if self.ranked else None

  @property
  def what_would_help(self) -> str:
    """The :attr:`remedies` as a sentence, or that none was found (for a plan where nothing
    fits)."""
    if not self.remedies:
      return (f"By the same arithmetic, no more host memory or NVMe, no batch of one sequence "
              f"per device and no more nodes (up to {MORE_NODES} times as many) would make one "
              f"fit.")
    return "By the same arithmetic, a candidate would fit with " + "; or ".join(self.remedies) + "."

  @property
  def runner_up(self) -> Row | None:
    """The next fitting row, or else the fastest untried candidate predicted to fit."""
    rest = self.ranked[1:] or [r for r in self.rows if r.status == "not compiled"]
    return rest[0] if rest else None

  def deepspeed_config(self, nvme_path: str | None = None) -> dict:
    """The chosen candidate as a DeepSpeed config (``jzero train`` / ``jzero.initialize``).

    Raises:
      ConfigError: nothing fits (the table says why each candidate does not).
    """
    if self.chosen is None:
      raise ConfigError("no candidate fits this target: see the plan's table for each one's "
                        "numbers; add devices or nodes, host memory or NVMe, or shrink the batch.")
    kwargs = {} if nvme_path is None else {"nvme_path": nvme_path}
    return self.chosen.candidate.deepspeed_config(
        self.job, self.hardware.devices, devices_per_node=self.hardware.devices_per_node, **kwargs)

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
  """Why these bytes do not fit ``hw``'s budgets ("" when they do)."""
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


def _compiled_device(e: Estimated, c: Compiled, as_is: bool) -> tuple[float, str]:
  """(device bytes, how obtained) of a compiled candidate: the compiled peak where its own config
  was compiled (``as_is``) or it offloads nothing; else (compiled as its device twin, which holds
  the offloaded state on the device) for a candidate whose gradients leave the device in the
  backward pass, the memory model's bytes (:data:`MODEL`); for another, the twin's compiled peak
  less the state its offload keeps off the device -- or the arithmetic's update phase, if larger:
  the streamed update, which the twin does not run (:class:`jzero.planning.candidates.Estimated`)."""
  if as_is or not e.offloaded_bytes:
    return c.peak, "compiled"
  if e.streams_gradients:
    return e.device_bytes, MODEL
  twin = c.peak - e.offloaded_bytes
  return (twin, "twin - offload") if twin >= e.offload_floor else (e.offload_floor,
                                                                   "update phase (estimate)")


def _order(row: tuple) -> tuple:
  """Least predicted time first; ties (a step bound by the same term) go to the candidate with
  less work over all its terms, then fewer device bytes."""
  pred, device = row[3], row[1].device_bytes
  return (round(pred.seconds, 9), sum(pred.terms.values()), device)


def plan_for(model: Any = "default", *, gpu: str | None = "h100", devices: int = 8,
             nodes: int = 1, global_batch: int | None = None, precision: str = "bf16",
             hardware: Hardware | None = None, host_memory: float | None = None,
             nvme_bytes: float | None = None, nvme_bandwidth: float | None = None,
             mem_fraction: float = DEFAULT_MEM_FRACTION, compile: bool = True,
             compile_top: int = DEFAULT_COMPILE_TOP,
             time_budget: float = DEFAULT_TIME_BUDGET, margin: float = DEFAULT_MARGIN,
             stages: tuple[int, ...] = (0, 1, 2, 3), micro_batches: tuple[int, ...] | None = None,
             offload_tiers: tuple[str, ...] | None = None,
             checkpointing: tuple[str, ...] = CHECKPOINTING, base_config: dict | None = None,
             cache_dir: str | Path | None = None,
             progress: Callable[[str], Any] | None = None, tpu: str | None = None,
             topology: str | None = None, slices: int = 1) -> Plan:
  """Plans a job: which ZeRO config runs it fastest on the target (see the module docstring).

  Args:
    model: a GPT preset name, a parameter count
      (:func:`~jzero.planning.candidates.gpt_for_params`), or a ``GPTConfig``.
    tpu, topology, slices: instead of ``gpu``: a TPU slice (the rates of
      :func:`~jzero.planning.cost.tpu_hardware`; candidates compiled for its compile-only chips).
    gpu: the target GPU (a :data:`jzero.planning.aot.GPU_SPECS` name); ``None`` with ``hardware``
      for this machine's CPU devices (:func:`jzero.planning.cost.cpu_hardware`).
    devices: devices per node; nodes: nodes.
    global_batch: sequences per step (default 4 per device).
    precision: "bf16", "fp16" or "fp32".
    hardware: the target's rates (default: :func:`~jzero.planning.cost.gpu_hardware` of ``gpu``
      with ``mem_fraction``, ``host_memory``, ``nvme_bytes`` and ``nvme_bandwidth`` per node when
      given).
    mem_fraction: the share of each GPU's memory the step may use, what the run must set
      ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to (ignored with ``hardware``).
    compile: compile candidates (False: rank by arithmetic alone).
    compile_top: compile at least this many, least predicted time first, before stopping at a
      candidate proven to fit.
    time_budget: seconds of compiling after which the search stops (and says so).
    margin: share of each memory left free.
    stages, micro_batches, offload_tiers, checkpointing: narrow the candidates.
    base_config: the config blocks the plan keeps (optimizer, scheduler, clipping).
    cache_dir: where compiles are cached (:func:`jzero.planning.compiled.default_cache_dir`).
    progress: called with one line per compile, before and after it (the CLI prints them).

  Raises:
    ConfigError: an unknown GPU, a nonsense size, batch or budget (one paragraph naming the flag).
  """
  for flag, value in (("--devices", devices), ("--nodes", nodes)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f"{flag} {value!r}: give a positive whole number, e.g. {flag} 8.")
  if not 0 <= margin < 1:
    raise ConfigError(f"--margin {margin}: give the share of memory left free, in [0, 1).")
  if precision not in ("bf16", "fp16", "fp32"):
    raise ConfigError(f"--precision {precision!r}: give bf16, fp16 or fp32.")
  if not time_budget > 0:
    raise ConfigError(f"--time-budget {time_budget}: give the seconds of compiling the search may "
                      f"spend, more than 0 (default {DEFAULT_TIME_BUDGET:g}).")
  if compile_top < 0:
    raise ConfigError(f"--compile-top {compile_top}: give 0 or more candidates to compile.")
  target = "cpu" if gpu is None else gpu
  if tpu is not None and hardware is None:  # a TPU slice: compiled as "tpu:<generation>:<grid>"
    hardware = tpu_hardware(tpu, topology or "", slices, host_memory=host_memory,
                            nvme_bytes=nvme_bytes, nvme_bandwidth=nvme_bandwidth,
                            memory_fraction=1.0 if mem_fraction == DEFAULT_MEM_FRACTION
                            else mem_fraction)
    target = f"tpu:{tpu}:{topology}"
  if hardware is None:
    if gpu is None:
      raise ConfigError("plan_for(gpu=None) plans for this machine's CPU devices: pass "
                        "hardware=jzero.planning.cost.cpu_hardware(devices).")
    hardware = gpu_hardware(gpu, devices, nodes, precision=precision, host_memory=host_memory,
                            nvme_bytes=nvme_bytes, nvme_bandwidth=nvme_bandwidth,
                            memory_fraction=mem_fraction)
  gpt = _model(model)
  n = hardware.devices
  job = Job(gpt, global_batch or 4 * n, precision,
            **({} if base_config is None else {"base_config": base_config}))
  leaves, act_bytes = _leaves(gpt), activation_bytes_of(gpt, precision)
  priced = []
  narrow = dict(stages=stages, micro_batches=micro_batches, offload_tiers=offload_tiers,
                checkpointing=checkpointing, host_sum_in_loop=not target.startswith("tpu:"))
  for cand in candidates(job, n, hardware.nodes, **narrow):
    e = estimated(cand, job, hardware, leaves, act_bytes)
    problem = _fit_problem(e.device_bytes, e.host_bytes, e.nvme_bytes, hardware, margin,
                           "estimate")
    priced.append((cand, e, problem, predict(e.resources, hardware)))
  queue = sorted((p for p in priced if not p[2]), key=_order)
  shortfall = not queue and bool(priced)
  if shortfall:  # none predicted to fit: the smallest, compiled, gives the shortfall its number
    queue = sorted(priced, key=lambda p: ("host" in p[2] or "NVMe" in p[2], p[1].device_bytes))
  compiled, log = _compile_in_order(queue, job, hardware, target, gpt, margin, compile,
                                    compile_top, time_budget, cache_dir, progress, shortfall)
  if shortfall and log.stop == "exhausted":
    log = dataclasses.replace(log, stop="shortfall")
  compiling = compile and compile_top > 0
  rows = [_row(cand, e, problem, pred, compiled.get(_twin_key(cand, job, hardware, target)),
               job, hardware, target, margin, compiling) for cand, e, problem, pred in priced]
  order = {"fits": 0, "not compiled": 1, "too big": 2, "compile failed": 3, "pruned": 4}
  rows.sort(key=lambda r: (order[r.status], round(r.prediction.seconds, 9),
                           sum(r.prediction.terms.values()), r.device_bytes))
  untried = sum(r.status == "not compiled" for r in rows)
  log = dataclasses.replace(log, untried=untried)
  helps = None
  if not any(r.status in ("fits", "not compiled") for r in rows):
    helps = remedies(job, hardware, margin, leaves, act_bytes,
                     nodes="slices" if target.startswith("tpu:") else "nodes", **narrow)
  return Plan(job=job, hardware=hardware, target=target, margin=margin, rows=rows, search=log,
              remedies=helps)


def remedies(job: Job, hw: Hardware, margin: float, leaves: list, act_bytes: int,
             nodes: str = "nodes", **narrow: Any) -> tuple[str, ...]:
  """What would make a candidate of ``job`` fit where none does, each checked by the same
  arithmetic the search prices with (the plan's closing hint says these and nothing else): more
  host memory or NVMe per node (the least that lets a candidate whose device bytes fit), both,
  more nodes of this kind (up to :data:`MORE_NODES` times; the sequences per device kept), or a
  global batch of one sequence per device. ``nodes``: what a node is called ("slices" for a TPU
  target, whose flag is ``--slices``); ``narrow``: :func:`candidates`' filters."""
  from jzero.analysis.tables import format_bytes as fb  # noqa: PLC0415

  def price(j: Job, h: Hardware) -> list[tuple[Candidate, Estimated]]:
    micro = narrow["micro_batches"]
    if micro is not None and (j.global_batch // h.devices) % max(micro):
      micro = None
    return [(c, estimated(c, j, h, leaves, act_bytes))
            for c in candidates(j, h.devices, h.nodes, **{**narrow, "micro_batches": micro})]

  def fitting(j: Job, h: Hardware) -> list[Candidate]:
    return [c for c, e in price(j, h)
            if not _fit_problem(e.device_bytes, e.host_bytes, e.nvme_bytes, h, margin, "")]

  usable = hw.usable_device_memory * (1 - margin)
  host_cap, nvme_cap = (hw.host_memory.value * (1 - margin), hw.nvme_bytes.value * (1 - margin))
  priced = price(job, hw)
  on_device = [(c, e) for c, e in priced if e.device_bytes <= usable]
  out = []
  need = lambda nbytes: fb(nbytes / (1 - margin))  # noqa: E731 -- the budget before the margin
  host_only = [(c, e) for c, e in on_device if e.nvme_bytes <= nvme_cap]
  if host_only:
    c, e = min(host_only, key=lambda ce: ce[1].host_bytes)
    out.append(f"{need(e.host_bytes)} of host memory per node (--host-memory): {c.name}")
  nvme_only = [(c, e) for c, e in on_device if e.host_bytes <= host_cap]
  if nvme_only:
    c, e = min(nvme_only, key=lambda ce: ce[1].nvme_bytes)
    out.append(f"{need(e.nvme_bytes)} of NVMe per node (--nvme): {c.name}")
  if on_device and not host_only and not nvme_only:
    c, e = min(on_device, key=lambda ce: (ce[1].host_bytes, ce[1].nvme_bytes))
    out.append(f"{need(e.host_bytes)} of host memory and {need(e.nvme_bytes)} of NVMe per node: "
               f"{c.name}")
  if job.global_batch > hw.devices:
    small = fitting(dataclasses.replace(job, global_batch=hw.devices), hw)
    if small:
      out.append(f"a global batch of {hw.devices}, one sequence per device (--global-batch): "
                 f"{small[0].name}")
  per_device, count = job.global_batch // hw.devices, hw.nodes * 2
  while count <= hw.nodes * MORE_NODES:
    more = dataclasses.replace(hw, nodes=count)
    fits = fitting(dataclasses.replace(job, global_batch=per_device * more.devices), more)
    if fits:
      out.append(f"{count} {nodes} of this kind ({more.devices} devices, --{nodes}): "
                 f"{fits[0].name}")
      break
    count *= 2
  return tuple(out)


def _twin_key(cand: Candidate, job: Job, hw: Hardware, target: str) -> str:
  """Candidates with the same key compile to the same device program."""
  config = cand.deepspeed_config(job, hw.devices, devices_per_node=hw.devices_per_node)
  return json.dumps(program_config(config, target), sort_keys=True)


def _as_is(cand: Candidate, job: Job, hw: Hardware, target: str) -> bool:
  """The target compiles the candidate's own config, offload included (not its device twin)."""
  config = cand.deepspeed_config(job, hw.devices, devices_per_node=hw.devices_per_node)
  return program_config(config, target) is config


def _compile_in_order(queue: list, job: Job, hw: Hardware, target: str, gpt: Any, margin: float,
                      compile: bool, compile_top: int, time_budget: float,
                      cache_dir: str | Path | None, progress: Callable[[str], Any] | None,
                      shortfall: bool = False) -> tuple[dict, SearchLog]:
  """Compiles ``queue`` (candidates predicted to fit, least predicted time first) until one fits
  by its compile and ``compile_top`` were compiled, or ``time_budget`` seconds are spent; with
  ``shortfall`` (none predicted to fit, the queue smallest first) until one compiles."""
  from jzero.analysis.tables import format_bytes  # noqa: PLC0415

  say = progress or (lambda _: None)
  compiled: dict[str, Compiled] = {}
  if not compile or compile_top == 0:
    return compiled, SearchLog(0, 0, 0.0, "arithmetic", time_budget, 0)
  t0, proven, stop = time.perf_counter(), False, "exhausted"
  for cand, e, _, pred in queue:
    if proven and len(compiled) >= compile_top:
      stop = "proven"
      break
    key = _twin_key(cand, job, hw, target)
    if key not in compiled:
      if time.perf_counter() - t0 >= time_budget:
        stop = "budget"
        break
      say(f"compiling {len(compiled) + 1}: {cand.name} (predicted {pred.seconds:.4g} s, "
          f"estimate {format_bytes(e.device_bytes)} per device)")
      config = cand.deepspeed_config(job, hw.devices, devices_per_node=hw.devices_per_node)
      try:
        compiled[key] = compile_candidate(config, target, hw.devices, hw.nodes, gpt,
                                          cache_dir=cache_dir,
                                          memory_fraction=hw.memory_fraction.value)
      except Exception as err:  # noqa: BLE001 -- XLA refusing one program ends no search
        compiled[key] = CompileFailure(_first_line(err), isinstance(err, JZeroError))
    c = compiled[key]
    if isinstance(c, CompileFailure):
      say(f"  {cand.name}: compile failed ({c.error})")
      continue
    device, how = _compiled_device(e, c, _as_is(cand, job, hw, target))
    fits = not _fit_problem(device, e.host_bytes, e.nvme_bytes, hw, margin, how)
    say(f"  {cand.name}: {format_bytes(device)} ({how}{', cached' if c.cached else ''}) -> "
        f"{'fits' if fits else 'too big'}")
    proven = proven or fits
    if shortfall:
      break
  cached = sum(getattr(c, "cached", False) for c in compiled.values())
  return compiled, SearchLog(len(compiled), cached, time.perf_counter() - t0, stop, time_budget,
                             0)


@dataclasses.dataclass(frozen=True)
class CompileFailure:
  """A candidate's device program XLA did not compile, or jzero refused to build (its error's
  first line)."""

  error: str
  refused: bool = False  # jzero refused the config (a JZeroError), before XLA saw a program

  @property
  def reason(self) -> str:
    return f"{'jzero refused its config' if self.refused else 'XLA did not compile it'}: {self.error}"


def _first_line(err: BaseException) -> str:
  """The error's first line (with the next one when the first only introduces it), at most 160
  characters."""
  text = [line.strip() for line in str(err).strip().splitlines()]
  line = text[0] if text else type(err).__name__
  if line.endswith(":") and len(text) > 1:
    line = f"{line} {text[1]}"
  return line if len(line) <= 160 else line[:157] + "..."


def _row(cand: Candidate, e: Estimated, problem: str, pred: Prediction,
         c: Compiled | CompileFailure | None, job: Job, hw: Hardware, target: str, margin: float,
         compiling: bool) -> Row:
  """A candidate's row; without compiling, one predicted to fit "fits" by its estimate."""
  if isinstance(c, CompileFailure):
    reason = "; ".join(filter(None, [problem, c.reason]))
    return Row(cand, "compile failed", reason, e.device_bytes, e.host_bytes,
               e.nvme_bytes, e.resources, pred, estimate_bytes=e.device_bytes,
               parts=e.memory.parts())
  if c is None:
    status = "pruned" if problem else ("not compiled" if compiling else "fits")
    return Row(cand, status, problem, e.device_bytes, e.host_bytes, e.nvme_bytes, e.resources,
               pred, estimate_bytes=e.device_bytes, parts=e.memory.parts())
  device, how = _compiled_device(e, c, _as_is(cand, job, hw, target))
  problem = _fit_problem(device, e.host_bytes, e.nvme_bytes, hw, margin, how)
  resources = _with_compiled(e, c)
  return Row(cand, "too big" if problem else "fits", problem, device, e.host_bytes, e.nvme_bytes,
             resources, predict(resources, hw), c, estimate_bytes=e.device_bytes,
             device_from=how, parts=e.memory.parts())
