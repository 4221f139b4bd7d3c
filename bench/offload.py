"""Benchmark: ZeRO-Offload's two update modes against no offload, side by side in one run.

  python bench/offload.py [--devices 8] [--stage 2] [--steps 10] [--precision fp32] [--out bench/out]

The default job (jzero.models.GPT's default 6.4M-parameter model, micro-batch 1 per device) with
``offload_optimizer`` off, ``update: stream`` and ``update: host``, and each update mode with
``delayed_update: true`` (ZeRO-Offload's delayed parameter update, :mod:`jzero.tiers.delayed`: the
update of step t-1's gradient runs in the same step as step t's forward and backward, which XLA
may overlap; the first, prime step is a warm-up step, so the timed steps are the steady ones). Each mode is compiled, warmed
up for two steps, then the modes' steps are timed round-robin (one step of each in turn, each
blocked until ready) so every ratio compares runs under the same machine load. Per mode one row:
median step time and its ratio to no offload, XLA's memory analysis of the compiled step
(argument / temp bytes per device; host fields read 0 on CPU), master + optimizer-state bytes per
device by memory kind from the live arrays, and the largest loss difference from the no-offload run
over the same steps (exactness; with the delayed update the math differs by design, one step
late, and the column shows by how much). Writes ``offload.json`` and ``offload.md`` to ``--out``.

On CPU "device" and "host" memory are the same RAM, so the step-time ratio measures the cost of
the extra copies and of XLA's host computation, not of a PCIe link.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from round_robin import time_round_robin


# mode -> offload_optimizer block (None: no offload)
MODES = {
    "no offload": None,
    "stream": {"update": "stream"},
    "host": {"update": "host"},
    "stream + delayed update": {"update": "stream", "delayed_update": True},
    "host + delayed update": {"update": "host", "delayed_update": True},
}


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--stage", type=int, default=2)
  p.add_argument("--steps", type=int, default=10, help="timed steps per mode (after 2 warm-up)")
  p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
  p.add_argument("--out", default="bench/out")
  p.add_argument("--modes", default=",".join(MODES),
                 help=f"comma-separated subset of: {', '.join(MODES)}")
  return p.parse_args()


def main() -> int:
  args = _parse()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import jzero
  from jzero.runtime.data import ByteCorpus
  from jzero.analysis.estimate import format_bytes
  from jzero.analysis.memory_report import CompiledMemory, live_bytes
  from jzero.models import GPT, GPTConfig, lm_loss

  model = GPTConfig()
  corpus = ByteCorpus.load(None, seq_len=model.seq_len, max_bytes=1 << 20)
  names = [m.strip() for m in args.modes.split(",")]
  unknown = sorted(set(names) - set(MODES))
  if unknown or "no offload" not in names:
    raise SystemExit(f"--modes: {unknown} unknown; give a subset of {list(MODES)} that includes "
                     f"'no offload' (the baseline)")
  modes = {name: MODES[name] for name in MODES if name in names}
  runs = {}
  for name, block in modes.items():
    zero = {"stage": args.stage}
    if block:
      zero["offload_optimizer"] = {"device": "cpu", **block}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "zero_optimization": zero}
    if args.precision == "bf16":
      config["bf16"] = {"enabled": True}
    engine = jzero.initialize(lambda rngs: GPT(model, rngs=rngs), lm_loss, config)
    state = engine.init(jax.random.key(0))
    batch = engine.shard_batch(corpus.batch(0, engine.global_batch_size))
    t0 = time.perf_counter()
    compiled = CompiledMemory.of(engine.compile_step(state, batch))
    compile_s = time.perf_counter() - t0
    losses = []
    for i in range(2):
      state, metrics = engine.train_step(state, engine.shard_batch(
          corpus.batch(i, engine.global_batch_size)))
      losses.append(float(metrics["loss"]))
    runs[name] = dict(engine=engine, state=state, compiled=compiled, compile_s=compile_s,
                      times=[], losses=losses)

  time_round_robin(runs, corpus, first=2, steps=args.steps)

  base = runs["no offload"]
  base_ms = statistics.median(base["times"]) * 1e3
  rows = []
  for name, run in runs.items():
    ms = statistics.median(run["times"]) * 1e3
    device = engine_device = run["engine"].mesh.mesh.devices.flat[0]
    state_bytes = {}
    for part in (run["state"].master, run["state"].opt_state):
      for kind, n in live_bytes(part, device).items():
        state_bytes[kind] = state_bytes.get(kind, 0) + n
    del engine_device
    carried = run["state"].delayed
    carried_bytes = sum(live_bytes(carried.grads, device).values()) if carried is not None else 0
    diff = max(abs(a - b) / b for a, b in zip(run["losses"], base["losses"]))
    rows.append(dict(mode=name, step_ms=ms, ratio=ms / base_ms, compile_s=run["compile_s"],
                     argument=run["compiled"].argument, temp=run["compiled"].temp,
                     state_device=state_bytes.get("device", 0),
                     state_host=state_bytes.get("pinned_host", 0)
                     + state_bytes.get("unpinned_host", 0), carried_grads=carried_bytes,
                     max_loss_rel_diff=diff))

  header = ("| mode | step (ms, median) | vs no offload | compile (s) | argument | temp | "
            "master+opt on device | on host | carried grad (device) | max loss rel. diff |")
  lines = [f"ZeRO-{args.stage}, {args.precision}, default GPT ({model}), {args.devices} simulated "
           f"devices, {args.steps} timed steps round-robin; per-device bytes", "", header,
           "|" + "---|" * 10]
  for r in rows:
    lines.append(f"| {r['mode']} | {r['step_ms']:.1f} | {r['ratio']:.2f} | {r['compile_s']:.1f} | "
                 f"{format_bytes(r['argument'])} | {format_bytes(r['temp'])} | "
                 f"{format_bytes(r['state_device'])} | {format_bytes(r['state_host'])} | "
                 f"{format_bytes(r['carried_grads'])} | "
                 f"{r['max_loss_rel_diff']:.1e} |")
  table = "\n".join(lines)
  print(table)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = dict(stage=args.stage, precision=args.precision, devices=args.devices, steps=args.steps,
              jax=jax.__version__, machine=platform.machine(), cpus=os.cpu_count())
  (out / "offload.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
  (out / "offload.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
