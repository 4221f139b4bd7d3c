"""Validating ``jzero plan``'s cost model where a step can be run: this machine's CPU.

  python bench/plan_validation.py [--steps 3] [--micro-batches 4 1] [--checkpointing none block]
                                  [--compile-top N] [--out bench/out]

Plans the default job (the embedded GPT, configs/zero3.json's model and micro-batch x 8 devices
= global batch 32) for 8 simulated CPU devices with this CPU's measured FLOP rate and memory
bandwidth as the "hardware" (:func:`jzero.planning.cost.cpu_hardware`): ZeRO stages 1-3, optimizer
and parameter offload to the host, the given micro-batches and checkpointing choices. Compiles
every plausible candidate (``--compile-top``), runs every one that fits for ``--steps`` timed
steps (after 2 warm-up steps; the
median is the measured step), and prints predicted against measured with the Spearman rank
correlation and the chosen candidate's measured time over the best measured. Measured times
depend on a quiet machine: the table says how many cores this process had, and the spread of
each candidate's steps (max / min).

Writes ``plan_validation.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def spearman(a: list[float], b: list[float]) -> float:
  """Spearman's rank correlation (average ranks for ties)."""
  def ranks(x):
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):  # ties share their mean rank
      r[x == v] = r[x == v].mean()
    return r
  ra, rb = ranks(a), ranks(b)
  return float(np.corrcoef(ra, rb)[0, 1])


def measure(config: dict, steps: int) -> list[float]:
  """Seconds of ``steps`` train steps of the default GPT under ``config`` (after 2 warm-ups)."""
  return train_default_gpt(config, steps + 2)[1][2:]


def train_default_gpt(config: dict, steps: int) -> tuple[list[float], list[float]]:
  """(losses, seconds) of each of ``steps`` train steps of the default GPT under ``config`` on
  the embedded corpus, each step timed to completion."""
  import jax  # noqa: PLC0415

  import jzero  # noqa: PLC0415
  from jzero.models import GPT, GPTConfig, lm_loss  # noqa: PLC0415
  from jzero.runtime.data import ByteCorpus  # noqa: PLC0415

  cfg = GPTConfig()
  engine = jzero.initialize(model=lambda rngs: GPT(cfg, rngs=rngs), loss_fn=lm_loss,
                            config=config, total_num_steps=steps)
  state = engine.init(jax.random.key(0))
  corpus = ByteCorpus.load(None, seq_len=cfg.seq_len)
  losses, times = [], []
  for step in range(steps):
    batch = engine.shard_batch(corpus.batch(step, engine.global_batch_size))
    t0 = time.perf_counter()
    state, metrics = engine.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
    losses.append(float(metrics["loss"]))
  return losses, times


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--compile-top", type=int, default=1000, help="default: every plausible one")
  p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 1])
  p.add_argument("--checkpointing", nargs="+", default=["none", "block"])
  p.add_argument("--out", default="bench/out")
  args = p.parse_args()
  import jzero  # noqa: PLC0415

  jzero.simulate_cpu_devices(8)
  from jzero.planning import plan_for  # noqa: PLC0415
  from jzero.planning.cost import cpu_hardware  # noqa: PLC0415

  hw = cpu_hardware(8)
  with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as nvme:
    plan = plan_for("default", gpu=None, hardware=hw, stages=(1, 2, 3), offload_tiers=("cpu",),
                    micro_batches=tuple(args.micro_batches),
                    checkpointing=tuple(args.checkpointing), compile_top=args.compile_top,
                    cache_dir=cache, global_batch=32)
    rows = []
    for r in plan.ranked:
      config = r.candidate.deepspeed_config(plan.job, 8, nvme_path=nvme)
      times = measure(config, args.steps)
      rows.append({"name": r.name, "predicted_s": r.prediction.seconds,
                   "bound": r.prediction.bound, "measured_s": statistics.median(times),
                   "spread": max(times) / min(times)})
      print(f"[{len(rows)}/{len(plan.ranked)}] {r.name}: predicted "
            f"{r.prediction.seconds * 1e3:.1f} ms, measured {rows[-1]['measured_s'] * 1e3:.1f} ms",
            file=sys.stderr, flush=True)
  rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
  best = min(r["measured_s"] for r in rows)
  chosen_ratio = rows[0]["measured_s"] / best
  head = (f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"{hw.name}; default GPT, global batch 32, {args.steps} timed steps; "
          f"peak {hw.peak_flops.value * 8 / 1e9:.1f} GFLOP/s and memory "
          f"{hw.host_bandwidth.value / 1e9:.1f} GB/s measured")
  from jzero.analysis.tables import markdown_table  # noqa: PLC0415

  lines = [head, "", *markdown_table(
      ("#", "candidate", "predicted ms", "bound", "measured ms", "spread"),
      [(i, r["name"], f"{r['predicted_s'] * 1e3:.1f}", r["bound"], f"{r['measured_s'] * 1e3:.1f}",
        f"{r['spread']:.2f}") for i, r in enumerate(rows, 1)])]
  lines += ["", f"Spearman rank correlation (predicted vs measured, {len(rows)} candidates): "
                f"{rho:.3f}; chosen ({rows[0]['name']}) measured / best measured: "
                f"{chosen_ratio:.3f}"]
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "plan_validation.md").write_text("\n".join(lines) + "\n")
  (out / "plan_validation.json").write_text(json.dumps(
      {"source": head, "rows": rows, "spearman": rho, "chosen_over_best": chosen_ratio,
       "plan": plan.to_json()}, indent=1))
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
