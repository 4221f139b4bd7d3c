"""The module paths of jzero 0.1's flat layout, kept importable for one release.

jzero 0.1 had its modules side by side under ``jzero/``; they now live in subpackages by concern
(README, "Architecture"). ``import jzero.memory`` (or ``from jzero.offload import ...``) still works
and gives the module at its new path -- the same module object, not a copy -- with a
DeprecationWarning naming the new path. :data:`MOVED` is the map; :func:`install` (called by
``jzero/__init__.py``) puts the finder on ``sys.meta_path``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "install", "new_path"]

#: old module path -> new module path
MOVED = {
    "jzero.autofill": "jzero.config.auto",
    "jzero.support": "jzero.config.support",
    "jzero.mesh": "jzero.sharding.mesh",
    "jzero.plan": "jzero.sharding.plan",
    "jzero.units": "jzero.sharding.gather_units",
    "jzero.layers": "jzero.sharding.layer_scan",
    "jzero.collectives": "jzero.comm.collectives",
    "jzero.zeropp": "jzero.comm.zeropp",
    "jzero.collective_order": "jzero.comm.collective_order",
    "jzero.offload": "jzero.tiers.host_optimizer",
    "jzero.param_offload": "jzero.tiers.host_params",
    "jzero.nvme": "jzero.tiers.nvme_store",
    "jzero.nvme_state": "jzero.tiers.nvme_state",
    "jzero.nvme_settings": "jzero.tiers.nvme_settings",
    "jzero.param_nvme": "jzero.tiers.nvme_params",
    "jzero.delayed": "jzero.tiers.delayed",
    "jzero.step": "jzero.train.step",
    "jzero.engine": "jzero.train.engine",
    "jzero.engine_from_config": "jzero.train.initialize",
    "jzero.optim": "jzero.train.optim",
    "jzero.precision": "jzero.train.precision",
    "jzero.model": "jzero.train.model_adapter",
    "jzero.memory": "jzero.analysis.estimate",
    "jzero.memory_report": "jzero.analysis.memory_report",
    "jzero.profile": "jzero.analysis.hlo",
    "jzero.aot": "jzero.analysis.aot",
    "jzero.tables": "jzero.analysis.tables",
    "jzero.distributed": "jzero.runtime.distributed",
    "jzero.launch": "jzero.runtime.launch",
    "jzero.data": "jzero.runtime.data",
    "jzero.quiet_start": "jzero.runtime.quiet_start",
}


def new_path(old: str) -> str | None:
  """The new path of an old module path (None: it did not move)."""
  return MOVED.get(old)


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports an old path as the module at its new path (one object under both names)."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname not in MOVED:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec):
    return None  # a placeholder; exec_module swaps in the real module

  def exec_module(self, module: types.ModuleType) -> None:
    new = MOVED[module.__name__]
    warnings.warn(f"{module.__name__} moved to {new}; the old path goes away in the next release",
                  DeprecationWarning, stacklevel=2)
    sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
  """Puts the old-path finder on ``sys.meta_path`` (once)."""
  if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
    sys.meta_path.append(_OldPathFinder())
