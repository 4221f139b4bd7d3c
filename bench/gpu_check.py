"""What only a GPU can show: the Pallas kernels compiled by Triton, and the step with real host
memory and an NVMe store, on one CUDA device.

  python bench/gpu_check.py [--steps 30] [--out DIR]

1. **Kernels.** The qwZ / qgZ block kernels (:mod:`jzero.kernels.ops`, ``impl="pallas"``, compiled
   by Triton on the GPU) against the jnp reference, bit for bit (NaNs equal whatever their
   payload): int8 and int4 quantize (both rules, fp32 and bf16 inputs with inf / nan blocks),
   dequantize, dequantize-sum and requantize-sum. The claim is equality with the reference
   compiled for the same GPU (both divide with ``div.full.f32``, kernels/pallas.py); the count
   against the reference on the host CPU (exact division) is printed beside it.
2. **Steps.** The default job (the embedded GPT, configs/zero3.json) on one GPU, ``--steps`` steps
   per variant, fp32 matmuls at "highest" precision and XLA's deterministic GPU ops: ZeRO stage 0
   and 3 in fp32 (one device: the same math, so the same losses),
   bf16, and bf16 with the optimizer in pinned host memory (streamed through the GPU, and updated
   on the host's CPU), the parameters in host memory, and the optimizer state in an NVMe store. Prints each variant's losses against its reference and the
   median step time; writes ``gpu_check.json`` to ``--out``.

Exits 1 when a kernel differs from the reference on the GPU or a variant's losses differ from its
reference: bitwise, with fp32 matmuls at "highest" precision and deterministic GPU reductions (with
the GPU's defaults, TF32 matmuls and atomics, two runs of the same stage-0 job differ by 5e-5).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from plan_validation import train_default_gpt  # bench/, beside this script


def kernel_checks() -> list[tuple[str, int, int]]:
  """(check, elements where the GPU's Pallas kernel differs from the jnp reference on the GPU,
  elements where it differs from the reference on the host CPU) per kernel. Equal means the same
  bits, except that any two NaNs are equal (GPU and CPU write different NaN payloads)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jzero.kernels import ops  # noqa: PLC0415

  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
  rng = np.random.default_rng(0)
  results = []

  def differing(a, b) -> int:
    count = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      x, y = np.asarray(x), np.asarray(y)
      bits = x.view(np.uint8).reshape(x.shape + (-1,)) != y.view(np.uint8).reshape(y.shape + (-1,))
      diff = bits.any(axis=-1)
      if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
        diff &= ~(np.isnan(x.astype(np.float32)) & np.isnan(y.astype(np.float32)))
      count += int(diff.sum())
    return count

  def on(device, fn, *args):
    with jax.default_device(device):
      return jax.device_get(jax.jit(fn)(*jax.device_put(args, device)))

  def check(name, fn, *args):
    kernel = on(gpu, lambda *a: fn(*a, impl="pallas"), *args)
    results.append((name, differing(kernel, on(gpu, lambda *a: fn(*a, impl="jnp"), *args)),
                    differing(kernel, on(cpu, lambda *a: fn(*a, impl="jnp"), *args))))

  for dtype in (jnp.float32, jnp.bfloat16):
    x = rng.standard_normal((6, 1000)).astype(np.float32) * rng.uniform(1e-3, 1e3, (6, 1))
    x[1, 7], x[2, 40], x[3, 3] = np.inf, -np.inf, np.nan
    x = np.asarray(jnp.asarray(x, dtype))
    for bits in (8, 4):
      for rule in ("deepspeed", "no_clip"):
        tag = f"int{bits} {rule} {jnp.dtype(dtype).name}"
        check(f"quantize {tag}", lambda v, impl: ops.quantize(
            v, bits=bits, group_size=128, rule=rule, impl=impl), x)
        check(f"dequantize {tag}", lambda v, impl: ops.dequantize(ops.quantize(
            v, bits=bits, group_size=128, rule=rule, impl=impl), jnp.float32, impl=impl), x)
  stack = rng.standard_normal((4, 8, 600)).astype(np.float32)
  for bits, out_bits in ((8, 4), (4, 4)):
    def sums(v, impl):
      q = ops.quantize(v, bits=bits, group_size=96, batch_dims=1, impl=impl)
      return ops.dequantize_sum(q, impl=impl), ops.requantize_sum(q, out_bits, impl=impl)
    check(f"dequantize_sum / requantize_sum int{bits} -> int{out_bits}", sums, stack)
  return results


