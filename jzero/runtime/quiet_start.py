"""CUDA that cannot run here stays out of the process: a quiet ``import jzero`` without a GPU.

JAX's CUDA plugin (jzero's ``gpu-aot`` extra, which ``jzero aot`` needs to compile for a GPU it
does not have) is two packages: ``jax_cuda12_plugin`` (CUDA kernels: solver, PRNG, Triton calls,
...) and ``jax_plugins.xla_cuda12`` (the PJRT plugin JAX discovers when its backends start). On a
machine without an NVIDIA driver both are noise where they are loaded, from C++:

* ``import jax`` imports the kernel modules (``jaxlib.gpu_solver`` and its siblings); three of
  their libraries' static initialisers print absl's ``WARNING: All log messages before
  absl::InitializeLog() is called are written to STDERR`` and ``cudart_stub.cc:31] Could not find
  cuda drivers on your machine, GPU will not be used.``
* the backends' start imports the PJRT plugin, whose ``initialize()`` checks the CUDA runtime's
  version -- a logged ``Jax plugin configuration error`` traceback -- and loads its library (the
  cudart_stub line again).

None of it is actionable: CUDA cannot run without a driver, and compiling for a GPU needs no
runtime. :func:`prepare` -- which ``jzero/__init__`` calls before anything imports JAX -- keeps the
plugin's packages out of JAX's sight when **CUDA cannot run here**: no NVIDIA driver library
(``libcuda.so.1``) loads and ``JAX_PLATFORMS`` does not ask for CUDA. Nothing is redirected and no
output is filtered; the plugin is simply not loaded:

* the kernel packages are entered in ``sys.modules`` as ``None`` (Python's documented "not
  importable"), so JAX's import finds no CUDA kernels, as on a machine without the plugin;
* each PJRT plugin module is entered as a stand-in whose ``initialize()`` does nothing, so JAX's
  backend discovery registers no CUDA backend (and logs nothing: the module imported fine).

:func:`load_cuda_compiler` is the one way back: ``jzero aot`` (compiling for a GPU topology) takes
the stand-ins out, imports the real plugin and registers it, with its version check skipped. That
load prints the cudart_stub line once per library it opens (it is the plugin's own C++ logging,
before absl is initialised; no switch turns it off) -- the price of a GPU compile, paid only there.
The kernel packages become importable again (the plugin's ``cuda_plugin_extension`` lives there and
registers the compiler's custom-call and Triton handlers); JAX's kernel tables, filled at its
import, keep no CUDA kernels, which a compile for a topology does not run.

What remains: a script that imports JAX *before* jzero has loaded the kernel packages already, so
their three lines are printed by then (``import jax`` alone prints them wherever the plugin is
installed without a driver); jzero still keeps the backends' start quiet. On a machine with a
driver, or with ``JAX_PLATFORMS`` naming ``cuda`` / ``gpu``, nothing is hidden.

**libtpu** (jzero's ``tpu-aot`` extra, which ``jzero aot --tpu`` needs) is the same story: on a
machine without TPU chips JAX's backend start tries it anyway (its ``tpu`` backend factory loads
``libtpu.so``), and the library, finding no TPU VM metadata, prints "could not determine TPU
accelerator type", "unexpected worker hostname" and an error trace -- and costs seconds. Where no
TPU chip is on the PCI bus (Google's vendor id) and ``JAX_PLATFORMS`` does not ask for ``tpu``,
:func:`prepare` enters ``libtpu`` in ``sys.modules`` as ``None``: JAX finds no library, as on a
machine without it. :func:`load_tpu_compiler` (a compile for a TPU topology) takes it out again
after setting, before the library loads, the variables that describe a compile-only host to it
(:data:`TPU_COMPILE_ONLY_ENV`: no metadata server query, one local worker, its logs to stderr at
error level only) -- each with ``setdefault``, so the user's own values win. Where ``import jax``
came first, it has imported ``libtpu`` (not loaded the library) and that import pointed
``TPU_LIBRARY_PATH`` at it: :func:`prepare` hides the module and takes that variable back, and
:func:`load_tpu_compiler` restores both.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os
import sys
import types

from jzero.errors import JZeroError

__all__ = ["KERNEL_PACKAGES", "PJRT_PLUGINS", "TPU_COMPILE_ONLY_ENV", "TPU_PACKAGE",
           "cuda_can_run", "cuda_plugin_installed", "hidden", "load_cuda_compiler",
           "load_tpu_compiler", "prepare", "tpu_can_run", "tpu_compiler_installed"]

#: The CUDA plugin's kernel packages, by CUDA major version (jax 0.10: 12; jax 0.11+: 13 too).
KERNEL_PACKAGES = ("jax_cuda12_plugin", "jax_cuda13_plugin")
#: The PJRT plugin modules JAX discovers in its ``jax_plugins`` namespace package.
PJRT_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")

#: The package that carries libtpu.so (jax's ``tpu`` extra; jzero's ``tpu-aot``).
TPU_PACKAGE = "libtpu"
#: What libtpu reads at load to describe this host, for compiling only (module docstring): no GCE
#: metadata query, one worker (this host), an accelerator type (the topology is given per compile,
#: to ``get_topology_desc``), its log at error level, to stderr, no log files, and no claim on
#: the chips' lock file (there are no chips; several processes may compile at once).
TPU_COMPILE_ONLY_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-8",
                        "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
                        "TPU_MIN_LOG_LEVEL": "2", "TPU_STDERR_LOG_LEVEL": "2",
                        "TPU_LOG_DIR": "disabled", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (what jax._src.hardware_utils looks for)

_HIDDEN: dict[str, types.ModuleType | None] = {}  # name -> what prepare() entered in sys.modules
_LIBTPU: list[types.ModuleType] = []  # libtpu as imported before prepare() hid it


def _driver_present() -> bool:
  """Whether the NVIDIA driver library can be loaded (CUDA could run here)."""
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


def _cuda_requested() -> bool:
  """Whether ``JAX_PLATFORMS`` (the variable, or JAX's config once imported) names CUDA."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if "jax" in sys.modules:
    platforms = sys.modules["jax"].config.jax_platforms or platforms
  return any(p.strip() in ("cuda", "gpu") for p in platforms.lower().split(","))


def cuda_can_run() -> bool:
  """Whether CUDA could run in this process: an NVIDIA driver loads, or the user asked for it."""
  return _driver_present() or _cuda_requested()


def _installed(name: str) -> bool:
  parent, _, child = name.rpartition(".")
  try:
    if parent and importlib.util.find_spec(parent) is None:  # find_spec("a.b") raises without a
      return False
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):  # a module already in sys.modules as None, or without a spec
    return False


