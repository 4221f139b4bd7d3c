"""The questions a user asks ``jzero plan``, answered as a new user would ask them, compile-only.

  python bench/plan_questions.py [--compile-top 6] [--only 13b] [--cache-dir DIR] [--out bench/out]

1. 7B on 8 x H100 (the ZeRO paper's first table: why DDP does not fit);
2. 13B on 8 x A100-40GB (the ZeRO write-ups' own example), and with ZeRO-2 only;
3. 10B on one RTX 3090 with 256 GB of host memory, and with 128 GB without and with an NVMe
   drive (ZeRO-Offload's "10B on one GPU", ZeRO-Infinity);
4. 70B on 64 x H100 in 8 nodes (ZeRO++: hpZ's partition is a node, 8 GPUs);
5. 1T on 2 x 8 A100 with 1.5 TB of host memory and 28 TB of NVMe per node (ZeRO-Infinity).

For each chosen configuration ``jzero estimate`` is run as the plan's closing line says, and its
step's peak per device and host bytes per node are set beside the plan's.

Each question is planned with ``jzero plan``'s defaults (``--compile-top 1``: compile in order of
predicted time until a candidate is proven to fit by its compile) and a cold compile cache (a
temporary directory unless ``--cache-dir``), timed. Then the 7B, 13B and 70B questions are planned
again with ``--compile-top N`` on the same cache, to compare the estimator with more compiles: the
table of every compiled candidate (estimate, compiled figure, their ratio) and the median and
worst |estimate / compiled - 1| over the rows whose device bytes are a compiled peak (an offload
candidate's row derives its figure from its twin's compile and is shown, not counted).

Writes ``plan_questions.md`` (the tables docs/planning.md shows, with the command and the date) and
``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

QUESTIONS = {
    "7b": ("7B on 8 x H100", dict(model=7e9, gpu="h100", devices=8)),
    "13b": ("13B on 8 x A100-40GB", dict(model=13e9, gpu="a100-40gb", devices=8)),
    "13b-zero2": ("13B with ZeRO-2 on 8 x A100-40GB",
                  dict(model=13e9, gpu="a100-40gb", devices=8, stages=(2,))),
    "10b": ("10B on one RTX 3090, 256 GB host memory",
            dict(model=10e9, gpu="rtx3090", devices=1, host_memory=256e9)),
    "10b-host": ("10B on one RTX 3090, 128 GB host memory, no NVMe",
                 dict(model=10e9, gpu="rtx3090", devices=1, host_memory=128e9,
                      offload_tiers=("cpu",))),
    "10b-nvme": ("10B on one RTX 3090, 128 GB host memory and a 2 TB NVMe drive",
                 dict(model=10e9, gpu="rtx3090", devices=1, host_memory=128e9)),
    "70b": ("70B on 64 x H100 (8 nodes)", dict(model=70e9, gpu="h100", devices=8, nodes=8)),
    "1t": ("1T on 2 x 8 A100, 1.5 TB host memory and 28 TB NVMe per node",
           dict(model=1e12, gpu="a100", devices=8, nodes=2, host_memory=1.5e12,
                nvme_bytes=28e12)),
}
ESTIMATOR_TABLES = ("7b", "13b", "70b")


def _flags(kwargs: dict) -> str:
  """The ``jzero plan`` command line of a question."""
  count = kwargs["model"]
  exp = next(e for e in (12, 9, 6, 0) if count % 10**e == 0)
  params = f"{int(count // 10**exp)}e{exp}" if exp else f"{count:g}"
  flags = [f"--params {params}", f"--gpu {kwargs['gpu']}",
           f"--devices {kwargs['devices']}"]
  if kwargs.get("nodes", 1) > 1:
    flags.append(f"--nodes {kwargs['nodes']}")
  if "host_memory" in kwargs:
    flags.append(f"--host-memory {kwargs['host_memory'] / 1e9:g}GB")
  if "nvme_bytes" in kwargs:
    flags.append(f"--nvme {kwargs['nvme_bytes'] / 1e12:g}TB")
  if kwargs.get("offload_tiers") == ("cpu",):
    flags.append("--nvme 0")
  if "stages" in kwargs:
    flags.append("--stages " + ",".join(map(str, kwargs["stages"])))
  return "jzero plan " + " ".join(flags)


def _gb(x: float) -> str:
  return f"{x / 1e9:.2f}"


def answer(name: str, kwargs: dict, cache: str, compile_top: int) -> dict:
  from jzero.planning import plan_for  # noqa: PLC0415

  kwargs = dict(kwargs)
  if kwargs.pop("offload_tiers", None) == ("cpu",):
    kwargs["nvme_bytes"] = 0.0
  t0 = time.perf_counter()
  plan = plan_for(kwargs.pop("model"), cache_dir=cache, compile_top=compile_top,
                  progress=lambda line: print(f"  [{name}] {line}", file=sys.stderr, flush=True),
                  **kwargs)
  seconds = time.perf_counter() - t0
  from jzero.planning.plan_report import budget_line, search_line, stage_lines  # noqa: PLC0415

  rows = [{"name": r.name, "status": r.status, "from": r.device_from,
           "estimate": r.estimate_bytes, "compiled": r.device_bytes,
           "compiled_peak": r.compiled.peak, "ratio": r.estimate_ratio,
           "predicted_s": r.prediction.seconds}
          for r in plan.rows if r.compiled is not None]
  chosen = plan.chosen
  return {"seconds": seconds, "chosen": chosen.name if chosen else None,
          "chosen_bytes": chosen.device_bytes if chosen else None,
          "chosen_from": chosen.device_from if chosen else None,
          "chosen_host": chosen.host_bytes if chosen else None,
          "budget": budget_line(plan), "search": search_line(plan), "stages": stage_lines(plan),
          "why": plan.to_json()["why"], "compiled": rows,
          "config": plan.deepspeed_config() if chosen else None,
          **(estimator_says(plan) if chosen else {})}


def estimator_says(plan: object) -> dict:
  """``jzero estimate`` run as the plan's closing line says: its step's peak per device and host
  bytes per node for the chosen configuration, beside the plan's."""
  from jzero import cli  # noqa: PLC0415
  from jzero.planning.plan_report import estimate_command  # noqa: PLC0415

  command = estimate_command(plan)
  if command is None:
    return {}
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    cli.main(shlex.split(command)[1:])
  line = next(line for line in out.getvalue().splitlines()
              if line.startswith(f"  {_estimate_name(plan)}: ") and "/node" in line)
  device = float(line.split(": ", 1)[1].split(" GB", 1)[0].replace(",", "")) * 1e9
  host = float(line.rsplit("host ", 1)[1].split(" GB", 1)[0].replace(",", "")) * 1e9
  return {"estimate_command": command, "estimate_device": device, "estimate_host": host}


