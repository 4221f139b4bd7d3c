"""ZeRO-Offload's state tier (jzero.tiers.host_optimizer: ``update: stream`` / ``host``): optimizer
state and fp32 master in host memory, updated on the device or by XLA's host computation.

Exactness against the same stage without offload (fp32: <= 1e-6 relative), placement from the live
arrays' memory kinds, donation (the donated state's buffers are deleted), the CUDA export's host
annotations, the memory report, partial offload and checkpoints across tiers. The small model and
3 steps keep the file fast; bench/offload.py runs the default job for 12 steps (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import jzero
from jzero.errors import ConfigError, NotSupportedError
from jzero.sharding.plan import flatten_paths
from jzero.tiers import host_optimizer
from zero_testing import SAME_MATH, SMALL, batches, ds_config, make_engine, max_relative_diff

N = 8
STEPS = 3


@functools.lru_cache(maxsize=None)
def _data():
  return tuple(batches(SMALL.seq_len, N, STEPS))


def _engine(stage: int, precision: str = "fp32", offload: bool = True, **offload_optimizer):
  """This file's tier's engine: the streamed update unless ``update`` says "host" (``device: cpu``
  alone runs the host Adam for the config's AdamW: tests/tiers/test_host_step.py)."""
  offload_optimizer = {"device": "cpu", "update": "stream", **offload_optimizer}
  zero = {"offload_optimizer": offload_optimizer} if offload else {}
  return make_engine(ds_config(stage, precision=precision, **zero))


def _train(engine, check_donation: bool = False):
  """(final state, final logical params, losses); optionally asserts each step donated its input."""
  state = engine.init(jax.random.key(0))
  losses = []
  for batch in _data():
    old = state
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
    if check_donation:
      assert all(x.is_deleted() for x in jax.tree.leaves(old)), "state not donated"
  return state, jax.tree.map(np.asarray, engine.logical_params(state)), np.array(losses)


@functools.lru_cache(maxsize=None)
def _baseline(stage: int, precision: str = "fp32"):
  _, params, losses = _train(_engine(stage, precision, offload=False))
  return params, losses


def _kinds_of_param_like(engine, opt_state):
  """(memory kinds of optax's param-like leaves, kinds of the other leaves)."""
  flags = optax.tree_utils.tree_map_params(engine.tx, lambda _: True, opt_state,
                                           transform_non_params=lambda _: False)
  pairs = list(zip(jax.tree.leaves(flags), jax.tree.leaves(opt_state)))
  return ({x.sharding.memory_kind for f, x in pairs if f and x.ndim},
          {x.sharding.memory_kind for f, x in pairs if not f})


@pytest.mark.parametrize("stage,update", [(1, "host"), (2, "stream")])
def test_fp32_offload_equals_no_offload_and_lives_on_the_host(stage, update):
  """Both update modes give the non-offloaded stage's losses and parameters (fp32, 1e-6); the
  optimizer's moments are pinned_host arrays, the step count and the params stay on the device,
  and every step donates the whole state (the host buffers included: openxla/xla#29270)."""
  engine = _engine(stage, update=update)
  state, params, losses = _train(engine, check_donation=True)
  ref_params, ref_losses = _baseline(stage)
  assert max_relative_diff(params, ref_params) <= SAME_MATH
  assert np.max(np.abs(losses - ref_losses) / ref_losses) <= SAME_MATH
  host, other = _kinds_of_param_like(engine, state.opt_state)
  assert host == {"pinned_host"} and other == {"device"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}


@pytest.mark.parametrize("update", ["stream", "host"])
def test_bf16_offload_is_bitwise_the_step_without_offload(update):
  """bf16 training rounds the compute params from the fp32 master every step, so a one-ulp
  difference in the master's update grows into a different run: both update modes must give the
  non-offloaded master bit for bit. (The stream mode's barrier once held Adam's step count too,
  and XLA then compiled the update to other roundings: 10% of the master off by one ulp after
  one step.)"""
  _, master, losses = _train(_engine(2, "bf16", update=update))  # logical params: the master
  ref_master, ref_losses = _baseline(2, "bf16")
  assert max_relative_diff(master, ref_master) == 0.0
  np.testing.assert_array_equal(losses, ref_losses)


def test_host_update_skips_a_non_finite_step_without_a_conditional():
  """A step whose gradient is not finite (fp32: a token id past the embedding gives a NaN lookup)
  is skipped by the "host" update as without offload -- the same losses, skip count and params --
  by a select inside the host computation: the compiled step has no conditional (XLA's GPU
  compiler rejects a host computation inside one; seen on an H200 with jax 0.11.2)."""
  def run(engine):
    engine.check_input_ids = False
    state, losses = engine.init(jax.random.key(0)), []
    for i, batch in enumerate(_data()):
      if i == 1:
        batch = {k: np.array(v) for k, v in batch.items()}
        batch["tokens"][0, 3] = SMALL.vocab_size + 44
      state, metrics = engine.train_step(state, engine.shard_batch(batch))
      losses.append(float(metrics["loss"]) if i != 1 else int(metrics["skipped"]))
    return engine, state, losses

  engine, state, losses = run(_engine(2, update="host"))
  _, ref_state, ref_losses = run(_engine(2, offload=False))
  assert losses[1] == ref_losses[1] == 1  # the second step was skipped
  np.testing.assert_allclose(losses, ref_losses, rtol=SAME_MATH)
  assert max_relative_diff(jax.tree.map(np.asarray, engine.logical_params(state)),
                           jax.tree.map(np.asarray, engine.logical_params(ref_state))) <= SAME_MATH
  batch = engine.shard_batch(_data()[0])
  assert " conditional(" not in engine.compile_step(state, batch).as_text()


def test_host_update_in_the_function_spelling_of_compute_on(monkeypatch):
  """JAX 0.11's ``compute_on`` is a function wrapper that takes the results' memory spaces (0.10's
  ``compute_on2``); the context manager of 0.10 is gone. The host update in that spelling gives
  the non-offloaded master bit for bit too."""
  from jax.experimental import compute_on as module

  if not hasattr(module, "compute_on2"):
    pytest.skip("this JAX's compute_on is the function form already: the test above runs it")
  monkeypatch.setattr(module, "compute_on", module.compute_on2)
  _, master, losses = _train(_engine(2, "bf16", update="host"))
  ref_master, ref_losses = _baseline(2, "bf16")
  assert max_relative_diff(master, ref_master) == 0.0
  np.testing.assert_array_equal(losses, ref_losses)


def test_partial_offload_bf16_stage3_unpinned_and_memory_report():
  """ratio 0.5 moves the largest leaves' master and state (and nothing else) to unpinned_host;
  the memory report measures exactly the estimator's host share; the result equals the same
  bf16 stage-3 run without offload."""
  engine = _engine(3, "bf16", ratio=0.5, pin_memory=False)
  state, params, losses = _train(engine)
  ref_params, ref_losses = _baseline(3, "bf16")
  assert max_relative_diff(params, ref_params) <= SAME_MATH
  assert np.max(np.abs(losses - ref_losses) / ref_losses) <= SAME_MATH
  plan = engine.plan
  sizes = {l.path: l.numel for l in plan.leaf_list()}
  host = {l.path for l in plan.leaf_list() if l.state_tier == "host"}
  assert 0 < sum(sizes[p] for p in host) <= 0.5 * sum(sizes.values())
  largest = max(sizes, key=sizes.get)
  assert largest in host
  kinds = {path: x.sharding.memory_kind for path, x in flatten_paths(state.master).items()}
  assert {p for p, k in kinds.items() if k == "unpinned_host"} == host
  assert {kinds[p] for p in set(kinds) - host} == {"device"}
  report = engine.memory_report(state)
  measured_host = sum(report.measured[c].get("unpinned_host", 0) for c in ("master", "optimizer"))
  assert measured_host == pytest.approx(report.estimate.bytes["host"]["optimizer"], rel=1e-3)
  assert report.estimate.name == "ZeRO-3 + optimizer->cpu (stream)"
  assert report.ratio() == pytest.approx(1.0, abs=1e-3)


def test_step_exported_for_cuda_keeps_the_state_on_the_host():
  """The GPU path without a GPU: the step's StableHLO for CUDA carries the host memory kind on
  the optimizer-state arguments and results, with the placement annotations of the transfers."""
  from jax import export
  engine = _engine(2)
  state = engine.init(jax.random.key(0))
  batch = engine.shard_batch(_data()[0])
  text = export.export(engine.jitted_step(batch), platforms=("cuda",))(state, batch).mlir_module()
  main = next(line for line in text.splitlines() if "func.func public @main" in line)
  moments = sum(1 for l in engine.plan.leaf_list() if l.state_tier == "host") * 2  # mu, nu
  assert moments > 0
  results = main.split("->", 1)[1]
  assert main.split("->", 1)[0].count('mhlo.memory_kind = "pinned_host"') == moments
  assert results.count('mhlo.memory_kind = "pinned_host"') == moments
  placements = text.count('_xla_buffer_placement = \\"pinned_host\\"') + text.count(
      '_xla_buffer_placement = "pinned_host"')
  assert placements >= moments, placements


def test_offloaded_state_checkpoints_restore_across_tiers(tmp_path):
  """Saved from the host tier, restored into a device-only plan and back, exactly."""
  engine = _engine(2, "bf16")
  state, params, _ = _train(engine)
  engine.save_checkpoint(state, tmp_path)
  engine.wait_for_checkpoints()
  plain = make_engine(ds_config(2, precision="bf16"))
  restored = plain.load_checkpoint(tmp_path)
  assert max_relative_diff(jax.tree.map(np.asarray, plain.logical_params(restored)), params) == 0
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.opt_state)} <= {None, "device"}
  plain.save_checkpoint(restored, tmp_path / "plain")
  plain.wait_for_checkpoints()
  back = _engine(2, "bf16")
  again = back.load_checkpoint(tmp_path / "plain")
  assert max_relative_diff(jax.tree.map(np.asarray, back.logical_params(again)), params) == 0
  assert {x.sharding.memory_kind for x in jax.tree.leaves(again.master)} == {"pinned_host"}
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(again.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # and it trains on from there
  again, metrics = back.train_step(again, back.shard_batch(_data()[0]))
  assert np.isfinite(float(metrics["loss"]))


def test_choose_offloaded_takes_the_largest_leaves_within_the_ratio():
  sizes = {"a": 100, "b": 60, "c": 30, "d": 10}
  assert host_optimizer.choose_offloaded(sizes, 1.0) == {"a", "b", "c", "d"}
  assert host_optimizer.choose_offloaded(sizes, 0.5) == {"a"}
  assert host_optimizer.choose_offloaded(sizes, 0.8) == {"a", "b"}  # 160 of 200
  assert host_optimizer.choose_offloaded(sizes, 0.7) == {"a", "c", "d"}  # b would overshoot 140
  assert host_optimizer.choose_offloaded(sizes, 0.6) == {"a", "d"}  # so would b, then c: 120
  assert host_optimizer.choose_offloaded(sizes, 0.0) == set()


@pytest.mark.parametrize("zero,error,match", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, ConfigError, "stage 1, 2 or 3"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, ConfigError, "needs zero_optimization"
     r"\.offload_optimizer\.nvme_path"),
    ({"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "."}}, ConfigError,
     "needs ZeRO stage 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, ConfigError, "needs ZeRO stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}},
     NotSupportedError, "SuperOffload"),
])
def test_offload_settings_jzero_cannot_honour_are_refused(zero, error, match):
  config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}
  with pytest.raises(error, match=match):
    make_engine(config)


def test_nvme_only_keys_warn_with_cpu_offload():
  config = ds_config(2, offload_optimizer={"device": "cpu", "buffer_count": 8})
  with pytest.warns(jzero.JZeroWarning, match="buffer_count"):
    make_engine(config)
