"""A user's own multi-process script repeats bit for bit (tests/user_script_worker.py).

The script is shaped as users write it, not as jzero's own workers are: it initialises
``jax.distributed`` itself with one CPU device per process, builds its own GPT (biases, learned
positions, an untied head, ``scan_layers`` over ``nnx.split`` blocks) and starts from given weights.
Run as 2 and as 4 processes, it trains stages 3, 2 and 1 twice each. Two runs must give the same
bits, losses and parameters: before reduce-scatters across processes went through an all-to-all
(:mod:`jzero.comm.collective_order`), gloo's reduce-scatter raced on the script's 1 MiB gradients
and two runs of stages 2 and 3 differed (parameters by 1e-3 to 6e-3 after these 4 steps, at 2 and
at 4 processes). The stages must also agree with each other, to rounding: runs that repeated a
wrong sum would not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from user_script_worker import RUNS, STAGES, STEPS
from zero_testing import SAME_MATH, free_port, max_relative_diff, subprocess_env

WORKER = Path(__file__).parents[1] / "user_script_worker.py"


@pytest.fixture(scope="module", params=[2, 4], ids=["2x1", "4x1"])
def job(request, tmp_path_factory) -> Path:
  """The script's output directory after a job of ``request.param`` processes."""
  out = tmp_path_factory.mktemp(f"user{request.param}")
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(request.param), str(port),
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env())
           for i in range(request.param)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"
  return out


def _run(out: Path, stage: int, run: int) -> dict[str, np.ndarray]:
  with np.load(out / f"stage{stage}_run{run}.npz") as f:
    return {k: f[k] for k in f.files}


@pytest.mark.parametrize("stage", STAGES)
def test_two_runs_give_the_same_bits(job, stage):
  first, *others = [_run(job, stage, r) for r in range(RUNS)]
  assert len(first["losses"]) == STEPS and np.isfinite(first["losses"]).all()
  for other in others:
    assert first.keys() == other.keys()
    for name in first:
      assert first[name].tobytes() == other[name].tobytes(), name


def test_the_stages_agree(job):
  """Stages differ only in where the sums run (SAME_MATH's sources)."""
  runs = {stage: _run(job, stage, 0) for stage in STAGES}
  for stage in STAGES[1:]:
    np.testing.assert_allclose(runs[stage]["losses"], runs[STAGES[0]]["losses"], rtol=SAME_MATH)
    diff = max_relative_diff({k: v for k, v in runs[stage].items() if k != "losses"},
                             {k: v for k, v in runs[STAGES[0]].items() if k != "losses"})
    print(f"BOUND user script stage {stage} vs stage {STAGES[0]}: measured {diff:.3g} <= bound "
          f"{SAME_MATH:g}")
    assert diff <= SAME_MATH
