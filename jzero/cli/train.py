"""``jzero train``: a model trained with a DeepSpeed config through
:func:`jzero.train.loop.train_loop` (checkpoints, resume, preemption), with a summary at the end.

The model is the embedded GPT, or the user's own (``--model module:attr`` or
``--model path/to/file.py:attr``, as ``deepspeed train.py`` users bring theirs); the data is the
embedded corpus, a text file or directory, or a ``.npz`` / ``.npy`` file of arrays (``--data``).
Everything given is resolved and checked here -- the model and loss imported, the loss traced on the
data's batch shapes -- before any device work.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from jzero.cli.processes import add_device_args, add_process_args, check_process_args, join
from jzero.errors import DataError, JZeroError, JZeroWarning
from jzero.models.gpt import GPTConfig

__all__ = ["add_parser", "run"]

GPT_SHAPE_FLAGS = {"layers": "--layers", "d_model": "--d-model", "heads": "--heads"}
ARRAY_SUFFIXES = (".npz", ".npy")


# --- the user's code: --model / --loss -----------------------------------------------------------


def _import(spec: str, flag: str) -> tuple[Any, ModuleType]:
  """``module:attr`` or ``path/to/file.py:attr`` -> (the attribute, its module).

  A file is imported as ``python path/to/file.py`` runs it: its directory first on ``sys.path``
  (so it imports its neighbours); a module as ``python -m`` finds it: from the current directory
  too.
  """
  where, _, attr = spec.rpartition(":")
  if not where or not attr.isidentifier():
    raise JZeroError(f"{flag} {spec!r}: give MODULE:NAME or path/to/file.py:NAME, e.g. "
                     f"'{flag} mymodels.lm:make_model' or '{flag} models/lm.py:make_model'.")
  if where.endswith(".py") or "/" in where or os.sep in where:
    path = Path(where).absolute()
    if not path.is_file():
      raise JZeroError(f"{flag} {spec!r}: {where} is not a file.")
    sys.path.insert(0, str(path.parent))
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module  # dataclasses (Linen modules) look their module up there
    module_spec.loader.exec_module(module)
  else:
    if os.getcwd() not in sys.path and "" not in sys.path:
      sys.path.insert(0, os.getcwd())
    try:
      module = importlib.import_module(where)
    except ModuleNotFoundError as e:  # the module named, not one it imports
      if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
        raise
      raise JZeroError(f"{flag} {spec!r}: no module {e.name!r} on the path (the current "
                       f"directory {os.getcwd()} included); give its file instead: "
                       f"{flag} path/to/file.py:{attr}.") from None
  if not hasattr(module, attr):
    names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
    raise JZeroError(f"{flag} {spec!r}: {module.__file__} defines no {attr!r} (its callables: "
                     f"{', '.join(names) or 'none'}).")
  return getattr(module, attr), module


def _model(obj: Any, spec: str) -> Any:
  """What ``jzero.initialize`` takes as a model: a Linen class is built with no arguments."""
  from flax import linen, nnx  # noqa: PLC0415

  if isinstance(obj, type) and issubclass(obj, linen.Module):
    try:
      return obj()
    except TypeError as e:
      raise JZeroError(f"--model {spec!r} is a Linen class that needs arguments ({e}); name an "
                       f"instance of it in the module instead, e.g. model = {obj.__name__}(...)."
                       ) from None
  if isinstance(obj, (linen.Module, nnx.Module)) or callable(obj):
    return obj
  raise JZeroError(f"--model {spec!r} names an object of type {type(obj).__name__}, not a "
                   f"model: name a factory rngs -> nnx.Module (or an nnx.Module class taking "
                   f"rngs), or a Linen module.")


@dataclasses.dataclass
class _Job:
  """What ``jzero train`` trains and on what."""
  model: Any  # as jzero.initialize takes it
  loss_fn: Callable[..., Any]
  loss_name: str
  label: str | None  # None: the class of the model, once built
  init_inputs: Callable[[Any], tuple] | None
  corpus: Any  # a ByteCorpus, or None
  dataset: Any  # an ArrayDataset, or None

  @property
  def batch_keys(self) -> list[str]:
    return ["tokens"] if self.corpus is not None else sorted(self.dataset.arrays)


def _job(args: argparse.Namespace) -> _Job:
  from jzero.models import GPT, lm_loss  # noqa: PLC0415
  from jzero.runtime.data import ArrayDataset, ByteCorpus  # noqa: PLC0415

  corpus = dataset = None
  if args.data is not None and Path(args.data).suffix in ARRAY_SUFFIXES:
    dataset = ArrayDataset.load(args.data)
  else:
    corpus = ByteCorpus.load(args.data, seq_len=args.seq_len)
  if args.model is None:
    gpt = GPTConfig(seq_len=args.seq_len, **{k: v for k, v in (
        ("d_model", args.d_model), ("n_layers", args.layers), ("n_heads", args.heads))
        if v is not None})
    return _Job(model=lambda rngs: GPT(gpt, rngs=rngs), loss_fn=lm_loss,
                loss_name="jzero.models.lm_loss",
                label=f"GPT {gpt.n_layers} layers x d {gpt.d_model}", init_inputs=None,
                corpus=corpus, dataset=dataset)
  obj, module = _import(args.model, "--model")
  job = _Job(model=_model(obj, args.model), loss_fn=lm_loss, loss_name="jzero.models.lm_loss",
             label=None, init_inputs=getattr(module, "init_inputs", None), corpus=corpus,
             dataset=dataset)
  if args.loss is not None:
    job.loss_fn, job.loss_name = _import(args.loss, "--loss")[0], args.loss
  elif callable(getattr(module, "loss_fn", None)):
    job.loss_fn, job.loss_name = module.loss_fn, f"{module.__name__}.loss_fn"
  elif "tokens" not in job.batch_keys:
    raise JZeroError(
        f"--model {args.model!r}: no loss. Its module defines no loss_fn, and the --data batches "
        f"(keys {job.batch_keys}) have no 'tokens' for the default next-token cross-entropy. "
        f"Give --loss MODULE:NAME (NAME(model, batch) -> scalar loss), or define "
        f"loss_fn(model, batch) beside the model.")
  if not callable(job.loss_fn):
    raise JZeroError(f"--loss {args.loss!r} is a {type(job.loss_fn).__name__}, not a function "
                     f"loss_fn(model, batch) -> scalar.")
  return job


def _micro_batch(args: argparse.Namespace, config: Any) -> int | None:
  """``--micro-batch``; without it, None (a config's "auto" is then derived from its
  train_batch_size), or 4 with a warning when nothing else fixes the "auto"."""
  if args.micro_batch is not None:
    return args.micro_batch
  if config.train_micro_batch_size_per_gpu == "auto" and config.train_batch_size in (None, "auto"):
    warnings.warn('train_micro_batch_size_per_gpu is "auto" and train_batch_size does not fix '
                  "it: using 4, jzero train's default; --micro-batch N sets it.", JZeroWarning,
                  stacklevel=2)
    return 4
  return None


def _check_loss_on_batches(engine: Any, job: _Job, sample: dict, model_spec: str) -> None:
  """Traces the loss on the model and a micro-batch of the data's shapes (nothing is computed):
  a model that cannot take these batches is one error naming both, before any device work."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  micro = engine.config.train_micro_batch_size_per_gpu
  batch = {k: jax.ShapeDtypeStruct((micro,) + np.shape(v)[1:], np.asarray(v).dtype)
           for k, v in sample.items()}
  params = engine.model.abstract_params(jax.random.key(0), None)
  model_state = engine.model.abstract_model_state(jax.random.key(0), None)

  def loss(p, s, b):
    model = engine.model.bind(p, model_state=s)
    return job.loss_fn(model, b, rng=None) if engine.loss_takes_rng else job.loss_fn(model, b)

  try:
    jax.eval_shape(loss, params, model_state, batch)
  except Exception as e:  # pylint: disable=broad-except  (the user's code: any error)
    shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in batch.items())
    source = (job.corpus or job.dataset).source
    raise DataError(
        f"--model {model_spec!r} with the loss {job.loss_name} cannot take the batches of "
        f"{source} ({{{shapes}}} per device): {type(e).__name__}: "
        f"{str(e).splitlines()[0].rstrip('.')}. Text data gives {{'tokens': int32[B, --seq-len "
        f"+ 1]}} (bytes, ids < 256); a .npz gives its named arrays, a .npy {{'tokens': ...}}, "
        f"one row per sample. Give data the model takes, or a --loss that feeds the model from "
        f"these keys.") from e


