"""Step timing shared by the benchmarks: several runs' steps timed in turn, under the same load."""

from __future__ import annotations

import time
from typing import Any


def time_round_robin(runs: dict[Any, dict], corpus: Any, first: int, steps: int) -> None:
  """Steps every run once in turn, ``steps`` times, on the corpus batches ``first``, ``first + 1``,
  ...; each step is blocked until its state is ready. A run is a dict with "engine" and "state"
  (replaced as it trains); each step's seconds go to its "times" list and its loss to "losses"."""
  import jax  # here: a benchmark configures JAX (platform, device count) before importing it

  for i in range(first, first + steps):
    for run in runs.values():
      engine = run["engine"]
      batch = engine.shard_batch(corpus.batch(i, engine.global_batch_size))
      t0 = time.perf_counter()
      run["state"], metrics = engine.train_step(run["state"], batch)
      jax.block_until_ready(run["state"])
      run["times"].append(time.perf_counter() - t0)
      run["losses"].append(float(metrics["loss"]))
