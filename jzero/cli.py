"""The jzero command line.

``jzero train --config configs/zero3.json`` trains the embedded GPT on the embedded corpus (the
Python standard library's source, as bytes) on 8 simulated CPU devices, with a progress bar, the
loss every ``steps_per_print`` steps, and a summary at the end.

``--checkpoint-dir DIR`` saves sharded checkpoints there and resumes from the latest one.
``jzero launch --num_processes 2 --num_cpu_devices 4 --module jzero train ...`` runs a script (or
``jzero train``) as several processes, here or over ssh on a hostfile's hosts (:mod:`jzero.launch`);
``jzero train`` joins them, or a SLURM / Open MPI / Kubernetes job, by itself
(:mod:`jzero.distributed`), and stops at a step all processes agree on when one gets SIGTERM,
saving a checkpoint.
``jzero estimate --params 7e9 --devices 8`` prints ZeRO's per-device memory table.
``jzero aot --config ... --gpu h100 --devices 8`` compiles the step for a GPU topology that is not
present (:mod:`jzero.aot`).
``jzero convert CKPT --safetensors model.safetensors`` consolidates a sharded training checkpoint
into plain weights (DeepSpeed's ``zero_to_fp32``); ``jzero inspect CKPT`` describes one.

Bad input (config, mesh, data, checkpoint) is reported as one paragraph on stderr with exit status
2, before any device work.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Sequence

from jzero.errors import JZeroError
from jzero.models.gpt import GPTConfig

DEFAULT_DEVICES = 8


def _add_device_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--devices", type=int, default=None,
                 help="number of SIMULATED CPU devices (default 8, for trying jzero on a "
                      "laptop; started by `jzero launch` or a cluster: the launcher's "
                      "--num_cpu_devices, else the accelerators); on GPUs or TPUs pass --devices "
                      "0 to use the accelerators JAX finds")
  p.add_argument("--mesh", default=None,
                 help="mesh file (configs/mesh/*.yaml); default: all devices on one data axis")


def _add_process_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("several processes (jax.distributed; run the same command in each)")
  g.add_argument("--coordinator", default=None,
                 help="HOST:PORT of process 0's coordinator (with --num-processes, --process-id); "
                      "--devices then counts each process's devices")
  g.add_argument("--num-processes", type=int, default=None, help="number of processes")
  g.add_argument("--process-id", type=int, default=None, help="this process's index, from 0")


def _check_process_args(args: argparse.Namespace) -> None:
  given = [a is not None for a in (args.coordinator, args.num_processes, args.process_id)]
  if any(given) and not all(given):
    raise JZeroError("--coordinator, --num-processes and --process-id go together: give all three "
                     "(the same coordinator and count in every process) or none.")
  if all(given):
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      raise JZeroError(f"--process-id {args.process_id} must be in [0, --num-processes "
                       f"{args.num_processes}).")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise JZeroError(f"--coordinator {args.coordinator!r} must be HOST:PORT, e.g. 127.0.0.1:7777.")


def _join(args: argparse.Namespace) -> None:
  """Simulated devices, then the process job (jzero.distributed.init_distributed): from the flags,
  from `jzero launch`'s environment, or from a cluster's (SLURM, Open MPI, Kubernetes)."""
  import os
  from jzero import distributed

  devices = args.devices
  if devices is None:  # launched: the launcher's --num_cpu_devices, or the real accelerators
    launched = (args.coordinator is not None or distributed.ENV_COORDINATOR in os.environ
                or distributed.cluster_environment() is not None)
    devices = 0 if launched else DEFAULT_DEVICES
  if args.coordinator is not None:
    distributed.init_distributed(args.coordinator, args.num_processes, args.process_id,
                                 num_cpu_devices=devices or None)
  else:
    distributed.init_distributed(num_cpu_devices=devices or None)


def _train(args: argparse.Namespace) -> int:
  _check_process_args(args)
  _join(args)
  import jax
  import numpy as np
  from tqdm.auto import tqdm  # a notebook widget under Jupyter, text in a terminal
  from tqdm.contrib.logging import logging_redirect_tqdm

  import jzero
  from jzero.data import ByteCorpus
  from jzero.models import GPT, lm_loss
  from jzero import checkpoint, distributed, memory_report
  from jzero.precision import MIN_SCALE_ERROR

  primary = jax.process_index() == 0
  say = print if primary else (lambda *a, **k: None)  # process 0 reports for the job
  if not primary:
    logging.getLogger("jzero").setLevel(logging.WARNING)
  config = jzero.Config.load(args.config)
  model_cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                        n_heads=args.heads)
  corpus = ByteCorpus.load(args.data, seq_len=model_cfg.seq_len)
  auto = {"micro_batch_size": args.micro_batch}
  if args.warmup_steps is not None:
    auto["warmup_num_steps"] = args.warmup_steps
  engine = jzero.initialize(model=lambda rngs: GPT(model_cfg, rngs=rngs), loss_fn=lm_loss,
                            config=config, mesh=args.mesh, total_num_steps=args.steps,
                            auto_values=auto)
  cfg = engine.config
  say(f"jzero: ZeRO stage {cfg.zero_optimization.stage}, {cfg.precision}, mesh "
      f"{engine.mesh.describe()}")
  say(f"jzero: data {corpus.source} ({len(corpus) / 2**20:.1f} MiB); batch "
      f"{cfg.train_batch_size} x {model_cfg.seq_len} tokens = micro {cfg.train_micro_batch_size_per_gpu} "
      f"x gas {cfg.gradient_accumulation_steps} x dp {engine.mesh.dp_size}")
  state = engine.init(jax.random.key(args.seed))
  start = 0
  if args.resume and (not args.checkpoint_dir
                      or checkpoint.latest_step(args.checkpoint_dir) is None):
    raise JZeroError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir!r} to "
                     f"resume from.")
  if args.checkpoint_dir and checkpoint.latest_step(args.checkpoint_dir) is not None:
    state = engine.load_checkpoint(args.checkpoint_dir)
    start = int(state.step)
    say(f"jzero: resumed from {args.checkpoint_dir} at step {start}")
  plan = engine.plan
  if plan.uses_host or plan.uses_nvme_store:  # offload: what this process holds, before training
    from jzero.memory import format_bytes
    est, local = engine.memory_report(state).estimate, jax.local_device_count()
    tiers = [f"{tier} {format_bytes(est.tier_total(tier) * local)}"
             for tier in ("host", "nvme") if est.tier_total(tier)]
    if engine.nvme_store is not None:  # what the store holds (params, masters, state), measured
      tiers.append(f"NVMe store {format_bytes(engine.nvme_store.bytes_per_slot)} per slot "
                   f"(two slots on disk)")
    say(f"jzero: offload: predicted model states per process ({local} devices): "
        f"{', '.join(tiers)}; device {format_bytes(est.device_total)} per device")
  n_params = sum(l.numel for l in plan.leaf_list())
  say(f"jzero: model GPT {model_cfg.n_layers} layers x d {model_cfg.d_model}, {n_params / 1e6:.2f}M "
      f"parameters")

  losses, step_times = [], []
  tokens_per_step = cfg.train_batch_size * model_cfg.seq_len
  bar = tqdm(range(start, args.steps), desc="train", unit="step", dynamic_ncols=True,
             initial=start, total=args.steps, disable=args.no_progress or not primary)
  with logging_redirect_tqdm(loggers=[logging.getLogger("jzero")]):
    rows = engine.local_rows()  # each process reads only the rows its devices hold
    for step in bar:
      batch = engine.shard_batch(corpus.batch(step, cfg.train_batch_size, seed=args.seed,
                                              rows=rows))
      t0 = time.perf_counter()
      state, metrics = engine.train_step(state, batch)  # logs every steps_per_print steps
      loss = float(metrics["loss"])  # waits for the step
      step_times.append(time.perf_counter() - t0)
      if bool(metrics["min_scale_overflow"]):
        raise JZeroError(f"step {step + 1}: {MIN_SCALE_ERROR} (fp16 overflow with the loss scale "
                         f"at min_loss_scale; DeepSpeed stops here too)")
      losses.append(loss)
      if args.losses_file and primary:
        with open(args.losses_file, "a") as f:
          f.write(f"{step + 1} {loss!r}\n")
      bar.set_postfix(loss=f"{loss:.3f}", lr=f"{float(metrics['lr']):.2e}")
      saved = args.checkpoint_dir and (step + 1 == args.steps or (
          args.save_every and (step + 1) % args.save_every == 0))
      if saved:
        engine.save_checkpoint(state, args.checkpoint_dir, keep=args.keep)  # async
      if step + 1 < args.steps and distributed.should_stop(step + 1):  # SIGTERM: all stop here
        bar.close()
        if not args.checkpoint_dir:
          print(f"jzero: process {jax.process_index()}: stopped by SIGTERM after step {step + 1}; "
                f"nothing saved (no --checkpoint-dir)", file=sys.stderr)
          return 143
        if not saved:
          engine.save_checkpoint(state, args.checkpoint_dir, keep=args.keep)
        engine.wait_for_checkpoints()
        say(f"jzero: preempted (SIGTERM): every process stopped after step {step + 1}; "
            f"checkpoint at step {checkpoint.latest_step(args.checkpoint_dir)} in "
            f"{args.checkpoint_dir}; run the same command again to resume")
        return 0
  bar.close()
  if args.checkpoint_dir:
    engine.wait_for_checkpoints()
    say(f"jzero: checkpoint at step {checkpoint.latest_step(args.checkpoint_dir)} in "
        f"{args.checkpoint_dir}")
  if not losses:
    say(f"jzero: nothing to train: the checkpoint is at step {start} of {args.steps}")
    return 0

  val = engine.eval_loss(state, corpus.batch(0, cfg.train_batch_size, seed=args.seed, split="val"))
  steady = step_times[1:] or step_times
  tail = losses[-min(10, len(losses)):]
  say()
  say(f"loss: start {losses[0]:.4f} -> end {float(np.mean(tail)):.4f} (mean of last {len(tail)} "
      f"steps); validation {val:.4f}")
  say(f"throughput: {tokens_per_step / float(np.median(steady)):,.0f} tokens/s (median step "
      f"{float(np.median(steady)) * 1e3:.0f} ms; first step incl. compile "
      f"{step_times[0]:.1f} s)")
  say(memory_report.format_memory_report(engine.memory_report(state)))
  return 0


def _host_only() -> None:
  """convert / inspect are host work: unless JAX has started, keep it off any accelerator (a
  training job may be using it)."""
  import jax
  from jax._src import xla_bridge  # backends_are_initialized has no public home in jax 0.10

  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")


def _convert(args: argparse.Namespace) -> int:
  _host_only()
  from jzero import checkpoint

  report = checkpoint.consolidate(args.checkpoint, tag=args.tag, safetensors=args.safetensors,
                                  orbax=args.orbax, dtype=args.dtype)
  print(f"jzero: checkpoint {report.tag!r} (step {report.step}): {report.leaves} leaves, {report.total_bytes / 2**20:.2f} MiB "
        f"of {report.dtype} weights (largest leaf {report.largest_leaf_bytes / 2**20:.2f} MiB)")
  for out in report.outputs:
    print(f"jzero: wrote {out}")
  return 0


def _inspect(args: argparse.Namespace) -> int:
  _host_only()
  from jzero import checkpoint

  print(checkpoint.describe(args.checkpoint, args.tag))
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jzero", description="jzero: DeepSpeed's ZeRO rebuilt for JAX. Train with a DeepSpeed "
      "config, estimate memory, convert and inspect checkpoints.",
      epilog="Run 'jzero COMMAND --help' for a command's options.")
  sub = parser.add_subparsers(dest="command", required=True)

  t = sub.add_parser(
      "train", help="train the embedded GPT on the embedded corpus",
      description="Train the embedded byte-level GPT on the embedded corpus (the Python standard "
      "library's source) with a DeepSpeed config: progress bar, the loss every steps_per_print "
      "steps, and a summary with measured and predicted memory. By default the job runs on 8 "
      "simulated CPU devices (--devices 8) so it works on any machine; on real accelerators "
      "pass --devices 0.")
  t.add_argument("--config", required=True, help="DeepSpeed-style JSON or YAML config")
  _add_device_args(t)
  t.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250)")
  t.add_argument("--data", default=None, help="text file or directory (default: the stdlib source)")
  t.add_argument("--seed", type=int, default=0,
                 help="seed of the initial parameters and of the data order (default 0)")
  t.add_argument("--micro-batch", type=int, default=4,
                 help="fills train_micro_batch_size_per_gpu when the config says 'auto'")
  t.add_argument("--warmup-steps", type=int, default=None,
                 help="fills scheduler warmup_num_steps when the config says 'auto'")
  default = GPTConfig()
  t.add_argument("--layers", type=int, default=default.n_layers,
                 help=f"transformer blocks of the model (default {default.n_layers})")
  t.add_argument("--d-model", type=int, default=default.d_model,
                 help=f"hidden size of the model (default {default.d_model})")
  t.add_argument("--heads", type=int, default=default.n_heads,
                 help=f"attention heads; must divide --d-model (default {default.n_heads})")
  t.add_argument("--seq-len", type=int, default=default.seq_len,
                 help=f"tokens (bytes) per training sequence (default {default.seq_len})")
  t.add_argument("--no-progress", action="store_true", help="no progress bar")
  t.add_argument("--checkpoint-dir", default=None,
                 help="save here (at the end and every --save-every steps) and resume from its "
                      "latest checkpoint if there is one")
  t.add_argument("--save-every", type=int, default=0, help="also save every N steps")
  t.add_argument("--losses-file", default=None,
                 help="append each step's loss to this file, 'STEP LOSS' lines at full precision "
                      "(process 0; a resumed run appends its steps)")
  t.add_argument("--resume", action="store_true",
                 help="require a checkpoint in --checkpoint-dir and continue from it (without "
                      "--resume a checkpoint found there is resumed from too)")
  t.add_argument("--keep", type=int, default=None, help="keep only the last K checkpoints")
  _add_process_args(t)
  t.set_defaults(func=_train)

  from jzero import launch
  l = sub.add_parser("launch", help="start a script as several processes, here or on the hosts "
                     "of a hostfile (DeepSpeed's launcher)",
                     description=launch.__doc__.split("\n\n")[0] + " See `python -c 'import "
                     "jzero.launch; help(jzero.launch)'` for the details.")
  launch.add_launch_arguments(l)
  l.set_defaults(func=launch.run_launch)

  e = sub.add_parser("estimate", help="per-device memory of the ZeRO stages (analytic, no "
                     "device work)")
  from jzero import memory
  memory.add_estimate_arguments(e)
  e.set_defaults(func=memory.run_estimate)

  a = sub.add_parser("aot", help="compile the train step for a GPU topology without a GPU: "
                     "memory, fit and collective overlap from XLA's GPU compiler (gpu-aot extra)")
  from jzero import aot
  aot.add_aot_arguments(a)
  a.set_defaults(func=aot.run_aot)

  c = sub.add_parser("convert", help="consolidate a training checkpoint into plain weights "
                     "(DeepSpeed's zero_to_fp32)")
  c.add_argument("checkpoint", help="checkpoint directory (or one checkpoint's directory)")
  c.add_argument("--tag", "--step", default=None,
                 help="the checkpoint to convert: its tag or step (default: the latest)")
  c.add_argument("--safetensors", default=None, help="write the weights to this safetensors file")
  c.add_argument("--orbax", default=None,
                 help="write the weights as a params-only Orbax checkpoint in this directory")
  c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                 help="dtype of the written weights (default fp32)")
  c.set_defaults(func=_convert)

  i = sub.add_parser("inspect", help="describe a checkpoint: step, stage, mesh, precision, arrays")
  i.add_argument("checkpoint", help="checkpoint directory (or one checkpoint's directory)")
  i.add_argument("--tag", "--step", default=None,
                 help="the checkpoint to describe: its tag or step (default: the latest)")
  i.set_defaults(func=_inspect)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except JZeroError as e:
    print(f"jzero: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
