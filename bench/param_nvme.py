"""Benchmark: parameters on the NVMe tier (jzero.tiers.nvme_params) -- step time next to the params on the
device and in host memory, prefetch on and off, and the tier's host memory (RSS) next to its bound.

  python bench/param_nvme.py [--nvme-path DIR] [--devices 8] [--layers 8] [--d-model 256]
                             [--steps 5] [--out bench/out]

1. Step time, ZeRO-3, fp32, the default GPT (micro-batch 1 per device, persistence threshold 0 so
   every matrix is partitioned), one process: no offload; ``offload_param: cpu``; the optimizer
   state alone on NVMe (pipelined; what the parameter tier's update costs too); ``offload_param:
   nvme`` with ``max_in_cpu`` large (every layer served from the host cache), alone and with the
   optimizer state on the host (``offload_optimizer: cpu``: ZeRO-Infinity's headline config); with
   ``max_in_cpu: 0`` (every layer read from the disk) with the prefetch on and off
   (``stage3_prefetch_bucket_size: 0``). Two warm-up steps each, then the runs' steps timed
   round-robin (bench/round_robin.py: the same load for all), median, ratio to no offload, the
   largest loss difference from no offload (exactness), and the reader's counters of the timed
   steps (layers read from disk / prefetched / from the cache).
2. Host memory: for ``max_in_cpu`` = all, half of the partitions, and 0, a fresh process trains two
   steps, then drops the reader's host cache and staging buffers; the RSS that frees (Linux VmRSS,
   glibc's mmap threshold lowered as in bench/host_memory.py) next to what the reader held and to
   the configured bound ``4 x (max_in_cpu + local devices x buffer_count x buffer_size)``.

Prints the tables and writes ``param_nvme.json`` / ``param_nvme.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host_memory import child_env, rss  # RSS as bench/host_memory.py measures it
from round_robin import time_round_robin

BUFFERS = {"buffer_count": 2, "buffer_size": 1_000_000}


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--nvme-path", default=None, help="directory on the disk to use (default: a "
                 "temporary directory under the system's temp dir)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--steps", type=int, default=5, help="timed steps per run (after 2 warm-up)")
  p.add_argument("--out", default="bench/out")
  p.add_argument("--child", help=argparse.SUPPRESS)
  return p.parse_args()


def _modes(path: str) -> dict[str, dict]:
  nvme = {"device": "nvme", "nvme_path": path, **BUFFERS}
  return {
      "no offload": {},
      "params -> cpu": {"offload_param": {"device": "cpu"}},
      "optimizer -> nvme (params on the device)": {"offload_optimizer": {
          "device": "nvme", "nvme_path": path, "pipeline_read": True, "pipeline_write": True}},
      "params -> nvme, all in the host cache": {"offload_param": {**nvme, "max_in_cpu": 10**9}},
      "params -> nvme (cached) + optimizer -> cpu": {
          "offload_param": {**nvme, "max_in_cpu": 10**9}, "offload_optimizer": {"device": "cpu"}},
      "params -> nvme, max_in_cpu 0, prefetch": {"offload_param": {**nvme, "max_in_cpu": 0}},
      "params -> nvme, max_in_cpu 0, no prefetch": {"offload_param": {**nvme, "max_in_cpu": 0},
                                                    "stage3_prefetch_bucket_size": 0},
  }


def _engine(args, zero: dict):
  import jzero
  from jzero.models import GPT, GPTConfig, lm_loss
  model = GPTConfig(n_layers=args.layers, d_model=args.d_model)
  config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
  return jzero.initialize(lambda rngs: GPT(model, rngs=rngs), lm_loss, config), model


def _child(args) -> dict:
  """One process: train 2 steps with the params on NVMe (``max_in_cpu`` = args.child), then free
  the reader's host memory and measure what RSS gives back."""
  import gc

  import jax
  from jzero.runtime.data import ByteCorpus
  from jzero.tiers.nvme_params import host_bytes_bound
  max_in_cpu = int(args.child)
  path = tempfile.mkdtemp(prefix="jzero-bench-param-nvme-", dir=args.nvme_path)
  engine, model = _engine(args, {"offload_param": {"device": "nvme", "nvme_path": path,
                                                   "max_in_cpu": max_in_cpu, **BUFFERS}})
  corpus = ByteCorpus.load(None, seq_len=model.seq_len, max_bytes=1 << 20)
  state = engine.init(jax.random.key(0))
  for i in range(2):
    state, metrics = engine.train_step(state, engine.shard_batch(
        corpus.batch(i, engine.global_batch_size)))
  float(metrics["loss"])
  store = engine.nvme_store
  reader = store.reader
  held = reader.cache_bytes()
  gc.collect()
  before = rss()
  reader._cache.clear()  # the host cache and any staging buffer still filled
  reader.committed()
  gc.collect()
  freed = before - rss()
  store.close()
  return {"max_in_cpu": max_in_cpu, "cached_leaves": len(reader.cached),
          "leaves": len(reader.entries), "held_bytes": held, "rss_freed_bytes": freed,
          "bound_bytes": host_bytes_bound(store.settings, len(store.devices))}


