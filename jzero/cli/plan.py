"""``jzero plan``: which ZeRO config runs a job fastest on a GPU topology you may not have
(:mod:`jzero.planning.search`): the table of every candidate, the chosen config written as a
DeepSpeed JSON, and why it beat the runner-up."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jzero.cli.estimate import parse_bytes, parse_count
from jzero.errors import ConfigError

__all__ = ["add_parser", "add_plan_arguments", "run_plan"]


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("plan", help="search ZeRO stages, offload, checkpointing and micro-batch "
                     "for a GPU topology: fit and predicted step time per candidate, the best "
                     "written as a DeepSpeed config (gpu-aot extra to compile)")
  add_plan_arguments(p)
  p.set_defaults(func=run_plan)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the ``jzero plan`` flags to ``parser`` (see :func:`run_plan`)."""
  from jzero.models.gpt import PRESETS  # noqa: PLC0415
  from jzero.planning.aot import GPU_SPECS  # noqa: PLC0415
  from jzero.planning.cost import DEFAULT_MEM_FRACTION, MEM_FRACTION_ENV  # noqa: PLC0415
  from jzero.planning.search import (DEFAULT_COMPILE_TOP, DEFAULT_MARGIN,  # noqa: PLC0415
                                     DEFAULT_TIME_BUDGET)

  m = parser.add_argument_group("model (the embedded GPT)")
  what = m.add_mutually_exclusive_group()
  what.add_argument("--params", type=parse_count, default=None,
                    help="parameter count, e.g. 7e9 or 1e12: a preset within 10%%, else a GPT "
                         "at the ZeRO-Infinity paper's aspect ratio")
  what.add_argument("--model", choices=sorted(PRESETS), default=None,
                    help="shape preset (default: default, the embedded 6.4M model)")
  for flag, field in (("--layers", "n_layers"), ("--d-model", "d_model"), ("--heads", "n_heads"),
                      ("--seq-len", "seq_len"), ("--vocab-size", "vocab_size"),
                      ("--mlp-dim", "mlp_dim")):
    m.add_argument(flag, type=int, default=None, dest=field, help=f"GPTConfig.{field}")
  t = parser.add_argument_group("target (defaults: the part's datasheets and node, printed)")
  t.add_argument("--gpu", default="h100", help=f"GPU part: {', '.join(sorted(GPU_SPECS))}")
  t.add_argument("--tpu", choices=("v4", "v5e", "v5p", "v6e"), default=None,
                 help="plan for a TPU slice instead (tpu-aot extra to compile); give --topology")
  t.add_argument("--topology", default=None, help="the TPU slice's chip grid, e.g. 2x2x2")
  t.add_argument("--slices", type=int, default=1, help="TPU slices over DCN (default 1)")
  t.add_argument("--devices", type=int, default=8, help="GPUs per node (default 8)")
  t.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
  t.add_argument("--host-memory", type=parse_bytes, default=None, help="host memory per node")
  t.add_argument("--nvme", type=parse_bytes, default=None, dest="nvme_bytes",
                 help="NVMe bytes per node")
  t.add_argument("--nvme-bandwidth", type=parse_bytes, default=None,
                 help="NVMe bytes/s per node, e.g. 25GB")
  t.add_argument("--mem-fraction", type=float, default=DEFAULT_MEM_FRACTION,
                 help=f"share of each GPU's memory the step may use (default "
                      f"{DEFAULT_MEM_FRACTION}); the run must set {MEM_FRACTION_ENV} to it "
                      f"(written beside --out), JAX preallocates 0.75 otherwise")
  j = parser.add_argument_group("job and search")
  j.add_argument("--global-batch", type=int, default=None,
                 help="sequences per step (default 4 per GPU)")
  j.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
  j.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to try (default 0,1,2,3)")
  j.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                 help=f"share of each memory left free (default {DEFAULT_MARGIN})")
  j.add_argument("--compile-top", type=int, default=DEFAULT_COMPILE_TOP,
                 help=f"compile candidates in order of predicted time until one fits by its "
                      f"compile and at least this many were compiled (default "
                      f"{DEFAULT_COMPILE_TOP}); 0 ranks by arithmetic alone")
  j.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET,
                 help=f"seconds of compiling after which the search stops and says so (default "
                      f"{DEFAULT_TIME_BUDGET:g})")
  j.add_argument("--cache-dir", default=None,
                 help="compile cache (default $JZERO_CACHE_DIR or ~/.cache/jzero/plan)")
  o = parser.add_argument_group("output")
  o.add_argument("--out", default="plan_config.json",
                 help="where the chosen DeepSpeed config is written (default plan_config.json)")
  o.add_argument("--nvme-path", default=None, help="nvme_path in the written config (default "
                 "/local_nvme, DeepSpeed's tutorials')")
  o.add_argument("--report", default=None, help="also write the whole plan as JSON here")
  o.add_argument("--all", action="store_true", help="print every candidate (default: 40)")
  o.add_argument("--advice", action=argparse.BooleanOptionalAction, default=True,
                 help="where the chosen config overlaps under 90%% of its collective bytes on a "
                      "GPU, compile its step again with each knob that would raise it and print "
                      "what each gives (a compile each; default on, as jzero aot's)")


