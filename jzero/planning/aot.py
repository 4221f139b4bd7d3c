"""A GPU plan checked without a GPU: jzero's real train step compiled for an H100 / A100 topology.

XLA can compile for a GPU that is not present. With the CUDA compiler plugin installed (the
``gpu-aot`` extra: ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` matching the installed jax; no
GPU and no CUDA libraries needed), ``jax.experimental.topologies.get_topology_desc(platform="cuda",
topology="NODES x 1 x PER_NODE", target_config=<GPU spec>)`` gives compile-only devices of that
part, and ``jit(...).trace(abstract args).lower().compile()`` runs XLA's whole GPU pipeline for
them: SPMD partitioning, fusion, the collective combiners, async collectives and the
latency-hiding scheduler. :func:`compile_for` does that for jzero's own train step:

1. the mesh: a :class:`~jzero.sharding.mesh.ZeroMesh` over the topology's devices (the default
   one-axis mesh, or a mesh file), so the plan, the shardings and :func:`jzero.comm.program.compile_options` (the
   bucket and overlap knobs, passed only when the platform is ``gpu``, which compile-only CUDA
   devices report) are the ones a real run gets;
2. the engine: :func:`jzero.initialize` with the config, the model (an embedded GPT shape or any
   model with its loss and an abstract batch);
3. the state, abstractly: ``engine.abstract_state(full=False)``, a pure function of the plan --
   nothing is allocated, and no device work is done on the compile-only devices;
4. the step: ``engine.jitted_step(batch, variant).trace(state, batch).lower().compile()`` (the
   steady variant, :attr:`jzero.Engine.steady_variant`) with the batch as a ``ShapeDtypeStruct`` carrying its sharding -- and with the latency-hiding scheduler's memory
   limit a run has: on a GPU, XLA plans with the allocator's pool (``memory_fraction`` of the
   part) less the step's inputs and outputs; without the device it would take 80% of the part, so
   the compile gets the slop factor that makes the two equal
   (:func:`jzero.comm.program.scheduler_slop_for`, :func:`compile_once`). ``"auto"`` for
   ``stage3_max_live_parameters`` is resolved by compiling both ways, and below 90% overlapped
   ``advise`` compiles each knob that would raise it (:mod:`jzero.planning.overlap`).

The answer (:class:`jzero.planning.aot_report.AotReport`) puts side by side, per device: the model-state bytes by kind as the
plan lays them out (params, grads, fp32 master, optimizer state), the estimator's prediction
(:func:`jzero.analysis.estimate.estimate`, activations by Korthikanti et al. for the GPT shapes),
XLA's ``memory_analysis()`` (arguments, outputs, temporaries, peak), whether the peak fits the
part's memory (the spec's ``device_memory_size`` times the fraction JAX preallocates, 75% by
default), the compile times, and every collective of the scheduled program (read by
:func:`jzero.analysis.hlo.collectives`): runs per step, buffers combined, bytes, whether it is async
and whether compute is scheduled while it is in flight. ``overlap_fraction`` is the share of the
bytes sent per step that overlap compute, ``matmul_overlap_fraction`` the share with a matrix
multiplication in flight (a LayerNorm beside a 90 MB gather hides little of it).

**TPU slices.** ``compile_for(config, tpu="v5e", topology="2x4", slices=1)`` does the same for
compile-only TPU chips (:mod:`jzero.planning.tpu_specs`: libtpu, the ``tpu-aot`` extra; several
slices are joined by DCN and make hpZ / qgZ's node axis). What differs: XLA's TPU compiler plans
with the chip's HBM (no pool to emulate, memory fraction 1.0 by default), DeepSpeed's bucket and
overlap knobs are GPU compile options and are not passed (XLA's TPU defaults apply), the
arguments are laid out in tiles (``T(8,128)``), so the report sets the model-state arguments --
XLA's, in HBM and in host memory, less the batch and the tiles' padding
(:func:`jzero.analysis.hlo.parameter_bytes`) -- against the plan's bytes, and a collective is
asynchronous when XLA fuses it into a start and a done fusion (``AsyncCollectiveStart`` /
``AsyncCollectiveDone``), overlapped when compute is scheduled between them. ZeRO++'s block
kernels compile there as Pallas' Mosaic kernels (``tpu_custom_call``; Triton's on a GPU).

Limits: memory kinds are dropped on compile-only GPU devices, so host offload cannot be checked
for a GPU here (``jax.export`` for CUDA shows it instead); compile-only TPU chips keep them (the
``pinned_host`` arguments are counted apart). The schedule and the overlap are XLA's cost model's
decisions, not a measurement of a run.

``GPU_SPECS`` are XLA GPU target configs (``jzero/planning/gpu_specs/``): XLA's own for the H100,
A100 and B200, one XLA read from a real H200, and ones written from NVIDIA's datasheets for the
RTX 3090 and 4090, L4, L40S and A10G (sources in each file and the README there). ``jzero aot``
is the command line (:mod:`jzero.cli.aot`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any, Callable

from jzero.analysis.tables import format_bytes, format_count
from jzero.comm import program
from jzero.errors import ConfigError, JZeroError
from jzero.planning import overlap, tpu_specs
from jzero.planning.aot_report import AotReport
from jzero.runtime import quiet_start

__all__ = ["GPU_SPECS", "GpuSpec", "gpu_spec", "gpu_devices", "compile_for", "prepare",
           "compile_once", "Target",
           "DEFAULT_MEMORY_FRACTION", "SPEC_DIR"]

SPEC_DIR = Path(__file__).parent / "gpu_specs"
GPU_SPECS = {  # --gpu name -> XLA GPU target config in jzero/planning/gpu_specs
    "h100": "h100_sxm.txtpb",
    "h100-sxm": "h100_sxm.txtpb",
    "h100-pcie": "h100_pcie.txtpb",
    "a100": "a100_sxm_80.txtpb",
    "a100-80gb": "a100_sxm_80.txtpb",
    "a100-40gb": "a100_sxm_40.txtpb",
    "h200": "h200.txtpb",
    "b200": "b200.txtpb",
    "l40s": "l40s.txtpb",
    "l4": "l4.txtpb",
    "a10g": "a10g.txtpb",
    "rtx4090": "rtx4090.txtpb",
    "rtx3090": "rtx3090.txtpb",
}
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"  # the custom call a Pallas GPU kernel lowers to
MOSAIC_CALL_TARGET = 'custom_call_target="tpu_custom_call"'  # a Pallas TPU (Mosaic) kernel
DEFAULT_MEMORY_FRACTION = 0.75  # what JAX preallocates on a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION)


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """One GPU part: XLA's target config text and what jzero reads from it."""

  name: str  # the --gpu name, or the file's path
  text: str  # GpuTargetConfigProto as text: what get_topology_desc takes
  description: str  # device_description_str, e.g. "NVIDIA H100 80GB HBM3"
  memory_bytes: int  # device_memory_size


