"""Where jzero's log goes: the library logs to the ``jzero`` logger and prints nothing itself (it
has a ``NullHandler``, Python's convention for a library); the application's entry points --
:func:`jzero.initialize` and the ``jzero`` command -- show it (:func:`show_log`) as DeepSpeed's
logger does: ``[jzero] message`` lines on stdout, from INFO up (the step reports every
``steps_per_print``, what a plan makes of the config). An application that gives the ``jzero``
logger a handler of its own keeps it as it is.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOGGER", "show_log"]

#: jzero's logger name (every module logs to it, or to a child of it).
LOGGER = "jzero"


def show_log() -> None:
  """jzero's log on stdout, ``[jzero] message`` from INFO up, unless the ``jzero`` logger has a
  handler besides the library's ``NullHandler`` already (the application configured it, or an
  earlier call did)."""
  logger = logging.getLogger(LOGGER)
  if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
    return
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(logging.Formatter("[jzero] %(message)s"))
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False