def _model(args: argparse.Namespace):
  from jzero.models.gpt import preset  # noqa: PLC0415
  from jzero.planning.candidates import gpt_for_params  # noqa: PLC0415

  base = gpt_for_params(args.params) if args.params is not None else preset(args.model or "default")
  fields = {f: getattr(args, f) for f in ("n_layers", "d_model", "n_heads", "seq_len",
                                          "vocab_size", "mlp_dim") if getattr(args, f) is not None}
  bad = [f"{k}={v}" for k, v in fields.items() if v < 1]
  if bad:
    raise ConfigError(f"model shape flags must be positive: {', '.join(bad)}.")
  model = dataclasses.replace(base, **fields)
  if model.d_model % model.n_heads:
    raise ConfigError(f"--d-model {model.d_model} is not a multiple of --heads {model.n_heads}.")
  return model


def _advise(plan) -> None:
  """Where the chosen config overlaps less than 90% of its collective bytes on a GPU: its step
  compiled again with each knob that would raise it (``jzero aot``'s advice), printed."""
  from jzero.planning.aot import compile_for  # noqa: PLC0415
  from jzero.planning.aot_report import format_overlap  # noqa: PLC0415
  from jzero.planning.compiled import device_twin  # noqa: PLC0415
  from jzero.planning.overlap import ADVISE_BELOW  # noqa: PLC0415

  chosen = plan.chosen
  if (chosen is None or chosen.compiled is None or plan.target == "cpu"
      or plan.target.startswith("tpu:")  # the knobs advised are XLA GPU options
      or chosen.resources.overlap >= ADVISE_BELOW):
    return
  progress = lambda line: print(f"jzero plan: {line}", file=sys.stderr, flush=True)  # noqa: E731
  hw = plan.hardware
  report = compile_for(device_twin(plan.deepspeed_config()), plan.target, hw.devices,
                       nodes=hw.nodes, model=plan.job.model,
                       memory_fraction=hw.memory_fraction.value, progress=progress, advise=True)
  print(f"\nthe chosen config overlaps {chosen.resources.overlap:.0%} of its collective bytes; "
        f"its step compiled with each knob that would raise it:")
  print(format_overlap(report))


def run_plan(args: argparse.Namespace) -> int:
  """``jzero plan``: prints the table, writes the chosen config to ``--out`` and the environment
  the run needs (``XLA_PYTHON_CLIENT_MEM_FRACTION``) beside it, ``<out>.env``."""
  from jzero.cli.processes import host_only  # noqa: PLC0415
  from jzero.planning import plan_for  # noqa: PLC0415
  from jzero.planning.cost import MEM_FRACTION_ENV  # noqa: PLC0415
  from jzero.planning.plan_report import format_plan  # noqa: PLC0415

  host_only()
  try:
    stages = tuple(int(s) for s in args.stages.split(","))
  except ValueError:
    stages = (-1,)
  if not stages or not set(stages) <= {0, 1, 2, 3}:
    raise ConfigError(f"--stages {args.stages!r}: give ZeRO stages 0-3 separated by commas, "
                      f"e.g. --stages 1,2,3.")
  plan = plan_for(_model(args), gpu=args.gpu, devices=args.devices, nodes=args.nodes,
                  global_batch=args.global_batch, precision=args.precision,
                  host_memory=args.host_memory, nvme_bytes=args.nvme_bytes,
                  nvme_bandwidth=args.nvme_bandwidth, mem_fraction=args.mem_fraction,
                  compile=args.compile_top > 0, compile_top=args.compile_top,
                  time_budget=args.time_budget, margin=args.margin, stages=stages,
                  cache_dir=args.cache_dir, tpu=args.tpu, topology=args.topology,
                  slices=args.slices,
                  progress=lambda line: print(f"jzero plan: {line}", file=sys.stderr, flush=True))
  print(format_plan(plan, limit=None if args.all else 40))
  if args.advice:
    _advise(plan)
  if args.report:
    Path(args.report).write_text(json.dumps(plan.to_json(), indent=1))
  if plan.chosen is None:
    return 1
  out = Path(args.out)
  env = out.with_suffix(".env")
  fraction = f"{plan.hardware.memory_fraction.value:.2f}"
  out.write_text(json.dumps(plan.deepspeed_config(args.nvme_path), indent=2) + "\n")
  env.write_text(f"{MEM_FRACTION_ENV}={fraction}\n")
  print(f"written: {out} and {env}; run with {MEM_FRACTION_ENV}={fraction}, the share of each "
        f"GPU's memory this plan budgets (JAX preallocates 0.75 without it):\n"
        f"  export $(cat {env}); jzero train --config {out}")
  return 0
