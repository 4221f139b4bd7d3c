"""Checks that every internal link of a built HTML site resolves:
``python docs/check_links.py docs/_build/html``.

Sphinx's ``nitpicky`` checks the references it makes (roles, MyST links to documents and
headings); this checks what ends up in the HTML, links the theme and the notebooks' outputs add
included: every relative ``href`` and ``src`` must name a file of the site, and a ``#fragment`` an
``id`` (or ``<a name>``) in that file. Links with a scheme (``https:``, ``mailto:``) or starting
with ``//`` leave the site and are not checked (the build has no network). The pages are the
site's ``.html`` files outside ``_static/`` (where themes keep template fragments as assets).
Exits 1 naming each broken link as ``page: link``.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["broken_links"]


class _Page(HTMLParser):
  """The relative links and the anchors of one HTML page."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.links: list[str] = []
    self.anchors: set[str] = set()

  def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
    values = dict(attrs)
    for name in ("id",) + (("name",) if tag == "a" else ()):
      if values.get(name):
        self.anchors.add(values[name])
    for name in ("href", "src"):
      link = values.get(name)
      if link and not urlsplit(link).scheme and not link.startswith("//"):
        self.links.append(link)


def _parse(path: Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8", errors="replace"))
  return page


def _pages(site: Path) -> list[Path]:
  return sorted(path for path in site.rglob("*.html")
                if "_static" not in path.relative_to(site).parts)


def broken_links(site: Path) -> list[str]:
  """``"page: link"`` for every relative link of the HTML pages under ``site`` that names no file
  of the site, or an anchor its target does not have."""
  site = site.resolve()
  pages = {path: _parse(path) for path in _pages(site)}
  broken = []
  for path, page in pages.items():
    for link in page.links:
      parts = urlsplit(link)
      target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
      if target.is_dir():
        target = target / "index.html"
      if not target.is_file() or site not in target.parents:
        broken.append(f"{path.relative_to(site)}: {link}")
      elif parts.fragment and target.suffix == ".html":
        anchors = (pages.get(target) or _parse(target)).anchors
        if unquote(parts.fragment) not in anchors:
          broken.append(f"{path.relative_to(site)}: {link}")
  return broken


def main(argv: list[str]) -> int:
  if len(argv) != 1 or not Path(argv[0]).is_dir():
    print("usage: python docs/check_links.py BUILT_HTML_DIR", file=sys.stderr)
    return 2
  broken = broken_links(Path(argv[0]))
  pages = len(_pages(Path(argv[0]).resolve()))
  for line in broken:
    print(f"broken link: {line}")
  print(f"{pages} pages, {len(broken)} broken internal links")
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