def gpu_spec(gpu: str) -> GpuSpec:
  """A GPU by its name in :data:`GPU_SPECS` or the path of a target-config text proto."""
  if gpu in GPU_SPECS:
    path = SPEC_DIR / GPU_SPECS[gpu]
  elif gpu.endswith((".txtpb", ".pbtxt")) and Path(gpu).is_file():
    path = Path(gpu)
  else:
    raise ConfigError(f"unknown GPU {gpu!r} (--gpu): give one of {sorted(GPU_SPECS)} or the path "
                      f"of an XLA GPU target config (.txtpb, as in XLA's "
                      f"xla/tools/hlo_opt/gpu_specs).")
  text = path.read_text()
  memory = re.search(r"device_memory_size:\s*(\d+)", text)
  if memory is None:
    raise ConfigError(f"GPU spec {str(path)!r} has no gpu_device_info.device_memory_size: not an "
                      f"XLA GPU target config.")
  described = re.search(r'device_description_str:\s*"([^"]*)"', text)
  return GpuSpec(name=gpu, text=text, description=described.group(1) if described else path.stem,
                 memory_bytes=int(memory.group(1)))


def gpu_devices(gpu: str | GpuSpec, devices: int, nodes: int = 1) -> list[Any]:
  """Compile-only devices of ``nodes`` x ``devices / nodes`` GPUs of one part (no GPU needed).

  Raises:
    ConfigError: a device count that is not a positive multiple of ``nodes``, or an unknown GPU.
    JZeroError: the CUDA compiler plugin is not installed (the message names the extra).
  """
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ConfigError(f"--devices {devices!r}: a GPU topology needs a positive device count, e.g. "
                      f"--devices 8.")
  if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or devices % nodes:
    raise ConfigError(f"--devices {devices} over --nodes {nodes}: the devices must split evenly "
                      f"over a positive number of nodes (devices per node = devices / nodes).")
  spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
  quiet_start.load_cuda_compiler()
  from jax.experimental import topologies  # noqa: PLC0415

  try:
    topology = topologies.get_topology_desc(platform="cuda", topology=f"{nodes} x 1 x "
                                            f"{devices // nodes}", target_config=spec.text)
  except NotImplementedError:
    raise JZeroError("the CUDA compiler plugin did not register its topology: JAX started its "
                     "backends before jzero was imported, on a machine without CUDA libraries, and "
                     "the plugin's CUDA version check failed then. Import jzero before using JAX in "
                     "this interpreter, or set JAX_PLATFORMS=cpu before starting Python.") from None
  return list(topology.devices)


