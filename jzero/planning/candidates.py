"""The configurations ``jzero plan`` chooses among, and what each costs by ZeRO's arithmetic.

A :class:`Job` is the model (the embedded GPT's shape) and the global batch; a :class:`Candidate`
is one way to run it: ZeRO stage 0-3, ZeRO++'s parts (more than one node, stage 3; qwZ by each
weight quantization strategy :data:`jzero.sharding.quantization.WEIGHTS` marks ``planned``),
optimizer offload (none, or each tier's ``device`` value in :mod:`jzero.tiers.registry`: cpu --
whole or half, a tier with ``partial`` --, nvme, ...), parameter offload (stage 3: none / each
tier's value),
activation checkpointing (none / per block / per block with the inputs on the host) and the
micro-batch, which sets the gradient accumulation. :func:`candidates` lists every valid one;
:meth:`Candidate.deepspeed_config` writes it as the DeepSpeed JSON ``jzero train`` and
``jzero.initialize`` take.

:func:`estimated` prices a candidate without compiling it: the device bytes of its compiled step
by :func:`jzero.analysis.step_memory.step_memory` (state, gradients and their fp32 accumulator,
saved activations in the model's own activation dtype, one layer's working set, stage 3's
gathered layers, the update phase), host and NVMe bytes per node from
:func:`jzero.analysis.estimate.estimate`'s tiers (gradients stay on the device under jzero's
offload, so none on the host), FLOPs from the GPT's shapes (6 per parameter and token, the
attention scores, one forward more when blocks are recomputed), collective bytes from ZeRO's
communication analysis (2Ψ per step for stages 0-2, 3Ψ per micro-batch for stage 3; ZeRO++ as its
paper counts: qwZ's strategy of ``bits`` cuts the forward gather to ``bits / 16`` (DeepSpeed's
int8: half), hpZ keeps the backward gather inside the node, qgZ
sends a quarter of the gradient bytes across nodes), and the offload streams from the bytes each
tier moves per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from jzero.analysis import estimate as est
from jzero.analysis import update_memory
from jzero.config.blocks import CPU_ADAM
from jzero.errors import ConfigError
from jzero.planning.cost import Hardware, Resources
from jzero.sharding import quantization
from jzero.tiers import registry

__all__ = ["Job", "Candidate", "candidates", "estimated", "Estimated", "gpt_for_params",
           "param_buffer_size",
           "CHECKPOINTING", "DEFAULT_NVME_PATH"]

CHECKPOINTING = ("none", "block", "offload")  # activation checkpointing choices
DEFAULT_NVME_PATH = "/local_nvme"  # DeepSpeed's tutorials' nvme_path: change it to your drive
QWZ = "qwz"  # a Candidate.zeropp part: qwZ by DeepSpeed's strategy; "qwz-<name>" by another
_BUFFER_COUNT = 5  # offload_param.buffer_count, DeepSpeed's default
_BASE_CONFIG = {"gradient_clipping": 1.0, "steps_per_print": 10,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95],
                                                          "weight_decay": 0.1}}}


def _optimizer_offloads() -> list[tuple[str | None, float, str | None]]:
  """(offload_optimizer device, ratio, update) choices: none, then each registered tier's value
  whole with the engine's default update (``device: cpu``: the host's Adam, the gradients
  streamed to the host in the backward pass) and, for a tier that honours a ratio
  (:attr:`jzero.tiers.base.Tier.partial`), half; the host tier whole and half with the update
  on the device (``update: stream``, written into the config)."""
  out: list[tuple[str | None, float, str | None]] = [(None, 1.0, None)]
  for value in registry.devices("offload_optimizer"):
    updates = update_memory.update_choices(value)
    out += [(value, 1.0, update) for update in updates]
    if registry.answering("offload_optimizer", value).partial:
      out.append((value, 0.5, updates[-1]))
  return out


def _zeropp_choices(devices_per_node: int) -> list[tuple[str, ...]]:
  """ZeRO++'s combinations: none, hpZ (its secondary partition is a node's devices: with two or
  more per node), then qwZ by each planned weight strategy with qgZ, alone and with hpZ."""
  default = next(iter(quantization.WEIGHTS))
  qwz = [QWZ if name == default else f"{QWZ}-{name}"
         for name, s in quantization.WEIGHTS.items() if s.planned]
  hpz = devices_per_node >= 2
  return ([()] + [("hpz",)] * hpz + [(q, "qgz") for q in qwz]
          + [("hpz", q, "qgz") for q in qwz if hpz])


def _zero_infinity_1t() -> Any:
  from jzero.models.gpt import GPTConfig  # noqa: PLC0415

  return GPTConfig(vocab_size=50257, seq_len=2048, d_model=25600, n_layers=128, n_heads=160)


def gpt_for_params(count: float) -> Any:
  """The embedded GPT's shape for about ``count`` parameters: a preset (or the ZeRO-Infinity
  paper's 1T model, 128 layers of hidden 25,600) within 10% of it, else
  hidden size and depth at the ZeRO-Infinity paper's aspect ratio (1T: 128 layers of 25,600,
  hidden / layers = 200), hidden a multiple of 128, heads of 128, sequence 2048, vocabulary
  50257."""
  from jzero.models.gpt import PRESETS, GPTConfig  # noqa: PLC0415

  ZERO_INFINITY_1T = _zero_infinity_1t()  # noqa: N806
  if not count >= 1e5:
    raise ConfigError(f"--params {count:g}: give a parameter count of at least 1e5, e.g. 7e9.")
  for cfg in (*PRESETS.values(), ZERO_INFINITY_1T):
    if abs(cfg.num_params() - count) <= 0.1 * count:
      return cfg
  d_model = max(128, round((200 * count / 12) ** (1 / 3) / 128) * 128)
  layers = max(1, round(count / (12 * d_model * d_model)))
  return GPTConfig(vocab_size=50257, seq_len=2048, d_model=d_model, n_layers=layers,
                   n_heads=d_model // 128)


def param_buffer_size(model: Any, devices: int) -> int:
  """``offload_param.buffer_size`` for parameters on NVMe: DeepSpeed's 1e8 elements, or one
  layer's partition when that is larger (jzero refuses a buffer smaller than a partition)."""
  m = model
  embeddings = m.d_model * (m.vocab_size * (1 + (not m.tie_embeddings)) + m.seq_len)
  return max(100_000_000, math.ceil((m.num_params() - embeddings) / m.n_layers / devices))


