"""The README is the front page, not the manual: at most 250 lines -- what jzero is, the two
commands, short Python use, a config on one screen and links into docs/ -- and everything it
shows is checked against where it lives: its links resolve to pages and sections, its Python block
is the first block of docs/getting-started.md (run there by test_snippets.py), its config is
configs/zero3.json."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_snippets import parse  # noqa: E402  (the snippet test's parser: one reading of Markdown)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250


def _slug(heading: str) -> str:
  """GitHub's (and MyST's) anchor of a heading: lower case, punctuation dropped, spaces to -."""
  return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_readme_is_at_most_250_lines():
  lines = README.read_text(encoding="utf-8").count("\n")  # what `wc -l` counts
  assert lines <= MAX_LINES, f"README.md has {lines} lines; move sections to docs/ (<= {MAX_LINES})"


def test_readme_starts_with_the_two_commands():
  """The first block is the one .ci/run executes: exactly the two commands, install + train and
  install + test."""
  first = parse(README)[0][0]
  assert first.language == "bash"
  assert first.source.strip().splitlines() == [
      "pip install -e . && jzero train --config configs/zero3.json",
      'pip install -e ".[test]" && python -m pytest -q tests']


def test_readme_links_resolve_to_files_and_sections():
  text = README.read_text(encoding="utf-8")
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  assert sum(link.startswith("docs/") for link in links) >= 10, "the 'where next' list"
  for link in links:
    if "://" in link:
      continue
    path, _, anchor = link.partition("#")
    target = ROOT / path
    assert target.exists(), f"README links {link}: no {path}"
    if anchor:
      headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
      assert anchor in {_slug(h) for h in headings}, f"README links {link}: no such section"


def test_readme_python_is_the_getting_started_block_that_runs():
  """The README's Python block is skipped there because it is the first block of
  docs/getting-started.md, which the snippet test runs; the two must not drift apart."""
  (block,) = [b for b in parse(README)[0] if b.language == "python"]
  page = ROOT / "docs" / "getting-started.md"
  assert block.skip and "docs/getting-started.md" in block.skip
  first = next(b for b in parse(page)[0] if b.language == "python")
  assert first.skip is None and first.source == block.source


def test_readme_config_is_configs_zero3():
  text = README.read_text(encoding="utf-8").split("\n## Configs\n", 1)[1]
  (shown,) = [b for b in parse(README)[0] if b.language == "json"]
  assert shown.source in text
  assert json.loads(shown.source) == json.loads((ROOT / "configs" / "zero3.json").read_text())
