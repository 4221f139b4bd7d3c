"""The jzero command line: one module per subcommand (``train``, ``launch``, ``estimate``, ``aot``,
``convert`` / ``inspect`` in :mod:`jzero.cli.checkpoint`); :func:`main` dispatches.

``jzero train --config configs/zero3.json`` trains the embedded GPT on the embedded corpus (the
Python standard library's source, as bytes) on 8 simulated CPU devices, with a progress bar, the
loss every ``steps_per_print`` steps, and a summary at the end.

``jzero train --model path/to/file.py:factory [--loss ...] [--data samples.npz]`` trains the
user's own model (:mod:`jzero.cli.train`). ``--checkpoint-dir DIR`` saves sharded checkpoints
there and resumes from the latest one.
``jzero launch --num_processes 2 --num_cpu_devices 4 --module jzero train ...`` runs a script (or
``jzero train``) as several processes, here or over ssh on a hostfile's hosts
(:mod:`jzero.runtime.launch`); ``jzero train`` joins them, or a SLURM / Open MPI / Kubernetes job,
by itself (:mod:`jzero.runtime.distributed`), and stops at a step all processes agree on when one
gets SIGTERM, saving a checkpoint.
``jzero estimate --params 7e9 --devices 8`` prints ZeRO's per-device memory table.
``jzero plan --params 7e9 --gpu h100 --devices 8`` searches the ZeRO configs for that target and
writes the best as a DeepSpeed config (:mod:`jzero.planning.search`).
``jzero aot --config ... --gpu h100 --devices 8`` compiles the step for a GPU topology that is not
present (:mod:`jzero.planning.aot`).
``jzero convert CKPT --safetensors model.safetensors`` consolidates a sharded training checkpoint
into plain weights (DeepSpeed's ``zero_to_fp32``); ``jzero inspect CKPT`` describes one.
``jzero convert --from-deepspeed DIR --safetensors FILE`` is ``zero_to_fp32`` of a DeepSpeed
checkpoint without torch; ``jzero inspect DIR`` describes a DeepSpeed checkpoint too.
``jzero nvme-stores NVME_PATH [--reclaim]`` lists the NVMe tier's stores there and removes those
of processes that are gone (:mod:`jzero.cli.nvme`).

Bad input (config, mesh, data, checkpoint) is reported as one paragraph on stderr with exit status
2, before any device work. A warning is printed as ``jzero: warning: MESSAGE``, or at the user's
line when it points into a file of theirs (the ``--model`` module): jzero's warnings name the
first frame outside jzero, which in the command is the ``jzero`` script's own ``sys.exit(main())``
(or ``runpy``'s, under ``python -m``) -- no line of the user's.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import warnings
from typing import Sequence

from jzero.cli import aot, checkpoint, estimate, launch, nvme, plan, train
from jzero.errors import JZeroError, JZeroWarning
from jzero.runtime import logs

__all__ = ["build_parser", "main", "format_warning"]

#: The subcommands, in ``jzero --help``'s order: each module's ``add_parser(subparsers)``.
COMMANDS = (train, launch, estimate, aot, plan, checkpoint, nvme)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jzero", description="jzero: DeepSpeed's ZeRO rebuilt for JAX. Train with a DeepSpeed "
      "config, estimate memory, convert and inspect checkpoints.",
      epilog="Run 'jzero COMMAND --help' for a command's options.")
  sub = parser.add_subparsers(dest="command", required=True)
  for command in COMMANDS:
    command.add_parser(sub)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  logs.show_log()  # the library logs to a NullHandler; the command prints its log
  shown, warnings.formatwarning = warnings.formatwarning, format_warning
  try:
    return args.func(args)
  except JZeroError as e:
    print(f"jzero: error: {e}", file=sys.stderr)
    return 2
  finally:
    warnings.formatwarning = shown


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # jzero/
# Python's own library, installed packages and console scripts: none of them the user's files
_NOT_USERS = tuple(os.path.abspath(sysconfig.get_path(name)) + os.sep
                   for name in ("stdlib", "platstdlib", "purelib", "platlib", "scripts"))
_PYTHON_FORMAT = warnings.formatwarning


def _users_file(filename: str) -> bool:
  path = os.path.abspath(filename)
  return (os.path.isfile(path) and not path.startswith((_PACKAGE, *_NOT_USERS))
          and path != os.path.abspath(sys.argv[0]))


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
  """How the command prints a warning (module docstring): Python's format, source line
  included, where ``filename`` is the user's; else ``jzero: warning: MESSAGE`` (a category
  other than JZeroWarning named before the message)."""
  if _users_file(filename):
    return _PYTHON_FORMAT(message, category, filename, lineno, line)
  kind = "" if issubclass(category, JZeroWarning) else f"{category.__name__}: "
  return f"jzero: warning: {kind}{message}\n"
