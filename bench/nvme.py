"""Benchmark: the NVMe tier's read / write throughput next to the same disk's raw bandwidth, and
its step time next to no offload, measured in one run.

  python bench/nvme.py [--nvme-path DIR] [--devices 8] [--stage 2] [--layers 8] [--d-model 256]
                       [--steps 5] [--repeats 3] [--out bench/out]

1. Step time: the default job (jzero.models.GPT, fp32, micro-batch 1 per device) without offload
   and with ``offload_optimizer: {device: nvme, pipeline_read, pipeline_write}`` (every leaf's
   optimizer state in the store; ``aio.intra_op_parallelism`` and ``queue_depth`` = ``--threads``); two warm-up steps each, then the two engines' steps timed
   round-robin (each until its writes are committed), median and ratio. Loss difference = exactness.
2. Throughput, on the NVMe engine's own store after training: one slot's group files (packed
   once from the committed state) written (all writes started, then every commit waited for: the
   disk side of a step, tensorstore's fsync included)
   and read back (all reads started, then waited for), in each of tensorstore's ``file_io_mode``
   ``default`` (buffered) and ``direct`` (O_DIRECT, as DeepSpeed's aio), interleaved,
   ``--repeats`` times, best of each; before
   each read the store's files are dropped from the page cache (``posix_fadvise(DONTNEED)`` after
   an fsync), so the reads come from the disk; then the store's own reader (``os.preadv`` of
   each row file, the rows in parallel: the update's and the parameter tier's reads). Raw: the same number of bytes written to one plain
   file with ``write`` + ``fsync``, dropped from the page cache, and read back with ``read``, in
   the same directory, interleaved with the store's repeats. Ratio = store / raw (target >= 0.7).

Prints a table and writes ``nvme.json`` / ``nvme.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from round_robin import time_round_robin


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--nvme-path", default=None, help="directory on the disk to test (default: a "
                 "temporary directory under the system's temp dir)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--stage", type=int, default=2)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--steps", type=int, default=5, help="timed steps per engine (after 2 warm-up)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--threads", type=int, default=8,
                 help="aio.intra_op_parallelism and aio.queue_depth of the NVMe run")
  p.add_argument("--out", default="bench/out")
  return p.parse_args()


def _drop_cache(paths) -> None:
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _files(directory: Path) -> list[str]:
  return [os.path.join(r, n) for r, _, names in os.walk(directory) for n in names]


def _raw(directory: Path, nbytes: int) -> tuple[float, float]:
  """(write+fsync seconds, read seconds) of ``nbytes`` in one plain file, 8 MiB at a time."""
  block = os.urandom(8 << 20)
  path = directory / "raw.bin"
  t0 = time.perf_counter()
  with open(path, "wb", buffering=0) as f:
    left = nbytes
    while left > 0:
      left -= f.write(block[:min(left, len(block))])
    os.fsync(f.fileno())
  write_s = time.perf_counter() - t0
  _drop_cache([path])
  t0 = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    while f.read(8 << 20):
      pass
  read_s = time.perf_counter() - t0
  path.unlink()
  return write_s, read_s


def _raw_files(paths: list[str]) -> float:
  """Seconds to read ``paths`` (the store's own files, page cache dropped) with plain ``read``
  calls, one thread per file: what the OS gives for the store's layout."""
  from concurrent.futures import ThreadPoolExecutor
  _drop_cache(paths)

  def read(path):
    with open(path, "rb", buffering=0) as f:
      while f.read(8 << 20):
        pass

  t0 = time.perf_counter()
  with ThreadPoolExecutor(len(paths)) as pool:
    list(pool.map(read, paths))
  return time.perf_counter() - t0


def main() -> int:
  args = _parse()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jzero  # noqa: F401  (first: its quiet start keeps the CUDA plugin's no-driver lines out)
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import numpy as np
  from jzero.runtime.data import ByteCorpus
  from jzero.analysis.estimate import format_bytes
  from jzero.models import GPT, GPTConfig, lm_loss

  base_dir = Path(args.nvme_path or tempfile.mkdtemp(prefix="jzero-bench-nvme-"))
  model = GPTConfig(n_layers=args.layers, d_model=args.d_model)
  corpus = ByteCorpus.load(None, seq_len=model.seq_len, max_bytes=1 << 20)
  runs = {}
  for name in ("no offload", "nvme"):
    zero = {"stage": args.stage}
    if name == "nvme":
      zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(base_dir),
                                   "pipeline_read": True, "pipeline_write": True}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "zero_optimization": zero}
    if name == "nvme":  # copy threads and concurrent files (tensorstore's context limits)
      config["aio"] = {"intra_op_parallelism": args.threads, "queue_depth": args.threads}
    engine = jzero.initialize(lambda rngs: GPT(model, rngs=rngs), lm_loss, config)
    t0 = time.perf_counter()
    state = engine.init(jax.random.key(0))
    losses = []
    for i in range(2):
      state, metrics = engine.train_step(state, engine.shard_batch(
          corpus.batch(i, engine.global_batch_size)))
      losses.append(float(metrics["loss"]))
    runs[name] = dict(engine=engine, state=state, times=[], losses=losses,
                      warmup_s=time.perf_counter() - t0)
  time_round_robin(runs, corpus, first=2, steps=args.steps)
  base_ms = statistics.median(runs["no offload"]["times"]) * 1e3
  nvme_run = runs["nvme"]
  store = nvme_run["engine"].nvme_store
  nvme_ms = statistics.median(nvme_run["times"]) * 1e3
  diff = max(abs(a - b) / b for a, b in zip(nvme_run["losses"], runs["no offload"]["losses"]))

  # -- throughput: the store's own arrays in each file_io_mode, and raw sequential I/O ----------
  import tensorstore as ts
  from jzero.tiers import nvme_store
  arrays = store.read()  # the committed slot, as the step reads it
  buffers = [store._pack(g, arrays) for g in range(len(store.groups))]  # each group's file rows
  nbytes = store.bytes_per_slot
  slot = store._other
  modes = ("default", "direct", "memmap")
  by_mode = {mode: [ts.open(a.spec(), open=True, context=ts.Context(
                        nvme_store.io_context(store.settings, mode))).result()
                    for a in store._arrays[slot]] for mode in modes}
  results = {k: [] for k in ("raw_write", "raw_read", "raw_files_read", "rows_read",
                              *(f"{m}_{io}" for m in modes
                                                          for io in ("write", "read")))}
  for _ in range(args.repeats):
    for mode in modes:  # interleaved, so the modes share the disk's and the machine's load
      t0 = time.perf_counter()
      futures = [a.write(buf).commit for a, buf in zip(by_mode[mode], buffers)]
      for f in futures:
        f.result()
      results[f"{mode}_write"].append(time.perf_counter() - t0)
      _drop_cache(_files(store.directory / f"slot_{slot}"))
      t0 = time.perf_counter()
      reads = [a.read() for a in by_mode[mode]]
      for f in reads:
        f.result()
      results[f"{mode}_read"].append(time.perf_counter() - t0)
    _drop_cache(_files(store.directory / f"slot_{slot}"))
    t0 = time.perf_counter()  # the store's own read path (update, checkpoints): preadv per row
    for f in [store._read_rows(slot, g) for g in range(len(store.groups))]:
      f.result()
    results["rows_read"].append(time.perf_counter() - t0)
    w, r = _raw(store.directory, nbytes)
    results["raw_write"].append(w)
    results["raw_read"].append(r)
    results["raw_files_read"].append(_raw_files([
        p for p in _files(store.directory / f"slot_{slot}") if not p.endswith("zarr.json")]))
  mbps = {k: nbytes / min(v) / 1e6 for k, v in results.items()}

  files = len(store.groups) * len(store.devices)
  how = {"write": "write (fsync)", "read": "read (page cache dropped)"}
  rows = [dict(what=f"{how[io]}, file_io_mode {mode}"
                    + (" (the store's)" if mode == nvme_store.IO_MODE else ""),
               store_MBps=mbps[f"{mode}_{io}"], raw_MBps=mbps[f"raw_{io}"],
               ratio=mbps[f"{mode}_{io}"] / mbps[f"raw_{io}"])
          for io in ("write", "read") for mode in modes]
  rows.append(dict(what="read (page cache dropped), the store's reader: preadv per row file, "
                        "rows in parallel (the update's, checkpoints', the parameter tier's)",
                   store_MBps=mbps["rows_read"], raw_MBps=mbps["raw_read"],
                   ratio=mbps["rows_read"] / mbps["raw_read"]))
  lines = [f"NVMe tier, ZeRO-{args.stage}, fp32, GPT ({model.n_layers} layers, d "
           f"{model.d_model}), {args.devices} simulated devices; store: {format_bytes(nbytes)} per "
           f"slot in {files} files (one per sub-group and device), aio threads {args.threads}; "
           f"best of {args.repeats}", "",
           "| I/O | NVMe tier (MB/s) | raw file (MB/s) | tier / raw |", "|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['what']} | {r['store_MBps']:.0f} | {r['raw_MBps']:.0f} | "
                 f"{r['ratio']:.2f} |")
  same = mbps["raw_files_read"]
  lines.append(f"\nThe store's own {files} files read raw (one thread per file, page cache dropped): "
               f"{same:.0f} MB/s; tensorstore's read ({nvme_store.IO_MODE}) is "
               f"{mbps[nvme_store.IO_MODE + '_read'] / same:.2f} of it, the store's reader "
               f"{mbps['rows_read'] / same:.2f}.")
  lines += ["", "| run | step (ms, median) | vs no offload | max loss rel. diff |",
            "|---|---|---|---|",
            f"| no offload | {base_ms:.1f} | 1.00 | 0 |",
            f"| nvme (pipelined) | {nvme_ms:.1f} | {nvme_ms / base_ms:.2f} | {diff:.1e} |"]
  table = "\n".join(lines)
  print(table)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = dict(stage=args.stage, devices=args.devices, layers=args.layers, d_model=args.d_model,
              steps=args.steps, repeats=args.repeats, bytes_per_slot=nbytes, files=files,
              groups=len(store.groups), jax=jax.__version__, machine=platform.machine(),
              cpus=os.cpu_count())
  (out / "nvme.json").write_text(json.dumps(dict(
      meta=meta, io=rows, io_seconds=results,
      steps=dict(no_offload_ms=base_ms, nvme_ms=nvme_ms, ratio=nvme_ms / base_ms,
                 max_loss_rel_diff=diff)), indent=2))
  (out / "nvme.md").write_text(table + "\n")
  del np
  return 0


if __name__ == "__main__":
  sys.exit(main())
