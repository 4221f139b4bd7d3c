"""Benchmark: LoRA-style fine-tuning of the default GPT against training all of it, in one run.

  python bench/lora.py [--stage 3] [--precision bf16] [--steps 10] [--rank 8] [--out bench/out]

The default GPT with rank-``--rank`` adapters on its attention projections
(``GPTConfig(lora_rank=...)``), 8 simulated devices, trained two ways: every parameter with AdamW
(``optax.adamw``), and only the adapters -- the base frozen with ``optax.multi_transform`` and
``optax.set_to_zero`` (:func:`jzero.models.gpt.lora_labels`), so the base has no optimizer state, no
fp32 master and no gradient (:mod:`jzero.sharding.tx_traits`). Both are compiled and warmed up,
then their steps are timed round-robin (one step of each in turn) so the ratio compares them under
the same machine load. Per run one row: median step time and its ratio to full training, the
trainable parameters, and the optimizer, master and gradient bytes per device from the memory
report. Writes ``lora.json`` and ``lora.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from round_robin import time_round_robin


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stage", type=int, default=3)
  parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--rank", type=int, default=8)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--out", type=Path, default=Path("bench/out"))
  args = parser.parse_args()

  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import optax

  import jzero
  from jzero.analysis.tables import format_bytes, markdown_table
  from jzero.models import GPT, GPTConfig, lm_loss
  from jzero.models.gpt import lora_labels
  from jzero.runtime.data import ByteCorpus

  cfg = GPTConfig(lora_rank=args.rank)
  config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": args.stage}}
  if args.precision == "bf16":
    config["bf16"] = {"enabled": True}
  optimizers = {
      "full training": optax.adamw(1e-3),
      "LoRA (base frozen)": optax.multi_transform(
          {"lora": optax.adamw(1e-3), "frozen": optax.set_to_zero()}, lora_labels),
  }
  corpus = ByteCorpus.load(None, seq_len=cfg.seq_len)
  runs = {}
  for name, tx in optimizers.items():
    engine = jzero.initialize(lambda rngs: GPT(cfg, rngs=rngs), lm_loss, config, optimizer=tx)
    state = engine.init(jax.random.key(0))
    for i in range(2):  # compile and warm up
      state, _ = engine.train_step(state, engine.shard_batch(corpus.batch(i, engine.global_batch_size)))
    runs[name] = {"engine": engine, "state": state, "times": [], "losses": []}
    print(f"{name}: compiled", file=sys.stderr, flush=True)
  time_round_robin(runs, corpus, 2, args.steps)

  base = statistics.median(runs["full training"]["times"])
  rows, records = [], []
  for name, run in runs.items():
    engine = run["engine"]
    report = engine.memory_report(run["state"])
    trainable = sum(l.numel for l in engine.plan.leaf_list() if not l.frozen)
    step = statistics.median(run["times"])
    record = {"run": name, "step_ms": 1e3 * step, "vs_full": step / base, "trainable": trainable,
              **{c: report.measured_bytes(c) for c in ("optimizer", "master", "grads")}}
    records.append(record)
    rows.append([name, f"{record['step_ms']:.1f}", f"{record['vs_full']:.2f}", f"{trainable:,}",
                 format_bytes(record["optimizer"]), format_bytes(record["master"]),
                 format_bytes(record["grads"])])
  header = ["run", "step (ms, median)", "vs full training", "trainable params",
            "optimizer / device", "master / device", "grads / device"]
  table = "\n".join(markdown_table(header, rows))
  note = (f"default GPT + rank-{args.rank} adapters on qkv and attn_out, ZeRO-{args.stage}, "
          f"{args.precision}, {args.devices} simulated devices, {args.steps} steps round-robin, "
          f"{os.cpu_count()} cores")
  print(note)
  print(table)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "lora.json").write_text(json.dumps({"note": note, "runs": records}, indent=1))
  (args.out / "lora.md").write_text(note + "\n\n" + table + "\n")


if __name__ == "__main__":
  main()
