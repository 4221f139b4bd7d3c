"""Bad input gets one clear paragraph naming the key / file, before any device work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jzero
from jzero.tiers import where
from zero_testing import ds_config, make_engine

DS_CONFIGS = Path(__file__).parents[1] / "data" / "ds_configs"


def _one_paragraph(message: str) -> None:
  assert "\n\n" not in message and "Traceback" not in message


@pytest.mark.parametrize("config, key", [
    ({**ds_config(2), "zero_optimization": {"stgae": 2}}, "zero_optimization.stgae"),
    ({**ds_config(2), "zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({**ds_config(2), "zero_optimization": {"stage": "two"}}, "zero_optimization.stage"),
    ({**ds_config(2), "gradient_clipping": "high"}, "gradient_clipping"),
    ({**ds_config(2), "train_batch_size": 33, "train_micro_batch_size_per_gpu": 17,
      "gradient_accumulation_steps": 2}, "train_batch_size"),
    ({**ds_config(2), "fp16": {"enabled": True, "loss_scael": 0}}, "fp16.loss_scael"),
])
def test_bad_config_names_the_key(config, key):
  with pytest.raises(jzero.ConfigError) as e:
    make_engine(config)
  assert key in str(e.value)
  _one_paragraph(str(e.value))


def test_batch_mismatch_names_all_three_numbers():
  cfg = {**ds_config(2), "train_batch_size": 33, "train_micro_batch_size_per_gpu": 2,
         "gradient_accumulation_steps": 2}
  with pytest.raises(jzero.ConfigError) as e:
    make_engine(cfg)
  for text in ("33", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "8"):
    assert text in str(e.value)


def test_missing_config_file(tmp_path):
  missing = tmp_path / "nope.json"
  with pytest.raises(jzero.ConfigError) as e:
    make_engine(str(missing))
  assert str(missing) in str(e.value)


def test_mesh_that_does_not_fit_the_devices(tmp_path):
  mesh = tmp_path / "mesh.yaml"
  mesh.write_text("axes: {node: 3, local: 2}\n")
  with pytest.raises(jzero.MeshError) as e:
    make_engine(2, mesh=str(mesh))
  assert str(mesh) in str(e.value) and "8 are present" in str(e.value)
  _one_paragraph(str(e.value))


def test_mesh_file_errors(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("axes: {data: 8}\nzero_axes: [model]\n")
  with pytest.raises(jzero.MeshError, match="zero_axes names \\['model'\\]"):
    jzero.MeshSpec.load(bad)
  with pytest.raises(jzero.MeshError, match="does not exist"):
    jzero.MeshSpec.load(tmp_path / "missing.yaml")


def test_zero_infinity_config_is_refused_only_for_its_missing_nvme_directory():
  """SGLang's ZeRO-Infinity config (params on NVMe) loads; its nvme_path does not exist here, and
  the error names the key and the fix before any device work."""
  mesh = jzero.MeshSpec.from_dict({"axes": {"data": 1}}).build(jax.devices()[:1])
  name = "deepspeedai_DeepSpeedExamples__inference_sglang_ds_offload_nvme_aio.json"
  with pytest.raises(jzero.ConfigError) as e:
    make_engine(str(DS_CONFIGS / name), mesh=mesh)
  message = str(e.value)
  assert "zero_optimization.offload_param.nvme_path=/local_nvme/sglang: no such directory" in message
  assert "mkdir -p /local_nvme/sglang" in message
  _one_paragraph(message)


def test_shipped_offload_configs_both_run():
  """ds_zero2_offload.json (optimizer offload) and ds_zero3_offload.json (optimizer and
  parameter offload), the DeepSpeed docs' examples, build engines whose plans offload."""
  configs = Path(__file__).parents[2] / "configs"
  engine = make_engine(str(configs / "ds_zero2_offload.json"))
  engine.init(jax.random.key(0))
  # their AdamW: the host Adam's tier (gradients to host memory, Adam on the host's cores)
  host_adam = lambda plan: {l.state_tier for l in plan.leaf_list() if l.shard_dim is not None}
  assert host_adam(engine.plan) == {"host_step"}
  engine = make_engine(str(configs / "ds_zero3_offload.json"))
  engine.init(jax.random.key(0))
  # every leaf of this small model is under the config's persistence threshold (1e5), so the
  # params stay on the device as DeepSpeed keeps persistent params
  # (tests/tiers/test_param_offload.py offloads a model's partitioned params)
  assert host_adam(engine.plan) == {"host_step"} and not where.param_offloads(engine.plan)
  assert engine.config.zero_optimization.offload_param.device == "cpu"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shipped_stage_configs_resolve(stage):
  path = Path(__file__).parents[2] / "configs" / f"zero{stage}.json"
  engine = make_engine(str(path), total_num_steps=100)
  assert engine.config.zero_optimization.stage == stage and engine.global_batch_size == 32


