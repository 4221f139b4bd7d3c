"""``jzero launch``: a script as several processes (:mod:`jzero.runtime.launch`)."""

from __future__ import annotations

import argparse

from jzero.runtime import launch

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
  l = sub.add_parser("launch", help="start a script as several processes, here or on the hosts "
                     "of a hostfile (DeepSpeed's launcher)",
                     description=launch.__doc__.split("\n\n")[0] + " See `python -c 'import "
                     "jzero.runtime.launch; help(jzero.runtime.launch)'` for the details.")
  launch.add_launch_arguments(l)
  l.set_defaults(func=launch.run_launch)
