"""A small GPT (Flax NNX) whose layers run under ``scan`` -- the default job's model.

Byte-level (vocabulary 256), pre-LayerNorm blocks with causal self-attention and a GELU MLP, learned
positions, output head tied to the token embedding. The ``n_layers`` blocks are created stacked
(``nnx.vmap``): every block parameter has a leading layer axis, and :func:`jzero.scan_layers` runs
them, so under ZeRO-3 one layer's parameters are gathered at a time. ``stacked_layers`` tells the
engine which subtree is stacked.

The same code takes the classic shapes, to check real sizes (``jzero aot``): an MLP width other than
``mlp_ratio * d_model`` (``mlp_dim``), a gated SiLU MLP (``gated_mlp``: gate, up and down
projections, as Llama's), an untied output head (``tie_embeddings=False``) and any vocabulary.
:data:`PRESETS` names the default model, GPT-3 XL ("1.3b") and a Llama-like 7B ("7b"). The
defaults build exactly the parameters they always did (same paths, shapes and initial values).

Batches are ``{"tokens": int32[B, seq_len + 1]}``; :func:`lm_loss` is the mean next-byte
cross-entropy in nats.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jzero.modeling.layer_scan import scan_layers

__all__ = ["GPTConfig", "GPT", "lm_loss", "lora_labels", "PRESETS", "preset", "residual_dtype"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of the model. The default has 6.4M parameters.

  Attributes:
    vocab_size: tokens (256: bytes).
    seq_len: positions (learned position embeddings of this length).
    d_model: hidden size.
    n_layers: transformer blocks.
    n_heads: attention heads (``d_model`` must be a multiple).
    mlp_ratio: MLP width as a multiple of ``d_model`` when ``mlp_dim`` is None.
    mlp_dim: MLP width (default ``mlp_ratio * d_model``).
    gated_mlp: a gated SiLU MLP (``down(silu(gate(x)) * up(x))``, Llama's) instead of GELU.
    tie_embeddings: the output head is the token embedding (else a separate ``head`` matrix).
    lora_rank: LoRA adapters of this rank on the attention projections (``qkv`` and
      ``attn_out`` as ``nnx.LoRALinear``: their ``lora/lora_a`` and ``lora/lora_b`` beside the
      kernel); 0: none. Fine-tune them alone with :func:`lora_labels`.
  """

  vocab_size: int = 256
  seq_len: int = 64
  d_model: int = 256
  n_layers: int = 8
  n_heads: int = 4
  mlp_ratio: int = 4
  mlp_dim: int | None = None
  gated_mlp: bool = False
  tie_embeddings: bool = True
  lora_rank: int = 0

  @property
  def hidden_size(self) -> int:
    return self.d_model

  @property
  def mlp_width(self) -> int:
    return self.mlp_ratio * self.d_model if self.mlp_dim is None else self.mlp_dim

  def num_params(self) -> int:
    """Parameter count, from the shapes (no model is built)."""
    d, f = self.d_model, self.mlp_width
    block = (3 * d * d + d * d + d + 4 * d  # qkv, attention out (+ bias), two LayerNorms
             + (3 if self.gated_mlp else 2) * d * f + (2 if self.gated_mlp else 1) * f + d)
    head = 0 if self.tie_embeddings else d * self.vocab_size
    block += self.lora_rank * (d + 3 * d) + self.lora_rank * (d + d)  # adapters of qkv, attn_out
    return self.vocab_size * d + self.seq_len * d + self.n_layers * block + 2 * d + head


PRESETS: dict[str, GPTConfig] = {
    "default": GPTConfig(),
    # GPT-3 XL (Brown et al. 2020, Table 2.1): GPT-2's 50257-token vocabulary, tied head.
    "1.3b": GPTConfig(vocab_size=50257, seq_len=2048, d_model=2048, n_layers=24, n_heads=16),
    # Llama-like 7B (Touvron et al. 2023): gated MLP 11008 wide, untied head, learned positions
    # instead of rotary ones (8.4M parameters more; the same shapes otherwise).
    "7b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32,
                    mlp_dim=11008, gated_mlp=True, tie_embeddings=False),
}


