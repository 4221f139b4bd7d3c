"""ZeRO-Offload's delayed parameter update (jzero.tiers.delayed): step t updates with step t-1's gradient.

Exactness of each step's parameters (fp32) against runs that update with g_{t-1} at step t: the
same stage without the delayed update, fed by hand (1e-6), and a plain single-device optax loop
written here (1e-5, the suite's bound for 8 devices against one). The carried gradient's placement and its bytes in the
memory report, checkpoints that resume exactly, and the refusals. Small model, 3 steps.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import jzero
from jzero.analysis.memory_report import format_memory_report
from jzero.errors import ConfigError
from jzero.tiers.delayed import Variant
from zero_testing import (SAME_MATH, SMALL, assert_same_as_one_device, batches, ds_config,
                          gpt_factory, loss_of_params, make_engine, max_relative_diff,
                          reference_optimizer)

N = 8
STEPS = 3


def _data(gas: int = 1):
  return batches(SMALL.seq_len, N * gas, STEPS)


@functools.lru_cache(maxsize=None)  # one engine per setting: its compiled steps are reused
def _engine(stage: int, gas: int = 1, update: str = "stream"):
  offload_optimizer = {"update": update}
  return make_engine(ds_config(stage, gas=gas, offload_optimizer={
      "device": "cpu", "delayed_update": True, **offload_optimizer}))


def _logical(engine, state):
  """The fp32 params in the model's shapes, as numpy (engine.logical_params, without compiling a
  jit per call)."""
  return engine.plan.map(lambda leaf, x: np.asarray(leaf.to_logical(np.asarray(x))), state.params)


def _leaf(engine, path):
  return next(l for l in engine.plan.leaf_list() if l.path == path)


def _train(engine, state, data):
  """Steps ``state`` through ``data``; (state, each step's logical params, losses)."""
  params, losses = [], []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    params.append(_logical(engine, state))
    losses.append(float(metrics["loss"]))
  return state, params, losses


def _reference(initial, data, float64: bool = False):
  """The documented math as a plain single-device optax loop: step t computes g_t at the current
  parameters and updates them with g_{t-1} (clipped by its own norm, then AdamW); step 1 only
  keeps g_1. Returns each step's parameters and losses. ``float64``: the same loop in double
  precision, the exact result."""
  if float64:
    with jax.enable_x64(True):
      return _reference(jax.tree.map(lambda x: np.asarray(x, np.float64), initial), data)
  tx = reference_optimizer()
  grad_fn = jax.jit(jax.value_and_grad(loss_of_params(gpt_factory(SMALL))))

  @jax.jit
  def update(p, opt, g):
    updates, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, updates), opt

  device = jax.devices()[0]
  p = jax.device_put(initial, device)
  opt, carried = tx.init(p), None
  out, losses = [], []
  for batch in data:
    value, grads = grad_fn(p, jax.device_put(batch, device))  # g_t at the current parameters
    if carried is not None:
      p, opt = update(p, opt, carried)  # the update uses g_{t-1}
    carried = grads
    out.append(jax.tree.map(np.asarray, p))
    losses.append(float(value))
  return out, losses


def _same_stage_delayed_by_hand(stage, gas, update, data, warmup: int = 0):
  """The same stage *without* the delayed update, its forward+backward and its update run as
  two jits (the engine's wall_clock_breakdown pair) and fed by hand: step t computes g_t, then
  updates with g_{t-1} (the first ``warmup`` steps update with their own g_t). Same reductions as
  the engine, so fp32 results agree to rounding."""
  engine = make_engine(ds_config(stage, gas=gas,
                                 offload_optimizer={"device": "cpu", "update": update}))
  state = engine.init(jax.random.key(0))
  grads_fn, update_fn = engine.jitted_split_step(engine.shard_batch(data[0]))
  carried, out = None, []
  for i, batch in enumerate(data):
    grads = grads_fn(state, engine.shard_batch(batch))
    if i < warmup:
      state, _, _ = update_fn(state, *grads)
    else:
      if carried is not None:
        state, _, _ = update_fn(state, *carried)
      carried = grads
    out.append(_logical(engine, state))
  return out


