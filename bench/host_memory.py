"""Benchmark: host memory per process, predicted before training vs measured (RSS), per offload mode.

  python bench/host_memory.py [--devices 8] [--out bench/out]

DeepSpeed's offload users run out of host RAM (DeepSpeed #4571, #3860); jzero prints the host bytes
a process will hold before training starts (``jzero train``). This checks that prediction against
the process's resident memory: each mode runs in its own fresh process, which builds the default
job's engine (jzero.models.GPT's default 6.4M-parameter model, fp32), creates the train state
(``engine.init``) and runs one step, then deletes the state and reads how much resident memory that
frees (Linux ``/proc/self/status`` VmRSS; the child runs with glibc's ``MALLOC_MMAP_THRESHOLD_``
lowered, so every buffer of 4 kB or more is its own mapping and freeing it returns it).

Per mode one row: the model-state bytes per process the estimator predicts (params, fp32 master and
optimizer state, every tier: the train state's arrays; the gradient is a temporary of the step),
the host-tier share of it, the same bytes measured from the live arrays' shards (all local
devices, by memory kind), and the RSS the state's deletion freed. On CPU every tier is the same
RAM, so RSS sees device and host bytes alike: the comparison checks the total a process holds, and
the host column checks which part of it the plan put in host memory. Writes ``host_memory.json``
and ``host_memory.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# mode -> (stage, zero_optimization additions)
MODES = {
    "ZeRO-2, no offload": (2, {}),
    "ZeRO-2, optimizer -> cpu": (2, {"offload_optimizer": {"device": "cpu", "update": "stream"}}),
    "ZeRO-3, no offload": (3, {"stage3_param_persistence_threshold": 0}),
    "ZeRO-3, optimizer + params -> cpu": (3, {"stage3_param_persistence_threshold": 0,
                                              "offload_optimizer": {"device": "cpu",
                                                                    "update": "stream"},
                                              "offload_param": {"device": "cpu"}}),
}
STATE_CATEGORIES = ("params", "master", "optimizer")
# glibc serves allocations from this size up with their own mmap, and a free returns them to the
# OS; without it the small partitions of ZeRO-3 stay in malloc's arenas and RSS never drops.
MMAP_THRESHOLD = 4096


def child_env() -> dict[str, str]:
  """The environment of a measuring child process: glibc's mmap threshold lowered (above)."""
  return dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))


def rss() -> int:
  """This process's resident set size in bytes (Linux VmRSS)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status (this benchmark needs Linux)")


def _child(mode: str, devices: int) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import gc

  import jax
  jax.config.update("jax_num_cpu_devices", devices)
  import jzero
  from jzero.runtime.data import ByteCorpus
  from jzero.models import GPT, GPTConfig, lm_loss

  stage, zero = MODES[mode]
  cfg = GPTConfig()
  config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW",
                                                              "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, **zero}}
  engine = jzero.initialize(lambda rngs: GPT(cfg, rngs=rngs), lm_loss, config)
  corpus = ByteCorpus.load(None, seq_len=cfg.seq_len, max_bytes=1 << 20)
  state = engine.init(jax.random.key(0))
  state, metrics = engine.train_step(state, engine.shard_batch(corpus.batch(0, devices)))
  float(metrics["loss"])
  report = engine.memory_report(state)
  local = jax.local_device_count()
  predicted = sum(report.predicted.get(c, 0.0) for c in STATE_CATEGORIES) * local
  host_tiers = ("pinned_host", "unpinned_host")
  measured_by_kind: dict[str, int] = {}
  for x in jax.tree.leaves(state):
    for shard in x.addressable_shards:
      kind = x.sharding.memory_kind or "device"
      measured_by_kind[kind] = measured_by_kind.get(kind, 0) + shard.data.nbytes
  predicted_host = report.estimate.tier_total("host") * local
  grads_host = report.estimate.bytes["host"].get("grads", 0.0) * local
  gc.collect()
  before = rss()
  del state, metrics
  gc.collect()
  freed = before - rss()
  return {"mode": mode, "local_devices": local, "predicted_state_bytes": predicted,
          "predicted_host_bytes": predicted_host - grads_host,
          "measured_state_bytes": sum(measured_by_kind.values()),
          "measured_host_bytes": sum(v for k, v in measured_by_kind.items() if k in host_tiers),
          "rss_freed_bytes": freed, "params": sum(l.numel for l in engine.plan.leaf_list())}


def _mb(x: float) -> str:
  return f"{x / 1e6:.2f} MB"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--out", default="bench/out")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print(json.dumps(_child(args.child, args.devices)))
    return 0
  rows = []
  for mode in MODES:
    print(f"-- {mode}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--devices",
                           str(args.devices)], capture_output=True, text=True, check=False,
                          env=child_env())
    if done.returncode:
      sys.stderr.write(done.stderr[-3000:])
      return done.returncode
    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
  header = ("| mode | predicted state / process | measured (live arrays) | RSS freed | RSS ÷ "
            "predicted | predicted host | measured host |")
  lines = [header, "|" + "---|" * 7]
  for r in rows:
    lines.append(f"| {r['mode']} | {_mb(r['predicted_state_bytes'])} | "
                 f"{_mb(r['measured_state_bytes'])} | {_mb(r['rss_freed_bytes'])} | "
                 f"{r['rss_freed_bytes'] / r['predicted_state_bytes']:.2f} | "
                 f"{_mb(r['predicted_host_bytes'])} | {_mb(r['measured_host_bytes'])} |")
  table = "\n".join(lines)
  print(f"default GPT ({rows[0]['params']:,} params), fp32, {rows[0]['local_devices']} simulated "
        f"CPU devices in one process\n{table}")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "host_memory.json").write_text(json.dumps(rows, indent=2))
  (out / "host_memory.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
