"""ZeRO-Offload: the fp32 master and optimizer state in host memory, updated leaf by leaf.

``zero_optimization.offload_optimizer.device: "cpu"`` (stages 1-3) with ``update: "stream"`` or
``"host"`` -- what ``device: cpu`` runs where the host step (:mod:`jzero.tiers.host_step`, the
default for the config's Adam) does not: :func:`jzero.tiers.host_step.resolve_update` -- gives
every chosen leaf's optimizer state -- and, in bf16 / fp16 training, its fp32 master -- the
*host tier* of the plan (:attr:`jzero.sharding.plan.LeafPlan.state_tier`): the arrays keep the
plan's partitioning, and their sharding carries the memory kind ``pinned_host`` (``pin_memory:
false``: ``unpinned_host``). Compute params and gradients stay on the device. Scalars that are not
per-parameter (Adam's step count) stay on the device, as do 0-d parameters' states.

**Which leaves** (:func:`choose_offloaded`). ``offload_optimizer.ratio`` is DeepSpeed's partial
offload: the fraction of the parameters whose optimizer state goes to the host. The plan takes
leaves largest first while the offloaded elements stay within ``ratio`` of the total (a leaf that
would overshoot is skipped and smaller ones are tried), so ``ratio: 1`` moves everything and the
largest matrices move first.

**The update** (:func:`apply_update`), inside the train step's ``shard_map``, in one of two modes
(``offload_optimizer.update``, a jzero key):

* ``"stream"``: one *group* at a time (one parameter leaf per group), the group's host state is
  brought to the device (``jax.device_put(x, jax.memory.Space.Device)`` inside the jit), updated
  there by the same optax code as without offload, and written back to the host. Each group's
  transfer in waits (``lax.optimization_barrier``) for the previous group's results, so the device
  holds about one leaf's optimizer state at a time rather than all of it.
* ``"host"``: the gradient partitions go to the host and the optax update runs there, under
  ``compute_on("device_host")``; only the updated (fp32-training) parameter comes back.

Both run optax's own update on the same numbers. In bf16 both give the non-offloaded master bit
for bit (tested: a one-ulp difference there would grow through the bf16 rounding of the compute
params into a different run). That needs the stream's group barrier to hold only the per-leaf
arrays: with Adam's step count inside it, XLA compiled the update to other roundings (10% of the
master one ulp off after one step). In fp32 the stream mode can still differ by an ulp from the
second step on (XLA fuses the step-count-dependent bias correction differently around the
transfers); tests bound it by 1e-6. Grouping calls ``tx.update`` once per group
on a list of that group's leaves; that is valid for the optimizers jzero builds from the config
(elementwise; their only shared state is the step count, which every group advances the same
way). A client optax optimizer (``initialize(optimizer=...)``) may depend on the parameter tree's
structure, so it is updated as one group.

**Donation.** The step donates the whole train state. A donated buffer may only alias an output
of the same memory kind (openxla/xla#29270), and JAX 0.10 drops every memory kind from its
aliasing decision when any input or output lacks one; so when a plan offloads, every input and
output of the step gets an explicit memory kind (:meth:`jzero.sharding.plan.Plan.memory_kind`) and
each host leaf's output stays on the host: every buffer keeps its kind, and every one is donated.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jzero.config.blocks import CPU_ADAM, STREAM
from jzero.errors import ConfigError, JZeroWarning
from jzero.sharding.opt_layout import View
from jzero.sharding.planner import Placement
from jzero.tiers import where
from jzero.tiers.base import Tier, Update
from jzero.tiers.updates import DeviceUpdate

__all__ = ["UPDATE_MODES", "OffloadSettings", "settings_from_config",
           "choose_offloaded", "apply_update", "on_host", "to_device", "to_host", "split_state",
           "HostOptimizerTier", "HostUpdate"]

PyTree = Any
UPDATE_MODES = (STREAM, "host", CPU_ADAM)


@dataclasses.dataclass(frozen=True)
class OffloadSettings:
  """What the config asks of the optimizer-state tier (read once, before any device work).

  Attributes:
    ratio: fraction of the parameters whose state goes to the host (0: no offload).
    memory_kind: "pinned_host" or "unpinned_host".
    update: "stream" or "host" (see the module docstring).
    tier: the chosen leaves' tier: "host", or "nvme" (``device: nvme``,
    :mod:`jzero.tiers.nvme_store`), or another tier that answers the ``device`` value.
  """

  ratio: float = 0.0
  memory_kind: str = "pinned_host"
  update: str = STREAM
  tier: str = "host"


def settings_from_config(zero: Any) -> OffloadSettings:
  """The offload settings of a resolved ``zero_optimization`` block.

  Raises:
    ConfigError: offload in stage 0 (nothing is partitioned), or a ratio outside (0, 1].
  """
  block = zero.offload_optimizer
  if block is None or block.device in ("none", "auto"):
    return OffloadSettings()
  if zero.stage == 0:
    raise ConfigError(
        f"zero_optimization.offload_optimizer.device={block.device} needs ZeRO stage 1, 2 or 3 "
        "(stage 0 does not partition the optimizer state); set zero_optimization.stage to 1 or more, or "
        "remove offload_optimizer.")
  ratio = 1.0 if block.ratio == "auto" else float(block.ratio)
  if not 0.0 < ratio <= 1.0:
    raise ConfigError(f"zero_optimization.offload_optimizer.ratio={ratio}: give a fraction in "
                      f"(0, 1] of the parameters whose optimizer state goes to the host.")
  pinned = block.pin_memory in (True, "auto")
  # unset only in a config no engine resolved: initialize writes the update it runs
  # (jzero.tiers.host_step.resolve_update)
  update = block.update or STREAM
  if update == "cpu_adam" and block.device != "cpu":
    raise ConfigError(f"zero_optimization.offload_optimizer.update: cpu_adam runs the optimizer on "
                      f"the host's cores: it needs device: cpu, got {block.device!r}.")
  return OffloadSettings(ratio=ratio, memory_kind="pinned_host" if pinned else "unpinned_host",
                         update=update, tier=("host_step" if update == "cpu_adam" else "host")
                         if block.device == "cpu" else block.device)


def choose_offloaded(sizes: dict[str, int], ratio: float) -> set[str]:
  """Paths whose optimizer state goes to the host: largest first, at most ``ratio`` of the
  elements (see the module docstring). ``sizes``: path -> elements of the splittable leaves."""
  if ratio <= 0:
    return set()
  budget = ratio * sum(sizes.values())
  chosen, used = set(), 0
  for path, numel in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
    if used + numel <= budget * (1 + 1e-9):
      chosen.add(path)
      used += numel
  return chosen


def on_host(fn: Callable[..., Any], *args: Any) -> Any:
  """``fn(*args)`` computed by the host (``compute_on("device_host")``), its results in host
  memory. JAX 0.10 spells it as a context manager; JAX 0.11 only as a function wrapper that takes
  the results' memory spaces (0.10's ``compute_on2``)."""
  from jax.experimental import compute_on as module  # noqa: PLC0415

  wrapper = getattr(module, "compute_on", None)
  if wrapper is None:  # pragma: no cover - depends on the JAX version
    raise ConfigError("this JAX has no jax.experimental.compute_on.compute_on: use "
                      "zero_optimization.offload_optimizer.update: stream.")
  if "out_memory_spaces" in inspect.signature(wrapper).parameters:
    return wrapper(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)
  with wrapper("device_host"):
    return fn(*args)


def to_device(x: jax.Array) -> jax.Array:
  """``x`` moved to device memory (inside a jit)."""
  return jax.device_put(x, jax.memory.Space.Device)


def to_host(x: jax.Array) -> jax.Array:
  """``x`` moved to host memory (inside a jit; the memory kind comes from the out_shardings)."""
  return jax.device_put(x, jax.memory.Space.Host)


# -- updating the state group by group ------------------------------------------------------------
def split_state(opt_state: PyTree, params_def: Any):
  """(treedef of the nodes, nodes) where each param-like node is a list of its leaves in the
  params' order and every other node is a leaf (e.g. Adam's count)."""
  is_params = lambda x: jax.tree.structure(x) == params_def
  nodes, node_def = jax.tree_util.tree_flatten(opt_state, is_leaf=is_params)
  flags = [is_params(n) and not isinstance(n, jax.Array) for n in nodes]
  return node_def, [jax.tree.leaves(n) if f else n for n, f in zip(nodes, flags)], flags


def apply_update(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree,
                 master: PyTree, on_host: PyTree, *, mode: str, grouped: bool,
                 master_on_host: bool | PyTree,
                 keep: jax.Array | None = None) -> tuple[PyTree, PyTree, PyTree]:
  """optax update of ``master`` with ``grads``, state leaves on the host where ``on_host`` says.

  Args:
    tx: the optimizer.
    grads: fp32 gradients in the state layout (local partitions, on the device).
    opt_state: ``tx``'s state; param-like leaves of host leaves arrive in host memory.
    master: what the optimizer updates (fp32 master, or in fp32 training the param partitions):
      host leaves of a mixed-precision master are in host memory.
    on_host: a bool per parameter leaf (params' structure): its state lives on the host.
    mode: "stream" or "host" (module docstring).
    grouped: update one parameter leaf at a time (elementwise optimizers only).
    master_on_host: ``master`` is a separate fp32 master whose host leaves live on the host
      (mixed precision); False when it is fp32 training's param partitions (on the device). Or
      a bool per parameter leaf: that leaf's master arrives and goes back in host memory,
      whatever its state's tier (fp32 training with parameter offload,
      :mod:`jzero.tiers.host_params`).
    keep: "host" mode only: a traced bool; where true (a skipped step) the old master and state
      are selected, on the host for the host leaves (inside the host computation) and on the
      device for the others.

  Returns:
    (new master, the same on the device -- what the compute params are cast from --, new
    opt_state), each host leaf's stored results in host memory.
  """
  leaves_g, params_def = jax.tree.flatten(grads)
  leaves_m = params_def.flatten_up_to(master)
  host = params_def.flatten_up_to(on_host)
  if isinstance(master_on_host, bool):
    master_host = [h and master_on_host for h in host]
  else:
    master_host = params_def.flatten_up_to(master_on_host)
  node_def, nodes, flags = split_state(opt_state, params_def)
  n = len(leaves_g)
  groups: list[list[int]] = [[i] for i in range(n)] if grouped else [list(range(n))]
  new_m: list[Any] = [None] * n
  on_device: list[Any] = [None] * n
  new_nodes = [[None] * n if f else None for f in flags]
  previous: Any = ()
  for group in groups:
    g = [leaves_g[i] for i in group]
    m = [leaves_m[i] for i in group]
    s = [[node[i] for i in group] if f else node for node, f in zip(nodes, flags)]
    moved = [host[i] for i in group]
    m_host = [master_host[i] for i in group]
    if mode == "host" and any(moved):
      m_out, s_out = _host_update(tx, g, s, m, flags, moved, node_def, m_host, keep)
      m_dev_out = [to_device(x) if hm else x for x, hm in zip(m_out, m_host)]
    else:
      streamed = any(moved) or any(m_host)
      if streamed and previous != ():
        # Bring this group in only after the previous one went back: one group on the device.
        # Only the per-leaf arrays wait: the step count (a scalar every group reads) stays out
        # of the barrier, or XLA computes the update around it differently (not bitwise equal
        # to the update without offload).
        moved_s = [node for node, f in zip(s, flags) if f]
        m, moved_s, _ = lax.optimization_barrier((m, moved_s, previous))
        it = iter(moved_s)
        s = [next(it) if f else node for node, f in zip(s, flags)]
      m_dev = [to_device(x) if h or hm else x for x, h, hm in zip(m, moved, m_host)]
      s_dev = [[to_device(x) if h else x for x, h in zip(node, moved)] if f else node
               for node, f in zip(s, flags)]
      state = jax.tree.unflatten(node_def, s_dev)
      updates, new_state = tx.update(g, state, m_dev)
      m_out = m_dev_out = optax.apply_updates(m_dev, updates)
      if keep is not None:
        m_out = m_dev_out = _select(keep, m_dev, m_out)
        new_state = _select(keep, state, new_state)
      s_out = node_def.flatten_up_to(new_state)
      s_out = [[to_host(x) if h else x for x, h in zip(node, moved)] if f else node
               for node, f in zip(s_out, flags)]
      m_out = [to_host(x) if hm else x for x, hm in zip(m_out, m_host)]
      if streamed:
        previous = (m_out, [node for node, f in zip(s_out, flags) if f])
    for j, i in enumerate(group):
      new_m[i], on_device[i] = m_out[j], m_dev_out[j]
    for k, (node, f) in enumerate(zip(s_out, flags)):
      if f:
        for j, i in enumerate(group):
          new_nodes[k][i] = node[j]
      elif new_nodes[k] is None:
        new_nodes[k] = node  # e.g. the step count: every group advances it the same way
  out_nodes = [jax.tree.unflatten(params_def, node) if f else node
               for node, f in zip(new_nodes, flags)]
  return (jax.tree.unflatten(params_def, new_m), jax.tree.unflatten(params_def, on_device),
          jax.tree.unflatten(node_def, out_nodes))


def _select(keep: jax.Array, old: PyTree, new: PyTree) -> PyTree:
  """``old`` where ``keep`` (a traced bool) is true, else ``new``, leaf by leaf."""
  return jax.tree.map(lambda a, b: jnp.where(keep, a, b), old, new)


def _host_update(tx, g, s, m, flags, moved, node_def, host_m, keep=None):
  """The "host" mode: gradients to the host, the optax update under compute_on("device_host");
  ``host_m``: per leaf, its master arrives and goes back in host memory. ``keep``: a skipped
  step selects the old master and state inside the host computation -- the step needs no
  ``lax.cond`` around it (XLA's GPU compiler rejects a host computation inside a conditional:
  "Expected computation ... to be called only by one caller and that caller to be a While",
  jax 0.11.2 on an H200)."""
  g = [to_host(x) for x in g]
  m_in = [x if hm else to_host(x) for x, hm in zip(m, host_m)]
  # Everything the host computation reads is in host memory: device-resident state (the step
  # count, leaves of a mixed group that stay on the device) goes over and comes back.
  s = [[x if h else to_host(x) for x, h in zip(node, moved)] if f else to_host(node)
       for node, f in zip(s, flags)]
  def update(g, s, m_in, *keep):
    old = jax.tree.unflatten(node_def, s)
    updates, state = tx.update(g, old, m_in)
    m_out = optax.apply_updates(m_in, updates)
    if keep:
      return _select(keep[0], m_in, m_out), _select(keep[0], old, state)
    return m_out, state

  m_out, state = on_host(update, g, s, m_in, *(() if keep is None else (to_host(keep),)))
  s_out = node_def.flatten_up_to(state)
  # Device-resident parts of the state (the step count) come back to the device.
  s_out = [[x if h else to_device(x) for x, h in zip(node, moved)] if f else to_device(node)
           for node, f in zip(s_out, flags)]
  m_out = [x if hm else to_device(x) for x, hm in zip(m_out, host_m)]
  return m_out, s_out


def keep_tiers(opt_state: PyTree, master: PyTree, on_host: PyTree, *,
               master_on_host: bool) -> tuple[PyTree, PyTree]:
  """The unchanged state of a skipped (fp16 overflow) step, typed as :func:`apply_update`'s
  results are: host leaves placed in host memory (both branches of the step's ``lax.cond`` must
  agree on memory spaces)."""
  host = jax.tree.leaves(on_host)
  node_def, nodes, flags = split_state(opt_state, jax.tree.structure(on_host))
  nodes = [jax.tree.unflatten(jax.tree.structure(on_host),
                              [to_host(x) if h else x for x, h in zip(node, host)])
           if f else node for node, f in zip(nodes, flags)]
  if master_on_host:
    master = jax.tree.map(lambda x, h: to_host(x) if h else x, master, on_host)
  return master, jax.tree.unflatten(node_def, nodes)


def _in_host_memory(kind: str | None) -> bool:
  return kind is not None and kind.endswith("_host")


class HostOptimizerTier(Tier):
  """The host-memory tier: active whenever some array of the train state lives in host memory --
  optimizer state and masters (``offload_optimizer.device: cpu``), or params
  (``offload_param.device: cpu``, whose fp32-training masters are those params). Its update,
  :class:`HostUpdate`, replaces the device's."""

  name = "host"
  memory = "host"
  answers = (("offload_optimizer", "cpu"),)
  partial = True

  @classmethod
  def check_config(cls, config: Any) -> None:
    settings_from_config(config.zero_optimization)

  @classmethod
  def place(cls, plan: Any, zero: Any, placement: Placement) -> Placement:
    """The largest splittable leaves' state, up to the offload ratio (:func:`choose_offloaded`),
    in the offload's tier (host memory, or the tier the ``device`` value names)."""
    offload = settings_from_config(zero)
    if offload.ratio <= 0 or plan.stage < 1:
      return placement
    chosen = choose_offloaded({l.path: l.numel for l in plan.leaf_list()
                               if l.shard_dim is not None and not l.frozen}, offload.ratio)
    kinds = dict.fromkeys(chosen, offload.memory_kind) if offload.tier == where.HOST else {}
    return dataclasses.replace(
        placement, state_tiers={**placement.state_tiers, **dict.fromkeys(chosen, offload.tier)},
        state_kinds={**placement.state_kinds, **kinds},
        # the host step's gradients leave the step in host memory: every array gets its kind
        explicit_kinds=placement.explicit_kinds or (offload.tier == "host_step" and bool(chosen)))

  @classmethod
  def uses(cls, plan: Any) -> bool:
    return where.uses_host(plan)

  @classmethod
  def update(cls, plan: Any, config: Any, tx: optax.GradientTransformation, resource: Any,
             inner: Update, *, elementwise: bool) -> Update:
    mode = settings_from_config(config.zero_optimization).update
    return HostUpdate(inner, mode=mode, grouped=elementwise)