def main() -> int:
  args = _parse()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jzero  # noqa: F401  (first: its quiet start keeps the CUDA plugin's no-driver lines out)
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  if args.child:
    print(json.dumps(_child(args)))
    return 0
  from jzero.runtime.data import ByteCorpus

  base = Path(args.nvme_path or tempfile.mkdtemp(prefix="jzero-bench-param-nvme-"))
  runs = {}
  for name, zero in _modes(str(base)).items():
    print(f"-- {name}", file=sys.stderr, flush=True)
    engine, model = _engine(args, zero)
    corpus = ByteCorpus.load(None, seq_len=model.seq_len, max_bytes=1 << 20)
    state = engine.init(jax.random.key(0))
    losses = []
    for i in range(2):
      state, metrics = engine.train_step(state, engine.shard_batch(
          corpus.batch(i, engine.global_batch_size)))
      losses.append(float(metrics["loss"]))
    reader = engine.nvme_store.reader if engine.nvme_store is not None else None
    counts = (reader.disk_reads, reader.prefetch_hits, reader.cache_hits) if reader else None
    runs[name] = dict(engine=engine, state=state, times=[], losses=losses, counts=counts)
  time_round_robin(runs, corpus, first=2, steps=args.steps)
  base_ms = statistics.median(runs["no offload"]["times"]) * 1e3
  step_rows = []
  for name, run in runs.items():
    ms = statistics.median(run["times"]) * 1e3
    diff = max(abs(a - b) / b for a, b in zip(run["losses"], runs["no offload"]["losses"]))
    reader = run["engine"].nvme_store.reader if run["engine"].nvme_store is not None else None
    served = "-"
    if reader is not None:
      d0, p0, c0 = run["counts"]
      served = (f"{reader.disk_reads - d0} / {reader.prefetch_hits - p0} / "
                f"{reader.cache_hits - c0}")
    step_rows.append(dict(run=name, step_ms=ms, ratio=ms / base_ms, max_loss_rel_diff=diff,
                          layers_disk_prefetch_cache=served))

  memory_rows = []
  half = None
  for max_in_cpu in (10**9, "half", 0):
    if max_in_cpu == "half":  # room for about half of the partitions
      max_in_cpu = half
    print(f"-- host memory, max_in_cpu {max_in_cpu}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--child", str(max_in_cpu), "--devices",
                           str(args.devices), "--layers", str(args.layers), "--d-model",
                           str(args.d_model)] + (["--nvme-path", str(base)]),
                          capture_output=True, text=True, check=False,
                          env=child_env())
    if done.returncode:
      sys.stderr.write(done.stderr[-3000:])
      return done.returncode
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if half is None:
      engine = runs["params -> nvme, all in the host cache"]["engine"]
      reader = engine.nvme_store.reader
      half = sum(e.numel for e in reader.entries.values()) * len(engine.nvme_store.devices) // 2
    memory_rows.append(row)

  lines = [f"ZeRO-3, fp32, GPT ({args.layers} layers, d {args.d_model}), {args.devices} simulated "
           f"devices, micro-batch 1 per device, buffer_count {BUFFERS['buffer_count']} x "
           f"buffer_size {BUFFERS['buffer_size']:,}; median of {args.steps} steps, round-robin",
           "", "| run | step (ms) | vs no offload | max loss rel. diff | layers read: disk / "
           "prefetched / cache |", "|---|---|---|---|---|"]
  for r in step_rows:
    lines.append(f"| {r['run']} | {r['step_ms']:.0f} | {r['ratio']:.2f} | "
                 f"{r['max_loss_rel_diff']:.1e} | {r['layers_disk_prefetch_cache']} |")
  lines += ["", "| max_in_cpu | leaves cached | reader held | RSS freed | bound (4 x (max_in_cpu "
            "+ devices x buffers)) |", "|---|---|---|---|---|"]
  for r in memory_rows:
    lines.append(f"| {r['max_in_cpu']:,} | {r['cached_leaves']} of {r['leaves']} | "
                 f"{r['held_bytes'] / 1e6:.2f} MB | {r['rss_freed_bytes'] / 1e6:.2f} MB | "
                 f"{r['bound_bytes'] / 1e6:.2f} MB |")
  table = "\n".join(lines)
  print(table)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = dict(devices=args.devices, layers=args.layers, d_model=args.d_model, steps=args.steps,
              jax=jax.__version__, machine=platform.machine(), cpus=os.cpu_count(),
              when=time.strftime("%Y-%m-%d"))
  (out / "param_nvme.json").write_text(json.dumps(dict(meta=meta, steps=step_rows,
                                                       host_memory=memory_rows), indent=2))
  (out / "param_nvme.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
