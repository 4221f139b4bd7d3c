"""What :func:`jzero.planning.aot.compile_for` answers: :class:`AotReport`, and its table.

Per device: the model-state bytes by kind as the plan lays them out, the estimator's prediction,
XLA's ``memory_analysis()``, whether the peak fits the part's memory, the compile times and every
collective of the scheduled program with its overlap (:mod:`jzero.planning.aot` says how each is
read). :func:`report_parts` lays the report out as lines and tables, which :func:`format_report`
prints and a notebook renders as HTML.
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Any

from jzero.analysis.hlo import Collective
from jzero.analysis.tables import (format_bytes, format_count, html_table, require_pyplot,
                                    text_table)

__all__ = ["Advice", "AotReport", "report_parts", "format_report", "format_overlap",
           "STATE_KINDS"]

STATE_KINDS = ("params", "grads", "master", "optimizer")


@dataclasses.dataclass(frozen=True)
class Advice:
  """A knob that raises the step's overlap, and what the step compiled with it gives and costs.

  Attributes:
    knob: the setting, as the user writes it.
    why: what it changes in XLA's schedule.
    overlap, in_loop_overlap: share of the bytes sent per step with compute in flight, over the
      step and inside the accumulation loop (nan: no loop).
    peak: the compiled peak per device with it; fits: within the usable memory.
  """

  knob: str
  why: str
  overlap: float
  in_loop_overlap: float
  peak: int
  fits: bool


@dataclasses.dataclass(frozen=True)
class AotReport:
  """What :func:`compile_for` found; per-device bytes throughout (see the module docstring).

  Attributes:
    gpu: the part's description; gpu_name: the --gpu name.
    devices, nodes: the topology; mesh: the mesh, described.
    stage, precision: from the config.
    model: the model, described; num_params: Ψ.
    micro_batch, gradient_accumulation_steps, checkpoint_activations: the step's shape.
    state: kind (params, grads, master, optimizer) -> bytes as the plan lays them out (grads in the
      compute dtype, as ZeRO counts them; they live only inside the step).
    estimate: kind -> bytes the estimator predicts, plus "activations" when it can estimate them.
    argument, output, temp, alias: XLA's ``memory_analysis()``.
    device_memory: the part's memory; memory_fraction: the part of it JAX may use.
    trace_s, lower_s, compile_s: wall times of tracing, lowering and XLA's GPU compile.
    collectives: every collective of the scheduled program.
    pallas_kernels: the Pallas kernel calls (Triton on a GPU, Mosaic on a TPU) in the compiled
      program -- ZeRO++'s int8 / int4 block kernels (``kernels/``); 0 without qwZ / qgZ.
    matmul_flops: FLOPs of the program's matrix multiplications per device per step, recompute
      included (:func:`jzero.analysis.hlo.matmul_flops`).
    memory_traffic: bytes its other instructions read and write per device per step
      (:func:`jzero.analysis.hlo.memory_traffic`).
    xla_options: the compile options the plan passed (bucket and overlap knobs).
    scheduler_limit: the bytes XLA's latency-hiding scheduler planned the step's temporaries
      within (:mod:`jzero.comm.program`: a run's pool less the step's inputs and outputs, times
      the slop factor); scheduler_slop: the slop factor the compile got to plan within it, for a
      part without its pool (:func:`jzero.comm.program.scheduler_slop_for`; 0: none).
    prefetch: stage 3 gathered the next layer while one computed (the plan's).
    largest_gathered: bytes of the largest group stage 3 gathers at once (a layer, or a unit).
    choices: what ``"auto"`` settings chose, and why (:mod:`jzero.planning.overlap`).
    advice: with less than 90% of the bytes overlapped, each knob that would raise it: the step
      compiled again with it (:class:`Advice`).
    step_estimate: the peak the arithmetic predicts for this step
      (:func:`jzero.analysis.step_memory.step_memory`; 0 for a model that is not the embedded
      GPT).
    platform: "gpu", or "tpu" for a TPU slice (then ``gpu`` names the chip, ``nodes`` counts the
      slices, and the Pallas kernels are Mosaic's).
    tile_padding, batch_bytes: on a TPU, the bytes its layout tiles add to the arguments
      (:func:`jzero.analysis.hlo.parameter_bytes`) and the batch's bytes per chip; 0 on a GPU.
    host_argument: on a TPU, XLA's arguments in host memory (``pinned_host`` offload: compiled
      with their memory kinds); 0 on a GPU, whose compile-only devices drop memory kinds.
  """

  gpu: str
  gpu_name: str
  devices: int
  nodes: int
  mesh: str
  stage: int
  precision: str
  model: str
  num_params: int
  micro_batch: int
  gradient_accumulation_steps: int
  checkpoint_activations: bool
  state: dict[str, int]
  estimate: dict[str, float]
  argument: int
  output: int
  temp: int
  alias: int
  device_memory: int
  memory_fraction: float
  trace_s: float
  lower_s: float
  compile_s: float
  collectives: list[Collective]
  xla_options: dict[str, Any]
  pallas_kernels: int = 0
  matmul_flops: float = 0.0
  memory_traffic: float = 0.0
  scheduler_limit: float = 0.0
  scheduler_slop: int = 0
  prefetch: bool = False
  largest_gathered: int = 0
  choices: tuple[str, ...] = ()
  advice: tuple[Advice, ...] = ()
  step_estimate: float = 0.0
  platform: str = "gpu"
  tile_padding: int = 0
  batch_bytes: int = 0
  host_argument: int = 0

  @property
  def state_arguments(self) -> int:
    """The step's arguments that are model state, as the plan counts bytes: XLA's arguments in
    device and host memory less the batch and what a TPU's tiles add."""
    return self.argument + self.host_argument - self.tile_padding - self.batch_bytes

  @property
  def kinds(self) -> tuple[str, ...]:
    """:data:`STATE_KINDS`, plus "secondary" with ZeRO++ hpZ."""
    return STATE_KINDS + (("secondary",) if "secondary" in self.state else ())

  @property
  def persistent_state(self) -> int:
    """Bytes of the state that lives across steps: params, fp32 master, optimizer state (and
    hpZ's secondary copy)."""
    return (self.state["params"] + self.state["master"] + self.state["optimizer"]
            + self.state.get("secondary", 0))

  @property
  def model_states(self) -> int:
    """ZeRO's model states: params, grads, master and optimizer state (and hpZ's secondary)."""
    return sum(self.state[k] for k in self.kinds)

  @property
  def peak(self) -> int:
    """argument + output + temp - alias (donated buffers reused for outputs count once)."""
    return self.argument + self.output + self.temp - self.alias

  @property
  def usable_memory(self) -> float:
    return self.device_memory * self.memory_fraction

  @property
  def fits(self) -> bool:
    return self.peak <= self.usable_memory

  @property
  def sent_bytes(self) -> float:
    """Bytes one device sends per step (ring algorithm, run counts through the loops)."""
    return sum(c.step_bytes for c in self.collectives)

  @property
  def overlapped_bytes(self) -> float:
    return sum(c.step_bytes for c in self.collectives if c.overlapped)

  @property
  def overlap_fraction(self) -> float:
    """Share of the bytes sent per step by collectives with compute in flight (nan: none sent)."""
    return self.overlapped_bytes / self.sent_bytes if self.sent_bytes else math.nan

  @property
  def matmul_overlap_fraction(self) -> float:
    """Share of the bytes sent per step by collectives with a matmul in flight (nan: none sent)."""
    hidden = sum(c.step_bytes for c in self.collectives if c.overlapped and c.overlapped_matmuls)
    return hidden / self.sent_bytes if self.sent_bytes else math.nan

  def __str__(self) -> str:
    return format_report(self)

  def _repr_html_(self) -> str:
    out = []
    for part in report_parts(self):
      if isinstance(part, str):
        out.append(f"<div>{html.escape(part)}</div>" if part else "")
      else:
        out.append(html_table(part[1], part[2], caption=part[0]))
    return "".join(out)

  def plot(self, ax: Any = None) -> Any:
    """Bars of the model state per kind (plan and estimator, GB) and lines for XLA's peak and the
    usable device memory. Returns the Axes."""
    plt = require_pyplot()
    if ax is None:
      _, ax = plt.subplots(figsize=(6, 3.2))
    kinds = list(self.kinds)
    xs = range(len(kinds))
    ax.bar([x - 0.2 for x in xs], [self.state[k] / 1e9 for k in kinds], 0.4, label="plan")
    ax.bar([x + 0.2 for x in xs], [self.estimate[k] / 1e9 for k in kinds], 0.4, label="estimator")
    ax.axhline(self.peak / 1e9, color="r", label="XLA peak")
    ax.axhline(self.usable_memory / 1e9, color="k", linestyle="--", label="usable memory")
    ax.set_xticks(list(xs), kinds)
    ax.set_ylabel("GB per device")
    ax.set_title(f"{self.devices} x {self.gpu_name}, ZeRO-{self.stage}, {self.model}",
                 fontsize="medium")
    ax.legend(fontsize="small")
    return ax

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable dict: the fields, the derived figures, and each collective."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["collectives"] = [dict(dataclasses.asdict(c), sent_bytes=c.sent_bytes,
                               step_bytes=c.step_bytes, overlapped=c.overlapped)
                          for c in self.collectives]
    nan_free = lambda x: None if isinstance(x, float) and math.isnan(x) else x  # noqa: E731
    out["advice"] = [{k: nan_free(v) for k, v in dataclasses.asdict(a).items()}
                     for a in self.advice]
    out["choices"] = list(self.choices)
    from jzero.planning import loop_overlap  # noqa: PLC0415

    out["loop_overlap"] = [dict(dataclasses.asdict(s), overlap=nan_free(s.overlap))
                           for s in loop_overlap.breakdown(self.collectives,
                                                           self.gradient_accumulation_steps)]
    for name in ("persistent_state", "model_states", "peak", "usable_memory", "fits",
                 "sent_bytes", "overlapped_bytes"):
      out[name] = getattr(self, name)
    for name in ("overlap_fraction", "matmul_overlap_fraction"):
      fraction = getattr(self, name)
      out[name] = None if math.isnan(fraction) else fraction
    return out


