"""TPU slices without a TPU: the chips' datasheet figures and compile-only devices of a topology.

With ``libtpu`` installed (jzero's ``tpu-aot`` extra: the version jax's own ``tpu`` extra pins;
no TPU needed), ``jax.experimental.topologies.get_topology_desc(platform="tpu",
topology_name="v5e:2x4", ...)`` gives compile-only chips of a slice, and XLA's TPU compiler
compiles for them as it would on the slice: SPMD partitioning, fusion, the TPU's collective
combiners and async collectives, its latency-hiding scheduler, Mosaic for Pallas kernels.
:func:`tpu_devices` makes them the way MaxText's ``train_compile.py`` does (the chip config and
the chips-per-host bounds of each generation), for ``slices`` slices joined by the data-centre
network (DCN); :func:`jzero.runtime.quiet_start.load_tpu_compiler` loads the library quietly
first.

:data:`TPU_SPECS` are the chips' figures, each from Google's Cloud TPU documentation (the page
named in :attr:`TpuSpec.source`, read 2026-11-27): HBM bytes and bandwidth, peak bf16 matmul
rate, inter-chip interconnect (ICI) bandwidth per chip (bidirectional) and data-centre network
(DCN) bandwidth per chip (the host's NICs shared by its chips; v4 and v5p: not published per
host, 0 here).

========= ======================== ====== ======== ============ ======== ======== ===========
``--tpu`` chip                     HBM    HBM GB/s bf16 TFLOP/s ICI GB/s DCN GB/s chips/host
========= ======================== ====== ======== ============ ======== ======== ===========
v4        TPU v4 (megacore)        32 GiB 1200     275          300      n/a      4
v5e       TPU v5 lite              16 GB  819      197          400      3.125    8
v5p       TPU v5 (megacore)        95 GB  2765     459          600      n/a      4
v6e       TPU v6 lite (Trillium)   32 GB  1640     918          800      12.5     8
========= ======================== ====== ======== ============ ======== ======== ===========

Sources: v4 -- cloud.google.com/tpu/docs/v4 (HBM, bf16); its ICI from Jouppi et al., "TPU v4: An
Optically Reconfigurable Supercomputer for Machine Learning with Hardware Support for Embeddings"
(ISCA 2023: 6 links x 50 GB/s). v5e -- cloud.google.com/tpu/docs/v5e (16 GB, 819 GBps, 197 TFLOPs,
bidirectional ICI 400 GBps per chip; 2 x 100 Gbps NICs per 8-chip host). v5p --
cloud.google.com/tpu/docs/v5p (95 GB, 2765 GBps, 459 TFLOPs, ICI 4800 Gbps). v6e --
cloud.google.com/tpu/docs/v6e (32 GB, 1640 GBps, 918 TFLOPs, bidirectional ICI 800 GBps per chip; 4
x 200 Gbps NICs per 8-chip host). "GB" in Google's HBM figures: v4's page says GiB, v5e/v5p/v6e's
GB; the table keeps each page's unit. The memory a compiled step's peak is checked against is the
HBM capacity times the memory fraction (1.0 by default: a TPU run does not preallocate a pool below
it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jzero.errors import ConfigError, JZeroError
from jzero.runtime import quiet_start

__all__ = ["TPU_SPECS", "TpuSpec", "tpu_spec", "tpu_devices", "parse_topology"]

GiB, GB = 2**30, 10**9


@dataclasses.dataclass(frozen=True)
class TpuSpec:
  """One TPU generation: its datasheet figures and how libtpu names its topologies.

  Attributes:
    name: the ``--tpu`` name; description: the chip as reports print it.
    prefix: the generation in libtpu's topology names ("v5e" in "v5e:2x4").
    chip_config: libtpu's chip config ("megacore": v4 / v5p's two TensorCores as one device).
    dims: the topology's dimensions (2: a 2D torus, v5e / v6e; 3: v4 / v5p).
    host_bounds: chips per host in libtpu's topology (x, y, z).
    memory_bytes: HBM per chip; hbm_bandwidth: bytes/s; bf16_flops: peak matmul FLOP/s.
    ici_bandwidth: bytes/s per chip, bidirectional; dcn_bandwidth: bytes/s per chip (0: not
      published).
    source: where the figures come from.
  """

  name: str
  description: str
  prefix: str
  chip_config: str
  dims: int
  host_bounds: tuple[int, int, int]
  memory_bytes: int
  hbm_bandwidth: float
  bf16_flops: float
  ici_bandwidth: float
  dcn_bandwidth: float
  source: str


TPU_SPECS = {
    "v4": TpuSpec("v4", "TPU v4", "v4", "megacore", 3, (2, 2, 1), 32 * GiB, 1200 * GB, 275e12,
                  300 * GB, 0.0, "cloud.google.com/tpu/docs/v4; ICI: Jouppi et al., ISCA 2023"),
    "v5e": TpuSpec("v5e", "TPU v5e", "v5e", "default", 2, (2, 2, 1), 16 * GB, 819 * GB, 197e12,
                   400 * GB, 200e9 / 8 / 8, "cloud.google.com/tpu/docs/v5e"),
    "v5p": TpuSpec("v5p", "TPU v5p", "v5p", "megacore", 3, (2, 2, 1), 95 * GB, 2765 * GB, 459e12,
                   600 * GB, 0.0, "cloud.google.com/tpu/docs/v5p"),
    "v6e": TpuSpec("v6e", "TPU v6e", "v6e", "default", 2, (2, 2, 1), 32 * GB, 1640 * GB, 918e12,
                   800 * GB, 800e9 / 8 / 8, "cloud.google.com/tpu/docs/v6e"),
}


def tpu_spec(tpu: str) -> TpuSpec:
  """A TPU generation by its :data:`TPU_SPECS` name."""
  if tpu not in TPU_SPECS:
    raise ConfigError(f"unknown TPU {tpu!r} (--tpu): give one of {sorted(TPU_SPECS)}.")
  return TPU_SPECS[tpu]


def parse_topology(spec: TpuSpec, topology: str) -> tuple[int, ...]:
  """The chip grid of ``topology`` ("2x4", "2x2x2") for ``spec``'s generation.

  Raises:
    ConfigError: not AxB (v5e, v6e) / AxBxC (v4, v5p) of positive integers.
  """
  shape = tuple(int(d) for d in topology.split("x")) if re.fullmatch(
      r"\d+(x\d+)*", topology or "") else ()
  if len(shape) != spec.dims or not all(shape):
    example = "2x4, 4x4, 8x16" if spec.dims == 2 else "2x2x1, 2x2x2, 4x4x8"
    raise ConfigError(f"--topology {topology!r} for {spec.name}: give the slice's chip grid, "
                      f"{spec.dims} positive sizes joined by 'x' (e.g. {example}).")
  return shape


def tpu_devices(tpu: str | TpuSpec, topology: str, slices: int = 1) -> list[Any]:
  """Compile-only chips of ``slices`` slices of ``topology`` (no TPU needed), slice-major: the
  chips of slice 0 first (each device's ``slice_index`` says its slice).

  Raises:
    ConfigError: an unknown TPU, a malformed topology or a non-positive slice count.
    JZeroError: libtpu is not installed (the message names the extra), or libtpu refuses the
      topology (its message).
  """
  spec = tpu if isinstance(tpu, TpuSpec) else tpu_spec(tpu)
  shape = parse_topology(spec, topology)
  if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
    raise ConfigError(f"--slices {slices!r}: give a positive number of slices.")
  quiet_start.load_tpu_compiler()
  from jax.experimental import topologies  # noqa: PLC0415

  bounds = tuple(min(b, s) for b, s in zip(spec.host_bounds, shape + (1,) * (3 - len(shape))))
  try:
    found = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{spec.prefix}:{topology}",
        chip_config_name=spec.chip_config, chips_per_host_bounds=bounds, num_slices=slices,
        wrap=(False, False, False))
  except Exception as e:  # pylint: disable=broad-except  (libtpu's own error type)
    raise JZeroError(f"libtpu has no {spec.name} topology {topology!r} x {slices} slice(s): "
                     f"{str(e).splitlines()[0]}") from None
  devices = sorted(found.devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))
  expected = math.prod(shape) * slices
  if len(devices) != expected:
    raise JZeroError(f"libtpu gave {len(devices)} devices for {spec.name}:{topology} x {slices} "
                     f"slice(s), not {expected} chips.")
  return devices
