"""A model defined outside jzero, for `jzero train --model tests/own_model.py:factory`
(tests/cli/test_cli.py): a byte-level MLP language model in Flax NNX with its loss beside it, and
two regressors for .npz data (NNX and Linen) with theirs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen, nnx

VOCAB, WIDTH = 256, 32


class ByteMLP(nnx.Module):
  """Each next byte from the current one: embed, one hidden layer, logits."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.hidden = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.out(jax.nn.gelu(self.hidden(self.embed(tokens))))


def factory(rngs: nnx.Rngs) -> ByteMLP:
  return ByteMLP(rngs)


def loss_fn(model: ByteMLP, batch: dict) -> jax.Array:
  """Mean next-byte cross-entropy of batch["tokens"] [B, T + 1]."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class Regressor(nnx.Module):
  """x [B, 4] -> y [B, 2], for .npz data (no loss_fn of its own: see regression_loss)."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear(x)


def regression_loss(model: Regressor, batch: dict) -> jax.Array:
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class LinenRegressor(linen.Module):
  """The same in Linen: jzero train builds the class with no arguments."""

  @linen.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return linen.Dense(2)(x)


def init_inputs(batch: dict) -> tuple:
  """What Linen's module.init is called with (jzero train reads it from the model's module)."""
  return (batch["x"],)
