"""Plans for hardware you may not have: the real step compiled for a GPU topology.

* :mod:`jzero.planning.aot` -- the step compiled for a GPU topology that is not present
  (``jzero aot``; GPU target configs in ``gpu_specs/``).
"""

__all__: list[str] = []
