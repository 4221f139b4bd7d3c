"""The default job's data: real text as bytes, no download.

The embedded corpus is the Python standard library's own source (the ``.py`` files of the running
interpreter's ``stdlib``, read in sorted order), about 8 MB of real, varied text that every machine
with Python has. Any text file or directory can be given instead.

Tokens are bytes (vocabulary 256). The last ``val_fraction`` of the corpus is held out. A batch for
optimizer step ``s`` is a pure function of ``(seed, s)``: windows at offsets drawn from
``numpy.random.default_rng((seed, s))``. So a run resumed at step ``s`` sees exactly the batches
the uninterrupted run would have seen, and the data position to save is just the step.

:class:`DataLoader` does the same for a user's own indexable dataset: it is what
``jzero.initialize(..., training_data=dataset)`` puts in ``engine.training_dataloader`` (DeepSpeed's
``training_data`` argument), yielding global batches already placed on the mesh.
:class:`ArrayDataset` is such a dataset read from a ``.npz`` / ``.npy`` file (``jzero train
--data``): named arrays with one row per sample.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jzero.errors import DataError

__all__ = ["ArrayDataset", "ByteCorpus", "DataLoader", "local_rows", "stdlib_files"]

DEFAULT_MAX_BYTES = 8 << 20


def stdlib_files() -> list[Path]:
  """The standard library's ``.py`` files (tests and third-party packages left out), sorted."""
  root = Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
  files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read(files: list[Path], max_bytes: int) -> np.ndarray:
  chunks, total = [], 0
  for f in files:
    if total >= max_bytes:
      break
    data = f.read_bytes()[: max_bytes - total]
    chunks.append(data)
    total += len(data)
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def local_rows(sharding: Any, batch_size: int) -> np.ndarray:
  """Rows of a global batch of ``batch_size`` that this process's devices hold under
  ``sharding`` (ascending): every row in a single process."""
  index_map = sharding.addressable_devices_indices_map((batch_size,))
  rows = set()
  for index in index_map.values():
    rows.update(range(batch_size)[index[0]] if index else range(batch_size))
  return np.array(sorted(rows))


class ByteCorpus:
  """A byte corpus split into train / validation, with deterministic per-step batches."""

  def __init__(self, tokens: np.ndarray, *, seq_len: int, val_fraction: float = 0.05,
               source: str = "<array>"):
    self.tokens = np.asarray(tokens, dtype=np.uint8)
    self.seq_len = seq_len
    self.source = source
    split = int(len(self.tokens) * (1 - val_fraction))
    self._splits = {"train": (0, split), "val": (split, len(self.tokens))}
    for name, (lo, hi) in self._splits.items():
      if hi - lo < seq_len + 2:
        raise DataError(f"{source}: the {name} split has {hi - lo} bytes, fewer than one sequence "
                        f"of {seq_len + 1} tokens. Give more text or a smaller sequence length.")

  @classmethod
  def load(cls, path: str | os.PathLike[str] | None = None, *, seq_len: int,
           max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05) -> ByteCorpus:
    """Reads ``path`` (a file, or every file under a directory, sorted), or the stdlib source."""
    if path is None:
      files, source = stdlib_files(), "the Python standard library source"
    else:
      p = Path(path)
      if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist; give a text file or a directory of "
                        f"text files, or leave --data out to train on the Python standard library.")
      files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
      source = str(p)
    tokens = _read(files, max_bytes)
    return cls(tokens, seq_len=seq_len, val_fraction=val_fraction, source=source)

  def __len__(self) -> int:
    return len(self.tokens)

  def batch(self, step: int, batch_size: int, *, seed: int = 0, split: str = "train",
            rows: np.ndarray | None = None) -> dict:
    """``{"tokens": int32[batch_size, seq_len + 1]}`` for optimizer step ``step``.

    ``rows`` (e.g. ``engine.local_rows()``): only those rows of the global batch, in that order --
    each process of a multi-process job reads its own part, ``engine.shard_batch`` assembles them.
    """
    lo, hi = self._splits[split]
    rng = np.random.default_rng((seed, step, 0 if split == "train" else 1))
    starts = rng.integers(lo, hi - self.seq_len - 1, size=batch_size)
    if rows is not None:
      starts = starts[np.asarray(rows)]
    idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
    return {"tokens": self.tokens[idx].astype(np.int32)}


