"""What a user migrating from DeepSpeed tries in their first hour: a loss with dropout (``rng``)
and aux outputs in training and evaluation; DeepSpeed's call shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.errors import JZeroError, JZeroWarning

from zero_testing import SAME_MATH, loss_of_params

N = 8
WIDTH, CLASSES, ROWS = 32, 4, 16


class DropoutNet(nnx.Module):
  """An MLP with dropout as docs/getting-started.md writes it: no key of its own, one from the
  loss."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, CLASSES, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rng=None):
    h = self.drop(jax.nn.relu(self.hidden(x)), deterministic=rng is None, rngs=rng)
    return self.out(h)


def classify(model, batch, rng=None):
  logits = model(batch["x"], rng=rng)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def _batch(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
          "y": rng.integers(0, CLASSES, size=ROWS).astype(np.int32)}


def _config(stage: int) -> dict:
  return {"train_micro_batch_size_per_gpu": ROWS // N, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": stage}}


def test_eval_loss_with_rng_loss_turns_dropout_off_and_returns_aux():
  """``eval_loss`` calls a loss that takes ``rng`` with ``rng=None`` (dropout off) and returns its
  aux: equal to the same loss computed on one device with the logical params, and the same twice;
  ``train_step`` passes keys (dropout on: its loss differs from evaluation of the same params)."""
  engine = jzero.initialize(DropoutNet, classify, _config(3))
  state = engine.init(jax.random.key(0), _batch(0))
  batch = _batch(1)
  loss, aux = engine.eval_loss(state, batch)
  assert isinstance(loss, float) and set(aux) == {"accuracy"} and isinstance(aux["accuracy"], float)
  assert engine.eval_loss(state, batch) == (loss, aux)

  params = jax.tree.map(np.asarray, engine.logical_params(state))
  ref_loss, ref_aux = loss_of_params(DropoutNet, classify)(params, batch)
  # one forward pass of the same params, 8 devices against one: a mean over the batch in another
  # order and the dots' other tilings, far below SAME_MATH's per-step bound
  np.testing.assert_allclose(loss, float(ref_loss), rtol=SAME_MATH)
  np.testing.assert_allclose(aux["accuracy"], float(ref_aux["accuracy"]), rtol=SAME_MATH)

  state, metrics = engine.train_step(state, engine.shard_batch(batch))
  assert abs(float(metrics["loss"]) - loss) > 1e-4, "dropout was off in training"
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0


class TrainModeDropoutNet(nnx.Module):
  """Dropout as Gemma builds it: `nnx.Dropout(rate, deterministic=False)` (train mode in the
  module), the key given at call time."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, CLASSES, rngs=rngs)
    self.drop = nnx.Dropout(0.5, deterministic=False)

  def __call__(self, x, rng=None):
    return self.out(self.drop(jax.nn.relu(self.hidden(x)), rngs=rng))


def classify_in_mode(model, batch, rng=None):
  logits = model(batch["x"], rng=rng)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_loss_puts_an_nnx_model_in_eval_mode_for_that_call_only(stage):
  """A model whose Dropout is in train mode (deterministic=False): ``eval_loss`` evaluates it in
  ``model.eval()`` mode (dropout off; equal to the eval-mode model on one device), and training
  afterwards still drops out (the engine's model is not switched to eval)."""
  engine = jzero.initialize(TrainModeDropoutNet, classify_in_mode, _config(stage))
  state = engine.init(jax.random.key(0), _batch(0))
  batch = _batch(1)
  loss = engine.eval_loss(state, batch)

  params = jax.tree.map(np.asarray, engine.logical_params(state))
  graphdef, template = nnx.split(nnx.eval_shape(lambda: TrainModeDropoutNet(nnx.Rngs(0))),
                                 nnx.Param)
  nnx.replace_by_pure_dict(template, params)
  reference = nnx.merge(graphdef, template)
  reference.eval()
  np.testing.assert_allclose(loss, float(classify_in_mode(reference, batch)), rtol=SAME_MATH)

  state, metrics = engine.train_step(state, engine.shard_batch(batch))
  assert abs(float(metrics["loss"]) - loss) > 1e-4, "dropout was off in training"
  assert engine.eval_loss(state, batch) != loss


def test_eval_loss_of_a_plain_loss_is_a_float():
  engine = jzero.initialize(DropoutNet, lambda m, b: classify(m, b)[0], _config(1))
  state = engine.init(jax.random.key(0), _batch(0))
  assert isinstance(engine.eval_loss(state, _batch(1)), float)


def test_deepspeed_call_shapes(tmp_path):
  """DeepSpeed's 4-tuple is an engine that holds the state: its loop, ``module``, ``global_steps``
  and ``get_lr()`` work, and its steps are jzero's ``train_step`` exactly; jzero's own engine
  refuses DeepSpeed's calls, naming the 4-tuple and ``train_step``
  (tests/train/test_deepspeed_engine.py has every name)."""
  config = {**_config(2), "scheduler": {"type": "WarmupLR", "params": {
      "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}}
  jzero_engine = jzero.initialize(DropoutNet, classify, config)
  engine, optimizer, dataloader, scheduler = jzero_engine
  assert engine.jzero_engine is jzero_engine and optimizer.tx is jzero_engine.tx
  assert dataloader is None
  assert engine.global_steps == 0 and engine.get_lr() == [float(scheduler(0))]
  for step in range(3):
    loss = engine(_batch(step))
    engine.backward(loss)
    engine.step()
  assert isinstance(engine.module, DropoutNet)
  assert engine.global_steps == 3 == int(engine.state.step)
  # the lr the next step uses, as DeepSpeed's get_lr() after step(): the schedule at count 3
  assert engine.get_lr() == [float(scheduler(3))] and 0 < engine.get_lr()[0] < 1e-2

  plain = jzero.initialize(DropoutNet, classify, config)
  state = plain.init(jax.random.key(0))
  for step in range(3):
    state, metrics = plain.train_step(state, plain.shard_batch(_batch(step)))
  assert float(metrics["loss"]) == loss.item()
  for call in (lambda: plain(_batch(0)), lambda: plain.backward(metrics["loss"]),
               lambda: plain.step()):
    with pytest.raises(JZeroError, match=r"state, metrics = engine\.train_step\(state, batch\)"):
      call()
  with pytest.raises(JZeroError, match=r"engine\.save_checkpoint\(state, directory, tag\)"):
    plain.save_checkpoint(str(tmp_path), tag="x")
  assert not any(tmp_path.iterdir())


def test_a_per_example_loss_is_a_clear_error():
  per_example = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"])
  engine = jzero.initialize(DropoutNet, per_example, _config(2))
  state = engine.init(jax.random.key(0), _batch(0))
  with pytest.raises(JZeroError, match=r"loss of shape \(2,\); .* return loss\.mean\(\)"):
    engine.train_step(state, engine.shard_batch(_batch(1)))
  with pytest.raises(JZeroError, match=r"return loss\.mean\(\)"):
    engine.eval_loss(state, _batch(1))


def test_restoring_into_another_model_names_the_leaves_it_lacks(tmp_path):
  """A checkpoint of a tied-embedding GPT restored into an untied one: the message names the
  model's leaf the checkpoint lacks and no empty list of the other kind."""
  from jzero.errors import CheckpointError
  from jzero.models import GPT, lm_loss
  from zero_testing import SMALL, ds_config
  import dataclasses
  make = lambda cfg: jzero.initialize(lambda rngs: GPT(cfg, rngs=rngs), lm_loss, ds_config(1))
  engine = make(SMALL)
  engine.save_checkpoint(engine.init(jax.random.key(0)), tmp_path, 1)
  engine.wait_for_checkpoints()
  untied = make(dataclasses.replace(SMALL, tie_embeddings=False))
  with pytest.raises(CheckpointError) as info:
    untied.load_checkpoint(tmp_path)
  message = str(info.value)
  assert "written for another model: the model's leaves ['head" in message, message
  assert "[]" not in message and "jzero inspect" in message


def test_simulate_cpu_devices_under_the_launcher_says_the_launcher_decides(monkeypatch):
  """Under ``jzero launch --num_cpu_devices N`` the launcher's count is used, and a script's own
  different count is a warning, not silently dropped."""
  monkeypatch.setenv("JZERO_NUM_CPU_DEVICES", str(jax.device_count()))
  with pytest.warns(JZeroWarning, match=r"--num_cpu_devices 8.*using 8"):
    jzero.simulate_cpu_devices(2)  # this process already has the launcher's 8: no error
  assert jax.device_count() == 8


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_step_with_a_nan_row_is_skipped_and_said(stage):
  """fp32: one NaN input row makes the gradient NaN; the step is skipped (parameters unchanged,
  metrics flag and count it), a warning says so once, and training goes on."""
  loss = lambda m, b: classify(m, b)[0]
  engine = jzero.initialize(DropoutNet, loss, _config(stage))
  state = engine.init(jax.random.key(0), _batch(0))
  state, _ = engine.train_step(state, engine.shard_batch(_batch(0)))
  before = jax.tree.map(np.asarray, engine.logical_params(state))
  poisoned = _batch(1)
  poisoned["x"][3] = np.nan
  state, metrics = engine.train_step(state, engine.shard_batch(poisoned))
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1 == int(state.skipped)
  after = jax.tree.map(np.asarray, engine.logical_params(state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  with pytest.warns(JZeroWarning, match=r"step 2: the gradient was not finite .* skipped"):
    state, metrics = engine.train_step(state, engine.shard_batch(_batch(2)))
  assert not bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(engine.logical_params(state)))


def test_token_ids_past_the_embedding_are_a_data_error_unless_switched_off():
  """An id past the embedding table would be a NaN lookup: shard_batch and the engine's data
  loader refuse it naming the leaf, the id and the table; engine.check_input_ids = False lets it
  through (the fp32 step is then skipped, as the NaN test above shows)."""
  from jzero.models import GPT, GPTConfig
  from jzero.models.gpt import lm_loss
  model = GPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8)  # vocab 256
  config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam",
            "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
  tokens = np.random.default_rng(0).integers(0, 256, (jax.device_count(), 9)).astype(np.int32)
  engine = jzero.initialize(lambda rngs: GPT(model, rngs=rngs), lm_loss, config)
  engine.init(jax.random.key(0), {"tokens": tokens})
  engine.shard_batch({"tokens": tokens})  # ids 0..255: fine
  bad = tokens.copy()
  bad[1, 4] = 300
  with pytest.raises(jzero.DataError, match=r"\['tokens'\] holds the id 300.* 256 rows"):
    engine.shard_batch({"tokens": bad})
  engine.check_input_ids = False
  engine.shard_batch({"tokens": bad})
  data = [{"tokens": row} for row in np.concatenate([tokens, bad])]
  loader_engine = jzero.initialize(lambda rngs: GPT(model, rngs=rngs), lm_loss, config,
                                   training_data=data, shuffle=False)
  loader_engine.init(jax.random.key(0), {"tokens": tokens})
  next(loader_engine.training_dataloader.batches(0))  # the good rows
  with pytest.raises(jzero.DataError, match="holds the id 300"):
    next(loader_engine.training_dataloader.batches(1))  # the second half: bad[1] has 300