def _config_dict(config: Any, precision: str | None, checkpoint_activations: bool | None,
                 micro_batch: int | None) -> dict[str, Any]:
  """The config as a dict with the overrides applied (each names the CLI flag that sets it)."""
  from jzero.config import Config  # noqa: PLC0415

  data = (config if isinstance(config, Config) else Config.load(config)).to_dict()
  if precision is not None:
    if precision not in ("fp32", "bf16", "fp16"):
      raise ConfigError(f"--precision {precision!r}: give fp32, bf16 or fp16.")
    data["fp16"] = dict(data.get("fp16") or {}, enabled=precision == "fp16")
    data["bf16"] = dict(data.get("bf16") or {}, enabled=precision == "bf16")
  if checkpoint_activations is True and data.get("activation_checkpointing") is None:
    data["activation_checkpointing"] = {}
  elif checkpoint_activations is False:
    data["activation_checkpointing"] = None
  if micro_batch is not None:
    if micro_batch < 1:
      raise ConfigError(f"--micro-batch {micro_batch}: give a positive number of sequences.")
    data["train_micro_batch_size_per_gpu"] = micro_batch
    data["train_batch_size"] = None  # derived again from micro-batch x accumulation x devices
  return data


def _model(model: Any) -> tuple[Any, Any, str | None]:
  """(model factory or module, GPTConfig or None, description or None) of compile_for's
  ``model``; a model of the user's is described by its class once built."""
  from jzero.models import GPT, GPTConfig  # noqa: PLC0415
  from jzero.models.gpt import PRESETS, preset  # noqa: PLC0415

  if isinstance(model, str):
    model = preset(model)
  if isinstance(model, GPTConfig):
    names = [n for n, c in PRESETS.items() if c == model]
    what = (f"GPT {names[0]}" if names else "GPT") + (
        f" ({model.n_layers} layers x d {model.d_model}, MLP {model.mlp_width}"
        f"{' gated' if model.gated_mlp else ''}, vocab {model.vocab_size}, seq {model.seq_len})")
    cfg = model
    return (lambda rngs: GPT(cfg, rngs=rngs)), cfg, what
  return model, None, None


def _leaf_bytes(sharding: Any, tree: Any) -> int:
  """Bytes one device holds of the leaves of ``tree`` laid out by ``sharding``."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  return sum(math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _state_bytes(engine: Any, state: Any) -> dict[str, int]:
  """Per-device bytes of each kind of model state, from the plan's shardings."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415

  plan = engine.plan
  shardings = engine.state_shardings()
  is_sharding = lambda x: isinstance(x, NamedSharding)  # noqa: E731

  def kind_bytes(shard_tree, tree):
    if tree is None:
      return 0
    per_leaf = jax.tree.map(_leaf_bytes, shard_tree, tree, is_leaf=is_sharding)
    return int(sum(jax.tree.leaves(per_leaf)))

  grads = sum(plan.local_numel(l, l.grad_partitioned) for l in plan.leaf_list())
  out = {"params": kind_bytes(shardings.params, state.params),
         "grads": grads * jnp.dtype(plan.compute_dtype).itemsize,
         "master": kind_bytes(shardings.master, state.master),
         "optimizer": kind_bytes(shardings.opt_state, state.opt_state)}
  if state.secondary is not None:
    out["secondary"] = kind_bytes(shardings.secondary, state.secondary)
  return out