# --- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
  check_process_args(args)
  if args.model is not None:
    given = [flag for name, flag in GPT_SHAPE_FLAGS.items() if getattr(args, name) is not None]
    if given:
      raise JZeroError(f"{', '.join(given)}: the embedded GPT's shape; with --model your "
                       f"factory builds the model, so leave {' and '.join(given)} out.")
  elif args.loss is not None:
    raise JZeroError("--loss goes with --model; the embedded GPT trains with its own loss.")
  join(args)
  # after join(): the simulated devices are set before anything starts JAX's backend
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jzero.analysis.estimate import format_bytes  # noqa: PLC0415
  from jzero.analysis.memory_report import format_memory_report  # noqa: PLC0415
  from jzero.analysis.tables import format_count  # noqa: PLC0415
  from jzero.config import Config  # noqa: PLC0415
  from jzero.train.initialize import initialize  # noqa: PLC0415
  from jzero.train.loop import init_or_resume, train_loop  # noqa: PLC0415

  primary = jax.process_index() == 0
  say = print if primary else (lambda *a, **k: None)  # process 0 reports for the job
  if not primary:
    logging.getLogger("jzero").setLevel(logging.WARNING)
  config = Config.load(args.config)
  job = _job(args)
  auto = {"micro_batch_size": _micro_batch(args, config)}
  if args.warmup_steps is not None:
    auto["warmup_num_steps"] = args.warmup_steps
  sample = job.corpus.batch(0, 1, seed=args.seed) if job.corpus is not None else job.dataset[0]
  if job.dataset is not None:
    sample = {k: v[None] for k, v in sample.items()}
  engine = initialize(model=job.model, loss_fn=job.loss_fn, config=config, mesh=args.mesh,
                      total_num_steps=args.steps, auto_values=auto, init_inputs=job.init_inputs,
                      sample_batch=sample if job.corpus is not None else None,
                      training_data=job.dataset, seed=args.seed,
                      tokens_per_sample=job.corpus.seq_len if job.corpus is not None else None)
  if args.model is not None:
    _check_loss_on_batches(engine, job, sample, args.model)
  cfg = engine.config
  say(f"jzero: ZeRO stage {cfg.zero_optimization.stage}, {cfg.precision}, mesh "
      f"{engine.mesh.describe()}")
  if job.corpus is not None:
    seq_len = job.corpus.seq_len
    say(f"jzero: data {job.corpus.source} ({len(job.corpus) / 2**20:.1f} MiB); batch "
        f"{cfg.train_batch_size} x {seq_len} tokens = micro {cfg.train_micro_batch_size_per_gpu} "
        f"x gas {cfg.gradient_accumulation_steps} x dp {engine.mesh.dp_size}")
  else:
    say(f"jzero: data {job.dataset.source} ({len(job.dataset)} samples: "
        f"{', '.join(f'{k} {v.dtype}{list(v.shape[1:])}' for k, v in job.dataset.arrays.items())}"
        f"); batch {cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} x gas "
        f"{cfg.gradient_accumulation_steps} x dp {engine.mesh.dp_size}")
  state, start = init_or_resume(engine, jax.random.key(args.seed), args.checkpoint_dir,
                                require=args.resume)
  if start:
    say(f"jzero: resumed from {args.checkpoint_dir} at step {start}")
  plan = engine.plan
  # offload (any tier's): what this process holds, before training
  if any(l.state_tier != "device" or l.param_tier != "device" for l in plan.leaf_list()):
    est, local = engine.memory_report(state).estimate, jax.local_device_count()
    tiers = [f"{tier} {format_bytes(est.tier_total(tier) * local)}"
             for tier in ("host", "nvme") if est.tier_total(tier)]
    if engine.nvme_store is not None:  # what the store holds (params, masters, state), measured
      tiers.append(f"NVMe store {format_bytes(engine.nvme_store.bytes_per_slot)} per slot "
                   f"(two slots on disk)")
    say(f"jzero: offload: predicted model states per process ({local} devices): "
        f"{', '.join(tiers)}; device {format_bytes(est.device_total)} per device")
  n_params = sum(l.numel for l in plan.leaf_list())
  label = job.label or type(engine.model.module).__name__
  say(f"jzero: model {label}, {format_count(n_params)} parameters; loss {job.loss_name}")

  if job.corpus is not None:
    rows = engine.local_rows()  # each process reads only the rows its devices hold
    batch_at = lambda step: engine.shard_batch(job.corpus.batch(  # noqa: E731
        step, cfg.train_batch_size, seed=args.seed, rows=rows))
  else:
    batch_at = engine.training_dataloader.batch  # the same: a pure function of the step
  result = train_loop(engine, state, batch_at, args.steps, start=start,
                      checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                      keep=args.keep, losses_file=args.losses_file,
                      progress=not args.no_progress)
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
  steady = step_times[1:] or step_times
  step_s = float(np.median(steady))
  tail = losses[-min(10, len(losses)):]
  say()
  if job.corpus is not None:
    val = engine.eval_loss(state, job.corpus.batch(0, cfg.train_batch_size, seed=args.seed,
                                                   split="val"))
    val = val[0] if isinstance(val, tuple) else val
    say(f"loss: start {losses[0]:.4f} -> end {float(np.mean(tail)):.4f} (mean of last "
        f"{len(tail)} steps); validation {val:.4f}")
  else:
    say(f"loss: start {losses[0]:.4f} -> end {float(np.mean(tail)):.4f} (mean of last "
        f"{len(tail)} steps)")
  say(f"throughput: {result.throughput}; median step {step_s * 1e3:.0f} ms, first step incl. "
      f"compile {step_times[0]:.1f} s")
  say(format_memory_report(engine.memory_report(state)))
  return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
  t = sub.add_parser(
      "train", help="train the embedded GPT, or your own model, with a DeepSpeed config",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Train with a DeepSpeed config: progress bar, the loss every steps_per_print "
      "steps, and a summary with measured and predicted memory. By default the job runs on 8 "
      "simulated CPU devices (--devices 8) so it works on any machine; on real accelerators "
      "pass --devices 0.",
      epilog="""\
your own model:
  --model MODULE:NAME or path/to/file.py:NAME names what jzero.initialize takes as a model:
  a factory rngs -> nnx.Module (or an nnx.Module class taking rngs), or a Linen module
  (an instance, or a class built with no arguments; its module may define
  init_inputs(batch) -> args for module.init). The loss is --loss MODULE:NAME, else the
  model module's loss_fn(model, batch) -> scalar, else next-token cross-entropy
  (jzero.models.lm_loss: model(tokens[:, :-1]) -> logits) for 'tokens' batches.

data (--data):
  default        the Python standard library's source, as bytes:
                 {'tokens': int32[B, --seq-len + 1]} batches, ids < 256
  text file/dir  its bytes, batches as above
  FILE.npz       named arrays, one row per sample: {'x': ..., 'y': ...} batches
  FILE.npy       one array, one row per sample: {'tokens': ...} batches
  Batches are a pure function of the step (a resumed run sees the same ones). The loss is
  traced on the data's shapes before training: a mismatch is one error naming both.

  e.g. jzero train --model models/lm.py:make_model --config ds_config.json --steps 100""")
  t.add_argument("--config", required=True, help="DeepSpeed-style JSON or YAML config")
  add_device_args(t)
  t.add_argument("--model", default=None,
                 help="your model, MODULE:NAME or path/to/file.py:NAME (see below; default: the "
                      "embedded GPT)")
  t.add_argument("--loss", default=None,
                 help="its loss, MODULE:NAME or file.py:NAME: NAME(model, batch) -> scalar "
                      "(default: the model module's loss_fn, else next-token cross-entropy)")
  t.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250)")
  t.add_argument("--data", default=None,
                 help="text file or directory, or a .npz / .npy of arrays (see below; default: "
                      "the stdlib source)")
  t.add_argument("--seed", type=int, default=0,
                 help="seed of the initial parameters and of the data order (default 0)")
  t.add_argument("--micro-batch", type=int, default=None,
                 help="fills train_micro_batch_size_per_gpu when the config says 'auto' (without "
                      "it: derived from train_batch_size, else 4 with a warning)")
  t.add_argument("--warmup-steps", type=int, default=None,
                 help="fills scheduler warmup_num_steps when the config says 'auto'")
  default = GPTConfig()
  t.add_argument("--layers", type=int, default=None,
                 help=f"embedded GPT: transformer blocks (default {default.n_layers})")
  t.add_argument("--d-model", type=int, default=None,
                 help=f"embedded GPT: hidden size (default {default.d_model})")
  t.add_argument("--heads", type=int, default=None,
                 help=f"embedded GPT: attention heads; must divide --d-model (default "
                      f"{default.n_heads})")
  t.add_argument("--seq-len", type=int, default=default.seq_len,
                 help=f"tokens (bytes) per training sequence of text data (default "
                      f"{default.seq_len})")
  t.add_argument("--no-progress", action="store_true",
                 help="no progress bar (there is none when stderr is not a terminal: a log file "
                      "gets the loss every steps_per_print steps only)")
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
  t.add_argument("--keep", type=int, default=None,
                 help="keep only the newest K complete checkpoints in --checkpoint-dir")
  add_process_args(t)
  t.set_defaults(func=run)
