"""ZeRO-Offload's optimizer step on the host, as DeepSpeed schedules it: gradients leave the device
as the backward produces them, Adam runs on the host's cores outside the step, the new 16-bit
parameters go back. ``offload_optimizer: {"device": "cpu"}`` runs it wherever it can run the
config (:func:`resolve_update`, at initialize; ``update: "cpu_adam"`` asks for it and is refused
where it cannot run; ``update: "stream"`` keeps the optimizer state's update on the device); the
tier is chosen by :func:`jzero.tiers.host_optimizer.settings_from_config`.

**Where things live.** The chosen leaves' fp32 master and Adam moments live in host memory as numpy
arrays, one partition per device, in the tier's :class:`~jzero.tiers.host_store.HostStore` (the
train state holds 0-byte placeholders for them, as for the NVMe tier). The device keeps the
compute params -- replicated at stages 1/2, partitioned at stage 3 -- and no fp32 state.

**The backward** (stages 2 and 3). What the step differentiates for a stacked such leaf (the
layers, most of a model) is a :class:`HostSlot`: a zero gradient slot *in host memory* and a norm
token. The leaf's
:class:`~jzero.comm.zero_param.ZeroParam` reads its device value through :func:`into_host`, whose
backward sends the reduced gradient partition the gather's (or the attach's) backward produced to
host memory and hands the token the partition's sum of squares, taken on the device before the
copy. The slot and token are sliced per layer by the layer scan, which gathers each layer once,
so each layer's gradient partition is copied out as soon as its reduce-scatter is done and the
device never holds the layers' whole gradient partition. A leaf outside the stack (an embedding a
model may use twice: its gradient is the sum of both uses', and so is its norm) keeps the device
path and is sent to host memory at the end of the backward. Stage 1 reduces the full local
gradient at the end, as DeepSpeed's stage 1 does, and only then sends the partitions.

**The update.** The step's global norm and its finiteness include the host leaves (from the
tokens); :class:`HostStepUpdate`, the outermost link of the update chain (``wraps = "step"``),
hands their gradients (in host memory), the loss scale, the clipping factor and whether the step
is skipped out of the jit and leaves their placeholders as they are. After the jit the store runs
:class:`jzero.tiers.host_adam.HostAdam` over the partitions (unscaled and clipped as the device
path does, with the step's learning rate) and uploads the new compute params (stage 1/2: the
partitions, then one all-gather).

**Gradient accumulation** (``gradient_accumulation_steps`` > 1), as DeepSpeed's offload does it:
a slot's sum over the micro-batches lives in host memory, in the device path's accumulation
dtype, each micro-batch's partition added to it by the host as it arrives
(:meth:`HostSlot.add`); the sum's norm is taken from the sum, on the host (:meth:`HostSlot.summed`).

**Limits** (:func:`update_refusals`; an explicit ``update: cpu_adam`` is refused with them at
initialize, an unset update falls back to ``stream`` and the log says why): a mesh whose
data-parallel axes are all ZeRO axes (no replicas of a partition), the config's Adam or AdamW (a
client optax transformation or another optimizer keeps the ``stream`` / ``host`` modes), and on
TPU one micro-batch per step (libtpu aborts compiling the host's sum inside the micro-batch loop:
"host vs. host").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero.comm.zero_param import SlotTarget
from jzero.config.blocks import CPU_ADAM, STREAM, cpu_offload_update
from jzero.errors import ConfigError
from jzero.sharding.opt_layout import OptLayout
from jzero.tiers import host_store
from jzero.tiers.base import Tier, Update
from jzero.tiers.delayed import Variant
from jzero.tiers.host_optimizer import on_host, to_device, to_host
from jzero.tiers.updates import placeholder_shape

__all__ = ["HOST_STEP", "INTO_HOST", "HostSlot", "HostStepTier", "HostStepUpdate", "into_host",
           "update_refusals", "check_update", "resolve_update"]

PyTree = Any

#: The tier's name in a plan's ``LeafPlan.state_tier``.
HOST_STEP = "host_step"


def update_refusals(config: Any, *, client_optimizer: bool, replica_axes: tuple,
                    platform: str) -> list[str]:
  """What keeps the host step (``update: cpu_adam``) from running a config, one reason each
  (empty: it runs): it needs the config's Adam or AdamW, a mesh without replicas of a partition
  and, on TPU, one micro-batch per step."""
  kind = str(getattr(config.optimizer, "type", "")).lower()
  gas = config.gradient_accumulation_steps
  return [why for why, bad in (
      ("a client optax optimizer (it needs the config's Adam or AdamW block)", client_optimizer),
      (f"optimizer {config.optimizer.type if config.optimizer else None} (it runs Adam or AdamW)",
       not client_optimizer and kind not in ("adam", "adamw")),
      (f"the mesh's replica axes {replica_axes} (every device must hold its own partition of the "
       f"optimizer state)", bool(replica_axes)),
      (f"gradient_accumulation_steps={gas} on TPU (libtpu's compiler aborts on the host's sum "
       f"inside the loop over micro-batches; one micro-batch per step runs)",
       platform == "tpu" and gas > 1),
  ) if bad]


def check_update(config: Any, *, client_optimizer: bool, replica_axes: tuple,
                 platform: str) -> None:
  """A config that names ``offload_optimizer.update: cpu_adam`` where the host step cannot run it
  (:func:`update_refusals`) is refused, naming each reason. Before any device work."""
  block = config.zero_optimization.offload_optimizer
  if block is None or block.update != CPU_ADAM:
    return
  reasons = update_refusals(config, client_optimizer=client_optimizer,
                            replica_axes=replica_axes, platform=platform)
  if reasons:
    raise ConfigError(
        "zero_optimization.offload_optimizer.update: cpu_adam (Adam on the host's cores) cannot "
        f"run with {'; '.join(reasons)}. Use update: stream, or change what is named.")


def resolve_update(config: Any, *, client_optimizer: bool, replica_axes: tuple,
                   platform: str) -> tuple[Any, list[str] | None]:
  """``offload_optimizer: {device: cpu}`` without an ``update``, as DeepSpeed runs it: the host
  step (``cpu_adam``, DeepSpeed's CPU Adam's schedule) where it can run the config
  (:func:`update_refusals`), else the streamed update (``stream``: the optimizer's state in host
  memory, updated on the device one leaf at a time), which is also what keeps the state of
  parameters on NVMe in host memory, as the config asks (beside the host step, the NVMe store
  keeps their state with them). -> (the config with the update written in, the reasons it
  streams -- empty: the host step runs --; None: nothing was left to choose, and the config is
  as given)."""
  zero = config.zero_optimization
  block = zero.offload_optimizer
  if block is None or block.device != "cpu" or block.update is not None:
    return config, None
  reasons = update_refusals(config, client_optimizer=client_optimizer,
                            replica_axes=replica_axes, platform=platform)
  param = zero.offload_param.device if zero.offload_param is not None else None
  if cpu_offload_update(param) != CPU_ADAM:
    reasons.append("offload_param.device: nvme (the host's Adam leaves the optimizer state of "
                   "parameters on NVMe in the NVMe store; the streamed update keeps it in host "
                   "memory, where the config puts it)")
  chosen = STREAM if reasons else CPU_ADAM
  zero = zero.model_copy(update={"offload_optimizer": block.model_copy(update={"update": chosen})})
  return config.model_copy(update={"zero_optimization": zero}), reasons


@jax.custom_vjp
def into_host(slot: jax.Array, norm: jax.Array, value: jax.Array) -> jax.Array:
  """``value`` (on the device) for the forward pass; its gradient, in the backward, goes to
  ``slot``'s memory (host memory) and its sum of squares to ``norm``."""
  del slot, norm
  return value


