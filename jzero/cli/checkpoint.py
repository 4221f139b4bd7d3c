"""``jzero convert`` (DeepSpeed's ``zero_to_fp32``; ``--optax``: a plain Flax + optax run's Orbax
checkpoint) and ``jzero inspect``: checkpoints on the host (:mod:`jzero.checkpoint`). Both also
take a DeepSpeed checkpoint (``convert --from-deepspeed DIR``; ``inspect`` recognises one), read
without torch (:mod:`jzero.checkpoint.deepspeed`)."""

from __future__ import annotations

import argparse

from jzero.cli.processes import host_only

__all__ = ["add_parser", "convert", "inspect"]


def convert(args: argparse.Namespace) -> int:
  host_only()
  from jzero import checkpoint  # noqa: PLC0415 (imports JAX after host_only chose the CPU)
  if args.from_deepspeed is not None or args.checkpoint is None:
    return _convert_deepspeed(args)
  if args.optax is not None:
    _export_optax(args)
    if args.safetensors is None and args.orbax is None:
      return 0
  report = checkpoint.consolidate(args.checkpoint, tag=args.tag, safetensors=args.safetensors,
                                  orbax=args.orbax, dtype=args.dtype)
  print(f"jzero: checkpoint {report.tag!r} (step {report.step}): {report.leaves} leaves, "
        f"{report.total_bytes / 2**20:.2f} MiB of {report.dtype} weights (largest leaf "
        f"{report.largest_leaf_bytes / 2**20:.2f} MiB)")
  for out in report.outputs:
    print(f"jzero: wrote {out}")
  return 0


def _export_optax(args: argparse.Namespace) -> None:
  """``jzero convert DIR --optax OUT``: the checkpoint as a plain Flax + optax run's Orbax
  ``CheckpointManager`` step (:func:`jzero.checkpoint.export_optax`), its optimizer rebuilt from
  the config the checkpoint records."""
  from jzero import checkpoint  # noqa: PLC0415
  from jzero.errors import CheckpointError  # noqa: PLC0415
  from jzero.train.optim import build_optimizer  # noqa: PLC0415

  config = checkpoint.read_metadata(args.checkpoint, args.tag)["config"]
  if not config.get("optimizer"):
    raise CheckpointError(
        f"{args.checkpoint} was trained with a client optax optimizer (initialize(optimizer=...)), "
        f"which its config does not record, so the command line cannot rebuild its state's "
        f"structure. Export from Python: jzero.checkpoint.export_optax({str(args.checkpoint)!r}, "
        f"{str(args.optax)!r}, optimizer=your_optax_transformation).")
  block = lambda b: None if not b else {"type": b["type"], "params": dict(b.get("params") or {})}
  tx, _ = build_optimizer(block(config["optimizer"]), block(config.get("scheduler")))
  folder = checkpoint.export_optax(args.checkpoint, args.optax, tx, tag=args.tag)
  print(f"jzero: wrote {folder} (CheckpointManager step {folder.name}: params, opt_state)")


def _convert_deepspeed(args: argparse.Namespace) -> int:
  """``jzero convert --from-deepspeed DIR --safetensors FILE``: zero_to_fp32 without torch."""
  from jzero import checkpoint  # noqa: PLC0415
  from jzero.errors import CheckpointError  # noqa: PLC0415

  if args.from_deepspeed is None or args.checkpoint is not None:
    raise CheckpointError("give one checkpoint: a jzero checkpoint directory (jzero convert DIR "
                          "...) or a DeepSpeed one (jzero convert --from-deepspeed DIR ...).")
  if args.safetensors is None or args.orbax is not None or args.optax is not None:
    raise CheckpointError("a DeepSpeed checkpoint converts to a safetensors file: give "
                          "--safetensors FILE (and no --orbax or --optax; to continue it in "
                          "jzero, engine.import_deepspeed).")
  report = checkpoint.convert_deepspeed(args.from_deepspeed, args.safetensors, tag=args.tag,
                                        dtype=args.dtype)
  print(f"jzero: DeepSpeed checkpoint {report['tag']!r} (step {report['step']}): "
        f"{report['tensors']} tensors, {report['total_bytes'] / 2**20:.2f} MiB of "
        f"{report['dtype']} weights (largest {report['largest_bytes'] / 2**20:.2f} MiB)")
  print(f"jzero: wrote {report['output']}")
  return 0


def inspect(args: argparse.Namespace) -> int:
  host_only()
  from jzero import checkpoint  # noqa: PLC0415
  if checkpoint.find_deepspeed(args.checkpoint, args.tag) is not None:
    print(checkpoint.describe_deepspeed(args.checkpoint, args.tag))
    return 0
  print(checkpoint.describe(args.checkpoint, args.tag))
  return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
  c = sub.add_parser("convert", help="consolidate a training checkpoint into plain weights "
                     "(DeepSpeed's zero_to_fp32)")
  c.add_argument("checkpoint", nargs="?", default=None,
                 help="checkpoint directory (or one checkpoint's directory)")
  c.add_argument("--from-deepspeed", metavar="DIR", default=None,
                 help="convert a DeepSpeed ZeRO checkpoint instead (the directory given to its "
                 "save_checkpoint, or one tag's), without torch, to --safetensors")
  c.add_argument("--tag", "--step", default=None,
                 help="the checkpoint to convert: its tag or step (default: the latest)")
  c.add_argument("--safetensors", default=None, help="write the weights to this safetensors file")
  c.add_argument("--orbax", default=None,
                 help="write the weights as a params-only Orbax checkpoint in this directory")
  c.add_argument("--optax", metavar="DIR", default=None,
                 help="write the fp32 params and the optax state as a plain Flax + optax run's "
                 "Orbax CheckpointManager step in this directory (DIR/<step>/params, opt_state)")
  c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                 help="dtype of the written weights (default fp32)")
  c.set_defaults(func=convert)

  i = sub.add_parser("inspect", help="describe a checkpoint (jzero's or DeepSpeed's): step, "
                     "stage, mesh, precision, arrays")
  i.add_argument("checkpoint", help="checkpoint directory (or one checkpoint's directory)")
  i.add_argument("--tag", "--step", default=None,
                 help="the checkpoint to describe: its tag or step (default: the latest)")
  i.set_defaults(func=inspect)
