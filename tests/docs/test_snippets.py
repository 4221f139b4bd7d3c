"""Every Python and shell block of the documentation runs in the suite, so a snippet that breaks
fails CI.

The documents are ``DOCUMENTS``: README.md, notebooks/README.md and every Markdown page under
docs/. Nothing here knows one document from another: a page moved from the README into docs/ keeps
its blocks, markers and tests.

**Why a collector of our own** rather than pytest-markdown-docs or Sybil: the suite runs
``pytest tests``, and README.md lies outside tests/, so a plugin that collects ``.md`` files the way
pytest collects test files would never see it -- a test module that reads the documents does;
neither plugin runs shell blocks; a skipped block must say why in the Markdown, which
pytest-markdown-docs' fence options cannot carry; and the whole collector is the 150 lines below,
with no new dependency.

**Markers** are HTML comments right before a block (only blank lines between), invisible on GitHub
and in the built site::

  <!-- snippet: skip REASON -->
      the next block is not run: its test is reported skipped with REASON (needs GPUs, a cluster,
      minutes...). A skip without a reason is an error.

  <!-- snippet: setup
  PYTHON CODE
  -->
      runs in the document's namespace right before the next block: what the prose leaves out
      (a batch function, a loss), never shown to the reader.

**How blocks run.**

* ``python`` blocks: in this process (8 simulated CPU devices, as the whole suite), in the order
  they appear, in one namespace per document -- a page is one session, as a reader runs it top to
  bottom. Each block is its own test; running one runs the blocks before it first. A traceback
  names the Markdown file and line.
* ``bash`` / ``sh`` / ``shell`` blocks: each in a ``bash -euo pipefail`` subprocess, with this
  Python's ``bin`` folder first on ``PATH`` (its ``jzero`` and ``python``).
* Both run in a scratch folder per document that links the repository's top-level entries, so
  that relative paths (``configs/zero3.json``) resolve and what a snippet writes (``ckpt/``) stays
  out of the checkout.
* Other blocks (json, yaml, console transcripts, MyST directives) are not run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "notebooks" / "README.md",
                    *(path for path in (ROOT / "docs").rglob("*.md")
                      if not {"_build", "api"} & set(path.relative_to(ROOT / "docs").parts))])
PYTHON, SHELL = {"python", "py", "python3"}, {"bash", "sh", "shell"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>\S+)\s*(?P<rest>.*?)\s*(?P<end>-->)?\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced block: its document, the line of its first content line (1-based), language,
  source, and what a marker asked (``skip``: the reason; ``setup``: hidden code and its line)."""

  document: Path
  line: int
  language: str
  source: str
  skip: str | None = None
  setup: tuple[int, str] | None = None

  @property
  def name(self) -> str:
    return f"{self.document.relative_to(ROOT)}:{self.line}"

  @property
  def runs(self) -> bool:
    return self.language in PYTHON | SHELL


def _language(info: str) -> str:
  words = info.split()
  if words and words[0] in ("{code-block}", "{code}", "{sourcecode}"):
    words = words[1:]
  return words[0].lower() if words else ""


