"""The package's shape: no import cycle, no private name across packages, ``__all__`` everywhere.

The import graph is read from the source (ast): every ``import`` of a jzero module, at the top of a
module or inside a function (an import deferred for start-up time is fine; one deferred to dodge a
cycle is a cycle), except those under ``if TYPE_CHECKING:`` (annotations only). Importing
``jzero.P.m`` from outside ``P`` also runs ``P/__init__.py``: an edge to it too. The root package's
``__init__`` (the public API, which imports the engine) is the one node left out: every import of a
jzero module runs it first, as Python does for any package.

Run as a script to print the graph's problems: ``python tests/test_layout.py``.
"""

from __future__ import annotations

import ast
import os
import pathlib
import random
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jzero"


def modules() -> dict[str, pathlib.Path]:
  """Dotted name -> file of every module in the jzero package."""
  found = {}
  for path in sorted(ROOT.rglob("*.py")):
    parts = ("jzero",) + path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found[name] = path
  return found


def top_package(name: str) -> str:
  """The concern a module belongs to: ``jzero.tiers.nvme_store`` -> ``jzero.tiers``; the root's own
  modules (``jzero.errors``) -> ``jzero``."""
  parts = name.split(".")
  if len(parts) >= 2 and (ROOT / parts[1]).is_dir():
    return ".".join(parts[:2])
  return "jzero"


class _Imports(ast.NodeVisitor):
  """The jzero imports of one module: (target module, names imported, line)."""

  def __init__(self, name: str, is_package: bool, known: dict):
    self.name, self.known, self.found = name, known, []
    self.package = name if is_package else name.rpartition(".")[0]
    self.bound: dict[str, str] = {}  # local name -> the jzero module it is bound to

  def visit_If(self, node: ast.If) -> None:
    test = node.test
    if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
      for child in node.orelse:
        self.visit(child)
      return
    self.generic_visit(node)

  def visit_Import(self, node: ast.Import) -> None:
    for alias in node.names:
      if alias.name == "jzero" or alias.name.startswith("jzero."):
        self.found.append((alias.name, (), node.lineno))
        if alias.asname:
          self.bound[alias.asname] = alias.name

  def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
    base = node.module or ""
    if node.level:
      parts = self.package.split(".")
      parts = parts[:len(parts) - (node.level - 1)]
      base = ".".join(parts + ([node.module] if node.module else []))
    if not (base == "jzero" or base.startswith("jzero.")):
      return
    for alias in node.names:
      full = f"{base}.{alias.name}"
      if full in self.known:  # a submodule
        self.found.append((full, (), node.lineno))
        self.bound[alias.asname or alias.name] = full
      else:
        self.found.append((base, (alias.name,), node.lineno))


def scan() -> tuple[dict[str, set[str]], list[str]]:
  """(import graph, problems other than cycles)."""
  known = modules()
  graph: dict[str, set[str]] = {name: set() for name in known}
  problems = []
  for name, path in known.items():
    tree = ast.parse(path.read_text(), str(path))
    visitor = _Imports(name, path.name == "__init__.py", known)
    visitor.visit(tree)
    mine = top_package(name)
    for target, names, line in visitor.found:
      where = f"{path.relative_to(ROOT.parent)}:{line}"
      if target not in known:
        problems.append(f"{where}: imports {target}, which is not a jzero module")
        continue
      if target != "jzero" and target != name:
        graph[name].add(target)
      theirs = top_package(target)
      if theirs != mine and theirs != "jzero" and not target.startswith(name + "."):
        graph[name].add(theirs)  # importing P.m runs P/__init__.py
      for imported in names:
        if imported.startswith("_") and not imported.startswith("__") and theirs != mine:
          problems.append(f"{where}: {name} imports the private {target}.{imported} "
                          f"(another package's)")
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.attr.startswith("_") and not node.attr.startswith("__")):
        owner = visitor.bound.get(node.value.id)
        if owner is not None and top_package(owner) != mine:
          problems.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name} reads the "
                          f"private {owner}.{node.attr} (another package's)")
        elif node.value.id == "engine" and mine != "jzero.train":
          problems.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name} reads the "
                          f"engine's private engine.{node.attr}: use its public interface")
    declared = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)}
    if path.name != "__main__.py" and "__all__" not in declared:
      problems.append(f"{path.relative_to(ROOT.parent)}: {name} has no __all__")
  return graph, problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  sys.setrecursionlimit(10_000)
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