def _bytes_per_param(engine: Any, state: Any) -> tuple[float, float]:
  """Bytes per parameter of the state's fp32 master and of its optimizer state (K = their sum)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  plan = engine.plan
  numel = sum(math.prod(plan.state_shape(l)) for l in plan.leaf_list())
  nbytes = lambda x: math.prod(x.shape) * np.dtype(x.dtype).itemsize  # noqa: E731
  master_k = sum(nbytes(x) for x in jax.tree.leaves(state.master)) / numel
  opt_k = sum(nbytes(x) for x in jax.tree.leaves(state.opt_state) if len(x.shape)) / numel
  return master_k, opt_k


def _estimate(engine: Any, state: Any, gpt: Any) -> dict[str, float]:
  """The estimator's per-device prediction for the same model, by kind (+ activations)."""
  import jax.numpy as jnp  # noqa: PLC0415

  from jzero.analysis import estimate  # noqa: PLC0415

  plan, zero = engine.plan, engine.config.zero_optimization
  master_k, opt_k = _bytes_per_param(engine, state)
  itemsize = jnp.dtype(plan.compute_dtype).itemsize
  activations = 0.0
  checkpointing = engine.config.activation_checkpointing
  if gpt is not None and not (checkpointing is not None and checkpointing.cpu_checkpointing):
    # (cpu_checkpointing keeps the checkpointed layer inputs on the host, none on the device)
    activations = estimate.activation_bytes(
        engine.micro_batch_size, gpt.seq_len, gpt.d_model, gpt.n_layers, gpt.n_heads,
        bytes_per_element=itemsize, checkpointing=checkpointing is not None)
  est = estimate.estimate(plan.leaf_list(), plan.stage, engine.mesh.zero_size, param_bytes=itemsize,
                        optimizer_bytes=master_k + opt_k,
                        persistence_threshold=zero.param_persistence_threshold,
                        model_persistence_threshold=zero.model_persistence_threshold,
                        hpz_partition_size=plan.zeropp.hpz)
  device = est.bytes["device"]
  per_k = device["optimizer"] / (master_k + opt_k) if master_k + opt_k else 0.0
  out = {"params": device["params"], "grads": device["grads"], "master": per_k * master_k,
         "optimizer": per_k * opt_k}
  if est.hpz > 1:
    out["secondary"] = device["secondary"]
  if activations:
    out["activations"] = activations
  return out


