"""DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py as a jzero user runs it: a BERT-style
masked language model whose forward returns its loss, trained by DeepSpeed's calls. Written for
these tests after that script's ``train()``: its DeepSpeed calls in its order, its config; the
model in Flax NNX (small), the tokenizer and wikitext replaced by a synthetic corpus (no download).

DeepSpeed calls (each runs here; tests/journeys/test_deepspeed_scripts.py checks them)::

  model, _, _, _ = deepspeed.initialize(model=model, model_parameters=..., config=ds_config)
  _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
  model.parameters()
  model.train()
  loss = model(**batch); model.backward(loss); model.step(); loss.item()
  model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})

Lines that differ from the original besides the imports and the model (docs/coming-from-deepspeed.md
names each):

* ``model_parameters=model.parameters()`` -> ``model_parameters=nnx.state(model, nnx.Param)``;
* ``batch[key] = value.to(device)`` -> nothing: the engine places numpy batches on the mesh;
* ``p.numel()`` -> ``p.size`` (JAX arrays);
* the data loader's ``batch_size`` -> ``batch_size * jax.local_device_count()``: one jzero process
  drives all its devices, so its batch holds a micro-batch for each.
"""

from __future__ import annotations

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jzero as deepspeed

__all__ = ["BertMLM", "create_data_iterator", "train"]

logger = logging.getLogger("hello_deepspeed")
VOCAB, PAD, MASK = 64, 0, 1


class BertMLM(nnx.Module):
  """An encoder (embeddings, ``num_layers`` self-attention blocks) with an MLM head; called with
  ``src_tokens, attention_mask, tgt_tokens`` it returns the masked-token cross-entropy, as the
  original's ``RobertaMLMModel.forward``."""

  def __init__(self, num_layers: int, num_heads: int, ff_dim: int, h_dim: int, dropout: float,
               max_seq_length: int, rngs: nnx.Rngs):
    self.tokens = nnx.Embed(VOCAB, h_dim, rngs=rngs)
    self.positions = nnx.Embed(max_seq_length, h_dim, rngs=rngs)
    self.attention = nnx.List([nnx.MultiHeadAttention(num_heads, h_dim, decode=False,
                                                      dropout_rate=dropout, deterministic=False,
                                                      rngs=rngs)
                               for _ in range(num_layers)])
    self.ff_in = nnx.List([nnx.Linear(h_dim, ff_dim, rngs=rngs) for _ in range(num_layers)])
    self.ff_out = nnx.List([nnx.Linear(ff_dim, h_dim, rngs=rngs) for _ in range(num_layers)])
    self.norms = nnx.List([nnx.LayerNorm(h_dim, rngs=rngs) for _ in range(2 * num_layers)])
    self.dropout = nnx.Dropout(dropout, deterministic=False, rngs=rngs)
    self.head = nnx.Linear(h_dim, VOCAB, rngs=rngs)

  def __call__(self, src_tokens, attention_mask, tgt_tokens):
    x = self.tokens(src_tokens) + self.positions(jnp.arange(src_tokens.shape[1]))
    mask = nnx.make_attention_mask(attention_mask, attention_mask)
    for i, attend in enumerate(self.attention):
      x = self.norms[2 * i](x + self.dropout(attend(x, mask=mask)))
      x = self.norms[2 * i + 1](x + self.dropout(self.ff_out[i](nnx.gelu(self.ff_in[i](x)))))
    logits = self.head(x)
    masked = tgt_tokens != PAD
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tgt_tokens)
    return jnp.sum(losses * masked) / jnp.maximum(jnp.sum(masked), 1)


def create_data_iterator(mask_prob: float, max_seq_length: int, batch_size: int, seed: int = 0):
  """Endless batches of masked sequences: ``src_tokens`` with ``mask_prob`` of the tokens masked,
  ``tgt_tokens`` the masked tokens' originals (``PAD`` elsewhere), ``attention_mask``."""
  rng = np.random.default_rng(seed)
  while True:
    tokens = rng.integers(2, VOCAB, size=(batch_size, max_seq_length))
    tokens[:, 1::2] = (tokens[:, ::2] + 1) % (VOCAB - 2) + 2  # something to learn
    masked = rng.random(tokens.shape) < mask_prob
    yield {"src_tokens": np.where(masked, MASK, tokens).astype(np.int32),
           "attention_mask": np.ones(tokens.shape, np.int32),
           "tgt_tokens": np.where(masked, tokens, PAD).astype(np.int32)}


def train(checkpoint_dir: str | None = None, load_checkpoint_dir: str | None = None,
          mask_prob: float = 0.15, max_seq_length: int = 16, num_layers: int = 2,
          num_heads: int = 2, ff_dim: int = 32, h_dim: int = 16, dropout: float = 0.1,
          batch_size: int = 2, num_iterations: int = 6, checkpoint_every: int = 3,
          log_every: int = 2, dtype: str = "bf16") -> dict:
  """The original's ``train`` (its experiment directory is ``checkpoint_dir`` itself); returns
  what the tests check: the losses, the first step, the client state loaded, the parameter count."""
  exp_dir = pathlib.Path(checkpoint_dir or load_checkpoint_dir)
  exp_dir.mkdir(exist_ok=True)
  data_iterator = create_data_iterator(mask_prob=mask_prob, max_seq_length=max_seq_length,
                                       batch_size=batch_size * jax.local_device_count())
  model = BertMLM(num_layers, num_heads, ff_dim, h_dim, dropout, max_seq_length, nnx.Rngs(0))
  assert dtype in ("fp16", "bf16")
  ds_config = {
      "train_micro_batch_size_per_gpu": batch_size,
      "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
      dtype: {"enabled": True},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
  }
  model, _, _, _ = deepspeed.initialize(model=model,
                                        model_parameters=nnx.state(model, nnx.Param),
                                        config=ds_config)
  start_step, client_state = 1, None
  if load_checkpoint_dir is not None:
    _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
    checkpoint_step = client_state["checkpoint_step"]
    start_step = checkpoint_step + 1
    for _ in range(checkpoint_step):  # the original's iterator restarts too; ours skips ahead
      next(data_iterator)
  num_params = sum(p.size for p in model.parameters())
  logger.info(f"Total number of model parameters: {num_params:,d}")
  model.train()
  losses = []
  for step, batch in enumerate(data_iterator, start=start_step):
    if step >= num_iterations:
      break
    loss = model(**batch)
    model.backward(loss)
    model.step()
    losses.append(loss.item())
    if step % log_every == 0:
      logger.info("Loss: {0:.4f}".format(np.mean(losses)))
    if step % checkpoint_every == 0:
      model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
  if step % checkpoint_every != 0:
    model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
  return {"losses": losses, "start_step": start_step, "client_state": client_state,
          "num_params": num_params, "global_steps": model.global_steps}
