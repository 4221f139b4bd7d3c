"""fp32's skip of a step whose gradient is not finite: the state is left bit for bit, and the skip
costs no state-sized temporary in the compiled step (jzero.train.step, ``_skippable_update``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jzero
from models_testing import LoopNet, mse
from zero_testing import ds_config, make_engine


def _batch(seed: int, d: int) -> dict:
  x = np.random.default_rng(seed).normal(size=(8 * jax.device_count(), d)).astype(np.float32)
  return {"x": x, "y": np.roll(x, 1, axis=1)}


def _host(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_non_finite_step_leaves_params_and_optimizer_state_unchanged(stage):
  """One NaN input row: the step is flagged and counted, and every array of the state --
  parameters and Adam's moments and count -- is what it was, bit for bit; the next step trains."""
  engine = make_engine(ds_config(stage, micro=8, **{"stage3_param_persistence_threshold": 0}),
                       lambda rngs: LoopNet(rngs, 2, 32), mse)
  state = engine.init(jax.random.key(0))
  state, _ = engine.train_step(state, engine.shard_batch(_batch(0, 32)))
  before = _host((state.params, state.opt_state))
  poisoned = _batch(1, 32)
  poisoned["x"][3] = np.nan
  state, metrics = engine.train_step(state, engine.shard_batch(poisoned))
  assert bool(metrics["overflow"]) and int(state.skipped) == 1 and int(state.step) == 2
  after = _host((state.params, state.opt_state))
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))  # bits
  with pytest.warns(jzero.JZeroWarning, match="the gradient was not finite"):
    state, metrics = engine.train_step(state, engine.shard_batch(_batch(2, 32)))
  assert not bool(metrics["overflow"])
  assert any((a != b).any() for a, b in zip(after, _host((state.params, state.opt_state))))


def _temp_and_state(stage: int, layers: int) -> tuple[int, int]:
  """(compiled step's temp bytes, bytes of the device's state arrays) of the loop model."""
  engine = make_engine(ds_config(stage, micro=8), lambda rngs: LoopNet(rngs, layers, 512), mse)
  state = engine.init(jax.random.key(0))
  compiled = engine.compile_step(state, engine.shard_batch(_batch(0, 512)))
  held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
             if s.device == jax.devices()[0])
  return compiled.memory_analysis().temp_size_in_bytes, held


@pytest.mark.parametrize("stage", [0, 3])
def test_the_skip_costs_no_state_sized_temp(stage):
  """Doubling the loop model's depth (2 -> 4 blocks of two 512 x 2048 kernels) grows the step's
  temp by less than 0.75x what it grows the device's state (params + Adam's two moments).

  Measured: 0.67x at stage 0 (the gradient and its clipped copy: two param-sized buffers of the
  three the state holds per param) and 0.02x at stage 3 (0.33x from 4 to 8 blocks). An elementwise
  select of old and new state kept a copy of the moments beside them: 1.00x at both stages (temp
  64 -> 96 MiB at stage 0, 4 blocks)."""
  (t2, s2), (t4, s4) = _temp_and_state(stage, 2), _temp_and_state(stage, 4)
  print(f"stage {stage}: temp grows {(t4 - t2) / 2**20:.2f} MiB for {(s4 - s2) / 2**20:.2f} MiB "
        f"of state: {(t4 - t2) / (s4 - s2):.3f}x")
  assert t4 - t2 < 0.75 * (s4 - s2)