def _step_estimate(engine: Any, state: Any, gpt: Any) -> float:
  """The arithmetic's peak for this step (:func:`jzero.analysis.step_memory.step_peak`, what
  ``jzero plan`` states for the same config): the estimator's bytes for the plan's leaves with the
  config's offload and update (K read from the state), the GPT's shapes; 0 for another model."""
  if gpt is None:
    return 0.0
  import jax.numpy as jnp  # noqa: PLC0415

  from jzero.analysis.estimate import estimate  # noqa: PLC0415
  from jzero.analysis.step_memory import step_peak  # noqa: PLC0415
  from jzero.models.gpt import residual_dtype  # noqa: PLC0415

  plan, cfg = engine.plan, engine.config
  zero = cfg.zero_optimization
  n = engine.mesh.zero_size
  k = sum(_bytes_per_param(engine, state))
  def device(block: Any) -> str | None:
    return None if block is None or block.device in ("none", "auto") else block.device
  opt, param = device(zero.offload_optimizer), device(zero.offload_param)
  ratio = zero.offload_optimizer.ratio if opt else 1.0
  checkpointing = cfg.activation_checkpointing
  mode = ("none" if checkpointing is None else
          "offload" if checkpointing.cpu_checkpointing else "block")
  compute = jnp.dtype(plan.compute_dtype)
  e = estimate(plan.leaf_list(), plan.stage, n, param_bytes=compute.itemsize, optimizer_bytes=k,
               offload_optimizer=opt, offload_param=param,
               offload_ratio=1.0 if ratio == "auto" else float(ratio),
               offload_update=zero.offload_optimizer.update if opt == "cpu" else None,
               gradient_accumulation=cfg.gradient_accumulation_steps,
               persistence_threshold=zero.param_persistence_threshold,
               model_persistence_threshold=zero.model_persistence_threshold,
               hpz_partition_size=plan.zeropp.hpz, sub_group_size=zero.sub_group_size,
               delayed_update=bool(opt and zero.offload_optimizer.delayed_update),
               param_buffer_elements=(zero.offload_param.buffer_count
                                      * zero.offload_param.buffer_size if param == "nvme" else 0),
               param_cache_elements=zero.offload_param.max_in_cpu if param == "nvme" else 0)
  return step_peak(e, gpt, micro_batch=cfg.train_micro_batch_size_per_gpu, checkpointing=mode,
                   activation_bytes=residual_dtype(gpt, compute).itemsize,
                   quantized_gathers=plan.zeropp.quantized_weights is not None).peak


def compile_for(config: Any, gpu: str = "h100", devices: int = 8, *, advise: bool = False,
                **kwargs: Any) -> AotReport:
  """Compiles one train step for ``devices`` GPUs of one part without a GPU -- or, with
  ``tpu="v5e", topology="2x4"``, for a TPU slice without a TPU; see the module doc.

  The arguments are :func:`prepare`'s, and ``advise``: where less than
  :data:`jzero.planning.overlap.ADVISE_BELOW` of the bytes overlap, compile the step again with
  each knob that would raise it, and report what each gives and costs (:attr:`AotReport.advice`;
  a compile each). ``stage3_max_live_parameters: "auto"`` is resolved by compiling
  (:func:`jzero.planning.overlap.compile_resolved`).
  """
  target, data = prepare(config, gpu, devices, **kwargs)
  return overlap.compile_resolved(compile_once, target, data, advise=advise)


