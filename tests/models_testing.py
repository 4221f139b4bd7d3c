"""Small models several test folders train: the issue's loop model (residual MLP blocks in a Python
loop, NNX) with its regression batches, and a Linen model whose layers run under
jzero.linen_scan_layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

import jzero
from zero_testing import make_engine

N = 8
WIDE = 512  # the loop model: residual MLP blocks of width 512 (two 512 x 2048 kernels)


class Block(nnx.Module):
  def __init__(self, d: int, rngs: nnx.Rngs):
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))


class LoopNet(nnx.Module):
  """L blocks in an nnx.List run by a Python loop."""

  def __init__(self, rngs: nnx.Rngs, layers: int = 4, d: int = WIDE):
    self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def regression_batch(n: int = N, d: int = WIDE, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(n, d)).astype(np.float32),
          "y": rng.normal(size=(n, d)).astype(np.float32)}


class LinenScanBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h)), None


class LinenScanned(nn.Module):
  """A Linen model whose layers run under nn.scan, built with jzero.linen_scan_layers."""
  width: int = 32
  layers: int = 3
  stacked_layers = ("blocks",)

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    x, _ = jzero.linen_scan_layers(LinenScanBlock, self.layers)(self.width, name="blocks")(x, None)
    return nn.Dense(3)(x)


def linen_loss(apply, batch):
  return jnp.mean((apply(batch["x"]) - batch["y"]) ** 2)


def linen_engine(module: nn.Module, config: dict):
  return make_engine(config, module, linen_loss, init_inputs=lambda b: (b["x"],))
