"""A Hugging Face-style fine-tuning script as a jzero user runs it: DeepSpeedExamples'
applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py, whose causal LM returns
an output object with ``.loss``, whose optimizer and schedule are its own, evaluated for
perplexity between epochs. Written for these tests after that script's ``main``: its DeepSpeed
calls in its order, its config's shape; the model a small Flax NNX causal LM with Hugging Face's
output convention, the tokenizer and datasets replaced by synthetic sequences (no download).

DeepSpeed calls (each runs here; tests/journeys/test_deepspeed_scripts.py checks them)::

  parser = deepspeed.add_config_arguments(parser)
  deepspeed.init_distributed()
  model, optimizer, _, lr_scheduler = deepspeed.initialize(
      model=model, optimizer=optimizer, args=args, config=ds_config, dist_init_required=True)
  model.train(); model.backward(loss); model.step()
  model.eval(); outputs = model(**batch); outputs.loss
  model.global_rank; model.module (the trained weights, saved)

Lines that differ from the original besides the imports and the model (docs/coming-from-deepspeed.md
names each):

* the client optimizer over param groups and Hugging Face's ``get_scheduler`` -> one optax
  transformation with the schedule inside (``optax.inject_hyperparams(optax.adamw)``, weight decay
  masked off biases and norms), and ``lr_scheduler=lr_scheduler`` dropped from ``initialize``;
* ``outputs = model(**batch, use_cache=False); loss = outputs.loss`` -> ``loss = model(**batch)``:
  in train mode the engine's forward is the compiled step and returns the loss;
* ``batch = to_device(batch, device)`` -> nothing: the engine places numpy batches on the mesh;
* ``model.tput_timer.update_epoch_count()`` and ``print_throughput(model.model, ...)`` -> nothing:
  jzero's step log prints the throughput (``steps_per_print``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jzero as deepspeed

__all__ = ["CausalLMOutput", "TinyCausalLM", "get_train_ds_config", "parse_args", "main"]

VOCAB = 48


@dataclasses.dataclass
class CausalLMOutput:
  """Hugging Face's ``CausalLMOutputWithPast``, the fields used here."""

  loss: jax.Array | None
  logits: jax.Array


class TinyCausalLM(nnx.Module):
  """A one-block causal transformer LM that takes Hugging Face's ``input_ids``,
  ``attention_mask`` and ``labels`` and returns :class:`CausalLMOutput` (loss: next-token
  cross-entropy over the unmasked labels)."""

  def __init__(self, hidden_size: int, rngs: nnx.Rngs):
    self.config = argparse.Namespace(hidden_size=hidden_size, vocab_size=VOCAB)
    self.embed = nnx.Embed(VOCAB, hidden_size, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(2, hidden_size, decode=False, rngs=rngs)
    self.norm = nnx.LayerNorm(hidden_size, rngs=rngs)
    self.mlp = nnx.Linear(hidden_size, hidden_size, rngs=rngs)
    self.lm_head = nnx.Linear(hidden_size, VOCAB, rngs=rngs)

  def __call__(self, input_ids, attention_mask, labels=None):
    x = self.embed(input_ids)
    mask = nnx.combine_masks(nnx.make_causal_mask(input_ids),
                             nnx.make_attention_mask(attention_mask, attention_mask))
    x = self.norm(x + self.attention(x, mask=mask))
    logits = self.lm_head(x + nnx.gelu(self.mlp(x)))
    if labels is None:
      return CausalLMOutput(None, logits)
    shifted, targets = logits[:, :-1], labels[:, 1:]
    valid = targets != -100
    losses = optax.softmax_cross_entropy_with_integer_labels(shifted, jnp.where(valid, targets, 0))
    return CausalLMOutput(jnp.sum(losses * valid) / jnp.maximum(jnp.sum(valid), 1), logits)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description="Finetune a causal LM (DeepSpeed-Chat step 1)")
  parser.add_argument("--per_device_train_batch_size", type=int, default=2)
  parser.add_argument("--learning_rate", type=float, default=1e-2)
  parser.add_argument("--weight_decay", type=float, default=0.0)
  parser.add_argument("--num_train_epochs", type=int, default=2)
  parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
  parser.add_argument("--num_warmup_steps", type=int, default=2)
  parser.add_argument("--zero_stage", type=int, default=3)
  parser.add_argument("--dtype", type=str, default="bf16", choices=["fp16", "bf16"])
  parser.add_argument("--local_rank", type=int, default=-1)
  parser = deepspeed.add_config_arguments(parser)
  return parser.parse_args(argv)


def get_train_ds_config(args: argparse.Namespace, global_batch_size: int) -> dict:
  """dschat.utils.ds_utils.get_train_ds_config's shape (no offload, no hybrid engine)."""
  return {
      "train_batch_size": global_batch_size,
      "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
      "steps_per_print": 10,
      "zero_optimization": {"stage": args.zero_stage,
                            "stage3_param_persistence_threshold": 1e4,
                            "stage3_max_live_parameters": 3e7,
                            "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
      args.dtype: {"enabled": True},
      "gradient_clipping": 1.0,
      "prescale_gradients": False,
      "wall_clock_breakdown": False,
  }


def _dataset(n: int, seq: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  start = rng.integers(0, VOCAB, size=(n, 1))
  ids = ((start + np.arange(seq)) % VOCAB).astype(np.int32)  # counting: learnable
  return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids.copy()}


def main(args: argparse.Namespace) -> dict:
  deepspeed.init_distributed()
  devices = jax.local_device_count()
  global_batch = args.per_device_train_batch_size * devices * args.gradient_accumulation_steps
  ds_config = get_train_ds_config(args, global_batch)
  model = TinyCausalLM(hidden_size=16, rngs=nnx.Rngs(0))
  train_data, eval_data = _dataset(4 * global_batch, 12, 0), _dataset(global_batch, 12, 1)
  batches = lambda data: ({k: v[i:i + global_batch] for k, v in data.items()}  # noqa: E731
                          for i in range(0, len(data["input_ids"]), global_batch))

  def evaluation(model, eval_batches):
    model.eval()
    losses, step = 0.0, 0
    for step, batch in enumerate(eval_batches):
      outputs = model(**batch)
      losses += float(outputs.loss)
    losses = losses / (step + 1)
    return math.exp(losses), losses

  num_update_steps_per_epoch = math.ceil(len(train_data["input_ids"]) / global_batch)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.learning_rate, args.num_warmup_steps,
      args.num_train_epochs * num_update_steps_per_epoch)
  decayed = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, _: not any(getattr(k, "key", None) in ("bias", "scale") for k in path), params)
  optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=0.9, b2=0.95,
                                                    weight_decay=args.weight_decay, mask=decayed)
  model, optimizer, _, lr_scheduler = deepspeed.initialize(
      model=model, optimizer=optimizer, args=args, config=ds_config, dist_init_required=True)

  perplexities = [evaluation(model, batches(eval_data))[0]]
  train_losses = []
  for epoch in range(args.num_train_epochs):
    model.train()
    for step, batch in enumerate(batches(train_data)):
      loss = model(**batch)
      model.backward(loss)
      model.step()
      train_losses.append(loss.item())
    perplexities.append(evaluation(model, batches(eval_data))[0])
  trained = model.module if model.global_rank == 0 else None  # save_hf_format's source
  return {"perplexities": perplexities, "train_losses": train_losses, "trained": trained,
          "lr_scheduler": lr_scheduler, "optimizer": optimizer, "global_steps": model.global_steps}
