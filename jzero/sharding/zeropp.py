"""ZeRO++ as data: what the config asks, resolved against the mesh, and each leaf's static choice
of how its collectives move bytes (:class:`Comm`). The collectives themselves are
:mod:`jzero.comm.zeropp`, whose docstring describes qwZ, hpZ and qgZ.

**The hierarchy.** All three read a split of the ZeRO axes into *node* axes (across nodes) and
*local* axes (inside a node), :class:`Hierarchy`. With hpZ the local axes are the trailing ZeRO
axes whose sizes multiply to s; without hpZ (qgZ alone) the last ZeRO axis is local and the
others are nodes. A mesh file says which axes those are (``configs/mesh/node2x4.yaml``:
``axes: {node: 2, local: 4}``); without one, jzero lays the default one-axis mesh out as
``node = N / s`` x ``local = s`` (devices in process order, so a node is a run of consecutive
processes' devices), or, for qgZ without hpZ in several processes, ``node`` = processes x
``local`` = devices per process, and logs it (:func:`resolve`). The ZeRO axes stay in mesh order,
node axes first, so the primary partition of device (n, l) is partition ``n * L + l`` -- the
same layout as plain ZeRO-3, which is why checkpoints and the optimizer do not change.

**Which quantization** (qwZ and qgZ): the config's ``zero_quantized_weights`` /
``zero_quantized_gradients`` is ``true`` (DeepSpeed's: int8 weights, int4 gradients) or the name of
a strategy of :mod:`jzero.sharding.quantization` (``"int4"`` weights); any other value is refused,
naming the registry's.

**What stays plain** (per leaf, decided by :func:`jzero.sharding.planner.make_plan` from the
strategy's :meth:`~jzero.sharding.quantization.WeightQuantizer.block` and recorded in the plan):
the qwZ gather of a small per-layer partition (fp32 scales would cost more than the bits save,
e.g. a LayerNorm scale); the qgZ reduction of a leaf that is one-dimensional per layer
(DeepSpeed's rule) or whose per-device partition is below two blocks per layer. Sizes never have
to divide: a partitioned leaf is already padded to a multiple of the ZeRO size, and a last block is
zero-padded. Node counts need not be powers of two (DeepSpeed #5054): nothing here depends on it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax

from jzero.errors import ConfigError, JZeroWarning
from jzero.sharding import quantization
from jzero.sharding.mesh import MeshSpec, ZeroMesh

__all__ = ["Hierarchy", "ZeroPP", "Comm", "resolve", "strategy_name"]

logger = logging.getLogger("jzero")

Axes = tuple[str, ...]


# --- what the config asks, against the mesh -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """The ZeRO axes split into node axes (across nodes) and local axes (inside a node)."""

  node_axes: Axes
  local_axes: Axes
  nodes: int
  local: int


@dataclasses.dataclass(frozen=True)
class ZeroPP:
  """ZeRO++ as the config asks for it, resolved against the mesh.

  Attributes:
    quantized_weights: qwZ: the name of its strategy (:data:`jzero.sharding.quantization.WEIGHTS`),
      or None.
    quantized_gradients: qgZ: the name of its strategy
      (:data:`jzero.sharding.quantization.GRADIENTS`), or None.
    hpz: the secondary group size s (1: hpZ off).
    hierarchy: the node / local split of the ZeRO axes (None when nothing needs one).
  """

  quantized_weights: str | None = None
  quantized_gradients: str | None = None
  hpz: int = 1
  hierarchy: Hierarchy | None = None

  @property
  def enabled(self) -> bool:
    return bool(self.quantized_weights or self.quantized_gradients or self.hpz > 1)

  def describe(self) -> str:
    parts = []
    if self.quantized_weights:
      parts.append(f"qwZ ({self.quantized_weights} weight gather)")
    if self.hpz > 1:
      parts.append(f"hpZ (secondary partition over {self.hpz} devices)")
    if self.quantized_gradients:
      parts.append(f"qgZ ({self.quantized_gradients} two-hop gradient all-to-all)")
    h = self.hierarchy
    where = (f"; nodes {list(h.node_axes)} = {h.nodes}, local {list(h.local_axes)} = {h.local}"
             if h else "")
    return "ZeRO++: " + (", ".join(parts) or "off") + where


_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def strategy_name(key: str, value: Any, registry: dict[str, Any]) -> str | None:
  """The strategy a ``zero_quantized_*`` value names: ``true`` -> the registry's first
  (DeepSpeed's), a registered name -> itself, false / None -> None.

  Raises:
    ConfigError: a value the registry has no strategy for, naming those it has.
  """
  if value is None or value is False:
    return None
  if value is True:
    return next(iter(registry))
  if isinstance(value, str) and value in registry:
    return value
  accepted = ", ".join(["true", "false", *map(repr, registry)])
  raise ConfigError(f"zero_optimization.{key}={value!r}: give one of {accepted} (the "
                    f"quantized collectives of jzero.sharding.quantization).")


def _trailing(mesh: ZeroMesh, size: int) -> Axes | None:
  """The trailing ZeRO axes whose sizes multiply to ``size`` (None when no such run exists)."""
  prod = 1
  axes: list[str] = []
  for axis in reversed(mesh.zero_axes):
    if prod == size:
      break
    prod *= mesh.mesh.shape[axis]
    axes.insert(0, axis)
  return tuple(axes) if prod == size else None


def _hierarchy(mesh: ZeroMesh, local_axes: Axes) -> Hierarchy:
  node_axes = tuple(a for a in mesh.zero_axes if a not in local_axes)
  size = lambda axes: math.prod(mesh.mesh.shape[a] for a in axes)  # noqa: E731
  return Hierarchy(node_axes=node_axes, local_axes=local_axes, nodes=size(node_axes),
                   local=size(local_axes))


def _relayout(mesh: ZeroMesh, nodes: int, local: int, why: str) -> ZeroMesh:
  """The default one-axis mesh as node x local (same devices, same order)."""
  spec = MeshSpec(axes=(("node", nodes), ("local", local)), zero_axes=("node", "local"),
                  batch_axes=("node", "local"))
  laid = spec.build(list(mesh.mesh.devices.flat))
  logger.info("ZeRO++: %s; the default mesh is laid out as node=%d x local=%d (give a mesh file "
              "with node and local axes to choose otherwise)", why, nodes, local)
  return laid


def resolve(zero: Any, mesh: ZeroMesh, *, default_mesh: bool = False) -> tuple[ZeroMesh, ZeroPP]:
  """Checks the ZeRO++ keys of a resolved ``zero_optimization`` block against the mesh.

  DeepSpeed's rules, as ConfigErrors naming the key and the sizes, before any device work: ZeRO++
  needs stage 3; the hpZ group must divide the ZeRO world size; qgZ needs more than one node. An
  hpZ group as large as the ZeRO world does nothing (its secondary partition would be the
  primary): it is turned off with a warning.

  Args:
    zero: the resolved ``zero_optimization`` block (:class:`jzero.config.schema.ZeroConfig`).
    mesh: the mesh the engine runs on.
    default_mesh: ``mesh`` is jzero's default one-axis mesh, which may be laid out again as
      node x local (see the module docstring); a mesh the user gave is never changed.

  Returns:
    (the mesh to run on, the resolved settings).
  """
  qw = strategy_name("zero_quantized_weights", zero.zero_quantized_weights, quantization.WEIGHTS)
  qg = strategy_name("zero_quantized_gradients", zero.zero_quantized_gradients,
                     quantization.GRADIENTS)
  s = int(zero.zero_hpz_partition_size)
  shown = lambda name, given: None if name is None else ("true" if given is True else repr(name))
  asked = [f"{k}={v}" for k, v in zip(_KEYS, (shown(qw, zero.zero_quantized_weights),
                                              shown(qg, zero.zero_quantized_gradients),
                                              s if s > 1 else None)) if v is not None]
  if not asked:
    return mesh, ZeroPP()
  keys = ", ".join(f"zero_optimization.{a}" for a in asked)
  if zero.stage != 3:
    raise ConfigError(f"{keys}: ZeRO++ works on stage 3's parameter gathers and gradient "
                      f"reduce-scatters, and this config has zero_optimization.stage="
                      f"{zero.stage}. Set stage 3, or remove the ZeRO++ keys (as DeepSpeed, "
                      f"which acts on them in stage 3 only).")
  world = mesh.zero_size
  where = (f"the mesh's ZeRO axes {list(mesh.zero_axes)} "
           f"({' x '.join(str(mesh.mesh.shape[a]) for a in mesh.zero_axes)} = {world} devices)")
  hierarchy = None
  if s > 1:
    if s > world or world % s:
      raise ConfigError(
          f"zero_optimization.zero_hpz_partition_size={s}: the hpZ group must divide the ZeRO "
          f"world size, and {where} is not a multiple of {s}. Use a group size that divides "
          f"{world} -- the devices per node, e.g. {_divisors_hint(world)}.")
    if s == world:
      import warnings  # noqa: PLC0415
      warnings.warn(
          f"zero_optimization.zero_hpz_partition_size={s} equals the ZeRO world size ({world}): "
          f"the secondary partition would be the primary one, so hpZ has nothing to save and is "
          f"off. Set it to the devices per node of a multi-node job.", JZeroWarning, stacklevel=3)
      s = 1
  if s > 1:
    local = _trailing(mesh, s)
    if local is None and default_mesh and len(mesh.zero_axes) == 1:
      mesh = _relayout(mesh, world // s, s, f"zero_hpz_partition_size={s}")
      local = ("local",)
    if local is None:
      sizes = ", ".join(f"{a}={mesh.mesh.shape[a]}" for a in mesh.zero_axes)
      raise ConfigError(
          f"zero_optimization.zero_hpz_partition_size={s}: hpZ keeps the secondary partition "
          f"over the trailing ZeRO axes whose sizes multiply to {s}, and {where} has none "
          f"({sizes}). Give a mesh file with a node and a local axis, e.g. axes: "
          f"{{node: {world // s}, local: {s}}} (configs/mesh/node2x4.yaml), or no mesh "
          f"(jzero then lays the devices out so).")
    hierarchy = _hierarchy(mesh, local)
  elif qg:
    if len(mesh.zero_axes) >= 2:
      hierarchy = _hierarchy(mesh, mesh.zero_axes[-1:])
    elif default_mesh and jax.process_count() > 1 and world % jax.process_count() == 0:
      procs = jax.process_count()
      mesh = _relayout(mesh, procs, world // procs, "qgZ without hpZ: one node per process")
      hierarchy = _hierarchy(mesh, ("local",))
  if qg and (hierarchy is None or hierarchy.nodes == 1):
    raise ConfigError(
        f"zero_optimization.zero_quantized_gradients={shown(qg, zero.zero_quantized_gradients)}: "
        f"qgZ reduces gradients in two hops, "
        f"inside a node and across nodes, and {where} is one node. DeepSpeed uses it only with "
        f"more than one node: turn it off, or give a mesh file with a node and a local axis "
        f"(configs/mesh/node2x4.yaml) -- with hpZ, zero_hpz_partition_size smaller than {world}.")
  return mesh, ZeroPP(quantized_weights=qw, quantized_gradients=qg, hpz=s, hierarchy=hierarchy)


def _divisors_hint(n: int) -> str:
  return ", ".join(str(d) for d in range(2, n) if n % d == 0) or "none below it"


# --- per-leaf static choices ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comm:
  """How one leaf's collectives move bytes: the static part of a ZeRO++ ``ZeroParam``.

  Attributes:
    gather: the qwZ strategy of the gather over all ZeRO axes -- or with hpZ of the refresh of the
      secondary over the node axes -- (a :class:`jzero.sharding.quantization.WeightQuantizer`), or
      None: plain.
    secondary: hpZ: the forward / backward gathers read the secondary over the local axes.
    reduce: the qgZ strategy of the gradient reduce-scatter
      (:class:`jzero.sharding.quantization.GradientQuantizer`), or None: plain.
    gather_group: block size (elements) of the quantized gather.
    reduce_group: block size of the quantized reduction.
    zero_axes, node_axes, local_axes: the mesh axes.
    impl: the kernels' implementation (:mod:`jzero.kernels.ops`): "jnp" on a CPU mesh (the Pallas
      kernels would only be traced to be dropped: seconds of tracing per step compile), "auto"
      elsewhere (Pallas where the step is lowered for CUDA or TPU, also ahead of time).
  """

  gather: Any
  secondary: bool
  reduce: Any
  gather_group: int
  reduce_group: int
  zero_axes: Axes
  node_axes: Axes
  local_axes: Axes
  impl: str = "auto"
