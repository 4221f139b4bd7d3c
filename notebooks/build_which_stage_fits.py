"""Writes notebooks/which_stage_fits.ipynb (run it, then execute the notebook to store its outputs:
``python notebooks/build_which_stage_fits.py``)."""

from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_build import execute_and_write

CELLS = [
    new_markdown_cell("""# Which ZeRO stage fits?

Each ZeRO stage partitions one more kind of model state over the data-parallel devices: stage 1 the
optimizer state, stage 2 the gradients too, stage 3 the parameters too; offload moves the optimizer
state (and with ZeRO-Infinity the parameters) off the device. This notebook answers the question
twice: with the **estimator** (the ZeRO paper's arithmetic, for any parameter count) and with the
**bytes a live engine holds** on 8 simulated CPU devices for the embedded GPT, each next to the
prediction. It runs top to bottom on a laptop CPU in well under a minute."""),
    new_code_cell("""import jzero

jzero.simulate_cpu_devices(8)  # before JAX starts: 8 CPU devices stand in for 8 GPUs

import jax
import matplotlib.pyplot as plt
from IPython.display import display

from jzero.memory import EstimateTable, estimate
from jzero.models import GPT, GPTConfig, lm_loss

%matplotlib inline"""),
    new_markdown_cell("""## A 7B model on 8 GPUs of 80 GB

fp16 / bf16 parameters and gradients (2 bytes each) and Adam with an fp32 master (K = 12 bytes per
parameter), per device. DDP needs 16 bytes per parameter on every device; each stage divides one
more term by N = 8. The dashed line is the GPU's memory less 10% headroom."""),
    new_code_cell("""budget = 0.9 * 80e9
table = EstimateTable(
    [estimate(7e9, stage, 8) for stage in range(4)]
    + [estimate(7e9, 3, 8, offload_optimizer="cpu"),
       estimate(7e9, 3, 8, offload_optimizer="cpu", offload_param="cpu")])
display(table)
table.plot(budget=budget)
plt.show()

fits = [r["configuration"] for r in table.to_records() if r["device_total"] <= budget]
print("fits in 72 GB:", ", ".join(fits))
totals = {r["configuration"]: r["device_total"] for r in table.to_records()}
assert totals["DDP (stage 0)"] == 112e9 and totals["ZeRO-3"] == 14e9  # the ZeRO paper's numbers
assert fits[0] == "ZeRO-1" and "DDP (stage 0)" not in fits"""),
    new_markdown_cell("""## The embedded GPT, measured

The same question for a model that really trains here: the default byte-level GPT (8 layers,
d 256, 6.4M parameters) in fp32 (no separate master: K = 8). For each stage the engine creates the
train state directly in its ZeRO placement; `engine.memory_report(state)` reads one device's bytes
from the live arrays' shards and sets the estimator's prediction beside them (stage 3 keeps the
small leaves replicated: the persistence threshold)."""),
    new_code_cell("""def engine_for(stage):
    config = {"train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}}
    return jzero.initialize(lambda rngs: GPT(GPTConfig(), rngs=rngs), lm_loss, config)

reports = {}
for stage in range(4):
    engine = engine_for(stage)
    reports[stage] = engine.memory_report(engine.init(jax.random.key(0)))
display(reports[3])

fig, ax = plt.subplots(figsize=(7, 3.4))
categories = ["params", "grads", "optimizer"]
for i, category in enumerate(categories):
    measured = [reports[s].measured_bytes(category) / 1e6 for s in range(4)]
    predicted = [reports[s].predicted_bytes(category) / 1e6 for s in range(4)]
    xs = [s + (i - 1) * 0.27 for s in range(4)]
    ax.bar(xs, measured, 0.25, label=f"{category} (measured)")
    ax.scatter(xs, predicted, color="k", marker="_", s=200, zorder=3,
               label="predicted" if i == 0 else None)
ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
ax.set_ylabel("MB per device")
ax.set_title("default GPT, fp32, 8 devices: live bytes vs the estimator")
ax.legend(fontsize="small")
plt.show()

for stage, report in reports.items():
    print(f"stage {stage}: {report.measured_bytes() / 1e6:6.2f} MB measured, "
          f"{report.predicted_bytes() / 1e6:6.2f} MB predicted (ratio {report.ratio():.4f})")
    assert abs(report.ratio() - 1) < 0.02  # Adam's int32 step counters and padding
assert reports[3].measured_bytes() < reports[0].measured_bytes() / 5"""),
    new_markdown_cell("""## What the GPU compiler says

For a real GPU, `jzero aot --config configs/zero3.json --gpu h100 --devices 8 --model 7b
--precision bf16` compiles the actual train step with XLA's CUDA compiler on a machine without a
GPU and prints XLA's own `memory_analysis()` next to these model-state bytes (README, "GPU plans
without a GPU"). It is not run here: that compile takes minutes."""),
]


if __name__ == "__main__":
  execute_and_write(CELLS, "which_stage_fits")
