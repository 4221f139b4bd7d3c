"""ZeRO-Infinity's NVMe tier as a :class:`~jzero.tiers.base.Tier`: :class:`NvmeTier`.

One store (:class:`jzero.tiers.nvme_store.NvmeStore`, settings :mod:`jzero.tiers.nvme_settings`)
holds what the config puts on NVMe: optimizer state and fp32 masters (``offload_optimizer.device:
nvme``), stage-3 params (``offload_param.device: nvme``, read inside the step by
:mod:`jzero.tiers.nvme_params`), or, with the optimizer state on the host, an fp32 copy of each
param. The tier's hooks put the pieces together:

* init: the store is opened (:meth:`NvmeTier.open`, its free space checked) before the first state,
  into the engine's resources; the TrainState holds 0-byte placeholders for what the store holds,
  and the initial masters are written as step 0;
* the forward pass: a param on NVMe is differentiated through a zero gradient slot and read by a
  host callback when its gather runs;
* the update phase (:class:`NvmeUpdate`, the outermost link of the step's update): the step hands
  out the NVMe leaves' gradients (and what their update reads) and keeps their params; after the
  jitted step the store updates its leaves sub-group by sub-group and commits the step
  (:meth:`NvmeStore.update`), or writes the params' new copies;
* outside a step: checkpoints and ``logical_params`` read the store into the state
  (:mod:`jzero.tiers.nvme_state`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero.comm import layouts
from jzero.tiers import nvme_settings, nvme_state, nvme_store, where
from jzero.tiers.base import Tier, Update
from jzero.tiers.host_optimizer import split_state
from jzero.tiers.nvme_params import ParamSource
from jzero.tiers.updates import shrink

__all__ = ["NvmeTier", "NvmeUpdate", "step_outputs", "step_output_specs"]

PyTree = Any
NVME = nvme_settings.NVME


class NvmeTier(Tier):
  """The NVMe store's hooks (module docstring). Its resource is the store
  (:class:`jzero.tiers.nvme_store.NvmeStore`), opened per plan."""

  name = "nvme"
  memory = "nvme"
  answers = (("offload_optimizer", "nvme"), ("offload_param", "nvme"))
  wraps = "step"

  @classmethod
  def uses(cls, plan: Any) -> bool:
    return where.uses_nvme_store(plan)

  @classmethod
  def holds_state(cls, plan: Any, leaf: Any) -> bool:
    return leaf.state_tier == NVME

  @classmethod
  def holds_param(cls, plan: Any, leaf: Any) -> bool:
    return where.param_placeholder(plan, leaf)

  @classmethod
  def keeps(cls, plan: Any, leaf: Any) -> bool:
    return leaf.state_tier == NVME or leaf.param_tier == NVME  # copies of params too

  @classmethod
  def estimate(cls, block: str, share: float, numbers: Any, tiers: dict) -> None:
    """``offload_param: nvme`` keeps ``numbers.param_cache`` of the partition in host memory (the
    reader's cache, ``max_in_cpu``) beside the staging buffers every partition passes through
    (``numbers.param_buffers``), the rest on NVMe only; ``offload_optimizer: nvme`` is the plain
    rule."""
    super().estimate(block, share, numbers, tiers)
    if block == "offload_param":
      partition = numbers.partition_elements
      cached = min(numbers.param_cache, partition)
      tiers[cls.memory]["params"] = numbers.param_bytes * (partition - cached)
      tiers["host"]["params"] = numbers.param_bytes * (cached + numbers.param_buffers)

  # -- run time ------------------------------------------------------------------------------
  @classmethod
  def open(cls, plan: Any, config: Any, tx: optax.GradientTransformation) -> Any:
    """The store of ``plan``'s NVMe leaves (its free space checked first)."""
    return nvme_store.NvmeStore(plan, nvme_settings.settings_from_config(config), tx)

  @classmethod
  def write_initial(cls, plan: Any, resource: Any, masters: dict[str, jax.Array]) -> None:
    resource.write_masters(0, masters)

  # -- the forward pass ----------------------------------------------------------------------
  @classmethod
  def grad_target(cls, plan: Any, leaf: Any, p: jax.Array) -> jax.Array | None:
    if leaf.param_tier != NVME:
      return None
    shape = list(leaf.padded_shape)  # p is a 0-byte placeholder
    shape[leaf.shard_dim] //= plan.mesh.zero_size
    return jnp.zeros(shape, p.dtype)

  @classmethod
  def gather_inputs(cls, plan: Any, resource: Any, leaf: Any, p: jax.Array) -> dict | None:
    if leaf.param_tier != NVME:
      return None
    return {"source": ParamSource(resource.reader, leaf.path, plan.mesh.zero_axes),
            "stored": jnp.arange(leaf.shape[0]) if leaf.stacked else jnp.zeros((), jnp.int32)}

  # -- the update ----------------------------------------------------------------------------
  @classmethod
  def update(cls, plan: Any, config: Any, tx: optax.GradientTransformation, resource: Any,
             inner: Update, *, elementwise: bool) -> Update:
    return NvmeUpdate(inner, plan, tx)

  @classmethod
  def after_step(cls, plan: Any, config: Any, tx: optax.GradientTransformation,
                 resource: Any) -> Any:
    """The store's update of its leaves from what the step handed out
    (:meth:`jzero.tiers.nvme_store.NvmeStore.update`), or the params' new copies written."""
    store = resource

    def after(state: Any, metrics: dict, outputs: dict) -> Any:
      if NVME in outputs:
        return store.update(state, metrics, outputs[NVME])
      if store.copies:
        return store.write_copies(state, metrics)
      return state
    return after

  # -- outside a step ------------------------------------------------------------------------
  @classmethod
  def full_state(cls, plan: Any, resource: Any, state: Any) -> Any:
    return nvme_state.full_state(plan, resource, state)

  @classmethod
  def absorb(cls, plan: Any, resource: Any, state: Any) -> Any:
    return nvme_state.absorb(plan, resource, state)

  @classmethod
  def measured_bytes(cls, plan: Any, resource: Any) -> dict[str, dict[str, int]]:
    store = resource
    out = {category: {"nvme": nbytes} for category, nbytes in store.measured_per_device().items()
           if nbytes}  # measured from the store's chunk files
    if store.reader is not None and store.reader.cache_bytes():  # params' host cache (numpy)
      out.setdefault("params", {})["unpinned_host"] = (store.reader.cache_bytes()
                                                       // len(store.devices))
    return out

  @classmethod
  def held_bytes(cls, plan: Any, resource: Any) -> dict[str, int]:
    return resource.logical_bytes()  # the state holds 0-byte placeholders


class NvmeUpdate(Update):
  """The update from and to the NVMe store, outside the step's clipping: the step
  hands out the NVMe leaves' unclipped gradients with the clipping factor (and what their update
  reads) and keeps placeholders for them; after the jitted step (:meth:`NvmeTier.after_step`)
  the store updates its leaves sub-group by sub-group and commits the step
  (:meth:`jzero.tiers.nvme_store.NvmeStore.update`), or writes the params' new copies."""

  def __init__(self, inner: Update, plan: Any, tx: optax.GradientTransformation):
    super().__init__(inner)
    self.plan, self.tx = plan, tx
    self.updates_state = where.has_nvme(plan)  # else params (or their copies) only
    self.nvme_leaves = frozenset(l.path for l in plan.leaf_list() if l.state_tier == NVME)

  @property
  def output_specs(self) -> dict:
    specs = self.inner.output_specs
    if not self.updates_state:
      return specs
    return {**specs, NVME: step_output_specs(self.plan, self.tx)}

  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    if not self.updates_state:
      return self.inner.update(grads, state, skip, factor)
    # the clipping factor is applied in the store's update, as the device path applies it inside
    # its fused update (the same rounding)
    handed = step_outputs(self.plan, state, grads, factor)
    new, outputs = self.inner.update(shrink(self.plan, grads, self.nvme_leaves), state, skip,
                                     factor)
    return new, {**outputs, NVME: handed}


def step_outputs(plan: Any, state: Any, grads: PyTree, factor: jax.Array | None) -> dict:
  """Inside the step's ``shard_map``: what :meth:`jzero.tiers.nvme_store.NvmeStore.update` needs
  from the device (its module docstring): the NVMe leaves' fp32 gradients before clipping and the
  clipping ``factor`` (the update multiplies, as the device path does inside its fused update: the
  same rounding), fp32 training's master partitions, and the optimizer state's non-parameter
  leaves before the update. The store never donates them: a failed write runs its update again
  from them (:class:`jzero.errors.StepNotCommitted`)."""
  nvme = [l for l in plan.leaf_list() if l.state_tier == NVME]
  flat_g = dict(zip([l.path for l in plan.leaf_list()], jax.tree.leaves(grads)))
  out = {"grads": {l.path: flat_g[l.path] for l in nvme},
         "factor": jnp.ones((), jnp.float32) if factor is None else factor}
  if not plan.has_master:  # (a param on the NVMe tier has its master in the store)
    flat_p = dict(zip([l.path for l in plan.leaf_list()], jax.tree.leaves(state.params)))
    out["master"] = {l.path: layouts.local_master(plan, l, flat_p[l.path]) for l in nvme
                     if l.param_tier != NVME}
  _, nodes, flags = split_state(state.opt_state, nvme_store.params_def(plan))
  out["nodes"] = [n for n, f in zip(nodes, flags) if not f]
  return out


def step_output_specs(plan: Any, tx: optax.GradientTransformation) -> dict:
  """Partition specs of :func:`step_outputs`."""
  nvme = [l for l in plan.leaf_list() if l.state_tier == NVME]
  specs = {"grads": {l.path: plan.state_spec(l) for l in nvme}, "factor": P()}
  if not plan.has_master:
    specs["master"] = {l.path: plan.state_spec(l) for l in nvme if l.param_tier != NVME}
  abstract = jax.eval_shape(tx.init, plan.abstract_master())
  _, nodes, flags = split_state(abstract, nvme_store.params_def(plan))
  specs["nodes"] = [P() for f in flags if not f]
  return specs