def parse(document: Path) -> tuple[list[Block], list[str]]:
  """The fenced blocks of ``document`` with their markers, and the problems of its markers."""
  lines = document.read_text(encoding="utf-8").splitlines()
  blocks, problems, marker, i = [], [], None, 0
  where = lambda n: f"{document.relative_to(ROOT)}:{n}"
  while i < len(lines):
    line, found = lines[i], _MARKER.match(lines[i])
    if found:
      if marker is not None:
        problems.append(f"{where(marker[2])}: a marker not followed by a block")
      kind, start, body = found["kind"], i + 1, [found["rest"]]
      while not found["end"] and i + 1 < len(lines):  # up to the line that ends with -->
        i += 1
        body.append(lines[i])
        if lines[i].rstrip().endswith("-->"):
          body[-1] = lines[i].rstrip()[:-3]
          break
      if kind == "skip":
        value = " ".join(" ".join(body).split())
        if not value:
          problems.append(f"{where(start)}: 'snippet: skip' needs a reason")
      elif kind == "setup":
        value = (start + 1, textwrap.dedent("\n".join(body[1:])))
        if body[0] or not value[1].strip():
          problems.append(f"{where(start)}: 'snippet: setup' holds its code on the lines after it")
      else:
        value = None
        problems.append(f"{where(start)}: unknown marker 'snippet: {kind}' (skip or setup)")
      marker = (kind, value, start)
    elif (fence := _FENCE.match(line)) is not None:
      indent, opening = len(fence["indent"]), fence["fence"]
      end = i + 1
      while end < len(lines) and not (lines[end].strip().startswith(opening)
                                      and not lines[end].strip().strip(opening[0])):
        end += 1
      source = "\n".join(text[indent:] if len(text) - len(text.lstrip()) >= indent
                         else text.lstrip() for text in lines[i + 1:end])
      block = Block(document, i + 2, _language(fence["info"]), source)
      if marker is not None:
        kind, value, start = marker
        if kind in ("skip", "setup"):
          block = dataclasses.replace(block, **{kind: value})
        if not block.runs:
          problems.append(f"{where(start)}: a marker on a {block.language or 'plain'} block, "
                          f"which is not run anyway")
        marker = None
      blocks.append(block)
      i = end
    elif line.strip() and marker is not None:
      problems.append(f"{where(marker[2])}: a marker not followed by a block")
      marker = None
    i += 1
  if marker is not None:
    problems.append(f"{where(marker[2])}: a marker not followed by a block")
  return blocks, problems


BLOCKS = [block for document in DOCUMENTS for block in parse(document)[0] if block.runs]


def test_markers_are_well_formed():
  problems = [problem for document in DOCUMENTS for problem in parse(document)[1]]
  assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
  """A scratch folder per document, linking the repository's top-level entries."""
  folders = {}

  def folder(document: Path) -> Path:
    if document not in folders:
      path = tmp_path_factory.mktemp(document.stem.lower())
      for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name != "build":
          (path / entry.name).symlink_to(entry)
      folders[document] = path
    return folders[document]
  return folder


@dataclasses.dataclass
class _Session:
  """A document's Python namespace and how far it has run."""

  namespace: dict = dataclasses.field(default_factory=lambda: {"__name__": "__main__"})
  done: int = 0  # blocks of the document run so far (in DOCUMENT order)
  failed: str | None = None


@pytest.fixture(scope="module")
def sessions():
  found: dict[Path, _Session] = {}
  yield found
  found.clear()  # the documents' engines and states go with their namespaces


def _exec(document: Path, line: int, source: str, namespace: dict) -> None:
  # padded so that a traceback's line numbers are the Markdown file's
  exec(compile("\n" * (line - 1) + source, str(document), "exec"), namespace)  # noqa: S102


def _run_python(block: Block, session: _Session) -> None:
  if block.setup is not None:
    _exec(block.document, *block.setup, session.namespace)
  _exec(block.document, block.line, block.source, session.namespace)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language in PYTHON],
                         ids=lambda block: block.name)
def test_python_block(block, scratch, sessions, monkeypatch):
  monkeypatch.chdir(scratch(block.document))
  session = sessions.setdefault(block.document, _Session())
  sequence = [b for b in BLOCKS if b.document == block.document and b.language in PYTHON]
  for earlier in sequence[session.done:sequence.index(block) + 1]:
    if session.failed:
      pytest.fail(f"an earlier block of the document failed: {session.failed}")
    session.done += 1
    if earlier.skip:
      continue
    try:
      _run_python(earlier, session)
    except BaseException:
      session.failed = earlier.name
      raise
  if block.skip:
    pytest.skip(f"{block.name}: {block.skip}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language in SHELL],
                         ids=lambda block: block.name)
def test_shell_block(block, scratch):
  if block.skip:
    pytest.skip(f"{block.name}: {block.skip}")
  env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
  done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.source],
                        cwd=scratch(block.document), env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, (f"{block.name} exited {done.returncode}:\n{block.source}\n"
                                f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n"
                                f"{done.stderr[-3000:]}")
