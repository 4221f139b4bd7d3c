"""torch's ``.pt`` files read without torch and without running code from them.

A ``.pt`` file (``torch.save``, format of torch >= 1.6) is a zip archive: ``<name>/data.pkl``, a
pickle of the saved object, and one member ``<name>/data/<key>`` per storage holding its raw
bytes. The pickle names the storages through persistent ids ``("storage", torch.FloatStorage,
key, location, numel)`` and rebuilds tensors with ``torch._utils._rebuild_tensor_v2(storage,
offset, size, stride, ...)``.

:func:`load_pt` unpickles with an allow-list (:meth:`pickle.Unpickler.find_class` is the only door
through which a pickle reaches a Python global): plain containers, the tensor rebuild functions,
the typed storages and the few value objects DeepSpeed pickles (``LossScaler``,
``DynamicLossScaler``, ``ZeroStageEnum``, ``fragment_address``). Any other global -- ``os.system``
in a crafted file -- is refused by name before anything is called. Tensors come back as read-only
numpy arrays (bf16 through ``ml_dtypes``) that view a memory map of the file: nothing is read
until a tensor's values are used, so a caller gathers one parameter at a time from files larger
than host memory. DeepSpeed's value objects come back as :class:`DeepSpeedValue` records of their
attributes; ``ZeroStageEnum`` as its int.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jzero.errors import CheckpointError

__all__ = ["DeepSpeedValue", "load_pt"]

_STORAGE_DTYPES = {
    "FloatStorage": np.dtype("<f4"), "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype("<i8"), "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"), "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"), "BoolStorage": np.dtype("?"), "UntypedStorage": np.dtype("u1"),
}
_ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra length


@dataclasses.dataclass
class DeepSpeedValue:
  """One of DeepSpeed's pickled value objects, as data: its class and its attributes.

  Attributes:
    type_name: the class's qualified name, e.g. ``deepspeed.runtime.fp16.loss_scaler.LossScaler``.
    attributes: the object's ``__dict__`` as pickled (e.g. ``{"cur_scale": 1.0, ...}``).
  """

  type_name: str = ""
  attributes: dict = dataclasses.field(default_factory=dict)

  def __setstate__(self, state: Any) -> None:  # pickle's BUILD
    if not isinstance(state, dict):
      raise pickle.UnpicklingError(f"{self.type_name}: expected a dict of attributes")
    self.attributes = dict(state)


def _value_class(qualified: str) -> type:
  """A class pickle's NEWOBJ can instantiate (``cls.__new__(cls)``) standing for ``qualified``."""
  return type(qualified.rsplit(".", 1)[1], (DeepSpeedValue,), {"type_name": qualified})


@dataclasses.dataclass(frozen=True)
class _StorageType:
  """``torch.FloatStorage`` and its kin, as the dtype of the raw bytes they name."""

  name: str
  dtype: np.dtype


_TENSOR_TYPE = object()  # torch.Tensor: only ever the ``new_type`` of _rebuild_from_type_v2


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None) -> np.ndarray:
  """``torch._utils._rebuild_tensor_v2``: a strided view of ``storage`` (checked in bounds)."""
  if not isinstance(storage, np.ndarray):
    raise pickle.UnpicklingError("a tensor without a storage")
  size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
  offset = int(storage_offset)
  if len(size) != len(stride) or min(size + stride + (offset,), default=0) < 0:
    raise pickle.UnpicklingError(f"a tensor of size {size} and stride {stride}")
  if math.prod(size) == 0:
    return np.empty(size, storage.dtype)
  last = offset + sum((n - 1) * s for n, s in zip(size, stride))
  if last >= storage.size:
    raise pickle.UnpicklingError(f"a tensor of size {size}, stride {stride} at offset {offset} "
                                 f"reaches past its storage of {storage.size} elements")
  return np.lib.stride_tricks.as_strided(storage[offset:], size,
                                         tuple(s * storage.itemsize for s in stride),
                                         writeable=False)


def _rebuild_from_type_v2(func, new_type, args, state) -> np.ndarray:
  """``torch._tensor._rebuild_from_type_v2`` for a plain ``torch.Tensor`` (the attributes in
  ``state``, e.g. DeepSpeed's ``ds_id``, are dropped)."""
  if func is not _rebuild_tensor_v2 or new_type is not _TENSOR_TYPE:
    raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than a torch.Tensor")
  return func(*args)


def _zero_stage(value) -> int:
  """``deepspeed.runtime.zero.config.ZeroStageEnum(value)``: an IntEnum, read as its int."""
  if value not in (0, 1, 2, 3):
    raise pickle.UnpicklingError(f"ZeroStageEnum({value!r})")
  return int(value)


