"""``jzero estimate``: ZeRO's per-device memory table from a parameter count or the embedded model's
shapes, and which stage fits a budget (the arithmetic: :mod:`jzero.analysis.estimate`)."""

from __future__ import annotations

import argparse
import re

from jzero.analysis import estimate as estimate_lib
from jzero.analysis.estimate import (DEFAULT_PERSISTENCE_THRESHOLD, PRECISION_BYTES,
                                     activation_bytes, estimate, format_bytes, format_estimates,
                                     largest_gathered_numel, param_shapes, persistent_numel,
                                     recommend, transformer_layer_numel)
from jzero.errors import ConfigError
from jzero.tiers import registry

__all__ = ["add_parser", "add_estimate_arguments", "run_estimate", "parse_count", "parse_bytes"]


def add_parser(sub: argparse._SubParsersAction) -> None:
  e = sub.add_parser("estimate", help="per-device memory of the ZeRO stages (analytic, no "
                     "device work)")
  add_estimate_arguments(e)
  e.set_defaults(func=run_estimate)


_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {"": 1, "B": 1, **{prefix + suffix: base**i for i, prefix in enumerate("KMGT", 1)
                                  for suffix, base in (("", 1000), ("B", 1000), ("I", 1024),
                                                       ("IB", 1024))}}
_NUMBER = r"\s*(\d+(?:\.\d*)?(?:[eE]\+?\d+)?)\s*"


def parse_count(text: str) -> int:
  """'7e9', '7B', '350M', '6.4M' -> a parameter count."""
  m = re.fullmatch(_NUMBER + r"([KMBGT]?)\s*", text, re.IGNORECASE)
  if not m:
    raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count such as 7e9, 7B or 350M")
  return round(float(m[1]) * _COUNT_SUFFIX[m[2].upper()])


