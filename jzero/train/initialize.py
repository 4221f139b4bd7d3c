"""Building an engine from a DeepSpeed config: :func:`initialize`.

The phase before any step: the config read and resolved (``"auto"`` values, the batch triple) for
the mesh and the model, ZeRO++'s hierarchy, the optimizer and schedule, the loss scaler, the data
loader, the refusals and warnings of settings jzero cannot honour -- then an
:class:`~jzero.train.engine.Engine` holding it all. The engine itself (plan, state, steps) is
:mod:`jzero.train.engine`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from jzero.sharding import zeropp as zpp
from jzero.config import Config
from jzero.config.messages import user_stacklevel
from jzero.errors import ConfigError, JZeroWarning, NotSupportedError
from jzero.runtime.data import DataLoader
from jzero.runtime import logs
from jzero.runtime.logs import LOGGER
from jzero.runtime.distributed import init_distributed
from jzero.sharding.mesh import MeshSpec, ZeroMesh
from jzero.tiers import delayed, host_step, nvme_settings, registry
from jzero.train.engine import Engine
from jzero.train.monitor import Monitor, check_packages
from jzero.modeling.model_adapter import NnxModel, as_model
from jzero.train.deepspeed_engine import DeepSpeedEngine
from jzero.train.optim import build_optimizer, plain_block
from jzero.train.precision import LossScaler
__all__ = ["initialize", "add_config_arguments", "deepspeed_tuple", "model_output_loss"]

logger = logging.getLogger(LOGGER)


def _as_mesh(mesh: Any) -> ZeroMesh:
  if mesh is None:
    return MeshSpec.default().build()
  if isinstance(mesh, ZeroMesh):
    return mesh
  if isinstance(mesh, MeshSpec):
    return mesh.build()
  if isinstance(mesh, (str, Path)):
    return MeshSpec.load(mesh).build()
  if isinstance(mesh, jax.sharding.Mesh):
    names = tuple(mesh.axis_names)
    return ZeroMesh(mesh=mesh, zero_axes=names, batch_axes=names)
  raise ConfigError(f"mesh must be None, a mesh file path, a MeshSpec, a ZeroMesh or a "
                    f"jax.sharding.Mesh; got {type(mesh).__name__}.")


def _as_prefixes(value: str | Sequence[str] | None) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def initialize(model: Any = None, loss_fn: Callable[..., Any] | None = None,
               config: Config | dict | str | Path | None = None, mesh: Any = None, *,
               args: Any = None, model_parameters: Any = None,
               optimizer: optax.GradientTransformation | None = None, lr_scheduler: Any = None,
               training_data: Any = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config_params: Any = None,
               distributed_port: int | None = None, mesh_param: Any = None,
               stacked_layers: str | Sequence[str] | None = None, hidden_size: int | None = None,
               total_num_steps: int | None = None, auto_values: dict | None = None,
               init_inputs: Callable[[Any], tuple] | None = None, sample_batch: Any = None,
               shuffle: bool = True, seed: int = 0,
               tokens_per_sample: int | None = None) -> Engine:
  """Builds a ZeRO engine, with DeepSpeed's call shape: ``engine = jzero.initialize(model=...,
  loss_fn=..., config=...)``, or ``engine, optimizer, dataloader, lr_scheduler =
  jzero.initialize(args=args, model=model, model_parameters=params, config=ds_config)``.

  Everything about the input is checked here, before any device work: the config is parsed and
  validated, unsupported settings are refused, "auto" values are resolved and the batch triple is
  checked against the mesh. The plan is made here too when it can be (an NNX model, or a sample
  batch). The result is jzero's :class:`Engine`; unpacked, it is DeepSpeed's 4-tuple, whose
  engine (:class:`jzero.train.deepspeed_engine.DeepSpeedEngine`) holds the train state and takes
  DeepSpeed's ``loss = engine(batch); engine.backward(loss); engine.step()``.

  Args:
    model: a Flax NNX module, a factory ``rngs -> nnx.Module``, or a Linen module.
    loss_fn: ``loss_fn(model, batch) -> loss`` or ``-> (loss, aux_dict)``; the loss is the mean over
      the batch it is given. If it has an ``rng`` parameter it gets a per-device, per-micro-batch
      key in ``train_step`` and ``None`` in ``eval_loss`` (dropout off). None: DeepSpeed's
      convention, the model's output is the loss (:func:`model_output_loss`).
    config: a DeepSpeed config: :class:`jzero.Config`, dict, or path of a JSON / YAML file
      (DeepSpeed's ``config_params`` and ``args.deepspeed_config`` are read as it).
    mesh: None (all devices on one data axis), a mesh file path, a MeshSpec, a ZeroMesh, or a
      ``jax.sharding.Mesh`` (all axes used for ZeRO and the batch).
    args: DeepSpeed's argparse namespace: its ``deepspeed_config`` is the config when ``config``
      is not given; nothing else of it is read (one jzero process drives all its devices).
    model_parameters: DeepSpeed's parameters to optimize: None, or all of the model's (e.g.
      ``nnx.state(model, nnx.Param)``); jzero optimizes every parameter, and refuses a part of
      them or torch-style param groups.
    optimizer: an optax transformation to use instead of the config's ``optimizer`` block.
    lr_scheduler, mpu, collate_fn, mesh_param: DeepSpeed's; refused when given (each message says
      jzero's way). ``dist_init_required=False``: the processes are not joined here.
      ``distributed_port``: refused (``jzero launch`` or the environment says where to meet).
    stacked_layers: path(s) of the params subtree(s) stacked over a leading layer axis and run with
      :func:`jzero.scan_layers` (default: the model's ``stacked_layers`` attribute, if any).
    hidden_size: fills hidden-size "auto" values (default: read from the model when it has one).
    total_num_steps: fills ``scheduler.params.total_num_steps: "auto"``.
    auto_values: values for other "auto" keys (``micro_batch_size``, ``lr``,
      ``warmup_num_steps``...).
    init_inputs: Linen only: ``batch -> args`` for ``module.init`` (default: ``(batch,)``).
    sample_batch: Linen only: a batch to create the parameters' shapes from, here (the model's
      variables are checked now) instead of at ``engine.init``; default: the first batch of
      ``training_data``.
    training_data: an indexable dataset (``dataset[i]`` a numpy array or a dict / tuple of them);
      ``engine.training_dataloader`` then yields global batches placed on the mesh
      (:class:`jzero.runtime.data.DataLoader`: shuffled with ``seed`` unless ``shuffle=False``, a
      pure function of the optimizer step, each process reading only its rows).
    seed: the data order's seed, and the DeepSpeed engine's: its state is ``engine.init(
      jax.random.key(seed))``.
    tokens_per_sample: tokens one sample trains on (a language model's sequence length): the
      engine then reports tokens/s beside samples/s (its log, monitors, :func:`jzero.train.loop.train_loop`).

  The config's monitors (``tensorboard``, ``csv_monitor``, ``wandb``) are opened here, on process
  0, and written every step (:mod:`jzero.train.monitor`).
  """
  config = _deepspeed_arguments(model, config, args, config_params, lr_scheduler, mpu,
                                collate_fn, distributed_port, mesh_param)
  if loss_fn is None:
    loss_fn = model_output_loss
  logs.show_log()  # jzero's log on stdout, as DeepSpeed's (unless the application configured it)
  if dist_init_required is not False:  # joins the other processes when launched as several
    init_distributed()  # (jzero launch, SLURM...)
  given = config if isinstance(config, Config) else Config.load(config)
  given.check_supported()
  check_packages(given)  # an enabled monitor's package
  with warnings.catch_warnings():  # refusals only: the engine's plan warns once, when it is built
    warnings.simplefilter("ignore", JZeroWarning)
    registry.check_config(given)  # e.g. offload the stage cannot have: refused
  zmesh = _as_mesh(mesh)
  adapter = as_model(model, init_inputs)
  cfg = given.resolve(dp_world_size=zmesh.dp_size, hidden_size=hidden_size or adapter.hidden_size,
                    total_num_steps=total_num_steps, auto_values=auto_values)
  zmesh, zeropp = zpp.resolve(cfg.zero_optimization, zmesh, default_mesh=mesh is None)
  context = dict(client_optimizer=optimizer is not None, replica_axes=zmesh.replica_axes,
                 platform=zmesh.mesh.devices.flat[0].platform)
  host_step.check_update(cfg, **context)
  cfg, streamed_because = host_step.resolve_update(cfg, **context)
  if streamed_because is not None:
    _log_offload_update(streamed_because)
  if delayed.enabled(cfg.zero_optimization) and cfg.precision == "fp32":
    warnings.warn(
        "offload_optimizer.delayed_update in fp32: a step whose gradient is not finite (NaN / "
        "inf) is not skipped -- the delayed update applies each carried gradient "
        "unconditionally, so that the host update overlaps the next forward and backward. Use "
        "fp16, or bf16 (check_grad_overflow: true), to have such steps skipped.",
        JZeroWarning, stacklevel=user_stacklevel())
  # the NVMe tier's settings checked now (its path, a client optimizer), before any device work;
  # the tier reads them again when it opens its store
  nvme_settings.settings_from_config(cfg, client_optimizer=optimizer is not None)
  if optimizer is None:
    tx, schedule = build_optimizer(plain_block(cfg.optimizer), plain_block(cfg.scheduler))
  else:
    tx, schedule = optimizer, None
    dropped = [key for key in ("optimizer", "scheduler") if getattr(cfg, key) is not None]
    if dropped:
      warnings.warn(
          f"initialize(optimizer=...) replaces the config's {' and '.join(dropped)} block"
          f"{'s' if len(dropped) > 1 else ''}: {', '.join(dropped)} settings in the config are "
          f"not used. Put the schedule in the optax optimizer (wrapped in "
          f"optax.inject_hyperparams, jzero logs its learning rate).", JZeroWarning,
          stacklevel=user_stacklevel())
    if "gradient_clipping" not in given.model_fields_set and cfg.gradient_clipping > 0:
      warnings.warn(
          f"initialize(optimizer=...): the config does not set gradient_clipping, so DeepSpeed's "
          f"default ({cfg.gradient_clipping:g}) clips the gradient by its global norm before your "
          f"optax transformation, as DeepSpeed does before a client optimizer. Give "
          f'"gradient_clipping": 0.0 to leave clipping to the transformation '
          f"(optax.clip_by_global_norm), or set it to keep the clipping without this warning.",
          JZeroWarning, stacklevel=user_stacklevel())
  if cfg.precision == "fp16":
    fp16 = cfg.fp16
    scaler = LossScaler.from_config(
        loss_scale=fp16.loss_scale, initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis, min_loss_scale=fp16.min_loss_scale)
  else:
    scaler = LossScaler.disabled()
  _warn_gpu_only_knobs(given.zero_optimization, cfg.zero_optimization, zmesh)
  loader = None
  if training_data is not None:
    loader = DataLoader(training_data, cfg.train_batch_size, zmesh.sharding(zmesh.batch_spec()),
                        shuffle=shuffle, seed=seed)
    left_over = len(training_data) % cfg.train_batch_size
    if left_over and not cfg.dataloader_drop_last:
      warnings.warn(
          f"training_data: {len(training_data)} samples make {len(loader)} batches of "
          f"train_batch_size {cfg.train_batch_size} per epoch; the last {left_over} samples of "
          f"each epoch's order are not used (a compiled step has one batch shape). DeepSpeed's "
          f"dataloader_drop_last is false here; set it to true to drop them without this warning.",
          JZeroWarning, stacklevel=user_stacklevel())
    if sample_batch is None:
      sample_batch = loader.host_batch(0, rows=np.arange(1))
  if sample_batch is not None:
    adapter.set_sample_batch(sample_batch)
  if stacked_layers is None:
    stacked_layers = adapter.stacked_layers
  engine = Engine(config=cfg, mesh=zmesh, model=adapter, loss_fn=loss_fn, tx=tx,
                  schedule=schedule, scaler=scaler, stacked_layers=_as_prefixes(stacked_layers),
                  training_dataloader=loader, zeropp=zeropp,
                  monitor=Monitor.from_config(cfg), tokens_per_sample=tokens_per_sample)
  engine.unpack = functools.partial(deepspeed_tuple, engine, seed=seed, client_optimizer=optimizer,
                                    training_data=training_data)
  if loader is not None:
    loader.check = engine._check_input_ids
  if isinstance(adapter, NnxModel) or sample_batch is not None:
    engine.make_plan(sample_batch)  # the engine whole now: its plan, before any state
  if model_parameters is not None:
    _check_model_parameters(model_parameters, engine)
  return engine


def add_config_arguments(parser: Any) -> Any:
  """DeepSpeed's ``add_config_arguments``: ``--deepspeed`` and ``--deepspeed_config`` (and the
  retired ``--deepscale`` / ``--deepscale_config``) on ``parser``, which it returns;
  ``initialize(args=args)`` reads ``args.deepspeed_config`` as the config."""
  group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
  group.add_argument("--deepspeed", default=False, action="store_true",
                     help="kept for DeepSpeed's scripts: jzero always runs its engine")
  group.add_argument("--deepspeed_config", default=None, type=str,
                     help="DeepSpeed json configuration file")
  group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
  group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
  return parser


def deepspeed_tuple(engine: Engine, *, seed: int, client_optimizer: Any,
                    training_data: Any) -> tuple:
  """DeepSpeed's ``(engine, optimizer, training_dataloader, lr_scheduler)`` over ``engine``
  (:mod:`jzero.train.deepspeed_engine`)."""
  ds = DeepSpeedEngine(engine, seed=seed, client_optimizer=client_optimizer,
                       training_data=training_data)
  return ds, ds.optimizer, engine.training_dataloader, ds.lr_scheduler


def model_output_loss(model: Any, batch: Any) -> Any:
  """The loss when ``initialize`` gets no ``loss_fn``: DeepSpeed's convention, the model's
  output is the loss (``loss = engine(**batch)``). The model is called with the batch --
  ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, ``model(batch)``
  otherwise -- and returns a scalar, ``(loss, aux_dict)``, or an output with a ``loss`` field
  (a Hugging Face-style output object or dict)."""
  if isinstance(batch, dict):
    out = model(**batch)
  elif isinstance(batch, (tuple, list)):
    out = model(*batch)
  else:
    out = model(batch)
  if isinstance(out, tuple):
    return out
  loss = out["loss"] if isinstance(out, dict) and "loss" in out else getattr(out, "loss", out)
  if np.ndim(loss) != 0:
    raise ConfigError(
        f"initialize got no loss_fn, so the model's output is the loss (DeepSpeed's "
        f"loss = engine(batch)), but the model returned an array of shape {np.shape(loss)} "
        f"(for one device's micro-batch), not a scalar. jzero compiles the loss into the step: give "
        f"jzero.initialize(..., loss_fn=lambda model, batch: ...) (e.g. the cross-entropy of "
        f"model(batch['x']) and batch['y']), or have the model return its loss.")
  return loss


def _deepspeed_arguments(model: Any, config: Any, args: Any, config_params: Any,
                         lr_scheduler: Any, mpu: Any, collate_fn: Any, distributed_port: Any,
                         mesh_param: Any) -> Any:
  """DeepSpeed's ``initialize`` arguments checked: the config from ``config``,
  ``config_params`` or ``args.deepspeed_config``; those jzero cannot take refused, naming its
  way."""
  if isinstance(model, argparse.Namespace):
    raise ConfigError("jzero.initialize's first argument is the model: pass DeepSpeed's "
                      "arguments by keyword, jzero.initialize(args=args, model=model, ...).")
  if model is None:
    raise ConfigError("jzero.initialize needs model= (a Flax NNX module or factory, or a Linen "
                      "module).")
  given = [(name, value) for name, value in (
      ("config", config), ("config_params", config_params),
      ("args.deepspeed_config", getattr(args, "deepspeed_config", None))) if value is not None]
  if len(given) > 1:
    raise ConfigError(f"jzero.initialize got a DeepSpeed config twice, as "
                      f"{' and '.join(name for name, _ in given)}: give one.")
  if not given:
    raise ConfigError("jzero.initialize needs a DeepSpeed config: config= (a dict, a JSON / YAML "
                      "path or a jzero.Config), or args.deepspeed_config (DeepSpeed's "
                      "--deepspeed_config).")
  refused = {
      "lr_scheduler": (lr_scheduler, "jzero's schedule is the config's scheduler block, or the "
                       "schedule inside an optax optimizer given as optimizer= "
                       "(optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))"),
      "mpu": (mpu, "jzero is data-parallel only; its devices are the mesh (mesh=)"),
      "mesh_param": (mesh_param, "jzero's devices are the mesh (mesh=: a mesh file, a MeshSpec, "
                     "a jax.sharding.Mesh)"),
      "collate_fn": (collate_fn, "training_data's samples are stacked as they are (numpy arrays, "
                     "or dicts / tuples of them): collate them in the dataset's __getitem__"),
      "distributed_port": (distributed_port, "the processes meet where `jzero launch` or the "
                           "environment says (JAX's coordinator address)"),
  }
  for name, (value, way) in refused.items():
    if value is not None:
      raise NotSupportedError(f"jzero.initialize({name}=...): {way}.")
  return given[0][1]


def _check_model_parameters(model_parameters: Any, engine: Engine) -> None:
  """DeepSpeed's ``model_parameters`` are the parameters to optimize: jzero optimizes all of
  the model's, so it takes them only when they are all of them (as many values, as many elements).
  """
  if isinstance(model_parameters, (list, tuple)) and any(
      isinstance(g, dict) and "params" in g for g in model_parameters):
    raise NotSupportedError(
        "jzero.initialize(model_parameters=[param groups]): jzero optimizes all parameters with "
        "one optax transformation; per-group settings are optax.multi_transform (or "
        "optax.masked for weight decay) given as optimizer=.")
  sizes = sorted(int(np.size(x)) for x in jax.tree.leaves(model_parameters))
  if engine.plan is None:  # a Linen model without a sample batch: checked against nothing yet
    warnings.warn("jzero.initialize(model_parameters=...) is not checked for a Linen model "
                  "without a sample batch: jzero optimizes every parameter of the model.",
                  JZeroWarning, stacklevel=user_stacklevel())
    return
  model = sorted(int(np.prod(leaf.shape)) for leaf in engine.plan.leaf_list())
  if sizes != model:
    raise NotSupportedError(
        f"jzero.initialize(model_parameters=...): got {len(sizes)} arrays of {sum(sizes):,} "
        f"values, the model has {len(model)} of {sum(model):,}. jzero optimizes every parameter "
        f"of the model: pass them all (nnx.state(model, nnx.Param)) or none; to keep some fixed, "
        f"give optimizer=optax.multi_transform(...) with optax.set_to_zero() for them.")


def _log_offload_update(streamed_because: list[str]) -> None:
  """One line for ``offload_optimizer: {device: cpu}`` without an ``update``: which update runs
  (:func:`jzero.tiers.host_step.resolve_update`) and, for the streamed one, why."""
  if streamed_because:
    logger.info("offload_optimizer: the optimizer state in host memory, updated on the device a "
                "leaf at a time (update: stream): the host's Adam (update: cpu_adam) does not "
                "run with %s.", "; ".join(streamed_because))
  else:
    logger.info("offload_optimizer: gradients to host memory in the backward pass, Adam on the "
                "host's cores (update: cpu_adam, DeepSpeed's CPU Adam); update: stream keeps "
                "the update on the device.")


def _warn_gpu_only_knobs(given: Any, zero: Any, mesh: ZeroMesh) -> None:
  """Bucket sizes and overlap_comm reach XLA as GPU compile options (jzero.comm.program.compile_options); say so
  once when the user set them to something other than DeepSpeed's defaults on another backend
  (values jzero derived from "auto" are not the user's, and are not warned about)."""
  platform = mesh.mesh.devices.flat[0].platform
  if platform == "gpu":
    return
  fields = type(zero).model_fields
  changed = [f"{fields[name].alias or name}={getattr(zero, name)}"
             for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size")
             if getattr(given, name) != "auto" and getattr(zero, name) != fields[name].default]
  if given.overlap_comm not in (None, "auto") and zero.overlap_comm != (zero.stage == 3):
    changed.append(f"overlap_comm={zero.overlap_comm}")
  if changed:
    warnings.warn(
        f"zero_optimization {', '.join(changed)}: jzero passes bucket sizes and overlap to XLA's "
        f"collective combiners and latency-hiding scheduler, which the GPU compiler has and the "
        f"{platform} backend does not; on {platform} these settings change nothing.", JZeroWarning,
        stacklevel=user_stacklevel())