@pytest.mark.parametrize("stage,gas,update", [(2, 1, "stream"), (3, 2, "host")])
def test_delayed_update_equals_the_documented_math(stage, gas, update):
  """Every step's parameters equal, in fp32, those of a plain run that updates with g_{t-1} at
  step t: the same stage without the delayed update fed by hand to 1e-6, and (stage 2) the plain
  single-device optax loop as every exactness test compares with it
  (zero_testing.assert_same_as_one_device). The first step changes nothing; the carried gradient is fp32 on the device in the
  state layout; the steady step has no lax.cond."""
  engine = _engine(stage, gas, update=update)
  data = _data(gas)
  state = engine.init(jax.random.key(0))
  initial = _logical(engine, state)
  state, params, losses = _train(engine, state, data)
  assert max_relative_diff(params[0], initial) == 0  # step 1: no update
  assert max_relative_diff(params[-1], params[-2]) > 1e-4  # the later steps do update
  by_hand = _same_stage_delayed_by_hand(stage, gas, update, data)
  for got, same_stage in zip(params, by_hand):
    assert max_relative_diff(got, same_stage) <= SAME_MATH
  if stage == 2:  # the independent loop once (its compile is the file's slowest part)
    ref_params, ref_losses = _reference(initial, data)
    exact = functools.cache(lambda: _reference(initial, data, float64=True)[0])
    for step, (got, loop) in enumerate(zip(params, ref_params)):
      assert_same_as_one_device(got, loop, lambda: exact()[step])
    assert np.max(np.abs(np.array(losses) - ref_losses) / np.array(ref_losses)) <= SAME_MATH
  carried = jax.tree.leaves(state.delayed.grads)
  assert {x.sharding.memory_kind for x in carried} == {"device"}
  assert {x.dtype for x in carried} == {np.dtype(np.float32)}
  assert [x.sharding.spec for x in carried] == jax.tree.leaves(
      engine.plan.state_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert bool(state.delayed.ready)
  # step 1 ran the prime variant, the rest the steady one (the variant is the state's)
  assert set(engine.step_variants) == {Variant.PRIME, Variant.APPLY}
  assert state.delayed.variant == Variant.APPLY
  batch = engine.shard_batch(data[0])
  hlo = engine.jitted_step(batch, Variant.APPLY).lower(state, batch).as_text()
  assert "stablehlo.case" not in hlo and "stablehlo.if" not in hlo
  # a state as init returns it lowers with the default step: the one that reads the carried flag
  engine.jitted_step(batch).lower(engine.init(jax.random.key(0)), batch)
  assert Variant.READ in engine.step_variants


def test_warmup_runs_plain_steps_before_the_delayed_update():
  """delayed_update_warmup: 1 -- step 1 is a plain step (it applies its own gradient), step 2
  takes the place of the delayed update's first step (it carries g_2 and applies nothing), step 3
  applies g_2: each step's parameters equal the same stage fed by hand so (1e-6, fp32)."""
  engine = make_engine(ds_config(2, offload_optimizer={
      "device": "cpu", "delayed_update": True, "delayed_update_warmup": 1}))
  data = _data()
  state = engine.init(jax.random.key(0))
  initial = _logical(engine, state)
  state, params, _ = _train(engine, state, data)
  assert max_relative_diff(params[0], initial) > 1e-4  # step 1 applied g_1 at once
  assert max_relative_diff(params[1], params[0]) == 0  # step 2 only carried g_2
  assert max_relative_diff(params[2], params[1]) > 1e-4
  for got, by_hand in zip(params, _same_stage_delayed_by_hand(2, 1, "stream", data, warmup=1)):
    assert max_relative_diff(got, by_hand) <= SAME_MATH
  assert set(engine.step_variants) == {Variant.WARMUP, Variant.PRIME, Variant.APPLY}
  assert bool(state.delayed.ready)


def test_checkpoint_resumes_exactly_with_the_carried_gradient(tmp_path):
  """Saved after the first step (parameters unchanged, g_1 carried) and restored: the carried
  gradient comes back bit for bit and the next steps equal the uninterrupted run exactly (the
  restored flag is read once, so the steady step runs, not the prime one); restored into an
  engine without the delayed update, the gradient is dropped with a warning; a checkpoint
  without one (or params_only) resumes with nothing carried: a prime step first."""
  engine = _engine(2)
  data = _data()
  state = engine.init(jax.random.key(0))
  state, _, _ = _train(engine, state, data[:1])
  saved = [np.asarray(x) for x in jax.tree.leaves(state.delayed.grads)]
  assert any(np.abs(x).max() > 0 for x in saved)
  engine.save_checkpoint(state, tmp_path)
  engine.wait_for_checkpoints()
  state, straight, straight_losses = _train(engine, state, data[1:])

  restored = engine.load_checkpoint(tmp_path)
  assert bool(restored.delayed.ready) and engine.variant_for(restored) == Variant.APPLY
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.delayed.grads)} == {"device"}
  for a, b in zip(saved, jax.tree.leaves(restored.delayed.grads)):
    np.testing.assert_array_equal(a, np.asarray(b))
  _, resumed, resumed_losses = _train(engine, restored, data[1:])
  for got, want in zip(resumed, straight):
    assert max_relative_diff(got, want) == 0
  assert resumed_losses == straight_losses

  other = _engine(3, 2, "host")  # another stage (and batch): the gradient is resharded
  with pytest.warns(jzero.JZeroWarning, match="global batch of 8"):
    moved = other.load_checkpoint(tmp_path).delayed.grads
  for leaf, a, b in zip(engine.plan.leaf_list(), saved, jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(leaf.to_logical(a)), np.asarray(
        _leaf(other, leaf.path).to_logical(b)))

  plain = make_engine(ds_config(2, offload_optimizer={"device": "cpu"}))
  with pytest.warns(jzero.JZeroWarning, match="delayed-update gradient"):
    back = plain.load_checkpoint(tmp_path)
  assert back.delayed is None
  plain.save_checkpoint(back, tmp_path / "plain")  # and a plain run's checkpoint resumes with
  plain.wait_for_checkpoints()                     # nothing carried: a prime step first
  switched = engine.load_checkpoint(tmp_path / "plain")
  assert not bool(switched.delayed.ready) and engine.variant_for(switched) == Variant.PRIME
  fresh = engine.load_checkpoint(tmp_path, params_only=True)  # weights only: nothing carried
  assert not bool(fresh.delayed.ready) and engine.variant_for(fresh) == Variant.PRIME