def _estimate_name(plan: object) -> str:
  from jzero.planning.candidates import estimated  # noqa: PLC0415

  return estimated(plan.chosen.candidate, plan.job, plan.hardware).estimate.name


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--compile-top", type=int, default=6,
                 help="compiles per estimator table (7B, 13B, 70B; default 6)")
  p.add_argument("--only", nargs="+", choices=sorted(QUESTIONS), default=None)
  p.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory")
  p.add_argument("--out", default="bench/out")
  args = p.parse_args()
  warnings.simplefilter("ignore")
  import jax  # noqa: PLC0415

  import jzero  # noqa: F401, PLC0415

  names = args.only or list(QUESTIONS)
  results: dict[str, dict] = {}
  with tempfile.TemporaryDirectory() as tmp:
    cache = args.cache_dir or tmp
    for name in names:
      title, kwargs = QUESTIONS[name]
      print(f"{title}: {_flags(kwargs)}", file=sys.stderr, flush=True)
      results[name] = answer(name, kwargs, cache, 1)
      results[name].update(title=title, command=_flags(kwargs))
    for name in [n for n in ESTIMATOR_TABLES if n in names and args.compile_top > 1]:
      print(f"{QUESTIONS[name][0]}: --compile-top {args.compile_top}", file=sys.stderr)
      results[name]["more"] = answer(name, QUESTIONS[name][1], cache, args.compile_top)
  head = (f"{datetime.date.today()}, {platform.machine()}, jax {jax.__version__}, XLA's GPU "
          f"compiler (compile-only), cold cache; `python bench/plan_questions.py --compile-top "
          f"{args.compile_top}`")
  from jzero.analysis.tables import markdown_table  # noqa: PLC0415

  lines = [head, "", *markdown_table(
      ("question", "command", "chosen", "device bytes", "search", "time"),
      [(r["title"], f"`{r['command']}`", r["chosen"] or "none",
        _gb(r["chosen_bytes"]) + f" GB ({r['chosen_from']})" if r["chosen"] else "-",
        r["search"].split(";")[0].removeprefix("search: "), f"{r['seconds']:.0f} s")
       for r in (results[name] for name in names)])]
  agreed = [results[name] for name in names if "estimate_device" in results[name]]
  if agreed:
    lines += ["", "`jzero estimate` for each chosen configuration (the command the plan prints), "
                  "beside `jzero plan`:", "", *markdown_table(
                  ("question", "plan device GB", "estimate device GB", "plan / estimate",
                   "plan host GB/node", "estimate host GB/node", "plan / estimate"),
                  [(r["title"], _gb(r["chosen_bytes"]), _gb(r["estimate_device"]),
                    f"{r['chosen_bytes'] / r['estimate_device']:.3f}", _gb(r["chosen_host"]),
                    _gb(r["estimate_host"]), f"{r['chosen_host'] / r['estimate_host']:.3f}")
                   for r in agreed])]
  for name in names:
    r = results[name]
    lines += ["", f"**{r['title']}** (`{r['command']}`)", "", "```", r["budget"], r["search"],
              *[s.strip() for s in r["stages"]], f"chosen: {r['chosen'] or 'none'}", "```"]
    if not r["chosen"]:
      lines += ["", r["why"]]
    if "estimate_command" in r:
      lines += ["", f"`{r['estimate_command']}`"]
  errors = []
  for name in [n for n in ESTIMATOR_TABLES if n in names]:
    r = results[name].get("more", results[name])
    lines += ["", f"Estimate against compile, {results[name]['title']} (every compiled "
                  f"candidate; GB per device):", "", *markdown_table(
                  ("candidate", "status", "estimate", "compiled", "from", "estimate / compiled"),
                  [(row["name"], row["status"], _gb(row["estimate"]), _gb(row["compiled"]),
                    row["from"], "-" if row["ratio"] is None else f"{row['ratio']:.3f}")
                   for row in r["compiled"]])]
    errors += [abs(row["ratio"] - 1) for row in r["compiled"] if row["from"] == "compiled"]
  if errors:
    lines += ["", f"Estimator over the 7B, 13B and 70B tables ({len(errors)} compiled peaks): "
                  f"median |estimate / compiled - 1| = {statistics.median(errors):.1%}, worst "
                  f"{max(errors):.1%}"]
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "plan_questions.md").write_text("\n".join(lines) + "\n")
  (out / "plan_questions.json").write_text(json.dumps(
      {"source": head, "results": results,
       "median_error": statistics.median(errors) if errors else None,
       "worst_error": max(errors) if errors else None}, indent=1, default=str))
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
