"""ZeRO-Offload's CPU Adam schedule (jzero.tiers.host_step; what ``offload_optimizer.device: cpu``
runs): gradients leave the device as the backward produces them, Adam runs on the host after the
step.

Exactness against the same stage without offload (fp32: SAME_MATH; bf16 and fp16: the first
step's master and every loss, then the master within what a compute param rounded the other way
costs), with gradient accumulation (stages 1-3, fp16 with params in host memory), beside params on
NVMe and ZeRO++, the delayed update one step late (equal to the streamed update's delayed run),
where the state lives (the store's numpy buffers, 0-byte placeholders in the train state, the
gradients handed out in host memory), checkpoints across tiers and the refusals. Small model, 3
steps."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from jzero.config import Config
from jzero.errors import ConfigError
from jzero.sharding.plan import flatten_paths
from jzero.tiers.host_step import HOST_STEP, check_update, resolve_update
from zero_testing import SAME_MATH, SMALL, batches, ds_config, make_engine, max_relative_diff

N = 8
STEPS = 3
CPU_ADAM = {"device": "cpu", "update": "cpu_adam"}
NODE2X4 = str(Path(__file__).resolve().parents[2] / "configs" / "mesh" / "node2x4.yaml")


@functools.lru_cache(maxsize=None)
def _data():
  return tuple(batches(SMALL.seq_len, N, STEPS))


def _train(engine, state=None, data=None):
  """(final state, logical params after each step, losses)."""
  state = engine.init(jax.random.key(0)) if state is None else state
  params, losses = [], []
  for batch in _data() if data is None else data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
    params.append(jax.tree.map(np.asarray, engine.logical_params(state)))
  return state, params, np.array(losses)


def _assert_matches(params, losses, ref_params, ref_losses, steps: int | None = None) -> None:
  """Every loss, and the master after each of the first ``steps`` steps (None: every step),
  within SAME_MATH of the reference run's."""
  for got, want in zip(params[:steps], ref_params):
    assert max_relative_diff(got, want) <= SAME_MATH
  assert np.max(np.abs(losses - ref_losses) / ref_losses) <= SAME_MATH


def _assert_report_matches(engine, state) -> None:
  """The memory report's rows equal the estimator's within 2%: the host store's buffers measured
  (the fp32 partitions count as params in fp32 training, where they are the params; the 16-bit
  upload buffers as params), the gradients counted from the plan where the host step keeps them
  (in flight on the device, the partitions in pinned host memory)."""
  report = engine.memory_report(state)
  for name in report.categories:
    if report.predicted[name] or report.measured_bytes(name):
      assert report.ratio(name) == pytest.approx(1, abs=0.02), name
  assert report.measured["grads"]["pinned_host"] > 0
  assert report.ratio() == pytest.approx(1, abs=0.02)


@functools.lru_cache(maxsize=None)
def _baseline(stage: int, precision: str = "fp32", **offload_optimizer):
  zero = {"offload_optimizer": offload_optimizer} if offload_optimizer else {}
  _, params, losses = _train(make_engine(ds_config(stage, precision=precision, **zero)))
  return params, losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_cpu_adam_equals_no_offload(stage):
  """Every step's parameters and losses equal the same stage without offload (fp32, SAME_MATH);
  the train state holds no optimizer state or master of its own (0-byte placeholders: the host
  store's numpy buffers hold them, as the memory report says) and the step hands the gradient
  partitions out in host memory."""
  engine = make_engine(ds_config(stage, offload_optimizer=CPU_ADAM))
  state, params, losses = _train(engine)
  _assert_matches(params, losses, *_baseline(stage))
  assert all(x.size == 0 for x in jax.tree.leaves(state.opt_state) if x.ndim)
  numel = sum(l.numel for l in engine.plan.leaf_list())
  report = engine.memory_report(state)
  moments = report.measured["optimizer"]
  assert moments.get("device", 0) < 64  # the step counts only
  assert moments["unpinned_host"] >= 8 * numel / N  # m and v: 4 bytes each, partitioned
  batch = engine.shard_batch(_data()[0])
  out_kinds = engine.jitted_step(batch).lower(state, batch).compile().output_shardings
  handed = [s.memory_kind for s in jax.tree.leaves(out_kinds[-1][HOST_STEP]["grads"])]
  assert handed and set(handed) == {"pinned_host"}
  _assert_report_matches(engine, state)


