"""Communication you can see: the collectives of a compiled step, read from its HLO.

:func:`collectives` walks the optimized HLO module of a compiled step (``compiled.as_text()``) and
returns every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute with

* the bytes of the full (unpartitioned) buffer it moves,
* how many times it runs per step (collectives inside ``while`` loops -- the layer scan, the
  micro-batch scan -- run ``known_trip_count`` times; a ``conditional`` branch is counted once,
  an upper bound),
* its group size and the mesh axes its replica groups span, so traffic inside a node can be told
  from traffic across nodes on a ``node x local`` mesh,
* the bytes one device sends per run under the ring algorithm: all-gather and reduce-scatter
  ``(n-1)/n * full``, all-reduce ``2 (n-1)/n * full``, all-to-all ``(n-1)/n * full``,
  collective-permute the whole buffer,
* how many buffers XLA's combiners merged into it (DeepSpeed's buckets),
* its payload: the element types it moves (``u16`` for 16-bit parameters, which jzero gathers as
  their bits; ``s8`` + ``f32`` for ZeRO++'s int8 blocks and scales; ``u8`` for int4 blocks, two
  per byte -- every type is counted at its own width, so quantized collectives show their real
  bytes),
* and, in a scheduled GPU program, whether it runs asynchronously and what is scheduled while it
  is in flight. The GPU compiler turns every collective into a ``-start`` / ``-done`` pair and
  marks the ones it runs synchronously (``"is_sync":true`` in the backend config); the text of a
  scheduled module lists each computation's instructions in schedule order, so the compute
  instructions (fusions, custom calls such as cuBLAS gemms, convolutions, dots, and loops, calls
  or conditionals, which hold compute) between a start and its done run while the collective is in
  flight: the collective is *overlapped* with compute. Any fusion counts, even a LayerNorm; the
  matrix multiplications among them (gemm fusions, cuBLAS / cuDNN custom calls, dots,
  convolutions) are counted apart, since hiding a large transfer takes a matmul. A start whose done
  is not in the same computation (a collective pipelined across loop iterations) counts what
  follows it to the end of the computation. A TPU program fuses an asynchronous collective into a
  start and a done fusion (custom calls ``AsyncCollectiveStart`` / ``AsyncCollectiveDone``), and
  sends the part of a collective that crosses TPU slices over the data-centre network as
  host-transfer ``send`` instructions for the megascale runtime (kind ``"dcn all-to-all"`` etc.).

:func:`comm_volume` sums them per step and expresses the total in units of Psi (the parameter
count times the bytes of one element), the unit of the ZeRO paper's communication analysis:
DDP, ZeRO-1 and ZeRO-2 move ``2 Psi`` per device per step, ZeRO-3 ``3 Psi`` (times ``(n-1)/n`` for
a ring of ``n`` devices, which the paper rounds to 1). :meth:`CommVolume.crossing` is what
crosses a mesh axis -- on a ``node x local`` mesh, the bytes over the slow links: every collective
whose replica groups span that axis, counted whole (a collective over all devices is counted as
crossing nodes, as the ZeRO++ paper counts ZeRO-3's 3Ψ). An all-to-all over a tuple of buffers
(XLA's CPU form: one buffer per destination) counts them all.

Every reading here -- the collectives and their overlap, the matmul FLOPs, the memory traffic,
the per-step volume -- walks the same parsed module, its loop trip counts and operand types:
:mod:`jzero.analysis.hlo_module`, the grammar of XLA's HLO text.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import numpy as np

from jzero.analysis.hlo_module import (ARRAY, BRANCHES, CALLS, ELEMENT_BYTES, Instruction,
                                       element_types, operand_names, parse_module, run_counts,
                                       tuple_elements, type_bytes)
from jzero.analysis.tables import html_table, require_pyplot, text_table
from jzero.sharding.mesh import ZeroMesh

__all__ = ["Collective", "CommVolume", "StepTiming", "collectives", "comm_volume", "zero_theory",
           "unordered_collectives", "matmul_flops", "parameter_bytes", "COMPUTE_OPS"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Instructions that run kernels (or hold instructions that do) in a scheduled GPU program.
COMPUTE_OPS = ("fusion", "custom-call", "convolution", "dot", "while", "conditional", "call")
_MATMUL = re.compile(r"gemm|matmul|dot|conv", re.IGNORECASE)
_CALLEE = re.compile(r"(?:calls|custom_call_target)=\"?%?([\w.\-$]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled step."""

  kind: str
  name: str
  full_bytes: int  # the unpartitioned buffer: AG output, RS input, AR / A2A / CP operand
  group_size: int
  axes: tuple[str, ...]  # mesh axes the replica groups span
  count: int  # runs per step
  buffers: int = 1  # buffers XLA's combiners merged into this one instruction
  is_async: bool = False  # a start/done pair XLA runs asynchronously (not marked is_sync)
  overlapped_ops: int = 0  # compute instructions scheduled between its start and done
  overlapped_matmuls: int = 0  # of which matrix multiplications (gemms, dots, convolutions)
  computation: str = ""  # the HLO computation it is in (a loop body, or the entry)
  payload: tuple[str, ...] = ()  # element types moved, e.g. ("s8", "f32") for int8 blocks
  loops: tuple[tuple[str, int], ...] = ()  # enclosing while loops, outermost first: (name, trips)

  @property
  def overlapped(self) -> bool:
    """Runs asynchronously with compute scheduled while it is in flight."""
    return self.is_async and self.overlapped_ops > 0

  @property
  def sent_bytes(self) -> float:
    """Bytes one device sends per run (ring algorithm)."""
    n = self.group_size
    if n <= 1:
      return 0.0
    if self.kind == "all-reduce":
      return 2 * (n - 1) / n * self.full_bytes
    if self.kind == "collective-permute":
      return float(self.full_bytes)
    return (n - 1) / n * self.full_bytes

  @property
  def step_bytes(self) -> float:
    return self.sent_bytes * self.count


