"""DeepSpeed's JSON config format, typed and validated: :class:`Config`.

One module per step a config goes through:

* :mod:`jzero.config.schema` -- :class:`Config`: ``Config.load`` parses and validates (every problem
  of a config in one ConfigError, one line per key); the blocks it holds are
  :mod:`jzero.config.blocks`, its wording :mod:`jzero.config.messages`.
* :mod:`jzero.config.auto` -- ``Config.resolve``: Hugging Face's ``"auto"`` values and DeepSpeed's
  batch triple.
* :mod:`jzero.config.support` -- ``Config.check_supported``: ``SUPPORT_TABLE``, the one place that
  says what jzero refuses or what has no effect under XLA.

A new key: its field in the block's model (:mod:`jzero.config.blocks`, DeepSpeed's name and
default), a row in ``SUPPORT_TABLE`` if jzero cannot honour every value, and the module that reads
it (an offload tier reads its block in its ``settings_from_config``).
"""

from jzero.config.blocks import (ActivationCheckpointingConfig, AioConfig, Bf16Config,
                                 CheckpointConfig, DataTypesConfig, Fp16Config, LeafModuleConfig,
                                 OffloadOptimizerConfig, OffloadParamConfig, OptimizerConfig,
                                 SchedulerConfig, ZeroConfig)
from jzero.config.schema import Config

__all__ = ["Config", "ActivationCheckpointingConfig", "AioConfig", "Bf16Config", "CheckpointConfig",
           "DataTypesConfig", "Fp16Config", "LeafModuleConfig", "OffloadOptimizerConfig",
           "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "ZeroConfig"]
