"""``jzero plan``'s output: the table of every candidate, the constants with their sources, the
chosen config and one paragraph on why it beat the runner-up -- as text, HTML and JSON.

Times are predictions of the cost model (:mod:`jzero.planning.cost`), labelled so. Bytes are
per device (device memory, collectives, PCIe) or per node (host memory, NVMe), GB = 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jzero.analysis.tables import format_bytes, format_count, html_table, text_table
from jzero.planning.cost import describe_constants

__all__ = ["plan_rows", "format_plan", "html_plan", "plan_json", "why_chosen", "HEADER"]

HEADER = ["#", "candidate", "status", "device/dev", "host/node", "NVMe/node", "intra-node/dev",
          "inter-node/dev", "PCIe/dev", "FLOPs/dev", "overlap", "predicted s", "bound", "from"]


def _b(x: float) -> str:
  return format_bytes(x) if x else "-"


def plan_rows(plan: Any) -> list[list[str]]:
  """One row of strings per candidate, ranked ones first (:data:`HEADER`)."""
  rows = []
  for i, r in enumerate(plan.rows, 1):
    res = r.resources
    status = r.status if not r.reason else f"{r.status}: {r.reason}"
    rows.append([str(i), r.name, status, _b(r.device_bytes), _b(r.host_bytes), _b(r.nvme_bytes),
                 _b(res.intra_node_bytes), _b(res.inter_node_bytes), _b(res.pcie_bytes),
                 format_count(res.flops), _overlap(r), f"{r.prediction.seconds:.4g}",
                 r.prediction.bound, res.source])
  return rows


def _overlap(row: Any) -> str:
  """The share of the collective bytes overlapped, and inside the accumulation loop when the
  compiled step has one (:mod:`jzero.planning.loop_overlap`)."""
  loop = row.compiled.loop_overlap if row.compiled is not None else None
  return f"{row.resources.overlap:.0%}" + ("" if loop is None else f" (loop {loop:.0%})")


def _seconds_terms(row: Any) -> str:
  return ", ".join(f"{k} {v:.3g} s" for k, v in row.prediction.terms.items() if v)


def why_chosen(plan: Any) -> str:
  """One paragraph: why the chosen candidate beat the runner-up, term by term (predictions)."""
  best, second = plan.chosen, plan.runner_up
  if best is None:
    return ("Nothing fits: every candidate is pruned or over memory, each with its numbers in the "
            "table. More devices or nodes, host memory or NVMe, or a smaller batch would help.")
  if second is None:
    return (f"{best.name} is the only candidate that fits; predicted "
            f"{best.prediction.seconds:.4g} s.")
  parts_b, parts_s = _parts(best), _parts(second)
  diffs = {k: parts_s[k] - v for k, v in parts_b.items()}
  part = max(diffs, key=lambda k: abs(diffs[k]))
  tied = best.prediction.seconds >= 0.999 * second.prediction.seconds
  verdict = ("ties with" if tied else "beat") + f" the runner-up {second.name}"
  return (f"{best.name} {verdict}: predicted {best.prediction.seconds:.4g} s against "
          f"{second.prediction.seconds:.4g} s per step (predictions of the cost model, not "
          f"measurements){'; the tie goes to less work over all terms' if tied else ''}. The "
          f"largest difference is {part}: {diffs[part]:+.3g} s for the runner-up. Per device, the "
          f"chosen moves {_moves(best.resources)}; the runner-up {_moves(second.resources)}. "
          f"Terms of the chosen: {_seconds_terms(best)}; of the runner-up: "
          f"{_seconds_terms(second)}. Both fit: {format_bytes(best.device_bytes)} and "
          f"{format_bytes(second.device_bytes)} per device of "
          f"{format_bytes(plan.hardware.usable_device_memory * (1 - plan.margin))}.")


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
           "  " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(plan.rows)} "
           f"candidates; fits = within the usable memory less {plan.margin:.0%}",
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
  return "\n".join(lines)


def html_plan(plan: Any) -> str:
  return html_table(HEADER, plan_rows(plan), caption="\n".join(_head(plan)),
                    notes=[why_chosen(plan)])


def plan_json(plan: Any) -> dict[str, Any]:
  """Everything the table shows, as plain data (what the notebook plots)."""
  hw = plan.hardware
  return {
      "hardware": hw.name, "target": plan.target, "margin": plan.margin,
      "constants": {n: {"value": c.value, "source": c.source} for n, c in hw.constants().items()},
      "model": dataclasses.asdict(plan.job.model), "num_params": plan.job.model.num_params(),
      "global_batch": plan.job.global_batch, "precision": plan.job.precision,
      "chosen": plan.chosen.name if plan.chosen else None, "why": why_chosen(plan),
      "rows": [{"name": r.name, "candidate": dataclasses.asdict(r.candidate), "status": r.status,
                "reason": r.reason, "device_bytes": r.device_bytes, "host_bytes": r.host_bytes,
                "nvme_bytes": r.nvme_bytes, "resources": dataclasses.asdict(r.resources),
                "predicted_s": r.prediction.seconds, "terms": r.prediction.terms,
                "bound": r.prediction.bound,
                "compile_s": r.compiled.compile_s if r.compiled else None,
                "loop_overlap": r.compiled.loop_overlap if r.compiled else None}
               for r in plan.rows]}
