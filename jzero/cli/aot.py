"""``jzero aot``: the step compiled for a GPU topology or a TPU slice that is not present
(:mod:`jzero.planning.aot`, :mod:`jzero.planning.tpu_specs`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jzero.planning.aot import GPU_SPECS, compile_for
from jzero.planning.tpu_specs import TPU_SPECS
from jzero.planning.aot_report import format_report
from jzero.cli.processes import host_only
from jzero.errors import ConfigError

__all__ = ["add_parser", "add_aot_arguments", "run_aot"]


def add_parser(sub: argparse._SubParsersAction) -> None:
  a = sub.add_parser("aot", help="compile the train step for a GPU topology without a GPU: "
                     "memory, fit and collective overlap from XLA's GPU compiler (gpu-aot extra)")
  add_aot_arguments(a)
  a.set_defaults(func=run_aot)


def add_aot_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the ``jzero aot`` flags to ``parser`` (see :func:`run_aot`)."""
  from jzero.models.gpt import PRESETS  # noqa: PLC0415

  parser.add_argument("--config", required=True, help="DeepSpeed-style JSON or YAML config")
  parser.add_argument("--gpu", default="h100",
                      help=f"GPU part: {', '.join(sorted(GPU_SPECS))}, or the path of an XLA GPU "
                           f"target config (.txtpb); default h100 (SXM, 80 GB)")
  parser.add_argument("--devices", type=int, default=8, help="GPUs in all (default 8)")
  parser.add_argument("--nodes", type=int, default=1,
                      help="nodes the GPUs are spread over (default 1)")
  parser.add_argument("--tpu", choices=sorted(TPU_SPECS), default=None,
                      help="compile for a TPU slice instead of GPUs (tpu-aot extra): the "
                           "generation; give --topology too")
  parser.add_argument("--topology", default=None,
                      help="the TPU slice's chip grid, e.g. 2x4 (v5e, v6e) or 2x2x2 (v4, v5p)")
  parser.add_argument("--slices", type=int, default=1,
                      help="TPU slices joined by the data-centre network (default 1; ZeRO++'s "
                           "hpZ / qgZ take them as the node axis)")
  parser.add_argument("--mesh", default=None,
                      help="mesh file (configs/mesh/*.yaml); default: all GPUs on one data axis")
  m = parser.add_argument_group("model (the embedded GPT)")
  m.add_argument("--model", choices=sorted(PRESETS), default="default",
                 help="shape preset: default (the embedded 6.4M model), 1.3b (GPT-3 XL), 7b "
                      "(Llama-like); the flags below change single fields")
  for flag, field in (("--layers", "n_layers"), ("--d-model", "d_model"), ("--heads", "n_heads"),
                      ("--seq-len", "seq_len"), ("--vocab-size", "vocab_size"),
                      ("--mlp-dim", "mlp_dim")):
    m.add_argument(flag, type=int, default=None, dest=field, help=f"GPTConfig.{field}")
  s = parser.add_argument_group("step")
  s.add_argument("--micro-batch", type=int, default=None,
                 help="sequences per GPU per micro-batch (overrides the config's "
                      "train_micro_batch_size_per_gpu; it fills 'auto' too)")
  s.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                 help="overrides the config's precision (bf16/fp16 keep an fp32 master)")
  s.add_argument("--checkpoint-activations", action=argparse.BooleanOptionalAction, default=None,
                 help="add / remove the config's activation_checkpointing block (default: as "
                      "the config says)")
  parser.add_argument("--mem-fraction", type=float, default=None,
                      help="fraction of the device's memory the step may use (default: 0.75 of "
                           "a GPU, what JAX preallocates; 1.0 of a TPU's HBM)")
  parser.add_argument("--advice", action=argparse.BooleanOptionalAction, default=True,
                      help="where under 90%% of the bytes overlap compute, compile the step again "
                           "with each knob that would raise it and report what each gives and "
                           "costs (a compile each; default on)")
  parser.add_argument("--json", action="store_true",
                      help="print the report as JSON on stdout (progress stays on stderr)")


def run_aot(args: argparse.Namespace) -> int:
  """``jzero aot``: compiles the step for the GPU topology and prints the report."""
  from jzero.models.gpt import preset  # noqa: PLC0415

  host_only()  # the host side runs on CPU: no CUDA backend to start without a GPU
  fields = {f: getattr(args, f) for f in ("n_layers", "d_model", "n_heads", "seq_len",
                                          "vocab_size", "mlp_dim") if getattr(args, f) is not None}
  bad = [f"{k}={v}" for k, v in fields.items() if v < 1]
  if bad:
    raise ConfigError(f"model shape flags must be positive: {', '.join(bad)}.")
  model = dataclasses.replace(preset(args.model), **fields)
  if model.d_model % model.n_heads:
    raise ConfigError(f"--d-model {model.d_model} is not a multiple of --heads {model.n_heads}.")
  progress = lambda line: print(f"jzero aot: {line}", file=sys.stderr, flush=True)  # noqa: E731
  tpu = {} if args.tpu is None else {"tpu": args.tpu, "topology": args.topology,
                                     "slices": args.slices}
  if args.tpu is None and args.topology is not None:
    raise ConfigError(f"--topology {args.topology!r} is a TPU slice's: give --tpu too.")
  report = compile_for(args.config, args.gpu, args.devices, nodes=args.nodes, mesh=args.mesh, **tpu,
                       model=model, micro_batch=args.micro_batch, precision=args.precision,
                       checkpoint_activations=args.checkpoint_activations,
                       memory_fraction=args.mem_fraction, progress=progress,
                       advise=args.advice)
  if args.json:
    print(json.dumps(report.to_json(), indent=1))
  else:
    print(format_report(report))
  return 0
