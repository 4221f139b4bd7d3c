"""Moving one leaf between the plan's layouts, inside the step's ``shard_map`` (one device's
blocks): the fp32 master partition of a replicated param (:func:`local_master`), the compute param
from an updated master partition (:func:`compute_param`), and ZeRO++ hpZ's secondary partition
from the primary one (:func:`secondary_partition`, and the jitted refresh of a whole state's,
:func:`refresh_program`). The step, the tiers that update state outside the device
(:mod:`jzero.tiers.nvme_store`) and the engine's hpZ refresh all call these, so each layout change
has one home.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from jzero.comm import collectives, program, zeropp
from jzero.sharding.plan import LeafPlan, Plan

__all__ = ["compute_param", "local_master", "secondary_partition", "refresh_program"]


def local_master(plan: Plan, leaf: LeafPlan, p: jax.Array) -> jax.Array:
  """fp32 training: this device's partition of a param, as the optimizer's master."""
  if leaf.state_partitioned and not leaf.param_partitioned:
    return collectives.local_slice(p, leaf.shard_dim, leaf.padded, plan.mesh.zero_axes)
  return p


def compute_param(plan: Plan, leaf: LeafPlan, m: jax.Array) -> jax.Array:
  """Updated master partition -> compute param in the param layout (stage 1/2: cast, then
  all-gathered in the compute dtype, as DeepSpeed gathers its 16-bit partitions).

  A stacked leaf is gathered one layer at a time (a scan writing each gathered layer into the
  output), so the step never holds a second full copy of the stack: gathered whole, XLA's GPU
  compiler issues every stack's gather at once and transposes each result into the output layout
  (the 7B shape's stage-1/2 peak was those copies, 26 GB per device)."""
  m = m.astype(plan.compute_dtype)
  if not leaf.state_partitioned or leaf.param_partitioned:
    return m
  gather = functools.partial(collectives.all_gather, dim=leaf.shard_dim,
                             size=leaf.shape[leaf.shard_dim], axes=plan.mesh.zero_axes)
  if leaf.stacked:
    return lax.map(gather, m)
  return gather(m)


def secondary_partition(plan: Plan, leaf: LeafPlan, p: jax.Array) -> jax.Array | None:
  """hpZ: a device's secondary partition of one leaf from its primary partition (None for a leaf
  without one)."""
  if not leaf.secondary:
    return None
  return zeropp.refresh_secondary(p, leaf.shard_dim, plan.comm(leaf), int(leaf.stacked))


def refresh_program(plan: Plan):
  """``params -> secondary``: hpZ's secondary partitions of a whole params tree, jitted with the
  plan's shardings, by the code the step refreshes them with (so init, restore, a running step and
  the NVMe store's update agree bit for bit). No compile options: a plain program. Callers keep
  the program (one per plan)."""
  specs, out = plan.param_specs(), plan.secondary_specs()
  body = lambda p: plan.map(lambda l, x: secondary_partition(plan, l, x), p)
  return jax.jit(program.shard_map(plan, body, (specs,), out),
                 in_shardings=(plan.shardings(specs),), out_shardings=plan.shardings(out))
