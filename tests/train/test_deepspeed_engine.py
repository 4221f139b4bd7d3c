"""DeepSpeed's engine over jzero's (jzero/train/deepspeed_engine.py): every public name of DeepSpeed
0.19.8's ``DeepSpeedEngine`` (tests/deepspeed_engine_names.py) works or is refused with a jzero
error naming jzero's way; initialize's DeepSpeed call shape; the 4-tuple's optimizer and scheduler;
DeepSpeed's loop equal to ``train_step``; ``load_checkpoint``'s ``(load_path, client_state)`` and
the restored step count and learning rate, against numbers DeepSpeed 0.19.8 gave."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jzero
from jzero.errors import ConfigError, JZeroError, NotSupportedError
from jzero.train.deepspeed_engine import DeepSpeedEngine
from jzero.train.deepspeed_names import NAMES, markdown_table

from deepspeed_engine_names import ALL_NAMES, ATTRIBUTES, METHODS, PROPERTIES

ROOT = Path(__file__).parents[2]

# DeepSpeed 0.19.8 on CPU (torch 2.13.0), ZeRO-0, this CONFIG on a Linear(8, 4) (its lr does not
# depend on the model): engine.get_lr() after 4 steps, and after load_checkpoint of that run.
DEEPSPEED_LR_AFTER_4 = 0.0006020599913279623
DEEPSPEED_LR_AFTER = [0.0, 0.0, 0.00030102999566398113, 0.0004771212547196624,
                      0.0006020599913279623]  # get_lr() after 0, 1, ..., 4 steps

CONFIG = {"train_batch_size": 16,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 10}},
          "zero_optimization": {"stage": 2}}


class Regressor(nnx.Module):
  """A model whose output is its loss when given targets (DeepSpeed's convention)."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(8, 16, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x, y=None):
    pred = self.out(nnx.relu(self.hidden(x)))
    return pred if y is None else jnp.mean((pred - y) ** 2)


def _batches(n: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(16, 8)).astype(np.float32),
           "y": rng.normal(size=(16, 4)).astype(np.float32)} for _ in range(n)]


def _deepspeed(config: dict | None = None, **kw):
  model = Regressor(nnx.Rngs(0))
  return jzero.initialize(model=model, model_parameters=nnx.state(model, nnx.Param),
                          config=config or CONFIG, **kw)


def _ulps(jzero_lr: float, deepspeed_lr: float) -> int:
  """float32 ulps between jzero's learning rate -- the float32 its step uses, computed in float32
  (jzero.train.optim) -- and DeepSpeed's Python float rounded to float32."""
  return abs(int(np.float32(jzero_lr).view(np.int32)) - int(np.float32(deepspeed_lr).view(np.int32)))


def _train(engine, batches) -> list[float]:
  losses = []
  for batch in batches:
    loss = engine(**batch)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
  return losses


# --- every public name of DeepSpeed's engine -------------------------------------------------------


def test_the_table_is_deepspeeds_list():
  """The adapter's table holds exactly the names written down from DeepSpeed 0.19.8's source, as
  DeepSpeed has them (method or attribute); refused rows say why."""
  assert len(ALL_NAMES) == len(set(ALL_NAMES)) == 261
  assert sorted(NAMES) == sorted(ALL_NAMES)
  for name in METHODS:
    assert NAMES[name].kind == "method", name
  for name in ATTRIBUTES + PROPERTIES:
    assert NAMES[name].kind == "attribute", name
  assert all(len(row.note) > 10 for row in NAMES.values() if row.status != "works")


# getters and calls whose arguments or effects other tests exercise
_CALLED_ELSEWHERE = {"forward", "backward", "step", "save_checkpoint", "load_checkpoint",
                     "deepspeed_io", "is_map_style_dataset", "is_iterable_style_dataset",
                     "destroy", "train", "eval", "get_mom"}


