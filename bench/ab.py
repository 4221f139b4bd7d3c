"""A/B: the default job and the step's compiled memory, this tree against a git ref, in one run.

  python bench/ab.py --ref ede0f60 [--rounds 3] [--steps 60] [--memory] [--no-time]

Both sides are installed side by side (``pip install --no-deps --target``, into a temporary
folder; the ref from ``git worktree``, this side from the working tree as it is, uncommitted
changes included), so each runs its own jzero in its own interpreter with the same dependencies.

* **Time** (default): ``jzero train --config configs/zero3.json --steps N --no-progress`` -- the
  README's first job, shortened -- runs for the ref and for this tree alternately, ``--rounds``
  times each (ref, this, ref, this, ...), so both sides share the machine's load. Each run's
  median step time is read from its summary line; the table gives every round and the ratio this
  / ref of the medians over rounds. A ratio below 1 means this tree is faster.
* **Memory** (``--memory``): each side compiles the step (``engine.compile_step``) for the default
  GPT at stages 0-3 and for an NNX model whose blocks run in a Python loop (d 512, 4 and 8 blocks,
  stages 0 and 3), fp32, 8 simulated CPU devices, and prints XLA's ``memory_analysis()`` temp and
  argument bytes: deterministic numbers, one compile per side.

This machine is shared and noisy: quote ratios measured side by side in one run, not absolute
times from different runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run by each side's interpreter: the compiled step's memory for the models of the table.
MEMORY_PROBE = r'''
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jzero
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jzero.models import GPT, GPTConfig, lm_loss

class Block(nnx.Module):
  def __init__(self, d, rngs):
    self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))

class LoopNet(nnx.Module):
  def __init__(self, rngs, layers, d=512):
    self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x

def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

def config(stage):
  return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
          "zero_optimization": {"stage": stage}}

def measure(model, loss, stage, batch):
  engine = jzero.initialize(model, loss, config(stage))
  state = engine.init(jax.random.key(0))
  batch = engine.shard_batch(batch)
  m = engine.compile_step(state, batch).memory_analysis()
  return {"temp": int(m.temp_size_in_bytes), "arguments": int(m.argument_size_in_bytes)}

rows = {}
tokens = {"tokens": np.random.default_rng(0).integers(0, 256, (32, 65), dtype=np.int32)}
for stage in (0, 1, 2, 3):
  rows[f"default GPT, stage {stage}"] = measure(lambda rngs: GPT(GPTConfig(), rngs=rngs), lm_loss,
                                                stage, tokens)
x = np.random.default_rng(1).normal(size=(32, 512)).astype(np.float32)
for stage in (0, 3):
  for layers in (4, 8):
    rows[f"loop model, {layers} blocks, stage {stage}"] = measure(
        lambda rngs, n=layers: LoopNet(rngs, n), mse, stage, {"x": x, "y": x})
print("MEMORY " + json.dumps(rows))
'''


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--ref", required=True, help="the git ref to compare against (e.g. main~3, a hash)")
  p.add_argument("--rounds", type=int, default=3, help="alternated runs of each side (default 3)")
  p.add_argument("--steps", type=int, default=60, help="steps of each default-job run (default 60)")
  p.add_argument("--memory", action="store_true", help="also compare the compiled step's memory")
  p.add_argument("--no-time", action="store_true", help="skip the timed runs")
  return p.parse_args()


def _install(source: Path, target: Path) -> None:
  """jzero from ``source`` (a checkout) into ``target``, without dependencies (the current
  environment's jax, flax, ... serve both sides)."""
  subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                  "--target", str(target), str(source)], check=True, capture_output=True)


