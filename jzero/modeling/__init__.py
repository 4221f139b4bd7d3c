"""The user's model as the step runs it: bound to ZeRO's parameters, gathered where it uses them.

* :mod:`jzero.modeling.model_adapter` -- Flax NNX / Linen / plain functions behind one interface:
  abstract params, init, binding to the step's parameters and model state, eval mode.
* :mod:`jzero.modeling.model_state` -- the model's state besides parameters (BatchNorm's
  statistics): what the train state carries, SyncBatchNorm over the data axes, NNX RNG streams.
* :mod:`jzero.modeling.gather_units` -- stage 3's gather units: the modules whose calls gather their
  parameters (DeepSpeed's leaf modules / granularity threshold).
* :mod:`jzero.modeling.layer_scan` -- :func:`jzero.scan_layers` and friends: a stack of layers
  scanned with one layer gathered at a time, rematerialised, with prefetch.
"""

__all__: list[str] = []