def _into_host_fwd(slot, norm, value):
  return value, jnp.zeros((0,), slot.dtype)  # the residual: the slot's dtype


def _into_host_bwd(dtype_of, ct):
  sent = ct.astype(dtype_of.dtype)  # the norm is the sent value's, as the device path's is
  return to_host(sent), sum_of_squares(sent), None


def sum_of_squares(g: jax.Array, axis: Any = None) -> jax.Array:
  """A gradient's sum of squares in fp32 (over ``axis``; None: all), what the global norm adds."""
  return jnp.sum(jnp.square(g.astype(jnp.float32)), axis=axis)


into_host.defvjp(_into_host_fwd, _into_host_bwd)


@dataclasses.dataclass(frozen=True)
class _IntoHost:
  """The :class:`~jzero.comm.zero_param.PartitionSource` of a leaf whose gradient goes to host
  memory: ``stored`` is ``(value or None, norm token)``; a missing value (a replicated
  parameter's gradient slot) is zeros of the slot's shape."""

  def fetch(self, slot: jax.Array, stored: Any) -> jax.Array:
    value, norm = stored
    if value is None:
      value = jnp.zeros(slot.shape, slot.dtype)
    return into_host(slot, norm, value)


INTO_HOST = _IntoHost()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HostSlot(SlotTarget):
  """What the step differentiates for a host-step leaf (module docstring): ``grad``, a zero slot
  of the leaf's gradient partition in host memory (its gradient is the reduced partition), and
  ``norm`` (one per layer of a stacked leaf), whose gradient is that partition's sum of squares."""

  grad: jax.Array
  norm: jax.Array

  def zero_param_args(self, value: jax.Array | None) -> dict:
    return {"partition": self.grad, "stored": (value, self.norm), "source": INTO_HOST}

  # gradient accumulation: the sum stays in host memory, added by the host (the device path's
  # accumulation dtype, so the sum is the one the device would hold), and its norm is taken from
  # the sum on the host -- a sum of the micro-batches' tokens would be the wrong norm
  def accumulator(self, dtype: Any) -> HostSlot:
    return HostSlot(grad=to_host(jnp.zeros(self.grad.shape, dtype)),
                    norm=jnp.zeros(self.norm.shape, jnp.float32))

  def add(self, micro: HostSlot) -> HostSlot:
    grad = on_host(lambda total, g: total + g.astype(total.dtype), self.grad, micro.grad)
    return HostSlot(grad=grad, norm=self.norm)

  def summed(self) -> HostSlot:
    per_layer = lambda g: sum_of_squares(g, axis=tuple(range(1, g.ndim)))  # noqa: E731
    return HostSlot(grad=self.grad, norm=to_device(on_host(per_layer, self.grad)))


