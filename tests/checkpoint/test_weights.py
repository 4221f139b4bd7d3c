"""Weights in by shard: ``checkpoint.load_weights`` places each leaf in the engine's plan, each
process reading only the blocks its devices hold, from a safetensors file, a Hugging Face index of
several or a params-only Orbax checkpoint -- and the state it gives equals the whole-file load's.
bench/weights_rss.py measures the peak host memory per process on a 200 MB model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from flax import nnx

from jzero import checkpoint
from jzero.checkpoint.layout import nest
from jzero.errors import CheckpointError, ConfigError
from jzero.sharding.plan import flatten_paths
from zero_testing import ds_config, free_port, make_engine, subprocess_env

WORKER = Path(__file__).parents[1] / "weights_worker.py"


class _Odd(nnx.Module):
  """Over 8 devices: ``a/kernel`` [12, 20] is split along a padded dim 1 (24), ``b/kernel``
  [20, 16] along dim 1 unpadded, ``emb`` [40, 6] along dim 0; the biases stay replicated under
  ZeRO-3 (below the persistence threshold of the config below)."""

  def __init__(self, rngs: nnx.Rngs):
    self.a = nnx.Linear(12, 20, rngs=rngs)
    self.b = nnx.Linear(20, 16, rngs=rngs)
    self.emb = nnx.Param(jnp.zeros((40, 6)))

  def __call__(self, x):
    return self.b(self.a(x)) + self.emb[:16, :1].T


def _engine(stage: int, precision: str = "fp32"):
  zero = {"stage3_param_persistence_threshold": 30} if stage == 3 else {}
  return make_engine(ds_config(stage, precision=precision, **zero), _Odd,
                     lambda model, batch: jnp.mean(model(batch["x"]) ** 2))


def _weights(engine) -> dict[str, np.ndarray]:
  """Random weights of the engine's model, by leaf path."""
  rng = np.random.default_rng(0)
  model = engine.model.abstract_params(jax.random.key(0), None)
  return {p: rng.standard_normal(x.shape).astype(np.float32)
          for p, x in flatten_paths(model).items()}


def _write_index(directory: Path, weights: dict[str, np.ndarray], files: int) -> Path:
  """A Hugging Face model directory: ``weights`` over ``files`` safetensors files + the index."""
  directory.mkdir()
  names = sorted(weights)
  weight_map = {}
  for i in range(files):
    file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
    part = {n: weights[n] for n in names[i::files]}
    safetensors.numpy.save_file(part, str(directory / file))
    weight_map.update((n, file) for n in part)
  (directory / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(x.nbytes for x in weights.values())},
       "weight_map": weight_map}))
  return directory


def _state_shards(state) -> list[tuple]:
  return [(s.index, np.asarray(s.data)) for x in jax.tree.leaves(state)
          for s in x.addressable_shards]


def _whole_file_state(engine, path):
  """The train state from the whole-file path: every tensor read into numpy, logical shapes."""
  whole = checkpoint.read_weights(path)
  model = engine.model.abstract_params(jax.random.key(0), None)
  return engine.init(jax.random.key(1), params=jax.tree.unflatten(
      jax.tree.structure(model), [np.asarray(whole[p], x.dtype)
                                  for p, x in flatten_paths(model).items()]))


@pytest.mark.parametrize("stage,precision", [(3, "fp32"), (1, "bf16")])
def test_sharded_load_equals_the_whole_file_load_bit_for_bit(tmp_path, stage, precision):
  """From one file, an index over 3 files and a bf16 Orbax checkpoint: each leaf arrives placed as
  the plan's param (ZeRO-3: split, padded with zeros), and the state built from it equals the
  whole-file load's in every shard, padding included."""
  engine = _engine(stage, precision)
  weights = _weights(engine)
  safetensors.numpy.save_file(weights, str(tmp_path / "one.safetensors"))
  ocp.PyTreeCheckpointer().save(tmp_path / "orbax", nest(
      {p: x.astype(ml_dtypes.bfloat16) for p, x in weights.items()}))
  sources = [tmp_path / "one.safetensors", _write_index(tmp_path / "hf", weights, 3),
             tmp_path / "orbax"]
  for source in sources:
    params = engine.load_weights(source)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    plan = engine.plan
    for leaf, x in zip(plan.leaf_list(), jax.tree.leaves(params)):
      assert x.shape == plan.param_shape(leaf), leaf.path
      assert x.sharding.spec == plan.param_spec(leaf), leaf.path
      logical = np.asarray(leaf.to_logical(x))
      truth = weights[leaf.path]
      if source.name == "orbax":
        truth = truth.astype(ml_dtypes.bfloat16).astype(np.float32)
      np.testing.assert_array_equal(logical, truth)
      padding = np.array(x)
      padding[tuple(slice(0, n) for n in leaf.shape)] = 0
      assert not padding.any(), leaf.path
    if stage == 3:
      a = plan.leaves["a"]["kernel"]
      assert a.param_partitioned and a.pad == 4 and a.shard_dim == -1
      assert not plan.leaves["a"]["bias"].param_partitioned
    sharded = _state_shards(engine.init(jax.random.key(1), params=params))
    whole = _state_shards(_whole_file_state(engine, source))
    assert len(sharded) == len(whole)
    for (i, x), (j, y) in zip(sharded, whole):
      assert i == j and x.dtype == y.dtype
      np.testing.assert_array_equal(x, y)


