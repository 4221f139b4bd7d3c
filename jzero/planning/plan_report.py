"""``jzero plan``'s output: the budget, how the search went, one line per ZeRO stage, the table of
every candidate, the constants with their sources, the chosen config and one paragraph on why it
beat the runner-up -- as text, HTML and JSON.

Times are predictions of the cost model (:mod:`jzero.planning.cost`), labelled so. Bytes are
per device (device memory, collectives, PCIe) or per node (host memory, NVMe), GB = 1e9 bytes.
Every device figure is measured against the one usable figure the head states
(:attr:`jzero.planning.search.Plan.usable`); each compiled row shows the estimate over the
compiled figure beside it (``est/compiled``) and where its device bytes come from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jzero.analysis.tables import format_bytes, format_count, html_table, text_table
from jzero.planning.cost import MEM_FRACTION_ENV, describe_constants

__all__ = ["plan_rows", "format_plan", "html_plan", "plan_json", "why_chosen", "stage_lines",
           "budget_line", "search_line", "estimate_command", "HEADER"]

HEADER = ["#", "candidate", "status", "device/dev", "est/compiled", "device from", "host/node",
          "NVMe/node", "intra-node/dev", "inter-node/dev", "PCIe/dev", "FLOPs/dev", "overlap",
          "predicted s", "bound"]


def _b(x: float) -> str:
  return format_bytes(x) if x else "-"


def plan_rows(plan: Any) -> list[list[str]]:
  """One row of strings per candidate, ranked ones first (:data:`HEADER`)."""
  rows = []
  for i, r in enumerate(plan.rows, 1):
    res = r.resources
    status = r.status if not r.reason else f"{r.status}: {r.reason}"
    ratio = r.estimate_ratio
    rows.append([str(i), r.name, status, _b(r.device_bytes),
                 "-" if ratio is None else f"{ratio:.2f}", r.device_from, _b(r.host_bytes),
                 _b(r.nvme_bytes), _b(res.intra_node_bytes), _b(res.inter_node_bytes),
                 _b(res.pcie_bytes), format_count(res.flops), _overlap(r),
                 f"{r.prediction.seconds:.4g}", r.prediction.bound, res.source])
  return rows


def _overlap(row: Any) -> str:
  """The share of the collective bytes overlapped, and inside the accumulation loop when the
  compiled step has one (:mod:`jzero.planning.loop_overlap`)."""
  loop = getattr(row.compiled, "loop_overlap", None)
  return f"{row.resources.overlap:.0%}" + ("" if loop is None else f" (loop {loop:.0%})")


def budget_line(plan: Any) -> str:
  """The usable figure every row is measured against, and how it is made."""
  hw = plan.hardware
  fraction = hw.memory_fraction
  return (f"usable per device: {format_bytes(plan.usable)} = {format_bytes(hw.device_memory.value)}"
          f" x {fraction.value:.2f} ({fraction.source}) x (1 - {plan.margin:.0%} margin); per "
          f"node: host "
          f"{format_bytes(hw.host_memory.value * (1 - plan.margin))}, NVMe "
          f"{format_bytes(hw.nvme_bytes.value * (1 - plan.margin))} (less the margin)")


def search_line(plan: Any) -> str:
  """What the search compiled and why it stopped."""
  s = plan.search
  if s is None or s.stop == "arithmetic":
    return ("search: arithmetic alone (--compile-top 0): candidates within the budget 'fit' by "
            "their estimates, none was compiled")
  how = {"proven": "stopped at the first candidate proven to fit by its compile, the fastest "
                   "the arithmetic predicted to fit (uncompiled rows keep the arithmetic's time, "
                   "which leaves out most non-matmul memory traffic a compile counts; "
                   "--compile-top N compiles more)",
         "exhausted": "every candidate predicted to fit was compiled",
         "shortfall": "none was predicted to fit; the one with the fewest device bytes was "
                      "compiled, to measure its shortfall",
         "budget": f"STOPPED: the time budget ({s.time_budget:g} s) ran out"}[s.stop]
  return (f"search: {s.compiled} device program{'s' * (s.compiled != 1)} compiled ({s.cached} "
          f"from the cache) in {s.seconds:.0f} s, least predicted time first; {how}; {s.untried} "
          f"candidate{'s' * (s.untried != 1)} predicted to fit left uncompiled")


def stage_lines(plan: Any) -> list[str]:
  """One line per ZeRO stage: its best candidate and the bytes that decide whether it fits."""
  out = []
  for stage in sorted({r.candidate.stage for r in plan.rows}):
    rows = [r for r in plan.rows if r.candidate.stage == stage]
    label = "DDP (stage 0)" if stage == 0 else f"ZeRO-{stage}"
    fits = [r for r in rows if r.status == "fits"]
    untried = [r for r in rows if r.status == "not compiled"]
    if fits:
      r = fits[0]
      out.append(f"  {label}: fits -- {r.name}, {format_bytes(r.device_bytes)} per device "
                 f"({r.device_from}), predicted {r.prediction.seconds:.4g} s")
    elif untried:
      r = untried[0]
      out.append(f"  {label}: predicted to fit, not compiled -- {r.name}, "
                 f"{format_bytes(r.device_bytes)} per device (estimate)")
    else:
      compiled = [r for r in rows if r.status == "too big"]  # a compiled figure, where there is
      r = min(compiled or rows, key=lambda r: ("host" in r.reason or "NVMe" in r.reason,
                                               r.estimate_bytes, r.host_bytes, r.nvme_bytes))
      big = sorted(r.parts.items(), key=lambda kv: -kv[1])[:3]
      most = ", ".join(f"{k} {format_bytes(v)}" for k, v in big)
      out.append(f"  {label}: does not fit -- its smallest{'' if compiled else ' by estimate'}, "
                 f"{r.name}: {r.reason}"
                 + (f" (largest parts: {most})" if most and "device" in r.reason else ""))
  return out


def _seconds_terms(row: Any) -> str:
  return ", ".join(f"{k} {v:.3g} s" for k, v in row.prediction.terms.items() if v)


def why_chosen(plan: Any) -> str:
  """One paragraph: why the chosen candidate beat the runner-up, term by term (predictions)."""
  best, second = plan.chosen, plan.runner_up
  usable = format_bytes(plan.usable)
  if best is None:
    untried = [r for r in plan.rows if r.status == "not compiled"]
    if untried:
      return (f"No candidate was proven to fit before the time budget ran out: {len(untried)} "
              f"predicted to fit were not compiled, the fastest {untried[0].name} "
              f"({format_bytes(untried[0].device_bytes)} per device by estimate, of {usable} "
              f"usable). Raise --time-budget.")
    head = (f"Nothing fits: every candidate is pruned or over memory ({usable} usable per "
            f"device), each with its numbers in the table and the line per stage above.")
    return f"{head} {plan.what_would_help}"
  if second is None:
    return (f"{best.name} is the only candidate that fits: {format_bytes(best.device_bytes)} of "
            f"{usable} usable per device; predicted {best.prediction.seconds:.4g} s.")
  parts_b, parts_s = _parts(best), _parts(second)
  diffs = {k: parts_s[k] - v for k, v in parts_b.items()}
  part = max(diffs, key=lambda k: abs(diffs[k]))
  tied = best.prediction.seconds >= 0.999 * second.prediction.seconds
  compiled = second.status == "fits"
  verdict = ("ties with" if tied else "beat") + f" the runner-up {second.name}"
  if not compiled:
    verdict += " (predicted to fit by arithmetic, not compiled)"
  return (f"{best.name} {verdict}: predicted {best.prediction.seconds:.4g} s against "
          f"{second.prediction.seconds:.4g} s per step (predictions of the cost model, not "
          f"measurements{'' if compiled else '; the runner-up by arithmetic alone'})"
          f"{'; the tie goes to less work over all terms' if tied else ''}. The "
          f"largest difference is {part}: {diffs[part]:+.3g} s for the runner-up. Per device, the "
          f"chosen moves {_moves(best.resources)}; the runner-up {_moves(second.resources)}. "
          f"Terms of the chosen: {_seconds_terms(best)}; of the runner-up: "
          f"{_seconds_terms(second)}. Device bytes: {format_bytes(best.device_bytes)} "
          f"({best.device_from}) and {format_bytes(second.device_bytes)} ({second.device_from}) "
          f"of {usable} usable.")


def _moves(r: Any) -> str:
  return (f"{format_count(r.flops)} FLOPs, {format_bytes(r.intra_node_bytes + r.inter_node_bytes)}"
          f" of collectives ({r.overlap:.0%} overlapped), {format_bytes(r.pcie_bytes)} over PCIe")


def _parts(row: Any) -> dict[str, float]:
  """A predicted step in the parts it adds up from (:func:`jzero.planning.cost.predict`)."""
  t, overlap = row.prediction.terms, row.resources.overlap
  return {"compute with the collectives it hides": max(t["compute"], overlap * t["network"]),
          "exposed collectives": (1 - overlap) * t["network"],
          "offload streams": max(t["pcie"], t["host"], t["nvme"])}


def _head(plan: Any) -> list[str]:
  hw, job = plan.hardware, plan.job
  m = job.model
  counts: dict[str, int] = {}
  for r in plan.rows:
    counts[r.status] = counts.get(r.status, 0) + 1
  lines = [f"jzero plan: {hw.name}; GPT {format_count(m.num_params())} params ({m.n_layers} layers "
           f"x d {m.d_model}, seq {m.seq_len}), {job.precision}, global batch {job.global_batch} "
           f"sequences",
           budget_line(plan), search_line(plan),
           "  " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(plan.rows)} "
           f"candidates", "by stage (why the cheaper ones do not fit):", *stage_lines(plan),
           "constants of the cost model (jzero/planning/cost.py):"]
  lines += [f"  {name} = {value}  [{source}]" for name, value, source in describe_constants(hw)]
  return lines


def format_plan(plan: Any, limit: int | None = None) -> str:
  """The plan as text: the head, the constants, the table (first ``limit`` rows), the choice."""
  rows = plan_rows(plan)
  shown = rows if limit is None else rows[:limit]
  lines = _head(plan) + ["", "candidates (times are PREDICTIONS; bytes per step):",
                         text_table(HEADER, shown, indent="  ")]
  if len(shown) < len(rows):
    lines.append(f"  ... {len(rows) - len(shown)} more (--all shows them)")
  lines += ["", f"chosen: {plan.chosen.name if plan.chosen else 'none'}", why_chosen(plan)]
  command = estimate_command(plan)
  if command:
    lines += [f"the same configuration by the estimator (its step's peak per device): {command}"]
  return "\n".join(lines)


def estimate_command(plan: Any, row: Any = None) -> str | None:
  """The ``jzero estimate`` command that prices ``row`` (default: the chosen one) with the same
  memory model -- model states by tier, the step's peak per device, host bytes per node -- or
  None where its flags cannot say the row (a GPT shape other than the default model's kind, a
  qwZ candidate)."""
  from jzero.planning.candidates import _BUFFER_COUNT, param_buffer_size  # noqa: PLC0415

  row = row if row is not None else plan.chosen
  m, job, hw = plan.job.model, plan.job, plan.hardware
  plain = (m.mlp_dim is None and m.mlp_ratio == 4 and not m.gated_mlp and m.tie_embeddings
           and not m.lora_rank)
  if row is None or not plain or row.candidate.quantized_weights:
    return None
  c = row.candidate
  flags = [f"--model default --layers {m.n_layers} --hidden {m.d_model} --heads {m.n_heads} "
           f"--seq-len {m.seq_len} --vocab-size {m.vocab_size}",
           f"--devices {hw.devices_per_node} --nodes {hw.nodes} --precision {job.precision} "
           f"--stage {c.stage}"]
  if c.offload_optimizer:
    flags.append(f"--offload-optimizer {c.offload_optimizer}"
                 + (f" --offload-update {c.offload_update}" if c.offload_update else ""))
  if c.offload_param:
    flags.append(f"--offload-param {c.offload_param}")
    if c.offload_param == "nvme":
      flags.append(f"--buffer-count {_BUFFER_COUNT} "
                   f"--buffer-size {param_buffer_size(m, hw.devices)} --max-in-cpu 1000000000")
  if "hpz" in c.zeropp:
    flags.append(f"--hpz {hw.devices_per_node}")
  flags.append(f"--micro-batch {c.micro_batch} --gradient-accumulation {c.gradient_accumulation}")
  flags += {"block": ["--checkpoint-activations"], "offload": ["--cpu-checkpointing"]}.get(
      c.checkpointing, [])
  return "jzero estimate " + " ".join(flags)


def html_plan(plan: Any) -> str:
  return html_table(HEADER, plan_rows(plan), caption="\n".join(_head(plan)),
                    notes=[why_chosen(plan)])


def plan_json(plan: Any) -> dict[str, Any]:
  """Everything the table shows, as plain data (what the notebook plots)."""
  hw = plan.hardware
  return {
      "hardware": hw.name, "target": plan.target, "margin": plan.margin,
      "mem_fraction": hw.memory_fraction.value, "mem_fraction_env": MEM_FRACTION_ENV,
      "usable_device_bytes": plan.usable,
      "search": dataclasses.asdict(plan.search) if plan.search else None,
      "stages": stage_lines(plan),
      "constants": {n: {"value": c.value, "source": c.source} for n, c in hw.constants().items()},
      "model": dataclasses.asdict(plan.job.model), "num_params": plan.job.model.num_params(),
      "global_batch": plan.job.global_batch, "precision": plan.job.precision,
      "chosen": plan.chosen.name if plan.chosen else None, "why": why_chosen(plan),
      "rows": [{"name": r.name, "candidate": dataclasses.asdict(r.candidate), "status": r.status,
                "reason": r.reason, "device_bytes": r.device_bytes,
                "estimate_bytes": r.estimate_bytes, "device_from": r.device_from,
                "host_bytes": r.host_bytes, "nvme_bytes": r.nvme_bytes,
                "resources": dataclasses.asdict(r.resources), "predicted_s": r.prediction.seconds,
                "terms": r.prediction.terms, "bound": r.prediction.bound,
                "compile_s": r.compiled.compile_s if r.compiled else None,
                "loop_overlap": getattr(r.compiled, "loop_overlap", None)}
               for r in plan.rows]}
