"""Where model state lives besides device memory and how its update runs (the tiers), and when
the update applies (the delayed update).

* :mod:`jzero.tiers.base` -- :class:`~jzero.tiers.base.Tier`, the hooks the step and the engine
  call; :class:`~jzero.tiers.base.Update`, how the optimizer update runs, which a tier wraps; and
  :class:`~jzero.tiers.base.EngineView`, what a tier may read from the engine.
* :mod:`jzero.tiers.registry` -- ``TIERS``, the tiers in the order their hooks run and their
  updates wrap.
* :mod:`jzero.tiers.host_optimizer` -- ZeRO-Offload: master and optimizer state in host memory,
  updated streaming through the device or on the host.
* :mod:`jzero.tiers.host_params` -- stage-3 parameter partitions in host memory.
* :mod:`jzero.tiers.nvme` -- ZeRO-Infinity's NVMe tier; its store :mod:`jzero.tiers.nvme_store`,
  parameter reads :mod:`jzero.tiers.nvme_params`, settings :mod:`jzero.tiers.nvme_settings`, the
  store's contents outside a step :mod:`jzero.tiers.nvme_state`.
* :mod:`jzero.tiers.delayed` -- ZeRO-Offload's delayed parameter update: not a tier, a
  transformation of the step's gradient with its own carried state.

A new tier: a module here with a ``Tier`` subclass, one line in ``registry.TIERS``, its config
block's fields in :mod:`jzero.config.blocks` (docs/architecture.md, "Where do I add ...").
"""

__all__: list[str] = []
