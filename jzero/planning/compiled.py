"""A candidate's step compiled for the target, read for what the cost model needs, and cached.

For a GPU target the step is compiled by :func:`jzero.planning.aot.compile_for` (XLA's GPU
compiler, compile-only devices, no GPU needed); for the CPU target, on this process's own devices
through :meth:`jzero.Engine.compile_step` with the state abstract (nothing is allocated). From the
compiled program :class:`Compiled` keeps the per-device peak (``memory_analysis()``: arguments +
outputs + temporaries - aliased), the matmul FLOPs with their loop counts (recompute included), the
bytes the other instructions read and write (:func:`jzero.analysis.hlo.memory_traffic`),
the collective bytes sent per step split into those inside a node and those crossing nodes (by the
mesh axes their replica groups span: a collective over a ``node`` axis, or over the flat data
axis of a multi-node topology, crosses), and the share of those bytes the schedule overlaps with
compute -- over the step and inside the gradient-accumulation loop
(:mod:`jzero.planning.loop_overlap`). A GPU compile schedules with the memory a run with the
target's memory fraction has (:func:`jzero.planning.aot.compile_once`), so the fraction is part of
the cache key.

Offload (:func:`program_config`): XLA's compile-only GPU devices list no memory spaces, so a
deviceless compile cannot place ``pinned_host`` arguments, and on a GPU target a candidate that
offloads optimizer state or parameters is compiled as its *device twin* (the same step with that
offload removed: the same collectives and FLOPs). Its device bytes are derived from the twin's
compile (:func:`jzero.planning.search.plan_for`): the twin's peak less the state the offload keeps
on the host, or the arithmetic's update phase if larger (the streamed update, which the twin does
not run), labelled "twin - offload", never as the twin's peak. A candidate whose gradients leave
the device in the backward pass (``"cpu_adam"``) has no twin whose program holds what it holds:
its device bytes are the memory model's (:func:`jzero.analysis.step_memory.step_peak`), labelled
so, and the twin's compile gives its FLOPs and collectives. Compile-only TPU chips keep memory
kinds (:func:`compiles_offload`): there a candidate with host-memory offload is compiled as it is
and its device bytes are its compile's HBM peak; one with state on NVMe (a store a compile-only
target does not open) is compiled as its twin. ``cpu_checkpointing`` needs no twin: the compile
keeps the layer inputs in host memory itself. Host and NVMe bytes and the PCIe / NVMe streams
always come from the arithmetic (:mod:`jzero.planning.candidates`).

Compiles are cached as small JSON files keyed by the config, the target, the model's shape and
the jax / jzero versions (``cache_dir``; default ``$JZERO_CACHE_DIR`` or
``~/.cache/jzero/plan``), so planning again, or a candidate whose twin was compiled, costs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["Compiled", "compile_candidate", "device_twin", "default_cache_dir", "compiles_offload",
           "program_config"]


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What the compiled step of one config uses per device (see the module docstring)."""

  peak: float
  flops: float
  memory_bytes: float  # non-matmul traffic (jzero.analysis.hlo.memory_traffic)
  intra_node_bytes: float
  inter_node_bytes: float
  overlap: float
  compile_s: float
  cached: bool = False
  loop_overlap: float | None = None  # inside the accumulation loop (None: no such loop)


# of a cached Compiled: 2 added memory_bytes, 3 counts dynamic slices as slices, 4 counts the runs
# of loops XLA leaves unannotated, adds loop_overlap and schedules with the run's memory pool
_FORMAT = 4


def default_cache_dir() -> Path:
  return Path(os.environ.get("JZERO_CACHE_DIR") or Path.home() / ".cache" / "jzero" / "plan")


def device_twin(config: dict) -> dict:
  """``config`` with the optimizer and parameter offload removed (what a GPU target compiles)."""
  zero = {k: v for k, v in config["zero_optimization"].items()
          if k not in ("offload_optimizer", "offload_param")}
  return dict(config, zero_optimization=zero)


def compiles_offload(target: str) -> bool:
  """The target's compile places host-memory arguments: this process's CPU devices and
  compile-only TPU chips do, XLA's compile-only GPUs do not (they list no memory spaces)."""
  return target == "cpu" or target.startswith("tpu:")


def program_config(config: dict, target: str) -> dict:
  """The config whose step ``target`` compiles for ``config``: itself where the compile places
  host memory (:func:`compiles_offload`) -- on a TPU target unless it keeps state on NVMe --,
  else its :func:`device_twin`."""
  if target == "cpu":
    return config
  zero = config["zero_optimization"]
  on_nvme = any((zero.get(block) or {}).get("device") == "nvme"
                for block in ("offload_optimizer", "offload_param"))
  return config if compiles_offload(target) and not on_nvme else device_twin(config)