def cuda_plugin_installed() -> bool:
  """Whether JAX's CUDA PJRT plugin is installed (loaded, hidden by :func:`prepare`, or not yet
  imported)."""
  return any(name in _HIDDEN or _installed(name) for name in PJRT_PLUGINS)


def _stand_in(name: str) -> types.ModuleType:
  module = types.ModuleType(name, f"jzero's stand-in for {name}: CUDA cannot run in this process "
                                  f"(jzero.runtime.quiet_start).")
  module.initialize = lambda: None  # JAX's discovery calls it: register nothing
  return module


def _backends_started() -> bool:
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # backends_are_initialized has no public home in jax 0.10
  return xla_bridge.backends_are_initialized()


def _tpu_chips_present() -> bool:
  """Whether a TPU chip is on this machine's PCI bus."""
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def tpu_can_run() -> bool:
  """Whether a TPU could run in this process: a chip is present, or ``JAX_PLATFORMS`` asks for
  ``tpu``, or JAX_FORCE_TPU_INIT is set."""
  platforms = os.environ.get("JAX_PLATFORMS", "").lower().split(",")
  return (_tpu_chips_present() or "tpu" in (p.strip() for p in platforms)
          or "JAX_FORCE_TPU_INIT" in os.environ)


def tpu_compiler_installed() -> bool:
  """Whether libtpu is installed (loaded, hidden by :func:`prepare`, or not yet imported)."""
  return TPU_PACKAGE in _HIDDEN or _installed(TPU_PACKAGE)


def prepare() -> None:
  """Hides the CUDA plugin from JAX where CUDA cannot run, and libtpu where no TPU can (module
  docstring). Call before ``import jax``; afterwards it can still keep the backends' start
  quiet, if they have not started. Does nothing where a driver is present or ``JAX_PLATFORMS``
  asks for CUDA (libtpu: a TPU chip, or ``JAX_PLATFORMS`` naming ``tpu``)."""
  if not _backends_started() and TPU_PACKAGE not in _HIDDEN and not tpu_can_run():
    imported = sys.modules.get(TPU_PACKAGE)  # `import jax` before jzero imports it (not loads)
    if imported is not None or _installed(TPU_PACKAGE):
      _LIBTPU[:] = [imported] if imported is not None else []
      sys.modules[TPU_PACKAGE] = _HIDDEN[TPU_PACKAGE] = None
      if imported is not None and os.environ.get("TPU_LIBRARY_PATH") == getattr(
          imported, "get_library_path", lambda: None)():
        del os.environ["TPU_LIBRARY_PATH"]  # what its import set, pointing JAX at it
  if cuda_can_run():
    return
  if "jax" not in sys.modules:
    for name in KERNEL_PACKAGES:
      if name not in sys.modules and _installed(name):
        sys.modules[name] = _HIDDEN[name] = None
  if not _backends_started():
    for name in PJRT_PLUGINS:
      if name not in sys.modules and _installed(name):
        sys.modules[name] = _HIDDEN[name] = _stand_in(name)


