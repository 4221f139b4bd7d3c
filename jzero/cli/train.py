"""``jzero train``: the embedded GPT on the embedded corpus with a DeepSpeed config, through
:func:`jzero.train.loop.train_loop` (checkpoints, resume, preemption), with a summary at the end."""

from __future__ import annotations

import argparse
import logging

from jzero.cli.processes import add_device_args, add_process_args, check_process_args, join
from jzero.models.gpt import GPTConfig

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
  check_process_args(args)
  join(args)
  # after join(): the simulated devices are set before anything starts JAX's backend
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jzero.analysis.estimate import format_bytes  # noqa: PLC0415
  from jzero.analysis.memory_report import format_memory_report  # noqa: PLC0415
  from jzero.config import Config  # noqa: PLC0415
  from jzero.models import GPT, lm_loss  # noqa: PLC0415
  from jzero.runtime.data import ByteCorpus  # noqa: PLC0415
  from jzero.train.initialize import initialize  # noqa: PLC0415
  from jzero.train.loop import init_or_resume, train_loop  # noqa: PLC0415

  primary = jax.process_index() == 0
  say = print if primary else (lambda *a, **k: None)  # process 0 reports for the job
  if not primary:
    logging.getLogger("jzero").setLevel(logging.WARNING)
  config = Config.load(args.config)
  model_cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                        n_heads=args.heads)
  corpus = ByteCorpus.load(args.data, seq_len=model_cfg.seq_len)
  auto = {"micro_batch_size": args.micro_batch}
  if args.warmup_steps is not None:
    auto["warmup_num_steps"] = args.warmup_steps
  engine = initialize(model=lambda rngs: GPT(model_cfg, rngs=rngs), loss_fn=lm_loss,
                      config=config, mesh=args.mesh, total_num_steps=args.steps,
                      auto_values=auto, tokens_per_sample=model_cfg.seq_len)
  cfg = engine.config
  say(f"jzero: ZeRO stage {cfg.zero_optimization.stage}, {cfg.precision}, mesh "
      f"{engine.mesh.describe()}")
  say(f"jzero: data {corpus.source} ({len(corpus) / 2**20:.1f} MiB); batch "
      f"{cfg.train_batch_size} x {model_cfg.seq_len} tokens = micro {cfg.train_micro_batch_size_per_gpu} "
      f"x gas {cfg.gradient_accumulation_steps} x dp {engine.mesh.dp_size}")
  state, start = init_or_resume(engine, jax.random.key(args.seed), args.checkpoint_dir,
                                require=args.resume)
  if start:
    say(f"jzero: resumed from {args.checkpoint_dir} at step {start}")
  plan = engine.plan
  if plan.uses_host or plan.uses_nvme_store:  # offload: what this process holds, before training
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

  rows = engine.local_rows()  # each process reads only the rows its devices hold
  result = train_loop(
      engine, state,
      lambda step: engine.shard_batch(corpus.batch(step, cfg.train_batch_size, seed=args.seed,
                                                   rows=rows)),
      args.steps, start=start, checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
      keep=args.keep, losses_file=args.losses_file, progress=not args.no_progress)
  if result.preempted:
    return result.exit_status
  if args.checkpoint_dir:
    from jzero import checkpoint  # noqa: PLC0415
    say(f"jzero: checkpoint at step {checkpoint.latest_step(args.checkpoint_dir)} in "
        f"{args.checkpoint_dir}")
  losses, step_times = result.losses, result.step_times
  if not losses:
    say(f"jzero: nothing to train: the checkpoint is at step {start} of {args.steps}")
    return 0

  state = result.state
  val = engine.eval_loss(state, corpus.batch(0, cfg.train_batch_size, seed=args.seed, split="val"))
  steady = step_times[1:] or step_times
  tail = losses[-min(10, len(losses)):]
  say()
  say(f"loss: start {losses[0]:.4f} -> end {float(np.mean(tail)):.4f} (mean of last {len(tail)} "
      f"steps); validation {val:.4f}")
  say(f"throughput: {result.throughput}; median step {float(np.median(steady)) * 1e3:.0f} ms, "
      f"first step incl. compile {step_times[0]:.1f} s")
  say(format_memory_report(engine.memory_report(state)))
  return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
  t = sub.add_parser(
      "train", help="train the embedded GPT on the embedded corpus",
      description="Train the embedded byte-level GPT on the embedded corpus (the Python standard "
      "library's source) with a DeepSpeed config: progress bar, the loss every steps_per_print "
      "steps, and a summary with measured and predicted memory. By default the job runs on 8 "
      "simulated CPU devices (--devices 8) so it works on any machine; on real accelerators "
      "pass --devices 0.")
  t.add_argument("--config", required=True, help="DeepSpeed-style JSON or YAML config")
  add_device_args(t)
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
  add_process_args(t)
  t.set_defaults(func=run)