# -- the readable table ----------------------------------------------------------------------------
def _where(c: Collective) -> str:
  return "step" if c.count == 1 else f"loop x{c.count}"


def report_parts(r: AotReport) -> list[Any]:
  """The report as a list of parts: a line (str), or a table (caption, header, rows) -- what
  :func:`format_report` prints and a notebook renders (``AotReport._repr_html_``)."""
  gib = r.device_memory / 2**30
  parts: list[Any] = [
      f"jzero aot: {r.devices} x {r.gpu} ({gib:.2f} GiB each), ZeRO-{r.stage}, {r.precision}, "
      f"{r.model}, {format_count(r.num_params)} params",
      f"  mesh {r.mesh}; micro-batch {r.micro_batch} x gas {r.gradient_accumulation_steps}, "
      f"activation checkpointing {'on' if r.checkpoint_activations else 'off'}",
      f"  compile: trace {r.trace_s:.1f} s, lower {r.lower_s:.1f} s, XLA "
      f"{r.platform.upper()} compile {r.compile_s:.1f} s", ""]
  rows = [[k, format_bytes(r.state[k]), format_bytes(r.estimate[k])] for k in r.kinds]
  rows.append(["total", format_bytes(r.model_states),
               format_bytes(sum(r.estimate[k] for k in r.kinds))])
  if "activations" in r.estimate:
    rows.append(["activations", "-", format_bytes(r.estimate["activations"])])
  parts.append(("model state per device (grads: in the compute dtype, inside the step)",
                ["kind", "plan", "estimator"], rows))
  ratio = r.argument / r.persistent_state if r.persistent_state else math.nan
  parts += [""]
  if r.platform == "tpu":
    ratio = r.state_arguments / r.persistent_state if r.persistent_state else math.nan
    parts.append(f"model-state arguments {format_bytes(r.state_arguments)} (XLA's arguments "
                 f"{format_bytes(r.argument)} in HBM + {format_bytes(r.host_argument)} in host "
                 f"memory, less the batch {format_bytes(r.batch_bytes)} and "
                 f"the TPU tiles' padding {format_bytes(r.tile_padding)}) / the plan's params + "
                 f"master + optimizer {format_bytes(r.persistent_state)}: ratio {ratio:.4f}")
  parts += [f"XLA memory_analysis per device: arguments {format_bytes(r.argument)} (plan's "
            f"params + master + optimizer {format_bytes(r.persistent_state)}, ratio "
            f"{r.argument / r.persistent_state if r.persistent_state else math.nan:.4f}), "
            f"outputs {format_bytes(r.output)}, temp {format_bytes(r.temp)}, "
            f"aliased {format_bytes(r.alias)}; peak {format_bytes(r.peak)}",
            *([f"estimated peak (jzero.analysis.step_memory): {format_bytes(r.step_estimate)}, "
               f"estimate / compiled {r.step_estimate / r.peak:.2f}"] if r.step_estimate else []),
            f"fits: {'yes' if r.fits else 'NO'} -- peak {format_bytes(r.peak)} of "
            f"{format_bytes(r.usable_memory)} usable ({r.memory_fraction:.0%} of "
            f"{format_bytes(r.device_memory)})", ""]
  rows = []
  for c in r.collectives:
    rows.append([c.kind, "x".join(c.axes) or "-", _where(c), str(c.buffers),
                 format_bytes(c.full_bytes), format_bytes(c.step_bytes),
                 "async" if c.is_async else "sync",
                 f"{c.overlapped_ops} ({c.overlapped_matmuls} matmuls)" if c.overlapped else "no"])
  parts.append(("collectives of the scheduled program (bytes: full buffer per run, sent per "
                "device per step; overlapped: compute instructions in flight, of which matmuls)",
                ["collective", "axes", "runs", "buffers", "bytes/run", "sent/step", "mode",
                 "overlapped"], rows))
  pct = lambda x: "-" if math.isnan(x) else f"{x:.1%}"  # noqa: E731
  parts.append(f"overlapped with compute: {pct(r.overlap_fraction)} of "
               f"{format_bytes(r.sent_bytes)} sent per device per step "
               f"({pct(r.matmul_overlap_fraction)} with a matmul in flight)")
  parts += _overlap_parts(r)
  parts.append(f"Pallas kernels (ZeRO++ block quantization, "
               f"{'Triton' if r.platform == 'gpu' else 'Mosaic'}): {r.pallas_kernels} calls")
  return parts


