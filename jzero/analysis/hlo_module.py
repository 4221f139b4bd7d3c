"""XLA's optimized HLO text as data: the grammar every reading of :mod:`jzero.analysis.hlo` walks.

:func:`parse_module` splits a module (``compiled.as_text()``) into its computations, each a list
of :data:`Instruction` ``(name, result type, opcode, operands and attributes)`` in text order --
which, for a scheduled module, is schedule order -- and records who calls whom, how many times:
a ``while`` body its trip count per run of its caller, everything else once.
:func:`run_counts` multiplies those along the call graph, so a collective or a matmul inside the
layer scan inside the micro-batch loop is counted ``layers x micro-batches`` times per step.

**Trip counts.** XLA annotates most loops with ``known_trip_count``. Where it does not -- a loop
the collective pipeliner peeled (the gradient-accumulation loop runs ``gas - 1`` times), and every
loop of XLA's TPU compiler, which names no induction variable -- :func:`trip_count` reads the loop
itself: the induction variable's initial constant (the while's operand tuple), its constant step
(the body's root tuple) and the bound its condition compares it with.

**Types.** :func:`type_bytes` counts a type string's arrays at their own width (sub-byte types
packed: ``s4`` is half a byte), :func:`element_types` names the element types a buffer holds, and
:func:`tuple_elements` splits a tuple type at its top level.
"""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

