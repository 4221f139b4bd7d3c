"""Where a compiled step's collectives overlap compute: inside the gradient-accumulation loop or
outside it, per kind of collective.

XLA's latency-hiding scheduler decides overlap per computation, and it has less memory to work
with inside a loop body than outside (a body starts its count with everything live at the loop's
call site; :mod:`jzero.comm.program`). So one step can overlap every collective of its first
micro-batch -- which XLA's collective pipeliner peels out of the accumulation loop into the
step's top level -- and none of the same collectives of the other micro-batches, inside the loop.
:func:`breakdown` splits the bytes sent per step by where they run:

* ``in the accumulation loop``: the micro-batches the loop runs (``gas`` of them, or ``gas - 1``
  when XLA peeled the first one out), with the layer scans inside them;
* ``outside it``: everything else -- the peeled first micro-batch's layer scans, the gradient
  reduction after the loop, the update's gathers (with ``gas`` 1 there is no accumulation loop,
  and every collective is outside it);

and within each, by kind: the stage-3 forward and backward gathers (``all-gather``), the
backward's gradient reduction (``reduce-scatter``), ZeRO++'s quantized gathers (an all-gather of
``s8`` / ``u8`` blocks, qwZ) and quantized gradient exchange (``all-to-all``, qgZ), the rest.

The accumulation loop is the step's top-level loop that runs ``gas`` or ``gas - 1`` times and
holds loops of its own (the layer scans) -- or, for a model without a layer scan, the one that
runs that many times and sends the most.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["LoopShare", "accumulation_loop", "breakdown", "kind_of", "place_overlap", "IN_LOOP",
           "OUTSIDE"]

IN_LOOP = "in the accumulation loop"
OUTSIDE = "outside it"
_QUANTIZED = ("s8", "u8", "s4", "u4")


@dataclasses.dataclass(frozen=True)
class LoopShare:
  """The collectives of one kind in one place of the step, per device per step."""

  where: str  # IN_LOOP or OUTSIDE
  kind: str  # "all-gather", "all-gather (quantized)", "reduce-scatter", "all-to-all", ...
  sent_bytes: float
  overlapped_bytes: float
  sync_bytes: float  # sent by collectives XLA runs synchronously

  @property
  def overlap(self) -> float:
    return self.overlapped_bytes / self.sent_bytes if self.sent_bytes else math.nan


def accumulation_loop(collectives: list[Any], gas: int) -> str | None:
  """The name of the accumulation loop's while instruction among the collectives' enclosing
  loops (:attr:`jzero.analysis.hlo.Collective.loops`), or None (``gas`` 1, or none found)."""
  if gas <= 1:
    return None
  nested: dict[str, bool] = {}
  sent: dict[str, float] = {}
  for c in collectives:
    if c.loops and c.loops[0][1] in (gas, gas - 1):
      name = c.loops[0][0]
      nested[name] = nested.get(name, False) or len(c.loops) > 1
      sent[name] = sent.get(name, 0.0) + c.step_bytes
  if not sent:
    return None
  return max(sent, key=lambda n: (nested[n], sent[n]))


def kind_of(c: Any) -> str:
  """A collective's kind as the breakdown names it: quantized all-gathers apart (ZeRO++ qwZ)."""
  if c.kind == "all-gather" and any(p in _QUANTIZED for p in c.payload):
    return "all-gather (quantized)"
  return c.kind


def breakdown(collectives: list[Any], gas: int) -> list[LoopShare]:
  """Bytes sent per step by place (:data:`IN_LOOP`, :data:`OUTSIDE`) and kind, with the share
  overlapped; places and kinds that send nothing are left out."""
  loop = accumulation_loop(collectives, gas)
  totals: dict[tuple[str, str], list[float]] = {}
  for c in collectives:
    if not c.step_bytes:
      continue
    where = IN_LOOP if loop is not None and c.loops and c.loops[0][0] == loop else OUTSIDE
    row = totals.setdefault((where, kind_of(c)), [0.0, 0.0, 0.0])
    row[0] += c.step_bytes
    row[1] += c.step_bytes if c.overlapped else 0.0
    row[2] += c.step_bytes if not c.is_async else 0.0
  order = {IN_LOOP: 0, OUTSIDE: 1}
  return [LoopShare(where, kind, *values) for (where, kind), values
          in sorted(totals.items(), key=lambda kv: (order[kv[0][0]], -kv[1][0]))]


def place_overlap(shares: list[LoopShare], where: str) -> float:
  """The share of the bytes sent in ``where`` that overlap compute (nan: nothing sent there)."""
  sent = sum(s.sent_bytes for s in shares if s.where == where)
  return sum(s.overlapped_bytes for s in shares if s.where == where) / sent if sent else math.nan