def _outputs(op: str, type_str: str) -> str:
  """The result buffers of a collective. Async all-gather / reduce-scatter / all-to-all /
  collective-permute starts return (operands, results[, contexts]); all-reduce-start returns its
  results; a synchronous collective returns its results."""
  if op.endswith("-start") and op != "all-reduce-start":
    parts = tuple_elements(type_str)
    if len(parts) >= 2:
      return parts[1]
  return type_str


def _groups(attrs: str, n_devices: int) -> list[list[int]]:
  m = re.search(r"replica_groups=\{(\{[^=]*?\})\}", attrs)
  if m:
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^{}]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    g, s = int(m.group(1)), int(m.group(2))
    ids = np.arange(math.prod(int(d) for d in m.group(3).split(","))).reshape(
        [int(d) for d in m.group(3).split(",")])
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if m:
    pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(0))
    return [[int(a), int(b)] for a, b in pairs]
  return [list(range(n_devices))]  # empty replica_groups: all devices


def _axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  spanned = set()
  for g in groups:
    coords = np.array(np.unravel_index(np.asarray(g), sizes)).T
    for i, name in enumerate(names):
      if len(set(coords[:, i])) > 1:
        spanned.add(name)
  return tuple(n for n in names if n in spanned)


def unordered_collectives(hlo_text: str) -> list[tuple[str, str, str]]:
  """Pairs of collective-bearing instructions (a collective, or a loop / branch / call holding
  one) that no data dependency orders: ``(computation, earlier, later)`` for each pair adjacent in
  text order where the later does not read the earlier's result, directly or through others.

  Empty when every computation's collectives form one chain -- what
  :mod:`jzero.comm.collective_order` builds, so that XLA's CPU runtime cannot run two at once."""
  comps, calls, _, _ = parse_module(hlo_text)
  bearing: dict[str, bool] = {}

  def holds(comp: str) -> bool:
    if comp not in bearing:
      bearing[comp] = False
      bearing[comp] = any(op.removesuffix("-start") in KINDS for _, _, op, _ in comps.get(comp, ())
                          ) or any(holds(c) for c, _ in calls.get(comp, ()))
    return bearing[comp]

  found = []
  for comp, insts in comps.items():
    ancestors: dict[str, set[str]] = {}
    elements: dict[str, list[str]] = {}  # a tuple's (or a barrier's) elements, by position
    previous = None
    for name, _, op, rest in insts:
      reads = [o for o in operand_names(rest) if o in ancestors]
      if op == "tuple":
        elements[name] = reads
      elif op == "opt-barrier" and reads and reads[0] in elements:
        elements[name] = elements[reads[0]]  # passes its tuple through, element by element
      index = re.search(r"index=(\d+)", rest)
      if op == "get-tuple-element" and reads and reads[0] in elements and index:
        reads = elements[reads[0]][int(index.group(1)):][:1]
      ancestors[name] = set(reads).union(*(ancestors[o] for o in reads))
      if op.endswith("-done"):
        continue
      callees = [c.strip().lstrip("%") for c in CALLS.findall(rest)] + [
          c.strip().lstrip("%") for b in BRANCHES.findall(rest) for c in b.split(",")]
      if op.removesuffix("-start") in KINDS or any(holds(c) for c in callees):
        if previous is not None and previous not in ancestors[name]:
          found.append((comp, previous, name))
        previous = name
  return found


