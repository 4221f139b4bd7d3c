"""The suite's two tiers (tests/README.md): the fast tier (``-m "not slow"``) holds a test of every
subpackage of jzero -- a test file in a folder of tests/ (the root's files name the packages
for other reasons), outside suite_tiers.SLOW, that imports it."""

from __future__ import annotations

import re
from pathlib import Path

from suite_tiers import SLOW

TESTS = Path(__file__).parent
PACKAGE = TESTS.parent / "jzero"


def test_the_fast_tier_tests_every_subpackage():
  subpackages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
  fast = [p for p in TESTS.glob("*/test_*.py") if p.relative_to(TESTS).as_posix() not in SLOW]
  imports = {name: [p.relative_to(TESTS).as_posix() for p in fast
                    if re.search(rf"\bjzero\.{name}\b", p.read_text())]
             for name in subpackages}
  missing = [name for name, files in imports.items() if not files]
  assert len(subpackages) >= 10 and not missing, missing


def test_slow_names_only_files_that_exist():
  assert all((TESTS / name).is_file() for name in SLOW), sorted(
      name for name in SLOW if not (TESTS / name).is_file())
