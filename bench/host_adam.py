"""Benchmark: the host Adam step -- jzero's kernel, XLA:CPU's optax, DeepSpeed's CPU Adam.

  python bench/host_adam.py [--params 200e6] [--threads 1,2] [--rounds 5] [--steps 3] \
      [--deepspeed-python PYTHON] [--out bench/out]

One AdamW step (weight decay 0.01, bias correction) over ``--params`` fp32 parameters, elements per
second, for each thread count in ``--threads``:

* ``jzero``: :class:`jzero.tiers.host_adam.HostAdam` (numba) on numpy arrays, in place;
* ``jzero, bf16 out``: the same, also writing the new params as bf16 (30 bytes per parameter);
* ``XLA:CPU optax``: jzero's optax AdamW (``jzero.train.optim``) jitted by XLA:CPU on the same
  arrays as jax arrays, donated (the host update's path before this kernel);
* ``numpy + threads``: the same formula as numpy ufuncs (``out=``, no temporaries past 64 KiB
  per array) over 16K-element blocks of the same chunks, on a pool of the same threads (numpy
  releases the GIL inside a ufunc) -- the library-free way, without fused multiply-adds;
* ``DeepSpeed``: ``DeepSpeedCPUAdam`` (its ``cpu_adam`` op, AVX-512 / AVX2 and OpenMP, JIT-built
  with ninja and g++) in the Python of ``--deepspeed-python`` -- a separate venv with torch's CPU
  wheel and DeepSpeed, never a dependency of jzero; without the flag the table says so;
* ``copy``: ``np.copyto`` of ``--params`` fp32 values in chunks over the threads: the machine's
  copy rate, counted as STREAM counts it (4 bytes read + 4 written per element);
* ``28-B stream``: Adam's bytes without its arithmetic -- a numba loop over the same chunks and
  threads that reads p, m, v, g and writes p, m, v (one add each).

The memory-bandwidth limit of an Adam step is the copy rate over 28 bytes per parameter (p, m, v
read and written, g read); each contender's elements per second is shown as a fraction of it and
of the 28-B stream, both measured at the same thread count. A copy is one read stream and one
write stream, and its destination lines are read before they are written (bytes STREAM does not
count), while Adam reads four streams and writes only lines it has read: on a machine whose one
core cannot saturate the memory with one stream, Adam moves more bytes per second than a copy,
and the 28-B stream is the tighter limit.

Each measurement runs in a fresh process pinned to that many cores (``sched_setaffinity``, and
``OMP_NUM_THREADS`` / ``torch.set_num_threads`` / the kernel's ``threads``), one process alive at
a time (a contender holds 3.2 GB at 200M parameters): it builds its arrays, runs a warm-up step,
times ``--steps`` steps and reports the fastest (on a shared machine the other steps measure the
neighbours' load). A round measures every contender once at every thread count, in turn; the table
gives the median over ``--rounds`` rounds, so a shared machine's load falls on all of them alike. Writes ``host_adam.json`` and ``host_adam.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Adam's bytes per parameter: p, m, v read and written (24), g read (4).
ADAM_BYTES = 28
COPY_BYTES = 8
CONTENDERS = ("jzero", "jzero, bf16 out", "XLA:CPU optax", "numpy + threads", "DeepSpeed", "copy",
              "28-B stream")
LIMITS = ("copy", "28-B stream")  # measured beside the contenders, not contenders themselves
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--params", type=float, default=200e6, help="fp32 parameters per step")
  p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
  p.add_argument("--deepspeed-python", default=None,
                 help="the python of a venv with torch (CPU) and deepspeed installed")
  p.add_argument("--out", default="bench/out")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args()


# -- the workers: one contender, one thread count, one process ---------------------------------

def _arrays(n: int) -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(0)
  p = rng.random(n, dtype=np.float32) - np.float32(0.5)
  g = rng.random(n, dtype=np.float32) - np.float32(0.5)
  return p, np.zeros(n, np.float32), np.zeros(n, np.float32), g


def _timed(step, steps: int) -> list[float]:
  step()  # warm-up: compiles, faults the pages in, builds the moments
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  return times


def _worker_jzero(n: int, threads: int, steps: int, bf16_out: bool) -> list[float]:
  import ml_dtypes
  from jzero.tiers.host_adam import HostAdam, HostAdamSettings

  p, m, v, g = _arrays(n)
  out = np.empty(n, ml_dtypes.bfloat16) if bf16_out else None
  adam = HostAdam(HostAdamSettings(betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                  threads=threads, backend="numba")
  count = [0]

  def step():
    count[0] += 1
    adam.step(p, m, v, g, count[0], LR, out_params=out)

  return _timed(step, steps)


def _worker_xla(n: int, threads: int, steps: int) -> list[float]:
  import jax
  import jax.numpy as jnp
  import optax
  from jzero.train.optim import build_optimizer

  tx, _ = build_optimizer({"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                       "weight_decay": WEIGHT_DECAY}}, None)
  arrays = _arrays(n)
  p, g = jnp.asarray(arrays[0]), jnp.asarray(arrays[3])
  del arrays
  state = [p, tx.init(p)]

  def update(p, opt_state, g):
    updates, opt_state = tx.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state

  update = jax.jit(update, donate_argnums=(0, 1))

  def step():
    state[0], state[1] = update(state[0], state[1], g)
    jax.block_until_ready(state)

  return _timed(step, steps)


def _worker_deepspeed(n: int, threads: int, steps: int) -> list[float]:
  import torch
  from deepspeed.ops.adam import DeepSpeedCPUAdam

  torch.set_num_threads(threads)
  p, _, _, g = _arrays(n)
  param = torch.nn.Parameter(torch.from_numpy(p))
  param.grad = torch.from_numpy(g)
  opt = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                         bias_correction=True, adamw_mode=True)
  return _timed(opt.step, steps)


def _worker_copy(n: int, threads: int, steps: int) -> list[float]:
  from concurrent.futures import ThreadPoolExecutor

  src = _arrays(n)[0]
  dst = np.empty_like(src)
  chunk = 1 << 20
  pool = ThreadPoolExecutor(threads)

  def step():
    list(pool.map(lambda lo: np.copyto(dst[lo:lo + chunk], src[lo:lo + chunk]),
                  range(0, n, chunk)))

  return _timed(step, steps)


def _worker_numpy(n: int, threads: int, steps: int) -> list[float]:
  from concurrent.futures import ThreadPoolExecutor

  f32 = np.float32
  b1, b2, wd, neg_lr = f32(BETAS[0]), f32(BETAS[1]), f32(WEIGHT_DECAY), f32(-LR)
  c1, c2, eps = f32(1 - BETAS[0]), f32(1 - BETAS[1]), f32(EPS)
  p, m, v, g = _arrays(n)
  chunk, block = 1 << 20, 1 << 14
  count = [0]

  def update(lo: int, r1: np.float32, r2: np.float32) -> None:
    x, y = np.empty(block, np.float32), np.empty(block, np.float32)
    for a in range(lo, min(lo + chunk, n), block):
      b = min(a + block, lo + chunk, n)
      pb, mb, vb, gb, xb, yb = p[a:b], m[a:b], v[a:b], g[a:b], x[:b - a], y[:b - a]
      np.multiply(mb, b1, out=mb)
      np.multiply(gb, c1, out=xb)
      np.add(mb, xb, out=mb)  # m = b1 m + (1 - b1) g
      np.multiply(vb, b2, out=vb)
      np.multiply(gb, gb, out=xb)
      np.multiply(xb, c2, out=xb)
      np.add(vb, xb, out=vb)  # v = b2 v + (1 - b2) g^2
      np.multiply(vb, r2, out=yb)
      np.sqrt(yb, out=yb)
      np.add(yb, eps, out=yb)
      np.multiply(mb, r1, out=xb)
      np.divide(xb, yb, out=xb)  # m_hat / (sqrt(v_hat) + eps)
      np.multiply(pb, wd, out=yb)
      np.add(xb, yb, out=xb)
      np.multiply(xb, neg_lr, out=xb)
      np.add(pb, xb, out=pb)  # p - lr (u + wd p)

  pool = ThreadPoolExecutor(threads)

  def step():
    count[0] += 1
    r1 = f32(1) / (f32(1) - b1 ** f32(count[0]))
    r2 = f32(1) / (f32(1) - b2 ** f32(count[0]))
    list(pool.map(lambda lo: update(lo, r1, r2), range(0, n, chunk)))

  return _timed(step, steps)


def _worker_stream(n: int, threads: int, steps: int) -> list[float]:
  """Adam's bytes without its arithmetic: p, m, v read and written, g read, by a numba loop over
  the same chunks and threads as the kernel's."""
  from concurrent.futures import ThreadPoolExecutor

  import numba

  @numba.njit(nogil=True, error_model="numpy")
  def touch(p, m, v, g):
    for i in range(p.size):
      gi = g[i]
      p[i] += gi
      m[i] += gi
      v[i] += gi

  p, m, v, g = _arrays(n)
  chunk = 1 << 20
  pool = ThreadPoolExecutor(threads)

  def step():
    list(pool.map(lambda lo: touch(p[lo:lo + chunk], m[lo:lo + chunk], v[lo:lo + chunk],
                                   g[lo:lo + chunk]), range(0, n, chunk)))

  return _timed(step, steps)


