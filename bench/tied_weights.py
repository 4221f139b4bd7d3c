"""What a tied weight costs under ZeRO-3: Hugging Face's Flax GPT-2, LM head tied or not.

``python bench/tied_weights.py [--layers 2] [--seq 128]`` compiles the train step of
``FlaxGPT2LMHeadModel`` at GPT-2 small's width and vocabulary (d 768, 50,257 tokens) on 8
simulated CPU devices, fp32, micro-batch 1, every leaf partitioned
(``stage3_param_persistence_threshold: 0``), and prints XLA's ``memory_analysis()`` temp bytes:

* stage 0 (DDP), for scale;
* stage 3 with the LM head tied (the model's default: the head reads the embedding as
  ``variables["params"]["wte"]["embedding"].T``, a ZeroParam gathered for that use);
* stage 3 untied (``tie_word_embeddings=False``: the head is an ``nn.Dense`` unit of its own).

The difference between the two stage-3 rows is what the tie costs: the head's gathered copy of
the embedding is a value of the forward pass that its matmul keeps for backward, where an untied
head's unit gathers its kernel again. The full embedding is printed beside it. Needs
``transformers<5`` (Flax models).
"""

from __future__ import annotations

import argparse

import jzero

jzero.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from transformers import FlaxGPT2LMHeadModel, GPT2Config  # noqa: E402

VOCAB, WIDTH = 50257, 768


def inputs(batch):
  ids = batch["input_ids"]
  return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)


def loss_fn(model, batch):
  logits = model(*inputs(batch)).logits
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["input_ids"][:, 1:]).mean()


def temp_mib(stage: int, tied: bool, layers: int, seq: int) -> float:
  config = GPT2Config(vocab_size=VOCAB, n_positions=seq, n_embd=WIDTH, n_layer=layers,
                      n_head=12, tie_word_embeddings=tied)
  module = FlaxGPT2LMHeadModel(config, _do_init=False).module
  batch = {"input_ids": np.random.default_rng(0).integers(0, VOCAB, (8, seq)).astype(np.int32)}
  ds = {"train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
  engine = jzero.initialize(module, loss_fn, ds, sample_batch=batch, init_inputs=inputs)
  state = engine.init(jax.random.key(0))
  compiled = engine.compile_step(state, engine.shard_batch(batch))
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--seq", type=int, default=128)
  args = parser.parse_args()
  print(f"jax {jax.__version__}; FlaxGPT2LMHeadModel d {WIDTH}, vocab {VOCAB}, {args.layers} "
        f"layers, sequence {args.seq}, micro-batch 1, 8 devices, fp32; temp MiB per device of the "
        f"compiled step (XLA memory_analysis)")
  rows = {"stage 0 (DDP), tied": temp_mib(0, True, args.layers, args.seq),
          "stage 3, tied (head reads the embedding's ZeroParam)":
              temp_mib(3, True, args.layers, args.seq),
          "stage 3, untied (head is its own unit)": temp_mib(3, False, args.layers, args.seq)}
  print("| configuration | temp MiB |")
  print("|---|---|")
  for name, mib in rows.items():
    print(f"| {name} | {mib:.1f} |")
  tied, untied = list(rows.values())[1:]
  full = VOCAB * WIDTH * 4 / 2**20
  print(f"the tie costs {tied - untied:+.1f} MiB at stage 3 ({(tied - untied) / full:.2f}x the "
        f"full fp32 embedding, {full:.1f} MiB)")


if __name__ == "__main__":
  main()