def test_memory_report_counts_the_carried_gradient():
  """The carried gradient is its own category: 4 bytes per parameter / N on the device, as the
  estimator predicts."""
  engine = _engine(2)
  state = engine.init(jax.random.key(0))
  report = engine.memory_report(state)
  measured = report.measured["delayed_grads"]
  assert set(measured) == {"device"}
  numel = sum(l.numel for l in engine.plan.leaf_list())
  assert report.predicted["delayed_grads"] == pytest.approx(4 * numel / N)
  assert measured["device"] == pytest.approx(4 * numel / N, rel=0.02)  # padding
  assert "delayed grads (DPU)" in format_memory_report(report)


@pytest.mark.parametrize("offload_optimizer,match", [
    ({"delayed_update": True}, "needs offload_optimizer.device: cpu"),
    ({"device": "none", "delayed_update": True}, "needs offload_optimizer.device: cpu"),
    ({"device": "cpu", "delayed_update": "yes"}, "delayed_update"),
    ({"device": "cpu", "delayed_update_warmup": 2}, "no delayed update to warm up"),
    ({"device": "cpu", "delayed_update": True, "delayed_update_warmup": -1},
     "delayed_update_warmup"),
])
def test_delayed_update_without_cpu_offload_is_refused(offload_optimizer, match):
  """Before any device work, naming the key and the fix."""
  with pytest.raises(ConfigError, match=match):
    make_engine(ds_config(2, offload_optimizer=offload_optimizer))
