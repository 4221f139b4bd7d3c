"""Writes notebooks/same_loss.ipynb and stores its outputs: ``python notebooks/build_same_loss.py``."""

from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_build import execute_and_write

CELLS = [
    new_markdown_cell("""# The stages give the same loss

ZeRO changes where model states live and which collectives move them, not the math: in fp32
every stage must train exactly like plain data parallelism (stage 0), to float rounding. ZeRO++'s
quantized collectives (qwZ: int8 weights, qgZ: int4 gradients) round on purpose and may move
the curve a little; hpZ only adds a secondary copy, so it is exact. Offloading the optimizer to
host memory is exact; ZeRO-Offload's *delayed* parameter update changes the math by one step, on
purpose. This notebook trains a small GPT for 12 steps each way on 8 simulated devices
(2 nodes x 4 for ZeRO++) and plots the loss curves and their distance from stage 0."""),
    new_code_cell("""import jzero

jzero.simulate_cpu_devices(8)

import warnings

import jax
import matplotlib.pyplot as plt
import numpy as np

from jzero.models import GPT, GPTConfig, lm_loss
from jzero.runtime.data import ByteCorpus

%matplotlib inline
# the delayed update in fp32 warns that a non-finite gradient would not be skipped: known here
warnings.filterwarnings("ignore", message="offload_optimizer.delayed_update in fp32")

MODEL = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)
STEPS, BATCH = 12, 8
NODE2X4 = jzero.MeshSpec.from_dict({"axes": {"node": 2, "local": 4}, "zero_axes": ["node", "local"],
                                    "batch_axes": ["node", "local"]})  # configs/mesh/node2x4.yaml
corpus = ByteCorpus.load(None, seq_len=MODEL.seq_len, max_bytes=1 << 18)
data = [corpus.batch(i, BATCH) for i in range(STEPS)]

def train(zero, mesh=None):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero}}
    engine = jzero.initialize(lambda rngs: GPT(MODEL, rngs=rngs), lm_loss, config, mesh=mesh)
    state, losses = engine.init(jax.random.key(0)), []
    for batch in data:
        state, metrics = engine.train_step(state, engine.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    return np.array(losses)"""),
    new_code_cell("""runs = {f"stage {s}": train({"stage": s}) for s in range(4)}
runs["stage 2 + optimizer offload"] = train({"stage": 2, "offload_optimizer": {"device": "cpu"}})
runs["stage 2 + delayed update"] = train(
    {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_update": True}})
for name, extra in {"hpZ": {"zero_hpz_partition_size": 4},
                    "qwZ": {"zero_quantized_weights": True},
                    "qgZ": {"zero_quantized_gradients": True},
                    "ZeRO++ (all three)": {"zero_hpz_partition_size": 4,
                                           "zero_quantized_weights": True,
                                           "zero_quantized_gradients": True}}.items():
    runs[name] = train({"stage": 3, **extra}, mesh=NODE2X4)
"""),
    new_code_cell("""base = runs["stage 0"]
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for name, losses in runs.items():
    left.plot(range(1, STEPS + 1), losses, label=name, linewidth=1)
    diff = np.abs(losses - base) / base
    right.semilogy(range(1, STEPS + 1), np.maximum(diff, 1e-9), label=name, linewidth=1)
left.set(xlabel="step", ylabel="loss", title="loss curves")
right.axhline(1e-6, color="k", linestyle=":", label="1e-6 (float rounding)")
right.set(xlabel="step", ylabel="|loss - stage 0| / stage 0 (floor 1e-9)",
          title="distance from stage 0")
right.legend(fontsize="x-small", ncol=2)
plt.tight_layout()
plt.show()

gap = {name: float(np.max(np.abs(losses - base) / base)) for name, losses in runs.items()}
for name, g in gap.items():
    print(f"{name:28s} max relative distance from stage 0: {g:.1e}")
exact = ["stage 1", "stage 2", "stage 3", "stage 2 + optimizer offload", "hpZ"]
assert all(gap[name] <= 1e-6 for name in exact)         # the same math, to float rounding
assert all(0 < gap[name] <= 0.02 for name in ("qwZ", "qgZ", "ZeRO++ (all three)"))
assert gap["stage 2 + delayed update"] > 1e-3           # one step late, on purpose
assert all(losses[-1] < losses[0] for losses in runs.values())"""),
    new_markdown_cell("""What the numbers say: stages 1-3, optimizer offload and hpZ stay within 1e-6 of stage 0
(the order of one sum over 8 devices and XLA's fusions are the only differences); qwZ and qgZ
move the curve by their quantization step, well inside 2%; the delayed update is a different
trajectory, one step behind, which still trains. (At a learning rate of 3e-3 instead of 1e-3,
qgZ's int4 gradients gave this model one bad step -- the loss jumped from 3.48 to 6.06 at step 11
and recovered by step 12 -- while stage 3 went on smoothly: int4 gradients are coarse, which is
why ZeRO++ reduces them in two hops with fine blocks.) The suite checks the same properties with
tighter, reasoned bounds (tests/train/test_engine.py, tests/comm/test_zeropp.py,
tests/tiers/test_delayed_update.py)."""),
]


if __name__ == "__main__":
  execute_and_write(CELLS, "same_loss")
