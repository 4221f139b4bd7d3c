"""Test setup, before the JAX backend starts: 8 simulated CPU devices, and XLA's CPU backend at
LLVM's optimisation level 0.

The level changes only how LLVM turns each fused kernel into machine code: the programs the tests
inspect -- HLO, fusion, buffer assignment, memory_analysis(), the collectives and their order --
are XLA's own passes and the same at every level. The suite's models are small, so compiling
dominates and O0 compiles about a third faster; float results round as another CPU's kernels
would, which every bound allows for (tests/isa_matrix.sh runs the float-sensitive tests at the
default level too). Subprocess tests inherit the flag through the environment. Set XLA_FLAGS with
any ``--xla_backend_optimization_level`` to choose another level.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import jzero  # noqa: E402,F401  (first: it imports JAX without the CUDA plugin's no-driver noise)
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
