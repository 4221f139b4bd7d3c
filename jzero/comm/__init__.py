"""The collectives, explicit inside ``shard_map``, and the parameter object whose ``gather()`` runs
them.

* :mod:`jzero.comm.collectives` -- gather (backward: reduce-scatter), attach, all-gather,
  reduce-scatter, local slice.
* :mod:`jzero.comm.zero_param` -- :class:`ZeroParam`, a parameter as the model sees it.
* :mod:`jzero.comm.zeropp` -- ZeRO++: qwZ, hpZ, qgZ (the Pallas kernels are ``jzero.kernels``).
* :mod:`jzero.comm.layouts` -- one leaf moved between the plan's layouts; hpZ's refresh program.
* :mod:`jzero.comm.collective_order` -- one order of collectives on every process.
* :mod:`jzero.comm.program` -- the ``shard_map`` every program runs in, and its compile options.

A new quantized collective is a strategy object of :mod:`jzero.sharding.quantization` (one module
and one registry line): :mod:`jzero.comm.zeropp` calls the leaf's strategy, never compares names.
"""

__all__: list[str] = []