def test_every_name_works_or_is_a_jzero_error_naming_jzeros_way():
  engine, *_ = _deepspeed()
  _train(engine, _batches(1))
  for name in ALL_NAMES:
    row = NAMES[name]
    if row.status == "refused":
      with pytest.raises(JZeroError, match=re.escape(row.note)):
        value = getattr(engine, name)
        value()  # a method: refused when called (hasattr still answers)
      continue
    value = getattr(engine, name)  # never an AttributeError
    if row.kind == "method" and name not in _CALLED_ELSEWHERE:
      value()
  # jzero's own engine names DeepSpeed's, and the 4-tuple, rather than an AttributeError
  for name in ("gradient_accumulation_steps", "global_steps", "get_lr", "module", "backward"):
    with pytest.raises(JZeroError, match=r"first of initialize's 4-tuple"):
      getattr(engine.jzero_engine, name)
  with pytest.raises(AttributeError):
    engine.no_such_name
  assert not hasattr(engine.jzero_engine, "no_such_name")


def test_config_getters_read_the_resolved_config():
  config = {**CONFIG, "gradient_clipping": 0.5, "steps_per_print": 7,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                  "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
            "bf16": {"enabled": True}}
  engine, *_ = _deepspeed(config, hidden_size=16)
  assert engine.get_batch_info() == (16, 2, 1)  # 8 devices
  assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
          engine.gradient_accumulation_steps()) == (16, 2, 1)
  assert (engine.zero_optimization(), engine.zero_optimization_stage(),
          engine.zero_optimization_partition_weights(), engine.zero_cpu_offload(),
          engine.zero_use_cpu_optimizer(), engine.zero_nvme_offload_optimizer()) == (
              True, 3, True, True, True, False)
  assert (engine.bfloat16_enabled(), engine.fp16_enabled(), engine.dynamic_loss_scale(),
          engine.dynamic_loss_scale_args()) == (True, False, False, None)
  assert (engine.gradient_clipping(), engine.steps_per_print(),
          engine.zero_reduce_bucket_size()) == (0.5, 7, 16 * 16)  # "auto": H^2, H = 16
  assert engine.optimizer_name() == "adam" and engine.get_mom() == [(0.8, 0.999)]
  assert engine.scheduler_name() == "WarmupLR"
  assert engine.zero_offload_optimizer()["device"] == "cpu"
  assert engine.get_data_types() == (np.dtype(jnp.bfloat16), np.dtype("float32"))
  assert (engine.world_size, engine.dp_world_size, engine.mp_world_size,
          engine.global_rank, engine.local_rank) == (8, 8, 1, 0, 0)
  assert engine.config["train_batch_size"] == 16
  assert engine.param_names == ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]


def test_deepspeed_io_gives_global_batches_of_a_dataset():
  engine, *_ = _deepspeed()
  samples = [(np.full(8, i, np.float32), np.full(4, i, np.float32)) for i in range(40)]
  assert engine.is_map_style_dataset(samples) and not engine.is_iterable_style_dataset(samples)
  assert engine.is_iterable_style_dataset(iter(samples))
  loader = engine.deepspeed_io(samples)
  assert len(loader) == 2 and [b[0].shape for b in loader] == [(16, 8), (16, 8)]
  with pytest.raises(JZeroError, match=r"global batches of train_batch_size = 16"):
    engine.deepspeed_io(samples, batch_size=2)


# --- initialize's call shape ----------------------------------------------------------------------


def test_deepspeeds_initialize_call_shape(tmp_path):
  """args.deepspeed_config is the config; no loss_fn: the model's output is the loss."""
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(CONFIG))
  args = argparse.Namespace(deepspeed_config=str(path), local_rank=-1, deepspeed=True)
  model = Regressor(nnx.Rngs(0))
  engine, optimizer, loader, scheduler = jzero.initialize(
      args=args, model=model, model_parameters=nnx.state(model, nnx.Param))
  assert isinstance(engine, DeepSpeedEngine) and loader is None
  assert engine.jzero_engine.plan is not None  # built in initialize: an NNX model needs no batch
  assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
  assert engine.train_batch_size() == 16
  with pytest.raises(ConfigError, match=r"config twice, as config and args.deepspeed_config"):
    jzero.initialize(args=args, model=model, config=CONFIG)
  with pytest.raises(ConfigError, match=r"pass DeepSpeed's arguments by keyword"):
    jzero.initialize(args, model)
  with pytest.raises(ConfigError, match=r"needs a DeepSpeed config"):
    jzero.initialize(model=model)


