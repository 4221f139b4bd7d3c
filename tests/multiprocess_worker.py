"""One process of the multi-process tests (tests/runtime/test_multiprocess.py); not a test module
itself.

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT_DIR
[zeropp | param-nvme]

Joins a ``jax.distributed`` job over gloo on 127.0.0.1 with DEVICES_PER_PROCESS CPU devices, then,
with ZeRO stage 3 on one data axis over every device of every process:
trains 2 steps, saves a checkpoint (each process writes its own shards), restores it into a fresh
state, trains 2 more steps and saves again. Process 0 writes the losses and the final logical
params to OUT_DIR/result.npz; every process writes the shapes of the shards it held to
OUT_DIR/shards_<id>.json. With ``zeropp`` the job runs ZeRO++ with qwZ, hpZ (one group per
process: the default mesh laid out as node = process x local) and qgZ (tests/comm/test_zeropp.py).
With ``param-nvme`` the partitions live on the NVMe tier (``offload_param: nvme`` under
OUT_DIR/nvme, every read from the disk; tests/tiers/test_param_nvme.py): each process reads and
writes its own devices' rows.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

STEPS = 4
BATCH = 8
STAGE3 = {"stage3_param_persistence_threshold": 0}  # partition every parameter, small ones too
ZEROPP = {**STAGE3, "zero_quantized_weights": True, "zero_hpz_partition_size": 4,
          "zero_quantized_gradients": True}


def param_nvme(out: str) -> dict:
  """The zero_optimization keys of the ``param-nvme`` job, its store under ``out``."""
  return {**STAGE3, "offload_param": {"device": "nvme", "nvme_path": os.path.join(out, "nvme"),
                                      "max_in_cpu": 0, "buffer_count": 2, "buffer_size": 10**5}}


def main(process_id: int, num_processes: int, port: int, devices: int, out: str,
         zero: dict = STAGE3) -> None:
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id, initialization_timeout=120)
  import numpy as np
  import jzero
  from jzero.models import lm_loss
  from jzero.sharding.plan import flatten_paths
  from zero_testing import SMALL, batches, ds_config, gpt_factory

  data = batches(SMALL.seq_len, BATCH, STEPS)
  engine = jzero.initialize(gpt_factory(SMALL), lm_loss,
                            ds_config(3, micro=BATCH // jax.device_count(), **zero))
  state = engine.init(jax.random.key(0))
  ckpt = os.path.join(out, "ckpt")
  losses = []
  for i, batch in enumerate(data):
    if i == STEPS // 2:
      engine.save_checkpoint(state, ckpt)
      engine.wait_for_checkpoints()
      state = engine.load_checkpoint(ckpt)
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  engine.save_checkpoint(state, ckpt)
  engine.wait_for_checkpoints()
  shards = {path: [list(s.data.shape) for s in x.addressable_shards]
            for path, x in flatten_paths(state.params).items()}
  held = {"local_devices": jax.local_device_count(), "global_devices": jax.device_count(),
          "shards": shards}
  store = engine.nvme_store
  if store is not None:  # its files go when the engine does: what this process's store held
    held["nvme"] = {"devices": [d.id for d in store.devices],
                    "directory": os.path.relpath(store.directory, out),
                    "disk_reads": store.reader.disk_reads if store.reader else 0}
  with open(os.path.join(out, f"shards_{process_id}.json"), "w") as f:
    json.dump(held, f)
  params = jax.tree.map(np.asarray, engine.logical_params(state))
  if process_id == 0:
    np.savez(os.path.join(out, "result.npz"), losses=np.array(losses),
             **{k: v for k, v in flatten_paths(params).items()})
  jax.distributed.shutdown()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  pid, nproc, port, ndev = map(int, sys.argv[1:5])
  mode = sys.argv[6] if len(sys.argv) > 6 else "stage3"
  main(pid, nproc, port, ndev, sys.argv[5],
       {"stage3": STAGE3, "zeropp": ZEROPP, "param-nvme": param_nvme(sys.argv[5])}[mode])