def test_with_params_in_host_memory_stage3_equals_no_offload():
  """ZeRO-3 with both offloads as a DeepSpeed config writes them (``{"device": "cpu"}``, no jzero
  key: what `jzero plan` chooses for 10B on one RTX 3090) runs the host Adam -- the engine's
  config says so, the plan puts every partitioned leaf's state in its tier -- with the same
  losses and parameters as stage 3 without offload (fp32, SAME_MATH). A persistence threshold
  of 1,000 elements partitions the small model's layers (the default keeps them whole), so
  their params live in host memory and the host's new params are written back there."""
  engine = make_engine(ds_config(3, stage3_param_persistence_threshold=1000,
                                 offload_optimizer={"device": "cpu"},
                                 offload_param={"device": "cpu"}))
  assert engine.config.zero_optimization.offload_optimizer.update == "cpu_adam"
  plan = engine.make_plan()
  assert {l.state_tier for l in plan.leaf_list() if l.state_partitioned} == {HOST_STEP}
  in_host = [l.path for l in plan.leaf_list() if l.param_tier == "host"]
  assert "blocks/qkv/kernel" in in_host
  state, params, losses = _train(engine)
  kinds = {p: x.sharding.memory_kind for p, x in flatten_paths(state.params).items()}
  assert {kinds[p] for p in in_host} == {"pinned_host"}
  ref_params, ref_losses = _baseline(3)
  assert max_relative_diff(params[-1], ref_params[-1]) <= SAME_MATH
  assert np.max(np.abs(losses - ref_losses) / ref_losses) <= SAME_MATH


@pytest.mark.parametrize("precision,stage", [("bf16", 2), ("bf16", 3), ("fp16", 3)])
def test_mixed_precision_cpu_adam_is_the_step_without_offload(precision, stage):
  """bf16 and fp16 (loss-scaled): the host's Adam updates the same fp32 master as the device's.
  The first step's master and every loss equal the same stage without offload (SAME_MATH); after
  it the two runs' masters, a float rounding apart, can round a few compute params to the
  neighbouring 16-bit value, so the last step's master is compared within what that costs
  (measured: bf16 6e-8, fp16 2.3e-5 after 3 steps -- the fp16 gradient unscaled twice, a bug this
  test found, was 0.67)."""
  engine = make_engine(ds_config(stage, precision=precision, offload_optimizer=CPU_ADAM))
  state, params, losses = _train(engine)
  _assert_report_matches(engine, state)
  ref_params, ref_losses = _baseline(stage, precision)
  _assert_matches(params, losses, ref_params, ref_losses, steps=1)
  assert max_relative_diff(params[-1], ref_params[-1]) <= (1e-5 if precision == "bf16" else 1e-4)


@pytest.mark.parametrize("stage,gas", [(2, 1), (3, 1), (2, 2)])
def test_delayed_update_on_the_host_is_one_step_late(stage, gas):
  """delayed_update with cpu_adam: the host's Adam for step t's gradient runs on a thread while the
  device computes step t+1 with the params before it (the delayed update's math: step t applies
  g_{t-1}). Every step's loss -- a function of the params the device used -- equals the streamed
  update's delayed run's (tests/tiers/test_delayed_update.py checks that run's math), over four
  steps. A full state read between steps (logical params, a checkpoint) waits for the running
  update and holds it applied: after step 1 that is step 1 of the run without the delay. Stage 3
  partitions the layers (a persistence threshold of 1,000 elements), so the host uploads their
  partitions as they are while its thread goes on to the next update (the race the host store's
  copy closes: without it the losses drifted 0.3% by step 3, differently each run)."""
  threshold = {"stage3_param_persistence_threshold": 1000} if stage == 3 else {}
  cfg = lambda update: ds_config(stage, gas=gas, **threshold, offload_optimizer={  # noqa: E731
      "device": "cpu", "update": update, "delayed_update": True})
  data = tuple(batches(SMALL.seq_len, gas * N, STEPS + 1))
  host_engine = make_engine(cfg("cpu_adam"))
  state, host, host_losses = _train(host_engine, data=data)
  _, _, stream_losses = _train(make_engine(cfg("stream")), data=data)
  assert np.max(np.abs(host_losses - stream_losses) / stream_losses) <= SAME_MATH
  plain_step_1 = (_baseline(stage)[0][0] if gas == 1 else
                  _train(make_engine(ds_config(stage, gas=gas)), data=data[:1])[1][0])
  assert max_relative_diff(host[0], plain_step_1) <= SAME_MATH
  assert host_engine._open()[HOST_STEP].count == len(data)
  _assert_report_matches(host_engine, state)  # the carried partitions counted twice on the host


