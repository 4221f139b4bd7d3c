"""Benchmark: ZeRO++ (qwZ, hpZ, qgZ) against plain ZeRO-3 on a node x local CPU mesh, one run.

  python bench/zeropp.py [--nodes 2] [--local 4] [--steps 10] [--precision bf16] [--small]

For plain ZeRO-3, each ZeRO++ switch alone and all three together it compiles the step of the
default GPT (jzero.models.GPT, 6.4M parameters; ``--small``: a 2-layer d_model=128 one) on a
``node x local`` mesh of simulated CPU devices and prints one row: the bytes each device sends
per step over collectives that cross the node axis (from the compiled HLO, as
:meth:`jzero.analysis.hlo.CommVolume.crossing` counts them), their ratio to ZeRO-3's, the bytes of
every collective, and the median step time with its ratio to ZeRO-3's. Steps are timed
round-robin (one step of each configuration in turn) so that the ratios compare runs under the
same machine load. Every configuration partitions every leaf
(``stage3_param_persistence_threshold: 0``).

Two honest notes. A CPU has no slow link: the simulated devices share one memory, so the
"network" costs nothing and ZeRO++'s quantize / dequantize work shows up as extra time; the win is
in the bytes, which are what a real inter-node link pays for. And XLA's CPU backend carries a bf16
reduce-scatter out in f32 (a sum cannot travel as bits), so ZeRO-3's gradient bytes are also
shown at bf16 width ("ZeRO-3 on a GPU"), the figure a GPU would move; the ratio uses that one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {
    "ZeRO-3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": None},  # the devices per node
    "qgZ": {"zero_quantized_gradients": True},
    "ZeRO++ (all three)": {"zero_quantized_weights": True, "zero_hpz_partition_size": None,
                           "zero_quantized_gradients": True},
}


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--nodes", type=int, default=2)
  p.add_argument("--local", type=int, default=4, help="devices per node")
  p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
  p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
  p.add_argument("--small", action="store_true", help="a 2-layer d_model=128 GPT (faster)")
  return p.parse_args()


def main() -> int:
  args = _parse()
  import jzero
  jzero.simulate_cpu_devices(args.nodes * args.local)
  import jax

  from jzero.runtime.data import ByteCorpus
  from jzero.sharding.mesh import MeshSpec
  from jzero.models import GPT, GPTConfig, lm_loss
  from jzero.analysis.hlo import comm_volume

  cfg = GPTConfig(d_model=128, n_layers=2, n_heads=4, seq_len=32) if args.small else GPTConfig()
  corpus = ByteCorpus.load(None, seq_len=cfg.seq_len, max_bytes=1 << 20)
  n = args.nodes * args.local
  mesh = MeshSpec.from_dict({"axes": {"node": args.nodes, "local": args.local},
                             "zero_axes": ["node", "local"], "batch_axes": ["node", "local"]})
  width = 2 if args.precision == "bf16" else 4
  runs = {}
  for name, keys in MODES.items():
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    zero.update({k: (args.local if v is None else v) for k, v in keys.items()})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "zero_optimization": zero}
    if args.precision == "bf16":
      config["bf16"] = {"enabled": True}
    engine = jzero.initialize(lambda rngs: GPT(cfg, rngs=rngs), lm_loss, config, mesh=mesh)
    state = engine.init(jax.random.key(0))
    batch = engine.shard_batch(corpus.batch(0, n))
    t0 = time.perf_counter()
    compiled = engine.compile_step(state, batch)
    compile_s = time.perf_counter() - t0
    psi = sum(l.numel for l in engine.plan.leaf_list())
    volume = comm_volume(compiled, engine.mesh, num_params=psi, bytes_per_param=width)
    state, _ = engine.train_step(state, batch)  # warm-up
    jax.block_until_ready(state)
    runs[name] = dict(engine=engine, state=state, batch=batch, volume=volume, times=[],
                      compile_s=compile_s)
    print(f"compiled {name} in {compile_s:.1f} s", flush=True)
  for _ in range(args.steps):  # round-robin: every configuration under the same load
    for run in runs.values():
      t0 = time.perf_counter()
      run["state"], metrics = run["engine"].train_step(run["state"], run["batch"])
      jax.block_until_ready(metrics["loss"])
      run["times"].append(time.perf_counter() - t0)

  def crossing(volume, gpu_width: bool) -> float:
    total = 0.0
    for c in volume.ops:
      if "node" not in c.axes:
        continue
      widened = gpu_width and c.kind == "reduce-scatter" and c.payload == ("f32",) and width == 2
      total += c.step_bytes / 2 if widened else c.step_bytes
    return total

  base = runs["ZeRO-3"]
  base_cross = crossing(base["volume"], True)
  base_time = statistics.median(base["times"])
  mib = 2 ** 20
  print()
  print(f"ZeRO++ vs ZeRO-3: {args.nodes} nodes x {args.local} devices (simulated CPU), "
        f"{psi:,} params, {args.precision}, median of {args.steps} steps")
  header = (f"{'configuration':<20}{'cross-node MiB':>15}{'/ ZeRO-3':>10}{'all MiB':>10}"
            f"{'step ms':>10}{'/ ZeRO-3':>10}{'compile s':>11}")
  print(header)
  print("-" * len(header))
  if width == 2:
    raw = crossing(base["volume"], False)
    print(f"{'ZeRO-3 (CPU HLO)':<20}{raw / mib:>15.3f}{raw / base_cross:>10.3f}"
          f"{base['volume'].total_bytes / mib:>10.3f}{'':>10}{'':>10}{'':>11}")
  for name, run in runs.items():
    cross = crossing(run["volume"], name == "ZeRO-3")
    step = statistics.median(run["times"])
    label = "ZeRO-3 on a GPU" if name == "ZeRO-3" and width == 2 else name
    print(f"{label:<20}{cross / mib:>15.3f}{cross / base_cross:>10.3f}"
          f"{run['volume'].total_bytes / mib:>10.3f}{step * 1e3:>10.1f}{step / base_time:>10.2f}"
          f"{run['compile_s']:>11.1f}")
  print()
  print("Bytes: per device per step, over collectives whose groups span the node axis (a "
        "collective over all devices counts whole, as the ZeRO++ paper counts ZeRO-3's 3 Psi).")
  print("Time: a CPU has no slow link -- simulated devices share one memory, so moving fewer "
        "bytes saves nothing here and quantizing costs compute; the win shows in bytes, not "
        "seconds.")
  print()
  print("per-axis table, ZeRO++ (all three):")
  print(runs["ZeRO++ (all three)"]["volume"].table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
