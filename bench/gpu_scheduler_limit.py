"""On one real GPU: the memory XLA's GPU compiler plans with, and jzero's scheduler option.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python bench/gpu_scheduler_limit.py

``jzero aot`` compiles for a part that is not present, where XLA takes 80% of the part's memory as
the module's; it assumes that on the GPU jaxlib hands the compiler the allocator's pool instead
(``ExecutableBuildOptions.device_memory_size`` = the device's ``bytes_limit``), and sets the
scheduler's slop factor for a compile without the device so that its limit is the run's
(:func:`jzero.comm.program.scheduler_slop_for`). This script checks both on the device it runs on:

1. the compiler knows ``xla_gpu_memory_limit_slop_factor`` (jzero probes it; this jax's name);
2. the memory limit XLA's rematerialization reports for a module that cannot fit -- the module's
   device memory, which the scheduler's limit starts from -- is the pool (``bytes_limit``, half the
   card with the fraction above) and not the card's (compiled for a part that is not present, the
   same program reports the part's whole memory: 84,978,434,112 B for an H100).

Compiles only: nothing runs on the device but a one-element probe. Prints one line per check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

CHILD = """
import jax, jax.numpy as jnp
pool = jax.devices()[0].memory_stats()["bytes_limit"]
n = int(pool // 4 // 6)  # float32 elements: each output a sixth of the pool, twelve of them
f = jax.jit(lambda x: tuple(jnp.cumsum(x * (i + 1)) for i in range(12)))
f.lower(jax.ShapeDtypeStruct((n,), jnp.float32)).compile()
print("POOL", pool)
"""


def main() -> int:
  import jax

  from jzero.comm import program

  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  print(f"jax {jax.__version__}, {device.device_kind}, bytes_limit {stats.get('bytes_limit')}, "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')}")
  known = program.supported(device, {program.SLOP_OPTION: program.SCHEDULER_POOL_PERCENT})
  print(f"1. {program.SLOP_OPTION}: {'known' if known else 'UNKNOWN'} to this compiler")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
  out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                       timeout=600)
  pool = re.search(r"POOL (\d+)", out.stdout)
  limit = re.search(r"Can't reduce memory use below [\d.]+\w+ \((\d+) bytes\)", out.stderr)
  if pool is None or limit is None:
    print("2. no rematerialization limit in the log:", out.stderr[-2000:])
    return 1
  pool_b, limit_b = int(pool.group(1)), int(limit.group(1))
  is_pool = abs(limit_b / pool_b - 1) < 0.02
  print(f"2. rematerialization limit {limit_b:,} B = {limit_b / pool_b:.3f} x the pool "
        f"({pool_b:,} B): {'the pool' if is_pool else 'NOT the pool'}")
  return 0 if known and is_pool else 1


if __name__ == "__main__":
  sys.exit(main())