def _key(config: dict, target: str, devices: int, nodes: int, model: Any,
         memory_fraction: float) -> str:
  import jax  # noqa: PLC0415

  from jzero.version import __version__  # noqa: PLC0415

  text = json.dumps([config, target, devices, nodes, dataclasses.asdict(model), jax.__version__,
                     __version__, _FORMAT, memory_fraction], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _split(collectives: list, nodes: int) -> tuple[float, float, float]:
  """(intra-node bytes, inter-node bytes, overlapped share) of a program's collectives."""
  intra = inter = hidden = 0.0
  for c in collectives:
    crosses = nodes > 1 and set(c.axes) != {"local"}
    if crosses:
      inter += c.step_bytes
    else:
      intra += c.step_bytes
    hidden += c.step_bytes if c.overlapped else 0.0
  total = intra + inter
  return intra, inter, hidden / total if total else 0.0


def _compile_gpu(config: dict, gpu: str, devices: int, nodes: int, model: Any,
                 memory_fraction: float) -> Compiled:
  from jzero.planning import loop_overlap  # noqa: PLC0415
  from jzero.planning.aot import compile_for  # noqa: PLC0415

  if gpu.startswith("tpu:"):  # "tpu:v5p:2x2x2": a TPU slice; nodes are its slices
    _, tpu, topology = gpu.split(":")
    report = compile_for(config, tpu=tpu, topology=topology, slices=nodes, model=model,
                         memory_fraction=memory_fraction)
  else:
    report = compile_for(config, gpu, devices, nodes=nodes, model=model,
                         memory_fraction=memory_fraction)
  intra, inter, overlap = _split(report.collectives, nodes)
  shares = loop_overlap.breakdown(report.collectives, report.gradient_accumulation_steps)
  in_loop = loop_overlap.place_overlap(shares, loop_overlap.IN_LOOP)
  return Compiled(peak=report.peak, flops=report.matmul_flops,
                  memory_bytes=report.memory_traffic, intra_node_bytes=intra,
                  inter_node_bytes=inter, overlap=overlap,
                  compile_s=report.trace_s + report.lower_s + report.compile_s,
                  loop_overlap=None if math.isnan(in_loop) else in_loop)


def _compile_cpu(config: dict, model: Any) -> Compiled:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jzero.analysis.hlo import collectives, matmul_flops, memory_traffic  # noqa: PLC0415
  from jzero.models import GPT, lm_loss  # noqa: PLC0415
  from jzero.train.initialize import initialize  # noqa: PLC0415

  t0 = time.perf_counter()
  engine = initialize(model=lambda rngs: GPT(model, rngs=rngs), loss_fn=lm_loss, config=config)
  state = engine.abstract_state(full=False)
  batch = {"tokens": jax.ShapeDtypeStruct((engine.global_batch_size, model.seq_len + 1),
                                          jnp.int32, sharding=engine.batch_sharding())}
  compiled = engine.compile_step(state, batch)
  analysis = compiled.memory_analysis()
  hlo = compiled.as_text()
  intra, inter, overlap = _split(collectives(hlo, engine.mesh), 1)
  peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
          + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  return Compiled(peak=peak, flops=matmul_flops(hlo), memory_bytes=memory_traffic(hlo),
                  intra_node_bytes=intra,
                  inter_node_bytes=inter, overlap=overlap, compile_s=time.perf_counter() - t0)


def compile_candidate(config: dict, target: str, devices: int, nodes: int, model: Any, *,
                      cache_dir: Path | None = None, memory_fraction: float = 0.75) -> Compiled:
  """The compiled step of ``config`` on ``target`` ("cpu": this process's devices; else a
  ``--gpu`` name for :func:`jzero.planning.aot.compile_for`, scheduled for a run that may use
  ``memory_fraction`` of the part's memory), from the cache when it is there. The config
  compiled is :func:`program_config`'s (a GPU target's: the device twin)."""
  config = program_config(config, target)
  cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
  path = cache / f"{_key(config, target, devices, nodes, model, memory_fraction)}.json"
  if path.is_file():
    return dataclasses.replace(Compiled(**json.loads(path.read_text())), cached=True)
  result = (_compile_cpu(config, model) if target == "cpu"
            else _compile_gpu(config, target, devices, nodes, model, memory_fraction))
  if not all(math.isfinite(v) for v in (result.peak, result.flops, result.memory_bytes,
                                         result.overlap)):
    return result
  cache.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(dataclasses.asdict(result)))
  tmp.replace(path)
  return result
