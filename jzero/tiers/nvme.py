"""ZeRO-Infinity's NVMe tier as a :class:`~jzero.tiers.base.Tier`: :class:`NvmeTier`.

One store (:class:`jzero.tiers.nvme_store.NvmeStore`, settings :mod:`jzero.tiers.nvme_settings`)
holds what the config puts on NVMe: optimizer state and fp32 masters (``offload_optimizer.device:
nvme``), stage-3 params (``offload_param.device: nvme``, read inside the step by
:mod:`jzero.tiers.nvme_params`), or, with the optimizer state on the host, an fp32 copy of each
param. The tier's hooks put the pieces together:

* init: the store is opened (its free space checked) before the first state; the TrainState holds
  0-byte placeholders for what the store holds, and the initial masters are written as step 0;
* the forward pass: a param on NVMe is differentiated through a zero gradient slot and read by a
  host callback when its gather runs;
* the update phase: the step hands out the NVMe leaves' gradients (and what their update reads)
  and keeps their params; after the jitted step the store updates its leaves sub-group by
  sub-group and commits the step (:meth:`NvmeStore.update`), or writes the params' new copies;
* outside a step: checkpoints and ``logical_params`` read the store into the state
  (:mod:`jzero.tiers.nvme_state`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jzero.tiers import nvme_settings, nvme_state, nvme_store, where
from jzero.tiers.base import EngineView, Tier, Update
from jzero.tiers.nvme_params import ParamSource

__all__ = ["NvmeTier", "NvmeUpdate"]

PyTree = Any
NVME = nvme_settings.NVME


class NvmeTier(Tier):
  """The NVMe store's hooks (module docstring). The store itself is ``engine.nvme_store``."""

  name = "nvme"

  @classmethod
  def create(cls, engine: EngineView) -> NvmeTier | None:
    return cls() if where.uses_nvme_store(engine.plan) else None

  # -- init ------------------------------------------------------------------------------------
  def prepare(self, engine: EngineView) -> None:
    if engine.nvme_store is None:  # checks the free space first
      engine.nvme_store = nvme_store.NvmeStore(engine, engine.nvme_settings)

  @staticmethod
  def _in_store(leaf: Any) -> bool:
    return leaf.state_tier == NVME or leaf.param_tier == NVME

  def initial_layout(self, engine: EngineView, state_layout: PyTree,
                     params: PyTree) -> tuple[PyTree, PyTree, Any]:
    plan = engine.plan
    # the store's masters (and copies of params) start from the full masters
    output = {l.path: x for l, x in zip(plan.leaf_list(), jax.tree.leaves(state_layout))
              if self._in_store(l)}
    if where.has_nvme(plan):  # placeholders; the real masters go to the store
      state_layout = nvme_store.shrink(plan, state_layout)
    if where.params_on_nvme(plan):  # placeholders: the store holds the params
      params = nvme_store.shrink(plan, params, "param_tier")
    return state_layout, params, output

  def init_output_shardings(self, engine: EngineView) -> Any:
    plan = engine.plan
    return {l.path: plan.sharding(plan.state_spec(l)) for l in plan.leaf_list()
            if self._in_store(l)}

  def after_init(self, engine: EngineView, state: Any, output: Any) -> None:
    engine.nvme_store.write_masters(engine, 0, output)

  # -- the forward pass ------------------------------------------------------------------------
  def grad_target(self, engine: EngineView, leaf: Any, p: jax.Array) -> jax.Array | None:
    if leaf.param_tier != NVME:
      return None
    shape = list(leaf.padded_shape)  # p is a 0-byte placeholder
    shape[leaf.shard_dim] //= engine.mesh.zero_size
    return jnp.zeros(shape, p.dtype)

  def gather_inputs(self, engine: EngineView, leaf: Any, p: jax.Array) -> dict | None:
    if leaf.param_tier != NVME:
      return None
    return {"source": ParamSource(engine.nvme_store.reader, leaf.path, engine.mesh.zero_axes),
            "stored": jnp.arange(leaf.shape[0]) if leaf.stacked else jnp.zeros((), jnp.int32)}

  # -- the update -----------------------------------------------------------------------------
  def update(self, engine: EngineView, inner: Update) -> Update:
    return NvmeUpdate(engine, inner)

  # -- bytes -----------------------------------------------------------------------------------
  def measured_bytes(self, engine: EngineView) -> dict[str, dict[str, int]]:
    store = engine.nvme_store
    out = {category: {"nvme": nbytes} for category, nbytes in store.measured_per_device().items()
           if nbytes}  # measured from the store's chunk files
    if store.reader is not None and store.reader.cache_bytes():  # params' host cache (numpy)
      out.setdefault("params", {})["unpinned_host"] = (store.reader.cache_bytes()
                                                       // len(store.devices))
    return out

  def held_bytes(self, engine: EngineView) -> dict[str, int]:
    return engine.nvme_store.logical_bytes()  # the state holds 0-byte placeholders

  # -- outside a step --------------------------------------------------------------------------
  def full_state(self, engine: EngineView, state: Any) -> Any:
    return nvme_state.full_state(engine, state)

  def expand_abstract(self, engine: EngineView, abstract: Any) -> Any:
    return nvme_state.expand_abstract(engine, abstract)

  def absorb(self, engine: EngineView, state: Any) -> Any:
    return nvme_state.absorb(engine, state)


class NvmeUpdate(Update):
  """The update from and to the NVMe store, wrapping the update of the leaves in memory: the
  step hands out the NVMe leaves' gradients (and what their update reads) and keeps their params;
  after the jitted step the store updates its leaves sub-group by sub-group and commits the step
  (:meth:`jzero.tiers.nvme_store.NvmeStore.update`), or writes the params' new copies."""

  def __init__(self, engine: EngineView, inner: Update):
    super().__init__(inner)
    self.engine, self.plan = engine, engine.plan
    self.updates_state = where.has_nvme(engine.plan)  # else params (or their copies) only

  def hand_out(self, state: Any, grads: PyTree, factor: jax.Array | None) -> tuple[PyTree, dict]:
    grads, outputs = self.inner.hand_out(state, grads, factor)
    if not self.updates_state:
      return grads, outputs
    # the clipping factor is applied in the store's update, as the device path applies it inside
    # its fused update (the same rounding)
    return (nvme_store.shrink(self.plan, grads),
            {**outputs, NVME: nvme_store.step_outputs(self.engine, state, grads, factor)})

  def output_specs(self) -> dict:
    specs = self.inner.output_specs()
    if not self.updates_state:
      return specs
    return {**specs, NVME: nvme_store.step_output_specs(self.engine)}

  def apply(self, grads: PyTree, opt_state: PyTree, master: PyTree,
            keep: jax.Array | None = None) -> tuple[PyTree, PyTree, PyTree]:
    if self.updates_state:
      master = nvme_store.shrink(self.plan, master)
    return self.inner.apply(grads, opt_state, master, keep)

  def new_param(self, leaf: Any, m_device: jax.Array, m: jax.Array, old: jax.Array) -> jax.Array:
    # NVMe leaves keep their params here: the store's update makes the new ones; a param copied
    # to the tier is written there after the step from the new master, which in fp32 training is
    # the state's param itself
    if leaf.state_tier == NVME or where.param_placeholder(self.plan, leaf):
      return old
    if where.param_copy_on_nvme(leaf):
      return m
    return self.inner.new_param(leaf, m_device, m, old)

  def after_step(self, state: Any, metrics: dict, outputs: dict) -> Any:
    state = self.inner.after_step(state, metrics, outputs)
    store = self.engine.nvme_store
    if NVME in outputs:
      return store.update(self.engine, state, metrics, outputs[NVME])
    if store.copies:
      store.write_copies(self.engine, state, metrics)
    return state
