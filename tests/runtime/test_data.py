"""The embedded corpus and deterministic per-step batches."""

from __future__ import annotations

import numpy as np
import pytest

from jzero.errors import DataError
from jzero.runtime.data import ArrayDataset, ByteCorpus, stdlib_files


def test_stdlib_corpus_is_real_python_source():
  files = stdlib_files()
  assert len(files) > 100 and all(f.suffix == ".py" for f in files)
  corpus = ByteCorpus.load(None, seq_len=64, max_bytes=1 << 20)
  assert len(corpus) == 1 << 20
  assert b"def " in corpus.tokens[:200_000].tobytes()


def test_batches_are_a_pure_function_of_seed_and_step():
  corpus = ByteCorpus.load(None, seq_len=16, max_bytes=1 << 18)
  a, b = corpus.batch(7, 4, seed=1), corpus.batch(7, 4, seed=1)
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  assert a["tokens"].shape == (4, 17) and a["tokens"].dtype == np.int32
  assert not np.array_equal(corpus.batch(8, 4, seed=1)["tokens"], a["tokens"])
  # train and validation windows come from their own parts of the corpus
  split = int(len(corpus) * 0.95)
  train, val = corpus.tokens[:split].tobytes(), corpus.tokens[split:].tobytes()
  for w in corpus.batch(0, 8, split="val")["tokens"]:
    assert w.astype(np.uint8).tobytes() in val
  for w in corpus.batch(0, 8)["tokens"]:
    assert w.astype(np.uint8).tobytes() in train


def test_text_file_and_errors(tmp_path):
  f = tmp_path / "t.txt"
  f.write_text("hello world " * 100)
  corpus = ByteCorpus.load(f, seq_len=8)
  assert corpus.source == str(f) and len(corpus) == 1200
  with pytest.raises(DataError, match="does not exist"):
    ByteCorpus.load(tmp_path / "missing.txt", seq_len=8)
  tiny = tmp_path / "tiny.txt"
  tiny.write_text("abc")
  with pytest.raises(DataError, match="fewer than one sequence"):
    ByteCorpus.load(tiny, seq_len=8)


def test_array_files_and_their_errors(tmp_path):
  """`jzero train --data`: a .npz gives its named arrays, a .npy the key 'tokens', one row per
  sample; arrays of different row counts, object arrays and missing files are refused."""
  np.savez(tmp_path / "xy.npz", x=np.arange(12.0).reshape(6, 2), y=np.arange(6))
  xy = ArrayDataset.load(tmp_path / "xy.npz")
  assert len(xy) == 6 and xy[4]["x"].tolist() == [8.0, 9.0] and int(xy[4]["y"]) == 4
  np.save(tmp_path / "tokens.npy", np.ones((3, 5), np.int32))
  assert ArrayDataset.load(tmp_path / "tokens.npy")[2]["tokens"].shape == (5,)
  np.savez(tmp_path / "ragged.npz", x=np.zeros((6, 2)), y=np.zeros(5))
  with pytest.raises(DataError, match=r"the same number in each; got rows \{'x': 6, 'y': 5\}"):
    ArrayDataset.load(tmp_path / "ragged.npz")
  np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object))
  with pytest.raises(DataError, match="without object arrays"):
    ArrayDataset.load(tmp_path / "objects.npz")
  with pytest.raises(DataError, match="does not exist"):
    ArrayDataset.load(tmp_path / "missing.npz")
