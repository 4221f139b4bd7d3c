"""Memory you can see: per-device bytes of the train state, measured from the live arrays.

``state_report`` reads, for one device, the bytes of every shard that device holds of the compute
params, the fp32 master and the optimizer state (``arr.addressable_shards``), by memory kind; the
gradient buffer, which lives only inside the compiled step, is counted from the plan (its layout
times the compute dtype), as ZeRO's accounting does.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["live_bytes", "state_report", "format_state_report"]


def live_bytes(tree: Any, device: jax.Device | None = None) -> dict[str, int]:
  """Bytes of the shards of ``tree``'s arrays that live on ``device``, by memory kind.

  Args:
    tree: a pytree of ``jax.Array`` (other leaves are ignored).
    device: the device to count (default: the first device of the first array).
  """
  out: dict[str, int] = collections.defaultdict(int)
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array):
      continue
    device = device or x.addressable_shards[0].device
    for shard in x.addressable_shards:
      if shard.device == device:
        out[x.sharding.memory_kind or "device"] += shard.data.nbytes
  return dict(out)


def state_report(engine: Any, state: Any) -> dict[str, dict[str, int]]:
  """Per-device bytes of params / grads / master / optimizer state for one device of ``engine``."""
  plan = engine.plan
  device = engine.mesh.mesh.devices.flat[0]
  itemsize = jnp.dtype(plan.compute_dtype).itemsize
  grads = sum(plan.local_numel(l, l.grad_partitioned) for l in plan.leaf_list()) * itemsize
  return {
      "params": live_bytes(state.params, device),
      "grads": {"device": grads},
      "master": live_bytes(state.master, device),
      "optimizer": live_bytes(state.opt_state, device),
  }


def format_state_report(report: dict[str, dict[str, int]]) -> str:
  """A small table of :func:`state_report`."""
  lines = ["per-device bytes (device 0):"]
  total = 0
  for name, kinds in report.items():
    n = sum(kinds.values())
    total += n
    where = ", ".join(f"{k}" for k in kinds) or "-"
    lines.append(f"  {name:<10} {n / 2**20:10.3f} MiB  ({where})")
  lines.append(f"  {'total':<10} {total / 2**20:10.3f} MiB")
  return "\n".join(lines)
