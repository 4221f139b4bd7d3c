"""jzero.train.loop: the resumable loop of ``jzero train`` from Python -- a run stopped half-way
and resumed from its checkpoint gives the losses and parameters of the straight run, bit for bit."""

from __future__ import annotations

import io
import sys
import types

import jax
import numpy as np
import pytest

from jzero import checkpoint
from jzero.errors import JZeroError
from jzero.train.loop import init_or_resume, train_loop
from zero_testing import SMALL, batches, make_engine

N = 8
STEPS = 4


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_resumed_loop_equals_the_straight_one(tmp_path, capsys, monkeypatch):
  """... and the progress bar is drawn on a terminal or in a notebook only: into a log file tqdm
  wrote two lines a step."""
  data = batches(SMALL.seq_len, N, STEPS)
  engine = make_engine(3)
  batch_at = lambda step: engine.shard_batch(data[step])
  with pytest.raises(JZeroError, match="no checkpoint"):
    init_or_resume(engine, jax.random.key(0), tmp_path / "none", require=True)

  state, start = init_or_resume(engine, jax.random.key(0), tmp_path / "straight")
  straight = train_loop(engine, state, batch_at, STEPS, start=start)  # stderr: not a terminal
  assert "train" not in capsys.readouterr().err
  assert start == 0 and len(straight.losses) == STEPS and not straight.preempted
  assert straight.losses[-1] < straight.losses[0]

  seen = []
  state, start = init_or_resume(engine, jax.random.key(0), tmp_path / "ckpt")
  kernel = types.SimpleNamespace(config={"IPKernelApp": {}})  # what a Jupyter kernel's IPython has
  monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
  first = train_loop(engine, state, batch_at, STEPS // 2, start=start,
                     checkpoint_dir=tmp_path / "ckpt", losses_file=tmp_path / "losses.txt",
                     save_every=1, keep=3, on_step=lambda step, metrics: seen.append(step))
  monkeypatch.delitem(sys.modules, "IPython")
  assert "train: 100%" in capsys.readouterr().err  # a notebook's output: the bar is drawn
  assert seen == [1, 2] and first.exit_status == 0
  assert checkpoint.all_tags(tmp_path / "ckpt") == ["1", "2"]  # keep=3 kept both
  state, start = init_or_resume(engine, jax.random.key(0), tmp_path / "ckpt")
  assert start == STEPS // 2
  terminal = _Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  second = train_loop(engine, state, batch_at, STEPS, start=start,
                      checkpoint_dir=tmp_path / "ckpt", losses_file=tmp_path / "losses.txt",
                      save_every=1, keep=3)
  assert checkpoint.all_tags(tmp_path / "ckpt") == ["2", "3", "4"]  # the newest 3 of both runs
  assert first.losses + second.losses == straight.losses
  assert "train: 100%" in terminal.getvalue() and f"{STEPS}/{STEPS}" in terminal.getvalue()
  lines = (tmp_path / "losses.txt").read_text().split("\n")[:-1]
  assert [float(line.split()[1]) for line in lines] == straight.losses
  for a, b in zip(jax.tree.leaves(engine.logical_params(second.state)),
                  jax.tree.leaves(engine.logical_params(straight.state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