@dataclasses.dataclass(frozen=True)
class Job:
  """What to train: the GPT's shape, the global batch (sequences per step), the precision, and
  the config blocks a plan keeps as given (optimizer, scheduler, clipping)."""

  model: Any  # jzero.models.GPTConfig
  global_batch: int
  precision: str = "bf16"
  base_config: dict = dataclasses.field(default_factory=lambda: dict(_BASE_CONFIG))

  @property
  def param_bytes(self) -> int:
    return est.PRECISION_BYTES[self.precision]

  @property
  def optimizer_bytes(self) -> int:
    """K: Adam's two moments, plus an fp32 master under bf16 / fp16."""
    return 8 if self.precision == "fp32" else 12


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to run a job (see the module docstring)."""

  stage: int
  micro_batch: int
  gradient_accumulation: int
  checkpointing: str = "none"
  offload_optimizer: str | None = None
  offload_ratio: float = 1.0
  offload_param: str | None = None
  zeropp: tuple[str, ...] = ()
  offload_update: str | None = None  # None: the engine's default for offload_optimizer

  @property
  def update(self) -> str | None:
    """The optimizer offload's update (:mod:`jzero.analysis.update_memory`), None without one."""
    return self.offload_update or update_memory.default_update(self.offload_optimizer,
                                                                self.offload_param)

  @property
  def quantized_weights(self) -> str | None:
    """The qwZ strategy's name (:data:`jzero.sharding.quantization.WEIGHTS`), or None."""
    part = next((p for p in self.zeropp if p.startswith(QWZ)), None)
    if part is None:
      return None
    return part[len(QWZ) + 1:] or next(iter(quantization.WEIGHTS))

  @property
  def name(self) -> str:
    """'ZeRO-3 +hpZ+qwZ opt->cpu(0.5) param->nvme ckpt=block mb 2x4' (another qwZ strategy than
    DeepSpeed's: '+qwZ(int4)'; an update named in the config: 'opt->cpu[stream]')."""
    parts = ["DDP" if self.stage == 0 else f"ZeRO-{self.stage}"]
    parts += [f"+qwZ({p[len(QWZ) + 1:]})" if p.startswith(QWZ + "-")
              else f"+{p[:-1]}{p[-1].upper()}" for p in self.zeropp]
    if self.offload_optimizer:
      ratio = f"({self.offload_ratio:g})" if self.offload_ratio != 1 else ""
      update = f"[{self.offload_update}]" if self.offload_update else ""
      parts.append(f"opt->{self.offload_optimizer}{ratio}{update}")
    if self.offload_param:
      parts.append(f"param->{self.offload_param}")
    if self.checkpointing != "none":
      parts.append(f"ckpt={self.checkpointing}")
    parts.append(f"mb {self.micro_batch}x{self.gradient_accumulation}")
    return " ".join(parts)

  def deepspeed_config(self, job: Job, devices: int, nvme_path: str = DEFAULT_NVME_PATH, *,
                       devices_per_node: int | None = None) -> dict:
    """The candidate as a DeepSpeed config for ``devices`` devices (the job's base blocks kept).

    Every value has the type DeepSpeed's config classes declare (tests/deepspeed_fields.py):
    hpZ's ``zero_hpz_partition_size`` is the integer ``devices_per_node``
    (DeepSpeed drops an "auto" value, which leaves hpZ off)."""
    zero: dict[str, Any] = {"stage": self.stage, "overlap_comm": self.stage == 3}
    if self.offload_optimizer:
      zero["offload_optimizer"] = {"device": self.offload_optimizer, "pin_memory": True}
      if self.offload_ratio != 1:
        zero["offload_optimizer"]["ratio"] = self.offload_ratio
      if self.offload_optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_path
      if self.offload_update:  # jzero's key (DeepSpeed's config class has no such field)
        zero["offload_optimizer"]["update"] = self.offload_update
    if self.offload_param:
      zero["offload_param"] = {"device": self.offload_param, "pin_memory": True}
      if self.offload_param == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path, buffer_count=_BUFFER_COUNT,
                                     buffer_size=param_buffer_size(job.model, devices))
    if "hpz" in self.zeropp:
      if devices_per_node is None or devices_per_node < 2:
        raise ValueError(f"{self.name}: hpZ's partition is a node's devices; give "
                         f"devices_per_node (2 or more), got {devices_per_node!r}.")
      zero["zero_hpz_partition_size"] = int(devices_per_node)
    weights = self.quantized_weights
    if weights is not None:
      deepspeeds = weights == next(iter(quantization.WEIGHTS))
      zero["zero_quantized_weights"] = True if deepspeeds else weights
    if "qgz" in self.zeropp:
      zero["zero_quantized_gradients"] = True
    config = dict(job.base_config)
    config.update({
        "train_batch_size": self.micro_batch * self.gradient_accumulation * devices,
        "train_micro_batch_size_per_gpu": self.micro_batch,
        "gradient_accumulation_steps": self.gradient_accumulation,
        "bf16": {"enabled": job.precision == "bf16"}, "fp16": {"enabled": job.precision == "fp16"},
        "zero_optimization": zero})
    if self.checkpointing != "none":
      config["activation_checkpointing"] = {"cpu_checkpointing": self.checkpointing == "offload"}
    return config


