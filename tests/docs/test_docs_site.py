"""The documentation site's checks that need no Sphinx: the HTML link checker CI runs on the built
site (docs/check_links.py), and the index's promise to a newcomer -- each of three questions
answered by a page one click from the index. The build itself (``python -m sphinx -W``, nitpicky)
runs in .ci/run, with the docs extra."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _check_links():
  spec = importlib.util.spec_from_file_location("check_links", DOCS / "check_links.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_link_checker_finds_missing_pages_and_anchors(tmp_path):
  (tmp_path / "_static").mkdir()
  (tmp_path / "guide").mkdir()
  (tmp_path / "_static" / "theme.css").write_text("")
  # a theme's template fragment kept as an asset: not a page
  (tmp_path / "_static" / "macros.html").write_text('<link href="{{ pathto(x) }}">')
  (tmp_path / "index.html").write_text(
      '<a href="guide/a.html#usage">ok</a> <a href="guide/a.html#gone">no anchor</a> '
      '<a href="missing.html">no page</a> <a href="https://example.org/x">external</a> '
      '<link href="_static/theme.css"> <img src="_static/logo.png"> <a href="#top">self</a> '
      '<a href="../outside.html">outside the site</a> <a href="mailto:a@b.c">mail</a>')
  (tmp_path / "guide" / "a.html").write_text(
      '<h1 id="usage">Usage</h1><a href="../index.html#top">up</a> <a name="old-anchor"></a>'
      '<a href="a.html#old-anchor">named</a> <a href="./">folder</a>')
  (tmp_path / "guide" / "index.html").write_text("")
  (tmp_path.parent / "outside.html").write_text("")
  assert _check_links().broken_links(tmp_path) == [
      "guide/a.html: ../index.html#top", "index.html: guide/a.html#gone",
      "index.html: missing.html", "index.html: _static/logo.png", "index.html: #top",
      "index.html: ../outside.html"]


def _links(markdown: str) -> list[tuple[str, str]]:
  return re.findall(r"\[([^\]]+)\]\(([^)\s]+)\)", markdown)


def _slug(heading: str) -> str:
  """MyST's anchor of a heading (GitHub's rule: lower case, punctuation dropped, spaces to -)."""
  return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_the_index_answers_a_newcomers_questions_one_click_away():
  """Each question links, from the index, to a section of a page that answers it: the section
  exists under that anchor and names the calls or commands of the answer."""
  index = (DOCS / "index.md").read_text()
  answers = {"resume my DeepSpeed run": ["read_deepspeed", "import_deepspeed"],
             "continue my Flax or optax run": ["load_weights", "params="],
             "Will 13B fit on 8 A100-40GB": ["jzero estimate", "jzero plan", "offload_optimizer"]}
  rows = [line for line in index.splitlines() if line.startswith("|")]
  for question, terms in answers.items():
    (row,) = [line for line in rows if question.lower() in line.lower()]
    ((_, target),) = _links(row)
    page, _, anchor = target.partition("#")
    text = (DOCS / page).read_text()
    sections = {_slug(m[1]): m.end() for m in re.finditer(r"^#+ (.+)$", text, re.M)}
    assert anchor in sections, (question, target, sorted(sections))
    section = text[sections[anchor]:].split("\n#", 1)[0]
    assert all(term in section for term in terms), (question, terms)
