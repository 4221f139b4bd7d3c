"""Tables of bytes, as text (terminals, logs) and as HTML (notebooks): one home for both.

The reports (:class:`jzero.analysis.estimate.EstimateTable`,
:class:`jzero.analysis.memory_report.MemoryReport`, the AOT report) build one ``(header, rows)``
pair of strings and render it with :func:`text_table` (rich's ``Table``, without borders) or
:func:`html_table` (an HTML ``<table>``, which rich does not write), so a notebook shows the numbers
the CLI prints; :class:`Table` is such a pair that shows itself (a notebook's own tables).
:func:`require_pyplot` gives their ``.plot()`` methods matplotlib, or says how to install it.
"""

from __future__ import annotations

import dataclasses
import html
import io
from typing import Any, Sequence

import rich.console
import rich.table

__all__ = ["Table", "format_bytes", "format_count", "byte_cell", "text_table", "html_table",
           "markdown_table", "require_pyplot"]


def format_bytes(n: float) -> str:
  """Decimal units up to GB (GB = 1e9 bytes): '38.50 GB', '2,100.00 GB', '25.58 MB'."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:,.2f} {unit}"
  return f"{n:,.0f} B"


def format_count(n: float) -> str:
  """A count to three significant digits with a decimal unit: '950', '86.7K', '6.39M', '7B'."""
  rounded = float(f"{n:.3g}")
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(rounded) >= scale:
      return f"{rounded / scale:.3g}{unit}"
  return f"{rounded:.3g}"


def byte_cell(n: float) -> str:
  """:func:`format_bytes`, or '-' for nothing."""
  return format_bytes(n) if n else "-"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> str:
  """Plain-text table (rich's, no borders, no styles): first column left-aligned, the others
  right-aligned, two spaces between columns, never wrapped; each line after ``indent``."""
  table = rich.table.Table(box=None, show_edge=False, pad_edge=False, padding=(0, 1),
                           header_style=None, highlight=False)
  for i, name in enumerate(header):
    table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
  for row in rows:
    table.add_row(*row)
  out = io.StringIO()
  rich.console.Console(file=out, width=1_000_000, color_system=None, markup=False, emoji=False,
                       highlight=False).print(table)
  return "\n".join(indent + line.rstrip() for line in out.getvalue().rstrip("\n").split("\n"))


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]],
               caption: str | None = None, notes: Sequence[str] = ()) -> str:
  """The same table as HTML (cells escaped; numbers right-aligned), with an optional caption and
  lines of notes under it."""
  def cells(tag: str, row: Sequence[str]) -> str:
    return "".join(f'<{tag} style="text-align:{"left" if i == 0 else "right"}">'
                   f"{html.escape(c)}</{tag}>" for i, c in enumerate(row))
  parts = ["<table>"]
  if caption:
    parts.append(f'<caption style="text-align:left">{html.escape(caption)}</caption>')
  parts.append(f"<thead><tr>{cells('th', header)}</tr></thead><tbody>")
  parts.extend(f"<tr>{cells('td', row)}</tr>" for row in rows)
  parts.append("</tbody></table>")
  parts.extend(f"<div>{html.escape(note)}</div>" for note in notes)
  return "".join(parts)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  """The lines of a Markdown (GitHub) table: what the benchmark scripts write into the docs, each
  cell as ``str`` gives it (a ``|`` in a cell is escaped)."""
  def line(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
  return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


@dataclasses.dataclass(frozen=True)
class Table:
  """Rows of strings that show themselves: HTML in a notebook, text in a terminal or a log."""

  header: Sequence[str]
  rows: Sequence[Sequence[str]]
  caption: str = ""

  def _repr_html_(self) -> str:
    return html_table(self.header, self.rows, caption=self.caption or None)

  def __str__(self) -> str:
    table = text_table(self.header, self.rows)
    return f"{self.caption}\n{table}" if self.caption else table

  __repr__ = __str__


def require_pyplot() -> Any:
  """``matplotlib.pyplot``, or an ImportError saying how to install it (it is not a dependency of
  training; the ``test`` and ``bench`` extras have it)."""
  try:
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("plotting needs matplotlib: pip install matplotlib (or the project's "
                      "'bench' extra)") from e
  return plt
