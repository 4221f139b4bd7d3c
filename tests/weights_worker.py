"""One process of the sharded weight-load test (tests/checkpoint/test_weights.py); not a test
module itself.

Usage: python weights_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS WEIGHTS OUT_DIR

Joins a ``jax.distributed`` job over gloo with DEVICES_PER_PROCESS CPU devices, builds a ZeRO-3
engine of :class:`Wide` (about 36 MB of fp32 weights) on one data axis over every device, then:

* loads WEIGHTS with ``checkpoint.load_weights``, counting the bytes of every region it reads from
  the files (``weights._read_region``) per leaf, and measuring the peak resident memory of the load
  (Linux: ``/proc/self/clear_refs`` resets VmHWM right after VmRSS is read; the peak is VmHWM
  after the load minus that VmRSS);
* builds the train state from it, and from the whole-file path (``read_weights`` into numpy, as
  ``load_weights`` did before it read by shard), and compares the two states' local shards bit for
  bit.

Writes OUT_DIR/weights_<id>.json: per leaf the bytes read, the leaf's bytes and whether its param is
partitioned; the bytes this process's devices hold of the params; the peak; the comparison.
"""

from __future__ import annotations

import json
import math
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
from flax import nnx  # noqa: E402


class Wide(nnx.Module):
  """Three dense layers: kernels split along dim 0 ([1024, 4000], [4000, 1021]) and, as neither
  dimension divides by 4, along a padded dim 1 ([1021, 1023]); the biases stay replicated
  (stage 3's persistence threshold)."""

  def __init__(self, rngs: nnx.Rngs):
    self.a = nnx.Linear(1024, 4000, rngs=rngs)
    self.b = nnx.Linear(4000, 1021, rngs=rngs)
    self.c = nnx.Linear(1021, 1023, rngs=rngs)

  def __call__(self, x):
    return self.c(self.b(self.a(x)))


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def main(process_id: int, num_processes: int, port: int, devices: int, weights: str,
         out: str) -> None:
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id, initialization_timeout=120)
  import jax.numpy as jnp
  import numpy as np

  import jzero
  from jzero import checkpoint
  from jzero.checkpoint import weights as weights_lib
  from jzero.sharding.plan import flatten_paths
  from zero_testing import ds_config

  engine = jzero.initialize(Wide, lambda model, batch: jnp.mean(model(batch["x"]) ** 2),
                            ds_config(3))
  engine.make_plan()  # the plan, before the measured load
  read: dict[str, int] = {}
  read_region = weights_lib._read_region

  def counting(f, name, region, shape):
    x = read_region(f, name, region, shape)
    read[name] = read.get(name, 0) + x.nbytes
    return x

  weights_lib._read_region = counting
  before = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
  params = engine.load_weights(weights)
  peak = _status("VmHWM") - before
  held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
  key = jax.random.key(0)
  state = engine.init(key, params=params)
  del params
  whole = checkpoint.read_weights(weights)
  model = engine.model.abstract_params(key, None)
  reference = engine.init(key, params=jax.tree.unflatten(jax.tree.structure(model), [
      np.asarray(whole[p], x.dtype) for p, x in flatten_paths(model).items()]))
  equal = all(np.array_equal(np.asarray(a.data), np.asarray(b.data), equal_nan=True)
              and a.index == b.index
              for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(reference))
              for a, b in zip(x.addressable_shards, y.addressable_shards))
  leaves = {leaf.path: {"read": read.get(leaf.path, 0), "bytes": 4 * math.prod(leaf.shape),
                        "partitioned": leaf.param_partitioned}
            for leaf in engine.plan.leaf_list()}
  with open(os.path.join(out, f"weights_{process_id}.json"), "w") as f:
    json.dump({"leaves": leaves, "held": held, "peak": peak, "equal": equal,
               "processes": jax.process_count(), "devices": jax.device_count()}, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
       sys.argv[6])
