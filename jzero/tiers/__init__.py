"""Where model state lives besides the device: the tiers (see :mod:`jzero.tiers.registry`)."""

__all__: list[str] = []
