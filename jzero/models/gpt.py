"""A small GPT (Flax NNX) whose layers run under ``scan`` -- the default job's model.

Byte-level (vocabulary 256), pre-LayerNorm blocks with causal self-attention and a GELU MLP, learned
positions, output head tied to the token embedding. The ``n_layers`` blocks are created stacked
(``nnx.vmap``): every block parameter has a leading layer axis, and :func:`jzero.scan_layers` runs
them, so under ZeRO-3 one layer's parameters are gathered at a time. ``stacked_layers`` tells the
engine which subtree is stacked.

Batches are ``{"tokens": int32[B, seq_len + 1]}``; :func:`lm_loss` is the mean next-byte
cross-entropy in nats.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jzero.layers import scan_layers

__all__ = ["GPTConfig", "GPT", "lm_loss"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of the model. The default has 6.4M parameters."""

  vocab_size: int = 256
  seq_len: int = 64
  d_model: int = 256
  n_layers: int = 8
  n_heads: int = 4
  mlp_ratio: int = 4

  @property
  def hidden_size(self) -> int:
    return self.d_model


class Block(nnx.Module):
  """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    d, init = cfg.d_model, nnx.initializers.normal(0.02)
    out_init = nnx.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
    self.n_heads = cfg.n_heads
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, kernel_init=init, rngs=rngs)
    self.attn_out = nnx.Linear(d, d, kernel_init=out_init, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, kernel_init=init, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, kernel_init=out_init, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)
    attn = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + self.attn_out(attn.reshape(b, t, d))
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))


class GPT(nnx.Module):
  """Byte-level GPT with scanned layers. ``GPT(GPTConfig(), rngs=nnx.Rngs(0))``."""

  stacked_layers = ("blocks",)

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.pos = nnx.Param(nnx.initializers.normal(0.01)(rngs.params(), (cfg.seq_len, cfg.d_model)))

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = make_blocks(rngs)
    self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (float32) [B, T, vocab] for int tokens [B, T]."""
    x = self.embed(tokens) + self.pos[: tokens.shape[1]].astype(self.embed.embedding.dtype)
    graphdef, stacked = nnx.split(self.blocks)
    x = scan_layers(lambda h, params: nnx.merge(graphdef, params)(h), x, stacked)
    return self.embed.attend(self.ln_f(x)).astype(jnp.float32)


def lm_loss(model: GPT, batch: dict) -> jax.Array:
  """Mean next-token cross-entropy (nats) of ``batch["tokens"]`` [B, T + 1]."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