def hidden() -> tuple[str, ...]:
  """The plugin packages :func:`prepare` keeps out of sight in this process."""
  return tuple(name for name, entry in _HIDDEN.items() if sys.modules.get(name, 0) is entry)


def _not_installed(target: str, compiler: str, cause: str, extra: str, holds: str) -> JZeroError:
  """The error of a compile for a ``target`` topology whose compile-only ``compiler`` is missing:
  the ``extra`` that installs it and what it ``holds``."""
  return JZeroError(f"compiling for a {target} topology needs {compiler}, which is not installed "
                    f"({cause}). Install the {extra} extra: pip install -e \".[{extra}]\" (or pip "
                    f"install \"jzero[{extra}]\"): {holds}.")


def load_cuda_compiler() -> None:
  """Makes JAX's CUDA compiler plugin available in this process, for compiling to a GPU topology
  that is not present (``jax.experimental.topologies.get_topology_desc(platform="cuda")``).

  Where :func:`prepare` deferred the PJRT plugin, the real one is imported and registered now,
  after the CPU backend has started (so the CUDA backend is never started: it cannot run) and
  without its CUDA-runtime version check (compiling needs no runtime). Elsewhere JAX's own
  discovery registers it; before that discovery, jzero skips the same version check for it.

  Raises:
    JZeroError: the plugin is not installed (the message names the ``gpu-aot`` extra).
  """
  deferred = [name for name in PJRT_PLUGINS if name in hidden()]
  if not deferred:
    if not cuda_plugin_installed():
      raise _not_installed("GPU", "the CUDA compiler plugin",
                           f"no CUDA PJRT plugin: {' / '.join(PJRT_PLUGINS)}", "gpu-aot",
                           "the CUDA compiler plugin, jax-cuda12-plugin and jax-cuda12-pjrt "
                           "matching your jax; no GPU and no CUDA libraries are needed")
    if not _backends_started():
      os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    return
  import jax  # noqa: PLC0415
  jax.devices()  # the backends start first, without CUDA
  check = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # read by the plugin's initialize()
  try:
    for name in [n for n in KERNEL_PACKAGES if n in hidden()]:  # the plugin's C++ extension
      del sys.modules[name]
      _HIDDEN.pop(name)
    for name in deferred:
      del sys.modules[name]
      importlib.import_module(name).initialize()
      _HIDDEN.pop(name)
  finally:
    if check is None:
      del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]


def load_tpu_compiler() -> None:
  """Makes libtpu available in this process, for compiling to a TPU topology that is not present
  (``jax.experimental.topologies.get_topology_desc(platform="tpu")``): the backends start first
  (without a TPU backend, where :func:`prepare` hid the library), then the compile-only host's
  variables (:data:`TPU_COMPILE_ONLY_ENV`) are set where the user has not set them, before JAX
  loads the library.

  Raises:
    JZeroError: libtpu is not installed (the message names the ``tpu-aot`` extra).
  """
  if not tpu_compiler_installed():
    raise _not_installed("TPU", "libtpu", f"no module {TPU_PACKAGE}", "tpu-aot",
                         "libtpu, the version jax's tpu extra pins; no TPU is needed")
  if TPU_PACKAGE in hidden():
    import jax  # noqa: PLC0415
    jax.devices()  # the backends start first, without a TPU backend
    del sys.modules[TPU_PACKAGE]
    if _LIBTPU:
      sys.modules[TPU_PACKAGE] = _LIBTPU.pop()
      getattr(sys.modules[TPU_PACKAGE], "configure_library_path", lambda: None)()
    _HIDDEN.pop(TPU_PACKAGE)
  if not tpu_can_run():
    for name, value in TPU_COMPILE_ONLY_ENV.items():
      os.environ.setdefault(name, value)
