"""The collectives, explicit inside ``shard_map``, and the parameter object whose ``gather()`` runs
them.

* :mod:`jzero.comm.collectives` -- gather (backward: reduce-scatter), attach, all-gather,
  reduce-scatter, local slice.
* :mod:`jzero.comm.zero_param` -- :class:`ZeroParam`, a parameter as the model sees it.
* :mod:`jzero.comm.zeropp` -- ZeRO++: qwZ, hpZ, qgZ (the Pallas kernels are ``jzero.kernels``).
* :mod:`jzero.comm.collective_order` -- one order of collectives on every process.

A new quantized collective: its algorithm in :mod:`jzero.comm.zeropp` (a ``Comm`` field saying when
a leaf uses it, a function in the shape of ``quantized_gather``), its kernel in ``kernels/``, and a
branch in :meth:`ZeroParam.gather` (forward) or the gather's backward in ``zeropp``.
"""

__all__: list[str] = []
