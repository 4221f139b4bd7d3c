"""Sphinx configuration of jzero's documentation site.

Build: ``pip install -e ".[docs]" && python -m sphinx -W -b html docs docs/_build/html`` (warnings
are errors; ``nitpicky``: every cross-reference must resolve). Pages are MyST Markdown; the API
reference is generated from the docstrings (autodoc + autosummary, Google style through
napoleon); the notebooks of ``notebooks/`` are rendered by myst-nb with the outputs they were
committed with, never executed here (the test suite executes them).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's jzero, also without `pip install -e .`
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jzero"
author = "the jzero authors"
copyright = "the jzero authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_nb",  # MyST Markdown pages and .ipynb notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings' Google style: Args / Returns / Raises / Attributes
]

# -- the pages -------------------------------------------------------------------------------------
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
templates_path = ["_templates"]
myst_enable_extensions = ["colon_fence", "deflist"]
# anchors for headings down to ####, so that pages can link each other's sections
myst_heading_anchors = 4
nitpicky = True  # a reference that does not resolve is a warning, and -W makes it an error

# -- notebooks: rendered with their stored outputs ------------------------------------------------
nb_execution_mode = "off"
# The notebooks live in notebooks/ (beside their build scripts), outside this source folder:
# copied into docs/notebooks/ (git-ignored) when the build starts, rewritten only when changed so
# that incremental builds stay incremental.
NOTEBOOKS = DOCS / "notebooks"
for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
  copy = NOTEBOOKS / notebook.name
  if not copy.exists() or copy.read_bytes() != notebook.read_bytes():
    shutil.copyfile(notebook, copy)

# -- the API reference ----------------------------------------------------------------------------
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False  # "Returns:" reads as prose (shapes and shardings), not a type field
# A signature's annotations are cross-references too (nitpicky checks them). Python's builtins and
# typing's names resolve by themselves (Sphinx's builtin resolver); jzero's own types resolve to
# their public name (PUBLIC below). What is left are third-party types: this build has no network,
# so no intersphinx inventory of JAX, NumPy, Flax or optax can be fetched; each such type is named
# here, one by one, so that a new reference to anything else still fails the build.
nitpick_ignore = [
    # the Python standard library (its inventory is on the web too)
    ("py:class", "os.PathLike"), ("py:class", "pathlib.Path"),
    ("py:class", "collections.abc.Mapping"),
    # JAX, as annotations name it (jax.Array's class lives in jaxlib; Mesh in jax._src)
    ("py:class", "jax.Array"), ("py:class", "jax.jaxlib._jax.Array"),
    ("py:class", "jaxlib._jax.Device"), ("py:class", "jax._src.mesh.Mesh"),
    # jzero's alias of Any for a JAX pytree (jax's notion: nested containers of arrays)
    ("py:class", "PyTree"),
    ("py:class", "numpy.ndarray"),
    ("py:class", "flax.nnx.module.Module"), ("py:class", "flax.linen.module.Module"),
    ("py:class", "optax._src.base.GradientTransformation"),
    ("py:class", "pydantic.main.BaseModel"),
]

# The modules the API reference documents (its autosummary in docs/api.md): jzero's top-level names,
# and the modules users import by name (the README's Python examples).
API_MODULES = re.findall(r"^   (jzero[\w.]*)$", (DOCS / "api.md").read_text(), re.M)


def _find(dotted: str) -> tuple[str, object] | None:
  """The jzero object named ``dotted`` (a module, or attributes of one) and its canonical name:
  where a class or function is defined, else the name it was found under; None if none."""
  parts = dotted.split(".")
  if parts[0] != "jzero":
    return None
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for part in parts[i:]:
      obj = getattr(obj, part, _MISSING)
      if obj is _MISSING:
        return None
    defined = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if i < len(parts) and None not in defined and defined[0].startswith("jzero"):
      return ".".join(defined), obj
    return dotted, obj
  return None


_MISSING = object()


def _public_names() -> dict[str, str]:
  """Where each documented object is defined -> the public name it is documented under:
  ``jzero.train.engine.Engine`` -> ``jzero.Engine`` (a signature's annotation names the
  defining module)."""
  public = {}
  for name in API_MODULES:
    module = importlib.import_module(name)
    for member in getattr(module, "__all__", []):
      found = _find(f"{name}.{member}")
      if found and found[0] != f"{name}.{member}":
        public.setdefault(found[0], f"{name}.{member}")
  return public


PUBLIC: dict[str, str] = {}


def _resolve_jzero(app, env, node, contnode):
  """A reference to a jzero object that Sphinx did not find by its written name:

  * written relative to the module (or class) whose docstring holds it, or by the module that
    defines it, it links to the object under its public name (``Engine.init`` in a docstring of
    ``jzero.train.loop``, ``jzero.train.engine.Engine`` in a signature -> ``jzero.Engine``);
  * an internal module or object that the API reference does not document (the docstrings name
    them for contributors: ``jzero.checkpoint.layout``) is set as code, not a link -- after
    checking that it exists, so that a misspelt name still fails the build.
  """
  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"].lstrip("~.")
  domain = env.get_domain("py")
  for dotted in [target] + [f"{base}.{target}" for base in _bases(node)] + _defined(target):
    found = _find(dotted) if dotted else None
    if found is None:
      continue
    canonical = found[0]
    for defined, public in PUBLIC.items():
      if canonical == defined or canonical.startswith(defined + "."):
        canonical = public + canonical[len(defined):]
        break
    for name in dict.fromkeys((canonical, dotted)):
      resolved = domain.resolve_any_xref(env, node["refdoc"], app.builder, name, node, contnode)
      if resolved:
        return resolved[0][1]
    return contnode  # exists, not in the API reference: code, not a link
  return None


def _bases(node) -> list[str]:
  """Where a relative name in ``node`` may start: the documented object's class and module, and
  the class and module that define it (its docstring was written there: "docstring of X" in
  the node's source)."""
  module, cls = node.get("py:module"), node.get("py:class")
  contexts = [f"{module}.{cls}" if cls else None, module]
  source = str(node.source or "")
  if "docstring of " in source:
    contexts.insert(0, source.rsplit("docstring of ", 1)[1].split(":")[0])
  bases = []
  for context in filter(None, contexts):
    found = _find(context)
    obj = found[1] if found else None
    parts = (found[0] if found else context).split(".")
    bases += [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    if obj is not None and getattr(obj, "__module__", None):
      bases.append(obj.__module__)
  return list(dict.fromkeys(bases))


def _defined(name: str) -> list[str]:
  """``name`` in the one jzero module that defines it (an annotation names a class its module
  imports only for type checking: ``DelayedGrads`` in ``TrainState``); [] if not exactly one."""
  found = [module for module, m in list(sys.modules.items())
           if module.startswith("jzero") and m is not None
           and getattr(vars(m).get(name), "__module__", None) == module]
  return [f"{found[0]}.{name}"] if len(found) == 1 else []


def _skip_tuple_fields(app, what, name, obj, skip, options):
  """A NamedTuple's fields are documented by its docstring's Attributes (their own docstrings
  say only "Alias for field number N")."""
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def setup(app):
  PUBLIC.update(_public_names())
  app.connect("missing-reference", _resolve_jzero)
  app.connect("autodoc-skip-member", _skip_tuple_fields)


# -- HTML ------------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "jzero"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
