"""Writes notebooks/which_stage_fits.ipynb (run it, then execute the notebook to store its outputs:
``python notebooks/build_which_stage_fits.py``)."""

from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_build import HERE, execute_and_write

RECORD = (HERE / "data" / "aot_7b_h100.json").read_text().strip()  # a compile for 8 x H100

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

from jzero.analysis.estimate import EstimateTable, estimate
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

The estimator counts model states; a GPU also needs room for the step's temporaries (the gathered
layers, activations kept for the backward, the gradients while they are reduced). XLA's CUDA
compiler says how much, for the real train step of a 7B GPT (bf16, fp32 master, AdamW,
micro-batch 1 x 2048 tokens, activation checkpointing) on 8 x H100, compiled on a machine
without a GPU by `jzero.planning.aot.compile_for` (docs/planning.md). Compiling
four stages takes minutes on a fresh machine, so this notebook plots a **committed record** of that
compile, `notebooks/data/aot_7b_h100.json` (written by `python bench/aot_7b.py --record
notebooks/data/aot_7b_h100.json`, the gpu-aot extra; copied into the cell below when the notebook
is built, so that it runs from any directory); its first line says when and with which jax. Bars:
XLA's arguments (the state that lives between steps) and temp (the step's temporaries) per device;
the black marks are the estimator's model states for the same Psi; the dashed line is the memory
JAX preallocates (75% of the part's)."""),
    new_code_cell("import json\n\n"
                  f'record = json.loads("""\n{RECORD}\n""")\n'  # (no backslash, no triple quote)
                  """print("record:", record["source"])
stages = record["stages"]
for row in stages:  # the estimator at this Psi against the plan the compiler was given
    predicted = estimate(record["num_params"], row["stage"], record["devices"]).model_states
    excess = row["model_states"] / predicted - 1
    if row["stage"] < 3:
        assert abs(excess) < 1e-9, row  # Adam's step counters: 8 bytes
    else:  # stage 3 keeps small leaves (the norms) whole on every device: 0.02% more
        assert 0 < excess < 1e-3, row
    assert row["peak"] >= row["argument"] and row["fits"] == (row["peak"] <= record["usable_memory"])

fig, ax = plt.subplots(figsize=(7, 3.4))
xs = [row["stage"] for row in stages]
arguments = [row["argument"] / 1e9 for row in stages]
temps = [(row["peak"] - row["argument"]) / 1e9 for row in stages]
ax.bar(xs, arguments, 0.5, label="XLA arguments (live state)")
ax.bar(xs, temps, 0.5, bottom=arguments, label="XLA temp (the step's temporaries)")
ax.scatter(xs, [row["model_states"] / 1e9 for row in stages], color="k", marker="_", s=300,
           zorder=3, label="estimator: model states")
ax.axhline(record["usable_memory"] / 1e9, color="r", linestyle="--", label=f"usable: {record['usable_memory'] / 1e9:.1f} GB")
ax.set_xticks(xs, [f"stage {s}" for s in xs])
ax.set_ylabel("GB per device")
ax.set_title("7B on 8 x H100: XLA's memory_analysis() (committed record)")
ax.legend(fontsize="small")
plt.show()

for row in stages:
    print(f"stage {row['stage']}: peak {row['peak'] / 1e9:6.2f} GB = arguments "
          f"{row['argument'] / 1e9:6.2f} + temp {(row['peak'] - row['argument']) / 1e9:5.2f}; "
          f"{'fits' if row['fits'] else 'does not fit'}")
assert [row["fits"] for row in stages] == [False, True, True, True]"""),
]


if __name__ == "__main__":
  execute_and_write(CELLS, "which_stage_fits")