class HostUpdate(DeviceUpdate):
  """The update of a state with arrays in host memory, in place of the device's (``root``): the
  optimizer update streamed from host memory or run on the host (:func:`apply_update`), the new
  params of leaves whose params live in host memory stored there (:mod:`jzero.tiers.host_params`),
  and a skipped step's unchanged state placed as the update places its results. Its skip mode is
  "cond" in the "stream" mode (host arrays cannot be selected elementwise on the device) and
  "select" -- inside the host computation -- in the "host" mode (XLA's GPU compiler rejects a
  host computation inside a conditional)."""

  def __init__(self, root: DeviceUpdate, *, mode: str, grouped: bool):
    super().__init__(root.plan, root.tx, root.opt, root.held, root.checks_overflow)
    plan = self.plan
    if mode == "host" and root.opt.view is View.WHOLE:
      warnings.warn(
          f"offload_optimizer.update: host: the optimizer couples elements across devices "
          f"({root.opt.traits.coupling}), so its update runs on whole arrays with collectives, "
          f"which a host computation cannot run: its host-memory state is streamed to the device "
          f"for the update instead (the 'stream' mode).", JZeroWarning, stacklevel=2)
      mode = "stream"
    self.mode, self.grouped = mode, grouped
    self.state_on_host = plan.map(lambda l: l.state_tier == where.HOST)  # per parameter leaf

  @property
  def skip_mode(self) -> str:
    return "select" if self.mode == "host" else "cond"

  @property
  def master_on_host(self) -> PyTree:
    """Per parameter leaf, whether its master arrives (and goes back) in host memory: the
    separate fp32 master follows the state's tier; in fp32 training the master is the param
    partition, in the param's memory."""
    plan = self.plan
    return (self.state_on_host if plan.has_master
            else plan.map(lambda l: where.param_in_host_memory(plan, l)))

  def apply(self, grads: PyTree, opt_state: PyTree, master: PyTree,
            keep: jax.Array | None) -> tuple[PyTree, PyTree, PyTree]:
    master_on_host = self.master_on_host
    if self.opt.view is View.WHOLE:
      return self._apply_whole(grads, opt_state, master, keep)
    if keep is not None:
      # The update starts from finished gradients, as inside the step's lax.cond it would: without
      # the barrier XLA fuses the unscale and clipping into the update and rounds the master one
      # ulp differently from the update without offload (bf16 must be bit for bit).
      grads, opt_state, master = lax.optimization_barrier((grads, opt_state, master))
    return apply_update(self.tx, grads, opt_state, master, self.state_on_host, mode=self.mode,
                        grouped=self.grouped, master_on_host=master_on_host, keep=keep)

  def _apply_whole(self, grads: PyTree, opt_state: PyTree, master: PyTree,
                   keep: jax.Array | None) -> tuple[PyTree, PyTree, PyTree]:
    """The whole view's update (a transformation that couples elements,
    :mod:`jzero.sharding.opt_layout`): the host-memory state and masters brought to the
    device, the device's update, the results back where they are stored -- one group."""
    opt, plan = self.opt, self.plan
    state_host = [_in_host_memory(opt.leaf_kind(l)) for l in opt.leaves]
    master_host = plan.flat(self.master_on_host)
    moved = lambda xs, flags, move: [move(x) if f else x for x, f in zip(xs, flags)]
    state = jax.tree.unflatten(opt.treedef, moved(opt.treedef.flatten_up_to(opt_state),
                                                  state_host, to_device))
    master = jax.tree.unflatten(jax.tree.structure(grads),
                                moved(plan.flat(master), master_host, to_device))
    new_master, on_device, new_state = super().apply(grads, state, master, keep)
    new_state = jax.tree.unflatten(opt.treedef, moved(opt.treedef.flatten_up_to(new_state),
                                                      state_host, to_host))
    stored = jax.tree.unflatten(jax.tree.structure(grads),
                                moved(plan.flat(new_master), master_host, to_host))
    return stored, on_device, new_state

  def unchanged(self, params: PyTree, master: PyTree,
                opt_state: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    plan = self.plan
    if self.opt.view is View.WHOLE:
      state_host = [_in_host_memory(self.opt.leaf_kind(l)) for l in self.opt.leaves]
      leaves = self.opt.treedef.flatten_up_to(opt_state)
      opt_state = jax.tree.unflatten(self.opt.treedef, [
          to_host(x) if h else x for x, h in zip(leaves, state_host)])
      if plan.has_master:
        master = plan.map(lambda l, m, h: to_host(m) if h else m, master, self.master_on_host)
      params = plan.map(lambda l, p: to_host(p) if where.param_in_host_memory(plan, l) else p,
                        params)
      return params, master, opt_state
    master, opt_state = keep_tiers(opt_state, master, self.state_on_host,
                                   master_on_host=plan.has_master)
    params = plan.map(lambda l, p: to_host(p) if where.param_in_host_memory(plan, l) else p,
                      params)
    return params, master, opt_state

  def store(self, params: PyTree, master: PyTree) -> PyTree:
    plan = self.plan
    # fp32 training: the new param of a param in host memory is the master, already back there --
    # unless a tier holds the leaf's state (its master is a placeholder here: the tier's update
    # writes the new param after the step)
    def stored(l, p, m):
      if not where.param_in_host_memory(plan, l):
        return p
      return m if not plan.has_master and l.path not in self.held.state else to_host(p)
    return plan.map(stored, params, master)