@pytest.mark.parametrize("argument, match", [
    ("lr_scheduler", r"lr_scheduler=.*config's scheduler block.*inject_hyperparams"),
    ("mpu", r"mpu=.*data-parallel only"),
    ("collate_fn", r"collate_fn=.*__getitem__"),
    ("mesh_param", r"mesh_param=.*mesh="),
    ("distributed_port", r"distributed_port=.*jzero launch"),
])
def test_deepspeed_arguments_jzero_cannot_take_are_refused(argument, match):
  with pytest.raises(NotSupportedError, match=match):
    jzero.initialize(model=Regressor(nnx.Rngs(0)), config=CONFIG, **{argument: object()})


def test_model_parameters_are_all_of_the_models():
  model = Regressor(nnx.Rngs(0))
  with pytest.raises(NotSupportedError, match=r"got 2 arrays of 144 values, the model has 4 of 212"
                     r".*optax.set_to_zero"):
    jzero.initialize(model=model, config=CONFIG,
                     model_parameters=nnx.state(model.hidden, nnx.Param))
  with pytest.raises(NotSupportedError, match=r"param groups.*optax.multi_transform"):
    jzero.initialize(model=model, config=CONFIG, model_parameters=[{"params": [], "lr": 1.0}])


def test_a_model_output_that_is_not_a_loss_names_loss_fn():
  engine, *_ = jzero.initialize(model=Regressor(nnx.Rngs(0)), config=CONFIG)
  with pytest.raises(JZeroError, match=r"model returned an array of shape \(2, 4\) .*not a scalar"
                     r".*loss_fn=lambda model, batch"):
    engine(_batches(1)[0]["x"])


# --- the loop, the optimizer, the scheduler ------------------------------------------------------


