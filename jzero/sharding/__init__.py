"""Where every array lives: the device mesh and the ZeRO plan.

* :mod:`jzero.sharding.mesh` -- :class:`ZeroMesh` from a mesh file or the device count: which axes
  partition, which replicate, which split the batch.
* :mod:`jzero.sharding.plan` -- :class:`Plan`: for every parameter leaf, the layout and tier of its
  compute parameter, gradient, fp32 master and optimizer state; the shardings and memory kinds the
  step is compiled with.
"""

__all__: list[str] = []
