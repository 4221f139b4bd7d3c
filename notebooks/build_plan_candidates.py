"""Writes notebooks/plan_candidates.ipynb (run it, then execute the notebook to store its outputs:
``python notebooks/build_plan_candidates.py``).

The notebook plots two committed ``jzero plan --report`` results (notebooks/data/plan_*.json):
the builder copies each into a cell as one JSON object with one line per candidate (the columns
the notebook uses), so that the notebook runs from any directory and never compiles."""

import json

from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_build import HERE, execute_and_write

COLUMNS = ["name", "stage", "status", "reason", "device_bytes", "host_bytes", "nvme_bytes",
           "intra_node_bytes", "inter_node_bytes", "pcie_bytes", "overlap", "source",
           "predicted_s", "compute", "network", "pcie", "host", "nvme", "bound"]


def _number(x):
  return int(x) if isinstance(x, float) and x.is_integer() else x


def embedded(name: str) -> str:
  """The report ``data/<name>.json`` as the notebook's cell holds it: its head, the constants'
  values, and per candidate the :data:`COLUMNS` (the table ``jzero plan`` prints)."""
  plan = json.loads((HERE / "data" / f"{name}.json").read_text())
  head = {k: plan[k] for k in ("hardware", "target", "margin", "num_params", "global_batch",
                               "precision", "chosen", "why")}
  head["constants"] = {k: _number(c["value"]) for k, c in plan["constants"].items()}
  head["columns"] = COLUMNS
  rows = []
  for r in plan["rows"]:
    flat = {**r, **r["resources"], **r["terms"], "stage": r["candidate"]["stage"]}
    rows.append(json.dumps([_number(flat[c]) for c in COLUMNS], ensure_ascii=False))
  text = json.dumps(head, ensure_ascii=False)[:-1] + ', "rows": [\n' + ",\n".join(rows) + "]}"
  assert '"""' not in text and "\\" not in text, name  # it goes into a triple-quoted string
  return text


