"""Writes notebooks/where_everything_lives.ipynb and stores its outputs:
``python notebooks/build_where_everything_lives.py``."""

from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_build import execute_and_write

CELLS = [
    new_markdown_cell("""# Where does everything live when I offload?

ZeRO-Offload and ZeRO-Infinity move model states off the accelerator. Three switches in
`zero_optimization` control this:

* `offload_optimizer: {"device": "cpu"}` puts the fp32 master weights and the optimizer state
  (Adam's two moments) in host memory. For the config's Adam or AdamW it runs DeepSpeed's
  schedule: each gradient partition leaves the device as the backward pass produces it, Adam
  runs on the host's cores over numpy arrays, and the new 16-bit parameters are uploaded
  (`update: cpu_adam`); with a client optax optimizer, or parameters on NVMe, the state lives in
  pinned host memory arrays of the train state and is updated on the device (`update: stream`);
* `offload_param: {"device": "cpu"}` (stage 3 only) puts the partitioned compute parameters
  there too, and brings them to the device one layer or unit at a time for their gathers;
* `offload_optimizer: {"device": "nvme", "nvme_path": ...}` puts master and moments in files on a
  disk (the NVMe tier), and `offload_param: {"device": "nvme", ...}` (stage 3, ZeRO-Infinity) the
  partitioned parameters too: each layer's partitions are read from the files inside the step,
  through a host cache of `max_in_cpu` elements. With `offload_optimizer: {"device": "cpu"}`
  beside it (ZeRO-Infinity's headline config) master and moments stay in pinned host memory and
  the files hold a copy of each parameter.

This notebook answers the question for a small MLP in bf16 with ZeRO stage 3 on 8 simulated CPU
devices. It shows where each leaf lives (the engine's plan, next to the memory kind of the live
arrays), how many bytes each tier holds per device (the memory report), and what each mode costs
per step on this machine. The NVMe tier writes to a temporary directory that is removed at the
end."""),
    new_code_cell("""import jzero

jzero.simulate_cpu_devices(8)  # before JAX starts: 8 CPU devices stand in for 8 GPUs

import dataclasses
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from IPython.display import display

from jzero.analysis.tables import Table
from jzero.sharding.plan import flatten_paths

%matplotlib inline

class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(64, 256, rngs=rngs)
        self.down = nnx.Linear(256, 64, rngs=rngs)
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.gelu(self.down(jax.nn.gelu(self.up(x)))))

def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

rng = np.random.default_rng(0)
data = [{"x": rng.normal(size=(32, 64)).astype(np.float32),
         "y": rng.normal(size=(32, 8)).astype(np.float32)} for _ in range(7)]
nvme_dir = tempfile.TemporaryDirectory()  # stands in for an NVMe drive's mount point"""),
    new_markdown_cell("""## Six engines

The same model and config six ways. `stage3_param_persistence_threshold: 1000` keeps the leaves
under 1,000 elements (the biases and the 64 x 8 head) whole on every device, as DeepSpeed does,
so stage 3 partitions only the two 64 x 256 matrices over the 8 devices. Each engine trains two
steps (the first one compiles), then five timed steps."""),
    new_code_cell("""MODES = {
    "no offload": {},
    "optimizer -> cpu": {"offload_optimizer": {"device": "cpu"}},
    "params + optimizer -> cpu": {"offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}},
    "optimizer -> nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir.name}},
    # ZeRO-Infinity's headline config: optimizer state on the host, parameters on NVMe (the
    # store holds an fp32 copy of each, written after every step)
    "params -> nvme, optimizer -> cpu": {"offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": nvme_dir.name, "max_in_cpu": 0}},
    # max_in_cpu 0: no host cache, every layer read from the files
    "params + optimizer -> nvme": {
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir.name},
        "offload_param": {"device": "nvme", "nvme_path": nvme_dir.name, "max_in_cpu": 0}},
}
engines, states, step_times = {}, {}, {}
for name, offload in MODES.items():
    config = {"train_batch_size": 32, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                                    **offload}}
    engine = jzero.initialize(MLP, loss_fn, config)
    state = engine.init(jax.random.key(0))
    batches = [engine.shard_batch(b) for b in data]
    for batch in batches[:2]:  # the first step compiles; the second is the first warm one
        state, metrics = engine.train_step(state, batch)
    times = []
    for batch in batches[2:]:
        start = time.perf_counter()
        state, metrics = engine.train_step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    engines[name], states[name], step_times[name] = engine, state, times
    print(f"{name:32s} loss {float(metrics['loss']):.4f}")"""),
    new_markdown_cell("""## Each leaf's tier

The plan gives every leaf a `param_tier` (where its compute parameter lives between steps) and a
`state_tier` (where its fp32 master and optimizer moments live). Each tier is checked against the
live arrays' `sharding.memory_kind`. JAX calls device memory `device` and page-locked host memory
`pinned_host`. A leaf whose state the host Adam updates (`host_step`) or the NVMe tier stores
keeps only a 0-byte placeholder in the train state (the same tree, with its shard dimension of
size 0): its numbers are in the host Adam's numpy arrays, or in the store's files.

On this machine the "device" is the CPU too, so device and pinned host memory are the same RAM
under two names. On a GPU they are HBM and the host's DRAM, across PCIe."""),
    new_code_cell("""def live_kinds(engine, state):
    \"\"\"Per leaf path: the memory kinds of its compute param, fp32 master and Adam moments
    (a 0-byte array is a placeholder: its bytes are on the NVMe tier).\"\"\"
    params, master = flatten_paths(state.params), flatten_paths(state.master)
    moments = flatten_paths(state.opt_state)
    def kind(x):
        return "0-byte placeholder" if x.size == 0 else x.sharding.memory_kind or "device"
    out = {}
    for leaf in engine.plan.leaf_list():
        state_arrays = [master[leaf.path]] + [x for p, x in moments.items()
                                              if p.endswith("/" + leaf.path)]
        assert len(state_arrays) == 3  # master, Adam's mu and nu
        out[leaf.path] = kind(params[leaf.path]), {kind(x) for x in state_arrays}
    return out

rows = []
SHOWN = ("params + optimizer -> cpu", "params -> nvme, optimizer -> cpu", "params + optimizer -> nvme")
kinds = {name: live_kinds(engines[name], states[name]) for name in MODES}
for leaf in engines["no offload"].plan.leaf_list():
    row = [leaf.path, "x".join(map(str, leaf.shape)),
           "partitioned" if leaf.param_partitioned else "whole (persistent)"]
    for name in SHOWN:
        plan_leaf = next(l for l in engines[name].plan.leaf_list() if l.path == leaf.path)
        param_kind, state_kind = kinds[name][leaf.path]
        row += [f"{plan_leaf.param_tier} ({param_kind})",
                f"{plan_leaf.state_tier} ({', '.join(sorted(state_kind))})"]
    rows.append(row)
display(Table(["leaf", "shape", "stage 3",
               "params+opt->cpu: param", "params+opt->cpu: master, moments",
               "params->nvme: param", "params->nvme: master, moments",
               "params+opt->nvme: param", "params+opt->nvme: master, moments"], rows,
              caption="plan tier (live memory kind), per leaf"))

# the tiers, checked against the live arrays
for name in MODES:
    for leaf in engines[name].plan.leaf_list():
        param_kind, state_kind = kinds[name][leaf.path]
        param_tier = {"params + optimizer -> cpu": "host", "params + optimizer -> nvme": "nvme",
                      "params -> nvme, optimizer -> cpu": "nvme"}.get(name, "device") if leaf.param_partitioned else "device"
        assert leaf.param_tier == param_tier
        assert param_kind == {"host": "pinned_host", "nvme": "0-byte placeholder"
                              }.get(param_tier, "device")
        expected_state = {"no offload": ("device", "device"),
                          "optimizer -> cpu": ("host_step", "0-byte placeholder"),
                          "params + optimizer -> cpu": ("host_step", "0-byte placeholder"),
                          "params -> nvme, optimizer -> cpu": ("host", "pinned_host")
                          }.get(name, ("nvme", "0-byte placeholder"))
        assert (leaf.state_tier, state_kind) == (expected_state[0], {expected_state[1]})
print("every leaf is where its plan says, in every mode")"""),
    new_markdown_cell("""## Bytes per tier

`engine.memory_report(state)` counts one device's bytes from the live arrays' shards by memory
kind, and the NVMe bytes from the store's files on disk. The gradient buffer exists only inside
the compiled step, so it is counted from the plan. Next to the measurement it sets the
estimator's prediction.

The expected figures follow from ZeRO's arithmetic. Ψ is the parameter count, and no leaf needs
padding because every dimension here is a multiple of 8. Stage 3 splits the fp32 master (4 bytes
per parameter), Adam's two fp32 moments (8 bytes) and the bf16 gradients (2 bytes) over the N = 8
devices. It splits the bf16 parameters too (2 bytes), except the persistent leaves, which every
device holds whole. Offloading moves those bytes between tiers without changing their number --
except the host Adam's (the two `-> cpu` optimizer modes without NVMe params): its gradients leave
the device in the backward pass, so the report counts them where the step has them, in flight on
the device (a leaf outside a layer stack, as every leaf of this MLP is, whole: its matmul's
backward produces it so) and its reduced partition in pinned host memory; and the host writes
each new bf16 partition into a buffer of its own (host memory, 2 bytes per parameter / N) for the
upload."""),
    new_code_cell("""reports = {name: engines[name].memory_report(states[name]) for name in MODES}
display(reports["params + optimizer -> cpu"])

plan = engines["no offload"].plan
leaves = plan.leaf_list()
assert all(leaf.padded_shape == leaf.shape for leaf in leaves)  # no padding: multiples of 8
n = engines["no offload"].mesh.zero_size
psi = sum(leaf.numel for leaf in leaves)
persistent = sum(leaf.numel for leaf in leaves if not leaf.param_partitioned)
partitioned = psi - persistent
print(f"N = {n} devices, Psi = {psi:,} parameters: {partitioned:,} partitioned, "
      f"{persistent:,} persistent")

def expected(name):
    \"\"\"Bytes per device by category and memory kind, from the arithmetic above.\"\"\"
    # the host Adam's numpy arrays are pageable host memory (unpinned_host)
    state_kind = {"no offload": "device", "optimizer -> cpu": "unpinned_host",
                  "params + optimizer -> cpu": "unpinned_host",
                  "params -> nvme, optimizer -> cpu": "pinned_host"}.get(name, "nvme")
    params = {"params + optimizer -> cpu": {"device": 2 * persistent,
                                            "pinned_host": 2 * partitioned // n},
              # on NVMe beside its state the parameter is its fp32 master (counted there); with
              # the state on the host the store holds an fp32 copy of it; no host cache here
              "params + optimizer -> nvme": {"device": 2 * persistent},
              "params -> nvme, optimizer -> cpu": {"device": 2 * persistent, "nvme": 4 * partitioned // n}
              }.get(name, {"device": 2 * persistent + 2 * partitioned // n})
    counts = sum(x.nbytes for x in jax.tree.leaves(states[name].opt_state) if x.ndim == 0)
    optimizer = {state_kind: 8 * psi // n}
    optimizer["device"] = optimizer.get("device", 0) + counts  # Adam's step count: on the device
    grads = {"device": 2 * psi // n}
    if state_kind == "unpinned_host":  # the host Adam (above)
        grads = {"device": 2 * psi, "pinned_host": 2 * psi // n}
        params = {**params, "unpinned_host": 2 * psi // n}
    return {"params": params, "grads": grads, "master": {state_kind: 4 * psi // n},
            "optimizer": optimizer}

def nonzero(measured):  # drops the NVMe placeholders' 0 bytes on the device
    return {c: {k: v for k, v in kinds.items() if v} for c, kinds in measured.items()}

for name, report in reports.items():
    assert nonzero(report.measured) == expected(name), (name, report.measured, expected(name))
    # the partitioned bf16 params: none with their NVMe masters, an fp32 copy with the state on
    # the host
    extra = {"params + optimizer -> nvme": -2, "params -> nvme, optimizer -> cpu": 2}.get(name, 0) * partitioned // n
    if expected(name)["grads"].get("pinned_host"):  # the host Adam: gradients in flight, buffers
        extra += 2 * psi - 2 * psi // n + 2 * psi // n + 2 * psi // n
    assert report.measured_bytes() == reports["no offload"].measured_bytes() + extra
print("bytes per category and tier as the arithmetic says, in every mode; the same total in all "
      "but the two with parameters on NVMe (no bf16 copy beside the masters, or an fp32 copy) "
      "and the host Adam's two (gradients in flight, upload buffers)")

tiers = [("device", "device", "tab:blue"), ("pinned_host", "pinned host", "tab:orange"),
         ("unpinned_host", "host (numpy)", "tab:purple"), ("nvme", "NVMe (files)", "tab:green")]
rows = []
for name, report in reports.items():
    per_tier = {kind: sum(report.measured[c].get(kind, 0) for c in report.categories)
                for kind, _, _ in tiers}
    rows.append([name] + [f"{per_tier[kind]:,} B" for kind, _, _ in tiers]
                + [f"{report.measured_bytes():,} B"])
display(Table(["mode"] + [label for _, label, _ in tiers] + ["total"], rows,
              caption="model-state bytes per device, by tier (measured)"))
store = engines["optimizer -> nvme"].nvme_store
print(f"the NVMe store holds {store.disk_bytes():,} bytes on disk for the 8 devices: two slots "
      f"(the step being written and the last committed one) and metadata")"""),
    new_markdown_cell("""## What each mode costs per step, here

The wall time of the five timed steps: the median, with the fastest and the slowest as the
whisker. **These are this machine's times**, a CPU with 8 simulated
devices and a tiny model. Here device and host memory are the same RAM, so host offload moves
bytes within one memory. The NVMe tier reads and writes real files on the local disk and syncs
them at every step. On a GPU the costs are different: host offload pays PCIe transfers and a CPU
optimizer step, and the NVMe tier pays the drive's bandwidth. `bench/offload.py`,
`bench/nvme.py` and `bench/param_nvme.py` measure those."""),
    new_code_cell("""fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
bottom = np.zeros(len(reports))
for kind, label, color in tiers:
    values = np.array([sum(r.measured[c].get(kind, 0) for c in r.categories)
                       for r in reports.values()]) / 1e3
    left.bar(range(len(reports)), values, bottom=bottom, label=label, color=color)
    bottom += values

def tick(mode):  # a mode's name over two lines
    return mode.replace(" + ", " +\\n").replace(", ", ",\\n")

left.set_xticks(range(len(reports)), [tick(m) for m in reports], fontsize="small",
                rotation=30, ha="right", rotation_mode="anchor")
left.set(ylabel="kB per device", title="model states per device, by tier")
left.set_ylim(0, 1.3 * bottom.max())  # room for the legend
left.legend(fontsize="small", ncol=3, loc="upper center")

medians = [statistics.median(t) * 1e3 for t in step_times.values()]
low = [m - min(t) * 1e3 for m, t in zip(medians, step_times.values())]
high = [max(t) * 1e3 - m for m, t in zip(medians, step_times.values())]
right.bar(range(len(step_times)), medians, yerr=[low, high], capsize=4, color="tab:gray")
right.set_xticks(range(len(step_times)), [tick(m) for m in step_times], fontsize="small",
                 rotation=30, ha="right", rotation_mode="anchor")
right.set(ylabel="ms per step (median of 5)",
          title="step time: this machine's wall clock (CPU, 8 simulated devices)")
plt.tight_layout()
plt.show()
for name, t in step_times.items():
    print(f"{name:32s} {statistics.median(t) * 1e3:7.1f} ms per step (median of {len(t)})")"""),
    new_code_cell("""nvme_dir.cleanup()  # removes the NVMe tier's files"""),
]


if __name__ == "__main__":
  execute_and_write(CELLS, "where_everything_lives")
