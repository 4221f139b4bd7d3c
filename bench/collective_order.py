"""Benchmark: the step time the collective chain costs, with several processes over gloo.

  python bench/collective_order.py [--layouts 2x1,2x4] [--steps 6]

For each layout (processes x devices per process) it launches that many processes on 127.0.0.1;
each trains ZeRO stages 0-3 twice side by side -- with :mod:`jzero.comm.collective_order`'s chain and
without it -- timing one step of each run in turn (round robin, so both see the same load). The
runs use gradient clipping 1.0: its global-norm ``psum`` happens to serialise the update's
collectives, so the unchained step survives long enough to be timed (without clipping it may
abort or mix buffers, which is what the chain prevents). Process 0 prints one row per layout and
stage: the median step time of each and their ratio, and whether both runs gave the same losses.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = dict(d_model=256, n_layers=4, n_heads=4, seq_len=128)  # a layer's compute overlaps comm
BATCH = 16


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layouts", default="2x1,2x4", help="processes x devices per process, comma list")
  p.add_argument("--steps", type=int, default=6, help="timed steps per run (after 2 warm-up)")
  p.add_argument("--worker", nargs=5, metavar=("ID", "N", "PORT", "DEVICES", "STEPS"),
                 help=argparse.SUPPRESS)
  return p.parse_args()


def _worker(process_id: int, processes: int, port: int, devices: int, steps: int) -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=process_id,
                             initialization_timeout=120)
  sys.path.insert(0, str(Path(__file__).parent))
  import jzero
  from jzero.comm import collective_order
  from jzero.runtime.data import ByteCorpus
  from jzero.models import GPT, GPTConfig, lm_loss
  from round_robin import time_round_robin

  cfg = GPTConfig(**MODEL)
  corpus = ByteCorpus.load(None, seq_len=cfg.seq_len, max_bytes=1 << 20)
  needed = collective_order.needed
  for stage in (0, 1, 2, 3):
    runs = {}
    for chained in (False, True):
      config = {"train_batch_size": BATCH, "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage}}
      engine = jzero.initialize(lambda rngs: GPT(cfg, rngs=rngs), lm_loss, config)
      collective_order.needed = needed if chained else (lambda mesh: False)
      state = engine.init(jax.random.key(0))
      batch = engine.shard_batch(corpus.batch(0, engine.global_batch_size))
      state, _ = engine.train_step(state, batch)  # compiles this run's step with this setting
      runs[chained] = {"engine": engine, "state": state, "times": [], "losses": []}
    collective_order.needed = needed
    time_round_robin(runs, corpus, first=1, steps=1)  # warm-up
    for run in runs.values():
      run["times"].clear()
    time_round_robin(runs, corpus, first=2, steps=steps)
    if process_id == 0:
      plain, ordered = (statistics.median(runs[c]["times"]) * 1e3 for c in (False, True))
      same = runs[False]["losses"] == runs[True]["losses"]
      print(f"| {processes} x {devices} | {stage} | {plain:.0f} | {ordered:.0f} | "
            f"{ordered / plain:.2f} | {'yes' if same else 'no'} |", flush=True)
  jax.distributed.shutdown()


def main() -> int:
  args = _parse()
  if args.worker:
    _worker(*map(int, args.worker))
    return 0
  print("| processes x devices | stage | unchained ms | chained ms | chained / unchained | "
        "same losses |")
  print("|---|---|---|---|---|---|")
  for layout in args.layouts.split(","):
    processes, devices = map(int, layout.split("x"))
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(processes),
                               str(port), str(devices), str(args.steps)],
                              stderr=subprocess.DEVNULL if i else None)
             for i in range(processes)]
    codes = [p.wait() for p in procs]
    if any(codes):
      print(f"| {layout} | failed: exit codes {codes} | | | | |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