def collectives(hlo_text: str, mesh: ZeroMesh | None = None) -> list[Collective]:
  """Every collective of an optimized HLO module, with its per-step run count.

  Args:
    hlo_text: ``compiled.as_text()`` of the step (or any optimized HLO module text).
    mesh: the mesh the step runs on (names the axes groups span); None: axes left empty.
  """
  mesh_shape = dict(mesh.mesh.shape) if mesh is not None else {}
  n_devices = math.prod(mesh_shape.values()) if mesh_shape else 1
  comps, calls, entry, loops = parse_module(hlo_text)

  runs = run_counts(comps, calls, entry)
  nests = _loop_nests(calls, entry, loops)
  halves = _tpu_async_halves(comps)
  found = []
  for comp, insts in comps.items():
    if not runs.get(comp) or halves.get(comp) in (_TPU_DONE, _TPU_CONTINUED):
      continue  # a TPU done half (or a fusion carrying it) repeats its start's collective
    for index, (name, type_str, op, rest) in enumerate(insts):
      kind = op.removesuffix("-start")
      if op == "send" and _MEGASCALE in rest:
        found.append(_dcn_transfer(insts, index, mesh, runs[comp], nests.get(comp, ()), comp))
        continue
      if kind not in KINDS or op.endswith("-done"):
        continue
      groups = _groups(rest, n_devices)
      size = len(groups[0]) if kind != "collective-permute" else n_devices
      outputs = _outputs(op, type_str)
      out = type_bytes(outputs)
      full = out * size if kind == "reduce-scatter" else out
      is_async, overlapped, matmuls = False, 0, 0
      if op.endswith("-start"):
        is_async = '"is_sync":true' not in rest
        overlapped, matmuls = _compute_in_flight(insts, index, name)
      elif halves.get(comp) == _TPU_START:
        is_async = True
        overlapped, matmuls = _tpu_in_flight(comps, halves, comp)
      found.append(Collective(kind=kind, name=name, full_bytes=full, group_size=size,
                              axes=_axes(groups, mesh_shape) if mesh_shape else (),
                              count=runs[comp], buffers=len(ARRAY.findall(outputs)),
                              is_async=is_async, overlapped_ops=overlapped,
                              overlapped_matmuls=matmuls, computation=comp,
                              payload=element_types(outputs), loops=nests.get(comp, ())))
  return found


