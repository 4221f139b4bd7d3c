"""7B and 70B on TPU slices: which ZeRO config ``jzero plan --tpu`` chooses for each slice.

  python bench/tpu_slices.py [--compile]

For each slice (TPU v5p 2x2x2 and 4x4x4, v6e 2x4, v5e 4x4) and model (the 7B preset's shape at
6.75B parameters, a 70B GPT at the ZeRO-Infinity paper's aspect ratio), bf16, 4 sequences per
chip: the plan's chosen candidate, its bytes per chip against the usable HBM, and the predicted
step time (the cost model's arithmetic over the datasheet rates of
:mod:`jzero.planning.tpu_specs`). Without ``--compile`` the search ranks by arithmetic alone
(seconds); with it, candidates are compiled for the compile-only chips until one fits by its
compile (libtpu; minutes per 7B compile on 2 cores, longer for 70B).
"""

from __future__ import annotations

import argparse
import time

import jzero  # noqa: F401  (keeps libtpu quiet until a TPU compile asks for it)
from jzero.analysis.tables import format_bytes, text_table
from jzero.planning import plan_for

SLICES = (("v5p", "2x2x2"), ("v6e", "2x4"), ("v5e", "4x4"), ("v5p", "4x4x4"))
MODELS = (("7B", 7e9), ("70B", 70e9))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--compile", action="store_true", help="compile until one fits")
  args = parser.parse_args()
  rows = []
  for label, params in MODELS:
    for tpu, topology in SLICES:
      t0 = time.perf_counter()
      plan = plan_for(params, tpu=tpu, topology=topology, compile=args.compile)
      chosen = plan.chosen
      rows.append([label, f"{tpu} {topology}", str(plan.hardware.devices),
                   format_bytes(plan.usable),
                   chosen.name if chosen else "none fits",
                   f"{format_bytes(chosen.device_bytes)} ({chosen.device_from})" if chosen else "-",
                   f"{chosen.prediction.seconds:.2f}" if chosen else "-",
                   f"{time.perf_counter() - t0:.0f}"])
  print(text_table(["model", "slice", "chips", "usable HBM/chip", "chosen", "bytes/chip",
                    "predicted s/step", "plan s"], rows))


if __name__ == "__main__":
  main()
