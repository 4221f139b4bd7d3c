"""Where model state lives besides device memory and how its update runs (the tiers), and when
the update applies (the delayed update).

* :mod:`jzero.tiers.base` -- :class:`~jzero.tiers.base.Tier`, a tier's hooks (class methods that
  take the plan, the config and the tier's resource explicitly); :class:`~jzero.tiers.base.Update`,
  one optax-shaped link of the step's update (``init`` / ``update`` / ``after``);
  :data:`~jzero.tiers.base.Resources`, what the tiers own at run time, by name.
* :mod:`jzero.tiers.registry` -- ``TIERS``, the tiers in the order their hooks run, and what the rest
  of jzero asks of all of them (the update chain, the accepted config values, the resources).
* :mod:`jzero.tiers.updates` -- the update's links that are no tier's: the device's optax update,
  the non-finite skip, the clipping; placeholders of what a tier keeps outside the state.
* :mod:`jzero.tiers.host_optimizer` -- ZeRO-Offload: master and optimizer state in host memory,
  updated streaming through the device or on the host.
* :mod:`jzero.tiers.host_adam` -- Adam / AdamW on host numpy arrays, in place, over the cores
  (DeepSpeed's CPU Adam; its numba loops :mod:`jzero.tiers.host_adam_kernel`); not yet called by
  the step.
* :mod:`jzero.tiers.host_params` -- stage-3 parameter partitions in host memory.
* :mod:`jzero.tiers.nvme` -- ZeRO-Infinity's NVMe tier; its store :mod:`jzero.tiers.nvme_store`,
  parameter reads :mod:`jzero.tiers.nvme_params`, settings :mod:`jzero.tiers.nvme_settings`, the
  store's contents outside a step :mod:`jzero.tiers.nvme_state`, its run directories on disk (who
  owns each, the stale ones, a failed write's message) :mod:`jzero.tiers.nvme_runs`.
* :mod:`jzero.tiers.delayed` -- ZeRO-Offload's delayed parameter update: not a tier, a link of the
  update with its own carried state.
* :mod:`jzero.tiers.where` -- what the built-in tiers' names in the plan mean.

A new tier: a module with a ``Tier`` subclass and one line -- in ``registry.TIERS``, or
``registry.register(MyTier)`` from outside the package -- plus its config block's fields in
:mod:`jzero.config.blocks` if it reads keys of its own (docs/architecture.md, "Where do I add
...").
"""

__all__: list[str] = []
