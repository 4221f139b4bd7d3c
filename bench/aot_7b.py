"""GPU plans without a GPU: a 7B model's ZeRO stages compiled for 8 x H100 by XLA's GPU compiler.

  python bench/aot_7b.py [--gpu h100] [--devices 8] [--model 7b] [--knobs] [--out bench/out]

Needs the gpu-aot extra (``pip install -e ".[gpu-aot]"``). For each ZeRO stage 0-3, with bf16
compute params, an fp32 master and AdamW (K = 12), micro-batch 1 x 2048 tokens and activation
checkpointing, ``jzero.planning.aot.compile_for`` compiles the real train step for the topology and the
script writes one table row: the classic ZeRO model-state figure for Psi = 7e9 (112 / 38.5 /
26.25 / 14 GB at N = 8), the same formula at this model's own Psi, the plan's model states, XLA's
per-device argument / temp / peak bytes, whether the peak fits the memory JAX preallocates (75% of
the part's), the share of the bytes sent per step by collectives with compute in flight (and with
a matmul in flight), and the XLA compile time. ``--knobs`` adds a second table: ZeRO-3 with
overlap_comm off, without prefetch, and with other buckets, to show what each knob does to the
scheduled program.

Writes ``aot_7b.json`` and ``aot_7b.md`` to ``--out`` and prints the markdown. ``--record PATH``
also writes the stages' per-device figures alone (a small JSON; the committed
``notebooks/data/aot_7b_h100.json`` that notebooks/which_stage_fits.ipynb plots is this file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings
from pathlib import Path

CLASSIC_PSI = 7e9
KNOBS = (  # (label, zero_optimization overrides) for the ZeRO-3 knob table
    ("defaults (overlap_comm on, prefetch 5e7, reduce bucket 5e8)", {}),
    ("overlap_comm false", {"overlap_comm": False}),
    ("stage3_prefetch_bucket_size 0 (no prefetch)", {"stage3_prefetch_bucket_size": 0}),
    ("stage3_prefetch_bucket_size 2e8", {"stage3_prefetch_bucket_size": 200_000_000}),
    ("reduce_bucket_size 5e7", {"reduce_bucket_size": 50_000_000}),
)


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gpu", default="h100")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--model", default="7b", help="GPT preset (default 7b)")
  p.add_argument("--stages", default="0,1,2,3")
  p.add_argument("--knobs", action="store_true", help="also the ZeRO-3 knob table")
  p.add_argument("--out", default="bench/out")
  p.add_argument("--record", help="also write the stages' per-device bytes to this JSON file")
  return p.parse_args()


def _record(head: str, reports: list) -> dict:
  """The stages' per-device figures (bytes) and where they come from: what a notebook plots."""
  first = reports[0][2]
  return {"source": head, "gpu": first.gpu, "devices": first.devices, "model": first.model,
          "num_params": first.num_params, "precision": first.precision,
          "usable_memory": first.usable_memory,
          "stages": [{"stage": r.stage, "model_states": r.model_states, "argument": r.argument,
                      "temp": r.temp, "peak": r.peak, "fits": r.fits}
                     for table, _, r in reports if table == "stages"]}


def _config(stage: int, **zero) -> dict:
  return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "bf16": {"enabled": True}, "activation_checkpointing": {},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
          "zero_optimization": {"stage": stage, **zero}}


def _classic(stage: int, psi: float, n: int) -> float:
  """ZeRO's model states per device, fp16/bf16 params and grads, K = 12 (the paper's Figure 1)."""
  return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def _gb(x: float) -> str:
  return f"{x / 1e9:.2f}"


def _pct(x: float) -> str:
  return "-" if x != x else f"{x:.1%}"


def main() -> int:
  args = _parse()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from jzero.planning import aot
  from jzero.models.gpt import preset

  warnings.simplefilter("ignore")  # config notes (e.g. keys jzero ignores) would repeat per stage
  reports, rows = [], []
  for stage in [int(s) for s in args.stages.split(",")]:
    print(f"stage {stage}: compiling {args.model} for {args.devices} x {args.gpu}", file=sys.stderr)
    r = aot.compile_for(_config(stage), args.gpu, args.devices, model=args.model)
    reports.append(("stages", f"ZeRO-{stage}", r))
    rows.append([str(stage), _gb(_classic(stage, CLASSIC_PSI, args.devices)),
                 _gb(_classic(stage, r.num_params, args.devices)), _gb(r.model_states),
                 _gb(r.argument), _gb(r.temp), _gb(r.peak), "yes" if r.fits else "no",
                 f"{r.sent_bytes / 1e9:.1f}", _pct(r.overlap_fraction),
                 _pct(r.matmul_overlap_fraction), f"{r.compile_s:.0f}"])
  first = reports[0][2]
  head = (f"{datetime.date.today().isoformat()}, {platform.machine()}, jax {jax.__version__}, "
          f"XLA GPU compiler (jax-cuda12-plugin), compile-only; {args.devices} x {first.gpu} "
          f"({first.device_memory / 2**30:.2f} GiB, fits = peak within "
          f"{first.memory_fraction:.0%}); GPT {args.model} {first.num_params / 1e9:.3f}B params, "
          f"bf16 + fp32 master + AdamW, micro-batch 1 x {preset(args.model).seq_len} "
          f"tokens, activation checkpointing; GB = 1e9 bytes per device")
  md = [head, "",
        "| stage | classic ZeRO, Ψ = 7e9 | ZeRO formula at this Ψ | plan model states | XLA "
        "arguments | XLA temp | XLA peak | fits | GB sent / step | overlapped | matmul in flight | "
        "compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  md += ["| " + " | ".join(row) + " |" for row in rows]
  if args.knobs:
    knob_rows = []
    for label, zero in KNOBS:
      print(f"ZeRO-3 knobs: {label}", file=sys.stderr)
      r = aot.compile_for(_config(3, **zero), args.gpu, args.devices, model=args.model)
      reports.append(("knobs", label, r))
      def count(kind: str, r=r) -> int:
        return sum(1 for c in r.collectives if c.kind == kind)

      def largest(kind: str, r=r) -> int:
        return max((c.full_bytes for c in r.collectives if c.kind == kind), default=0)

      asynchronous = sum(c.step_bytes for c in r.collectives if c.is_async) / r.sent_bytes
      knob_rows.append([label, str(count("all-gather")), f"{largest('all-gather') / 1e6:.0f}",
                        str(count("reduce-scatter")), f"{largest('reduce-scatter') / 1e6:.0f}",
                        _pct(asynchronous), _pct(r.overlap_fraction),
                        _pct(r.matmul_overlap_fraction), _gb(r.temp)])
    md += ["", f"ZeRO-3 knobs ({args.model}, same step): collective instructions in the scheduled "
               f"program, the largest combined one (MB, full buffer), the share of bytes sent "
               f"asynchronously, with compute and with a matmul in flight, XLA temp (GB)", "",
           "| zero_optimization | all-gathers | largest AG MB | reduce-scatters | largest RS MB | "
           "async | overlapped | matmul in flight | temp GB |",
           "|---|---|---|---|---|---|---|---|---|"]
    md += ["| " + " | ".join(row) + " |" for row in knob_rows]
  text = "\n".join(md)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "aot_7b.md").write_text(text + "\n")
  (out / "aot_7b.json").write_text(json.dumps(
      [{"table": table, "row": label, **r.to_json()} for table, label, r in reports], indent=1))
  if args.record:
    Path(args.record).write_text(json.dumps(_record(head, reports), indent=1) + "\n")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
