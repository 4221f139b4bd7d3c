"""jzero's version: written into every checkpoint's metadata and reported by ``jzero.__version__``."""

__all__ = ["__version__"]

__version__ = "0.1.0"