def test_wrong_batch_shape_is_a_data_error():
  engine = make_engine(1)
  with pytest.raises(jzero.DataError, match="train_batch_size = 8"):
    engine.shard_batch({"tokens": __import__("numpy").zeros((7, 33), "int32")})


def _cli(*args, cwd=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True,
                        env=env, cwd=cwd, timeout=300)


def test_cli_reports_bad_config_without_traceback(tmp_path):
  cfg = tmp_path / "cfg.json"
  cfg.write_text(json.dumps({**ds_config(3), "zero_optimization": {"stage": 3, "prefetch_bucket": 5}}))
  out = _cli("train", "--config", str(cfg), "--steps", "1")
  assert out.returncode == 2
  assert "zero_optimization.prefetch_bucket" in out.stderr
  assert "Traceback" not in out.stderr and "jax" not in out.stderr.lower()


class _Tokens(nnx.Module):
  """Per-position features (batch, positions, 16) -> logits: any number of positions, width 16."""

  def __init__(self, rngs: nnx.Rngs):
    self.proj = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.proj(x)


class _LinenTokens(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(x)


def _mean_square(model, batch):
  return jnp.mean(model(batch["x"]) ** 2)


def test_a_batch_of_python_lists_says_pass_arrays():
  """Python lists (as a tokenizer returns rows) are not arrays: shard_batch, train_step and
  eval_loss say which leaf and how to make it one, before any device work."""
  engine = make_engine(1, _Tokens, _mean_square)
  state = engine.init(jax.random.key(0))
  rows = [[[float(i)] * 16] * 4 for i in range(8)]
  calls = {"shard_batch": lambda: engine.shard_batch({"x": rows}),
           "train_step": lambda: engine.train_step(state, {"x": rows}),
           "eval_loss": lambda: engine.eval_loss(state, {"x": rows})}
  for name, call in calls.items():
    with pytest.raises(jzero.DataError) as e:
      call()
    message = str(e.value)
    assert "batch leaf ['x'] is a Python list" in message, name
    assert "np.asarray(batch['x'])" in message and "return_tensors='np'" in message, name
    _one_paragraph(message)
  state, metrics = engine.train_step(state, engine.shard_batch({"x": np.asarray(rows, np.float32)}))
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_a_later_batch_of_another_feature_width_names_the_leaf_and_both_shapes(kind):
  """The step is compiled for the first batch's shapes; a later batch with more positions is
  traced anew and trains, but one whose feature width the model cannot take is a DataError naming
  the leaf, the shape the step was compiled for and the new one (not the model's dot_general
  TypeError), before any device work: the state is not donated and trains on."""
  batch = lambda positions, width: {
      "x": np.random.default_rng(positions).normal(size=(8, positions, width)).astype(np.float32)}
  config = ds_config(3, stage3_param_persistence_threshold=0)
  if kind == "nnx":
    engine = make_engine(config, _Tokens, _mean_square)
  else:
    engine = make_engine(config, _LinenTokens(), _mean_square,
                         init_inputs=lambda b: (b["x"],), sample_batch=batch(4, 16))
  state = engine.init(jax.random.key(0))
  state, _ = engine.train_step(state, engine.shard_batch(batch(4, 16)))
  state, _ = engine.train_step(state, engine.shard_batch(batch(6, 16)))
  for call in (lambda: engine.shard_batch(batch(4, 24)),
               lambda: engine.train_step(state, batch(4, 24)),
               lambda: engine.eval_loss(state, batch(4, 24))):
    with pytest.raises(jzero.DataError) as e:
      call()
    message = str(e.value)
    assert ("batch leaf ['x'] has shape (8, 4, 24); the step was compiled for (8, 4, 16)"
            in message), message
    assert "TypeError" in message or "ScopeParamShapeError" in message, message
    _one_paragraph(message)
  state, metrics = engine.train_step(state, engine.shard_batch(batch(4, 16)))
  assert np.isfinite(float(metrics["loss"]))


# -- issue 48: what the config or a batch can carry, checked -------------------------------------


@pytest.mark.parametrize("params, message", [
    ({"lr": -0.01}, "optimizer.params.lr: must be >= 0, got -0.01"),
    ({"eps": -1}, "optimizer.params.eps: must be >= 0, got -1"),
    ({"weight_decay": -0.1}, "optimizer.params.weight_decay: must be >= 0, got -0.1"),
    ({"betas": [1.5, 0.999]}, "optimizer.params.betas.0: must be in [0, 1) (a moment's decay "
                              "rate), got 1.5"),
    ({"betas": [0.9, 1.0]}, "optimizer.params.betas.1: must be in [0, 1)"),
    ({"betas": [0.9]}, "optimizer.params.betas: expected two numbers (e.g. [0.9, 0.999]), got "
                       "[0.9]; give exactly two."),
    ({"lr": float("nan")}, "optimizer.params: lr must be a finite number, got NaN"),
    ({"lr": float("inf")}, "optimizer.params: lr must be a finite number, got Infinity"),
    ({"betas": [0.9, float("nan")]}, "optimizer.params: betas must be finite numbers, got "
                                     "[0.9, NaN]"),
])
def test_optimizer_hyperparameters_are_checked_as_torch_checks_them(params, message):
  """Signs and ranges torch.optim refuses (DeepSpeed's fused optimizers train on with them); a
  NaN is named as such (it was "expected a number, got null": the config is written back as
  JSON first); a pair of betas with one number says so (it spoke of a HF Trainer's steps)."""
  cfg = {**ds_config(2), "optimizer": {"type": "AdamW", "params": params}}
  with pytest.raises(jzero.ConfigError) as e:
    make_engine(cfg)
  assert message in str(e.value), str(e.value)
  assert "HF Trainer" not in str(e.value) and "null" not in str(e.value)


def test_schedule_learning_rates_are_checked_too():
  cfg = {**ds_config(2), "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -1e-3}}}
  with pytest.raises(jzero.ConfigError, match=r"scheduler.params.warmup_max_lr: must be >= 0"):
    make_engine(cfg)


class _Embedder(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)

  def __call__(self, tokens):
    return self.embed(tokens)


def _embedding_loss(model, batch):
  return jnp.mean(model(batch["tokens"]) ** 2)


def test_token_ids_that_index_no_row_are_data_errors():
  """A negative id (JAX wraps it to another row: the step trains on another token) is refused
  naming the leaf, the id and the valid range; torch's ignore index -100 passes (labels); float
  ids -- flax says only "Input type must be an integer" -- are a DataError naming the leaf and its
  dtype, raised while the step is traced: the state given is not donated and trains on."""
  engine = make_engine(2, _Embedder, _embedding_loss)
  state = engine.init(jax.random.key(0))
  tokens = np.ones((8, 4), np.int32)
  with pytest.raises(jzero.DataError) as e:
    engine.shard_batch({"tokens": np.where(tokens > 0, -5, 0)})
  assert ("batch leaf ['tokens'] holds the id -5, but ids index the model's embedding table from "
          "0 (ids 0..15)") in str(e.value)
  _one_paragraph(str(e.value))
  from jzero.train import input_checks
  input_checks.check_input_ids(engine.plan, {"labels": np.full((8, 4), -100, np.int32)})
  with pytest.raises(jzero.DataError) as e:
    engine.train_step(state, engine.shard_batch({"tokens": tokens.astype(np.float32)}))
  message = str(e.value)
  assert ("the model cannot take this batch (ValueError: Input type must be an integer or "
          "unsigned integer.); its leaves are ['tokens']: float32 (8, 4). If ['tokens'] holds "
          "token ids, give integers (np.int32)") in message, message
  assert "the state passed in is still usable" in message
  _one_paragraph(message)
  state, metrics = engine.train_step(state, engine.shard_batch({"tokens": tokens}))
  assert np.isfinite(float(metrics["loss"]))


def test_a_lost_peer_seen_when_the_loop_reads_the_loss_is_explained(monkeypatch):
  """With several processes the step runs asynchronously: a peer lost during it shows when
  train_loop reads the loss, outside train_step -- that raw Gloo error is the jzero one too."""
  from jzero.train.loop import train_loop

  class Lost:
    def __float__(self):
      raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read "
                                       "error [127.0.0.1]:4804: Connection reset by peer")

  class Engine:
    def train_step(self, state, batch):
      return state, {"loss": Lost()}

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(jzero.JZeroError, match=r"process 0: a collective failed, most likely "
                                             r"because another process of the job is gone") as e:
    train_loop(Engine(), None, lambda step: None, 3, progress=False)
  assert isinstance(e.value.__cause__, jax.errors.JaxRuntimeError)
