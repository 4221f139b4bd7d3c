"""Device meshes for ZeRO: mesh files, the default mesh, and simulated CPU devices.

A mesh file (YAML or JSON) names the mesh axes with their sizes and says which axes ZeRO partitions
over and which carry the batch::

  # configs/mesh/node2x4.yaml -- two "nodes" of four devices, ready for hpZ
  axes: {node: 2, local: 4}     # ordered: the device grid is devices reshaped to (2, 4)
  zero_axes: [node, local]      # parameters / gradients / optimizer states are split over these
  batch_axes: [node, local]     # the global batch is split over these (data parallelism)

One axis size may be ``-1`` ("all remaining devices"). jzero is data-parallel only: every mesh axis
must carry the batch, and ZeRO partitions over a subset of the batch axes. Batch axes that ZeRO does
not partition over hold replicas of the partitioned state (hybrid sharding); their gradients are
all-reduced after the reduce-scatter over the ZeRO axes.

Without a file the mesh is one axis ``data`` over all devices (:meth:`MeshSpec.default`). Devices
are laid out in (process index, device id) order, so a leading ``node`` axis on several hosts is the
process boundary.

:func:`simulate_cpu_devices` gives N CPU devices on a machine without accelerators; it must run
before JAX starts its backend (the CLI does it from ``--devices``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import yaml
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jzero.errors import JZeroWarning, MeshError

__all__ = ["MeshSpec", "ZeroMesh", "simulate_cpu_devices"]

#: The simulated CPU devices a launched process starts with (set by ``jzero launch``).
ENV_NUM_CPU_DEVICES = "JZERO_NUM_CPU_DEVICES"

_KNOWN_KEYS = ("axes", "zero_axes", "batch_axes")
_HOW_MANY = ("simulated CPU devices: `jzero train --devices N`, or jzero.simulate_cpu_devices(N) "
             "before JAX starts")


def simulate_cpu_devices(n: int) -> None:
  """Makes JAX expose ``n`` CPU devices. Call before any JAX computation.

  Raises:
    MeshError: the backend already started with a different number of devices.
  """
  if n < 1:
    raise MeshError(f"simulated device count must be >= 1, got {n}.")
  launched = os.environ.get(ENV_NUM_CPU_DEVICES)
  if launched and int(launched) != n:
    warnings.warn(
        f"simulate_cpu_devices({n}): this process was started by `jzero launch --num_cpu_devices "
        f"{launched}`, which sets each process's device count; using {launched}. Change "
        f"--num_cpu_devices to change it.", JZeroWarning, stacklevel=2)
    n = int(launched)
  from jax._src import xla_bridge  # backends_are_initialized has no public home in jax 0.10

  if xla_bridge.backends_are_initialized():
    have = jax.device_count()
    if have != n:
      raise MeshError(
          f"cannot simulate {n} CPU devices: JAX already started with {have} device(s). Call "
          f"jzero.simulate_cpu_devices({n}) right after `import jax`, before any computation (or set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={n} in the environment).")
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """What a mesh file says: ordered axis sizes and the axes ZeRO and the batch use."""

  axes: tuple[tuple[str, int], ...]
  zero_axes: tuple[str, ...]
  batch_axes: tuple[str, ...]
  source: str | None = None

  @classmethod
  def default(cls) -> MeshSpec:
    """All devices on one ``data`` axis, which both ZeRO and the batch use."""
    return cls(axes=(("data", -1),), zero_axes=("data",), batch_axes=("data",), source=None)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> MeshSpec:
    """Reads a mesh file (YAML or JSON)."""
    path = Path(path)
    if not path.is_file():
      raise MeshError(f"mesh file {str(path)!r} does not exist. Give the path of a YAML file such "
                      f"as configs/mesh/data8.yaml, or no mesh file for the default one-axis mesh.")
    try:
      raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
      raise MeshError(f"mesh file {str(path)!r} is not valid YAML: {e}") from None
    return cls.from_dict(raw, source=str(path))

  @classmethod
  def from_dict(cls, raw: Any, source: str | None = None) -> MeshSpec:
    """Validates a mesh description given as a mapping (what a mesh file holds)."""
    where = f"mesh file {source!r}" if source else "mesh description"
    if not isinstance(raw, Mapping):
      raise MeshError(f"{where}: expected a mapping with keys {list(_KNOWN_KEYS)}, got "
                      f"{type(raw).__name__}.")
    unknown = sorted(set(raw) - set(_KNOWN_KEYS))
    if unknown:
      raise MeshError(f"{where}: unknown key(s) {unknown}; a mesh file has {list(_KNOWN_KEYS)}.")
    axes = raw.get("axes")
    if not isinstance(axes, Mapping) or not axes:
      raise MeshError(f"{where}: 'axes' must be a non-empty mapping of axis name to size, e.g. "
                      f"{{data: 8}} or {{node: 2, local: 4}}.")
    pairs = []
    for name, size in axes.items():
      if not isinstance(name, str) or not name.isidentifier():
        raise MeshError(f"{where}: axis name {name!r} must be an identifier such as 'data'.")
      if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise MeshError(f"{where}: axes.{name} = {size!r}; a size is a positive integer or -1 "
                        f"(all remaining devices).")
      pairs.append((name, size))
    if sum(s == -1 for _, s in pairs) > 1:
      raise MeshError(f"{where}: only one axis size may be -1.")
    names = [n for n, _ in pairs]
    batch_axes = _axis_list(raw.get("batch_axes", names), "batch_axes", names, where)
    zero_axes = _axis_list(raw.get("zero_axes", batch_axes), "zero_axes", names, where)
    if set(batch_axes) != set(names):
      missing = sorted(set(names) - set(batch_axes))
      raise MeshError(f"{where}: axes {missing} carry no batch. jzero is data-parallel: every mesh "
                      f"axis must be listed in batch_axes.")
    if not set(zero_axes) <= set(batch_axes):
      raise MeshError(f"{where}: zero_axes {list(zero_axes)} must be a subset of batch_axes "
                      f"{list(batch_axes)}.")
    if not zero_axes:
      raise MeshError(f"{where}: zero_axes is empty; list at least one axis (ZeRO stage 0 needs no "
                      f"change here: it simply does not partition).")
    return cls(axes=tuple(pairs), zero_axes=zero_axes, batch_axes=batch_axes, source=source)

  def build(self, devices: Sequence[jax.Device] | None = None) -> ZeroMesh:
    """Lays ``devices`` (default: all) out on this mesh."""
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    n = len(devices)
    sizes = [s for _, s in self.axes]
    known = math.prod(s for s in sizes if s != -1)
    where = f"mesh file {self.source!r}" if self.source else "the mesh"
    if -1 in sizes:
      if n % known:
        raise MeshError(f"{where}: the fixed axis sizes multiply to {known}, which does not divide the "
                        f"{n} devices present. Change the sizes or the device count ({_HOW_MANY}).")
      sizes = [n // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != n:
      shape = " x ".join(f"{a}={s}" for (a, _), s in zip(self.axes, sizes))
      raise MeshError(f"{where}: axes {shape} need {math.prod(sizes)} devices but {n} are present. "
                      f"Change the axis sizes (or use -1 for one of them), or run on "
                      f"{math.prod(sizes)} devices ({_HOW_MANY}).")
    grid = np.array(devices, dtype=object).reshape(sizes)
    names = tuple(a for a, _ in self.axes)
    mesh = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    return ZeroMesh(mesh=mesh, zero_axes=self.zero_axes, batch_axes=self.batch_axes)


def _axis_list(value: Any, key: str, names: list[str], where: str) -> tuple[str, ...]:
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
    raise MeshError(f"{where}: {key} must be a list of axis names, got {value!r}.")
  bad = [v for v in value if v not in names]
  if bad:
    raise MeshError(f"{where}: {key} names {bad}, which are not mesh axes (axes: {names}).")
  if len(set(value)) != len(value):
    raise MeshError(f"{where}: {key} lists an axis twice: {list(value)}.")
  return tuple(n for n in names if n in value)  # mesh order, so shard order is row-major


@dataclasses.dataclass(frozen=True)
class ZeroMesh:
  """A :class:`jax.sharding.Mesh` plus the axes ZeRO partitions over and the axes the batch uses."""

  mesh: Mesh
  zero_axes: tuple[str, ...]
  batch_axes: tuple[str, ...]

  @property
  def zero_size(self) -> int:
    """Number of partitions of ZeRO-partitioned state (DeepSpeed's dp world size for ZeRO)."""
    return math.prod(self.mesh.shape[a] for a in self.zero_axes)

  @property
  def dp_size(self) -> int:
    """Data-parallel size, how many ways the global batch is split."""
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  @property
  def replica_axes(self) -> tuple[str, ...]:
    """Batch axes ZeRO does not partition over (hold replicas of the partitioned state)."""
    return tuple(a for a in self.batch_axes if a not in self.zero_axes)

  @property
  def size(self) -> int:
    return self.mesh.size

  def batch_spec(self) -> P:
    """The global batch: its leading dimension split over the batch axes."""
    axes = self.batch_axes
    return P(axes[0] if len(axes) == 1 else axes)

  def sharding(self, spec: P, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

  def describe(self) -> str:
    axes = " x ".join(f"{a}={s}" for a, s in self.mesh.shape.items())
    return (f"{axes} ({self.size} {self.mesh.devices.flat[0].platform} devices); ZeRO over "
            f"{list(self.zero_axes)}, batch over {list(self.batch_axes)}")
