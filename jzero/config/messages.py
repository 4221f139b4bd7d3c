"""How the config package speaks: values shown as the user wrote them, warnings, reports with one
line per problem, "did you mean".

A warning points at the user's line (the ``jzero.initialize(...)`` or ``Config.load(...)`` call),
not at jzero's: :func:`warn` counts its ``stacklevel`` past every frame of jzero and of pydantic
(whose validators call the config's), so the count follows the call depth. This is what Python
3.12's ``warnings.warn(skip_file_prefixes=...)`` does; jzero supports 3.11.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import warnings
from typing import Any

import pydantic
import pydantic_core

from jzero.errors import JZeroWarning

__all__ = ["show", "warn", "user_stacklevel", "suggest", "report"]


def show(value: Any) -> str:
  """A value as the user wrote it in JSON."""
  try:
    return json.dumps(value)
  except (TypeError, ValueError):
    return repr(value)


# Frames in these folders are jzero's own (and the validators' callers), never the user's.
_INTERNAL = tuple(os.path.dirname(path) + os.sep for path in (
    os.path.dirname(__file__), pydantic.__file__, pydantic_core.__file__))


def user_stacklevel() -> int:
  """The ``stacklevel`` that makes a ``warnings.warn`` called by the caller of this function point
  at the innermost frame outside jzero (and pydantic): the user's call."""
  frame, level = sys._getframe(2), 2  # the frame that calls warnings.warn is stacklevel 1
  while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
    frame, level = frame.f_back, level + 1
  return level


def warn(message: str) -> None:
  """A JZeroWarning pointing at the user's call (module docstring)."""
  warnings.warn(message, JZeroWarning, stacklevel=user_stacklevel())


def suggest(key: Any, known: Any, cutoff: float = 0.6) -> str:
  """"; did you mean 'K'?" for the known key K closest to ``key`` (difflib's ratio >= cutoff), or
  ""."""
  match = difflib.get_close_matches(str(key), list(known), n=1, cutoff=cutoff)
  return f"; did you mean '{match[0]}'?" if match else ""


def report(source: str | None, title: str, lines: list[str]) -> str:
  head = f"{source}: {title}" if source else title
  return f"{head}:\n" + "\n".join(f"  {line}" for line in lines)
