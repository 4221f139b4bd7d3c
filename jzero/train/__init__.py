"""Training: the engine and its step, the train state, optimizers and schedules, precision, the
resumable loop.

* :mod:`jzero.train.initialize` -- :func:`jzero.initialize`: a config, a model and a loss into an
  :class:`Engine`.
* :mod:`jzero.train.engine` -- :class:`Engine`: state creation, steps, evaluation;
  :mod:`jzero.train.state_io` -- its states outside a step: read back, checkpoints, imports.
* :mod:`jzero.train.deepspeed_engine` -- DeepSpeed's engine over jzero's (the 4-tuple's), and
  :mod:`jzero.train.deepspeed_names` -- each name of DeepSpeed's ``DeepSpeedEngine`` in jzero.
* :mod:`jzero.train.step` -- what one step computes; its update phase is the update chain the tiers
  compose (:mod:`jzero.tiers`).
* :mod:`jzero.train.state` -- :class:`TrainState`.
* :mod:`jzero.train.optim`, :mod:`jzero.train.precision` -- DeepSpeed's optimizers and schedules
  on optax; fp16 / bf16 and the loss scaler.
* :mod:`jzero.train.loop` -- :func:`train_loop`: checkpoints, resume, preemption (``jzero train``).
* :mod:`jzero.train.monitor` -- the config's tensorboard / csv_monitor / wandb monitors, written
  every step; throughput and MFU.
"""

__all__: list[str] = []
