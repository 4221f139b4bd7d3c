"""What a tied weight costs under ZeRO-3: Hugging Face's Flax GPT-2, LM head tied or not.

``python bench/tied_weights.py [--layers 1] [--seq 64]`` compiles the train step of
``FlaxGPT2LMHeadModel`` at GPT-2 small's width and vocabulary (d 768, 50,257 tokens) for 8 devices
-- simulated CPU devices, and 8 compile-only H100s (XLA's GPU compiler without a GPU,
docs/planning.md "GPU plans without a GPU"; skipped without the gpu-aot extra) -- fp32,
micro-batch 1, every leaf partitioned (``stage3_param_persistence_threshold: 0``), and prints
XLA's ``memory_analysis()`` temp bytes of each:

* stage 0 (DDP), for scale;
* stage 3 with the LM head tied (the model's default: the head reads the embedding as
  ``variables["params"]["wte"]["embedding"].T``, a ZeroParam gathered for that use);
* stage 3 untied (``tie_word_embeddings=False``: the head is an ``nn.Dense`` unit of its own).

The difference between the two stage-3 rows is what the tie costs; the full embedding is printed
beside it. Needs ``transformers<5`` (Flax models).
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

from jzero.planning.aot import gpu_devices  # noqa: E402
from jzero.runtime import quiet_start  # noqa: E402
from jzero.sharding.mesh import MeshSpec  # noqa: E402

VOCAB, WIDTH = 50257, 768


def inputs(batch):
  ids = batch["input_ids"]
  return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)


def loss_fn(model, batch):
  logits = model(*inputs(batch)).logits
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["input_ids"][:, 1:]).mean()


def temp_mib(stage: int, tied: bool, layers: int, seq: int, gpu: bool) -> float:
  """Temp MiB of the compiled step (on 8 compile-only H100s with ``gpu``, abstractly)."""
  config = GPT2Config(vocab_size=VOCAB, n_positions=seq, n_embd=WIDTH, n_layer=layers,
                      n_head=12, tie_word_embeddings=tied)
  module = FlaxGPT2LMHeadModel(config, _do_init=False).module
  batch = {"input_ids": np.random.default_rng(0).integers(0, VOCAB, (8, seq)).astype(np.int32)}
  ds = {"train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
  mesh = MeshSpec.default().build(gpu_devices("h100", 8)) if gpu else None
  engine = jzero.initialize(module, loss_fn, ds, sample_batch=batch, init_inputs=inputs,
                            mesh=mesh)
  if gpu:
    state = engine.abstract_state(full=False)
    sharding = engine.batch_sharding()
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          batch)
    compiled = engine.jitted_step(placed).trace(state, placed).lower().compile()
  else:
    state = engine.init(jax.random.key(0))
    compiled = engine.compile_step(state, engine.shard_batch(batch))
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=1)
  parser.add_argument("--seq", type=int, default=64)
  args = parser.parse_args()
  targets = {"CPU": False}
  if quiet_start.cuda_plugin_installed():
    targets["H100 (compile-only)"] = True
  print(f"jax {jax.__version__}; FlaxGPT2LMHeadModel d {WIDTH}, vocab {VOCAB}, {args.layers} "
        f"layers, sequence {args.seq}, micro-batch 1, 8 devices, fp32; temp MiB per device of the "
        f"compiled step (XLA memory_analysis)")
  rows = {"stage 0 (DDP), tied": (0, True),
          "stage 3, tied (the head reads the embedding's ZeroParam)": (3, True),
          "stage 3, untied (the head is a unit of its own)": (3, False)}
  temps = {name: {target: temp_mib(stage, tied, args.layers, args.seq, gpu)
                  for target, gpu in targets.items()} for name, (stage, tied) in rows.items()}
  print("| configuration | " + " | ".join(f"{t} temp MiB" for t in targets) + " |")
  print("|---|" + "---|" * len(targets))
  for name, by_target in temps.items():
    print(f"| {name} | " + " | ".join(f"{by_target[t]:.1f}" for t in targets) + " |")
  full = VOCAB * WIDTH * 4 / 2**20
  for target in targets:
    tied, untied = (temps[name][target] for name in list(rows)[1:])
    print(f"{target}: the tie costs {tied - untied:+.1f} MiB at stage 3 "
          f"({(tied - untied) / full:.2f}x the full fp32 embedding, {full:.1f} MiB)")


if __name__ == "__main__":
  main()