def _run_worker(spec: str) -> None:
  contender, threads, n, steps = json.loads(spec)
  if contender in ("jzero", "jzero, bf16 out"):
    times = _worker_jzero(n, threads, steps, bf16_out=contender != "jzero")
  elif contender == "XLA:CPU optax":
    times = _worker_xla(n, threads, steps)
  elif contender == "numpy + threads":
    times = _worker_numpy(n, threads, steps)
  elif contender == "DeepSpeed":
    times = _worker_deepspeed(n, threads, steps)
  elif contender == "copy":
    times = _worker_copy(n, threads, steps)
  else:
    times = _worker_stream(n, threads, steps)
  print("RESULT " + json.dumps({"seconds": min(times), "all": times}), flush=True)


# -- the driver --------------------------------------------------------------------------------

def _measure(python: str, contender: str, threads: int, n: int, steps: int) -> float:
  """The fastest of ``steps`` steps, in seconds, in a fresh process pinned to ``threads``
  cores."""
  cores = sorted(os.sched_getaffinity(0))[:threads]
  env = dict(os.environ, OMP_NUM_THREADS=str(threads), JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH")])))
  spec = json.dumps([contender, threads, n, steps])
  done = subprocess.run([python, __file__, "--worker", spec], env=env, capture_output=True,
                        text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
  results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  if done.returncode != 0 or not results:
    raise RuntimeError(f"{contender} at {threads} threads failed:\n{done.stdout[-3000:]}"
                       f"\n{done.stderr[-3000:]}")
  return json.loads(results[-1][len("RESULT "):])["seconds"]


def main() -> None:
  args = _parse()
  if args.worker is not None:
    _run_worker(args.worker)
    return
  n = int(args.params)
  thread_counts = [int(t) for t in args.threads.split(",")]
  cores = len(os.sched_getaffinity(0))
  if max(thread_counts) > cores:
    sys.exit(f"--threads {args.threads}: this process may use {cores} cores.")
  contenders = [c for c in CONTENDERS if c != "DeepSpeed" or args.deepspeed_python]
  if not args.deepspeed_python:
    print("DeepSpeed: not measured (give --deepspeed-python PYTHON: a venv with torch's CPU wheel "
          "and deepspeed; its cpu_adam op builds with ninja and g++ on first use).")
  seconds: dict[tuple[str, int], list[float]] = {}
  for r in range(args.rounds):
    for threads in thread_counts:
      for contender in contenders:
        python = args.deepspeed_python if contender == "DeepSpeed" else sys.executable
        s = _measure(python, contender, threads, n, args.steps)
        seconds.setdefault((contender, threads), []).append(s)
        print(f"round {r + 1}/{args.rounds}  {threads} thread(s)  {contender:16s} "
              f"{n / s / 1e9:7.3f} G elements/s", flush=True)
  _report(args, n, thread_counts, contenders, seconds)


def _report(args: argparse.Namespace, n: int, thread_counts: list[int], contenders: list[str],
            seconds: dict) -> None:
  from jzero.analysis.tables import markdown_table

  rate = {key: n / statistics.median(s) for key, s in seconds.items()}  # elements per second
  # The limits in Adam's elements per second: the copy rate's bytes over 28, and the 28-B stream.
  copy_limit = {t: rate["copy", t] * COPY_BYTES / ADAM_BYTES for t in thread_counts}
  stream_limit = {t: rate["28-B stream", t] for t in thread_counts}
  header = ["contender", "threads", "G elements/s", "vs DeepSpeed", "GB/s at 28 B/param",
            "of the copy limit", "of the 28-B stream"]
  rows = []
  for threads in thread_counts:
    for contender in contenders:
      if contender in LIMITS:
        continue
      r = rate[contender, threads]
      ds = rate.get(("DeepSpeed", threads))
      rows.append([contender, threads, f"{r / 1e9:.3f}", f"{r / ds:.2f}" if ds else "-",
                   f"{r * ADAM_BYTES / 1e9:.1f}", f"{r / copy_limit[threads]:.2f}",
                   f"{r / stream_limit[threads]:.2f}"])
  limits = "; ".join(
    f"{t} thread(s): copy {rate['copy', t] * COPY_BYTES / 1e9:.1f} GB/s (limit "
    f"{copy_limit[t] / 1e9:.3f} G elements/s), 28-B stream {stream_limit[t] / 1e9:.3f} G "
    f"elements/s ({stream_limit[t] * ADAM_BYTES / 1e9:.1f} GB/s)" for t in thread_counts)
  meta = (f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.system()}; {n / 1e6:.0f}M fp32 parameters, AdamW, median over "
          f"{args.rounds} rounds of each run's fastest of {args.steps} steps; limits measured "
          f"beside them: {limits}")
  lines = [meta, "", *markdown_table(header, rows)]
  if "DeepSpeed" not in contenders:
    lines += ["", "DeepSpeed not measured: no --deepspeed-python given."]
  text = "\n".join(lines)
  print()
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "host_adam.md").write_text(text + "\n")
  (out / "host_adam.json").write_text(json.dumps(
    {"meta": meta, "params": n, "seconds": {f"{c}@{t}": s for (c, t), s in seconds.items()}},
    indent=1))


if __name__ == "__main__":
  main()
