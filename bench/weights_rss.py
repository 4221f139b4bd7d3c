"""Benchmark: peak host memory per process while loading plain weights, by shard vs whole file.

  python bench/weights_rss.py [--processes 4] [--devices 2] [--out bench/out]

Writes a >= 200 MB fp32 safetensors file for each of two models, then, for each model and each
load path, runs PROCESSES fresh processes of DEVICES CPU devices joined over gloo
(``jax.distributed``), ZeRO-3 (AdamW, the default persistence threshold) on one data axis over
every device, so each process holds 1/PROCESSES of the params:

* ``by shard``: ``engine.load_weights(file)`` -- each leaf placed in the plan, each
  process reading only its devices' blocks through safetensors' slice API;
* ``whole file``: what ``load_weights`` did before: ``checkpoint.read_weights(file)`` (every tensor
  into numpy, through one ``safe_open``), cast into the params tree.

The models: ``gpt``, ``jzero.models.GPT`` with d_model 1024 and 5 scanned layers (stacked leaves:
the largest is a quarter of a layer stack, 80 MiB); ``mlp``, 52 dense 1024 x 1024 layers (the
largest leaf 4 MiB, so the bound is tight).

What is measured, per process (Linux ``/proc/self/status``): the plan is built first (outside the
measurement); then VmRSS is read (``before``), ``/proc/self/clear_refs`` gets "5", which resets the
peak VmHWM to the current VmRSS, the load runs, and ``load peak`` = VmHWM - before: the most
resident memory (anonymous and file-mapped pages: safetensors maps the file) the load added at any
moment. ``init peak`` the same over the load and ``engine.init(rng, params=...)`` together (the
train state: params + AdamW's two moments, 3 x the shard). ``shard`` is the bytes of the loaded
params this process's devices hold (their addressable shards), ``largest`` the largest leaf, and
the bound is (shard + largest) x 1.1. Children run with glibc's mmap threshold lowered
(``bench/host_memory.py``), so memory freed before the load is returned, not reused unseen.
Writes ``weights_rss.json`` and ``weights_rss.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from host_memory import child_env, rss

MODELS = ("gpt", "mlp")
PATHS = ("by shard", "whole file")
MLP_LAYERS, WIDTH = 52, 1024


def _model(name: str):
  """(factory of the NNX model, its loss) by name."""
  import jax.numpy as jnp
  from flax import nnx

  from jzero.models import GPT, GPTConfig, lm_loss

  if name == "gpt":
    cfg = GPTConfig(d_model=WIDTH, n_layers=5, n_heads=8)
    return (lambda rngs: GPT(cfg, rngs=rngs)), lm_loss

  class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(MLP_LAYERS)])

    def __call__(self, x):
      for layer in self.layers:
        x = layer(x)
      return x

  return Mlp, lambda model, batch: jnp.mean(model(batch["x"]) ** 2)


def _write(name: str, path: Path) -> None:
  """Random fp32 weights of the model, named as load_weights reads them."""
  import numpy as np
  import safetensors.numpy
  from flax import nnx

  from jzero.sharding.plan import flatten_paths

  factory, _ = _model(name)
  abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: factory(nnx.Rngs(0))), nnx.Param))
  rng = np.random.default_rng(0)
  safetensors.numpy.save_file({p: rng.standard_normal(x.shape, dtype=np.float32)
                               for p, x in flatten_paths(abstract).items()}, str(path))


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS


def _child(process_id: int, processes: int, port: int, devices: int, model: str, path: str,
           weights: str) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes,
                             process_id=process_id, initialization_timeout=300)
  import numpy as np

  import jzero
  from jzero import checkpoint
  from jzero.sharding.plan import flatten_paths

  factory, loss = _model(model)
  engine = jzero.initialize(factory, loss, {
      "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": 3}})
  engine.make_plan()  # the plan, outside the measurement
  abstract = engine.model.abstract_params(jax.random.key(0), None)

  def whole_file():
    flat = checkpoint.read_weights(weights)
    return jax.tree.unflatten(jax.tree.structure(abstract), [
        np.asarray(flat[p], x.dtype) for p, x in flatten_paths(abstract).items()])

  before = rss()
  _reset_peak()
  params = engine.load_weights(weights) if path == "by shard" else whole_file()
  load_peak = _status("VmHWM") - before
  state = engine.init(jax.random.key(0), params=params)
  jax.block_until_ready(state)
  del params
  init_peak = _status("VmHWM") - before
  sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)]
  plan = engine.plan
  shard = sum(s.data.nbytes for x in jax.tree.leaves(state.params) for s in x.addressable_shards)
  return {"model": model, "path": path, "process": process_id, "before": before,
          "load_peak": load_peak, "init_peak": init_peak, "shard": shard,
          "largest": max(sizes), "total": sum(sizes), "leaves": len(sizes),
          "partitioned": sum(leaf.param_partitioned for leaf in plan.leaf_list())}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _job(model: str, path: str, weights: Path, processes: int, devices: int) -> list[dict]:
  port = _free_port()
  env = dict(child_env(), JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), "--port", str(port),
                             "--processes", str(processes), "--devices", str(devices), "--model",
                             model, "--path", path, "--weights", str(weights)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(processes)]
  rows = []
  for i, p in enumerate(procs):
    out, err = p.communicate(timeout=1200)
    if p.returncode:
      raise SystemExit(f"{model} / {path}: process {i} exited with {p.returncode}:\n{err[-3000:]}")
    rows.append(json.loads(out.strip().splitlines()[-1]))
  return rows


def _mb(x: float) -> str:
  return f"{x / 2**20:.1f}"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--devices", type=int, default=2, help="CPU devices per process")
  p.add_argument("--out", default="bench/out")
  p.add_argument("--child", type=int, help=argparse.SUPPRESS)
  p.add_argument("--port", type=int, help=argparse.SUPPRESS)
  p.add_argument("--model", help=argparse.SUPPRESS)
  p.add_argument("--path", help=argparse.SUPPRESS)
  p.add_argument("--weights", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child is not None:
    print(json.dumps(_child(args.child, args.processes, args.port, args.devices, args.model,
                            args.path, args.weights)))
    return 0
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for model in MODELS:
      weights = Path(tmp) / f"{model}.safetensors"
      _write(model, weights)
      for path in PATHS:
        print(f"-- {model}, {path}", file=sys.stderr, flush=True)
        rows += _job(model, path, weights, args.processes, args.devices)
  header = ("| model | path | process | load peak (MiB) | shard (MiB) | largest leaf (MiB) | "
            "bound (shard + largest) x 1.1 | load peak / bound | load + init peak (MiB) |")
  lines = [header, "|" + "---|" * 9]
  for r in rows:
    bound = 1.1 * (r["shard"] + r["largest"])
    lines.append(f"| {r['model']} ({_mb(r['total'])} MiB, {r['leaves']} leaves) | {r['path']} | "
                 f"{r['process']} | {_mb(r['load_peak'])} | {_mb(r['shard'])} | "
                 f"{_mb(r['largest'])} | {_mb(bound)} | {r['load_peak'] / bound:.2f} | "
                 f"{_mb(r['init_peak'])} |")
  table = "\n".join(lines)
  print(f"{args.processes} processes x {args.devices} CPU devices, ZeRO-3, fp32 weights; peaks are "
        f"VmHWM after minus VmRSS before (see the docstring)\n{table}")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "weights_rss.json").write_text(json.dumps(rows, indent=2))
  (out / "weights_rss.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
