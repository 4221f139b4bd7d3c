"""Bit-for-bit digests of the train step over a matrix of configs: did a change move any number?

  python bench/step_digest.py [--write digests.json] [--check digests.json] [--only SUBSTRING]

For each configuration below (ZeRO stages 0-3, fp32 / bf16 / fp16, gradient accumulation,
ZeRO-Offload's stream and host updates, parameter offload, the NVMe tiers, ZeRO++, the delayed
update, activation checkpointing, a step whose gradient is not finite) it trains the small
GPT of the tests on 8 simulated CPU devices for a few steps on fixed batches and prints a SHA-256
of every loss, metric and array of the final state (the full state: what the tiers hold outside
it too, read as a checkpoint would). ``--write`` saves the table; ``--check`` compares against
a saved one and exits 1 naming every configuration whose digest moved. A refactor that claims
"numbers unchanged" runs ``--write`` before it and ``--check`` after.

Each configuration runs in this one process; the whole matrix takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import jzero  # noqa: E402
from jzero.models import GPT, GPTConfig, lm_loss  # noqa: E402
from jzero.runtime.data import ByteCorpus  # noqa: E402

MODEL = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)
STEPS = 3


def _config(stage: int, *, precision: str = "fp32", gas: int = 1, **zero) -> dict:
  cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
         "gradient_clipping": 1.0, "steps_per_print": 1000,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                   "weight_decay": 0.1}},
         "zero_optimization": {"stage": stage, **zero}}
  if precision == "bf16":
    cfg["bf16"] = {"enabled": True}
  if precision == "fp16":
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
  return cfg


def _matrix(nvme: str) -> dict[str, dict]:
  threshold = {"stage3_param_persistence_threshold": 0}
  host = lambda update: {"offload_optimizer": {"device": "cpu", "update": update}}
  nvme_opt = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
  nvme_par = {**threshold, "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0,
                                             "buffer_count": 2, "buffer_size": 10**5}}
  m = {}
  for stage in (0, 1, 2, 3):
    m[f"stage {stage} fp32"] = _config(stage)
  m["stage 3 fp32 threshold 0"] = _config(3, **threshold)
  m["stage 2 fp32 gas 2"] = _config(2, gas=2)
  m["stage 3 bf16 gas 2"] = _config(3, precision="bf16", gas=2)
  m["stage 1 bf16"] = _config(1, precision="bf16")
  m["stage 2 fp16"] = _config(2, precision="fp16")
  m["stage 3 fp16"] = _config(3, precision="fp16", **threshold)
  m["stage 2 offload stream fp32"] = _config(2, **host("stream"))
  m["stage 3 offload host bf16"] = _config(3, precision="bf16", **host("host"))
  m["stage 3 offload_param cpu fp32"] = _config(3, **threshold,
                                                offload_param={"device": "cpu"})
  m["stage 3 offload_param cpu bf16 + optimizer cpu"] = _config(
      3, precision="bf16", **threshold, offload_param={"device": "cpu"}, **host("stream"))
  m["stage 2 optimizer nvme fp32"] = _config(2, **nvme_opt)
  m["stage 3 params nvme bf16"] = _config(3, precision="bf16", **nvme_par)
  m["stage 3 infinity fp32"] = _config(3, **nvme_par, **host("stream"))
  m["stage 3 zero++ qwZ hpZ qgZ bf16"] = _config(
      3, precision="bf16", **threshold, zero_quantized_weights=True, zero_hpz_partition_size=4,
      zero_quantized_gradients=True)
  m["stage 2 delayed update fp32"] = _config(
      2, offload_optimizer={"device": "cpu", "update": "stream", "delayed_update": True})
  m["stage 3 delayed update warmup fp16"] = _config(
      3, precision="fp16", offload_optimizer={"device": "cpu", "update": "stream",
                                              "delayed_update": True, "delayed_update_warmup": 1})
  m["stage 3 activation checkpointing"] = {
      **_config(3), "activation_checkpointing": {"partition_activations": True}}
  m["stage 3 cpu checkpointing bf16"] = {
      **_config(3, precision="bf16"),
      "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
  m["stage 1 fp32 non-finite step"] = _config(1)
  m["stage 3 fp32 non-finite step"] = _config(3)
  m["stage 2 fp16 non-finite step"] = _config(2, precision="fp16")
  return m


def _digest(engine, state, losses: list, metrics: list) -> str:
  h = hashlib.sha256()
  h.update(np.asarray(losses, np.float64).tobytes())
  for m in metrics:
    for key in sorted(m):
      h.update(key.encode())
      h.update(np.asarray(m[key]).tobytes())
  full = engine.full_state(state) if hasattr(engine, "full_state") else state
  for leaf in jax.tree.leaves(full):
    array = np.asarray(jax.device_get(leaf))
    h.update(str(array.dtype).encode())
    h.update(array.tobytes())
  return h.hexdigest()[:16]


def run(name: str, config: dict, corpus: ByteCorpus) -> str:
  """Trains ``STEPS`` steps; a "non-finite" configuration's second batch holds a token id past
  the embedding (a NaN lookup: the step is skipped)."""
  engine = jzero.initialize(lambda rngs: GPT(MODEL, rngs=rngs), lm_loss, config)
  engine.check_input_ids = "non-finite" not in name
  state = engine.init(jax.random.key(0))
  losses, metrics = [], []
  for step in range(STEPS):
    batch = corpus.batch(step, engine.global_batch_size)
    if step == 1 and "non-finite" in name:
      batch = {k: v.copy() for k, v in batch.items()}
      batch["tokens"][0, 3] = MODEL.vocab_size + 44
    state, m = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(m["loss"]))
    metrics.append({k: np.asarray(v) for k, v in m.items()})
  return _digest(engine, state, losses, metrics)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--write", help="save the digests to this JSON file")
  p.add_argument("--check", help="compare with the digests in this JSON file")
  p.add_argument("--only", default="", help="run the configurations whose name contains this")
  args = p.parse_args()
  corpus = ByteCorpus.load(None, seq_len=MODEL.seq_len, max_bytes=1 << 20)
  digests = {}
  with tempfile.TemporaryDirectory() as nvme:
    for name, config in _matrix(nvme).items():
      if args.only not in name:
        continue
      digests[name] = run(name, config, corpus)
      print(f"{digests[name]}  {name}", flush=True)
  if args.write:
    Path(args.write).write_text(json.dumps(digests, indent=1) + "\n")
  if args.check:
    expected = json.loads(Path(args.check).read_text())
    moved = [n for n in digests if n in expected and expected[n] != digests[n]]
    for n in moved:
      print(f"MOVED: {n}: {expected[n]} -> {digests[n]}")
    print(f"{len(digests) - len(moved)} of {len(digests)} unchanged")
    return 1 if moved else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
