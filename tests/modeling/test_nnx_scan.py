"""An NNX model whose layers are made by ``nnx.vmap`` and run by ``nnx.scan`` (flax's own pattern
for stacked layers), at ZeRO-3: at a depth the device count divides, the stack's leading axis is
the one ZeRO-3 would split, so without ``stacked_layers`` jzero says so and names the fix; with it
the model trains as the plain loop does."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.errors import JZeroError
from zero_testing import SAME_MATH, batches

D = 32


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.lin = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return x + self.lin(self.ln(x))


class ScannedModel(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(256, D, rngs=rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)
    self.blocks = make(rngs)
    self.head = nnx.Linear(D, 256, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)
    return self.head(forward(x, self.blocks))


def loss_fn(model, batch):
  t = batch["tokens"]
  logits = model(t[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()


CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _train(**kw):
  engine = jzero.initialize(lambda rngs: ScannedModel(8, rngs), loss_fn, CONFIG,
                            optimizer=optax.adam(1e-3), **kw)
  state = engine.init(jax.random.key(0))
  losses = []
  for batch in batches(16, 8, 2):
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return losses


def test_a_scanned_stack_split_on_its_layer_axis_names_stacked_layers():
  with pytest.raises(JZeroError, match='stacked_layers="blocks"'):
    _train()


def test_with_stacked_layers_it_trains_as_the_plain_loop():
  losses = _train(stacked_layers="blocks")
  model = ScannedModel(8, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(1e-3)
  opt = tx.init(params)
  plain = []
  for batch in batches(16, 8, 2):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    plain.append(float(loss))
  np.testing.assert_allclose(losses, plain, rtol=SAME_MATH)