_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): tuple,
    ("torch", "Tensor"): _TENSOR_TYPE,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    **{("torch", name): _StorageType(name, dtype) for name, dtype in _STORAGE_DTYPES.items()},
    **{tuple(q.rsplit(".", 1)): _value_class(q) for q in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address")},
}


class _Refused(pickle.UnpicklingError):
  """A global outside the allow-list."""


class _Unpickler(pickle.Unpickler):
  """Rebuilds only what :data:`_GLOBALS` allows; storages are views of the archive's members."""

  def __init__(self, data: bytes, storages: Any):
    super().__init__(io.BytesIO(data))
    self._storages = storages
    self._seen: dict[str, np.ndarray] = {}

  def find_class(self, module: str, name: str) -> Any:
    found = _GLOBALS.get((module, name))
    if found is None:
      raise _Refused(f"{module}.{name}")
    return found

  def persistent_load(self, pid: Any) -> np.ndarray:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)):
      raise pickle.UnpicklingError(f"an unknown persistent id {pid!r}")
    _, kind, key, _location, numel = pid
    if str(key) not in self._seen:
      self._seen[str(key)] = self._storages(str(key), kind.dtype, int(numel))
    return self._seen[str(key)]


def _member_views(path: Path, archive: zipfile.ZipFile, prefix: str):
  """``storages(key, dtype, numel)``: the member ``<prefix>data/<key>`` as a numpy array -- a view
  of one memory map of the whole file when stored uncompressed (as torch writes it)."""
  whole = None

  def storage(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
    nonlocal whole
    try:
      info = archive.getinfo(f"{prefix}data/{key}")
    except KeyError:
      raise pickle.UnpicklingError(f"storage {key} is not in the archive") from None
    if info.file_size != numel * dtype.itemsize:
      raise pickle.UnpicklingError(f"storage {key} holds {info.file_size} bytes, not "
                                   f"{numel} x {dtype.itemsize}")
    if numel == 0:
      return np.empty(0, dtype)
    if info.compress_type != zipfile.ZIP_STORED:
      return np.frombuffer(archive.read(info), dtype)
    with open(path, "rb") as f:
      f.seek(info.header_offset)
      signature, name_len, extra_len = _ZIP_LOCAL_HEADER.unpack(f.read(_ZIP_LOCAL_HEADER.size))
    start = info.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len
    if signature != b"PK\x03\x04" or start + info.file_size > path.stat().st_size:
      raise pickle.UnpicklingError(f"storage {key} reaches past the end of the file")
    if whole is None:
      whole = np.memmap(path, np.uint8, mode="r")
    return whole[start:start + info.file_size].view(dtype)

  return storage


def load_pt(path: str | os.PathLike) -> Any:
  """The object a torch ``.pt`` file holds, tensors as read-only numpy arrays (memory-mapped).

  Raises:
    CheckpointError: a missing, truncated or damaged file, a file in torch's legacy (pre-1.6)
      format, or a pickle naming a global outside the allow-list (the message names the global;
      nothing from the file was called).
  """
  path = Path(path)
  if not path.is_file():
    raise CheckpointError(f"{path} does not exist.")
  if not zipfile.is_zipfile(path) and path.read_bytes()[:1] == b"\x80":
    raise CheckpointError(f"{path} is in torch's legacy format (torch < 1.6, a bare pickle); jzero "
                          f"reads the zip format only. Load and re-save it with a recent torch.")
  try:
    with zipfile.ZipFile(path) as archive:
      pickles = [n for n in archive.namelist() if n.endswith("data.pkl")
                 and n.count("/") <= 1]
      if len(pickles) != 1:
        raise CheckpointError(f"{path} is not a torch .pt archive (no single data.pkl in it).")
      prefix = pickles[0][:-len("data.pkl")]
      if f"{prefix}byteorder" in archive.namelist() and \
          archive.read(f"{prefix}byteorder").strip() != b"little":
        raise CheckpointError(f"{path} was written on a big-endian machine; jzero reads "
                              f"little-endian .pt files only. Load and re-save it with torch on "
                              f"a little-endian machine.")
      return _Unpickler(archive.read(pickles[0]), _member_views(path, archive, prefix)).load()
  except _Refused as e:
    raise CheckpointError(
        f"{path}: refused to load the global {e}: jzero reads .pt files without torch and never "
        f"runs code from them, so it rebuilds only tensors, plain containers and DeepSpeed's "
        f"LossScaler, ZeroStageEnum and fragment_address. This file asks for something else; "
        f"if it should be a DeepSpeed checkpoint, it was altered or is not one.") from None
  except (zipfile.BadZipFile, EOFError, OSError, pickle.UnpicklingError, ValueError,
          TypeError, AttributeError, IndexError, KeyError) as e:
    raise CheckpointError(f"{path} is not a readable torch .pt file (truncated or damaged?): "
                          f"{type(e).__name__}: {e}") from None
