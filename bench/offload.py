"""Benchmark: ZeRO-Offload's tiers against no offload, side by side in one run.

  python bench/offload.py [--devices 8] [--stage 2] [--steps 10] [--precision fp32] [--out bench/out]
  python bench/offload.py --platform gpu --devices 1 --stage 3 --model 1.3b --micro-batch 8 \
      --precision bf16 --sequential --modes "no offload,stream,host,params cpu"    # one GPU

A GPT (``--model``: a :data:`jzero.models.gpt.PRESETS` name, default the 6.4M-parameter default
model; ``--seq-len`` shortens its sequences) at ``--micro-batch`` sequences per device with
``offload_optimizer`` off, ``update: stream``, ``update: host`` and ``update: cpu_adam`` (the
gradients leave the device in the backward pass, Adam runs on the host's cores after the jit:
:mod:`jzero.tiers.host_step`), each update mode with
``delayed_update: true`` (ZeRO-Offload's delayed parameter update, :mod:`jzero.tiers.delayed`: the
update of step t-1's gradient runs in the same step as step t's forward and backward, which XLA
may overlap; the first, prime step is a warm-up step, so the timed steps are the steady ones), and
at stage 3 the parameters in host memory (``offload_param: cpu``, alone and with the host and
cpu_adam updates).
Each mode is compiled and warmed up for two steps, then the modes' steps are timed round-robin (one
step of each in turn, each blocked until ready) so every ratio compares runs under the same machine
load; ``--sequential`` times each mode's steps before the next mode is built instead (one state
alive at a time: for a model whose states do not all fit at once, on a machine nobody shares).
Per mode one row: median step time and its ratio to no offload, XLA's memory analysis of the
compiled step (argument / temp bytes per device; host fields read 0 on CPU), master +
optimizer-state bytes per device by memory kind from the live arrays, and the largest loss difference from the no-offload run over the
same steps (exactness; with the delayed update the math differs by design, one step late, and the
column shows by how much). Writes ``offload.json`` and ``offload.md`` to ``--out``.

On CPU "device" and "host" memory are the same RAM, so the step-time ratio measures the cost of
the extra copies and of XLA's host computation, not of a PCIe link; on a GPU it is the real thing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from round_robin import time_round_robin


# mode -> what it adds to zero_optimization ("params cpu" modes: stage 3 only)
MODES = {
    "no offload": {},
    "stream": {"offload_optimizer": {"device": "cpu", "update": "stream"}},
    "host": {"offload_optimizer": {"device": "cpu", "update": "host"}},
    "stream + delayed update": {"offload_optimizer": {"device": "cpu", "update": "stream",
                                                      "delayed_update": True}},
    "host + delayed update": {"offload_optimizer": {"device": "cpu", "update": "host",
                                                    "delayed_update": True}},
    "cpu_adam": {"offload_optimizer": {"device": "cpu", "update": "cpu_adam"}},
    "cpu_adam + delayed update": {"offload_optimizer": {"device": "cpu", "update": "cpu_adam",
                                                        "delayed_update": True}},
    "params cpu": {"offload_param": {"device": "cpu"}},
    "params cpu + host": {"offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu", "update": "host"}},
    "params cpu + cpu_adam": {"offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu", "update": "cpu_adam"}},
}
STAGE_3_ONLY = ("params cpu", "params cpu + host", "params cpu + cpu_adam")


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--platform", default="cpu", choices=("cpu", "gpu"),
                 help="cpu: --devices simulated CPU devices; gpu: the first --devices GPUs")
  p.add_argument("--stage", type=int, default=2)
  p.add_argument("--model", default="default", help="a jzero.models.gpt.PRESETS name")
  p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
  p.add_argument("--micro-batch", type=int, default=1, help="sequences per device per step")
  p.add_argument("--steps", type=int, default=10, help="timed steps per mode (after 2 warm-up)")
  p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
  p.add_argument("--sequential", action="store_true",
                 help="time each mode before building the next (one state alive at a time)")
  p.add_argument("--out", default="bench/out")
  p.add_argument("--modes", default=None,
                 help=f"comma-separated subset of: {', '.join(MODES)} (default: all that apply "
                      f"to --stage)")
  return p.parse_args()


def _config(args: argparse.Namespace, change: dict) -> dict:
  config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": args.stage, **change}}
  if args.precision == "bf16":
    config["bf16"] = {"enabled": True}
  return config


def _state_bytes(run: dict) -> dict:
  """Master + optimizer-state bytes of the first device by memory kind (the live arrays and what a
  tier holds outside them: cpu_adam's numpy store, the NVMe files), and the carried gradient's."""
  from jzero.analysis.memory_report import live_bytes, state_report  # noqa: PLC0415

  engine = run["engine"]
  device = engine.mesh.mesh.devices.flat[0]
  report = state_report(engine.plan, run["state"], engine.resources)
  out: dict = {}
  for category in ("master", "optimizer"):
    for kind, n in report[category].items():
      out[kind] = out.get(kind, 0) + n
  carried = run["state"].delayed
  out["carried"] = sum(live_bytes(carried.grads, device).values()) if carried is not None else 0
  return out


def main() -> int:
  args = _parse()
  if args.platform == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  if args.platform == "cpu":
    jax.config.update("jax_num_cpu_devices", args.devices)
  import jzero
  from jzero.runtime.data import ByteCorpus
  from jzero.analysis.estimate import format_bytes
  from jzero.analysis.memory_report import CompiledMemory
  from jzero.models import GPT, lm_loss
  from jzero.models.gpt import preset

  model = preset(args.model)
  if args.seq_len:
    model = dataclasses.replace(model, seq_len=args.seq_len)
  devices = jax.devices()[:args.devices]
  mesh = jax.sharding.Mesh(devices, ("data",))
  corpus = ByteCorpus.load(None, seq_len=model.seq_len, max_bytes=1 << 20)
  applicable = [m for m in MODES if args.stage == 3 or m not in STAGE_3_ONLY]
  names = [m.strip() for m in args.modes.split(",")] if args.modes else applicable
  unknown = sorted(set(names) - set(applicable))
  if unknown or "no offload" not in names:
    raise SystemExit(f"--modes: {unknown} unknown (or stage 3's only); give a subset of "
                     f"{applicable} that includes 'no offload' (the baseline)")
  runs = {}

  def build(name):
    engine = jzero.initialize(lambda rngs: GPT(model, rngs=rngs), lm_loss,
                              _config(args, MODES[name]), mesh=mesh)
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
    return dict(engine=engine, state=state, compiled=compiled, compile_s=compile_s, times=[],
                losses=losses)

  def summarize(name, run):
    run["state_bytes"] = _state_bytes(run)
    print(f"{name}: median step {statistics.median(run['times']) * 1e3:.1f} ms, compile "
          f"{run['compile_s']:.1f} s", flush=True)

  for name in names:
    if args.sequential:
      run = runs[name] = build(name)
      time_round_robin({name: run}, corpus, first=2, steps=args.steps)
      summarize(name, run)
      del run["state"], run["engine"]
    else:
      runs[name] = build(name)
  if not args.sequential:
    time_round_robin(runs, corpus, first=2, steps=args.steps)
    for name, run in runs.items():
      summarize(name, run)

  base = runs["no offload"]
  base_ms = statistics.median(base["times"]) * 1e3
  rows = []
  for name, run in runs.items():
    ms = statistics.median(run["times"]) * 1e3
    held = run["state_bytes"]
    diff = max(abs(a - b) / b for a, b in zip(run["losses"], base["losses"]))
    rows.append(dict(mode=name, step_ms=ms, ratio=ms / base_ms, compile_s=run["compile_s"],
                     argument=run["compiled"].argument, temp=run["compiled"].temp,
                     state_device=held.get("device", 0),
                     state_host=held.get("pinned_host", 0) + held.get("unpinned_host", 0),
                     carried_grads=held["carried"], max_loss_rel_diff=diff))

  header = ("| mode | step (ms, median) | vs no offload | compile (s) | argument | temp | "
            "master+opt on device | on host | carried grad (device) | "
            "max loss rel. diff |")
  where = (f"{args.devices} simulated CPU devices" if args.platform == "cpu" else
           f"{args.devices} x {devices[0].device_kind}")
  timing = "one mode after another" if args.sequential else "round-robin"
  lines = [f"{time.strftime('%Y-%m-%d')}, jax {jax.__version__}: ZeRO-{args.stage}, "
           f"{args.precision}, GPT {args.model!r} ({model.num_params() / 1e6:.0f}M parameters, "
           f"seq {model.seq_len}), micro-batch {args.micro_batch}, {where}, {args.steps} timed "
           f"steps {timing}; per-device bytes", "", header, "|" + "---|" * 10]
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
              model=args.model, micro_batch=args.micro_batch, platform=args.platform,
              jax=jax.__version__, machine=platform.machine(), cpus=os.cpu_count())
  (out / "offload.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
  (out / "offload.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