VARIANTS = {
    # name: (reference variant, relative tolerance, changes to configs/zero3.json)
    "stage 0 fp32": (None, 0.0, {"zero_optimization": {"stage": 0}}),
    "stage 3 fp32": ("stage 0 fp32", 0.0, {}),
    "stage 3 bf16": (None, 0.0, {"bf16": {"enabled": True}}),
    "stage 3 bf16, optimizer cpu, streamed": ("stage 3 bf16", 0.0, {
        "bf16": {"enabled": True},
        "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                    "update": "stream"}}}),
    # device: cpu as DeepSpeed configs write it: the host Adam (numpy on the host's cores), whose
    # float math is not the GPU's either
    "stage 3 bf16, optimizer cpu": ("stage 3 bf16", 1e-3, {
        "bf16": {"enabled": True},
        "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}),
    # the update runs on the host's CPU (XLA:CPU), whose float math is not the GPU's: the same
    # steps, not the same bits (the 1.3B model of bench/offload.py: 2.0e-5 after 7 steps)
    "stage 3 bf16, optimizer cpu, host update": ("stage 3 bf16", 1e-3, {
        "bf16": {"enabled": True},
        "zero_optimization": {"offload_optimizer": {"device": "cpu", "update": "host"}}}),
    "stage 3 bf16, params cpu": ("stage 3 bf16", 0.0, {
        "bf16": {"enabled": True},
        "zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True}}}),
    "stage 3 bf16, optimizer nvme": ("stage 3 bf16", 0.0, {
        "bf16": {"enabled": True},
        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}}),
}


def _merged(base: dict, change: dict, nvme: str) -> dict:
  out = copy.deepcopy(base)
  for key, value in change.items():
    if isinstance(value, dict):
      out[key] = _merged(out.get(key, {}), value, nvme)
    else:
      out[key] = nvme if value == "NVME" else value
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--out", default="bench/out")
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_deterministic_ops=true")
  import jax  # noqa: PLC0415

  # fp32 matmuls in fp32 (the GPU's default is TF32) and deterministic reductions: the stages can
  # then be held to the same losses
  jax.config.update("jax_default_matmul_precision", "highest")
  print(f"jax {jax.__version__}, {jax.devices()}", flush=True)
  if jax.default_backend() != "gpu":
    print("gpu_check: no CUDA device (jax.default_backend() is "
          f"{jax.default_backend()!r})", file=sys.stderr)
    return 2
  ok = True
  report: dict = {"jax": jax.__version__, "device": str(jax.devices()[0]), "kernels": {},
                  "variants": {}}
  for name, vs_gpu, vs_cpu in kernel_checks():
    print(f"kernel {name}: differs from the jnp reference in {vs_gpu} elements on the GPU, "
          f"{vs_cpu} on the CPU", flush=True)
    report["kernels"][name] = {"vs_gpu_reference": vs_gpu, "vs_cpu_reference": vs_cpu}
    ok &= vs_gpu == 0
  base = json.loads((Path(__file__).parents[1] / "configs" / "zero3.json").read_text())
  results = {}
  with tempfile.TemporaryDirectory() as nvme:
    for name, (ref, tol, change) in VARIANTS.items():
      losses, times = train_default_gpt(_merged(base, change, nvme), args.steps)
      results[name] = losses
      line = (f"{name}: first {losses[0]:.6f} last {losses[-1]:.6f}, median step "
              f"{statistics.median(times[2:]) * 1e3:.2f} ms")
      entry = {"losses": losses, "median_step_s": statistics.median(times[2:])}
      if ref is not None:
        err = float(np.max(np.abs(np.subtract(losses, results[ref])) / np.abs(results[ref])))
        passed = err <= tol and all(np.isfinite(losses))
        line += f"; max rel diff vs {ref}: {err:.3g} (allowed {tol:g}){'' if passed else ' FAIL'}"
        entry["max_rel_diff"] = err
        ok &= passed
      print(line, flush=True)
      report["variants"][name] = entry
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