@pytest.mark.parametrize("case", ["params on NVMe", "qwZ + qgZ", "hpZ"])
def test_cpu_adam_beside_the_nvme_params_and_zeropp_equals_the_device_update(case, tmp_path):
  """The host Adam beside the tiers and collectives it composes with: stage 3 with the params on
  NVMe (fp32, against stage 3 without offload), and on a node x local mesh ZeRO++'s quantized
  weights and gradients, or hpZ's secondary partition over a node (bf16), against the same
  ZeRO++ config with the device's update. Every loss within SAME_MATH, and every step's master in
  fp32, the first step's in bf16: after it a master a float rounding away rounds a compute param
  the other way, and qwZ's block quantization carries that to the block (measured 1.6e-4 after
  step 2, 6.2e-4 after step 3, the losses 2e-7 apart)."""
  if case == "params on NVMe":
    config = ds_config(3, offload_optimizer=CPU_ADAM,
                       offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
    engine, reference = make_engine(config), None
  else:
    zeropp = ({"zero_hpz_partition_size": 4} if case == "hpZ" else
              {"zero_quantized_weights": True, "zero_quantized_gradients": True})
    engine = make_engine(ds_config(3, precision="bf16", offload_optimizer=CPU_ADAM, **zeropp),
                         mesh=NODE2X4)
    reference = make_engine(ds_config(3, precision="bf16", **zeropp), mesh=NODE2X4)
  _, params, losses = _train(engine)
  reference_run = _baseline(3) if reference is None else _train(reference)[1:]
  _assert_matches(params, losses, *reference_run,
                  steps=None if reference is None else 1)  # bf16: the first step (docstring)


def test_checkpoint_round_trips_across_tiers(tmp_path):
  """Saved from the host store, restored into a plan without offload and back, exactly; the
  resumed run continues as the uninterrupted one, bit for bit."""
  engine = make_engine(ds_config(2, precision="bf16", offload_optimizer=CPU_ADAM))
  data = _data()
  state, _, _ = _train(engine, data=data[:1])
  engine.save_checkpoint(state, tmp_path)
  engine.wait_for_checkpoints()
  _, straight, straight_losses = _train(engine, state, data[1:])

  plain = make_engine(ds_config(2, precision="bf16"))
  restored = plain.load_checkpoint(tmp_path)
  plain.save_checkpoint(restored, tmp_path / "plain")
  plain.wait_for_checkpoints()
  back = make_engine(ds_config(2, precision="bf16", offload_optimizer=CPU_ADAM))
  again = back.load_checkpoint(tmp_path / "plain")
  _, resumed, resumed_losses = _train(back, again, data[1:])
  for got, want in zip(resumed, straight):
    assert max_relative_diff(got, want) == 0
  np.testing.assert_array_equal(resumed_losses, straight_losses)


@pytest.mark.parametrize("stage,precision,offload_param", [
    (1, "fp32", None), (2, "fp32", None), (3, "fp32", None), (3, "fp16", {"device": "cpu"})])
def test_gradient_accumulation_on_the_host_equals_no_offload(stage, precision, offload_param):
  """gradient_accumulation_steps 2: the micro-batches' partitions summed in host memory, the
  norm from the sum (clipping at 1.0 is active here); the same losses and parameters as the same
  stage, precision and accumulation without offload (SAME_MATH; fp16 with its loss scale: the
  first step's master and the losses, as in the test above), and the step's
  accumulator in host memory (no device buffer of the sum). Stage 1 reduces at the end of the
  accumulation; stage 3 with params in host memory too (what `jzero plan` picks for 10B on one
  GPU)."""
  data = tuple(batches(SMALL.seq_len, 2 * N, STEPS))
  extra = {"offload_param": offload_param} if offload_param else {}
  engine = make_engine(ds_config(stage, gas=2, precision=precision, offload_optimizer=CPU_ADAM,
                                 **extra))
  state, params, losses = _train(engine, data=data)
  _assert_report_matches(engine, state)  # the host's sums in the accumulation dtype
  _, ref_params, ref_losses = _train(make_engine(ds_config(stage, gas=2, precision=precision)),
                                     data=data)
  _assert_matches(params, losses, ref_params, ref_losses,
                  steps=None if precision == "fp32" else 1)  # 16-bit: the first step (above)
  hlo = engine.jitted_step(engine.shard_batch(data[0])).lower(
      engine.init(jax.random.key(0)), engine.shard_batch(data[0])).as_text()
  # stages 2-3: the slots' sum is added by the host; stage 1 sums its full local gradient on the
  # device and sends the partitions at the end, as DeepSpeed's stage 1 does
  assert ("_xla_compute_type = \"host\"" in hlo) == (stage > 1)


@pytest.mark.parametrize("extra,kwargs,match", [
    ({}, {"optimizer": optax.sgd(1e-2)}, "a client optax optimizer"),
])
def test_cpu_adam_refuses_what_it_cannot_run(extra, kwargs, match):
  """At initialize, naming the reason and the streamed update."""
  with pytest.raises(ConfigError, match=match):
    make_engine(ds_config(2, offload_optimizer=CPU_ADAM, **extra), **kwargs)


@pytest.mark.parametrize("change,given,match", [
    ({}, {"client_optimizer": True}, "a client optax optimizer"),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, {}, "optimizer Lion"),
    ({}, {"replica_axes": ("replica",)}, "the mesh's replica axes"),
    ({"gradient_accumulation_steps": 2}, {"platform": "tpu"},
     "gradient_accumulation_steps=2 on TPU"),
])
def test_check_update_names_each_reason(change, given, match):
  """The refusals as a unit (no engine): each names its reason and the streamed update; the same
  config runs where nothing is named (accumulation off TPU included)."""
  config = Config.load({**ds_config(2, offload_optimizer=CPU_ADAM), **change})
  where = {"client_optimizer": False, "replica_axes": (), "platform": "cpu"}
  with pytest.raises(ConfigError, match=f"{match}.*update: stream"):
    check_update(config, **{**where, **given})
  if "optimizer" not in change:
    check_update(config, **where)


