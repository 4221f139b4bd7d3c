"""jzero.train.precision against a transcription of DeepSpeed's DynamicLossScaler and its unit tests.

``DeepSpeedDynamicLossScaler`` is ``DynamicLossScaler.update_scale`` of
``deepspeed/runtime/fp16/loss_scaler.py`` without its logging. The hand-checked numbers come from
DeepSpeed's ``tests/unit/runtime/half_precision/test_zero_optim_overflow.py`` (TestZeROFloat16)
and ``test_dynamic_loss_scale.py`` (TestUnfused, TestZeroStage0Hysteresis).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzero.errors import ConfigError
from jzero.train.precision import LossScaler, LossScaleState, has_overflow

from deepspeed_reference import DeepSpeedDynamicLossScaler


def _scaler(power=8, window=2, hysteresis=2, consecutive=False, min_scale=1.0):
  return LossScaler.from_config(loss_scale=0, initial_scale_power=power, loss_scale_window=window,
                                hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                                min_loss_scale=min_scale)


def _run(scaler, overflows):
  """Runs ``update`` under jit step by step; returns the states after each step."""
  update = jax.jit(scaler.update)
  state, states = scaler.init(), []
  for overflow in overflows:
    state = update(state, jnp.asarray(overflow))
    states.append(state)
  return states


def _scales(scaler, overflows):
  return [float(state.scale) for state in _run(scaler, overflows)]


CONFIGS = [
  dict(power=power, window=window, hysteresis=hysteresis, consecutive=consecutive,
       min_scale=min_scale, p=p)
  for hysteresis, consecutive in itertools.product((1, 2, 3), (False, True))
  for power, window, min_scale, p in ((16, 5, 1.0, 0.05), (4, 2, 0.25, 0.3), (3, 1, 1.0, 0.5),
                                      (10, 3, 0.25, 0.8))
]


@pytest.mark.parametrize("seed,config", list(enumerate(CONFIGS)),
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
                         if isinstance(c, dict) else str(c))
def test_matches_deepspeed_on_random_sequences(seed, config):
  config = dict(config)
  rng = np.random.default_rng(seed)
  p = config.pop("p")
  # Bursts of 20 steps: overflow rate p, all clean, or all overflowing, so that the floor, growth
  # and hysteresis all happen.
  overflows = [bool(x) for x in rng.random(400) < np.repeat(rng.choice([p, 0.0, 1.0], 20), 20)]
  scaler = _scaler(**config)
  ref = DeepSpeedDynamicLossScaler(2.0**config["power"], config["window"], config["min_scale"],
                             config["hysteresis"], config["consecutive"])
  update, at_min = jax.jit(scaler.update), jax.jit(scaler.at_min_scale_overflow)
  state = scaler.init()
  for overflow in overflows:
    try:
      ref.update_scale(overflow)
      would_raise = False
    except Exception:  # DeepSpeed ends the run here; go on with the error disabled.
      would_raise = True
      ref.raise_error_at_min_scale = False
      ref.update_scale(overflow)
      ref.raise_error_at_min_scale = True
    assert bool(at_min(state, overflow)) == would_raise
    state = update(state, overflow)
    assert ref.cur_scale < 2.0**127  # below jzero's cap, where both must agree exactly
    assert float(state.scale) == np.float32(ref.cur_scale)
    assert int(state.cur_iter) == ref.cur_iter
    assert int(state.last_overflow_iter) == ref.last_overflow_iter
    assert int(state.cur_hysteresis) == ref.cur_hysteresis


def test_scale_growth_stops_at_float32_largest_power_of_two():
  scales = _scales(_scaler(power=125, window=1), [False] * 6)
  assert scales == [2.0**125, 2.0**126, 2.0**127, 2.0**127, 2.0**127, 2.0**127]


def test_matches_deepspeed_inside_scan():
  scaler = _scaler(power=12, window=7, hysteresis=2, consecutive=False, min_scale=0.25)
  overflows = np.random.default_rng(0).random(3000) < 0.15
  ref = DeepSpeedDynamicLossScaler(2.0**12, 7, 0.25, 2, False, raise_error_at_min_scale=False)
  expected = []
  for overflow in overflows:
    ref.update_scale(bool(overflow))
    expected.append(ref.cur_scale)

  def body(state, overflow):
    state = scaler.update(state, overflow)
    return state, state.scale

  final, scales = jax.jit(lambda s, o: jax.lax.scan(body, s, o))(scaler.init(), overflows)
  np.testing.assert_array_equal(scales, np.float32(expected))
  assert (int(final.cur_iter), int(final.last_overflow_iter), int(final.cur_hysteresis)) == (
    ref.cur_iter, ref.last_overflow_iter, ref.cur_hysteresis)


def test_deepspeed_no_overflow():
  # TestZeROFloat16.test_no_overflow: initial_scale_power 8, loss_scale_window 2.
  states = _run(_scaler(power=8, window=2), [False] * 10)
  expected = [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]
  assert [float(s.scale) for s in states] == expected
  assert [int(s.cur_iter) for s in states] == list(range(1, 11))


def test_deepspeed_all_overflow():
  # TestZeROFloat16.test_all_overflow: power 8 = 8 overflows, window 2, hysteresis 1, floor 1.
  scaler = _scaler(power=8, window=2, hysteresis=1)
  states = _run(scaler, [True] * 8)
  assert [float(s.scale) for s in states] == [128, 64, 32, 16, 8, 4, 2, 1]
  assert [int(s.cur_iter) for s in states] == list(range(1, 9))
  assert not any(bool(scaler.at_min_scale_overflow(s, True)) for s in [scaler.init()] + states[:-1])
  # A ninth overflow would halve a scale already at min_loss_scale: DeepSpeed's ZeRO raises.
  assert bool(scaler.at_min_scale_overflow(states[-1], True))
  assert not bool(scaler.at_min_scale_overflow(states[-1], False))
  assert float(scaler.update(states[-1], True).scale) == 1.0


def test_deepspeed_all_overflow_custom_floor():
  # TestUnfused.test_all_overflow: power 4, min_loss_scale 2, hysteresis 1.
  scales = _scales(_scaler(power=4, window=2, hysteresis=1, min_scale=2.0), [True] * 8)
  assert scales == [8, 4, 2, 2, 2, 2, 2, 2]


def test_deepspeed_some_overflow():
  # TestZeROFloat16.test_some_overflow: power 8, window 2, hysteresis 1.
  states = _run(_scaler(power=8, window=2, hysteresis=1), [True, True] + [False] * 3 + [True])
  assert [float(s.scale) for s in states] == [128, 64, 64, 64, 128, 64]
  assert int(states[1].cur_iter) == 2 and int(states[4].cur_iter) == 5
  assert int(states[5].cur_iter) == 6


def test_deepspeed_hysteresis():
  # TestZeroStage0Hysteresis.test_hysteresis: hysteresis 3, four overflows.
  assert _scales(_scaler(power=8, hysteresis=3), [True] * 4) == [256, 256, 128, 64]


def test_deepspeed_consecutive_hysteresis():
  # TestZeroStage0Hysteresis.test_consecutive_hysteresis: a clean step refills the hysteresis.
  scales = _scales(_scaler(power=8, hysteresis=2, consecutive=True), [True, False] * 4)
  assert scales == [256] * 8


def test_hysteresis_not_refilled_without_consecutive():
  scales = _scales(_scaler(power=8, hysteresis=2), [True, False] * 4)
  assert scales == [256, 256, 128, 128, 64, 64, 32, 32]


def test_growth_refills_hysteresis():
  states = _run(_scaler(power=8, window=2, hysteresis=2), [True, False, False, False, True])
  assert [float(s.scale) for s in states] == [256, 256, 256, 512, 512]
  assert [int(s.cur_hysteresis) for s in states] == [1, 1, 1, 2, 1]


def test_at_min_scale_with_hysteresis():
  scaler = _scaler(power=1, window=100, hysteresis=2, min_scale=1.0)
  state, flags = scaler.init(), []
  for overflow in [True, True, True]:  # absorbed, 2 -> 1, then at the floor
    flags.append(bool(scaler.at_min_scale_overflow(state, overflow)))
    state = scaler.update(state, overflow)
  assert flags == [False, False, True]


def test_static_and_disabled_scalers():
  scaler = LossScaler.from_config(loss_scale=128, initial_scale_power=16, loss_scale_window=1000,
                                  hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1)
  assert not scaler.dynamic
  state = scaler.init()
  assert float(state.scale) == 128.0
  for overflow in (True, False, True):
    new = jax.jit(scaler.update)(state, overflow)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(a == b), new, state))
    assert not bool(scaler.at_min_scale_overflow(state, overflow))
  disabled = LossScaler.disabled()
  assert not disabled.dynamic and float(disabled.init().scale) == 1.0


def test_init_state():
  state = _scaler(power=16, hysteresis=3).init()
  assert isinstance(state, LossScaleState)
  assert float(state.scale) == 65536.0 and state.scale.dtype == jnp.float32
  assert (int(state.cur_iter), int(state.last_overflow_iter), int(state.cur_hysteresis)) == (
    0, -1, 3)
  assert all(leaf.dtype == jnp.int32 for leaf in state[1:])


def test_from_config_errors():
  with pytest.raises(ConfigError, match="fp16.loss_scale_window: must be a positive integer"):
    _scaler(window=0)
  with pytest.raises(ConfigError, match="fp16.hysteresis: must be a positive integer"):
    _scaler(hysteresis=0)
  with pytest.raises(ConfigError, match="fp16.min_loss_scale: must be a positive number"):
    _scaler(min_scale=0)
  with pytest.raises(ConfigError, match="fp16.initial_scale_power"):
    _scaler(power=200)
  with pytest.raises(ConfigError, match="fp16.loss_scale: must be a finite number >= 0"):
    LossScaler.from_config(loss_scale=-1, initial_scale_power=16, loss_scale_window=1000,
                           hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1)


def test_has_overflow():
  finite = {"a": jnp.ones((3, 4), jnp.float16), "b": [jnp.zeros(5, jnp.bfloat16),
                                                     jnp.arange(4, dtype=jnp.int32)],
            "c": jnp.full((2,), 65504.0, jnp.float32)}
  check = jax.jit(has_overflow)
  assert not bool(check(finite))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    assert bool(check({**finite, "b": [finite["b"][0].at[3].set(bad), finite["b"][1]]}))
  assert bool(check({**finite, "a": finite["a"] * 1e5}))  # fp16 overflow to inf
  assert not bool(has_overflow({}))
  assert check(finite).shape == () and check(finite).dtype == jnp.bool_


def test_has_overflow_on_sharded_leaves():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  grads = np.ones(8 * 16, np.float32)
  assert not bool(jax.jit(has_overflow)(jax.device_put(grads, sharding)))
  grads[-1] = np.nan  # only the last shard holds it
  assert bool(jax.jit(has_overflow)(jax.device_put(grads, sharding)))