def candidates(job: Job, devices: int, nodes: int = 1, *, stages: tuple[int, ...] = (0, 1, 2, 3),
               micro_batches: tuple[int, ...] | None = None,
               offload_tiers: tuple[str, ...] | None = None,
               checkpointing: tuple[str, ...] = CHECKPOINTING,
               host_sum_in_loop: bool = True) -> list[Candidate]:
  """Every valid candidate for ``job`` on ``devices`` (in all) over ``nodes``.

  Micro-batches: the powers of two that divide the sequences per device (default), each with the
  accumulation that makes the global batch. ZeRO++ variants only with more than one node.
  ``offload_tiers`` are the ``device`` values offload may use (None: every registered tier's,
  :func:`jzero.tiers.registry.devices`; ``()``: no offload variants);
  ``checkpointing`` the activation checkpointing choices (:data:`CHECKPOINTING`).
  ``host_sum_in_loop``: the target compiles the host Adam's sum of micro-batches in host memory
  (False on TPU, where jzero refuses it: :func:`jzero.tiers.host_step.check_update`): without
  it the host Adam's candidates run one micro-batch per step.
  """
  if job.global_batch < 1 or job.global_batch % devices:
    raise ConfigError(f"--global-batch {job.global_batch}: the global batch must be a positive "
                      f"multiple of the {devices} devices, e.g. --global-batch {4 * devices}.")
  per_device = job.global_batch // devices
  if micro_batches is None:
    micro_batches = tuple(2**i for i in range(per_device.bit_length()) if per_device % 2**i == 0)
  bad = [m for m in micro_batches if m < 1 or per_device % m]
  if bad:
    raise ConfigError(f"micro-batches {bad} do not divide the {per_device} sequences per device "
                      f"of the global batch {job.global_batch}.")
  out = []
  for stage in stages:
    # a partial offload (ratio < 1) is stage 3's only, as in DeepSpeed (jzero's config refuses it)
    allowed = lambda value: offload_tiers is None or value in offload_tiers
    opts = [(o, r, u) for o, r, u in _optimizer_offloads()
            if o is None or (stage and allowed(o) and (r == 1 or stage == 3))]
    params = [None] + [t for t in registry.devices("offload_param") if stage == 3 and allowed(t)]
    zeropp = _zeropp_choices(devices // nodes) if nodes > 1 and stage == 3 else [()]
    for (opt, ratio, update), param, plus, ckpt, mb in itertools.product(
        opts, params, zeropp, checkpointing, micro_batches):
      if plus and param:  # ZeRO++ gathers device-resident partitions
        continue
      default = update_memory.default_update(opt, param)
      if update is not None and update == default and ratio == 1:
        continue  # the default's candidate (the streamed update beside NVMe params)
      if (update or default) == CPU_ADAM and (plus or (
          per_device // mb > 1 and not host_sum_in_loop)):
        continue  # the host Adam where its memory model is checked: no ZeRO++ (the engine
        # runs it with qwZ / qgZ / hpZ too: tests/tiers/test_host_step.py), params on the device
        # or in host memory (device: cpu beside params on NVMe streams), accumulation where the
        # target compiles it
      out.append(Candidate(stage, mb, per_device // mb, ckpt, opt, ratio, param, plus, update))
  return out


@dataclasses.dataclass(frozen=True)
class Estimated:
  """A candidate priced by arithmetic: its memory per tier and its :class:`Resources`.

  Attributes:
    device_bytes: per device: the compiled step's peak as ``memory`` models it.
    host_bytes, nvme_bytes: per node.
    estimate: the model states per tier (:func:`jzero.analysis.estimate.estimate`).
    memory: the step's device bytes by part (:class:`jzero.analysis.step_memory.StepMemory`).
    host_update_share: per device: bytes of the update the host tier runs.
    offloaded_bytes: per device: the state its offload keeps off the device (what its device
      twin holds more).
    offload_floor: per device, with offload: the update phase's bytes, which a twin's compile
      cannot show (the streamed update holds a leaf's state at a time); 0 without offload.
    streams_gradients: the gradients leave the device in the backward pass (``"cpu_adam"``): no
      device twin's compile shows its bytes, which come from ``memory`` where the target's
      compile cannot place host memory (:func:`jzero.planning.compiled.compiles_offload`).
  """

  device_bytes: float
  host_bytes: float
  nvme_bytes: float
  resources: Resources
  estimate: est.Estimate
  host_update_share: float = 0.0
  memory: Any = None
  offloaded_bytes: float = 0.0
  offload_floor: float = 0.0
  streams_gradients: bool = False


def _leaves(model: Any) -> list[est.ParamShape]:
  from jzero.modeling.model_adapter import as_model  # noqa: PLC0415
  from jzero.models import GPT  # noqa: PLC0415

  adapter = as_model(lambda rngs: GPT(model, rngs=rngs))
  return est.param_shapes(adapter.abstract_params(None, None), adapter.stacked_layers)


def activation_bytes_of(model: Any, precision: str) -> int:
  """Bytes per element of the activations the embedded GPT's layers pass along when its parameters
  are in ``precision`` (:func:`jzero.models.gpt.residual_dtype`: fp32 even in bf16 today)."""
  from jzero.models.gpt import residual_dtype  # noqa: PLC0415

  return residual_dtype(model, est.DTYPES[precision]).itemsize


def estimated(c: Candidate, job: Job, hw: Hardware, leaves: list | None = None,
              activation_bytes: int | None = None) -> Estimated:
  """Memory and resources of ``c`` by arithmetic (the module docstring): the device bytes of its
  compiled step (:func:`jzero.analysis.step_memory.step_peak`), host and NVMe bytes per node,
  and what a step moves. ``leaves`` (:func:`jzero.analysis.estimate.param_shapes` of the model)
  and ``activation_bytes`` (:func:`activation_bytes_of`) save working them out again."""
  from jzero.analysis.step_memory import step_peak  # noqa: PLC0415

  m, p, k = job.model, job.param_bytes, job.optimizer_bytes
  leaves = leaves if leaves is not None else _leaves(m)
  a = activation_bytes if activation_bytes is not None else activation_bytes_of(m, job.precision)
  n, per_node = hw.devices, hw.devices_per_node
  hpz = per_node if "hpz" in c.zeropp else 1
  gas = c.gradient_accumulation
  common = dict(param_bytes=p, optimizer_bytes=k, hpz_partition_size=hpz,
                gradient_accumulation=gas)
  e = est.estimate(leaves, c.stage, per_node, hw.nodes, offload_optimizer=c.offload_optimizer,
                   offload_param=c.offload_param, offload_ratio=c.offload_ratio,
                   offload_update=c.offload_update,
                   param_buffer_elements=_BUFFER_COUNT * param_buffer_size(m, n),
                   param_cache_elements=1e9, **common)
  twin = est.estimate(leaves, c.stage, per_node, hw.nodes, **common)
  def on_device(x: est.Estimate) -> float:  # the state on the device (gradients: the step's)
    return sum(v for kind, v in x.bytes["device"].items() if kind != "grads")
  memory = step_peak(e, m, micro_batch=c.micro_batch, checkpointing=c.checkpointing,
                     activation_bytes=a, quantized_gathers=c.quantized_weights is not None)
  offloaded = on_device(twin) - on_device(e)
  streams = update_memory.streams_gradients(e.update)
  acts = m.n_layers * c.micro_batch * m.seq_len * m.d_model * a  # the layer inputs, every layer
  psi = e.num_params
  host_acts = acts if c.checkpointing == "offload" else 0.0
  tokens = job.global_batch * m.seq_len / n
  forward = 2 * psi * tokens + 4 * m.n_layers * m.seq_len * m.d_model * tokens
  flops = forward * (3 + (c.checkpointing != "none"))
  shard = psi / n if c.stage else psi
  r = c.offload_ratio if c.offload_optimizer else 0.0
  ring = (n - 1) / n
  if c.stage == 3:  # forward gather, backward gather, gradient reduce-scatter, per micro-batch
    weights = c.quantized_weights
    parts = {"fwd": gas * psi * p * (quantization.weights(weights).bits / 16 if weights else 1),
             "bwd": gas * psi * p, "grad": gas * psi * p}
  elif c.stage == 2:
    parts = {"fwd": psi * p, "bwd": 0.0, "grad": gas * psi * p}
  else:
    parts = {"fwd": psi * p, "bwd": 0.0, "grad": psi * p}
  inter = intra = 0.0
  for part, nbytes in parts.items():
    nbytes *= ring
    if hw.nodes == 1 or (part == "bwd" and "hpz" in c.zeropp):
      intra += nbytes
    elif part == "grad" and "qgz" in c.zeropp:
      intra, inter = intra + nbytes / 2, inter + nbytes / 4
    else:
      inter += nbytes
  update = shard * (2 * k + p + p)  # read + write master and moments, read grads, write params
  nvme = 0.0
  if streams:  # each micro-batch's partition down (stage 1: the reduced one), new params up
    g = update_memory.host_gradient_bytes(p, gas)
    sent = gas if c.stage >= 2 else 1
    pcie = r * shard * (p * sent if c.stage >= 2 else g) + r * shard * p * (not c.offload_param)
    if gas > 1 and c.stage >= 2:  # the host sums the micro-batches in fp32
      update += shard * (g - p) + gas * shard * (p + 8)
    if c.offload_optimizer == "nvme":  # the gradient the host Adam reads waits in the store
      nvme += per_node * r * shard * (2 * g if gas == 1 else 8 * gas)
  else:
    pcie = r * shard * (p + p)  # gradient partition down, updated params up
  if c.offload_param:
    pcie += gas * 2 * p * (psi - e.persistent_params) / n  # each layer's partition, fwd and bwd
  pcie += 2 * host_acts * gas
  if c.offload_optimizer == "nvme":
    nvme += per_node * r * shard * 2 * k
  if c.offload_param == "nvme":
    nvme += per_node * e.bytes["nvme"]["params"] * gas * 2  # read in the forward and backward
  resources = Resources(
      flops=flops, memory_bytes=(1 - r) * update, intra_node_bytes=intra,
      inter_node_bytes=inter, overlap=1.0 if c.stage == 3 else 0.0, pcie_bytes=pcie,
      host_update_bytes=per_node * r * update, nvme_traffic=nvme, source="estimator")
  host = e.tier_total("host") * per_node + per_node * host_acts
  return Estimated(device_bytes=memory.peak, host_bytes=host,
                   nvme_bytes=e.tier_total("nvme") * per_node, resources=resources, estimate=e,
                   host_update_share=r * update, memory=memory, offloaded_bytes=offloaded,
                   offload_floor=memory.update_phase if offloaded else 0.0,
                   streams_gradients=streams)