class HostStepTier(Tier):
  """The optimizer step on the host (module docstring); its resource is the
  :class:`~jzero.tiers.host_store.HostStore`."""

  name = HOST_STEP
  memory = "host"
  wraps = "step"
  #: Chosen by ``offload_optimizer.update: cpu_adam`` of ``device: cpu`` (the host tier answers
  #: the value first; this one names it for the estimator and the memory report).
  answers = (("offload_optimizer", "cpu"),)

  @classmethod
  def uses(cls, plan: Any) -> bool:
    return any(l.state_tier == HOST_STEP for l in plan.leaf_list())

  @classmethod
  def holds_state(cls, plan: Any, leaf: Any) -> bool:
    return leaf.state_tier == HOST_STEP

  @classmethod
  def open(cls, plan: Any, config: Any, tx: optax.GradientTransformation) -> Any:
    """The store; the train layer hands it the optimizer's settings
    (:meth:`~jzero.tiers.host_store.HostStore.configure`) before the update chain is made."""
    leaves = [l for l in plan.leaf_list() if cls.holds_state(plan, l)]
    return host_store.HostStore(plan, OptLayout.of(plan, tx), leaves)

  @classmethod
  def grad_target(cls, plan: Any, leaf: Any, p: jax.Array) -> jax.Array | None:
    """A stacked leaf's :class:`HostSlot`: the layer scan gathers each layer once, so each
    layer's reduced partition is its whole gradient when it leaves. Another leaf -- an
    embedding a model may call twice, whose gradient is the sum of both calls' -- keeps the
    device path and leaves at the end of the backward (the device holds those few partitions).
    So does a stacked vector (a bias or a norm's scale, [layers, d]: small), whose per-layer
    writes into host memory would slice the second-minor dimension, which TPU's compiler cannot
    copy a row at a time (libtpu aborts: "Sublane slicing size not multiple of update chunk")."""
    if leaf.state_tier != HOST_STEP or not leaf.stacked or len(leaf.shape) < 3 or not (
        leaf.grad_partitioned or leaf.param_partitioned):
      return None
    shape = list(leaf.padded_shape)
    shape[leaf.shard_dim] //= plan.mesh.zero_size
    norm = jnp.zeros((leaf.shape[0],), jnp.float32)
    return HostSlot(grad=to_host(jnp.zeros(shape, plan.comm_dtype)), norm=norm)

  @classmethod
  def update(cls, plan: Any, config: Any, tx: optax.GradientTransformation, resource: Any,
             inner: Update, *, elementwise: bool) -> Update:
    """(:func:`check_update` refused what the host step cannot run, at initialize.)"""
    if resource.adam is None or not elementwise:
      raise ConfigError(
          "offload_optimizer.update: cpu_adam runs DeepSpeed's CPU Adam: it needs the config's "
          "optimizer block to be Adam or AdamW. Use update: stream or host for another.")
    return HostStepUpdate(inner, plan)

  @classmethod
  def after_step(cls, plan: Any, config: Any, tx: optax.GradientTransformation,
                 resource: Any) -> Any:
    """The store's host Adam over the handed-out partitions and the upload of the new params --
    on its thread while the next step runs, with the delayed update past its warm-up."""
    store = resource

    def after(state: Any, metrics: dict, outputs: dict) -> Any:
      carried = getattr(state, "delayed", None)
      if carried is not None and carried.variant != Variant.WARMUP:
        return store.update_delayed(state, metrics, outputs[HOST_STEP])
      return store.update(state, metrics, outputs[HOST_STEP])
    return after

  # -- outside a step ------------------------------------------------------------------------
  @classmethod
  def write_initial(cls, plan: Any, resource: Any, masters: dict[str, jax.Array]) -> None:
    resource.write_initial(masters)

  @classmethod
  def full_state(cls, plan: Any, resource: Any, state: Any) -> Any:
    return resource.full_state(state)

  @classmethod
  def absorb(cls, plan: Any, resource: Any, state: Any) -> Any:
    return resource.absorb(state)

  @classmethod
  def measured_bytes(cls, plan: Any, resource: Any) -> dict[str, dict[str, int]]:
    return {category: {"unpinned_host": nbytes}
            for category, nbytes in resource.bytes_per_device().items() if nbytes}

  @classmethod
  def held_bytes(cls, plan: Any, resource: Any) -> dict[str, int]:
    return resource.logical_bytes()


