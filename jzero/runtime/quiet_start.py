"""A quiet start: no CUDA-plugin noise when there is no NVIDIA driver.

With JAX's CUDA plugin installed (jzero's ``gpu-aot`` extra, which ``jzero aot`` needs to compile
for a GPU it does not have) every ``import jax`` on a machine without an NVIDIA driver prints, from
C++, ``cudart_stub.cc ... Could not find cuda drivers on your machine, GPU will not be used.`` and
absl's ``WARNING: All log messages before absl::InitializeLog() is called are written to STDERR``
(three times each), and the first backend initialisation logs the plugin's failed version check
as a traceback (``Jax plugin configuration error: Exception when calling
jax_plugins.xla_cuda12.initialize()``). None of it is actionable there: CUDA cannot run without
a driver, and compiling for a GPU (``jzero aot``) needs no runtime.

:func:`import_jax` -- called by ``jzero/__init__`` before anything imports JAX -- does two
things, and only when no driver can be loaded (``libcuda.so.1``): it imports JAX with file
descriptor 2 sent to a temporary file and writes every line of it back except those two known
lines (C++ writes to the descriptor, so Python's ``sys.stderr`` cannot filter it) -- loading the
plugin's PJRT library in the same window, whose static initialisers would print the line again
when the backend starts --, and it adds a filter to JAX's ``jax._src.xla_bridge`` logger that drops
that one plugin traceback. Everything
else, JAX's own warnings included, still reaches stderr. A program that imports JAX before jzero
has printed the lines already; so does any machine where a driver exists (there they may matter).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
import tempfile

__all__ = ["NOISE", "PLUGIN_ERROR", "driver_present", "import_jax"]

#: Lines of the CUDA plugin's import on a machine without a driver that :func:`import_jax` drops.
NOISE = (b"Could not find cuda drivers on your machine",
         b"All log messages before absl::InitializeLog() is called")
#: The start of the plugin's logged traceback at backend initialisation, dropped likewise.
PLUGIN_ERROR = "Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda"


def driver_present() -> bool:
  """Whether the NVIDIA driver library can be loaded (CUDA could run here)."""
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


class _NoPluginError(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.getMessage()).startswith(PLUGIN_ERROR)


def _load_cuda_plugin_library() -> None:
  """Loads the CUDA plugin's PJRT library now, so that its static initialisers log (the same
  cudart_stub line) into :func:`import_jax`'s filter instead of at the backend's start, when JAX
  loads it; loading it again there runs nothing. A plugin laid out otherwise: nothing done."""
  spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
  for folder in (spec.submodule_search_locations or []) if spec else []:
    library = os.path.join(folder, "xla_cuda_plugin.so")
    if os.path.exists(library):
      try:
        ctypes.CDLL(library)
      except OSError:
        pass  # JAX reports it itself when it tries


def import_jax() -> None:
  """Imports JAX; without an NVIDIA driver, without the CUDA plugin's noise (module docstring)."""
  if "jax" in sys.modules or driver_present():
    import jax  # noqa: F401  (already imported, or a driver: nothing to hide)
    return
  logging.getLogger("jax._src.xla_bridge").addFilter(_NoPluginError())
  flush = getattr(sys.stderr, "flush", lambda: None)  # sys.stderr may be None (pythonw, daemons)
  try:
    flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # no file descriptor 2 (closed): nothing to filter
    import jax  # noqa: F401
    return
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import jax  # noqa: F401
      _load_cuda_plugin_library()
    finally:
      flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().splitlines(keepends=True):
        if not any(noise in line for noise in NOISE):
          os.write(2, line)