def preset(name: str) -> GPTConfig:
  """A :data:`PRESETS` shape by name ("default", "1.3b", "7b")."""
  from jzero.errors import ConfigError  # noqa: PLC0415 (models import nothing else of jzero)

  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; the presets are {sorted(PRESETS)}.")
  return PRESETS[name]


class Block(nnx.Module):
  """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    d, init = cfg.d_model, nnx.initializers.normal(0.02)
    out_init = nnx.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
    self.n_heads = cfg.n_heads
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    linear = (functools.partial(nnx.LoRALinear, lora_rank=cfg.lora_rank) if cfg.lora_rank
              else nnx.Linear)
    self.qkv = linear(d, 3 * d, use_bias=False, kernel_init=init, rngs=rngs)
    self.attn_out = linear(d, d, kernel_init=out_init, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_width, kernel_init=init, rngs=rngs)
    if cfg.gated_mlp:
      self.mlp_gate = nnx.Linear(d, cfg.mlp_width, kernel_init=init, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_width, d, kernel_init=out_init, rngs=rngs)
    self.gated = cfg.gated_mlp

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)
    attn = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + self.attn_out(attn.reshape(b, t, d))
    h = self.ln2(x)
    if self.gated:
      h = jax.nn.silu(self.mlp_gate(h)) * self.mlp_in(h)
    else:
      h = jax.nn.gelu(self.mlp_in(h))
    return x + self.mlp_out(h)


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
    if not cfg.tie_embeddings:
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (float32) [B, T, vocab] for int tokens [B, T]."""
    x = self.embed(tokens) + self.pos[: tokens.shape[1]].astype(self.embed.embedding.dtype)
    graphdef, stacked = nnx.split(self.blocks)
    x = scan_layers(lambda h, params: nnx.merge(graphdef, params)(h), x, stacked)
    x = self.ln_f(x)
    logits = self.embed.attend(x) if self.config.tie_embeddings else self.head(x)
    return logits.astype(jnp.float32)


def lm_loss(model: GPT, batch: dict) -> jax.Array:
  """Mean next-token cross-entropy (nats) of ``batch["tokens"]`` [B, T + 1]."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def lora_labels(params: Any) -> Any:
  """``optax.multi_transform`` labels for LoRA fine-tuning: "lora" for the adapters (a path with a
  ``lora`` key), "frozen" for everything else --
  ``optax.multi_transform({"lora": optax.adamw(1e-3), "frozen": optax.set_to_zero()},
  lora_labels)``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "lora" if any(getattr(k, "key", None) == "lora" for k in path) else "frozen",
      params)


def residual_dtype(config: GPTConfig, param_dtype: Any) -> jnp.dtype:
  """The dtype of what the layers pass along (the layer scan's carry, the residual stream) when
  the parameters are ``param_dtype``: read from the traced forward of a two-layer model of the
  same kind, so that it follows the model. Today it is fp32 even with bf16 parameters:
  ``nnx.Embed`` promotes its lookup to its ``param_dtype`` (fp32), and the layers follow it."""
  return _residual_dtype(config.gated_mlp, config.tie_embeddings, jnp.dtype(param_dtype).name)


@functools.cache
def _residual_dtype(gated: bool, tied: bool, dtype_name: str) -> jnp.dtype:
  cfg = GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_layers=2, n_heads=2, mlp_dim=8,
                  gated_mlp=gated, tie_embeddings=tied)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype_name), state)
  jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(
      state, jax.ShapeDtypeStruct((1, 4), jnp.int32))
  scan = _first_scan(jaxpr.jaxpr)
  return jnp.dtype(scan.invars[scan.params["num_consts"]].aval.dtype)


def _first_scan(jaxpr: Any) -> Any:
  """The first ``scan`` equation of ``jaxpr``, nested jaxprs searched in order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      return eqn
    for value in eqn.params.values():
      for item in value if isinstance(value, (list, tuple)) else (value,):
        sub = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr
        found = _first_scan(sub) if hasattr(sub, "eqns") else None
        if found is not None:
          return found
  return None