class HostStepUpdate(Update):
  """The host step's link of the update chain (module docstring): inside the jit it hands the
  host leaves' gradients out (stage 1: sent to host memory here) with the loss scale each still
  carries (a slot's: the step's; one unscaled on the device path: 1), the clipping factor and the
  skip flag, and gives the links below placeholders for them; after the jit
  (:meth:`HostStepTier.after_step`) the store updates them and uploads their new params."""

  def __init__(self, inner: Update, plan: Any):
    super().__init__(inner)
    self.plan = plan
    self.leaves = frozenset(l.path for l in plan.leaf_list() if l.state_tier == HOST_STEP)

  @property
  def output_specs(self) -> dict:
    plan = self.plan
    grads = {l.path: plan.state_spec(l) for l in plan.leaf_list() if l.path in self.leaves}
    return {**self.inner.output_specs,
            HOST_STEP: {"grads": grads, "factor": P(), "scale": dict.fromkeys(grads, P()),
                        "skip": P()}}

  @property
  def output_kinds(self) -> dict:
    grads = {path: "pinned_host" for path in self.leaves}
    return {**self.inner.output_kinds,
            HOST_STEP: {"grads": grads, "factor": None, "scale": None, "skip": None}}

  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    plan = self.plan
    mine = lambda l: l.path in self.leaves  # noqa: E731
    # a slot's gradient left the device in the backward, still loss-scaled (the step unscaled its
    # norm only); a leaf on the device path was unscaled with the others: the store divides each
    # by its own scale
    scale, one = state.loss_scale.scale, jnp.ones((), jnp.float32)
    handed, scales = {}, {}
    for l, g in zip(plan.leaf_list(), plan.flat(grads)):
      if mine(l):
        slot = isinstance(g, HostSlot)
        handed[l.path] = g.grad if slot else to_host(g)
        scales[l.path] = scale if slot else one
    # the links below see 0-byte placeholders for them (only the shard dimension is split, and
    # it has size 0: the local shape is the global one)
    inner_grads = plan.map(lambda l, g: jnp.zeros(placeholder_shape(l), jnp.float32) if mine(l)
                           else g, grads)
    new, outputs = self.inner.update(inner_grads, state, skip, factor)
    flag = jnp.zeros((), bool) if skip is None or skip is False else jnp.asarray(skip)
    return new, {**outputs, HOST_STEP: {
        "grads": handed, "factor": one if factor is None else factor, "scale": scales,
        "skip": flag}}


