"""``jzero convert`` (DeepSpeed's ``zero_to_fp32``) and ``jzero inspect``: checkpoints on the
host (:mod:`jzero.checkpoint`)."""

from __future__ import annotations

import argparse

from jzero.cli.processes import host_only

__all__ = ["add_parser", "convert", "inspect"]


def convert(args: argparse.Namespace) -> int:
  host_only()
  from jzero import checkpoint  # noqa: PLC0415 (imports JAX after host_only chose the CPU)
  report = checkpoint.consolidate(args.checkpoint, tag=args.tag, safetensors=args.safetensors,
                                  orbax=args.orbax, dtype=args.dtype)
  print(f"jzero: checkpoint {report.tag!r} (step {report.step}): {report.leaves} leaves, "
        f"{report.total_bytes / 2**20:.2f} MiB of {report.dtype} weights (largest leaf "
        f"{report.largest_leaf_bytes / 2**20:.2f} MiB)")
  for out in report.outputs:
    print(f"jzero: wrote {out}")
  return 0


def inspect(args: argparse.Namespace) -> int:
  host_only()
  from jzero import checkpoint  # noqa: PLC0415
  print(checkpoint.describe(args.checkpoint, args.tag))
  return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
  c = sub.add_parser("convert", help="consolidate a training checkpoint into plain weights "
                     "(DeepSpeed's zero_to_fp32)")
  c.add_argument("checkpoint", help="checkpoint directory (or one checkpoint's directory)")
  c.add_argument("--tag", "--step", default=None,
                 help="the checkpoint to convert: its tag or step (default: the latest)")
  c.add_argument("--safetensors", default=None, help="write the weights to this safetensors file")
  c.add_argument("--orbax", default=None,
                 help="write the weights as a params-only Orbax checkpoint in this directory")
  c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                 help="dtype of the written weights (default fp32)")
  c.set_defaults(func=convert)

  i = sub.add_parser("inspect", help="describe a checkpoint: step, stage, mesh, precision, arrays")
  i.add_argument("checkpoint", help="checkpoint directory (or one checkpoint's directory)")
  i.add_argument("--tag", "--step", default=None,
                 help="the checkpoint to describe: its tag or step (default: the latest)")
  i.set_defaults(func=inspect)