CELLS = [
    new_markdown_cell("""# Which config? The candidates `jzero plan` weighed

`jzero plan` (docs/planning.md, "Which config?") lists every ZeRO config a DeepSpeed user
would try by hand (stage, ZeRO++, optimizer and parameter offload, activation checkpointing,
micro-batch), prunes the ones whose bytes cannot fit by the estimator's arithmetic, compiles the
plausible ones for the target GPUs (XLA's GPU compiler, no GPU needed) and ranks those that fit
by a **predicted** step time (the cost model of `jzero/planning/cost.py`: predictions, not
measurements). This notebook plots every candidate it weighed: the bytes each needs per resource
against the budget, its predicted step time, the chosen one marked, and why the others lost.

Compiling a 7B eight times takes minutes, so the notebook plots two **committed plans**, each the
JSON that `jzero plan --report` wrote (jax 0.10.2, the CUDA compiler plugin of the test extra):

* `notebooks/data/plan_7b_h100.json`: `jzero plan --params 7e9 --gpu h100 --devices 8 --report
  notebooks/data/plan_7b_h100.json` (8 candidates compiled for 8 x H100);
* `notebooks/data/plan_1t_a100.json`: `jzero plan --params 1e12 --gpu a100 --devices 8 --nodes 2
  --host-memory 1.5TB --compile-top 0 --report notebooks/data/plan_1t_a100.json` (arithmetic
  alone: ZeRO-Infinity's trillion parameters on two DGX A100 nodes).

The builder copies each into the cell below (one line per candidate: the columns of the plan's
table), so that the notebook runs from any directory in a few seconds."""),
    new_code_cell("import json\n\n"
                  "import matplotlib.pyplot as plt\n\n"
                  "%matplotlib inline\n\n"
                  f'PLAN_7B = json.loads("""\n{embedded("plan_7b_h100")}\n""")\n'
                  f'PLAN_1T = json.loads("""\n{embedded("plan_1t_a100")}\n""")'),
    new_markdown_cell("""## What the plan says, checked

Each row's budget: the device's usable memory (what JAX preallocates, 75%) and the node's host
memory and NVMe, each less the margin (5%); a candidate priced by the estimator alone is pruned
only when its device bytes exceed the usable memory itself (the estimate is a lower bound of the
compiled peak, so the plan compiles the close ones rather than rule them out). A candidate *fits*
when its bytes are within all three; every other one carries the reason it was ruled out. The
predicted step time adds up from its terms as docs/planning.md's formula says: `max(compute, overlap x
network) + (1 - overlap) x network + max(pcie, host, nvme)`. The cell checks both for every row,
and that the chosen one is the fitting one with the least predicted time."""),
    new_code_cell("""def rows_of(plan):
    return [dict(zip(plan["columns"], row)) for row in plan["rows"]]


def budgets(plan, row=None):
    # bytes a row may use: the margin left free, except that an estimate (a lower bound of the
    # compiled peak) is pruned only when it exceeds the usable device memory itself
    c, keep = plan["constants"], 1 - plan["margin"]
    usable = c["device_memory"] * c["memory_fraction"]
    device_keep = 1 if row is not None and row["source"] == "estimator" else keep
    return {"device_bytes": usable * device_keep, "host_bytes": c["host_memory"] * keep,
            "nvme_bytes": c["nvme_bytes"] * keep}


def check(plan):
    rows = rows_of(plan)
    for r in rows:
        over = [k for k, limit in budgets(plan, r).items() if r[k] > limit]
        if r["status"] in ("fits", "not compiled"):
            assert not over and not r["reason"], r
        else:  # pruned by the estimate, or too big once compiled: over a budget, and it says so
            assert r["status"] in ("pruned", "too big") and over and r["reason"], r
        step = (max(r["compute"], r["overlap"] * r["network"]) + (1 - r["overlap"]) * r["network"]
                + max(r["pcie"], r["host"], r["nvme"]))
        assert abs(step - r["predicted_s"]) <= 1e-9 * step, r
    fits = [r for r in rows if r["status"] == "fits"]
    assert plan["chosen"] == fits[0]["name"]
    assert fits[0]["predicted_s"] == min(r["predicted_s"] for r in fits)
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"{plan['hardware']}: {len(rows)} candidates, {counts}; chosen: {plan['chosen']}")
    return rows


rows_7b, rows_1t = check(PLAN_7B), check(PLAN_1T)
chosen_7b = next(r for r in rows_7b if r["name"] == PLAN_7B["chosen"])
assert chosen_7b["source"] == "compiled" and chosen_7b["stage"] in (1, 2, 3)
assert all(r["status"] == "pruned" for r in rows_7b if r["stage"] == 0)  # 16 bytes/param: DDP
assert "opt->nvme param->nvme" in PLAN_1T["chosen"]  # ZeRO-Infinity's layout"""),
    new_markdown_cell("""## Every candidate: device bytes against predicted step time

One point per candidate: its bytes per device (the compiled peak where it was compiled, else the
estimate) and its predicted step time, both on log scales. The dashed line is the usable device
memory less the margin; the star is the chosen config. Pruned candidates above the line do not fit
on the device; those below it are over the node's host memory or NVMe (the 1T's optimizer in
host memory). Candidates with the same bytes and time (the checkpointing choices whose
activations the estimate puts at the same size) lie on one point."""),
    new_code_cell("""STYLE = {"fits": ("tab:green", "o"), "not compiled": ("tab:blue", "s"),
         "too big": ("tab:orange", "D"), "pruned": ("tab:gray", "x")}


def scatter(ax, plan, rows, title):
    for status, (color, marker) in STYLE.items():
        some = [r for r in rows if r["status"] == status]
        if some:
            ax.scatter([r["predicted_s"] for r in some], [r["device_bytes"] / 1e9 for r in some],
                       c=color, marker=marker, s=22, alpha=0.7, label=f"{status} ({len(some)})")
    best = next(r for r in rows if r["name"] == plan["chosen"])
    ax.scatter([best["predicted_s"]], [best["device_bytes"] / 1e9], marker="*", s=320, c="gold",
               edgecolors="k", zorder=4, label="chosen")
    ax.annotate(best["name"], (best["predicted_s"], best["device_bytes"] / 1e9), fontsize=7,
                xytext=(6, -14), textcoords="offset points")
    ax.axhline(budgets(plan)["device_bytes"] / 1e9, color="r", linestyle="--", linewidth=1,
               label="usable less margin")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time, s (cost model)")
    ax.set_ylabel("GB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="x-small")


fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
scatter(axes[0], PLAN_7B, rows_7b, "7B on 8 x H100 (8 compiled)")
scatter(axes[1], PLAN_1T, rows_1t, "1T on 2 x 8 A100, 1.5 TB host/node (arithmetic)")
plt.tight_layout()
plt.show()"""),
    new_markdown_cell("""## Bytes per resource, the chosen one marked

For a readable subset of each plan: every candidate that fits or was compiled, the
best-predicted few that were not compiled, and, for each stage and each reason (device, host,
NVMe), the pruned candidate closest to fitting. Per candidate: device bytes (the peak) against the
usable device memory, host and NVMe bytes per node against the node's, the collective bytes each
device sends inside its node and across nodes per step, and the predicted step time with its
bound. Hatched bars do not fit; the chosen config is gold and starred; the reason each loser was
ruled out is printed below the plot. (The 7B's `param->nvme` keeps its whole parameter partition,
1.7 GB per device, in the host cache that `max_in_cpu` allows, as DeepSpeed does: no NVMe bytes.
The 1T's collectives all cross nodes: with two nodes the data axis spans both.)"""),
    new_code_cell("""PANELS = [
    ("device_bytes", "device peak, GB/device"), ("host_bytes", "host, GB/node"),
    ("nvme_bytes", "NVMe, GB/node"), ("intra_node_bytes", "collectives in node, GB/dev"),
    ("inter_node_bytes", "across nodes, GB/dev"),
    ("predicted_s", "predicted step, s")]


def subset(rows, not_compiled=3):
    keep = [r for r in rows if r["status"] in ("fits", "too big")]
    keep += [r for r in rows if r["status"] == "not compiled"][:not_compiled]
    closest = {}
    for r in rows:
        if r["status"] == "pruned":
            key = (r["stage"], r["reason"].split()[0])
            if key not in closest or r["device_bytes"] < closest[key]["device_bytes"]:
                closest[key] = r
    return keep + [closest[k] for k in sorted(closest)]


def resource_bars(plan, rows, title):
    shown = subset(rows)
    budget = budgets(plan)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 0.3 * len(shown) + 1.6), sharey=True)
    ys = range(len(shown))
    for ax, (key, label) in zip(axes, PANELS):
        scale = 1 if key == "predicted_s" else 1e9
        if not any(r[key] for r in shown):  # e.g. one node: nothing crosses nodes
            ax.text(0.5, 0.5, "0 for all shown", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8)
            ax.set_xticks([])
            ax.set_title(label, fontsize=8)
            continue
        colors = ["gold" if r["name"] == plan["chosen"] else STYLE[r["status"]][0] for r in shown]
        bars = ax.barh(ys, [r[key] / scale for r in shown], color=colors)
        for bar, r in zip(bars, shown):
            if r["status"] in ("pruned", "too big"):
                bar.set_hatch("///")
        if key in budget:
            ax.axvline(budget[key] / scale, color="r", linestyle="--", linewidth=1)
        if key == "predicted_s":
            for y, r in zip(ys, shown):
                ax.annotate(r["bound"], (r[key], y), fontsize=6, xytext=(2, -2),
                            textcoords="offset points")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_title(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(list(ys), [("* " if r["name"] == plan["chosen"] else "")
                                  + f"{r['name']} [{r['status']}]" for r in shown], fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(title + " (red: budget less margin; hatched: does not fit)", fontsize=10)
    plt.tight_layout()
    plt.show()
    for r in shown:
        if r["reason"]:
            print(f"{r['name']:>48} {r['status']}: {r['reason']}")
    print("why", plan["why"])


resource_bars(PLAN_7B, rows_7b, "7B on 8 x H100")"""),
    new_code_cell('resource_bars(PLAN_1T, rows_1t, "1T on 2 x 8 A100, 1.5 TB host/node")'),
    new_markdown_cell("""## Why the others lost, counted

Every candidate that does not fit, grouped by the budget it exceeds first (a candidate may exceed
more than one: its reason lists each) and by stage."""),
    new_code_cell("""def losers(plan, rows):
    counts = {}
    for r in rows:
        if r["reason"]:
            key = (r["status"], f"stage {r['stage']}", r["reason"].split()[0])
            counts[key] = counts.get(key, 0) + 1
    print(plan["hardware"])
    for (status, stage, over), n in sorted(counts.items()):
        print(f"  {n:4d} {status:8s} {stage}: over the {over} budget")
    return counts


counts_7b, counts_1t = losers(PLAN_7B, rows_7b), losers(PLAN_1T, rows_1t)
assert sum(counts_7b.values()) == sum(r["status"] in ("pruned", "too big") for r in rows_7b)
assert any(over == "host" for _, _, over in counts_1t)  # 12 B/param of optimizer: 6 TB/node"""),
]


if __name__ == "__main__":
  execute_and_write(CELLS, "plan_candidates")
