"""The cost model of ``jzero plan``: a step's predicted time from the bytes and FLOPs it moves.

A candidate's step is described by what it uses per device (:class:`Resources`): matmul FLOPs
(recompute included), collective bytes sent inside a node and across nodes, bytes over PCIe between
host and device, bytes the host-side optimizer touches in host memory, and bytes read from and
written to NVMe. Each is turned into seconds by one rate of the target (:class:`Hardware`), and the
step is::

    compute  = FLOPs / (peak x matmul_efficiency) + memory bytes / HBM bandwidth
    network  = intra-node bytes / intra-node bandwidth + inter-node bytes / inter-node bandwidth
    offload  = max(PCIe bytes / PCIe bandwidth, host update bytes / host memory bandwidth,
                   NVMe bytes / NVMe bandwidth)
    step     = max(compute, overlap x network) + (1 - overlap) x network + offload

*FLOPs* are the matrix multiplications' (recompute included); *memory bytes* what the rest of the
step -- elementwise work, normalizations, softmax, the optimizer update, copies -- reads and writes
in device memory, each instruction bound by bandwidth rather than arithmetic (the roofline's two
sides, added because the two kinds of instruction run one after the other). Arithmetic knows only
the optimizer update's bytes; a compiled candidate's are counted in its program
(:func:`jzero.analysis.hlo.memory_traffic`). ``overlap`` is the share of the collective bytes that the compiled schedule runs with compute in
flight (:attr:`jzero.planning.aot_report.AotReport.overlap_fraction`; without a compile, 1 where the
config asks for ``overlap_comm`` in stage 3 and 0 otherwise, as jzero's defaults compile). The
offload streams overlap one another (a pipeline of PCIe, host memory and NVMe) but not the device's
compute: jzero runs the host optimizer step after the backward pass. The *bound* of a step is its
largest term. Times are **predictions**, not measurements.

Every rate is a :class:`Constant` with its source: the GPU's XLA spec (HBM bandwidth), NVIDIA's
datasheets (peak FLOP/s, NVLink, PCIe, the DGX node's network, host memory and NVMe), the Amazon
EC2 instance a cloud PCIe part is rented in, a stated assumption (a GeForce part's desktop), a
paper's measurement (matmul efficiency, NVMe bandwidth), or a measurement on this machine
(:func:`cpu_hardware`, for validating the model where a step can be run: the CPU). The share of
each GPU's memory a step may use is the memory fraction the run sets with
``XLA_PYTHON_CLIENT_MEM_FRACTION`` (:data:`DEFAULT_MEM_FRACTION`, 0.90; JAX's own default, 0.75,
leaves a quarter of the card unused).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, NamedTuple

from jzero.analysis.flops import GPU_PEAKS
from jzero.errors import ConfigError

__all__ = ["Constant", "Hardware", "Resources", "Prediction", "gpu_hardware", "cpu_hardware",
           "predict", "measure_memory_bandwidth", "describe_constants",
           "NODE_DATASHEETS", "MATMUL_EFFICIENCY", "tpu_hardware", "DEFAULT_MEM_FRACTION",
           "JAX_MEM_FRACTION", "MEM_FRACTION_ENV"]

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # what JAX preallocates of each GPU
JAX_MEM_FRACTION = 0.75  # JAX's default preallocation
# What a plan may use of each GPU unless told otherwise, and what the written config's env file
# sets: 0.90 leaves 10% outside XLA's pool for the CUDA context, cuBLAS / cuDNN workspaces and
# NCCL's buffers (2.4 GB on a 24 GB card, 8 GB on 80 GB), where JAX's 0.75 leaves a quarter of the
# card idle.
DEFAULT_MEM_FRACTION = 0.90


class Constant(NamedTuple):
  """A named rate or size of the target, and where its value comes from."""

  value: float
  source: str


# Per-GPU links and per-node resources of the node each part ships in: NVIDIA's DGX datasheets for
# the SXM parts; the Amazon EC2 instance each cloud PCIe part is rented in (its largest size, 8
# GPUs); a desktop workstation for the GeForce parts. Keys are matched as whole words of the XLA
# spec's device description ("L4" is not "L40S").
_ZERO_INFINITY_NVME = Constant(25e9, "about 25 GB/s aggregate read of a DGX node's NVMe array "
                               "(ZeRO-Infinity paper, Rajbhandari et al. 2021, Sec. 2)")
_PCIE4 = Constant(32e9, "PCIe Gen4 x16: 64 GB/s bidirectional, 32 GB/s each way (datasheet)")
_PCIE5 = Constant(64e9, "PCIe Gen5 x16: 128 GB/s bidirectional, 64 GB/s each way (datasheet)")
_DGX_H = {
    "intra_node_bandwidth": Constant(450e9, "NVLink 4: 900 GB/s bidirectional per GPU, 450 GB/s "
                                     "each way (H100 / H200 SXM datasheets)"),
    "inter_node_bandwidth": Constant(50e9, "one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100 / H200 "
                                     "datasheets)"),
    "pcie_bandwidth": _PCIE5,
    "host_bandwidth": Constant(614e9, "2 x Xeon 8480C, 8 channels of DDR5-4800 each: "
                               "2 x 8 x 38.4 GB/s (DGX H100 / H200 datasheets, Intel ark)"),
    "host_memory": Constant(2e12, "2 TB system memory (DGX H100 / H200 datasheets)"),
    "nvme_bytes": Constant(30.72e12, "8 x 3.84 TB U.2 NVMe data drives (DGX H100 / H200 "
                           "datasheets)"),
    "nvme_bandwidth": _ZERO_INFINITY_NVME,
}


def _ec2(instance: str, memory_gib: int, network_gbps: int, nvme_tb: float, nvme_drives: str,
         cpu: str) -> dict[str, Constant]:
  """The per-GPU share of an 8-GPU Amazon EC2 instance (its instance-type page)."""
  page = f"Amazon EC2 {instance} instance type page"
  return {
      "intra_node_bandwidth": Constant(32e9, "no NVLink: GPU to GPU over PCIe Gen4 x16, 32 GB/s "
                                       "each way at most (datasheet)"),
      "inter_node_bandwidth": Constant(network_gbps / 8 * 1e9 / 8,
                                       f"{network_gbps} Gb/s network per instance, shared by its 8 "
                                       f"GPUs ({page})"),
      "pcie_bandwidth": _PCIE4,
      "host_bandwidth": Constant(2 * 8 * 25.6e9, f"{cpu}, 8 channels of DDR4-3200 per socket, two "
                                 f"sockets assumed: 2 x 8 x 25.6 GB/s (AMD spec)"),
      "host_memory": Constant(memory_gib * 2**30, f"{memory_gib} GiB memory ({page})"),
      "nvme_bytes": Constant(nvme_tb * 1e12, f"{nvme_drives} local NVMe ({page})"),
      "nvme_bandwidth": Constant(2e9 * int(nvme_drives.split()[0]),
                                 f"assumed: about 2 GB/s per local NVMe drive ({nvme_drives}); "
                                 f"AWS publishes no figure"),
  }


def _desktop(ddr: str, channel_gbs: float) -> dict[str, Constant]:
  """A GeForce workstation: what a plan on one should be told with --host-memory and --nvme."""
  return {
      "intra_node_bandwidth": Constant(32e9, "no NVLink between more than two cards: GPU to GPU "
                                       "over PCIe Gen4 x16, 32 GB/s each way at most"),
      "inter_node_bandwidth": Constant(12.5e9, "assumed: one 100 Gb/s Ethernet NIC (no vendor "
                                       "node)"),
      "pcie_bandwidth": _PCIE4,
      "host_bandwidth": Constant(2 * channel_gbs * 1e9, f"assumed desktop: 2 channels of {ddr}, "
                                 f"2 x {channel_gbs:g} GB/s"),
      "host_memory": Constant(128e9, "assumed desktop: 128 GB (4 x 32 GB DIMMs); give "
                              "--host-memory"),
      "nvme_bytes": Constant(2e12, "assumed: one 2 TB PCIe 4.0 NVMe drive; give --nvme"),
      "nvme_bandwidth": Constant(7e9, "one PCIe 4.0 NVMe drive's 7 GB/s sequential read "
                                 "(Samsung 980 PRO datasheet); give --nvme-bandwidth"),
  }


NODE_DATASHEETS: dict[str, dict[str, Constant]] = {
    "H100": _DGX_H,
    "H200": _DGX_H,
    "A100": {
        "intra_node_bandwidth": Constant(300e9, "NVLink 3: 600 GB/s bidirectional per GPU, "
                                         "300 GB/s each way (A100 datasheet)"),
        "inter_node_bandwidth": Constant(25e9, "one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100 "
                                         "datasheet)"),
        "pcie_bandwidth": Constant(32e9, "PCIe Gen4 x16: 64 GB/s bidirectional, 32 GB/s each "
                                   "way (A100 datasheet)"),
        "host_bandwidth": Constant(410e9, "2 x AMD EPYC 7742, 8 channels of DDR4-3200 each: "
                                   "2 x 8 x 25.6 GB/s (DGX A100 datasheet, AMD spec)"),
        "host_memory": Constant(2e12, "2 TB system memory (DGX A100 640 GB datasheet)"),
        "nvme_bytes": Constant(30.72e12, "8 x 3.84 TB U.2 NVMe data drives (DGX A100 640 GB "
                                         "datasheet)"),
        "nvme_bandwidth": _ZERO_INFINITY_NVME,
    },
    "B200": {
        "intra_node_bandwidth": Constant(900e9, "NVLink 5: 1.8 TB/s bidirectional per GPU, "
                                         "900 GB/s each way (DGX B200 datasheet)"),
        "inter_node_bandwidth": Constant(50e9, "one 400 Gb/s ConnectX-7 NIC per GPU (DGX B200 "
                                         "datasheet)"),
        "pcie_bandwidth": _PCIE5,
        "host_bandwidth": Constant(717e9, "2 x Xeon Platinum 8570, 8 channels of DDR5-5600 each: "
                                   "2 x 8 x 44.8 GB/s (DGX B200 datasheet, Intel ark)"),
        "host_memory": Constant(2e12, "2 TB system memory (DGX B200 datasheet)"),
        "nvme_bytes": Constant(30.72e12, "8 x 3.84 TB U.2 NVMe data drives (DGX B200 "
                               "datasheet)"),
        "nvme_bandwidth": _ZERO_INFINITY_NVME,
    },
    "L40S": _ec2("g6e.48xlarge", 1536, 400, 7.6, "4 x 1.9 TB", "AMD EPYC 7R13"),
    "L4": _ec2("g6.48xlarge", 768, 100, 60.0, "8 x 7.5 TB", "AMD EPYC 7R13"),
    "A10G": _ec2("g5.48xlarge", 768, 100, 7.6, "2 x 3.8 TB", "AMD EPYC 7R32"),
    "RTX 4090": _desktop("DDR5-5600", 44.8),
    "RTX 3090": _desktop("DDR4-3200", 25.6),
}
MATMUL_EFFICIENCY = Constant(0.5, "the share of peak a large transformer's matmuls reach: 52% on "
                             "A100 (Narayanan et al. 2021, Megatron-LM, Table 1)")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The target's rates and sizes, per device unless said otherwise, each with its source.

  Attributes:
    name: what it is, e.g. "8 x NVIDIA H100 80GB HBM3 (1 node)".
    devices_per_node, nodes: the topology.
    device_memory: bytes per device; memory_fraction: the part a step may use.
    peak_flops: matmul FLOP/s per device in the compute dtype; matmul_efficiency: the share of it
      a step reaches.
    hbm_bandwidth: device memory bytes/s (the optimizer update is memory-bound).
    intra_node_bandwidth, inter_node_bandwidth: bytes/s one device sends over each link kind.
    pcie_bandwidth: host <-> device bytes/s per device, one way.
    host_bandwidth: host memory bytes/s per node; host_memory: bytes per node.
    nvme_bandwidth: NVMe bytes/s per node; nvme_bytes: NVMe capacity per node.
  """

  name: str
  devices_per_node: int
  nodes: int
  device_memory: Constant
  memory_fraction: Constant
  peak_flops: Constant
  matmul_efficiency: Constant
  hbm_bandwidth: Constant
  intra_node_bandwidth: Constant
  inter_node_bandwidth: Constant
  pcie_bandwidth: Constant
  host_bandwidth: Constant
  host_memory: Constant
  nvme_bandwidth: Constant
  nvme_bytes: Constant

  @property
  def devices(self) -> int:
    return self.devices_per_node * self.nodes

  @property
  def usable_device_memory(self) -> float:
    return self.device_memory.value * self.memory_fraction.value

  def constants(self) -> dict[str, Constant]:
    """Every named constant, in field order (what the CLI prints and docs/planning.md lists)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Constant)}


def _part(description: str, names: Any) -> str | None:
  """The first of ``names`` that is a whole word (or words) of ``description``."""
  return next((n for n in names if re.search(rf"(?<!\w){re.escape(n)}(?!\w)", description)),
              None)


def gpu_hardware(gpu: str, devices_per_node: int, nodes: int = 1, *, precision: str = "bf16",
                 memory_fraction: float = DEFAULT_MEM_FRACTION,
                 **overrides: float | None) -> Hardware:
  """The rates of ``devices_per_node`` x ``nodes`` GPUs of one part (a ``--gpu`` name).

  ``memory_fraction`` is the share of each GPU's memory the step may use: what
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` makes JAX preallocate (:data:`DEFAULT_MEM_FRACTION`; JAX's
  own default is 0.75). ``overrides`` (host_memory, nvme_bytes, nvme_bandwidth, ... in bytes or
  bytes/s; None keeps the default) replace a datasheet value; their source then reads "given".
  """
  from jzero.planning.aot import gpu_spec  # noqa: PLC0415

  if not 0 < memory_fraction <= 1:
    raise ConfigError(f"--mem-fraction {memory_fraction}: give the share of each GPU's memory the "
                      f"step may use, in (0, 1]; JAX preallocates 0.75 unless "
                      f"{MEM_FRACTION_ENV} says otherwise.")
  spec = gpu_spec(gpu)
  family = _part(spec.description, NODE_DATASHEETS)
  peak = next(((p, h, t) for p, h, t in GPU_PEAKS if _part(spec.description, (p,))), None)
  if family is None or peak is None:
    raise ConfigError(f"--gpu {gpu!r} ({spec.description}): jzero plan has datasheet rates for "
                      f"{sorted(NODE_DATASHEETS)} parts only; give one of those --gpu names.")
  part, half, tf32 = peak
  flops = Constant((tf32 if precision == "fp32" else half) * 1e12,
                   f"{part} dense {'tf32' if precision == 'fp32' else 'bf16/fp16'} tensor-core "
                   f"peak (NVIDIA datasheet)")
  bandwidth = float(spec.text.split("memory_bandwidth:")[1].split()[0])
  rates = dict(NODE_DATASHEETS[family])
  for key, value in overrides.items():
    if key not in rates:
      raise TypeError(f"gpu_hardware: unknown override {key!r}")
    if value is not None:
      rates[key] = Constant(float(value), "given")
  fraction_source = (f"JAX's default preallocation ({MEM_FRACTION_ENV} unset)"
                     if memory_fraction == JAX_MEM_FRACTION else
                     f"--mem-fraction: run with {MEM_FRACTION_ENV}={memory_fraction:.2f}")
  return Hardware(
      name=f"{devices_per_node * nodes} x {spec.description} ({nodes} node{'s' * (nodes > 1)})",
      devices_per_node=devices_per_node, nodes=nodes,
      device_memory=Constant(spec.memory_bytes, f"device_memory_size of XLA's GPU spec "
                             f"({spec.name})"),
      memory_fraction=Constant(memory_fraction, fraction_source),
      peak_flops=flops, matmul_efficiency=MATMUL_EFFICIENCY,
      hbm_bandwidth=Constant(bandwidth, f"memory_bandwidth of XLA's GPU spec ({spec.name})"),
      **rates)


# What a TPU host gives its chips (Cloud TPU docs, the generation's page: "DRAM per host", chips
# per host); v4 / v5p pages publish no host DRAM, so a plan there is told it with --host-memory.
_TPU_HOSTS = {"v4": (None, 4), "v5e": (512 * 2**30, 8), "v5p": (None, 4),
              "v6e": (1536 * 2**30, 8)}


def tpu_hardware(tpu: str, topology: str, slices: int = 1, *,
                 memory_fraction: float = 1.0, **overrides: float | None) -> Hardware:
  """The rates of ``slices`` TPU slices of ``topology`` chips of one generation (a ``--tpu``
  name; :data:`jzero.planning.tpu_specs.TPU_SPECS`, each figure's source there). A slice is a
  "node": ICI inside it, DCN between slices. ``overrides`` replace a value, as in
  :func:`gpu_hardware`.

  Raises:
    ConfigError: an unknown TPU or topology, or several slices of a generation whose DCN
      bandwidth is not published (v4, v5p) without ``inter_node_bandwidth``.
  """
  from jzero.planning import tpu_specs  # noqa: PLC0415

  spec = tpu_specs.tpu_spec(tpu)
  chips = math.prod(tpu_specs.parse_topology(spec, topology))
  if not 0 < memory_fraction <= 1:
    raise ConfigError(f"--mem-fraction {memory_fraction}: give the share of each chip's HBM the "
                      f"step may use, in (0, 1].")
  page = f"Cloud TPU docs, {spec.source}"
  dram, per_host = _TPU_HOSTS[spec.name]
  hosts = max(1, chips // per_host)
  dcn = (Constant(spec.dcn_bandwidth, f"the host's NICs shared by its {per_host} chips ({page})")
         if spec.dcn_bandwidth else Constant(1.0, "unused: one slice (no published DCN figure)"))
  rates = {
      "intra_node_bandwidth": Constant(spec.ici_bandwidth / 2, f"ICI: half the chip's "
                                       f"bidirectional {spec.ici_bandwidth / 1e9:g} GB/s ({page})"),
      "inter_node_bandwidth": dcn,
      "pcie_bandwidth": Constant(16e9, "assumed: PCIe Gen4 x8 each way, host to chip (Google "
                                 "publishes no figure)"),
      "host_bandwidth": Constant(200e9 * hosts, f"assumed: 200 GB/s of DRAM per host x {hosts} "
                                 f"host(s)"),
      "host_memory": (Constant(dram * hosts, f"{dram / 2**30:g} GiB DRAM per host x {hosts} "
                               f"host(s) ({page})") if dram else
                      Constant(0.0, "not published for this generation: give --host-memory")),
      "nvme_bytes": Constant(0.0, "TPU VMs have no local NVMe (give --nvme for a disk)"),
      "nvme_bandwidth": Constant(1e9, "assumed: a persistent disk's ~1 GB/s"),
  }
  for key, value in overrides.items():
    if key not in rates:
      raise TypeError(f"tpu_hardware: unknown override {key!r}")
    if value is not None:
      rates[key] = Constant(float(value), "given")
  if slices > 1 and rates["inter_node_bandwidth"].value <= 1.0:
    raise ConfigError(f"--tpu {spec.name} over {slices} slices: Google publishes no DCN bandwidth "
                      f"for {spec.name}; plan one slice, or give the inter-slice rate.")
  return Hardware(
      name=f"{chips * slices} x {spec.description} ({slices} x {spec.name}:{topology} "
           f"slice{'s' * (slices > 1)})",
      devices_per_node=chips, nodes=slices,
      device_memory=Constant(spec.memory_bytes, f"HBM per chip ({page})"),
      memory_fraction=Constant(memory_fraction, "a TPU run uses its whole HBM (no preallocated "
                               "pool)" if memory_fraction == 1.0 else "--mem-fraction"),
      peak_flops=Constant(spec.bf16_flops, f"bf16 peak per chip ({page}); fp32 matmuls run as "
                          f"bf16 passes at JAX's default precision"),
      matmul_efficiency=MATMUL_EFFICIENCY,
      hbm_bandwidth=Constant(spec.hbm_bandwidth, f"HBM bandwidth per chip ({page})"),
      **rates)


def measure_memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
  """This machine's memory bandwidth, bytes/s: the best of ``repeats`` copies of a large array
  (read + write counted)."""
  import numpy as np  # noqa: PLC0415

  src = np.ones(megabytes * 2**20 // 8)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  return 2 * src.nbytes / best


def cpu_hardware(devices: int, *, flops_per_second: float | None = None,
                 memory_bandwidth: float | None = None, memory_bytes: float = 4e9) -> Hardware:
  """This machine's CPU as the target: ``devices`` simulated devices sharing its cores, so each
  gets 1/devices of the measured FLOP rate and memory bandwidth. Collectives, host transfers and
  the host update are memory copies here: every link is the memory bandwidth's share.

  Args:
    flops_per_second: all devices together (default: measured,
      :func:`jzero.analysis.flops.peak_flops` in fp32).
    memory_bandwidth: bytes/s of the host (default: measured, :func:`measure_memory_bandwidth`).
    memory_bytes: what each simulated device may hold (a budget: CPU devices share host memory).
  """
  import jax  # noqa: PLC0415

  from jzero.analysis.flops import peak_flops  # noqa: PLC0415

  if flops_per_second is None:
    flops_per_second = peak_flops("float32", jax.local_devices()[:1]).flops_per_second
    flops_source = "measured: best of 3 fp32 matmuls on this CPU, shared by the devices"
  else:
    flops_source = "given"
  if memory_bandwidth is None:
    memory_bandwidth = measure_memory_bandwidth()
    bw_source = "measured: numpy copy of 256 MiB on this CPU, shared by the devices"
  else:
    bw_source = "given"
  share = Constant(memory_bandwidth / devices, bw_source)
  node = Constant(memory_bandwidth, bw_source)
  return Hardware(
      name=f"{devices} simulated CPU devices", devices_per_node=devices, nodes=1,
      device_memory=Constant(memory_bytes, "given budget per simulated device"),
      memory_fraction=Constant(1.0, "CPU devices do not preallocate"),
      peak_flops=Constant(flops_per_second / devices, flops_source),
      matmul_efficiency=Constant(1.0, "the measured rate is already what a matmul reaches"),
      hbm_bandwidth=share, intra_node_bandwidth=share, inter_node_bandwidth=share,
      pcie_bandwidth=share, host_bandwidth=node, host_memory=Constant(64e9, "given"),
      nvme_bandwidth=node, nvme_bytes=Constant(1e12, "given"))


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one step of a candidate uses, per device unless said otherwise.

  Attributes:
    flops: matmul FLOPs (recomputed forward included).
    memory_bytes: bytes the non-matmul work reads and writes in device memory: the on-device
      optimizer update's (estimator), or every non-matmul instruction's of the compiled step.
    intra_node_bytes, inter_node_bytes: collective bytes one device sends within / across nodes.
    overlap: share of the collective bytes the schedule runs with compute in flight.
    pcie_bytes: bytes between host and device, both ways.
    host_update_bytes: host memory bytes the host-side optimizer reads and writes, per node.
    nvme_traffic: bytes read from and written to NVMe per node.
    source: "estimator" (arithmetic) or "compiled" (read from the compiled program).
  """

  flops: float
  memory_bytes: float
  intra_node_bytes: float
  inter_node_bytes: float
  overlap: float
  pcie_bytes: float
  host_update_bytes: float
  nvme_traffic: float
  source: str


@dataclasses.dataclass(frozen=True)
class Prediction:
  """A step's predicted seconds: each term, the total, and the term that bounds it."""

  terms: dict[str, float]  # compute, network, pcie, host, nvme
  seconds: float
  bound: str


def predict(r: Resources, hw: Hardware) -> Prediction:
  """The step time :class:`Resources` predict on ``hw`` (the formula: module docstring)."""
  compute = (r.flops / (hw.peak_flops.value * hw.matmul_efficiency.value)
             + r.memory_bytes / hw.hbm_bandwidth.value)
  network = (r.intra_node_bytes / hw.intra_node_bandwidth.value
             + r.inter_node_bytes / hw.inter_node_bandwidth.value)
  terms = {"compute": compute, "network": network,
           "pcie": r.pcie_bytes / hw.pcie_bandwidth.value,
           "host": r.host_update_bytes / hw.host_bandwidth.value,
           "nvme": r.nvme_traffic / hw.nvme_bandwidth.value}
  offload = max(terms["pcie"], terms["host"], terms["nvme"])
  seconds = max(compute, r.overlap * network) + (1 - r.overlap) * network + offload
  return Prediction(terms=terms, seconds=seconds, bound=max(terms, key=terms.get))


def describe_constants(hw: Hardware) -> list[tuple[str, str, str]]:
  """(name, value, source) of every constant: the lines ``jzero plan`` prints."""
  out = []
  for name, c in hw.constants().items():
    unit = ("FLOP/s" if name == "peak_flops" else "B/s" if "bandwidth" in name
            else "" if name in ("memory_fraction", "matmul_efficiency") else "B")
    out.append((name, f"{c.value:.4g} {unit}".strip(), c.source))
  return out

