"""One process of tests/comm/test_collective_order.py's multi-process runs; not a test module
itself.

Usage: python collective_order_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT_DIR

Joins a ``jax.distributed`` job over gloo on 127.0.0.1 (one process: no job, the same devices
locally), then for ZeRO stages 0-3 with no gradient clipping and 2 accumulation steps -- the
configuration whose collectives nothing else happens to serialise -- trains STEPS steps twice from
the same start. Process 0 writes every run's losses and final logical params to
OUT_DIR/stage<S>_run<R>.npz.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

STEPS = 4
BATCH = 16
RUNS = 2
STAGES = (0, 1, 2, 3)


def model_config():
  from jzero.models import GPTConfig
  # Big enough that a layer's compute overlaps its collectives (the small test GPT rarely races).
  return GPTConfig(d_model=128, n_layers=2, n_heads=4, seq_len=64)


def main(process_id: int, num_processes: int, port: int, devices: int, out: str) -> None:
  jax.config.update("jax_num_cpu_devices", devices)
  if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
  import numpy as np
  import jzero
  from jzero.comm import collective_order
  from jzero.models import lm_loss
  from jzero.sharding.plan import flatten_paths
  from zero_testing import batches, ds_config, gpt_factory

  cfg = model_config()
  data = batches(cfg.seq_len, BATCH, STEPS)
  for stage in STAGES:
    config = ds_config(stage, micro=BATCH // jax.device_count() // 2, gas=2)
    config["gradient_clipping"] = 0.0
    engine = jzero.initialize(gpt_factory(cfg), lm_loss, config)
    for run in range(RUNS):
      state = engine.init(jax.random.key(0))
      assert collective_order.needed(engine.plan.mesh.mesh) == (num_processes > 1)
      losses = []
      for batch in data:
        state, metrics = engine.train_step(state, engine.shard_batch(batch))
        losses.append(float(metrics["loss"]))
      params = flatten_paths(jax.tree.map(np.asarray, engine.logical_params(state)))
      if process_id == 0:
        np.savez(os.path.join(out, f"stage{stage}_run{run}.npz"), losses=np.array(losses),
                 **params)
  if num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  pid, nproc, port, ndev = map(int, sys.argv[1:5])
  main(pid, nproc, port, ndev, sys.argv[5])