def test_two_processes_read_only_their_blocks(tmp_path):
  """2 processes x 2 devices under ZeRO-3, weights as an index of 2 files: each process reads
  exactly its half of every split leaf (the two halves make the leaf) and every replicated leaf
  whole; its peak resident memory during the load stays within (its shard + the largest leaf) x
  1.1; the state equals the whole-file load's bit for bit."""
  from weights_worker import Wide  # noqa: PLC0415 (the worker sets JAX's platform at import)

  shapes = {p: x.shape for p, x in flatten_paths(nnx.to_pure_dict(nnx.state(
      nnx.eval_shape(lambda: Wide(nnx.Rngs(0))), nnx.Param))).items()}
  rng = np.random.default_rng(1)
  weights = {p: rng.standard_normal(s, dtype=np.float32) for p, s in shapes.items()}
  source = _write_index(tmp_path / "hf", weights, 2)
  processes, port = 2, free_port()
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(processes), str(port), "2",
                             str(source), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=subprocess_env())
           for i in range(processes)]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"
  reports = [json.loads((tmp_path / f"weights_{i}.json").read_text()) for i in range(processes)]
  largest = max(x.nbytes for x in weights.values())
  for report in reports:
    assert report["processes"] == 2 and report["devices"] == 4 and report["equal"]
    for path, leaf in report["leaves"].items():
      if leaf["partitioned"]:
        assert 0 < leaf["read"] <= leaf["bytes"] // 2 + leaf["bytes"] // 1000, path
      else:
        assert leaf["read"] == leaf["bytes"], path
    assert sum(leaf["read"] for leaf in report["leaves"].values()) < 0.51 * sum(
        x.nbytes for x in weights.values())
    assert report["peak"] <= 1.1 * (report["held"] + largest), (report["peak"], report["held"])
  for path, leaf in reports[0]["leaves"].items():
    if leaf["partitioned"]:
      assert sum(r["leaves"][path]["read"] for r in reports) == leaf["bytes"], path


def test_bad_indexes_and_directories_are_named(tmp_path):
  engine = _engine(3)
  weights = _weights(engine)
  index = _write_index(tmp_path / "hf", weights, 2) / "model.safetensors.index.json"
  (index.parent / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(CheckpointError, match=r"places \d+ tensors \(e\.g\. '.*'\) in .*"
                     r"model-00002-of-00002\.safetensors, which does not exist"):
    engine.load_weights(index.parent)

  other = _write_index(tmp_path / "other", {"a/kernel": weights["a/kernel"]}, 1)
  moved = json.loads(index.read_text())
  moved["weight_map"] = {n: "../other/model-00001-of-00001.safetensors" for n in weights}
  index.write_text(json.dumps(moved))
  with pytest.raises(CheckpointError, match=r"places tensors \[.*'a/bias'.*\] in .*other.*"
                     r"which does not hold them"):
    engine.load_weights(index)

  index.write_text('{"weights": {}}')
  with pytest.raises(CheckpointError, match=r"is not a safetensors index: expected JSON with a "
                     r"\"weight_map\""):
    checkpoint.read_weights(index)
  with pytest.raises(CheckpointError, match=r"neither a params-only Orbax checkpoint .* nor a "
                     r"Hugging Face model directory"):
    engine.load_weights(tmp_path)
  assert other.is_dir()

  truncated = tmp_path / "truncated.safetensors"
  safetensors.numpy.save_file(weights, str(truncated))
  truncated.write_bytes(truncated.read_bytes()[:-100])
  with pytest.raises(CheckpointError, match=r"truncated\.safetensors is not a readable "
                     r"safetensors file"):
    engine.load_weights(truncated)


def test_init_takes_a_padded_leaf_only_as_a_placed_array():
  """engine.init accepts a split leaf in the plan's padded shape as a jax.Array (what load_weights
  gives) and keeps it as it is; the same shape as numpy is the shape error it always was."""
  engine = _engine(3)
  weights = _weights(engine)
  engine.init(jax.random.key(0))
  leaf = engine.plan.leaves["a"]["kernel"]
  kernel = np.zeros((12, 24), np.float32)
  kernel[:, :20] = weights["a/kernel"]
  params = nest(dict(weights))
  params["a"]["kernel"] = jax.device_put(kernel, engine.plan.sharding(engine.plan.param_spec(leaf)))
  state = engine.init(jax.random.key(0), params=params)
  np.testing.assert_array_equal(np.asarray(state.params["a"]["kernel"]), kernel)
  params["a"]["kernel"] = kernel
  with pytest.raises(ConfigError, match=r"a/kernel: \(12, 24\) \(model: \(12, 20\)\)"):
    engine.init(jax.random.key(0), params=params)