def prepare(config: Any, gpu: str = "h100", devices: int = 8, *, nodes: int = 1,
            mesh: str | Path | None = None, model: Any = "default",
            loss_fn: Callable[..., Any] | None = None, batch: Any = None,
            micro_batch: int | None = None, precision: str | None = None,
            checkpoint_activations: bool | None = None,
            memory_fraction: float | None = None, total_num_steps: int = 1000,
            progress: Callable[[str], None] | None = None, tpu: str | None = None,
            topology: str | None = None, slices: int = 1) -> tuple[Target, dict[str, Any]]:
  """The compile-only target and the config (as a dict, overrides applied) that
  :func:`compile_once` compiles; checked before any compile.

  Args:
    config: a DeepSpeed config (path, dict or :class:`jzero.Config`).
    gpu: a :data:`GPU_SPECS` name ("h100", "a100", ...) or the path of an XLA GPU target config.
    devices: GPUs in all; nodes: over how many nodes (the topology is nodes x 1 x devices/nodes).
    mesh: a mesh file (default: all devices on one data axis; node x local over ``nodes`` when
      the config asks for ZeRO++'s hpZ or qgZ).
    model: a :data:`jzero.models.gpt.PRESETS` name, a ``GPTConfig``, or any model
      :func:`jzero.initialize` takes (then give ``loss_fn`` and ``batch``).
    loss_fn: the loss (default: :func:`jzero.models.lm_loss` for the GPT shapes).
    batch: the global batch as a pytree of ``jax.ShapeDtypeStruct``, or a function
      ``train_batch_size -> pytree`` (default for the GPT: int32 tokens [batch, seq_len + 1]).
    micro_batch: overrides the config's ``train_micro_batch_size_per_gpu``.
    precision: overrides the config's precision ("fp32", "bf16", "fp16").
    checkpoint_activations: adds (True) or removes (False) the config's
      ``activation_checkpointing`` block; None keeps it as it is.
    memory_fraction: the part of the device's memory the step may use (default: on a GPU 0.75,
      what JAX preallocates; on a TPU 1.0).
    total_num_steps: fills a scheduler's "auto" total (the LR values, not the program's shape).
    progress: called with one line per phase (the CLI prints them to stderr).
    tpu, topology, slices: instead of ``gpu`` / ``devices`` / ``nodes``: a TPU generation
      (:data:`jzero.planning.tpu_specs.TPU_SPECS`), its slice's chip grid ("2x4", "2x2x2") and
      how many slices the data-centre network joins (they take ``nodes``' place: hpZ / qgZ's
      node axis is the slice, DCN, and the local axis the slice's chips, ICI).

  Raises:
    ConfigError: bad config, GPU / TPU name, device count, topology or mesh file (before any
      compile).
    JZeroError: the CUDA compiler plugin or libtpu is missing (the message names the extra).
  """
  from jzero.sharding.mesh import MeshSpec  # noqa: PLC0415
  from jzero.models import lm_loss  # noqa: PLC0415

  say = progress or (lambda _: None)
  if memory_fraction is None:
    memory_fraction = DEFAULT_MEMORY_FRACTION if tpu is None else 1.0
  if not 0 < memory_fraction <= 1:
    raise ConfigError(f"--mem-fraction {memory_fraction}: give the fraction of the device's "
                      f"memory the step may use, in (0, 1] (JAX preallocates 0.75 of a GPU).")
  if tpu is not None:
    spec = tpu_specs.tpu_spec(tpu)
    shape = tpu_specs.parse_topology(spec, topology or "")
    devices, nodes = math.prod(shape) * slices, slices
  else:
    if topology is not None:
      raise ConfigError(f"--topology {topology!r} is a TPU slice's: give --tpu too (a GPU "
                        f"topology is --devices and --nodes).")
    spec = gpu_spec(gpu)
  data = _config_dict(config, precision, checkpoint_activations, micro_batch)
  factory, gpt, what = _model(model)
  if gpt is None and (loss_fn is None or batch is None):
    raise ConfigError("compile_for with a model of your own needs its loss_fn and an abstract "
                      "batch (a pytree of jax.ShapeDtypeStruct, or train_batch_size -> pytree).")
  mesh_spec = MeshSpec.load(mesh) if mesh is not None else MeshSpec.default()
  zero = data.get("zero_optimization") or {}
  if (zero.get("offload_param") or {}).get("device") == "nvme":
    raise ConfigError(
        "zero_optimization.offload_param.device=nvme: the step reads those parameters through "
        "host callbacks (jzero.tiers.nvme_params), and XLA lowers a host callback only for a backend that "
        "is present, so it cannot be compiled for a GPU this machine lacks. Compile the plan with "
        "offload_param.device: cpu here (the same device-side step: a layer's partition arrives "
        "before its gather), or run jzero aot on the GPU machine.")
  if mesh is None and nodes > 1 and (zero.get("zero_hpz_partition_size", 1) not in (1, "auto")
                                     or zero.get("zero_quantized_gradients") is True):
    # ZeRO++'s hpZ / qgZ need the node x local split: the topology's own
    mesh_spec = MeshSpec(axes=(("node", nodes), ("local", devices // nodes)),
                         zero_axes=("node", "local"), batch_axes=("node", "local"))
  if tpu is not None:
    chips = tpu_specs.tpu_devices(spec, topology, slices)
    where = f"{slices} x {spec.name}:{topology} slice{'s' * (slices > 1)}"
  else:
    chips = gpu_devices(spec, devices, nodes)
    where = f"{nodes} node{'s' * (nodes > 1)}"
  zmesh = mesh_spec.build(chips)
  say(f"{devices} x {spec.description} ({where}), compile-only; mesh {zmesh.describe()}")
  target = Target(spec=spec, devices=devices, nodes=nodes, mesh=zmesh, factory=factory, gpt=gpt,
                  what=what, loss_fn=loss_fn or lm_loss, batch=batch,
                  memory_fraction=memory_fraction, total_num_steps=total_num_steps, say=say)
  return target, data


@dataclasses.dataclass(frozen=True)
class Target:
  """What every compile of one :func:`compile_for` call shares: the part, the topology and its
  mesh, the model, its loss and batch, the memory the step may use, and where progress goes."""

  spec: GpuSpec | tpu_specs.TpuSpec
  devices: int
  nodes: int
  mesh: Any
  factory: Any
  gpt: Any
  what: str | None
  loss_fn: Callable[..., Any]
  batch: Any
  memory_fraction: float
  total_num_steps: int
  say: Callable[[str], None]

  @property
  def pool(self) -> float:
    """Bytes a run may use per device, the part's memory times the memory fraction (what JAX's
    allocator preallocates, and hands XLA's compiler as the device's memory)."""
    return self.spec.memory_bytes * self.memory_fraction


def _io_bytes(batch: Any, lowered: Any) -> float:
  """Per-device bytes of the step's inputs and outputs that are not donated -- what XLA subtracts
  from the device's memory before it sets the scheduler's limit: arguments + outputs - the donated
  state (aliased to the new state) = the batch + every output."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  def shard_bytes(x: Any) -> float:
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize

  return sum(shard_bytes(x) for x in jax.tree.leaves(
      (batch, lowered.out_info if lowered is not None else None)))


def _scheduler_slop(options: dict[str, Any]) -> int:
  """The slop factor a run of the plan's step compiles with: jzero's (the plan's options), the
  user's ``XLA_FLAGS``, or XLA's default."""
  import os  # noqa: PLC0415

  if program.SLOP_OPTION in options:
    return int(options[program.SLOP_OPTION])
  found = re.search(rf"--{program.SLOP_OPTION}=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return int(found.group(1)) if found else program.XLA_DEFAULT_SLOP_PERCENT


def compile_once(target: Target, data: dict[str, Any], slop: int | None = None,
                 run_slop: int | None = None) -> AotReport:
  """One compile of the step of config ``data`` for ``target``: XLA's scheduler plans with the
  memory limit a run on the part would have (:func:`jzero.comm.program.scheduler_slop_for`) with
  the slop factor the plan passes (or ``run_slop``: what a run with that factor would have), or
  -- a what-if -- with slop factor ``slop`` as the compile-only part reads it."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jzero.analysis.hlo import (collectives, matmul_flops, memory_traffic,  # noqa: PLC0415
                                  parameter_bytes)
  from jzero.train.initialize import initialize  # noqa: PLC0415

  say, zmesh, spec, gpt = target.say, target.mesh, target.spec, target.gpt
  engine = initialize(model=target.factory, loss_fn=target.loss_fn, config=data, mesh=zmesh,
                      total_num_steps=target.total_num_steps)
  t0 = time.perf_counter()
  state = engine.abstract_state(full=False)  # as the step takes it: nothing is allocated
  global_batch = engine.global_batch_size
  batch = target.batch
  if gpt is not None and batch is None:
    batch = {"tokens": jax.ShapeDtypeStruct((global_batch, gpt.seq_len + 1), jnp.int32)}
  elif callable(batch):
    batch = batch(global_batch)
  sharding = engine.batch_sharding()
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch)
  num_params = sum(l.numel for l in engine.plan.leaf_list())
  what = target.what or type(engine.model.module).__name__  # a factory's: the class it builds
  cfg = engine.config
  say(f"model {what}: {format_count(num_params)} params; ZeRO-{cfg.zero_optimization.stage}, "
      f"{cfg.precision}, micro-batch {cfg.train_micro_batch_size_per_gpu} x gas "
      f"{cfg.gradient_accumulation_steps} x dp {zmesh.dp_size}")
  variant = engine.steady_variant
  traced = engine.jitted_step(batch, variant).trace(engine.lowerable(state, variant), batch)
  t1 = time.perf_counter()
  say(f"traced in {t1 - t0:.1f} s; lowering")
  lowered = traced.lower()
  t2 = time.perf_counter()
  options = program.compile_options(engine.plan)
  run_slop = run_slop if run_slop is not None else _scheduler_slop(options)
  io = _io_bytes(batch, lowered)
  on_gpu = isinstance(spec, GpuSpec)
  extra = {}
  if on_gpu:  # a TPU compile plans with the chip's own HBM: no pool to emulate
    emulated = slop if slop is not None else program.scheduler_slop_for(
        run_slop, target.pool, spec.memory_bytes, io)
    extra = program.supported(zmesh.mesh.devices.flat[0], {program.SLOP_OPTION: emulated})
  limit = _limit(target, io, run_slop, slop) if on_gpu else 0.0
  if not on_gpu:
    say("reduce_bucket_size / allgather_bucket_size / overlap_comm / the prefetch knobs are XLA "
        "GPU options: the TPU compile keeps XLA's TPU defaults for them")
  say(f"lowered in {t2 - t1:.1f} s; XLA {'GPU' if on_gpu else 'TPU'} compile (fusion, "
      f"combiners, scheduling" + (f"; the scheduler's memory limit {format_bytes(limit)})"
                                  if on_gpu else ")"))
  compiled = lowered.compile(compiler_options=extra or None)
  t3 = time.perf_counter()
  say(f"compiled in {t3 - t2:.1f} s")
  analysis = compiled.memory_analysis()
  hlo = compiled.as_text()
  tile_padding = 0
  if not on_gpu:  # a TPU lays each argument out in tiles: what they add, apart from the plan's
    logical, laid_out = parameter_bytes(hlo)
    tile_padding = laid_out - logical
  return AotReport(
      gpu=spec.description, gpu_name=spec.name, devices=target.devices, nodes=target.nodes,
      mesh=zmesh.describe(), stage=cfg.zero_optimization.stage, precision=cfg.precision,
      model=what, num_params=num_params, micro_batch=cfg.train_micro_batch_size_per_gpu,
      gradient_accumulation_steps=cfg.gradient_accumulation_steps,
      checkpoint_activations=cfg.activation_checkpointing is not None,
      state=_state_bytes(engine, state), estimate=_estimate(engine, state, gpt),
      argument=analysis.argument_size_in_bytes, output=analysis.output_size_in_bytes,
      temp=analysis.temp_size_in_bytes, alias=analysis.alias_size_in_bytes,
      device_memory=spec.memory_bytes, memory_fraction=target.memory_fraction, trace_s=t1 - t0,
      lower_s=t2 - t1, compile_s=t3 - t2, collectives=collectives(hlo, zmesh),
      xla_options=options, scheduler_slop=extra.get(program.SLOP_OPTION, 0),
      pallas_kernels=pallas_calls(hlo), platform="gpu" if on_gpu else "tpu",
      tile_padding=tile_padding, batch_bytes=_io_bytes(batch, None) if not on_gpu else 0,
      host_argument=getattr(analysis, "host_argument_size_in_bytes", 0) if not on_gpu else 0,
      matmul_flops=matmul_flops(hlo), memory_traffic=memory_traffic(hlo),
      scheduler_limit=limit, prefetch=engine.plan.prefetch,
      largest_gathered=engine.plan.gathered_working_set()[0]
      * jnp.dtype(engine.plan.compute_dtype).itemsize,
      step_estimate=_step_estimate(engine, state, gpt))


def _limit(target: Target, io: float, run_slop: int, slop: int | None) -> float:
  """The scheduler's memory limit in bytes: a run's ``(pool - io) x slop / 100``, or -- with a
  what-if ``slop`` -- what XLA computes for the compile-only part."""
  if slop is not None:
    return (program.XLA_COMPILE_ONLY_MEMORY_SHARE * target.spec.memory_bytes - io) * slop / 100
  return (target.pool - io) * run_slop / 100


def pallas_calls(hlo_text: str) -> int:
  """The Pallas kernels a compiled program calls: a GPU program's Triton custom calls, a TPU
  program's Mosaic ones."""
  return sum(1 for line in hlo_text.splitlines()
             if "custom-call(" in line and (TRITON_CALL_TARGET in line
                                            or MOSAIC_CALL_TARGET in line))
