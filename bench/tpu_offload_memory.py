"""Benchmark: the offload steps' HBM, compiled for a TPU slice without a TPU, beside the model.

  python bench/tpu_offload_memory.py [--model 1.3b] [--layers 4] [--micro-batch 4] [--tpu v5e]
      [--topology 2x4]

Compile-only TPU chips keep host memory kinds, so the step with offload compiles as it is (the
gradient slots and handed gradients of ``update: cpu_adam``, the master and moments in
``pinned_host`` for ``stream``, params in host memory). One row per configuration -- ZeRO-2 and
ZeRO-3 without offload, ZeRO-2 with the host Adam, ZeRO-3 with parameter and optimizer offload
(``cpu_adam`` and ``stream``) -- bf16 + AdamW: XLA's memory analysis (arguments, temporaries,
arguments in host memory), the compiled HBM peak, the memory model's peak for the same step
(:func:`jzero.analysis.step_memory.step_memory`) and their ratio. Needs libtpu (the tpu-aot
extra). Each compile takes tens of seconds at the default shape.

A model whose temporaries fit in the chip's on-chip memory (the suite's 2-layer d-256 GPT) shows
0 bytes of HBM temporaries without offload, where a host transfer still stages its buffers in HBM:
there the offload step's peak is above the plain one's. Compare at a shape whose activations
live in HBM (the default: four layers of the 1.3B model).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

from jzero.analysis.tables import format_bytes, text_table
from jzero.models.gpt import preset
from jzero.planning import aot

CONFIGS = (
    ("ZeRO-2", {"stage": 2}),
    ("ZeRO-2 + cpu_adam", {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                             "update": "cpu_adam"}}),
    ("ZeRO-3", {"stage": 3}),
    ("ZeRO-3 + cpu_adam, params cpu", {"stage": 3, "offload_optimizer": {
        "device": "cpu", "update": "cpu_adam"}, "offload_param": {"device": "cpu"}}),
    ("ZeRO-3 + stream, params cpu", {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                       "update": "stream"},
                                     "offload_param": {"device": "cpu"}}),
)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="1.3b")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--micro-batch", type=int, default=4)
  ap.add_argument("--tpu", default="v5e")
  ap.add_argument("--topology", default="2x4")
  args = ap.parse_args()
  model = dataclasses.replace(preset(args.model), n_layers=args.layers)
  base = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
  rows = []
  for name, zero in CONFIGS:
    start = time.perf_counter()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      r = aot.compile_for(dict(base, zero_optimization=zero), tpu=args.tpu,
                          topology=args.topology, model=model)
    print(f"{name}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
    rows.append([name, format_bytes(r.argument), format_bytes(r.temp),
                 format_bytes(r.host_argument), format_bytes(r.peak),
                 format_bytes(r.step_estimate), f"{r.peak / r.step_estimate:.3f}"])
  print(f"\n{args.model} x {args.layers} layers, micro-batch {args.micro_batch}, bf16 AdamW, "
        f"{args.tpu} {args.topology} (per chip)")
  print(text_table(["step", "arguments", "temp", "host arguments", "compiled peak",
                      "model's peak", "compiled / model"], rows))


if __name__ == "__main__":
  main()
