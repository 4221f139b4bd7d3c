"""jzero: DeepSpeed's ZeRO rebuilt natively for JAX/XLA.

::

  import jzero
  engine = jzero.initialize(model=..., loss_fn=..., config="configs/zero3.json")
  state = engine.init(jax.random.key(0))
  state, metrics = engine.train_step(state, engine.shard_batch(batch))
"""

from jzero.config import Config
from jzero.engine import Engine, TrainState, initialize
from jzero.errors import (CheckpointError, ConfigError, DataError, JZeroError, JZeroWarning,
                          MeshError, NotSupportedError)
from jzero.layers import gather, remat, scan_layers
from jzero.mesh import MeshSpec, ZeroMesh, simulate_cpu_devices
from jzero.plan import Plan, make_plan

__version__ = "0.1.0"

__all__ = [
    "Config", "Engine", "TrainState", "initialize", "gather", "remat", "scan_layers", "MeshSpec",
    "ZeroMesh", "simulate_cpu_devices", "Plan", "make_plan", "JZeroError", "ConfigError",
    "NotSupportedError", "MeshError", "DataError", "CheckpointError", "JZeroWarning",
]
