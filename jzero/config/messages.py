"""How the config package speaks: values shown as the user wrote them, warnings, reports with one
line per problem, "did you mean"."""

from __future__ import annotations

import difflib
import json
import warnings
from typing import Any

from jzero.errors import JZeroWarning

__all__ = ["show", "warn", "suggest", "report"]


def show(value: Any) -> str:
  """A value as the user wrote it in JSON."""
  try:
    return json.dumps(value)
  except (TypeError, ValueError):
    return repr(value)


def warn(message: str) -> None:
  warnings.warn(message, JZeroWarning, stacklevel=2)


def suggest(key: Any, known: Any) -> str:
  match = difflib.get_close_matches(str(key), list(known), n=1)
  return f"; did you mean '{match[0]}'?" if match else ""


def report(source: str | None, title: str, lines: list[str]) -> str:
  head = f"{source}: {title}" if source else title
  return f"{head}:\n" + "\n".join(f"  {line}" for line in lines)
