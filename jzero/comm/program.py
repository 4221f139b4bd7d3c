"""How a program over the plan's mesh is built and compiled so its collectives behave as ZeRO says.

Every jitted program of jzero whose body runs per device -- the train step, the hpZ refresh, the
evaluation, the NVMe store's update -- is ``jax.jit(shard_map(body))`` with the options of this
module:

* :func:`shard_map`: ``jax.shard_map`` over the plan's mesh; across the CPU devices of several
  processes with the body's collectives chained into one order, so every process pairs the same
  ones (:mod:`jzero.comm.collective_order`).
* :func:`compile_options`: the XLA options that carry DeepSpeed's bucket and overlap knobs on GPU,
  and on CPU the options that keep ZeRO's memory promise (:data:`CPU_OPTIONS`).

**The scheduler's memory limit.** XLA's GPU latency-hiding scheduler (``gpu_hlo_schedule.cc``)
plans against a memory limit: the module's device memory -- on a GPU the allocator's pool, which
jaxlib's compile hands XLA (the device's ``bytes_limit``), or 80% of the part's memory where no
device is present (a compile-only topology) -- less the bytes of the inputs and outputs that are
not donated, times ``xla_gpu_memory_limit_slop_factor`` / 100 (95 by default). While its count of
the live bytes is over the limit, its memory rules come before its overlap rules: it places a
collective's start right next to its done, and the pair runs synchronously. A while loop's body
starts its count with everything live at the loop's call site, so the gradient-accumulation loop
(which carries the fp32 gradient accumulator) reaches the limit long before the same code outside
it. With ``overlap_comm`` jzero sets the slop factor to :data:`SCHEDULER_POOL_PERCENT`: the
scheduler may plan with the whole pool less the resident state. Its count runs above what the
compiled step holds, so the step stays within the pool: ZeRO-3 of a 10B model on 8 A100-40GB at
micro-batch 1 x 4, 95% of the card in the pool, overlaps everything once the limit is 21-22 GB,
while its compiled temporaries are 16.4 GB; it has a matmul in flight for 69% of its collective
bytes with jzero's factor and 43% with XLA's 95, at a peak of 85% of the pool either way
(docs/planning.md, "ZeRO-3's overlap where memory is tight").
``jzero aot`` compiles without the device and sets the factor that gives XLA the limit a run with
its memory fraction has (:func:`scheduler_slop_for`). A factor named in ``XLA_FLAGS`` is the
user's and left alone.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jzero.comm import collective_order
from jzero.errors import JZeroWarning

__all__ = ["CPU_OPTIONS", "SCHEDULER_POOL_PERCENT", "XLA_DEFAULT_SLOP_PERCENT", "compile_options",
           "per_device", "prefetches", "scheduler_slop_for", "shard_map", "supported"]

#: xla_gpu_memory_limit_slop_factor jzero passes with overlap_comm: the scheduler's limit is the
#: whole pool less the resident state (module docstring).
SCHEDULER_POOL_PERCENT = 100
#: XLA's own default of xla_gpu_memory_limit_slop_factor (debug_options_flags.cc).
XLA_DEFAULT_SLOP_PERCENT = 95
#: The share of the part's memory XLA's GPU compiler takes as the module's when no device is
#: present to give the allocator's pool (gpu_hlo_schedule.cc, GetSchedulerMemoryLimit).
XLA_COMPILE_ONLY_MEMORY_SHARE = 0.8
SLOP_OPTION = "xla_gpu_memory_limit_slop_factor"

# The CPU compiler expands optimization barriers before common-subexpression elimination, which
# then merges each backward re-gather (rematerialised behind JAX's barrier) with the forward gather
# it repeats: the gathered parameters stay alive until backward. Keeping the barriers keeps the
# re-gathers. (Its memory-optimised scheduler, `xla_cpu_scheduler_type`, would order the gathers
# too, but with it this jaxlib's CPU runtime was seen to run different collectives on different
# devices at once and deadlock; jzero.modeling.gather_units orders them with data dependencies
# instead.) The GPU compiler keeps the re-gathers and needs neither.
CPU_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


@functools.lru_cache(maxsize=None)
def _cpu_options() -> dict[str, Any]:
  """:data:`CPU_OPTIONS`, or {} where this jaxlib's CPU compiler does not know them (one probe
  compile per process, the first time a CPU program is built)."""
  try:
    probe = jax.device_put(jnp.zeros(()), jax.devices("cpu")[0])
    jax.jit(lambda x: x + 1).lower(probe).compile(compiler_options=CPU_OPTIONS)
  except Exception:  # pylint: disable=broad-except  (unknown option names or values)
    return {}
  return dict(CPU_OPTIONS)


def shard_map(plan: Any, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Callable:
  """``jax.shard_map`` of ``fn`` over ``plan``'s mesh (:class:`jzero.sharding.plan.Plan`); across
  CPU processes with its collectives chained into one order."""
  mesh = plan.mesh.mesh
  body = collective_order.in_one_order(fn) if collective_order.needed(mesh) else fn
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def per_device(plan: Any, inside: bool, fn: Callable[..., Any], in_specs: Any,
               out_specs: Any) -> Callable:
  """``fn``, a function of one device's blocks, callable where the caller is: ``fn`` itself
  ``inside`` a ``shard_map`` over the plan's mesh (the step's), else a :func:`shard_map` of it
  (on global arrays, inside a jit: the update's whole view, :mod:`jzero.sharding.opt_layout`)."""
  return fn if inside else shard_map(plan, fn, in_specs, out_specs)


def compile_options(plan: Any) -> dict[str, Any]:
  """XLA compile options that carry DeepSpeed's bucket and overlap knobs for ``plan``.

  XLA's collective combiners merge independent collectives up to a byte threshold -- exactly what
  DeepSpeed's buckets do by hand: ``reduce_bucket_size`` bounds the combined reduce-scatters and
  all-reduces, the gather bucket the combined all-gathers, all in elements of the full
  (unpartitioned) buffers, as DeepSpeed counts them. XLA's reduce-scatter threshold bounds the
  scattered result, so it gets the bucket's bytes divided by the ZeRO size. ``overlap_comm`` on
  keeps collectives asynchronous (the latency-hiding scheduler places compute between each start
  and done) and, in stage 3 with a non-zero prefetch bucket, pipelines the layer scan's
  all-gathers, so the next layer's parameters are gathered while this layer computes (DeepSpeed's
  prefetch). Off makes every collective synchronous. These passes exist in the GPU compiler; the
  CPU backend has none of them (and may run independent collectives at once, which
  :func:`shard_map` prevents by chaining them), so the options are only passed when compiling for
  GPU. ``jzero aot`` shows their effect on the scheduled program. With ``overlap_comm`` the
  latency-hiding scheduler plans with the whole memory pool (:data:`SCHEDULER_POOL_PERCENT`; the
  module docstring says why), and stage 3 prefetches when the plan does
  (:attr:`jzero.sharding.plan.Plan.prefetch`: ``stage3_prefetch_bucket_size`` and
  ``stage3_max_live_parameters``).

  On CPU a program gets the options that make XLA keep ZeRO's memory promise
  (:data:`CPU_OPTIONS`), where this jaxlib knows them.
  """
  platform = plan.mesh.mesh.devices.flat[0].platform
  if platform == "cpu":
    return _cpu_options()
  if platform != "gpu":
    return {}
  reduce_bytes = plan.reduce_bucket_size * jnp.dtype(plan.comm_dtype).itemsize
  options: dict[str, Any] = {
      "xla_gpu_reduce_scatter_combine_threshold_bytes": reduce_bytes // plan.mesh.zero_size,
      "xla_gpu_all_reduce_combine_threshold_bytes": reduce_bytes,
      "xla_gpu_all_gather_combine_threshold_bytes":
          plan.gather_bucket_size * jnp.dtype(plan.compute_dtype).itemsize,
  }
  if not plan.overlap_comm:
    options["xla_gpu_disable_async_collectives"] = "ALLCOLLECTIVES"
    return options
  options["xla_gpu_enable_latency_hiding_scheduler"] = True
  if not _user_flag(SLOP_OPTION):
    options[SLOP_OPTION] = SCHEDULER_POOL_PERCENT
  if plan.prefetch:
    options["xla_gpu_enable_pipelined_all_gather"] = True
  return supported(plan.mesh.mesh.devices.flat[0], options)


def _user_flag(name: str) -> bool:
  """``XLA_FLAGS`` sets the XLA option ``name`` (then the user's value applies, not jzero's)."""
  return re.search(rf"--{name}(=|\s|$)", os.environ.get("XLA_FLAGS", "")) is not None


def scheduler_slop_for(slop_percent: int, pool_bytes: float, device_bytes: float,
                       io_bytes: float) -> int:
  """The ``xla_gpu_memory_limit_slop_factor`` that gives a compile without the device the
  scheduler's memory limit a run on the device would have with ``slop_percent``.

  On the device XLA's limit is ``(pool - io) x slop / 100`` (the allocator's pool, ``pool_bytes``:
  the part's memory times the memory fraction); compiling for a part that is not present it is
  ``(0.8 x device - io) x slop' / 100``. ``io_bytes``: the step's inputs and outputs that are not
  donated (arguments + outputs - aliased). Rounded down, at least 1.
  """
  base = XLA_COMPILE_ONLY_MEMORY_SHARE * device_bytes - io_bytes
  if base <= 0:
    return slop_percent
  return max(1, math.floor(slop_percent * (pool_bytes - io_bytes) / base))


_UNKNOWN_OPTION = re.compile(r"No such compile option: '(\w+)'")


@functools.lru_cache(maxsize=None)
def _known_options(device: Any, options: tuple[tuple[str, Any], ...]) -> frozenset[str]:
  """The names of ``options`` (name, value pairs) the compiler of ``device`` knows: XLA renames and
  retires its GPU options between releases (``xla_gpu_enable_pipelined_all_gather`` is gone from
  jax 0.11's), and an unknown one fails the compile. One probe compile per device and option set,
  with the options' own values; each option dropped is said once (a JZeroWarning naming it and
  what it carried)."""
  probe = jax.ShapeDtypeStruct((), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  values = dict(options)
  known = set(values)
  while known:
    try:
      jax.jit(lambda x: x + 1).lower(probe).compile(
          compiler_options={n: values[n] for n in known})
      break
    except Exception as e:  # pylint: disable=broad-except  (the compiler's own error type)
      unknown = _UNKNOWN_OPTION.search(str(e))
      if unknown is None or unknown.group(1) not in known:
        raise
      known.discard(unknown.group(1))
      warnings.warn(f"XLA's compiler for {device.platform} (jax {jax.__version__}) has no option "
                    f"{unknown.group(1)!r}; jzero compiles without it "
                    f"({_CARRIES.get(unknown.group(1), 'an XLA tuning option')}).",
                    JZeroWarning, stacklevel=2)
  return frozenset(known)


# What each GPU option carries, for the warning when a compiler no longer knows it.
_CARRIES = {
    "xla_gpu_enable_pipelined_all_gather": "ZeRO-3's prefetch of the next layer's parameters "
                                           "(stage3_prefetch_bucket_size); XLA's own default "
                                           "pipelining applies",
    "xla_gpu_enable_latency_hiding_scheduler": "overlap_comm's scheduling of compute between "
                                               "each collective's start and done",
    "xla_gpu_disable_async_collectives": "overlap_comm: false (synchronous collectives)",
    SLOP_OPTION: "the latency-hiding scheduler's memory limit at the whole pool; XLA plans with "
                 "95% of it, and runs more collectives synchronously where memory is tight",
}


def supported(device: Any, options: dict[str, Any]) -> dict[str, Any]:
  """The ``options`` the compiler of ``device`` knows (the others dropped, each said once)."""
  known = _known_options(device, tuple(options.items()))
  return {name: value for name, value in options.items() if name in known}


def prefetches(plan: Any) -> bool:
  """XLA gathers the next layer while this one computes (GPU, see :func:`compile_options`)."""
  return bool(compile_options(plan).get("xla_gpu_enable_pipelined_all_gather"))
