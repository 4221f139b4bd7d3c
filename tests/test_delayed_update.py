"""ZeRO-Offload's delayed parameter update (jzero.delayed): step t updates with step t-1's gradient.

Exactness against a plain single-device optax loop written here that applies g_{t-1} at step t
(fp32, each step's parameters to 1e-6), the carried gradient's placement and its bytes in the
memory report, checkpoints that resume exactly, and the refusals. Small model, 4 steps.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.errors import ConfigError
from jzero.memory_report import format_memory_report
from jzero.models import GPT, lm_loss
from zero_testing import SMALL, batches, ds_config, gpt_factory, max_relative_diff, \
    reference_optimizer

N = 8
STEPS = 4


def _data(gas: int = 1):
  return batches(SMALL.seq_len, N * gas, STEPS)


def _engine(stage: int, gas: int = 1, **offload_optimizer):
  return jzero.initialize(gpt_factory(SMALL), lm_loss, ds_config(
      stage, gas=gas, offload_optimizer={"device": "cpu", "delayed_update": True,
                                         **offload_optimizer}))


def _logical(engine, state):
  return jax.tree.map(np.asarray, engine.logical_params(state))


def _train(engine, state, data):
  """Steps ``state`` through ``data``; (state, each step's logical params, losses)."""
  params, losses = [], []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    params.append(_logical(engine, state))
    losses.append(float(metrics["loss"]))
  return state, params, losses


def _reference(initial, data):
  """The documented math as a plain single-device optax loop: step t computes g_t at the current
  parameters and updates them with g_{t-1} (clipped by its own norm, then AdamW); step 1 only
  keeps g_1. Returns each step's parameters and losses."""
  model = GPT(SMALL, rngs=nnx.Rngs(0))
  graphdef, template = nnx.split(model, nnx.Param)
  tx = reference_optimizer()

  def loss(p, batch):
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, p)
    return lm_loss(nnx.merge(graphdef, state), batch)

  @jax.jit
  def step(p, opt, carried, batch):
    value, grads = jax.value_and_grad(loss)(p, batch)
    updates, opt = tx.update(carried, opt, p)
    return optax.apply_updates(p, updates), opt, grads, value

  device = jax.devices()[0]
  p = jax.device_put(initial, device)
  opt, carried = tx.init(p), None
  out, losses = [], []
  for batch in data:
    batch = jax.device_put(batch, device)
    if carried is None:
      value, carried = jax.jit(jax.value_and_grad(loss))(p, batch)
    else:
      p, opt, carried, value = step(p, opt, carried, batch)
    out.append(jax.tree.map(np.asarray, p))
    losses.append(float(value))
  return out, losses


@pytest.mark.parametrize("stage,gas,update", [(2, 1, "stream"), (3, 2, "host")])
def test_delayed_update_equals_the_documented_math(stage, gas, update):
  """Every step's parameters and loss equal the plain loop that applies g_{t-1} at step t (fp32,
  1e-6); the first step changes nothing; the carried gradient lives on the device in the state
  layout; the steady step keeps no lax.cond."""
  engine = _engine(stage, gas, update=update)
  state = engine.init(jax.random.key(0))
  initial = _logical(engine, state)
  state, params, losses = _train(engine, state, _data(gas))
  ref_params, ref_losses = _reference(initial, _data(gas))
  assert max_relative_diff(params[0], initial) == 0  # step 1: no update
  for got, want in zip(params, ref_params):
    assert max_relative_diff(got, want) <= 1e-6
  assert np.max(np.abs(np.array(losses) - ref_losses) / np.array(ref_losses)) <= 1e-6
  assert max_relative_diff(params[-1], params[-2]) > 1e-4  # later steps do update
  carried = jax.tree.leaves(state.delayed.grads)
  assert {x.sharding.memory_kind for x in carried} == {"device"}
  assert {x.dtype for x in carried} == {np.dtype(np.float32)}
  assert [x.sharding.spec for x in carried] == jax.tree.leaves(
      engine.plan.state_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert bool(state.delayed.ready)
  assert engine._prime_fn is not None  # step 1 ran the prime variant, the rest the steady one
  hlo = engine.jitted_step(engine.shard_batch(_data(gas)[0])).lower(
      state, engine.shard_batch(_data(gas)[0])).as_text()
  assert "stablehlo.case" not in hlo and "stablehlo.if" not in hlo


def test_checkpoint_resumes_exactly_with_the_carried_gradient(tmp_path):
  """Saved after 2 steps, restored into a fresh engine (another stage): the carried gradient comes
  back and the next 2 steps equal the uninterrupted run bit for bit; a checkpoint restored into an
  engine without the delayed update drops the gradient with a warning."""
  engine = _engine(1)
  data = _data()
  state = engine.init(jax.random.key(0))
  state, _, _ = _train(engine, state, data[:2])
  saved = [np.asarray(x) for x in jax.tree.leaves(state.delayed.grads)]
  engine.save_checkpoint(state, tmp_path)
  engine.wait_for_checkpoints()
  state, straight, straight_losses = _train(engine, state, data[2:])

  other = _engine(2)
  restored = other.load_checkpoint(tmp_path)
  assert bool(restored.delayed.ready)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.delayed.grads)} == {"device"}
  for leaf, a, b in zip(engine.plan.leaf_list(), saved, jax.tree.leaves(restored.delayed.grads)):
    np.testing.assert_array_equal(np.asarray(leaf.to_logical(a)), np.asarray(leaf.to_logical(b)))
  _, resumed, resumed_losses = _train(other, restored, data[2:])
  for got, want in zip(resumed, straight):
    assert max_relative_diff(got, want) <= 1e-6
  assert np.allclose(resumed_losses, straight_losses, rtol=1e-6, atol=0)
  assert other._prime_fn is None  # a ready restored gradient: no prime step

  plain = jzero.initialize(gpt_factory(SMALL), lm_loss, ds_config(1, offload_optimizer={
      "device": "cpu"}))
  with pytest.warns(jzero.JZeroWarning, match="delayed-update gradient"):
    back = plain.load_checkpoint(tmp_path)
  assert back.delayed is None


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
])
def test_delayed_update_without_cpu_offload_is_refused(offload_optimizer, match):
  """Before any device work, naming the key and the fix."""
  with pytest.raises(ConfigError, match=match):
    jzero.initialize(gpt_factory(SMALL), lm_loss,
                     ds_config(2, offload_optimizer=offload_optimizer))
