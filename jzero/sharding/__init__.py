"""Where every array lives: the device mesh and the ZeRO plan.

* :mod:`jzero.sharding.mesh` -- :class:`ZeroMesh` from a mesh file or the device count: which axes
  partition, which replicate, which split the batch.
* :mod:`jzero.sharding.plan` -- :class:`Plan`: for every parameter leaf, the layout and tier of its
  compute parameter, gradient, fp32 master and optimizer state; the shardings and memory kinds the
  step is compiled with.
* :mod:`jzero.sharding.zeropp` -- ZeRO++ as data: what the config asks, resolved against the mesh,
  and each leaf's choice of how its collectives move bytes.
* :mod:`jzero.sharding.quantization` -- the quantized collectives (qwZ int8 / int4, qgZ int4) as
  small strategy objects, by name.
"""

__all__: list[str] = []