def parse_bytes(text: str) -> float:
  """'16GB', '80GiB', '512MB', '1e9' -> bytes (kB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary)."""
  m = re.fullmatch(_NUMBER + r"([KMGT]?I?B?)\s*", text, re.IGNORECASE)
  if not m or m[2].upper() not in _BYTE_UNITS:
    raise argparse.ArgumentTypeError(f"{text!r} is not a memory size such as 16GB or 80GiB")
  return float(m[1]) * _BYTE_UNITS[m[2].upper()]


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the ``jzero estimate`` flags to ``parser`` (see :func:`run_estimate`)."""
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--params", type=parse_count, help="parameter count, e.g. 7e9, 7B or 350M")
  what.add_argument("--model", choices=["default"],
                    help="the embedded GPT by its leaf shapes (stage-3 persistence counted); "
                         "--seq-len/--hidden/--layers/--heads reshape it")
  parser.add_argument("--devices", type=int, default=8, help="devices per node (default 8)")
  parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1); N = devices x nodes")
  parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                      help="one ZeRO stage (default: all)")
  parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                      help="dtype of params and grads (default fp16)")
  parser.add_argument("--optimizer-bytes", type=float, default=None, metavar="K",
                      help="optimizer-state bytes per param, fp32 master included (default: 12 in "
                           "fp16/bf16 = master + Adam moments, 8 in fp32 = moments only)")
  parser.add_argument("--offload-optimizer", choices=registry.devices("offload_optimizer"),
                      default=None,
                      help="also show the stages with the optimizer state offloaded")
  parser.add_argument("--offload-param", choices=registry.devices("offload_param"), default=None,
                      help="also show ZeRO-3 with the params offloaded")
  nvme = parser.add_argument_group("parameters on NVMe (--offload-param nvme; DeepSpeed's "
                                   "offload_param keys and defaults)")
  nvme.add_argument("--buffer-count", type=int, default=5,
                    help="host staging buffers for parameters read from NVMe (default 5)")
  nvme.add_argument("--buffer-size", type=parse_count, default=100_000_000,
                    help="elements per staging buffer (default 1e8)")
  nvme.add_argument("--max-in-cpu", type=parse_count, default=1_000_000_000,
                    help="partitioned parameter elements kept in host memory (default 1e9)")
  parser.add_argument("--hpz", type=int, default=1, metavar="S",
                      help="ZeRO++ zero_hpz_partition_size: the ZeRO-3 rows add hpZ's secondary "
                           "copy of the params over S devices (default 1: off)")
  parser.add_argument("--persistence-threshold", type=parse_count,
                      default=DEFAULT_PERSISTENCE_THRESHOLD,
                      help="stage3_param_persistence_threshold, with --model (default 100000)")
  acts = parser.add_argument_group("activations (Korthikanti et al. 2022), with --micro-batch")
  acts.add_argument("--micro-batch", type=int, default=None, help="sequences per device")
  acts.add_argument("--seq-len", type=int, default=None)
  acts.add_argument("--hidden", "--d-model", dest="hidden", type=int, default=None)
  acts.add_argument("--layers", type=int, default=None)
  acts.add_argument("--heads", type=int, default=None)
  acts.add_argument("--checkpoint-activations", action="store_true",
                    help="full activation checkpointing: keep each layer's input only")
  parser.add_argument("--largest-layer", type=parse_count, default=None, metavar="N",
                      help="ZeRO-3's gathered working set: elements of the largest layer gathered "
                           "at once (DeepSpeed's largest_layer_params), twice for the prefetched "
                           "next one. Default: with --model its layer; with --hidden a transformer "
                           "layer, 12H² + 13H; otherwise not counted")
  fit = parser.add_argument_group("which stage?")
  fit.add_argument("--budget", type=parse_bytes, default=None,
                   help="device memory, e.g. 16GB or 80GiB: the smallest stage that fits")
  fit.add_argument("--host-budget", type=parse_bytes, default=None,
                   help="host memory per node, checked for the offload variants")
  fit.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of each budget kept free (default 0.1)")


def _estimate_inputs(args: argparse.Namespace):
  """(Ψ or leaf shapes, activation shape (s, h, L, a) or None, description of the model)."""
  if args.model:
    from jzero.modeling.model_adapter import as_model  # noqa: PLC0415 (only --model needs the model code)
    from jzero.models import GPT, GPTConfig  # noqa: PLC0415

    d = GPTConfig()
    cfg = GPTConfig(seq_len=args.seq_len or d.seq_len, d_model=args.hidden or d.d_model,
                    n_layers=args.layers or d.n_layers, n_heads=args.heads or d.n_heads)
    adapter = as_model(lambda rngs: GPT(cfg, rngs=rngs))
    params = param_shapes(adapter.abstract_params(None, None), adapter.stacked_layers)
    shape = (cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads)
    what = f"default GPT, {cfg.n_layers} layers x d {cfg.d_model}, seq {cfg.seq_len}"
  else:
    params, shape = args.params, (args.seq_len, args.hidden, args.layers, args.heads)
    what = "given count"
    missing = [f for f, v in zip(("--seq-len", "--hidden", "--layers", "--heads"), shape)
               if v is None]
    if args.micro_batch and missing:
      raise ConfigError(f"--micro-batch estimates activations and needs the transformer's shape: "
                        f"give {' '.join(missing)} too (or use --model default).")
  return params, (shape if args.micro_batch else None), what


def _estimate_rows(args: argparse.Namespace) -> list[tuple[int, str | None, str | None]]:
  """(stage, offload_optimizer, offload_param) of each table row: the stages, then the offload
  variants of those stages that have them (an explicit --stage must have them)."""
  stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
  rows = [(s, None, None) for s in stages]
  if args.offload_optimizer or args.offload_param:
    for s in stages:
      problem = estimate_lib.offload_problem(s, args.offload_optimizer, args.offload_param)
      if problem and args.stage is not None:
        raise ConfigError(problem)
      if not problem:
        rows.append((s, args.offload_optimizer, args.offload_param))
  return rows


def _print_deepspeed_host(rows: list) -> None:
  """Host bytes per node as DeepSpeed's estimator counts them, beside jzero's, and why they
  differ (:attr:`jzero.analysis.estimate.Estimate.deepspeed_host_per_node`)."""
  compared = [(e, e.deepspeed_host_per_node) for e in rows]
  compared = [(e, ds) for e, ds in compared if ds is not None]
  if not compared:
    return
  per_node = rows[0].devices_per_node
  print(f"host per node: jzero's state (host/process x {per_node}) and DeepSpeed's estimate (its "
        f"1.5x buffer factor over the offloaded state or the fp32 model each process loads, "
        f"4 B/param per process):")
  for e, ds in compared:
    print(f"  {e.name}: jzero {format_bytes(e.host_per_node)}, DeepSpeed {format_bytes(ds)}")
  print("  jzero's figure is the state it creates in place (from a model factory or a Linen "
        "module); a script that builds the model instance before initialize holds its fp32 "
        "copy per process until the state is placed, and the host allocator needs headroom: "
        "size host memory with the larger figure.")


def run_estimate(args: argparse.Namespace) -> int:
  """``jzero estimate``: prints the per-device table and, with ``--budget``, which stage fits.

  Raises:
    ConfigError: flags that do not go together (the CLI prints it and exits with status 2).
  """
  params, act_shape, what = _estimate_inputs(args)
  p = PRECISION_BYTES[args.precision]
  k = args.optimizer_bytes
  if k is None:
    k = 8 if args.precision == "fp32" else 12
  acts = 0.0
  if act_shape:
    acts = activation_bytes(args.micro_batch, *act_shape, bytes_per_element=p,
                            checkpointing=args.checkpoint_activations)
  largest = args.largest_layer
  if largest is None and not isinstance(params, int):
    largest = largest_gathered_numel(params, args.persistence_threshold)
  elif largest is None and args.hidden:
    largest = transformer_layer_numel(args.hidden)
  common = dict(param_bytes=p, optimizer_bytes=k, persistence_threshold=args.persistence_threshold,
                activations=acts, gathered=(largest or 0, 0), prefetch=True,
                param_buffer_elements=args.buffer_count * args.buffer_size,
                param_cache_elements=args.max_in_cpu)
  if args.hpz < 1 or (args.devices * args.nodes) % args.hpz:
    raise ConfigError(f"--hpz {args.hpz}: the hpZ group must divide the {args.devices * args.nodes} "
                      f"devices (usually --hpz {args.devices}, the devices per node).")
  rows = [estimate(params, s, args.devices, args.nodes, offload_optimizer=o, offload_param=q,
                   hpz_partition_size=args.hpz if s == 3 else 1, **common)
          for s, o, q in _estimate_rows(args)]
  first = rows[0]
  print(f"jzero estimate: {first.num_params:,} params ({what}); N = {first.devices} devices "
        f"({args.nodes} x {args.devices} per node); {args.precision} params and grads ({p} B "
        f"each), optimizer state K = {k:g} B/param")
  if not isinstance(params, int):
    print(f"  ZeRO-3 keeps {persistent_numel(params, args.persistence_threshold):,} params "
          f"replicated (persistence threshold {args.persistence_threshold:,})")
  if act_shape:
    s, h, layers, heads = act_shape
    print(f"  activations: micro-batch {args.micro_batch} x seq {s}, hidden {h}, {layers} layers, "
          f"{heads} heads, checkpointing {'on' if args.checkpoint_activations else 'off'}: "
          f"{format_bytes(acts)} per device")
  if any(e.stage == 3 for e in rows):
    print(f"  ZeRO-3 gathers the largest layer ({largest:,} params) and prefetches the next: "
          f"{format_bytes(2 * p * largest)} per device, in the device total" if largest else
          "  ZeRO-3's device total leaves out the gathered working set (the largest layer, twice "
          "with prefetch): give --largest-layer N, or --hidden H for a transformer layer")
  if args.offload_param == "nvme":
    print(f"  parameters on NVMe: host keeps up to {args.max_in_cpu:,} partitioned elements "
          f"(max_in_cpu) and {args.buffer_count} x {args.buffer_size:,} elements of staging "
          f"buffers per process, in host/process; the rest of the partition is on NVMe")
  print("per device (host and NVMe: per process; GB = 1e9 bytes):")
  print(format_estimates(rows))
  _print_deepspeed_host(rows)
  if args.budget is not None:
    choice = recommend(params, args.budget, args.devices, args.nodes, headroom=args.headroom,
                       host_budget=args.host_budget, **common)
    print(f"which stage? {choice}")
  return 0