#: The subpackages in the direction of their imports (docs/architecture.md): each imports only
#: packages before it.
PACKAGE_ORDER = ("config", "sharding", "comm", "tiers", "modeling", "analysis", "checkpoint",
                 "runtime", "train", "models", "planning", "cli")


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """The module graph collapsed to subpackages (``jzero.comm``, ...), every import counted; the
  root's own modules (``jzero.errors``, the public ``__init__``) left out."""
  out: dict[str, set[str]] = {}
  for name, targets in graph.items():
    mine = top_package(name)
    if mine == "jzero":
      continue
    out.setdefault(mine, set()).update(
        theirs for t in targets if (theirs := top_package(t)) not in ("jzero", mine))
  return out


def test_no_import_cycle():
  graph, _ = scan()
  assert cycles(graph) == []


def test_packages_form_a_dag_in_the_documented_order():
  """No cycle between subpackages either (lazy imports included), and every import points down
  :data:`PACKAGE_ORDER`."""
  packages = package_graph(scan()[0])
  assert sorted(packages) == sorted(f"jzero.{p}" for p in PACKAGE_ORDER)
  assert cycles(packages) == []
  rank = {f"jzero.{p}": i for i, p in enumerate(PACKAGE_ORDER)}
  upward = sorted(f"{a} -> {b}" for a, targets in packages.items() for b in targets
                  if rank[b] >= rank[a])
  assert upward == []


def test_no_private_name_across_packages_and_all_everywhere():
  _, problems = scan()
  assert problems == []


def test_the_step_the_engine_and_checkpoints_name_no_tier():
  """The step's update phase is the tiers' hooks composed: the training and checkpoint modules
  import the tier interface and the registry, no tier (the delayed update, a change of when the
  update applies, is not one)."""
  graph, _ = scan()
  allowed = {"jzero.tiers", "jzero.tiers.base", "jzero.tiers.registry", "jzero.tiers.delayed"}
  checkpoint = [n for n in graph if n.startswith("jzero.checkpoint")]
  assert len(checkpoint) >= 5
  for name in ("jzero.train.step", "jzero.train.programs", "jzero.train.engine", "jzero.train.state",
               *checkpoint):
    tiers = {t for t in graph[name] if t.startswith("jzero.tiers")}
    assert tiers <= allowed, (name, tiers - allowed)


def test_the_checks_catch_what_they_look_for(tmp_path):
  """The scanner on a graph with a cycle and on the edge cases of its rules."""
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []
  modules_graph = {"jzero.comm.x": {"jzero.tiers.y"}, "jzero.tiers.y": {"jzero.comm.z"},
                   "jzero.comm.z": set(), "jzero.errors": {"jzero.comm.x"}}
  assert cycles(package_graph(modules_graph)) == [["jzero.comm", "jzero.tiers"]]
  assert top_package("jzero.tiers.nvme_store") == "jzero.tiers"
  assert top_package("jzero.errors") == "jzero"
  tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from jzero.a import B\n"
                   "from jzero.c import _d\ndef f():\n  from jzero import e\n")
  visitor = _Imports("jzero.x.y", False, {"jzero.e": None})
  visitor.visit(tree)
  assert [(t, n) for t, n, _ in visitor.found] == [("jzero.c", ("_d",)), ("jzero.e", ())]


@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled"])
def test_every_module_imports_in_any_order(order):
  """Each module imported by a fresh interpreter, one after another, in three orders."""
  names = [n for n in modules() if not n.endswith("__main__")]
  if order == "reversed":
    names.reverse()
  elif order == "shuffled":
    random.Random(0).shuffle(names)
  code = "import importlib, sys\nfor n in sys.argv[1:]:\n  importlib.import_module(n)\n"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:jzero", "-c", code,
                        *names], capture_output=True, text=True, env=env, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]


if __name__ == "__main__":
  found_graph, found_problems = scan()
  for component in cycles(found_graph):
    print("cycle:", " <-> ".join(component))
  print("\n".join(found_problems))
