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
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import jzero  # noqa: E402,F401  (first: it imports JAX without the CUDA plugin's no-driver noise)
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


from suite_tiers import LONGEST_FIRST, SLOW  # noqa: E402  (no JAX: the tier test reads it too)


def pytest_collection_modifyitems(config, items):
  tests = Path(__file__).parent
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))
  for item in items:
    if item.path.relative_to(tests).as_posix() in SLOW:
      item.add_marker(pytest.mark.slow)
