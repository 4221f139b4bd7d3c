"""A user's own training script, run as one process of a job; not a test module itself.

Usage: python user_script_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Written the way a user writes it, with none of the suite's helpers: the script sets gloo and calls
``jax.distributed.initialize`` itself, with ``local_device_ids=[0]`` (one CPU device per process,
no ``jzero launch``); it builds its own NNX GPT (biases, learned positions, an untied head, blocks
stacked by ``nnx.vmap`` and run by ``jzero.scan_layers`` over ``nnx.split``), starts every run
from the same given weights (``engine.init(rng, params=...)``) and feeds the global batch through
``engine.shard_batch``. For ZeRO stages 3, 2 and 1 with the default persistence threshold, no
gradient clipping and AdamW with weight decay, it trains RUNS runs of STEPS steps; process 0 writes
each run's losses and final logical params to OUT_DIR/stage<S>_run<R>.npz.

The model is small, but its largest leaves (the MLP's [256, 1024] matrices) are 1 MiB: gloo's
reduce-scatter raced (:mod:`jzero.comm.collective_order`) when a send did not fit its socket's
buffer at once. Stage 3 runs first because a stage that ran after others raced less often (12
steps without the fix: stage 3 after stages 1 and 2 gave the same bits twice, stage 3 first did
not -- likely the connections' socket buffers, small at first, growing with the traffic).
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jzero  # noqa: E402

VOCAB, SEQ, D, LAYERS, HEADS = 512, 32, 256, 2, 4
BATCH, STEPS, RUNS = 8, 4, 2
STAGES = (3, 2, 1)


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
    self.proj = nnx.Linear(D, D, rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.fc = nnx.Linear(D, 4 * D, rngs=rngs)
    self.out = nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    heads = lambda y: y.reshape(b, t, HEADS, D // HEADS)
    att = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + self.proj(att.reshape(b, t, D))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  stacked_layers = ("blocks",)

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)) * 0.01)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(rngs)

    self.blocks = blocks(rngs)
    self.ln_f = nnx.LayerNorm(D, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    graphdef, stacked = nnx.split(self.blocks)
    x = jzero.scan_layers(lambda h, p: nnx.merge(graphdef, p)(h), x, stacked)
    return self.head(self.ln_f(x))


def loss_fn(model: GPT, batch: dict) -> jax.Array:
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def given_weights() -> dict:
  """The weights the script starts from, as numpy arrays (e.g. read from a file): the model's
  params tree, every leaf drawn from N(0, 0.02) except the LayerNorm scales, which are 1."""
  rng = np.random.default_rng(0)
  shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(nnx.Rngs(0))), nnx.Param))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: np.ones(x.shape, np.float32) if path[-1].key == "scale"
      else (0.02 * rng.standard_normal(x.shape)).astype(np.float32), shapes)


def config(stage: int) -> dict:
  return {
      "train_batch_size": BATCH,
      "gradient_clipping": 0.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
      "zero_optimization": {"stage": stage},
  }


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id, local_device_ids=[0])
  given = given_weights()
  data = np.random.default_rng(0).integers(0, VOCAB, (STEPS, BATCH, SEQ + 1), dtype=np.int32)
  for stage in STAGES:
    engine = jzero.initialize(lambda rngs: GPT(rngs), loss_fn, config(stage))
    for run in range(RUNS):
      state = engine.init(jax.random.key(0), params=given)
      losses = []
      for tokens in data:
        state, metrics = engine.train_step(state, engine.shard_batch({"tokens": tokens}))
        losses.append(float(metrics["loss"]))
      params = jax.tree.map(np.asarray, engine.logical_params(state))
      if process_id == 0:
        flat = {"/".join(str(k.key) for k in path): x
                for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(os.path.join(out, f"stage{stage}_run{run}.npz"), losses=np.array(losses), **flat)
  jax.distributed.shutdown()


if __name__ == "__main__":
  pid, nproc, port = map(int, sys.argv[1:4])
  main(pid, nproc, port, sys.argv[4])
