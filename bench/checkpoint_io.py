"""What checkpoint checksums cost: the default job's checkpoint saved and loaded, timed.

``python bench/checkpoint_io.py [--saves 6]`` builds the default job (configs/zero3.json, the
embedded GPT, 8 simulated CPU devices), takes one training step and saves the state ``--saves``
times. For each save it measures the whole save (call to finalized, ``latest`` moved) and, inside
it, the time spent checksumming the files (``layout._checksum``, timed in place); then it loads the
checkpoint as often and times the file verification inside each load. It prints a table and the
cost per GB. Times are medians; this machine is shared and noisy, so the ratio -- measured inside
the same runs -- is the number to read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jzero

jzero.simulate_cpu_devices(8)

import jax  # noqa: E402

from jzero.checkpoint import layout  # noqa: E402
from jzero.models import GPT, GPTConfig, lm_loss  # noqa: E402
from jzero.runtime.data import ByteCorpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _timed_checksums(spent: list[float]):
  original = layout._checksum

  def timed(path):
    t0 = time.perf_counter()
    try:
      return original(path)
    finally:
      spent.append(time.perf_counter() - t0)

  layout._checksum = timed


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--saves", type=int, default=6)
  args = parser.parse_args(argv)
  cfg = GPTConfig()
  engine = jzero.initialize(lambda rngs: GPT(cfg, rngs=rngs), lm_loss,
                            ROOT / "configs" / "zero3.json", total_num_steps=250,
                            auto_values={"micro_batch_size": 4})
  state = engine.init(jax.random.key(0))
  corpus = ByteCorpus.load(None, seq_len=cfg.seq_len, max_bytes=1 << 20)
  state, _ = engine.train_step(state, engine.shard_batch(corpus.batch(0, engine.global_batch_size)))
  spent: list[float] = []
  _timed_checksums(spent)
  saves, hashing, loads, verifying = [], [], [], []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(args.saves):
      del spent[:]
      t0 = time.perf_counter()
      engine.save_checkpoint(state, tmp, tag=f"s{i}")
      engine.wait_for_checkpoints()
      saves.append(time.perf_counter() - t0)
      hashing.append(sum(spent))
    files = layout.recorded_files(Path(tmp) / "s0")
    size = sum(files.values())
    for i in range(args.saves):
      del spent[:]
      t0 = time.perf_counter()
      jax.block_until_ready(engine.load_checkpoint(tmp, f"s{i}"))
      loads.append(time.perf_counter() - t0)
      verifying.append(sum(spent))
  med = statistics.median
  gb = size / 1e9
  print(f"default job checkpoint: {size / 2**20:.1f} MiB in {len(files)} files; jax "
        f"{jax.__version__}, {args.saves} saves and loads, medians")
  print("| phase | total s | checksum s | checksum share | checksum s per GB |")
  print("|---|---|---|---|---|")
  print(f"| save (call to finalized) | {med(saves):.3f} | {med(hashing):.3f} | "
        f"{med(h / s for h, s in zip(hashing, saves)):.1%} | {med(hashing) / gb:.2f} |")
  print(f"| load (verify + restore) | {med(loads):.3f} | {med(verifying):.3f} | "
        f"{med(v / l for v, l in zip(verifying, loads)):.1%} | {med(verifying) / gb:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
