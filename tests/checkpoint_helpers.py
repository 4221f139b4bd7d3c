"""Checkpoint-test pieces that also run in subprocesses: ``python tests/checkpoint_helpers.py``.

* ``resume DIR OUT``: restore the latest checkpoint of each job in ``DIR/<job>/`` (configs in
  :data:`RESUME_JOBS`) in a fresh process and train to :data:`RESUME_STEPS`; losses and final
  logical params go to ``OUT`` (npz).
* ``save DIR STEP``: restore the latest :class:`Wide` checkpoint of ``DIR``, start saving it again
  as ``STEP`` and wait to be killed (the SIGKILL test).
* ``load DIR``: restore ``DIR`` (SMALL, stage 2) and print the CheckpointError it raises, if any
  (Orbax leaves its failed reads' coroutines to the garbage collector: kept out of the test run).
* ``convert DIR OUT``: consolidate ``DIR`` into the safetensors file ``OUT`` and print the peak host
  memory it took (JSON): anonymous resident memory sampled while it runs, and tracemalloc's peak.
* ``race DIR GO``: a fresh SMALL state, ``ready`` printed; once the file ``GO`` exists, save
  steps 1-3 into ``DIR`` (its pid in each checkpoint's client state) and print ``saved``, or the
  CheckpointError that refuses it (exit status 3): two of them race for one directory.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jzero
from jzero import checkpoint
from jzero.sharding.plan import path_str
from zero_testing import SMALL, batches, ds_config, make_engine

RESUME_STEPS = 20
RESUME_AT = 10


def resume_config(job: str) -> dict:
  """The two exact-resume jobs, both with a WarmupLR schedule whose warmup ends after the resume
  point: fp32 stage 2, and fp16 stage 3 with a dynamic loss scale that grows every 4 steps, so
  the scaler's counters matter."""
  cfg = ds_config(2 if job == "fp32" else 3)
  cfg["scheduler"] = {"type": "WarmupLR", "params": {
      "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 15}}
  if job == "fp16":
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 4}
  return cfg


RESUME_JOBS = ("fp32", "fp16")


def resume_engine(job: str):
  return make_engine(resume_config(job))


def flat(tree) -> dict:
  """{'/'-joined leaf path: leaf}."""
  return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def train(engine, state, stop: int) -> tuple[jzero.TrainState, list[float]]:
  """Trains from ``state.step`` to ``stop``; batch ``s`` is a pure function of the step."""
  data = batches(SMALL.seq_len, engine.global_batch_size, stop)
  losses = []
  for step in range(int(state.step), stop):
    state, metrics = engine.train_step(state, engine.shard_batch(data[step]))
    losses.append(float(metrics["loss"]))
  return state, losses


class Wide(nnx.Module):
  """A model of a few large leaves (a MiB or more each) for the save-kill and memory tests."""

  def __init__(self, rngs: nnx.Rngs, width: int = 1024, n: int = 32):
    init = nnx.initializers.normal(0.02)
    self.kernels = nnx.List([nnx.Param(init(rngs.params(), (width, width))) for _ in range(n)])
    self.bias = nnx.Param(init(rngs.params(), (width - 3,)))  # uneven: padded under ZeRO

  def __call__(self, x):
    for k in self.kernels:
      x = jnp.tanh(x @ k)
    return x


def wide_loss(model: Wide, batch: dict) -> jax.Array:
  return jnp.mean(model(batch["x"]) ** 2)


def wide_engine():
  return make_engine(ds_config(3, micro=1), lambda rngs: Wide(rngs), wide_loss)


def _resume(directory: str, out: str) -> None:
  results = {}
  for job in RESUME_JOBS:
    engine = resume_engine(job)
    state = engine.load_checkpoint(f"{directory}/{job}")
    state, losses = train(engine, state, RESUME_STEPS)
    results[f"{job}/losses"] = np.asarray(losses)
    for path, x in flat(engine.logical_params(state)).items():
      results[f"{job}/{path}"] = np.asarray(x)
  np.savez(out, **results)


def _save_and_wait(directory: str, step: int) -> None:
  engine = wide_engine()
  state = engine.load_checkpoint(directory)
  engine.save_checkpoint(state, directory, step)
  time.sleep(600)


def _load(directory: str) -> None:
  engine = make_engine(2)
  try:
    engine.load_checkpoint(directory)
  except jzero.CheckpointError as e:
    print(f"CheckpointError: {e}")


def _race(directory: str, go: str) -> None:
  import os
  from pathlib import Path
  engine = make_engine(2)
  state = engine.init(jax.random.key(0))
  print("ready", flush=True)
  while not Path(go).exists():
    time.sleep(0.01)
  try:
    for step in (1, 2, 3):
      engine.save_checkpoint(state, directory, step, client_state={"pid": os.getpid()})
    engine.wait_for_checkpoints()
  except jzero.CheckpointError as e:
    print(f"CheckpointError: {e}", flush=True)
    raise SystemExit(3)
  print("saved", flush=True)


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _convert(directory: str, out: str) -> None:
  """Peak host memory of a consolidation: the anonymous resident memory (heap, arenas, buffers --
  not the pages of shared libraries it touches, which a CUDA plugin installed beside jaxlib makes
  ~90 MiB of) sampled every millisecond while it runs; tracemalloc counts the Python and numpy
  allocations among it."""
  import gc
  import threading
  import tracemalloc

  checkpoint.read_metadata(directory)  # imports and first reads done before measuring
  gc.collect()
  before = peak = _status_kib("RssAnon")
  done = threading.Event()

  def sample():
    nonlocal peak
    while not done.wait(0.001):
      peak = max(peak, _status_kib("RssAnon"))

  sampler = threading.Thread(target=sample)
  sampler.start()
  tracemalloc.start()
  report = checkpoint.consolidate(directory, safetensors=out)
  _, traced = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  done.set()
  sampler.join()
  peak = max(peak, _status_kib("RssAnon"))
  print(json.dumps({"tracemalloc_peak": traced, "anon_before": before * 1024,
                    "anon_peak": peak * 1024,
                    "largest_leaf": report.largest_leaf_bytes, "total": report.total_bytes}))


if __name__ == "__main__":
  jzero.simulate_cpu_devices(8)
  command, *args = sys.argv[1:]
  if command == "resume":
    _resume(*args)
  elif command == "save":
    _save_and_wait(args[0], int(args[1]))
  elif command == "load":
    _load(*args)
  elif command == "convert":
    _convert(*args)
  elif command == "race":
    _race(*args)
  else:
    raise SystemExit(f"unknown command {command!r}")
