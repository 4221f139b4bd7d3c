"""ZeRO-3's overlap where memory is tight: each knob's overlap and peak, on XLA's GPU compile.

  python bench/aot_overlap.py [--targets 10b,13b,7b,zeropp] [--out bench/out]

Needs the gpu-aot extra. For each target -- a 10B GPT (40 x 5120, MLP 13824) and the 13.3B shape
``jzero plan`` uses on 8 A100-40GB, a 7B (Llama shape) on 8 H100, and the 10B with ZeRO++ (qwZ +
qgZ) on 2 nodes x 4 A100-40GB -- ZeRO-3, bf16 + fp32 master + AdamW, micro-batch 1 x gas 4,
activation checkpointing per block, 95% of the card usable (``--mem-fraction 0.95``, what
``XLA_PYTHON_CLIENT_MEM_FRACTION=.95`` gives a run), the real train step is compiled for the
topology (``jzero.planning.aot``) once per knob setting, and one row says: the share of the bytes
sent per step with compute in flight over the step, inside the accumulation loop and outside it,
the share with a matmul in flight, the compiled peak per device and its share of the card, and
whether it fits. The settings:

* ``before``: what ``jzero aot`` compiled before the scheduler's limit was set: XLA's limit for a
  part that is not present, 95% of (80% of the card less the step's inputs and outputs);
* ``XLA default``: the limit a run on the card gets from XLA, 95% of (the pool less inputs and
  outputs);
* ``jzero``: the config as it is (``overlap_comm``: the whole pool less inputs and outputs;
  prefetch with ``stage3_max_live_parameters`` 1e9);
* ``max_live below two layers``: no prefetch;
* ``max_live "auto"``: jzero's choice (the prefetch unless the step fits only without it);
* ``limit lifted``: the scheduler with no memory limit (what overlap costs at most);
* ``overlap_comm false``: every collective synchronous.

Writes ``aot_overlap.md`` and ``aot_overlap.json`` to ``--out`` and prints the markdown.
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

MEMORY_FRACTION = 0.95


def _targets():
  from jzero.models import GPTConfig
  from jzero.planning.candidates import gpt_for_params

  ten_b = GPTConfig(vocab_size=50257, seq_len=2048, d_model=5120, n_layers=40, n_heads=40,
                    mlp_dim=13824)
  zeropp = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
  return {  # name -> (label, model, gpu, devices, nodes, extra zero_optimization keys)
      "10b": ("10B (40 x 5120, MLP 13824) x 8 A100-40GB", ten_b, "a100-40gb", 8, 1, {}),
      "13b": ("13.3B (jzero plan's shape: 30 x 6016) x 8 A100-40GB", gpt_for_params(13e9),
              "a100-40gb", 8, 1, {}),
      "7b": ("7B (Llama shape) x 8 H100 80GB", "7b", "h100", 8, 1, {}),
      "zeropp": ("10B, ZeRO++ qwZ + qgZ, 2 nodes x 4 A100-40GB", ten_b, "a100-40gb", 8, 2, zeropp),
  }


def _settings():
  """(label, zero_optimization overrides -- or a function of one layer's parameter count --,
  compile_once keywords, resolve "auto")."""
  return [
      ("before: XLA's compile-only limit", {}, {"slop": 95}, False),
      ("XLA default on the GPU (95% of the pool)", {}, {"run_slop": 95}, False),
      ("jzero: the whole pool, prefetch", {}, {}, False),
      ("stage3_max_live_parameters below two layers: no prefetch",
       lambda layer: {"stage3_max_live_parameters": layer}, {}, False),
      ('stage3_max_live_parameters "auto"', {"stage3_max_live_parameters": "auto"}, {}, True),
      ("scheduler limit lifted (what-if)", {}, {"slop": 10_000}, False),
      ("overlap_comm false", {"overlap_comm": False}, {}, False),
  ]


def _config(**zero) -> dict:
  return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
          "gradient_clipping": 1.0, "bf16": {"enabled": True}, "activation_checkpointing": {},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
          "zero_optimization": {"stage": 3, **zero}}


def _pct(x: float) -> str:
  return "-" if x != x else f"{x:.1%}"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--targets", default="10b,13b,7b,zeropp")
  p.add_argument("--out", default="bench/out")
  args = p.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from jzero.planning import aot, loop_overlap, overlap

  warnings.simplefilter("ignore")  # config notes would repeat per compile
  targets = _targets()
  rows, records = [], []
  for name in args.targets.split(","):
    label, model, gpu, devices, nodes, extra = targets[name]
    layer_params = None
    for setting, zero, keywords, resolve in _settings():
      progress = lambda line, s=setting: print(f"{name} / {s}: {line}", file=sys.stderr)
      zero = zero(layer_params) if callable(zero) else zero
      target, data = aot.prepare(_config(**extra, **zero), gpu, devices, nodes=nodes, model=model,
                                 memory_fraction=MEMORY_FRACTION, progress=progress)
      r = (overlap.compile_resolved(aot.compile_once, target, data) if resolve
           else aot.compile_once(target, data, **keywords))
      if layer_params is None:
        layer_params = r.largest_gathered // 2
      shares = loop_overlap.breakdown(r.collectives, r.gradient_accumulation_steps)
      row = [label, setting, _pct(r.overlap_fraction),
             _pct(loop_overlap.place_overlap(shares, loop_overlap.IN_LOOP)),
             _pct(loop_overlap.place_overlap(shares, loop_overlap.OUTSIDE)),
             _pct(r.matmul_overlap_fraction), f"{r.peak / 1e9:.2f}",
             f"{r.peak / r.device_memory:.1%}", "yes" if r.fits else "no",
             f"{r.sent_bytes / 1e9:.0f}"]
      rows.append(row)
      print("| " + " | ".join(row) + " |", file=sys.stderr)
      records.append({"target": name, "setting": setting, "choices": list(r.choices),
                      **{k: v for k, v in r.to_json().items() if k != "collectives"}})
  head = (f"{datetime.date.today().isoformat()}, {platform.machine()}, jax {jax.__version__}, XLA "
          f"GPU compiler (jax-cuda12-plugin), compile-only; ZeRO-3, bf16 + fp32 master + AdamW, "
          f"micro-batch 1 x gas 4 x 2048 tokens, activation checkpointing per block, usable = "
          f"{MEMORY_FRACTION:.0%} of the card; overlapped = share of the bytes sent per device "
          f"per step with compute in flight; GB = 1e9 bytes per device")
  md = [head, "", "| target | setting | overlapped | in the loop | outside | matmul in flight | "
        "peak GB | of the card | fits | GB sent |", "|---|---|---|---|---|---|---|---|---|---|"]
  md += ["| " + " | ".join(row) + " |" for row in rows]
  text = "\n".join(md)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "aot_overlap.md").write_text(text + "\n")
  (out / "aot_overlap.json").write_text(json.dumps(records, indent=1))
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