_TILE = re.compile(r"T\(([\d,]+)\)")


def parameter_bytes(hlo_text: str) -> tuple[int, int]:
  """(logical, laid-out) bytes of the entry computation's parameters: the arguments' shard shapes
  times their element widths, and the same padded to the first tile of each layout (a TPU
  program's ``T(8,128)`` pads the last two dimensions to multiples of 8 and 128; a scalar's
  ``T(128)`` takes 128 elements). The laid-out sum is XLA's ``argument_size_in_bytes`` on a TPU;
  their difference is what the chip's tiles add to the plan's bytes."""
  comps, _, entry, _ = parse_module(hlo_text)
  logical = laid_out = 0
  for _, type_str, op, _ in comps[entry]:
    if op != "parameter":
      continue
    for dtype, dims, layout in re.findall(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?",
                                          type_str):
      shape = [int(d) for d in dims.split(",")] if dims else []
      width = ELEMENT_BYTES.get(dtype, 0)
      logical += math.prod(shape) * width
      tile = _TILE.search(layout or "")
      if tile:
        sizes = [int(t) for t in tile.group(1).split(",")]
        shape = [1] * (len(sizes) - len(shape)) + shape
        for k, t in enumerate(sizes, start=len(shape) - len(sizes)):
          shape[k] = -(-shape[k] // t) * t
      laid_out += math.prod(shape) * width
  return logical, laid_out


def _loop_nests(calls: dict[str, list[tuple[str, int]]], entry: str,
                loops: dict[str, tuple[str, str, int]]) -> dict[str, tuple[tuple[str, int], ...]]:
  """For each computation reached from ``entry``: the while loops it runs inside, outermost first,
  as (while instruction, trip count) -- through loop bodies, calls and branches, the first path
  found."""
  nests: dict[str, tuple[tuple[str, int], ...]] = {entry: ()}
  stack = [entry]
  while stack:
    comp = stack.pop()
    for callee, _ in calls.get(comp, ()):
      if callee in nests:
        continue
      loop = loops.get(callee)
      nests[callee] = nests[comp] + (((loop[1], loop[2]),) if loop and loop[0] == comp else ())
      stack.append(callee)
  return nests


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of the matrix multiplications one run of an optimized HLO module does (one device's
  program, under SPMD): ``2 x result elements x contracted elements`` per ``dot`` (also inside
  fusions) and per GPU gemm custom call (cuBLAS carries its dot's dimension numbers), each times
  the runs of its computation -- ``known_trip_count`` for a loop body.

  XLA's ``compiled.cost_analysis()["flops"]`` counts a loop body once (a 4-layer ``lax.scan``
  reports one layer's FLOPs), so it undercounts a step whose layers or micro-batches are scanned;
  this count does not. Elementwise work and convolutions are not counted (a transformer's are a
  few percent of its matmuls; model-FLOPs formulas leave them out too).
  """
  comps, calls, entry, _ = parse_module(hlo_text)
  runs = run_counts(comps, calls, entry)
  total = 0.0
  for comp, insts in comps.items():
    if not runs.get(comp):
      continue
    types = {name: type_str for name, type_str, _, _ in insts}
    for _, type_str, op, rest in insts:
      if op == "dot":
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
      elif op == "custom-call" and "dot_dimension_numbers" in rest:
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
      else:
        continue
      lhs = types.get(next(iter(operand_names(rest)), ""), "")
      lhs_dims = ARRAY.search(lhs)
      out_dims = ARRAY.search(tuple_elements(type_str)[0])
      if found is None or lhs_dims is None or out_dims is None:
        continue
      lhs_shape = [int(d) for d in lhs_dims.group(2).split(",") if d]
      contracted = math.prod(lhs_shape[int(d.strip('" '))] for d in found.group(1).split(",")
                             if d.strip('" '))
      out = math.prod(int(d) for d in out_dims.group(2).split(",") if d)
      total += 2.0 * out * contracted * runs[comp]
  return total


# Instructions that move no data of their own (views, tuples, control) or are counted elsewhere.
_NO_TRAFFIC = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "add-dependency", "opt-barrier",
    "copy-done", "send-done", "recv-done"))


def memory_traffic(hlo_text: str) -> float:
  """Bytes the non-matmul instructions of one run of an optimized HLO module read and write (one
  device's program): for every instruction of the entry and of the computations it runs (loop
  bodies times their ``known_trip_count``, conditional branches, calls) -- not the bodies of
  fusions or reducers, whose traffic is their fusion's --, its operands' bytes plus its result's.
  Matrix multiplications (``dot``, fusions and custom calls around one) are left out: their time is
  the FLOPs' (:func:`matmul_flops`); collectives too (:func:`collectives`). The rest -- elementwise
  work, normalizations, softmax, the optimizer update, copies between memory kinds -- is bound by
  memory bandwidth, which this count divides into a time (:func:`jzero.planning.cost.predict`).
  """
  comps, calls, entry, _ = parse_module(hlo_text)
  fused = set()
  for insts in comps.values():
    for _, _, op, rest in insts:
      if op != "while" and op != "conditional" and op != "call":
        fused.update(CALLS.findall(rest))
  runs = run_counts(comps, calls, entry, skip=fused)
  matmul_bodies = {comp for comp, insts in comps.items()
                   if any(op in ("dot", "convolution") for _, _, op, _ in insts)}
  total = 0.0
  for comp, insts in comps.items():
    if not runs.get(comp) or comp in fused:
      continue
    types = {name: type_str for name, type_str, _, _ in insts}
    for name, type_str, op, rest in insts:
      kind = op.removesuffix("-start")
      if op in _NO_TRAFFIC or kind in KINDS or op.endswith("-done") or op == "dot":
        continue
      callee = _CALLEE.search(rest)
      if op == "custom-call" and _MATMUL.search(callee[1] if callee else ""):
        continue
      if op == "fusion" and callee and callee[1] in matmul_bodies:
        continue
      total += _instruction_traffic(comps, types, type_str, op, rest, callee) * runs[comp]
  return total


def _instruction_traffic(comps: dict[str, list[Instruction]], types: dict[str, str],
                         type_str: str, op: str, rest: str, callee: Any) -> float:
  """Bytes one run of an instruction reads and writes. A ``dynamic-slice`` reads only its slice
  and a ``dynamic-update-slice`` writes only its update, in place -- the stacked buffers a layer
  scan keeps its activations in are touched one layer per trip, not whole; inside a fusion the
  same holds for a parameter read only through dynamic slices, and for a result that is a
  dynamic-update-slice of one of the fusion's parameters."""
  operands = operand_names(rest)
  size = lambda name: type_bytes(types.get(name, ""))  # noqa: E731
  if op == "dynamic-slice":
    return 2.0 * type_bytes(type_str)
  if op == "dynamic-update-slice":
    return 2.0 * size(operands[1]) if len(operands) > 1 else 0.0
  body = comps.get(callee[1]) if op == "fusion" and callee else None
  if not body:
    return sum(size(o) for o in operands) + type_bytes(type_str)
  local = {name: t for name, t, _, _ in body}
  params = {}
  for name, _, bop, brest in body:
    if bop == "parameter":
      params[int(re.match(r"\s*(\d+)", brest).group(1))] = name
  # per value: (op, result type, is it the first operand) of each instruction that reads it
  users: dict[str, list[tuple[str, str, bool]]] = collections.defaultdict(list)
  for name, t, bop, brest in body:
    for i, o in enumerate(operand_names(brest)):
      users[o].append((bop, t, i == 0))
  read = 0.0
  for i, operand in enumerate(operands):
    uses = users.get(params.get(i, ""), [])
    if uses and all(op == "dynamic-slice" and first for op, _, first in uses):
      read += sum(type_bytes(t) for _, t, _ in uses)  # the slices read
    elif uses and all(op == "dynamic-update-slice" and first for op, _, first in uses):
      read += 0.0  # the buffer updated in place
    else:
      read += size(operand)
  root = body[-1]
  roots = [root] if root[2] != "tuple" else [next((b for b in body if b[0] == r), None)
                                             for r in operand_names(root[3])]
  written = 0.0
  for r in roots:
    if r is None:
      continue
    if r[2] == "dynamic-update-slice":
      update = operand_names(r[3])
      written += type_bytes(local.get(update[1], "")) if len(update) > 1 else 0.0
    else:
      written += type_bytes(r[1])
  return read + written


_TPU_START, _TPU_DONE = "AsyncCollectiveStart", "AsyncCollectiveDone"
_TPU_CONTINUED = "async_collective_fusion"  # compute carrying a collective in flight
_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'


def _dcn_transfer(insts: list[Instruction], index: int, mesh: ZeroMesh | None, count: int,
                  loops: tuple[tuple[str, int], ...], comp: str) -> Collective:
  """A TPU multi-slice program's hop over the data-centre network: XLA's TPU compiler lowers the
  part of a collective that crosses slices to a host-transfer ``send`` for the megascale runtime
  (``_xla_megascale_transfer_type`` names the collective, ``_xla_megascale_target`` the groups of
  chips, by device id). Its kind is "dcn <collective>", its buffer the bytes sent, and it is
  overlapped when compute runs between the send and its send-done."""
  name, type_str, _, rest = insts[index]
  kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', rest)
  kind = "dcn " + (kind.group(1).lower().replace("_", "-") if kind else "transfer")
  # the target: groups of device ids, or "{slices}x{first:last}" (those chips of each slice)
  target = re.search(r"_xla_megascale_target=\{(\{[^=]*?\})\}", rest)
  ranged = re.search(r'_xla_megascale_target="\{([\d,]+)\}x\{(\d+):(\d+)\}"', rest)
  groups = ([[int(x) for x in g.split(",")] for g in re.findall(r"\{([^{}]*)\}", target.group(1))]
            if target else [[0, 1]])
  sent = type_bytes(tuple_elements(type_str)[0]) if type_str.startswith("(") else 0
  axes: tuple[str, ...] = ()
  if mesh is not None:  # device ids -> mesh positions -> the axes the groups span
    devices = list(mesh.mesh.devices.flat)
    position = {d.id: i for i, d in enumerate(devices)}
    positions = [[position.get(d, 0) for d in g] for g in groups]
    if ranged:  # chip c of each named slice (slice-major positions)
      slices = sorted({getattr(d, "slice_index", 0) for d in devices})
      per_slice = len(devices) // len(slices)
      named = [int(x) for x in ranged.group(1).split(",")]
      chosen = [i for i, _ in enumerate(slices)][:len(named)]
      positions = [[i * per_slice + c for i in chosen]
                   for c in range(int(ranged.group(2)), int(ranged.group(3)) + 1)]
      groups = positions
    axes = _axes(positions, dict(mesh.mesh.shape))
  size = len(groups[0])
  overlapped, matmuls = _compute_in_flight(insts, index, name)
  return Collective(kind=kind, name=name, full_bytes=sent * size // max(size - 1, 1),
                    group_size=size, axes=axes, count=count, is_async=True,
                    overlapped_ops=overlapped, overlapped_matmuls=matmuls, computation=comp,
                    payload=element_types(tuple_elements(type_str)[0]), loops=loops)


def _tpu_async_halves(comps: dict[str, list[Instruction]]) -> dict[str, str]:
  """The computations of a TPU program that are one half of an asynchronous collective: XLA's
  TPU compiler fuses a collective into a start fusion (its root a custom call
  ``AsyncCollectiveStart``) and a done fusion (``AsyncCollectiveDone``, holding a copy of the
  collective); computation -> which half. Between the two, a collective in flight is carried on
  by ``async_collective_fusion`` computations (compute fused with the collective's progress, a
  copy of it inside): they count as the done half does -- the same collective, not another."""
  halves = {}
  for comp, insts in comps.items():
    if comp.startswith("async_collective_fusion"):
      halves[comp] = _TPU_CONTINUED
      continue
    if insts and insts[-1][2] == "custom-call":
      target = re.search(r'custom_call_target="(\w+)"', insts[-1][3])
      if target and target.group(1) in (_TPU_START, _TPU_DONE):
        halves[comp] = target.group(1)
  return halves


def _tpu_in_flight(comps: dict[str, list[Instruction]], halves: dict[str, str],
                   start_comp: str) -> tuple[int, int]:
  """(compute instructions, of which matmuls) a TPU program schedules between the fusion that
  starts a collective (calls ``start_comp``) and the done fusion that reads its result."""
  for insts in comps.values():
    for index, (name, _, op, rest) in enumerate(insts):
      if op == "fusion" and re.search(rf"calls=%?{re.escape(start_comp)}(?![\w.\-])", rest):
        return _compute_in_flight(insts, index, name, done=lambda r: _is_done(halves, r))
  return 0, 0


def _is_done(halves: dict[str, str], rest: str) -> bool:
  callee = re.search(r"calls=%?([\w.\-]+)", rest)
  return bool(callee and halves.get(callee.group(1)) == _TPU_DONE)


def _compute_in_flight(insts: list[tuple[str, str, str, str]], start: int,
                       name: str, done: Any = None) -> tuple[int, int]:
  """(compute instructions, of which matmuls) scheduled after ``insts[start]`` and before the done
  that consumes it (to the end of the computation when the done is elsewhere); ``done``: for a
  TPU start fusion, whether an instruction's text is a done fusion (:func:`_tpu_in_flight`)."""
  count = matmuls = 0
  reads = {name}  # the start, and the tuple elements taken from it
  for inst, _, op, rest in insts[start + 1:]:
    if op.endswith("-done") and rest.split(")")[0].strip().lstrip("%") == name:
      break
    if done is not None:  # a TPU start fusion: its done is a fusion reading it (or an element)
      if op == "get-tuple-element" and set(operand_names(rest)[:1]) & reads:
        reads.add(inst)
        continue
      if done(rest) and reads & set(operand_names(rest)):
        break
    if op in COMPUTE_OPS:
      count += 1
      callee = _CALLEE.search(rest)
      matmuls += op in ("dot", "convolution") or bool(
          op in ("fusion", "custom-call") and _MATMUL.search(inst + (callee[1] if callee else "")))
  return count, matmuls


def zero_theory(stage: int, n: int) -> float:
  """Bytes one device sends per step, in Psi units, for ZeRO ``stage`` over ``n`` devices (ring)."""
  return (3 if stage == 3 else 2) * (n - 1) / n


@dataclasses.dataclass(frozen=True)
class CommVolume:
  """Per-step communication of a compiled step."""

  ops: list[Collective]
  psi_bytes: int  # parameter count x bytes per element

  @property
  def total_bytes(self) -> float:
    return sum(c.step_bytes for c in self.ops)

  @property
  def total_psi(self) -> float:
    return self.total_bytes / self.psi_bytes

  def by_kind(self) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for c in self.ops:
      out[c.kind] += c.step_bytes
    return dict(out)

  @property
  def overlapped_bytes(self) -> float:
    """Bytes sent per step by collectives that run asynchronously with compute in flight."""
    return sum(c.step_bytes for c in self.ops if c.overlapped)

  @property
  def overlap_fraction(self) -> float:
    """Fraction of the bytes sent per step that overlap compute (nan when nothing is sent)."""
    total = self.total_bytes
    return self.overlapped_bytes / total if total else math.nan

  @property
  def matmul_overlap_fraction(self) -> float:
    """Fraction of the bytes sent per step with a matmul in flight (nan when nothing is sent)."""
    total = self.total_bytes
    hidden = sum(c.step_bytes for c in self.ops if c.overlapped and c.overlapped_matmuls)
    return hidden / total if total else math.nan

  def by_axes(self) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for c in self.ops:
      out[c.axes] += c.step_bytes
    return dict(out)

  def crossing(self, axis: str) -> float:
    """Bytes sent per device per step by the collectives whose groups span mesh axis ``axis``
    (``"node"``: what crosses nodes)."""
    return sum(c.step_bytes for c in self.ops if axis in c.axes)

  def rows(self) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of :meth:`table`: per kind, mesh axes and payload, the runs per step and the
    MiB each device sends per step (and in Psi units); a total row last."""
    grouped = collections.defaultdict(lambda: [0, 0.0])
    for c in self.ops:
      key = (c.kind, "x".join(c.axes) or "-", "+".join(c.payload) or "-")
      grouped[key][0] += c.count
      grouped[key][1] += c.step_bytes
    header = ["collective", "axes", "payload", "runs/step", "MiB sent/device", "Psi"]
    rows = [[kind, axes, payload, str(count), f"{sent / 2**20:.3f}",
             f"{sent / self.psi_bytes:.3f}"]
            for (kind, axes, payload), (count, sent) in sorted(grouped.items())]
    rows.append(["total", "", "", "", f"{self.total_bytes / 2**20:.3f}", f"{self.total_psi:.3f}"])
    return header, rows

  def table(self) -> str:
    """A per-kind / per-axes / per-payload table of bytes sent per device per step."""
    return text_table(*self.rows())

  def _repr_html_(self) -> str:
    return html_table(*self.rows(), caption="collectives of the compiled step, per device")

  def to_records(self) -> list[dict[str, Any]]:
    """One dict per kind, axes and payload: runs per step, bytes sent per device per step."""
    header, rows = self.rows()
    return [{"collective": r[0], "axes": r[1], "payload": r[2], "runs": int(r[3]),
             "bytes": float(r[4]) * 2**20} for r in rows[:-1]]

  def plot(self, ax: Any = None) -> Any:
    """Bars of MiB sent per device per step, one per kind and mesh axes. Returns the Axes."""
    plt = require_pyplot()
    if ax is None:
      _, ax = plt.subplots(figsize=(6, 3.2))
    records = self.to_records()
    ax.bar(range(len(records)), [r["bytes"] / 2**20 for r in records])
    ax.set_xticks(range(len(records)), [f"{r['collective']}\n{r['axes']} {r['payload']}"
                                        for r in records], fontsize="small")
    ax.set_ylabel("MiB sent per device per step")
    return ax


def comm_volume(compiled: Any, mesh: ZeroMesh, *, num_params: int, bytes_per_param: int
                ) -> CommVolume:
  """Collectives of a compiled step and their per-step volume in Psi units.

  Args:
    compiled: a compiled step (``engine.compile_step(...)``) or its HLO text.
    mesh: the mesh it runs on.
    num_params: Psi, the model's parameter count.
    bytes_per_param: bytes of one communicated element (4 for fp32, 2 for bf16 / fp16).
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  return CommVolume(ops=collectives(text, mesh), psi_bytes=num_params * bytes_per_param)


@dataclasses.dataclass(frozen=True)
class StepTiming:
  """Wall-clock time of one step run with ``wall_clock_breakdown`` (each part run to completion)."""

  step: int
  forward_backward_s: float  # forward + backward over all micro-batches + gradient reduction
  optimizer_s: float  # overflow check, clipping, optimizer update, parameter all-gather

  @property
  def total_s(self) -> float:
    return self.forward_backward_s + self.optimizer_s
