"""What the config asks of the NVMe tiers (ZeRO-Infinity), read and checked before any device work.

``zero_optimization.offload_optimizer`` and ``offload_param`` with ``device: nvme`` share one
store per process (:mod:`jzero.tiers.nvme_store`; parameters: :mod:`jzero.tiers.nvme_params`). This
module turns their blocks and ``aio`` into :class:`NvmeSettings`, checks ``nvme_path`` (a directory
this process can write and fsync in; a :class:`~jzero.errors.ConfigError` naming the key and the fix
otherwise), and maps the settings to tensorstore's context (:func:`io_context`). A missing
``nvme_path`` whose parent exists is created, with a warning, as DeepSpeed creates its swap folders
under it; a missing parent is an error (a drive not mounted, a misspelled path).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

from jzero.config.messages import user_stacklevel
from jzero.disk import write_probe_error
from jzero.errors import ConfigError, JZeroWarning

__all__ = ["NVME", "NvmeSettings", "settings_from_config", "check_directory", "IO_MODE",
           "io_context"]

NVME = "nvme"
_KEY = "zero_optimization.offload_optimizer.nvme_path"


@dataclasses.dataclass(frozen=True)
class NvmeSettings:
  """What the config asks of the NVMe tier (read once, before any device work)."""

  path: Path
  buffer_count: int = 4
  pipeline_read: bool = False
  pipeline_write: bool = False
  sub_group_size: int = 1_000_000_000
  queue_depth: int = 8
  intra_op_parallelism: int = 1
  # parameters on the tier (offload_param.device: nvme, jzero.tiers.nvme_params)
  params: bool = False
  param_buffer_count: int = 5
  param_buffer_size: int = 100_000_000
  max_in_cpu: int = 1_000_000_000
  prefetch: bool = True
  key: str = "zero_optimization.offload_optimizer.nvme_path"


#: tensorstore's ``file_io_mode`` for the store's files (bench/nvme.py measures the modes side by
#: side; docs/benchmarks.md).
IO_MODE = "default"


def io_context(settings: NvmeSettings, io_mode: str = IO_MODE) -> dict:
  """The tensorstore context of the store's I/O: concurrency from ``aio``, no cache (every read
  goes to the disk, nothing is held twice in host memory), fsync'ed writes."""
  return {"file_io_concurrency": {"limit": settings.queue_depth},
          "data_copy_concurrency": {"limit": settings.intra_op_parallelism},
          "cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True,
          "file_io_mode": {"mode": io_mode}}


def _int(value: Any, default: int) -> int:
  return default if value == "auto" else int(value)


def check_directory(path: str | os.PathLike, key: str = _KEY) -> Path:
  """``path`` as an absolute directory jzero can write and fsync in, created (with a warning) when
  only its last component is missing; ConfigError (naming the config ``key``) otherwise -- also for a
  path holding a backslash, which tensorstore would read as a separator."""
  path = Path(path).expanduser().absolute()
  if "\\" in str(path):  # tensorstore's file kvstore reads it as a separator
    raise ConfigError(f"{key}={path}: the path holds a backslash, which tensorstore reads as a "
                      f"path separator (the store's files would land in "
                      f"{str(path).replace(chr(92), '/')}); choose a directory without '\\'.")
  if not path.exists():
    if not path.parent.is_dir():
      raise ConfigError(f"{key}={path}: no such directory. Create it (mkdir -p {path}), ideally on "
                        f"a local NVMe drive, or point nvme_path at an existing directory; jzero "
                        f"creates nvme_path itself only when its parent exists, and "
                        f"{path.parent} does not.")
    try:
      path.mkdir(exist_ok=True)  # other processes of the job may create it at the same time
    except OSError as e:
      raise ConfigError(f"{key}={path}: no such directory, and jzero cannot create it "
                        f"({e.strerror or e}). Create it (mkdir -p {path}) or point nvme_path at "
                        f"a writable directory.") from None
    warnings.warn(f"{key}={path} did not exist: jzero created it, as DeepSpeed creates its swap "
                  f"folders under nvme_path. Check that it is on the NVMe drive you meant.",
                  JZeroWarning, stacklevel=user_stacklevel())
  if not path.is_dir():
    raise ConfigError(f"{key}={path} is not a directory; point nvme_path at a directory on the "
                      f"NVMe drive.")
  error = write_probe_error(path)
  if error is not None:
    raise ConfigError(f"{key}={path} is not writable ({error.strerror or error}): jzero keeps the "
                      f"NVMe tier there. Make it writable for this user (chmod / chown, or "
                      f"remount it read-write) or point nvme_path at a writable directory.")
  return path


