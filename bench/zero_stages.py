"""Benchmark: ZeRO stages 0-3 side by side on N simulated devices, plus state bytes vs N.

  python bench/zero_stages.py [--devices 8] [--steps 12] [--out bench/out]

For the default model (jzero.models.GPT, 6.4M parameters) and each stage it prints one table row:
model-state bytes per device (params, gradient buffer, master, optimizer state: measured from the
live arrays and the plan; predicted by the estimator; their ratio),
XLA's peak bytes for the compiled step, communication per step in Psi units (from the HLO) against
ZeRO's theory, the median step time over the timed steps with its ratio to stage 0, and the
compile time. The stages' steps are timed round-robin (one step of each stage in turn) so that the
ratios compare runs under the same machine load. A second table gives the train-state bytes per
device of every stage for N = 1, 2, 4, 8, 16 (ZeRO-3 must fall as 1/N; it does exactly with
``stage3_param_persistence_threshold: 0``, and nearly with the default, whose small persistent
parameters stay replicated).

Writes ``results.json``, ``results.md`` and ``zero_stages.png`` (bar chart) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8, help="simulated devices for the main table")
  p.add_argument("--steps", type=int, default=12, help="timed steps per stage (after 2 warm-up)")
  p.add_argument("--micro-batch", type=int, default=4)
  p.add_argument("--scaling", default="1,2,4,8,16", help="device counts of the scaling table")
  p.add_argument("--out", default="bench/out")
  return p.parse_args()


def main() -> int:
  args = _parse()
  scaling = [int(n) for n in args.scaling.split(",")]
  import jzero
  jzero.simulate_cpu_devices(max([args.devices, *scaling]))
  import jax

  from jzero.runtime.data import ByteCorpus
  from jzero.sharding.mesh import MeshSpec
  from jzero.models import GPT, GPTConfig, lm_loss
  from jzero.analysis.hlo import comm_volume, zero_theory

  model_cfg = GPTConfig()
  factory = lambda rngs: GPT(model_cfg, rngs=rngs)
  corpus = ByteCorpus.load(None, seq_len=model_cfg.seq_len, max_bytes=1 << 20)

  def config(stage: int, micro: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, **zero}}

  def mesh(n: int):
    return MeshSpec.from_dict({"axes": {"data": n}}).build(devices=jax.devices()[:n])

  print(f"jzero benchmark: GPT {model_cfg.n_layers}x{model_cfg.d_model} on {args.devices} "
        f"simulated CPU devices, micro-batch {args.micro_batch} x seq {model_cfg.seq_len}",
        flush=True)
  runs = {}
  for stage in range(4):
    engine = jzero.initialize(factory, lm_loss, config(stage, args.micro_batch),
                              mesh=mesh(args.devices))
    state = engine.init(jax.random.key(0))
    batch = engine.shard_batch(corpus.batch(0, engine.global_batch_size))
    t0 = time.perf_counter()
    compiled = engine.compile_step(state, batch)
    compile_s = time.perf_counter() - t0
    psi = sum(l.numel for l in engine.plan.leaf_list())
    volume = comm_volume(compiled, engine.mesh, num_params=psi, bytes_per_param=4)
    analysis = compiled.memory_analysis()
    report = engine.memory_report(state)
    runs[stage] = dict(
        engine=engine, state=state, psi=psi, compile_s=compile_s,
        state_bytes=report.measured_bytes(), predicted_bytes=report.predicted_bytes(),
        peak_bytes=analysis.argument_size_in_bytes + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes,
        comm_psi=volume.total_psi, theory_psi=zero_theory(stage, args.devices), times=[])
    print(f"  stage {stage}: compiled in {compile_s:.1f} s", flush=True)

  for i in range(args.steps + 2):  # round-robin: one step of each stage in turn
    batch = corpus.batch(i, runs[0]["engine"].global_batch_size)
    for stage, run in runs.items():
      placed = run["engine"].shard_batch(batch)
      t0 = time.perf_counter()
      run["state"], metrics = run["engine"].train_step(run["state"], placed)
      jax.block_until_ready(metrics)
      if i >= 2:
        run["times"].append(time.perf_counter() - t0)

  rows = []
  base = statistics.median(runs[0]["times"])
  for stage, run in runs.items():
    step = statistics.median(run["times"])
    rows.append({"stage": stage, "state_mib": run["state_bytes"] / 2**20,
                 "predicted_mib": run["predicted_bytes"] / 2**20,
                 "measured_vs_predicted": run["state_bytes"] / run["predicted_bytes"],
                 "peak_mib": run["peak_bytes"] / 2**20, "comm_psi": run["comm_psi"],
                 "theory_psi": run["theory_psi"], "step_ms": step * 1e3, "vs_stage0": step / base,
                 "compile_s": run["compile_s"]})

  # Scaling: stage 3 with stage3_param_persistence_threshold 0 partitions every parameter (pure
  # 1/N); "3p" keeps DeepSpeed's default threshold (1e5), whose persistent params stay replicated.
  variants = {"0": (0, {}), "1": (1, {}), "2": (2, {}),
              "3": (3, {"stage3_param_persistence_threshold": 0}), "3p": (3, {})}
  scale_rows = []
  for n in scaling:
    row = {"devices": n}
    for name, (stage, zero) in variants.items():
      engine = jzero.initialize(factory, lm_loss, config(stage, 1, **zero), mesh=mesh(n))
      state = engine.init(jax.random.key(0))
      row[name] = engine.memory_report(state).measured_bytes() / 2**20
      del state
    scale_rows.append(row)

  meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, "
          f"{os.cpu_count()} cores, {platform.system()}", "python": sys.version.split()[0],
          "jax": jax.__version__, "devices": args.devices, "params": runs[0]["psi"],
          "micro_batch": args.micro_batch, "seq_len": model_cfg.seq_len, "timed_steps": args.steps}
  md = _markdown(meta, rows, scale_rows)
  print()
  print(md)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps({"meta": meta, "stages": rows,
                                                "scaling": scale_rows}, indent=2))
  (out / "results.md").write_text(md)
  _plot(rows, scale_rows, out / "zero_stages.png")
  print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}, {out / 'zero_stages.png'}")
  return 0


def _markdown(meta: dict, rows: list[dict], scale_rows: list[dict]) -> str:
  lines = [f"{meta['date']}, {meta['machine']}, jax {meta['jax']}; GPT {meta['params'] / 1e6:.2f}M "
           f"params, fp32, {meta['devices']} simulated CPU devices, micro-batch "
           f"{meta['micro_batch']} x {meta['seq_len']} tokens, median of {meta['timed_steps']} steps",
           "",
           "| stage | state MiB/device (measured) | predicted | ratio | peak MiB (XLA) | comm / step (Psi) | theory | step ms | vs stage 0 | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['stage']} | {r['state_mib']:.2f} | {r['predicted_mib']:.2f} | "
                 f"{r['measured_vs_predicted']:.4f} | {r['peak_mib']:.1f} | {r['comm_psi']:.3f} | "
                 f"{r['theory_psi']:.3f} | {r['step_ms']:.0f} | {r['vs_stage0']:.2f} | "
                 f"{r['compile_s']:.1f} |")
  names = [k for k in scale_rows[0] if k != "devices"]
  lines += ["", "Train state MiB per device vs device count (3: persistence threshold 0; 3p: the "
            "default threshold 1e5; x N: stage-3 bytes times N, constant if it falls as 1/N)", "",
            "| devices | " + " | ".join(f"stage {k}" for k in names) + " | stage 3 x N |",
            "|---|" + "---|" * (len(names) + 1)]
  for r in scale_rows:
    lines.append(f"| {r['devices']} | " + " | ".join(f"{r[k]:.2f}" for k in names)
                 + f" | {r['3'] * r['devices']:.2f} |")
  return "\n".join(lines) + "\n"


def _plot(rows: list[dict], scale_rows: list[dict], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  stages = [f"stage {r['stage']}" for r in rows]
  axes[0].bar(stages, [r["state_mib"] for r in rows], color="tab:blue")
  axes[0].set_title("train state per device (MiB)")
  axes[1].bar(stages, [r["comm_psi"] for r in rows], color="tab:orange", label="measured (HLO)")
  axes[1].plot(stages, [r["theory_psi"] for r in rows], "k_", markersize=30, label="theory")
  axes[1].set_title("communication per step (Psi)")
  axes[1].legend(loc="upper left", fontsize=8)
  for name in [k for k in scale_rows[0] if k != "devices"]:
    axes[2].plot([r["devices"] for r in scale_rows], [r[name] for r in scale_rows],
                 marker="o", label=f"stage {name}")
  axes[2].set_xscale("log", base=2)
  axes[2].set_yscale("log", base=2)
  axes[2].set_xlabel("devices")
  axes[2].set_title("train state per device (MiB)")
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
