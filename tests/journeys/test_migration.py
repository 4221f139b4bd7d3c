"""The first hour of a user migrating from DeepSpeed: Linen models, client optimizers, messages
that speak the interface being used, the CLI's help, and DeepSpeed's ``training_data``."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jzero
from jzero.cli import build_parser
from jzero.config import Config
from jzero.errors import ConfigError, JZeroWarning, MeshError
from jzero.models import lm_loss

from zero_testing import SMALL, ds_config, gpt_factory

ROOT = Path(__file__).parents[2]


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


class LinenWithBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.BatchNorm(use_running_average=False)(x))


def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(n: int = 8) -> dict:
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(n, 8)).astype(np.float32),
          "y": rng.normal(size=(n, 4)).astype(np.float32)}


# --- Linen ---------------------------------------------------------------------------------------


def test_linen_dict_batch_without_init_inputs_says_how():
  engine = jzero.initialize(LinenMLP(), mse, ds_config(1))
  with pytest.raises(ConfigError, match=r"LinenMLP.init\(rng, batch\) failed .*calls module.init "
                     r"with the whole batch \(a dict with keys \['x', 'y'\]\).*init_inputs="):
    engine.init(jax.random.key(0), _batch())
  with pytest.raises(ConfigError, match=r"Pass a sample batch: engine.init\(rng, batch\), or "
                     r"jzero.initialize\(\.\.\., sample_batch=batch\)"):
    engine.init(jax.random.key(0))
  fixed = jzero.initialize(LinenMLP(), mse, ds_config(1), init_inputs=lambda b: (b["x"],),
                           sample_batch=_batch())
  state = fixed.init(jax.random.key(0))  # the sample batch given to initialize is used
  state, metrics = fixed.train_step(state, fixed.shard_batch(_batch()))
  assert np.isfinite(float(metrics["loss"]))


def test_linen_batchnorm_trains_its_statistics_over_the_global_batch():
  """A Linen model with nn.BatchNorm (no axis name) is accepted: its ``batch_stats`` are the
  state's ``model_state``, and one step on 8 devices of one row each moves them by the
  statistics of the whole batch of 8 (flax's momentum 0.99) -- a device's own row would have
  variance 0."""
  batch = _batch()
  engine = jzero.initialize(LinenWithBatchNorm(), mse, ds_config(1),
                            init_inputs=lambda b: (b["x"],), sample_batch=batch)
  state = engine.init(jax.random.key(0))
  assert jax.tree.map(np.shape, state.model_state) == {
      "batch_stats": {"BatchNorm_0": {"mean": (8,), "var": (8,)}}}
  state, _ = engine.train_step(state, engine.shard_batch(batch))
  stats = jax.device_get(state.model_state["batch_stats"]["BatchNorm_0"])
  np.testing.assert_allclose(stats["mean"], 0.01 * batch["x"].mean(0), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(stats["var"], 0.99 + 0.01 * batch["x"].var(0), rtol=1e-6)


# --- client optimizers and their learning rate ---------------------------------------------------


def test_client_optimizer_warns_about_dropped_blocks_and_logs_its_lr(caplog):
  cfg = ds_config(2)
  cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
  cfg["steps_per_print"] = 1
  schedule = optax.linear_schedule(1e-3, 0.0, 10)
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
  with pytest.warns(jzero.JZeroWarning, match=r"replaces the config's optimizer and scheduler "
                    r"blocks.*optax.inject_hyperparams"):
    engine = jzero.initialize(gpt_factory(SMALL), lm_loss, cfg, optimizer=tx)
  from zero_testing import batches
  data = batches(SMALL.seq_len, 8, 2)
  state = engine.init(jax.random.key(0))
  logger = logging.getLogger("jzero")
  logger.addHandler(caplog.handler)
  try:
    for i, batch in enumerate(data):
      state, metrics = engine.train_step(state, engine.shard_batch(batch))
      assert float(metrics["lr"]) == pytest.approx(float(schedule(i)))
  finally:
    logger.removeHandler(caplog.handler)
  assert "lr 1.000e-03" in caplog.text and "lr 9.000e-04" in caplog.text

  plain = jzero.initialize(gpt_factory(SMALL), lm_loss, ds_config(2) | {"steps_per_print": 1,
                                                                         "optimizer": None},
                           optimizer=optax.sgd(0.1))
  state = plain.init(jax.random.key(0))
  caplog.clear()
  logger.addHandler(caplog.handler)
  try:
    state, metrics = plain.train_step(state, plain.shard_batch(data[0]))
  finally:
    logger.removeHandler(caplog.handler)
  assert np.isnan(float(metrics["lr"])) and "step 1: loss" in caplog.text
  assert "lr" not in caplog.text.split("loss", 1)[1]  # an lr it cannot read is not logged as nan


# --- messages speak the interface being used -----------------------------------------------------


def test_bucket_warnings_only_for_values_the_user_set():
  cfg = ds_config(3)
  cfg["zero_optimization"].update({"reduce_bucket_size": "auto",
                                   "stage3_prefetch_bucket_size": "auto"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jzero.initialize(gpt_factory(SMALL), lm_loss, cfg)  # hidden size 64 fills both
  cfg["zero_optimization"]["reduce_bucket_size"] = 1000
  with pytest.warns(jzero.JZeroWarning, match=r"zero_optimization reduce_bucket_size=1000: "):
    jzero.initialize(gpt_factory(SMALL), lm_loss, cfg)


def test_warnings_of_initialize_point_at_the_users_call():
  """Every warning about the config (loading it, "auto", settings without effect, bucket sizes on
  CPU) names the line of the jzero.initialize call, not a line of jzero."""
  cfg = ds_config(2)
  cfg["zero_optimization"].update({"reduce_bucket_size": 1000, "contiguous_gradients": False})
  cfg.update({"flops_profiler": {"enabled": True}, "gradient_clipping": "auto"})
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    jzero.initialize(gpt_factory(SMALL), lm_loss, cfg)
    line = sys._getframe().f_lineno - 1
  messages = [str(w.message)[:40] for w in record]
  assert len(record) == 4, messages
  assert all((w.filename, w.lineno) == (__file__, line) for w in record), [
      (w.filename, w.lineno, str(w.message)[:40]) for w in record]


@pytest.mark.parametrize("name", ["embed_dim", "emb_dim", "hidden_size", "d_model"])
def test_auto_bucket_sizes_read_the_width_from_the_models_config(name):
  """Gemma (flax's examples) keeps its width in ``config.embed_dim``: the "auto" bucket and
  persistence sizes are derived from it as from Hugging Face's hidden_size."""
  width = dataclasses.make_dataclass("Width", [(name, int)], frozen=True)

  class Configured(nnx.Module):
    def __init__(self, rngs):
      self.config = width(24)
      self.dense = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      return self.dense(x)

  cfg = ds_config(3)
  cfg["zero_optimization"].update({"reduce_bucket_size": "auto",
                                   "stage3_param_persistence_threshold": "auto"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    engine = jzero.initialize(Configured(nnx.Rngs(0)), mse, cfg)
  zero = engine.config.zero_optimization
  assert (zero.reduce_bucket_size, zero.param_persistence_threshold) == (24 * 24, 240)


def test_mesh_error_from_python_names_the_python_way():
  with pytest.raises(MeshError, match=r"need 16 devices but 8 are present.*"
                     r"jzero.simulate_cpu_devices\(N\) before JAX starts"):
    jzero.MeshSpec.from_dict({"axes": {"node": 2, "local": 8}}).build()


def test_cli_help_is_plain_and_complete():
  parser = build_parser()
  assert "`" not in parser.format_help()
  train = next(a for a in parser._subparsers._group_actions[0].choices.items()
               if a[0] == "train")[1]
  text = train.format_help()
  assert train.description and "simulated CPU devices" in text and "--devices 0" in text
  for action in train._actions:
    if action.option_strings and action.dest != "help":
      assert action.help, f"{action.option_strings} has no help"


def test_package_description_claims_only_what_runs():
  """The description on the package index names no feature jzero refuses."""
  description = re.search(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(),
                          re.M).group(1)
  claims = {"offload": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
            "ZeRO++": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "stages 0-3": {"zero_optimization": {"stage": 3}}}
  for word, cfg in claims.items():
    if word.lower() in description.lower():
      Config.load({"train_batch_size": 8, **cfg}).check_supported()  # raises if refused


# --- DeepSpeed's training_data -------------------------------------------------------------------


class Samples:
  """An indexable dataset of dict samples, as a user's torch-style Dataset would be."""

  def __init__(self, n: int):
    data = _batch(n)
    self.x, self.y = data["x"], data["y"]

  def __len__(self):
    return len(self.x)

  def __getitem__(self, i):
    return {"x": self.x[i], "y": self.y[i]}


class Linear8x4(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)) * 0.1)

  def __call__(self, x):
    return x @ self.w


def _mlp_engine(config: dict | None = None, **kw):
  return jzero.initialize(Linear8x4, mse, config or ds_config(2, micro=2), **kw)


def test_training_data_gives_placed_global_batches_as_a_function_of_the_step():
  dataset = Samples(50)  # 50 samples, global batch 16: 3 batches per epoch, 2 samples dropped
  with pytest.warns(JZeroWarning, match=r"50 samples make 3 batches of train_batch_size 16 per "
                    r"epoch; the last 2 samples .* dataloader_drop_last"):
    engine = _mlp_engine(training_data=dataset, seed=3)
  loader = engine.training_dataloader
  assert len(loader) == 3
  epoch0 = list(loader)
  epoch1 = list(loader)
  assert len(epoch0) == 3 and all(b["x"].shape == (16, 8) for b in epoch0)
  assert epoch0[0]["x"].sharding == jax.sharding.NamedSharding(engine.mesh.mesh,
                                                               engine.mesh.batch_spec())
  seen = np.concatenate([loader.indices(s) for s in range(3)])
  assert len(set(seen.tolist())) == 48 and not np.array_equal(seen, np.arange(48))  # shuffled
  assert not np.array_equal(loader.indices(0), loader.indices(3))  # a new order each epoch
  np.testing.assert_array_equal(np.asarray(epoch1[1]["x"]), dataset.x[loader.indices(4)])
  resumed = loader.batches(start=4)
  np.testing.assert_array_equal(np.asarray(next(resumed)["y"]), np.asarray(epoch1[1]["y"]))

  state = engine.init(jax.random.key(0))
  for batch in epoch0:
    state, metrics = engine.train_step(state, batch)
  manual = _mlp_engine()
  mstate = manual.init(jax.random.key(0))
  for step in range(3):
    host = {k: v[loader.indices(step)] for k, v in (("x", dataset.x), ("y", dataset.y))}
    mstate, mmetrics = manual.train_step(mstate, manual.shard_batch(host))
  assert float(metrics["loss"]) == float(mmetrics["loss"])


def test_dataloader_drop_last_true_drops_the_remainder_quietly():
  config = {**ds_config(2, micro=2), "dataloader_drop_last": True}
  with warnings.catch_warnings():
    warnings.simplefilter("error", JZeroWarning)
    engine = _mlp_engine(config, training_data=Samples(50))
  assert len(engine.training_dataloader) == 3


def test_training_data_too_small_or_not_indexable_is_named():
  with pytest.raises(jzero.DataError, match="training_data has 10 samples, fewer than one global "
                     "batch of train_batch_size = 16"):
    _mlp_engine(training_data=Samples(10))
  with pytest.raises(jzero.DataError, match="must be an indexable dataset"):
    _mlp_engine(training_data=iter(range(3)))