def _overlap_parts(r: AotReport) -> list[Any]:
  """Where the bytes overlap (in the accumulation loop, outside it, per kind), the scheduler's
  memory limit, what "auto" chose, and the knobs that would raise the overlap."""
  from jzero.planning import loop_overlap  # noqa: PLC0415

  pct = lambda x: "-" if math.isnan(x) else f"{x:.1%}"  # noqa: E731
  shares = loop_overlap.breakdown(r.collectives, r.gradient_accumulation_steps)
  rows = [[s.where, s.kind, format_bytes(s.sent_bytes), pct(s.overlap),
           format_bytes(s.sync_bytes) if s.sync_bytes else "-"] for s in shares]
  parts: list[Any] = [("overlap by place and kind (sent per device per step)",
                       ["where", "collective", "sent/step", "overlapped", "sync"], rows)]
  if r.scheduler_limit:
    parts.append(f"XLA's latency-hiding scheduler planned within {format_bytes(r.scheduler_limit)}"
                 f" of temporaries (a run's pool, the usable memory, less the step's inputs and "
                 f"outputs, times the slop factor); prefetch {'on' if r.prefetch else 'off'}")
  parts += [f"auto: {c}" for c in r.choices]
  if r.advice:
    parts.append(("to raise the overlap, each knob compiled (overlap: over the step / in the "
                  "accumulation loop; peak per device)",
                  ["knob", "what it changes", "overlap", "in loop", "peak", "fits"],
                  [[a.knob, a.why, pct(a.overlap), pct(a.in_loop_overlap),
                    f"{format_bytes(a.peak)} ({'+' if a.peak >= r.peak else '-'}"
                    f"{format_bytes(abs(a.peak - r.peak))})", "yes" if a.fits else "NO"]
                   for a in r.advice]))
  return parts


def format_report(r: AotReport) -> str:
  """The report as text: memory by kind (plan vs estimator), XLA's analysis, fit, collectives."""
  return _text(report_parts(r))


def format_overlap(r: AotReport) -> str:
  """The overlap by place and kind, the scheduler's limit, "auto"'s choices and the advice, as
  text (what ``jzero plan`` prints for its chosen config)."""
  return _text(_overlap_parts(r))


def _text(parts: list[Any]) -> str:
  lines = []
  for part in parts:
    if isinstance(part, str):
      lines.append(part)
      continue
    caption, header, rows = part
    lines += [caption, text_table(header, rows, indent="  ") if rows else "  none"]
  return "\n".join(lines)
