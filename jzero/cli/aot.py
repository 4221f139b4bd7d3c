"""``jzero aot``: the step compiled for a GPU topology that is not present
(:mod:`jzero.analysis.aot`)."""

from __future__ import annotations

import argparse

from jzero.analysis import aot

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
  a = sub.add_parser("aot", help="compile the train step for a GPU topology without a GPU: "
                     "memory, fit and collective overlap from XLA's GPU compiler (gpu-aot extra)")
  aot.add_aot_arguments(a)
  a.set_defaults(func=aot.run_aot)