def test_deepspeeds_loop_is_train_step_bit_for_bit():
  """loss = engine(**batch); engine.backward(loss); engine.step() gives train_step's losses and
  parameters exactly; global_steps, global_samples, get_lr(), the scheduler and param_groups read
  DeepSpeed's numbers at each step."""
  data = _batches(4)
  engine, optimizer, _, scheduler = _deepspeed()
  assert engine.get_lr() == [DEEPSPEED_LR_AFTER[0]] == scheduler.get_last_lr()
  assert scheduler.last_batch_iteration == -1
  losses, lrs = [], [engine.get_lr()[0]]
  for k, batch in enumerate(data, 1):
    losses += _train(engine, [batch])
    assert engine.global_steps == k and engine.global_samples == 16 * k
    lrs.append(engine.get_lr()[0])
    assert scheduler.last_batch_iteration == k - 1 and scheduler.state_dict() == {
        "last_batch_iteration": k - 1}
    assert optimizer.param_groups[0]["lr"] == engine.get_lr()[0] == scheduler.get_lr()[0]
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
  assert optimizer.param_groups[0]["betas"] == (0.8, 0.999)
  # WarmupLR's log in float32: 0, 0, 1, 2, 1 ulps from DeepSpeed's float64 (measured)
  assert [_ulps(a, b) for a, b in zip(lrs, DEEPSPEED_LR_AFTER)] == [0, 0, 1, 2, 1]

  plain = jzero.initialize(Regressor(nnx.Rngs(0)), None, CONFIG)
  state = plain.init(jax.random.key(0))
  expected = []
  for batch in data:
    state, metrics = plain.train_step(state, plain.shard_batch(batch))
    expected.append(float(metrics["loss"]))
  assert losses == expected
  for a, b in zip(jax.tree.leaves(engine.module_state_dict()),
                  jax.tree.leaves(plain.logical_params(state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_optimizer_and_scheduler_refuse_what_would_be_ignored():
  engine, optimizer, _, scheduler = _deepspeed()
  optimizer.zero_grad()
  engine.zero_grad()
  with pytest.raises(JZeroError, match=r"a learning rate set by hand would be ignored"):
    optimizer.param_groups[0]["lr"] = 0.1
  with pytest.raises(JZeroError, match=r"engine.step\(\) after loss = engine\(batch\)"):
    optimizer.step()
  with pytest.raises(JZeroError, match=r"engine.save_checkpoint"):
    optimizer.state_dict()
  with pytest.raises(JZeroError, match=r"the engine steps the config's schedule"):
    scheduler.step()
  no_scheduler, _, _, none = _deepspeed({**CONFIG, "scheduler": None})
  assert none is None and no_scheduler.lr_scheduler is None


def test_the_loop_out_of_order_is_refused_and_eval_mode_does_not_train():
  engine, *_ = _deepspeed()
  batch = _batches(1)[0]
  with pytest.raises(JZeroError, match=r"after engine.backward\(loss\)"):
    engine.step()
  loss = engine(**batch)
  with pytest.raises(JZeroError, match=r"a loss computed outside it .* has no gradient"):
    engine.backward(loss * 2)
  with pytest.raises(JZeroError, match=r"not committed yet"):
    engine(**batch)
  engine.backward(loss)
  engine.step()
  before = jax.tree.map(np.asarray, engine.module_state_dict())
  engine.eval()
  out = engine(batch["x"])  # the model's output, dropout off, no update
  assert out.shape == (16, 4) and engine.global_steps == 1
  assert jax.tree.all(jax.tree.map(np.array_equal, before,
                                   jax.tree.map(np.asarray, engine.module_state_dict())))
  engine.train()
  _train(engine, [batch])
  assert engine.global_steps == 2


def test_deepspeeds_per_micro_batch_accumulation_is_named():
  engine, *_ = _deepspeed({**CONFIG, "gradient_accumulation_steps": 2})
  micro = {k: v[:8] for k, v in _batches(1)[0].items()}
  with pytest.raises(JZeroError, match=r"got 8 rows with gradient_accumulation_steps = 2: .* "
                     r"Give engine\(batch\) the 16 rows of one step"):
    engine(**micro)
  _train(engine, _batches(1))  # the whole step's rows: one step, two micro-batches inside
  assert engine.global_steps == 1 and engine.micro_steps == 2


# --- checkpoints -----------------------------------------------------------------------------------


def test_load_checkpoint_returns_deepspeeds_pair_and_the_checkpoints_step(tmp_path):
  """After 4 steps: the DeepSpeed unpack works, global_steps == 4, get_lr() is DeepSpeed's at step
  4, and the resumed losses are the uninterrupted run's bit for bit."""
  data = _batches(7)
  through, *_ = _deepspeed()
  uninterrupted = _train(through, data)

  first, *_ = _deepspeed()
  _train(first, data[:4])
  lr_at_4 = first.get_lr()[0]
  assert first.save_checkpoint(tmp_path, client_state={"checkpoint_step": 4}) is True
  first.destroy()

  resumed, _, _, scheduler = jzero.initialize(model=Regressor(nnx.Rngs(5)), config=CONFIG)
  load_path, client_state = resumed.load_checkpoint(tmp_path)
  assert Path(load_path) == (tmp_path / "global_step4").resolve()
  assert client_state == {"checkpoint_step": 4}
  assert (resumed.global_steps, resumed.global_samples) == (4, 64)
  assert resumed.get_lr() == [lr_at_4] and _ulps(lr_at_4, DEEPSPEED_LR_AFTER_4) == 1
  assert scheduler.last_batch_iteration == 3
  assert uninterrupted[4:] == _train(resumed, data[4:])

  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.warns(jzero.JZeroWarning, match=r"holds no checkpoint .* \(None, None\)"):
    assert resumed.load_checkpoint(empty) == (None, None)


def test_load_checkpoint_weights_only_starts_the_count_again(tmp_path):
  engine, *_ = _deepspeed()
  _train(engine, _batches(2))
  engine.save_checkpoint(tmp_path, tag="two")
  engine.destroy()
  fresh, *_ = _deepspeed()
  load_path, client_state = fresh.load_checkpoint(tmp_path, "two", load_optimizer_states=False)
  assert client_state == {} and fresh.global_steps == 0 and fresh.get_lr() == [0.0]
  with pytest.raises(JZeroError, match=r"load_lr_scheduler_states=False.*load_optimizer_states"):
    fresh.load_checkpoint(tmp_path, "two", load_lr_scheduler_states=False)


# --- the docs ----------------------------------------------------------------------------------------


def test_the_docs_table_is_the_adapters():
  """docs/coming-from-deepspeed.md shows :func:`markdown_table` as it is."""
  page = (ROOT / "docs" / "coming-from-deepspeed.md").read_text()
  assert markdown_table() in page
