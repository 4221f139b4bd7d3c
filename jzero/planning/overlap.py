"""ZeRO-3's overlap where memory is tight: ``"auto"`` resolved by compiling, and what each knob
would give -- for :func:`jzero.planning.aot.compile_for`.

DeepSpeed's knobs and what XLA schedules from them (:mod:`jzero.comm.program`,
:func:`jzero.modeling.gather_units.prefetches`):

* ``overlap_comm``: collectives asynchronous, the latency-hiding scheduler on, and its memory
  limit at the whole pool less the resident state (XLA's own is 95% of that): the scheduler runs
  a collective synchronously only when the memory the step has is used up.
* ``stage3_prefetch_bucket_size`` > 0: XLA's collective pipeliner gathers the next layer during
  this one (one layer ahead, never more); the bucket is the all-gather combiner's threshold.
* ``stage3_max_live_parameters``: the gathered parameters alive at once -- two of the largest
  group with prefetch, one without. A cap below two groups turns the prefetch off. ``"auto"``
  chooses the most overlap that fits: when the step with the prefetch does not fit the usable
  memory, or overlaps less than :data:`ADVISE_BELOW` of its bytes, it is compiled again without
  and the better one is taken -- the one that fits, then the one that overlaps more (one
  gathered layer less leaves the scheduler that much more room: the 13.3B shape on 8 A100-40GB
  at micro-batch 1 x 4 overlaps 10% of its bytes with the prefetch and 100% without, at 40.1 and
  40.05 GB). The choice is printed with the number that makes it without "auto"; at train time
  ``"auto"`` prefetches (:func:`jzero.modeling.gather_units.prefetches`).
* ``stage3_max_reuse_distance``: no effect -- jzero keeps no gathered parameter for reuse; every
  layer is gathered again in backward (the config check says so when it is set).

With ``advise``, a step that overlaps less than :data:`ADVISE_BELOW` of its bytes is compiled again
once per knob that could raise it -- the scheduler's memory limit lifted (what a larger pool,
``XLA_PYTHON_CLIENT_MEM_FRACTION`` on the GPU, gives), the prefetch off, or on -- and the report
lists each with its overlap, inside the accumulation loop and over the step, and its peak.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from jzero.analysis.tables import format_bytes
from jzero.planning import loop_overlap
from jzero.planning.aot_report import Advice, AotReport

__all__ = ["ADVISE_BELOW", "LIFTED_SLOP", "compile_resolved"]

ADVISE_BELOW = 0.9  # advise when less than this share of the bytes sent overlaps compute
LIFTED_SLOP = 10_000  # a slop factor that puts the scheduler's limit beyond any part's memory
_MAX_LIVE = "stage3_max_live_parameters"


def compile_resolved(compile_once: Callable[..., AotReport], target: Any, data: dict[str, Any],
                     *, advise: bool = False) -> AotReport:
  """The step of config ``data`` compiled for ``target`` by ``compile_once`` (one compile:
  :func:`jzero.planning.aot.compile_once`) with its ``"auto"`` prefetch resolved (module
  docstring), and with ``advise`` the knobs that would raise its overlap."""
  report = compile_once(target, data)
  choices: list[str] = []
  toggled = None  # the step compiled with the prefetch the other way, when "auto" did
  if _zero(data).get(_MAX_LIVE) == "auto" and report.prefetch and (
      not report.fits or report.overlap_fraction < ADVISE_BELOW):
    target.say(f'{_MAX_LIVE} "auto": compiling the step without the prefetch too')
    without_data = _without_prefetch(data, report)
    without = compile_once(target, without_data)
    if _preferred(without, report):
      choices.append(f'{_MAX_LIVE} "auto": no prefetch (set it to {_one_layer(report)} for the '
                     f"same step) -- with the prefetch {_outcome(report)}; without, "
                     f"{_outcome(without)}")
      report, toggled, data = without, report, without_data
    else:
      choices.append(f'{_MAX_LIVE} "auto": prefetch -- with it {_outcome(report)}; without, '
                     f"{_outcome(without)}")
      toggled = without
  advice: list[Advice] = []
  if advise and report.overlap_fraction < ADVISE_BELOW:
    advice = _advise(compile_once, target, data, report, toggled)
  return dataclasses.replace(report, choices=tuple(choices), advice=tuple(advice))


def _preferred(a: AotReport, b: AotReport) -> bool:
  """``a`` is the better step: it fits where ``b`` does not, or both fit (or neither) and it
  overlaps more of its bytes (or, neither fitting, peaks lower)."""
  if a.fits != b.fits:
    return a.fits
  if not a.fits:
    return a.peak < b.peak
  return a.overlap_fraction > b.overlap_fraction


def _outcome(r: AotReport) -> str:
  return (f"{r.overlap_fraction:.1%} overlapped at a peak of {format_bytes(r.peak)} "
          f"({'within' if r.fits else 'over'} the {format_bytes(r.usable_memory)} usable)")


def _one_layer(r: AotReport) -> int:
  """Parameters of the largest group gathered at once (one layer)."""
  return r.largest_gathered // (4 if r.precision == "fp32" else 2)


def _zero(data: dict[str, Any]) -> dict[str, Any]:
  return data.get("zero_optimization") or {}


def _with_zero(data: dict[str, Any], **zero: Any) -> dict[str, Any]:
  out = copy.deepcopy(data)
  out["zero_optimization"] = dict(_zero(out), **zero)
  return out


def _without_prefetch(data: dict[str, Any], report: AotReport) -> dict[str, Any]:
  """``data`` with ``stage3_max_live_parameters`` holding one largest group: no prefetch."""
  return _with_zero(data, **{_MAX_LIVE: _one_layer(report)})


def _advise(compile_once: Callable[..., AotReport], target: Any, data: dict[str, Any],
            report: AotReport, toggled: AotReport | None = None) -> list[Advice]:
  """Each knob that could raise ``report``'s overlap, compiled (module docstring); ``toggled``:
  the step with the prefetch the other way, when it was compiled already."""
  if report.stage != 3 or not report.xla_options.get("xla_gpu_enable_latency_hiding_scheduler"):
    return []
  whats = [("a larger memory pool (XLA_PYTHON_CLIENT_MEM_FRACTION on the GPU, --mem-fraction "
            "here): the scheduler's limit lifted",
            f"the latency-hiding scheduler plans within {format_bytes(report.scheduler_limit)}; "
            f"over it, it runs collectives synchronously",
            lambda: compile_once(target, data, slop=LIFTED_SLOP))]
  layer = _one_layer(report)
  if report.prefetch:
    whats.append((f"{_MAX_LIVE}: {layer} (one layer): no prefetch",
                  "one gathered layer less alive, so the scheduler has that much more room",
                  lambda: toggled or compile_once(target, _without_prefetch(data, report))))
  elif _zero(data).get("stage3_prefetch_bucket_size", 1) != 0:
    whats.append((f"{_MAX_LIVE}: {2 * layer} (two layers) or \"auto\": prefetch",
                  "the next layer is gathered while this one computes",
                  lambda: toggled or compile_once(target,
                                                  _with_zero(data, **{_MAX_LIVE: 2 * layer}))))
  out = []
  for knob, why, build in whats:
    target.say(f"advice: compiling with {knob}")
    other = build()
    shares = loop_overlap.breakdown(other.collectives, other.gradient_accumulation_steps)
    out.append(Advice(knob=knob, why=why, overlap=other.overlap_fraction,
                      in_loop_overlap=loop_overlap.place_overlap(shares, loop_overlap.IN_LOOP),
                      peak=other.peak, fits=other.fits))
  return out