__all__ = ["ARRAY", "BRANCHES", "CALLS", "ELEMENT_BITS", "ELEMENT_BYTES", "Instruction", "Module",
           "element_types", "operand_names", "parse_module", "run_counts", "trip_count",
           "tuple_elements", "type_bytes"]

ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                 "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                 "c64": 8, "c128": 16}
ELEMENT_BITS = {"s4": 4, "u4": 4, "s2": 2, "u2": 2, "s1": 1, "u1": 1}  # sub-byte types, packed
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                   r"%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def type_bytes(type_str: str) -> int:
  """Bytes of the arrays a type string names, each at its element type's width (sub-byte types
  packed, rounded up to whole bytes)."""
  total = 0
  for dt, dims in ARRAY.findall(type_str):
    numel = math.prod(int(d) for d in dims.split(",") if d)
    if dt in ELEMENT_BITS:
      total += -(-numel * ELEMENT_BITS[dt] // 8)
    else:
      total += ELEMENT_BYTES.get(dt, 4) * numel
  return total


def element_types(type_str: str) -> tuple[str, ...]:
  """The distinct element types of a collective's result buffers, in order of appearance."""
  return tuple(dict.fromkeys(dt for dt, _ in ARRAY.findall(type_str)))


def tuple_elements(type_str: str) -> list[str]:
  """Top-level elements of a tuple type '(a, (b, c), d)'; [type_str] when it is no tuple."""
  text = re.sub(r"/\*.*?\*/", "", type_str).strip()
  if not text.startswith("("):
    return [text]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(text[start:i].strip())
      start = i + 1
  return [p for p in parts if p]


Instruction = tuple[str, str, str, str]  # (name, result type, opcode, operands and attributes)


class Module(NamedTuple):
  """A parsed HLO module: instructions per computation in text order, (callee, trip count) per
  computation, the entry, and for each loop body the (caller, while instruction, trip count) that
  runs it."""

  comps: dict[str, list[Instruction]]
  calls: dict[str, list[tuple[str, int]]]
  entry: str
  loops: dict[str, tuple[str, str, int]]


def parse_module(hlo_text: str) -> Module:
  """The computations of an optimized HLO module and how they call one another (:class:`Module`);
  a loop without XLA's trip count annotation is counted by :func:`trip_count`."""
  comps: dict[str, list[Instruction]] = {}
  calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  whiles: list[tuple[str, str, str]] = []  # (caller, while's name, its operands and attributes)
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      comps[current] = []
      if header.group(1):
        entry = current
      continue
    inst = _INSTR.match(line)
    if not inst or current is None:
      continue
    name, type_str, op, rest = inst.group(2), inst.group(3), inst.group(4), inst.group(5)
    comps[current].append((name, type_str, op, rest))
    if op == "while":
      whiles.append((current, name, rest))
      continue
    for callee in CALLS.findall(rest):
      calls[current].append((callee, 1))
    for branches in BRANCHES.findall(rest):
      for callee in branches.split(","):
        calls[current].append((callee.strip().lstrip("%"), 1))
  if entry is None:
    raise ValueError("not an HLO module: no ENTRY computation found")
  loops = {}
  for caller, name, rest in whiles:
    trips = trip_count(comps, caller, rest) or 1
    for callee in CALLS.findall(rest):
      calls[caller].append((callee, trips))
    body = re.search(r"body=%?([\w.\-]+)", rest)
    if body:
      loops[body.group(1)] = (caller, name, trips)
  return Module(comps, calls, entry, loops)


_COMPARE = re.compile(r"direction=(LT|LE|GT|GE|NE)")
_LOOP_TRIPS = {"LT": lambda n, d: n, "LE": lambda n, d: n + d, "NE": lambda n, d: n,
               "GT": lambda n, d: n, "GE": lambda n, d: n + d}


def trip_count(comps: dict[str, list[Instruction]], caller: str, rest: str) -> int | None:
  """How many times the ``while`` whose operands and attributes are ``rest`` (an instruction of
  ``caller``) runs its body: XLA's ``known_trip_count`` where it gives one, else read from the loop
  itself -- the induction variable's initial constant (the while's operand tuple), its constant
  step (the body's root tuple) and the constant its condition compares it with. XLA drops the
  annotation from a loop it peels (the gradient-accumulation loop whose first micro-batch the
  collective pipeliner moved out of it runs ``gas - 1`` times, unannotated). None when the loop
  is not of that counted form."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
  if known:
    return int(known.group(1))
  index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}', rest)
  cond = re.search(r"condition=%?([\w.\-]+)", rest)
  body = re.search(r"body=%?([\w.\-]+)", rest)
  operands = operand_names(rest)
  if cond and not index:  # a TPU loop names no induction variable: the one its condition reads
    index = _compared_element(comps.get(cond.group(1), []))
  if not (index and cond and body and operands):
    return None
  i = int(index.group(1))
  init = _constant(comps, caller, _element(comps.get(caller, []), operands[0], i))
  step = _constant(comps, body.group(1), _element(comps.get(body.group(1), []), None, i),
                   through_add=True)
  bound = _compare_bound(comps, cond.group(1))
  if init is None or not step or bound is None:
    return None
  limit, direction = bound
  span = _LOOP_TRIPS[direction](limit - init, 1 if step > 0 else -1)
  trips = -(-span // step) if step > 0 else -(-(-span) // -step)
  return trips if trips > 0 else None


def _compared_element(insts: list[Instruction]) -> re.Match | None:
  """In a loop condition whose root compares an element of the loop tuple with a constant: the
  ``index=N`` of that element (None otherwise)."""
  if not insts or insts[-1][2] != "compare":
    return None
  reads = operand_names(insts[-1][3])
  by_name = {name: (op, rest) for name, _, op, rest in insts}
  for operand in reads:
    op, rest = by_name.get(operand, ("", ""))
    if op == "get-tuple-element":
      return re.search(r"index=(\d+)", rest)
  return None


def _element(insts: list[Instruction], tuple_name: str | None, index: int) -> str | None:
  """The name of element ``index`` of the tuple instruction ``tuple_name`` (None: the root)."""
  for name, _, op, rest in insts:
    if op == "tuple" and (name == tuple_name or tuple_name is None and insts[-1][0] == name):
      operands = operand_names(rest)
      return operands[index] if index < len(operands) else None
  return None


def _constant(comps: dict[str, list[Instruction]], comp: str, name: str | None, *,
              through_add: bool = False, depth: int = 0) -> int | None:
  """The integer constant instruction ``name`` of ``comp`` is, through copies and bitcasts (and,
  with ``through_add``, the constant operand of an add -- or of the add a fusion computes)."""
  if name is None or depth > 8:
    return None
  found = next(((op, rest) for n, _, op, rest in comps.get(comp, []) if n == name), None)
  if found is None:
    return None
  op, rest = found
  if op == "constant":
    value = re.match(r"\s*(-?\d+)\)", rest)
    return int(value.group(1)) if value else None
  operands = operand_names(rest)
  if op in ("copy", "bitcast") and operands:
    return _constant(comps, comp, operands[0], through_add=through_add, depth=depth + 1)
  if through_add and op == "add":
    for o in operands:
      value = _constant(comps, comp, o, depth=depth + 1)
      if value is not None:
        return value
  if through_add and op == "fusion":
    callee = re.search(r"calls=%?([\w.\-]+)", rest)
    if callee and comps.get(callee.group(1)):
      return _constant(comps, callee.group(1), comps[callee.group(1)][-1][0], through_add=True,
                       depth=depth + 1)
  return None


def _compare_bound(comps: dict[str, list[Instruction]], cond: str) -> tuple[int, str] | None:
  """(constant, direction) of a loop condition ``i <op> constant`` (the compare at its root, or
  at the root of the fusion there)."""
  insts = comps.get(cond)
  if not insts:
    return None
  _, _, op, rest = insts[-1]
  if op == "fusion":
    callee = re.search(r"calls=%?([\w.\-]+)", rest)
    return _compare_bound(comps, callee.group(1)) if callee else None
  direction = _COMPARE.search(rest)
  if op != "compare" or direction is None:
    return None
  operands = operand_names(rest)
  if len(operands) != 2:
    return None
  value = _constant(comps, cond, operands[1])
  return None if value is None else (value, direction.group(1))


def run_counts(comps: dict[str, list[Instruction]], calls: dict[str, list[tuple[str, int]]],
                entry: str, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, int]:
  """How many times one run of the module runs each computation reached from ``entry``: a loop
  body its ``known_trip_count`` times per run of its caller (``skip``: callees not followed)."""
  runs: dict[str, int] = collections.defaultdict(int)

  def visit(comp: str, mult: int) -> None:
    runs[comp] += mult
    for callee, trips in calls.get(comp, ()):
      if callee in comps and callee not in skip:
        visit(callee, mult * trips)

  visit(entry, 1)
  return runs


def operand_names(rest: str) -> list[str]:
  """The instruction names an instruction reads (its parenthesised operand list)."""
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch == "("
    if ch == ")":
      if depth == 0:
        return re.findall(r"%([\w.\-]+)", rest[:i])
      depth -= 1
  return re.findall(r"%([\w.\-]+)", rest)
