"""The default job's data: real text as bytes, no download.

The embedded corpus is the Python standard library's own source (the ``.py`` files of the running
interpreter's ``stdlib``, read in sorted order), about 8 MB of real, varied text that every machine
with Python has. Any text file or directory can be given instead.

Tokens are bytes (vocabulary 256). The last ``val_fraction`` of the corpus is held out. A batch for
optimizer step ``s`` is a pure function of ``(seed, s)``: windows at offsets drawn from
``numpy.random.default_rng((seed, s))``. So a run resumed at step ``s`` sees exactly the batches
the uninterrupted run would have seen, and the data position to save is just the step.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from jzero.errors import DataError

__all__ = ["ByteCorpus", "stdlib_files"]

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

  def batch(self, step: int, batch_size: int, *, seed: int = 0, split: str = "train") -> dict:
    """``{"tokens": int32[batch_size, seq_len + 1]}`` for optimizer step ``step``."""
    lo, hi = self._splits[split]
    rng = np.random.default_rng((seed, step, 0 if split == "train" else 1))
    starts = rng.integers(lo, hi - self.seq_len - 1, size=batch_size)
    idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
    return {"tokens": self.tokens[idx].astype(np.int32)}