class ArrayDataset:
  """Samples from named arrays of one row per sample: ``dataset[i] = {name: array[i]}``.

  :meth:`load` reads a ``.npz`` file (each array a batch key, e.g. ``x`` and ``y``) or a ``.npy``
  file (one array, the key ``tokens``: e.g. int32 token sequences [N, T + 1] for a language
  model). Arrays only: object arrays (pickles) are refused.
  """

  def __init__(self, arrays: dict[str, np.ndarray], *, source: str = "<arrays>"):
    if not arrays:
      raise DataError(f"{source} holds no arrays; give one array per batch key, one row per "
                      f"sample (np.savez(path, x=..., y=...)).")
    rows = {name: np.shape(x)[0] if np.ndim(x) else None for name, x in arrays.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
      raise DataError(f"{source}: every array needs one row per sample, the same number in each; "
                      f"got rows {rows} (a 0-d array has none).")
    self.arrays, self.source = arrays, source

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> ArrayDataset:
    """The arrays of a ``.npz`` or ``.npy`` file (a ``.npy`` is memory-mapped)."""
    p = Path(path)
    if not p.is_file():
      raise DataError(f"data file {str(p)!r} does not exist; give a .npz of named arrays or a "
                      f".npy of token sequences, one row per sample.")
    try:
      if p.suffix == ".npy":
        arrays = {"tokens": np.load(p, mmap_mode="r")}
      else:
        with np.load(p) as npz:
          arrays = {name: npz[name] for name in npz.files}
    except (ValueError, OSError) as e:
      raise DataError(f"{p} cannot be read as numpy arrays ({e}); write it with np.save / "
                      f"np.savez, without object arrays.") from None
    return cls(arrays, source=str(p))

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {name: np.asarray(x[index]) for name, x in self.arrays.items()}


class DataLoader:
  """Global batches of an indexable dataset, placed on the mesh (``engine.training_dataloader``).

  What ``jzero.initialize(..., training_data=dataset)`` builds, as DeepSpeed's ``initialize`` builds
  a DataLoader from ``training_data``. ``dataset[i]`` is one sample -- a numpy array, or a dict /
  tuple of them -- and ``len(dataset)`` the number of samples. An epoch is a permutation of the
  samples drawn from ``numpy.random.default_rng((seed, epoch))`` (in order with ``shuffle=False``),
  cut into batches of ``batch_size`` samples; the last incomplete batch is dropped, so every step
  has the shape the step was compiled for.

  Batches are a pure function of the optimizer step: step ``s`` reads batch ``s % len(loader)`` of
  epoch ``s // len(loader)``. ``for batch in loader`` runs one epoch (the next one each time it is
  iterated, as a DistributedSampler with ``set_epoch`` does); ``loader.batches(start)`` runs from
  optimizer step ``start`` on, forever -- resume with ``loader.batches(int(state.step))`` and the
  run reads exactly the batches the uninterrupted one would have.

  With several processes each process reads only the samples of the rows its devices hold and the
  global array is assembled with ``jax.make_array_from_process_local_data``.
  """

  def __init__(self, dataset: Any, batch_size: int, sharding: Any, *, shuffle: bool = True,
               seed: int = 0):
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
      raise DataError(f"training_data must be an indexable dataset (len(dataset) and "
                      f"dataset[i]), got {type(dataset).__name__}.")
    if len(dataset) < batch_size:
      raise DataError(f"training_data has {len(dataset)} samples, fewer than one global batch of "
                      f"train_batch_size = {batch_size}. Give more data or a smaller batch.")
    self.dataset, self.batch_size, self.sharding = dataset, batch_size, sharding
    self.shuffle, self.seed = shuffle, seed
    self.epoch = 0
    self._rows = self._local_rows()
    self.check: Callable[[Any], None] | None = None  # the engine's host-batch check

  def __len__(self) -> int:
    """Batches per epoch."""
    return len(self.dataset) // self.batch_size

  def _local_rows(self) -> np.ndarray:
    return local_rows(self.sharding, self.batch_size)

  def indices(self, step: int) -> np.ndarray:
    """The dataset indices of the global batch of optimizer step ``step``."""
    epoch, position = divmod(step, len(self))
    order = (np.random.default_rng((self.seed, epoch)).permutation(len(self.dataset))
             if self.shuffle else np.arange(len(self.dataset)))
    return order[position * self.batch_size:(position + 1) * self.batch_size]

  def host_batch(self, step: int, rows: np.ndarray | None = None) -> Any:
    """The samples of step ``step`` (only ``rows`` of the global batch, default all) stacked as
    numpy arrays."""
    picked = self.indices(step)
    picked = picked if rows is None else picked[rows]
    samples = [self.dataset[int(i)] for i in picked]
    try:
      return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *samples)
    except (ValueError, TypeError) as e:
      raise DataError(f"training_data samples {picked[:4].tolist()}... cannot be stacked into a "
                      f"batch (every sample needs the same structure and shapes): {e}") from None

  def batch(self, step: int) -> Any:
    """The global batch of optimizer step ``step``, placed on the mesh."""
    local = self.host_batch(step, self._rows)
    if self.check is not None:
      self.check(local)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            self.sharding, x, (self.batch_size,) + x.shape[1:]), local)

  def batches(self, start: int = 0) -> Iterator[Any]:
    """Placed global batches for optimizer steps ``start``, ``start + 1``, ... (endless)."""
    step = start
    while True:
      yield self.batch(step)
      step += 1

  def __iter__(self) -> Iterator[Any]:
    epoch, self.epoch = self.epoch, self.epoch + 1
    for position in range(len(self)):
      yield self.batch(epoch * len(self) + position)
