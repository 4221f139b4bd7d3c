"""A tier and a quantized collective added from outside jzero: one module each plus one registry
line, no library file touched.

``tests/toy_numpy_tier.py`` keeps the optimizer state in numpy on the host
(``offload_optimizer.device: "numpy"``, its own memory column and resource);
``tests/toy_fp8_cast.py`` gathers stage 3's params as fp8 bytes
(``zero_quantized_weights: "fp8"``). The fixture registers both (``registry.register``,
``quantization.register``) and takes them out afterwards. Each then shows up where jzero reads
its registries: the config accepts its value, ``jzero estimate`` and the memory report have the
tier's column, ``jzero plan`` lists candidates with each, the step runs them -- the numpy tier's
run equal to the device's, the fp8 gather's collectives one byte per element -- and a checkpoint
round trip continues each run bit for bit.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jzero import cli
from jzero.analysis.estimate import estimate
from jzero.errors import ConfigError
from jzero.sharding import quantization
from jzero.tiers import registry
from toy_fp8_cast import FP8_CAST
from toy_numpy_tier import NUMPY, NumpyTier
from zero_testing import (SAME_MATH, SMALL, batches, ds_config, make_engine, max_relative_diff)

N, STEPS = 8, 3


@pytest.fixture(scope="module", autouse=True)
def toys():
  registry.register(NumpyTier)
  quantization.register(FP8_CAST)
  yield
  registry.unregister(NumpyTier)
  quantization.unregister(FP8_CAST)


def _train(engine, state, data):
  losses = []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, losses


def _run_and_resume(config, data, tmp_path, save_after: int):
  """Trains a new engine on ``data``, saving a checkpoint after ``save_after`` steps, then
  restores that checkpoint (the state from disk, the tiers' resources taken back from it) and
  trains the rest again; returns (engine, final state, losses, resumed state, resumed losses)."""
  engine = make_engine(config)
  state, losses = _train(engine, engine.init(jax.random.key(0)), data[:save_after])
  engine.save_checkpoint(state, tmp_path)
  engine.wait_for_checkpoints()
  state, rest = _train(engine, state, data[save_after:])
  final = jax.tree.map(np.asarray, engine.full_state(state))
  resumed, resumed_losses = _train(engine, engine.load_checkpoint(tmp_path), data[save_after:])
  return engine, final, losses + rest, resumed, resumed_losses


def _same(a, b) -> None:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def data():
  return batches(SMALL.seq_len, N, STEPS)


@pytest.fixture(scope="module")
def plain(data):
  """Stage 2 on the device: (engine, final state, losses)."""
  engine = make_engine(ds_config(2))
  state, losses = _train(engine, engine.init(jax.random.key(0)), data)
  return engine, state, losses


def test_the_config_and_the_estimator_read_the_registries(capsys):
  with pytest.raises(ConfigError, match="numpy"):  # the tier's own refusal, before device work
    make_engine(ds_config(2, precision="bf16", offload_optimizer={"device": NUMPY}))
  e = estimate(1e9, 2, 8, offload_optimizer=NUMPY)
  assert e.bytes[NUMPY]["optimizer"] == 12e9 / 8 and e.bytes["device"]["optimizer"] == 0
  assert cli.main(["estimate", "--params", "1e9", "--stage", "2",
                   "--offload-optimizer", NUMPY]) == 0
  out = capsys.readouterr().out
  assert "numpy/process" in out and "ZeRO-2 + optimizer->numpy" in out and "1.50 GB" in out


def test_jzero_plan_lists_candidates_with_the_tier_and_the_quantizer(tmp_path):
  report = tmp_path / "plan.json"
  assert cli.main(["plan", "--params", "7e9", "--nodes", "2", "--compile-top", "0", "--all",
                   "--out", str(tmp_path / "config.json"), "--report", str(report)]) == 0
  names = [r["name"] for r in json.loads(report.read_text())["rows"]]
  assert any("opt->numpy" in n for n in names)
  assert any("+qwZ(fp8)" in n for n in names) and any(" +qwZ " in n for n in names)


def test_the_numpy_tier_trains_as_the_device_reports_and_round_trips(data, plain, tmp_path):
  plain, plain_state, plain_losses = plain
  config = ds_config(2, offload_optimizer={"device": NUMPY})
  engine, final, losses, resumed, resumed_losses = _run_and_resume(config, data, tmp_path, 2)
  assert NumpyTier in engine.tiers and {l.state_tier for l in engine.plan.leaf_list()} == {NUMPY}
  store = engine.resources[NUMPY]
  assert store.updates == STEPS + 1  # (and the resumed step)
  # the state holds placeholders; the store the moments, equal to the device run's
  assert all(x.size == 0 for x in jax.tree.leaves(resumed.opt_state) if x.ndim)
  assert max_relative_diff(jax.tree.leaves(final.opt_state),
                           jax.tree.leaves(plain_state.opt_state)) <= SAME_MATH
  assert max_relative_diff(final.params, plain_state.params) <= SAME_MATH
  assert np.max(np.abs(np.array(losses) - plain_losses)) <= SAME_MATH * max(plain_losses)
  # the checkpoint held the store's state: the resumed step is the first run's, bit for bit
  assert resumed_losses == losses[2:]
  _same(engine.full_state(resumed), final)
  # the memory report: the tier's column, measured from its store, predicted by the estimator
  report = engine.memory_report(resumed)
  measured = report.measured["optimizer"]
  assert measured[NUMPY] == store.per_device_bytes() > 0
  assert measured["device"] == sum(x.nbytes for x in jax.tree.leaves(resumed.opt_state))  # counts
  assert report.estimate.bytes[NUMPY]["optimizer"] > 0
  assert report.ratio("optimizer") == pytest.approx(1.0, rel=0.02)
  assert "numpy" in str(report)


def test_the_fp8_gather_moves_bytes_and_round_trips(data, plain, tmp_path):
  config = ds_config(3, stage3_param_persistence_threshold=0, zero_quantized_weights="fp8")
  engine, final, losses, resumed, resumed_losses = _run_and_resume(config, data, tmp_path, 2)
  assert {l.gather for l in engine.plan.leaf_list()} == {"fp8"}
  batch = engine.shard_batch(data[0])
  text = engine.jitted_step(batch).lower(resumed, batch).as_text()
  gathers = [line for line in text.splitlines() if "all_gather" in line]
  assert gathers and all("xui8>" in line for line in gathers)  # one byte per element
  plain_losses = plain[2]
  assert abs(losses[0] - plain_losses[0]) <= 1e-2 * plain_losses[0]  # the fp8 forward
  assert losses[0] != plain_losses[0] and losses[-1] < losses[0]
  assert resumed_losses == losses[2:]
  _same(engine.full_state(resumed), final)
