"""``jzero estimate``: ZeRO's per-device memory table (:mod:`jzero.analysis.estimate`)."""

from __future__ import annotations

import argparse

from jzero.analysis import estimate

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
  e = sub.add_parser("estimate", help="per-device memory of the ZeRO stages (analytic, no "
                     "device work)")
  estimate.add_estimate_arguments(e)
  e.set_defaults(func=estimate.run_estimate)
