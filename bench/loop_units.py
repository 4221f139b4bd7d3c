"""ZeRO-3 on a Flax model written the ordinary way: a Python loop of residual MLP blocks.

``python bench/loop_units.py`` compiles the train step of an NNX model whose L blocks (two
512 x 2048 kernels each) run in a ``for`` loop, on 8 simulated CPU devices, and prints the step's
temporary memory (XLA ``memory_analysis()``) at L = 4 and 8 for:

* stage 0 (DDP);
* stage 3 with one unit per block (``leaf_module.classes: ["Block"]``, FSDP2's per-block
  ``fully_shard``);
* stage 3 with DeepSpeed's default granularity: one unit per module owning parameters (Linear).

The last column is how much of the 4 extra blocks' full parameter bytes (32 MiB) the temp memory
grows by when the depth doubles (before gather units, jzero gathered such a model's parameters
when the forward pass started and kept them until backward: 1.00x, 32.6 -> 64.7 MiB). Then the
memory report of the default configuration at L = 8.
"""

from __future__ import annotations

import jzero

jzero.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jzero.analysis.memory_report import format_memory_report  # noqa: E402

WIDTH = 512


class Block(nnx.Module):
  def __init__(self, d: int, rngs: nnx.Rngs):
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))


class LoopNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, layers: int):
    self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(layers)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def config(stage: int, **zero) -> dict:
  return {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


VARIANTS = {
    "stage 0 (DDP)": config(0),
    "stage 3, one unit per Block": config(3, leaf_module={"classes": ["Block"]}),
    "stage 3, one unit per Linear (default)": config(3),
}


def main() -> None:
  rng = np.random.default_rng(0)
  batch = {k: rng.normal(size=(8, WIDTH)).astype(np.float32) for k in ("x", "y")}
  extra = 4 * 2 * WIDTH * 4 * WIDTH * 4
  print(f"jax {jax.__version__}; temp MiB per device of the compiled step (XLA memory_analysis)")
  print("| configuration | L = 4 | L = 8 | growth / extra params |")
  print("|---|---|---|---|")
  last = None
  for name, cfg in VARIANTS.items():
    temps = []
    for layers in (4, 8):
      engine = jzero.initialize(lambda rngs, n=layers: LoopNet(rngs, n), mse, cfg)
      state = engine.init(jax.random.key(0))
      placed = engine.shard_batch(batch)
      temps.append(engine.compile_step(state, placed).memory_analysis().temp_size_in_bytes)
      last = (engine, state, placed)
    print(f"| {name} | {temps[0] / 2**20:.1f} | {temps[1] / 2**20:.1f} | "
          f"{(temps[1] - temps[0]) / extra:.2f}x |")
  engine, state, placed = last
  print()
  print(format_memory_report(engine.memory_report(state, placed)))


if __name__ == "__main__":
  main()
