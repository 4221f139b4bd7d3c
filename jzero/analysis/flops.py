"""The two numbers model FLOPs utilization divides: a step's FLOPs and the peak of the hardware.

**FLOPs per step** (:func:`step_flops`) are read from the compiled step: the matrix
multiplications of its optimized HLO, each counted as many times as it runs
(:func:`jzero.analysis.hlo.matmul_flops`). That is one device's program under SPMD, so the count
is per device, and it includes what XLA really computes: the recomputed forward under activation
checkpointing, the padding of uneven shards. XLA's own ``compiled.cost_analysis()["flops"]``
(jax 0.10: a dict with "flops", "bytes accessed", ...) counts the body of a ``while`` loop once,
so for jzero's scanned layers and micro-batches it reports one layer of one micro-batch; the
count here agrees with it on a program without loops (tests/train/test_monitor.py).

**The peak** (:func:`peak_flops`) is said with its source, because an MFU is only as good as it:

* NVIDIA GPUs: the dense (no sparsity) tensor-core peak of the part from NVIDIA's datasheets
  (:data:`GPU_PEAKS`): H100 SXM and H200 989.5 TFLOP/s bf16 / fp16, 494.5 tf32; H100 NVL 835.5 /
  417.5; H100 PCIe 756.5 / 378; A100 312 / 156; B200 2250 / 1125; L40S 362 / 183; L4 121 / 60
  (the datasheets' "with sparsity" figures halved); the GeForce RTX 4090 165.2 / 82.6 and RTX 3090
  71 / 35.6 (NVIDIA's Ada and GA102 whitepapers: fp16 / bf16 with fp32 accumulate, which GeForce
  parts run at half the fp16-accumulate rate), and the A10G 70 / 35 (the A10's GA102 at 80 SMs
  with GeForce's half-rate fp32 accumulate, as AWS and Baseten's A10 / A10G table list it).
  fp32 training counts tf32's peak: XLA's default precision runs fp32 matmuls on the tensor cores
  in tf32 on these parts.
* CPU: measured, once per process and dtype -- the best of three square matmuls in the step's
  compute dtype on the first CPU device, sized until one takes 20 ms (at most 2048). jzero's
  simulated CPU devices are one host's cores shared, so that is the peak of all the local devices
  together.
* anything else: unknown (None), and no MFU is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp

from jzero.analysis.hlo import matmul_flops

__all__ = ["GPU_PEAKS", "Peak", "peak_flops", "step_flops"]

# device_kind substring (first match wins) -> dense TFLOP/s per GPU: (bf16 / fp16, tf32).
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756.5, 378.0),
    ("H100 NVL", 835.5, 417.5),
    ("H100", 989.5, 494.5),  # SXM: device_kind "NVIDIA H100 80GB HBM3"
    ("H200", 989.5, 494.5),
    ("A100", 312.0, 156.0),
    ("B200", 2250.0, 1125.0),
    ("L40S", 362.05, 183.0),  # before "L4", its prefix
    ("L4", 121.0, 60.0),
    ("A10G", 70.0, 35.0),
    ("RTX 4090", 165.2, 82.6),
    ("RTX 3090", 71.0, 35.6),
)
_DATASHEET = "NVIDIA datasheet, dense"
_CPU_TARGET_S = 0.02  # a measuring matmul takes at least this long (or is 2048 wide)


@dataclasses.dataclass(frozen=True)
class Peak:
  """The peak FLOP/s of the devices this process drives, together, and where it comes from."""

  flops_per_second: float
  source: str

  def __str__(self) -> str:
    return f"{self.flops_per_second / 1e12:,.3g} TFLOP/s ({self.source})"


def step_flops(compiled: Any) -> float:
  """Matmul FLOPs one device does in one run of ``compiled`` (a ``jax.stages.Compiled``)."""
  return matmul_flops(compiled.as_text())


def peak_flops(compute_dtype: Any, devices: list[jax.Device] | None = None) -> Peak | None:
  """The peak of ``devices`` (default: this process's) for matmuls in ``compute_dtype``; None
  where no peak is known (a GPU missing from :data:`GPU_PEAKS`, a TPU)."""
  devices = devices or jax.local_devices()
  device, dtype = devices[0], jnp.dtype(compute_dtype)
  if device.platform == "cpu":
    return _measured_cpu_peak(dtype.name)
  if device.platform != "gpu":
    return None
  kind = device.device_kind
  for part, half, tf32 in GPU_PEAKS:
    if part in kind:
      per_device, precision = (tf32, "tf32") if dtype == jnp.float32 else (half, dtype.name)
      return Peak(per_device * 1e12 * len(devices),
                  f"{len(devices)} x {kind} {precision}: {per_device:g} TFLOP/s each, "
                  f"{_DATASHEET}")
  return None


@functools.cache
def _measured_cpu_peak(dtype_name: str) -> Peak:
  device = jax.devices("cpu")[0]
  matmul = jax.jit(lambda a, b: a @ b)
  size = 256
  while True:
    a = jax.device_put(jnp.ones((size, size), dtype_name), device)
    matmul(a, a).block_until_ready()  # compiles
    best = float("inf")
    for _ in range(3):
      t0 = time.perf_counter()
      matmul(a, a).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    if best >= _CPU_TARGET_S or size >= 2048:
      break
    size *= 2
  return Peak(2 * size**3 / best,
              f"measured on this host: best of 3 {size}x{size} {dtype_name} matmuls")
