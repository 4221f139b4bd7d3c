"""Where every array lives: the device mesh, the ZeRO plan, and where stage 3 gathers.

* :mod:`jzero.sharding.mesh` -- :class:`ZeroMesh` from a mesh file or the device count: which axes
  partition, which replicate, which split the batch.
* :mod:`jzero.sharding.plan` -- :class:`Plan`: for every parameter leaf, the layout and tier of its
  compute parameter, gradient, fp32 master and optimizer state; the shardings and memory kinds the
  step is compiled with.
* :mod:`jzero.sharding.gather_units` -- stage 3's gather units: the modules whose calls gather their
  parameters (DeepSpeed's leaf modules / granularity threshold).
* :mod:`jzero.sharding.layer_scan` -- :func:`jzero.scan_layers` and friends: a stack of layers
  scanned with one layer gathered at a time, rematerialised, with prefetch.
"""

__all__: list[str] = []
