"""jzero: DeepSpeed's ZeRO rebuilt natively for JAX/XLA.

::

  import jzero
  engine = jzero.initialize(model=..., loss_fn=..., config="configs/zero3.json")
  state = engine.init(jax.random.key(0))
  state, metrics = engine.train_step(state, engine.shard_batch(batch))

Several processes: start the script with ``jzero launch`` (or srun / mpirun); ``jzero.initialize``
joins them (:func:`jzero.init_distributed`).
"""

import logging as _logging

from jzero.runtime import quiet_start as _quiet_start
_quiet_start.prepare()  # before anything imports JAX: CUDA that cannot run here is not loaded

from jzero.config import Config  # noqa: E402
from jzero.runtime.distributed import init_distributed  # noqa: E402
from jzero.train.engine import Engine  # noqa: E402
from jzero.train.state import TrainState  # noqa: E402
from jzero.train.aux_metrics import Max, Mean, Min, Sum  # noqa: E402
from jzero.train.initialize import add_config_arguments, initialize  # noqa: E402
from jzero.errors import (CheckpointError, ConfigError, DataError, JZeroError,  # noqa: E402
                          JZeroWarning, MeshError, NotSupportedError, Preempted,
                          StepNotCommitted)
from jzero.modeling.layer_scan import gather, linen_scan_layers, remat, scan_layers  # noqa: E402
from jzero.sharding.mesh import MeshSpec, ZeroMesh, simulate_cpu_devices  # noqa: E402
from jzero.sharding.plan import Plan  # noqa: E402
from jzero.sharding.planner import make_plan  # noqa: E402
from jzero.version import __version__  # noqa: E402,F401  (jzero.__version__)

# A library prints nothing itself: jzero.initialize and the jzero command show the log
# (jzero.runtime.logs.show_log).
_logging.getLogger("jzero").addHandler(_logging.NullHandler())

__all__ = [
    "Config", "Engine", "TrainState", "initialize", "add_config_arguments", "init_distributed",
    "gather", "remat", "scan_layers",
    "linen_scan_layers", "MeshSpec", "ZeroMesh", "simulate_cpu_devices", "Plan", "make_plan",
    "JZeroError", "ConfigError", "NotSupportedError", "MeshError", "DataError", "CheckpointError",
    "Preempted", "StepNotCommitted", "JZeroWarning", "Mean", "Sum", "Max", "Min",
]
