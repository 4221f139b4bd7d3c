"""The host step's store (:mod:`jzero.tiers.host_step`): each host leaf's fp32 master and Adam moments
as numpy arrays, one partition per local device, and the step that updates them after the jit.

**Layout.** For a leaf ``l`` and a device ``d`` of this process the store holds ``p`` (the fp32
master partition, padded like the plan's state layout), ``m`` and ``v`` (the moments, the optimizer
state's twins of ``l`` named ``mu`` and ``nu``: jzero's Adam is optax's ``scale_by_adam``) and, in
mixed precision, ``out`` (the new 16-bit partition the step writes for the device). The update
count is the store's (the state's optimizer counts are placeholders' siblings, written back into a
full state for checkpoints).

**The step** (:meth:`HostStore.update`): when the jitted step is not skipped, each leaf's gradient
partitions (in host memory, the communication dtype) are unscaled and clipped into fp32 buffers
(``g / scale * factor``, the device path's two roundings), and one
:class:`~jzero.tiers.host_adam.HostAdam` call updates every partition in place over the cores with
the schedule's learning rate for the updates applied so far (the device path's optax count). The new compute params are uploaded: at stage 3 the
partitions are the params; at stages 1/2 one jitted all-gather
(:func:`jzero.comm.layouts.compute_param`) makes the replicated params from them.

**Outside a step** the store's arrays are placed as the plan lays out the master and the
optimizer state (:meth:`HostStore.full_state`: checkpoints, logical params) and taken back from a
restored state (:meth:`HostStore.absorb`), so a checkpoint moves between this tier and the others
exactly.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jzero.comm import layouts, program
from jzero.tiers.host_adam import HostAdam, HostAdamSettings
from jzero.tiers.updates import placeholder_shape

__all__ = ["HostStore"]

PyTree = Any
_ROLE = {"mu": "m", "nu": "v"}  # optax scale_by_adam's moments -> the kernel's names


class HostStore:
  """The host leaves' partitions and their update (module docstring)."""

  def __init__(self, plan: Any, opt: Any, leaves: list):
    """``leaves``: the plan's leaves the host step updates (the tier chooses them)."""
    self.plan, self.opt = plan, opt
    self.leaves = list(leaves)
    self.paths = frozenset(l.path for l in self.leaves)
    me = jax.process_index()
    self.devices = [d for d in plan.mesh.mesh.devices.flat if d.process_index == me]
    self.adam: HostAdam | None = None
    self.count = 0
    self.arrays: dict[str, dict[Any, dict[str, np.ndarray]]] = {}
    self.roles: dict[int, tuple[str, str]] = {}  # state leaf index -> (param path, "m" / "v")
    for i, leaf in enumerate(opt.leaves):
      if leaf.twin is not None and leaf.twin.path in self.paths:
        role = next((_ROLE[k] for k in leaf.path.split("/") if k in _ROLE), None)
        if role is None:
          raise ValueError(f"the host step keeps Adam's moments; {leaf.path} is not one")
        self.roles[i] = (leaf.twin.path, role)
    self._gather = None
    self._thread: concurrent.futures.ThreadPoolExecutor | None = None
    self._running: concurrent.futures.Future | None = None  # the delayed update's
    self._schedule: Any = None

  def configure(self, settings: HostAdamSettings, schedule: Any) -> None:
    """The optimizer's settings (the config's Adam / AdamW block) and its learning-rate
    schedule (``count -> lr``: the k-th update, k = 0, 1, ..., uses ``schedule(k)``, as the
    device path's optax count does)."""
    if self.adam is None or self.adam.settings != settings:
      self.adam = HostAdam(settings)
    self._schedule = jax.jit(schedule)

  # -- the partitions ------------------------------------------------------------------------
  def _index(self, leaf: Any) -> dict[Any, tuple]:
    """Device -> the index (slices) of its partition of ``leaf``'s state-layout array."""
    sharding = self.plan.sharding(self.plan.state_spec(leaf))
    shape = self.plan.state_shape(leaf)
    return {d: i for d, i in sharding.devices_indices_map(shape).items() if d in self.devices}

  def _take(self, path: str, name: str, x: jax.Array) -> None:
    """Copies each local shard of ``x`` (a state-layout array of the leaf at ``path``) into the
    store's ``name`` buffers."""
    per_device = self.arrays.setdefault(path, {})
    for shard in x.addressable_shards:
      buffers = per_device.setdefault(shard.device, {})
      buffers[name] = np.array(shard.data, np.float32)

  def write_initial(self, masters: dict[str, jax.Array]) -> None:
    """The initial fp32 masters (state layout) of the host leaves; zero moments, count 0."""
    self.count = 0
    for path, x in masters.items():
      if path not in self.paths:
        continue
      self._take(path, "p", x)
      for buffers in self.arrays[path].values():
        buffers["m"] = np.zeros_like(buffers["p"])
        buffers["v"] = np.zeros_like(buffers["p"])
    self._add_outputs()

  def _add_outputs(self) -> None:
    if not self.plan.has_master:
      return
    dtype = np.dtype(ml_dtypes.bfloat16) if self.plan.compute_dtype == jnp.bfloat16 \
        else np.dtype(np.float16)
    for per_device in self.arrays.values():
      for buffers in per_device.values():
        buffers["out"] = np.empty(buffers["p"].shape, dtype)

  # -- the step ------------------------------------------------------------------------------
  def update(self, state: Any, metrics: dict, handed: dict) -> Any:
    """After a jitted step: the host leaves updated from ``handed`` (their gradients in host
    memory, ``factor``, ``scale`` -- by leaf: the loss scale each gradient still carries --,
    ``skip``) with the step's learning rate, and ``state``'s
    params of them replaced by the new ones (module docstring)."""
    self.wait()
    if not self._apply(metrics, handed):
      return state
    return state._replace(params=self._upload(state.params))

  def update_delayed(self, state: Any, metrics: dict, handed: dict) -> Any:
    """The delayed parameter update (:mod:`jzero.tiers.delayed`) on the host: ``state``'s params
    replaced by those of the update running since the previous step (if one was), then this
    step's gradient's update started on a thread of its own, to run while the device computes
    the next step (which uses the params returned here: one update late, as the delayed update's
    math says). :meth:`wait` ends it."""
    if self._running is not None:
      applied = self._running.result()
      self._running = None
      if applied:
        state = state._replace(params=jax.block_until_ready(self._upload(state.params)))
    if self._thread is None:
      self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jzero-host-step")
    self._running = self._thread.submit(self._apply, metrics, handed)
    return state

  def wait(self) -> bool:
    """Waits for a delayed update still running (its params are uploaded by the next
    :meth:`update_delayed`); whether it applied an update."""
    if self._running is None:
      return False
    return self._running.result()

  def _apply(self, metrics: dict, handed: dict) -> bool:
    """The numpy side of one update (module docstring), with the learning rate of the updates
    applied before it: False for a skipped step."""
    del metrics
    if bool(np.asarray(handed["skip"])):
      return False
    factor = np.float32(np.asarray(handed["factor"]))
    lr = float(np.asarray(self._schedule(np.int32(self.count))))
    ps, ms, vs, gs, outs = [], [], [], [], []
    for leaf in self.leaves:
      grad = handed["grads"][leaf.path]
      scale = np.float32(np.asarray(handed["scale"][leaf.path]))
      for shard in grad.addressable_shards:
        buffers = self.arrays[leaf.path][shard.device]
        g = np.asarray(shard.data).astype(np.float32)
        np.divide(g, scale, out=g)  # the loss scale this leaf's gradient still carries
        np.multiply(g, factor, out=g)
        ps.append(buffers["p"])
        ms.append(buffers["m"])
        vs.append(buffers["v"])
        gs.append(g)
        outs.append(buffers.get("out"))
    self.count += 1
    self.adam.step(ps, ms, vs, gs, self.count, lr,
                   out_params=outs if self.plan.has_master else None)
    return True

  def _partitions(self, leaf: Any, name: str, dtype: Any, kind: str | None = None) -> jax.Array:
    """The store's ``name`` buffers of ``leaf`` as one state-layout array (``kind``: its memory
    kind, default the plan's state kind of the leaf)."""
    plan = self.plan
    sharding = plan.sharding(plan.state_spec(leaf), kind)
    shape = plan.state_shape(leaf)
    per_device = self.arrays[leaf.path]
    # a numpy copy of each buffer, the device array's own (it may alias it): the store updates
    # its buffers in place, and device_put does not finish reading its source when it returns
    # (device_put(buffer, may_alias=False) raced with the delayed update's thread, which updates
    # them right after the upload: stage 3's uploaded partitions took some of the next update --
    # nondeterministic losses, 0.3% after 3 steps)
    arrays = [jax.device_put(np.array(per_device[d][name], dtype, copy=True),
                             jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
              for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

  def _upload(self, params: PyTree) -> PyTree:
    """``params`` with the host leaves' new compute params (stage 3: the partitions, in the
    param's memory -- host memory with ``offload_param: cpu``; stages 1/2: all-gathered)."""
    plan = self.plan
    name = "out" if plan.has_master else "p"
    new = {l.path: self._partitions(l, name, plan.compute_dtype,
                                    plan.param_memory_kind(l) if l.param_partitioned
                                    else plan.memory_kind())
           for l in self.leaves}
    replicated = [l for l in self.leaves if not l.param_partitioned]
    if replicated:
      new.update(self._gather_program(replicated)({l.path: new[l.path] for l in replicated}))
    return plan.map(lambda l, p: new.get(l.path, p), params)

  def _gather_program(self, leaves: list) -> Any:
    """The jitted all-gather of stage 1/2's uploaded partitions into compute params."""
    if self._gather is None:
      plan = self.plan
      specs = {l.path: plan.state_spec(l) for l in leaves}
      out = {l.path: plan.param_spec(l) for l in leaves}
      by_path = {l.path: l for l in leaves}
      body = lambda parts: {p: layouts.compute_param(plan, by_path[p], x)  # noqa: E731
                            for p, x in parts.items()}
      self._gather = jax.jit(program.shard_map(plan, body, (specs,), out),
                             out_shardings=plan.shardings(out))
    return self._gather

  # -- outside a step ------------------------------------------------------------------------
  def full_state(self, state: Any) -> Any:
    """``state`` with the host leaves' master (mixed precision) and Adam moments and counts read
    from the store, laid out by the plan (what checkpoints save); a delayed update running is
    waited for and saved applied."""
    plan, opt = self.plan, self.opt
    if not self.arrays:
      return state
    if self._running is not None and self._running.result():
      # a delayed update's step still to be uploaded (the live run uploads it after its next
      # step): the checkpoint holds it applied, params and master agreeing. A run resumed from it
      # computes its first gradient at these params, one update later than the live run does.
      state = state._replace(params=self._upload(state.params))
    kind = plan.memory_kind()
    master = state.master
    if plan.has_master:
      master = plan.map(lambda l, m: self._partitions(l, "p", jnp.float32, kind)
                        if l.path in self.paths else m, master)
    leaves = opt.treedef.flatten_up_to(state.opt_state)
    filled = []
    for i, (leaf, x) in enumerate(zip(opt.leaves, leaves)):
      if i in self.roles:
        path, role = self.roles[i]
        filled.append(self._partitions(next(l for l in self.leaves if l.path == path), role,
                                       jnp.float32, kind))
      elif leaf.path.split("/")[-1] == "count" and not leaf.shape:
        filled.append(jax.device_put(np.asarray(self.count, x.dtype), x.sharding))
      else:
        filled.append(x)
    return state._replace(master=master, opt_state=jax.tree.unflatten(opt.treedef, filled))

  def absorb(self, state: Any) -> Any:
    """A full state (a restore) -> the host leaves' master, moments and count taken into the
    store; their arrays in ``state`` replaced by placeholders."""
    plan, opt = self.plan, self.opt
    source = state.master if plan.has_master else state.params
    for leaf, x in zip(plan.leaf_list(), plan.flat(source)):
      if leaf.path in self.paths:  # (fp32: the param is the master; its padded partitions)
        self._take(leaf.path, "p", x if plan.has_master else _state_layout(plan, leaf, x))
    leaves = opt.treedef.flatten_up_to(state.opt_state)
    by_path = {l.path: l for l in self.leaves}
    filled = []
    for i, (leaf, x) in enumerate(zip(opt.leaves, leaves)):
      if i in self.roles:
        path, role = self.roles[i]
        self._take(path, role, x)
        x = jax.device_put(np.zeros(placeholder_shape(by_path[path]), x.dtype), x.sharding)
      elif leaf.path.split("/")[-1] == "count" and not leaf.shape:
        self.count = int(np.asarray(x))
      filled.append(x)
    self._add_outputs()
    master = state.master
    if plan.has_master:
      master = plan.map(lambda l, m: jax.device_put(np.zeros(placeholder_shape(l), m.dtype),
                                                    m.sharding) if l.path in self.paths else m,
                        master)
    return state._replace(master=master, opt_state=jax.tree.unflatten(opt.treedef, filled))

  # -- bytes ---------------------------------------------------------------------------------
  def bytes_per_device(self) -> dict[str, int]:
    """One device's bytes in the store: "master" (the fp32 master; in fp32 training the
    partition is the param's, and counted as "params"), "params" (the new 16-bit partitions
    written for the upload), "optimizer" (the moments)."""
    if not self.arrays or not self.devices:
      return {}
    first = self.devices[0]
    mine = [per[first] for per in self.arrays.values() if first in per]
    fp32 = sum(b["p"].nbytes for b in mine)
    return {"master": fp32 if self.plan.has_master else 0,
            "params": sum(b["out"].nbytes for b in mine if "out" in b)
                      + (0 if self.plan.has_master else fp32),
            "optimizer": sum(b["m"].nbytes + b["v"].nbytes for b in mine)}

  def logical_bytes(self) -> dict[str, int]:
    """Global bytes of what the store holds, as the state's arrays would take them."""
    numel = sum(math.prod(self.plan.state_shape(l)) for l in self.leaves)
    return {"master": 4 * numel if self.plan.has_master else 0, "optimizer": 8 * numel}


def _state_layout(plan: Any, leaf: Any, x: jax.Array) -> jax.Array:
  """fp32 training's master of a param array ``x`` in the state layout (padded, partitioned)."""
  return jax.jit(leaf.to_padded, out_shardings=plan.sharding(plan.state_spec(leaf)))(x)