def settings_from_config(config: Any, *, client_optimizer: bool = False) -> NvmeSettings | None:
  """The NVMe settings of a resolved config (None when neither ``offload_optimizer`` nor
  ``offload_param`` has ``device: nvme``); checks the path.

  One store holds both: with both blocks on NVMe it lives at ``offload_optimizer.nvme_path``.

  Raises:
    ConfigError: no ``nvme_path``, a path that is not a writable directory, a client optimizer,
      or a non-positive count.
  """
  zero = config.zero_optimization
  block, param_block = zero.offload_optimizer, zero.offload_param
  on_nvme = block is not None and block.device == NVME
  params = param_block is not None and param_block.device == NVME
  if not on_nvme and not params:
    return None
  owner = "offload_optimizer" if on_nvme else "offload_param"
  key = f"zero_optimization.{owner}.nvme_path"
  path = (block if on_nvme else param_block).nvme_path
  if not path:
    raise ConfigError(f"zero_optimization.{owner}.device=nvme needs {key}: the directory (on an "
                      f"NVMe drive) where the {'optimizer state' if on_nvme else 'parameters'} "
                      f'are kept. Add "nvme_path": "/local_nvme" to {owner}, or use device: cpu.')
  if client_optimizer:
    raise ConfigError(f"zero_optimization.{owner}.device=nvme updates the state in "
                      "sub-groups of leaves, which needs the config's elementwise optimizer "
                      "(Adam, AdamW, Lion, SGD); a client optax optimizer "
                      "(initialize(optimizer=...)) may couple leaves. Use the config's optimizer "
                      "block, or device: cpu.")
  path = check_directory(path, key)
  aio = config.aio
  buffers = _int(block.buffer_count, 4) if on_nvme else 4
  if buffers < 1:
    raise ConfigError(f"zero_optimization.offload_optimizer.buffer_count={buffers}: give at least "
                      f"1 (groups of the optimizer state in flight at once).")
  sub_group = _int(zero.sub_group_size, 1_000_000_000)
  if sub_group < 1:
    raise ConfigError(f"zero_optimization.sub_group_size={sub_group}: give a positive number of "
                      f"elements per optimizer sub-group.")
  extra = {}
  if params:
    extra = dict(params=True, param_buffer_count=_int(param_block.buffer_count, 5),
                 param_buffer_size=_int(param_block.buffer_size, 100_000_000),
                 max_in_cpu=_int(param_block.max_in_cpu, 1_000_000_000),
                 prefetch=_int(zero.prefetch_bucket_size, 1) > 0)
    for name in ("buffer_count", "buffer_size"):
      if extra[f"param_{name}"] < 1:
        raise ConfigError(f"zero_optimization.offload_param.{name}={extra[f'param_{name}']}: give "
                          f"a positive number (staging buffers between the NVMe tier and the "
                          f"device, and elements per buffer).")
    if extra["max_in_cpu"] < 0:
      raise ConfigError(f"zero_optimization.offload_param.max_in_cpu={extra['max_in_cpu']}: give "
                        f"0 or more parameter elements to keep in host memory.")
    if on_nvme and param_block.nvme_path and (
        Path(param_block.nvme_path).expanduser().absolute() != path):
      warnings.warn(
          f"zero_optimization.offload_param.nvme_path={param_block.nvme_path} differs from "
          f"offload_optimizer.nvme_path={block.nvme_path}: jzero keeps one store per process, "
          f"at offload_optimizer.nvme_path ({path}), for both.", JZeroWarning,
          stacklevel=user_stacklevel())
  # the optimizer block's pipeline flags; for a store that only the parameter tier asks for,
  # reads, updates and writes always overlap (DeepSpeed's parameter swapper is asynchronous too)
  return NvmeSettings(path=path, buffer_count=buffers,
                      pipeline_read=block.pipeline_read is True if on_nvme else True,
                      pipeline_write=block.pipeline_write is True if on_nvme else True,
                      sub_group_size=sub_group,
                      queue_depth=max(1, int(aio.queue_depth)),
                      intra_op_parallelism=max(1, int(aio.intra_op_parallelism)), key=key,
                      **extra)