def _side_env(site: Path) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env["PYTHONPATH"] = str(site)
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def _median_step_ms(site: Path, checkout: Path, steps: int) -> float:
  run = subprocess.run([sys.executable, "-P", "-m", "jzero", "train", "--config", "configs/zero3.json",
                        "--steps", str(steps), "--no-progress"], cwd=checkout,
                       env=_side_env(site), capture_output=True, text=True, timeout=3600)
  found = re.search(r"median step (\d+(?:\.\d+)?) ms", run.stdout)
  if run.returncode != 0 or found is None:
    raise SystemExit(f"the default job failed in {checkout}:\n{run.stdout[-2000:]}\n"
                     f"{run.stderr[-3000:]}")
  return float(found.group(1))


def _memory(site: Path, checkout: Path) -> dict[str, dict[str, int]]:
  run = subprocess.run([sys.executable, "-P", "-c", MEMORY_PROBE], cwd=checkout, env=_side_env(site),
                       capture_output=True, text=True, timeout=3600)
  line = next((l for l in run.stdout.splitlines() if l.startswith("MEMORY ")), None)
  if run.returncode != 0 or line is None:
    raise SystemExit(f"the memory probe failed in {checkout}:\n{run.stderr[-3000:]}")
  return json.loads(line[len("MEMORY "):])


def main() -> None:
  args = _parse()
  ref = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT, check=True,
                       capture_output=True, text=True).stdout.strip()
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                        capture_output=True, text=True).stdout.strip()
  dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip())
  this = f"{head}{' + changes' if dirty else ''}"
  with tempfile.TemporaryDirectory(prefix="jzero-ab-") as work:
    work = Path(work)
    checkout = work / "ref"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(checkout), ref], cwd=ROOT,
                   check=True)
    try:
      print(f"installing {ref} and {this} side by side ...", flush=True)
      _install(checkout, work / "site-ref")
      _install(ROOT, work / "site-this")
      sides = {ref: (work / "site-ref", checkout), this: (work / "site-this", ROOT)}
      print(f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
            f"python {platform.python_version()}")
      if not args.no_time:
        _time(sides, ref, this, args)
      if args.memory:
        _compare_memory(sides, ref, this)
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT,
                     capture_output=True)


def _time(sides: dict, ref: str, this: str, args: argparse.Namespace) -> None:
  times: dict[str, list[float]] = {ref: [], this: []}
  for r in range(args.rounds):
    for name in (ref, this):
      times[name].append(_median_step_ms(*sides[name], args.steps))
      print(f"  round {r + 1}: {name} median step {times[name][-1]:.0f} ms", flush=True)
  print(f"\nDefault job (configs/zero3.json, {args.steps} steps), median step in ms, alternated:\n")
  print("| tree | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " | median |")
  print("|---|" + "---|" * (args.rounds + 1))
  for name in (ref, this):
    print(f"| {name} | " + " | ".join(f"{t:.0f}" for t in times[name]) +
          f" | {statistics.median(times[name]):.0f} |")
  ratio = statistics.median(times[this]) / statistics.median(times[ref])
  per_round = [b / a for a, b in zip(times[ref], times[this])]
  print(f"\n{this} / {ref}: {ratio:.3f} (ratio of the medians); per round "
        + ", ".join(f"{x:.3f}" for x in per_round)
        + f" (median {statistics.median(per_round):.3f}: the figure that load drifting between "
          f"rounds moves least)")


def _compare_memory(sides: dict, ref: str, this: str) -> None:
  mem = {name: _memory(*sides[name]) for name in (ref, this)}
  mib = lambda b: f"{b / 2**20:.2f} MiB"
  print("\nCompiled step, fp32, 8 CPU devices: XLA's memory_analysis()\n")
  print(f"| model | {ref} temp | {this} temp | ratio | {ref} arguments | {this} arguments |")
  print("|---|---|---|---|---|---|")
  for row in mem[ref]:
    a, b = mem[ref][row], mem[this].get(row)
    if b is None:
      continue
    print(f"| {row} | {mib(a['temp'])} | {mib(b['temp'])} | {b['temp'] / a['temp']:.3f} | "
          f"{mib(a['arguments'])} | {mib(b['arguments'])} |")


if __name__ == "__main__":
  main()