@pytest.mark.parametrize("change,given,match", [
    ({}, {}, None),
    ({}, {"client_optimizer": True}, "a client optax optimizer"),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, {}, "optimizer Lion"),
    ({}, {"replica_axes": ("replica",)}, "the mesh's replica axes"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}, {},
     "offload_param.device: nvme"),
])
def test_device_cpu_alone_runs_the_host_adam_where_it_can(change, given, match):
  """``offload_optimizer: {device: cpu}`` without an update (a DeepSpeed config): the host Adam
  where the config allows it, else the streamed update with the reason (params on NVMe: the
  streamed update keeps their optimizer state in host memory, as the config says); an update
  the config names, and a config without optimizer offload, as they are (a unit: no engine)."""
  where = {"client_optimizer": False, "replica_axes": (), "platform": "cpu", **given}
  config = Config.load({**ds_config(2, offload_optimizer={"device": "cpu"}), **change})
  resolved, streamed_because = resolve_update(config, **where)
  update = resolved.zero_optimization.offload_optimizer.update
  if match is None:
    assert (update, streamed_because) == ("cpu_adam", [])
  else:
    assert update == "stream" and any(match in why for why in streamed_because)
  for unchanged in (ds_config(2, offload_optimizer={"device": "cpu", "update": "stream"}),
                    ds_config(2)):
    config = Config.load(unchanged)
    assert resolve_update(config, **where) == (config, None)
