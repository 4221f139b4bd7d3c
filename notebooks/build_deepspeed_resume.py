"""Writes notebooks/deepspeed_resume.ipynb and stores its outputs:
``python notebooks/build_deepspeed_resume.py``."""

from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_build import execute_and_write

CELLS = [
    new_markdown_cell("""# Resuming a DeepSpeed run in jzero

A team moving from DeepSpeed has checkpoints with weeks of Adam moments, a step count and an LR
schedule's position. jzero reads them without torch (an allow-listed unpickler: no code from the
file runs), gathers DeepSpeed's ZeRO partitions into named tensors, and places them in its own
ZeRO plan -- any stage, any device count -- so the run goes on where DeepSpeed stopped.

The checkpoints here were written by DeepSpeed 0.19.8 itself (2 ranks, CPU), after 5 steps of a
tiny torch GPT-2; DeepSpeed then went on to step 10 and logged its losses
(`tests/data/deepspeed/README.md` in the repository). We resume the ZeRO-2 fp32 and ZeRO-3 bf16
runs with jzero's ZeRO-3 on 8 devices and compare steps 6-10.

The checkpoints are read from the repository that jzero is installed from (`pip install -e .` in
a checkout), wherever this notebook runs."""),
    new_code_cell("""import jzero

jzero.simulate_cpu_devices(8)

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

%matplotlib inline
# the tests/data of the checkout jzero is installed from (pip install -e .), from any folder
DATA = Path(jzero.__file__).resolve().parents[1] / "tests" / "data" / "deepspeed"
assert DATA.is_dir(), (f"{DATA} is missing: this notebook reads the DeepSpeed checkpoints of a "
                       f"jzero checkout; install jzero from one (pip install -e .)")"""),
    new_markdown_cell("""**The model in Flax.** The torch model (pre-LN GPT-2, tanh GELU, an untied
head without bias) rewritten with NNX modules whose names follow torch's."""),
    new_code_cell("""class Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads)  # torch's view
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.reshape(b, t, d))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))


class TorchGPT(nnx.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, seq_len, rngs):
        self.wte = nnx.Embed(vocab, d_model, rngs=rngs)
        self.wpe = nnx.Embed(seq_len, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, n_heads, rngs) for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d_model, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()"""),
    new_markdown_cell("""**The mapping.** `convert` turns `{torch name: array}` into the model's
params tree: a Linear's `weight` [out, in] is a Flax `kernel` [in, out], a LayerNorm's `weight`
its `scale`. jzero applies it to the fp32 master and to both Adam moments alike."""),
    new_code_cell("""def convert(named):
    def linear(name, bias=True):
        kernel = {"kernel": named[f"{name}.weight"].T}
        return {**kernel, "bias": named[f"{name}.bias"]} if bias else kernel

    def norm(name):
        return {"scale": named[f"{name}.weight"], "bias": named[f"{name}.bias"]}

    layers = 1 + max(int(k.split(".")[1]) for k in named if k.startswith("blocks."))
    return {"wte": {"embedding": named["wte.weight"]}, "wpe": {"embedding": named["wpe.weight"]},
            "blocks": {i: {part: (norm if part.startswith("ln") else linear)(f"blocks.{i}.{part}")
                           for part in ("ln1", "qkv", "proj", "ln2", "fc", "out")}
                       for i in range(layers)},
            "ln_f": norm("ln_f"), "head": linear("head", bias=False)}"""),
    new_markdown_cell("""**Read, place, continue.** The jzero config is the DeepSpeed run's
(`ds_config.json`: its WarmupLR, clipping, precision) with its client `torch.optim.AdamW` written
as an optimizer block.
`read_deepspeed` gives the named tensors and the position; `engine.import_deepspeed` places them
in jzero's ZeRO-3 plan on 8 devices (DeepSpeed had 2 ranks)."""),
    new_code_cell("""def resume(name, stage=3):
    ds_config = json.loads((DATA / name / "ds_config.json").read_text())
    m = json.loads((DATA / name / "model.json").read_text())
    config = {"train_batch_size": 8, "gradient_clipping": ds_config["gradient_clipping"],
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                        "eps": 1e-8, "weight_decay": 0.1}},
              "scheduler": ds_config["scheduler"], "zero_optimization": {"stage": stage},
              "bf16": ds_config.get("bf16", {"enabled": False})}
    engine = jzero.initialize(lambda rngs: TorchGPT(m["vocab"], m["d_model"], m["n_layers"],
                                                    m["n_heads"], m["seq_len"], rngs),
                              loss_fn, config)
    ds = jzero.checkpoint.read_deepspeed(DATA / name / "checkpoint")
    print(f"{name}: ZeRO-{ds.zero_stage} on {ds.world_size} ranks, {ds.dtype}, step {ds.step}, "
          f"{ds.optimizer}, scheduler {ds.lr_scheduler}, client state {ds.client_state}")
    state = engine.import_deepspeed(ds, convert)
    batches = np.load(DATA / name / "batches.npz")
    losses = []
    for step in range(ds.step, 10):  # DeepSpeed's global batches of steps 6..10
        batch = {k: batches[k][step].astype(np.int32) for k in ("inputs", "targets")}
        state, metrics = engine.train_step(state, engine.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    lines = (DATA / name / "losses.jsonl").read_text().splitlines()
    deepspeed = [json.loads(line)["loss"] for line in lines]
    return np.array(deepspeed), np.array(losses)

runs = {name: resume(name) for name in ("zero2_fp32_w2", "zero3_bf16_w2")}"""),
    new_code_cell("""fp32_deepspeed, fp32_ours = runs["zero2_fp32_w2"]
bf16_deepspeed, bf16_ours = runs["zero3_bf16_w2"]
# bf16: at steps 1-3 every run evaluates the initial weights (WarmupLR's lr is 0 for steps 1-2),
# so there DeepSpeed's bf16 losses differ from its fp32 ones by bf16's error of the loss alone;
# two bf16 runs, each carrying that error, may differ by twice it
bf16_error = np.max(np.abs(bf16_deepspeed[:3] - fp32_deepspeed[:3]))
bounds = {"zero2_fp32_w2": 2e-5 * np.ones(5), "zero3_bf16_w2": 2 * bf16_error / bf16_deepspeed[5:]}

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for (name, (deepspeed, ours)), color in zip(runs.items(), ("C0", "C1")):
    left.plot(range(1, 11), deepspeed, "o-", color=color, label=f"DeepSpeed {name}")
    left.plot(range(6, 11), ours, "x--", color=color, markersize=10,
              label="jzero ZeRO-3 on 8 devices, from DeepSpeed's step 5")
    distance = np.abs(ours - deepspeed[5:]) / deepspeed[5:]
    right.semilogy(range(6, 11), np.maximum(distance, 1e-9), "o-", color=color, label=name)
    right.semilogy(range(6, 11), bounds[name], ":", color=color, label=f"bound, {name}")
left.axvline(5.5, color="k", linestyle=":", linewidth=1)
left.set(xlabel="step", ylabel="loss", title="DeepSpeed's run and jzero's continuation")
left.legend(fontsize="small")
right.set(xlabel="step", ylabel="|jzero - DeepSpeed| / DeepSpeed (floor 1e-9)",
          title="distance from DeepSpeed's losses")
right.legend(fontsize="small")
plt.tight_layout()
plt.show()

print(f"DeepSpeed's bf16 error of the loss at the same weights: {bf16_error:.4f}")
for name, (deepspeed, ours) in runs.items():
    gap = np.abs(ours - deepspeed[5:])
    print(f"{name}: max relative distance {np.max(gap / deepspeed[5:]):.1e}, "
          f"absolute {np.max(gap):.1e}")
assert np.allclose(fp32_ours, fp32_deepspeed[5:], rtol=2e-5, atol=0)
assert np.allclose(bf16_ours, bf16_deepspeed[5:], rtol=0, atol=2 * bf16_error)"""),
    new_markdown_cell("""In fp32 jzero continues DeepSpeed's run to float rounding (a few 1e-7:
another framework's kernels, another sharding -- 8 devices instead of 2 ranks, ZeRO-3 instead of
ZeRO-2). In bf16, DeepSpeed's reported losses are averages of bf16 numbers computed from bf16
logits: at steps 1-3, where every run evaluates the same initial weights, they sit up to 0.017
from the fp32 run's -- bf16's own error of the loss, about 2^-8 relative -- so two bf16 runs may
differ by twice that. jzero's bf16 continuation is 0.017 from DeepSpeed's (its loss is computed in
fp32 from bf16 activations: it lies about 1e-4 (relative) from DeepSpeed's fp32 run).
`tests/checkpoint/test_deepspeed_checkpoint.py` checks every shared checkpoint at ZeRO stages 1, 2 and 3 on
2 and 8 devices, the master bit for bit against DeepSpeed's own `zero_to_fp32`, and a crafted
`.pt` that would run `os.system` (refused by name, nothing run). From here,
`engine.save_checkpoint(state, dir)` writes a jzero checkpoint."""),
]


if __name__ == "__main__":
  execute_and_write(CELLS, "deepspeed_resume")
