"""Activation offload (``activation_checkpointing.cpu_checkpointing``): the layer inputs that
activation checkpointing keeps live in ``pinned_host`` memory between forward and backward.

Exactness against the same config without it (fp32, <= 1e-6 relative) for the scanned GPT and a
loop model through gather units; the CUDA export of the step carries one pinned_host offload per
saved layer input (and the copies back for backward); on CPU the offload runs and changes nothing
in ``memory_analysis()`` (numbers in docs/offload.md, "Activation offload").
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

import jzero
from jzero.modeling.layer_scan import LayerPolicy
from models_testing import LinenScanned, LoopNet, linen_engine, mse, regression_batch
from zero_testing import SAME_MATH, SMALL, batches, ds_config, make_engine, max_relative_diff

N = 8
STEPS = 2


def _config(stage: int, offload: bool, **zero) -> dict:
  cfg = ds_config(stage, **zero)
  cfg["activation_checkpointing"] = {"cpu_checkpointing": offload}
  return cfg


def _train(engine, data):
  state = engine.init(jax.random.key(0))
  losses = []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return jax.tree.map(np.asarray, engine.logical_params(state)), np.array(losses)


@functools.lru_cache(maxsize=None)
def _gpt_data():
  return tuple(batches(SMALL.seq_len, N, STEPS))


@functools.lru_cache(maxsize=None)
def _gpt_engine(stage: int, offload: bool):
  return make_engine(_config(stage, offload))


def _assert_same(run, ref):
  (params, losses), (ref_params, ref_losses) = run, ref
  assert np.max(np.abs(losses - ref_losses) / ref_losses) <= SAME_MATH
  assert max_relative_diff(params, ref_params) <= SAME_MATH


def test_policy_offloads_only_the_named_layer_inputs():
  policy = LayerPolicy(checkpoint_activations=True, offload_inputs=True)
  assert policy.jax_policy() is not jax.checkpoint_policies.nothing_saveable
  with pytest.raises(ValueError, match="needs checkpoint_activations"):
    LayerPolicy(offload_inputs=True)


def test_config_accepts_cpu_checkpointing():
  config = jzero.Config.load(_config(3, True))
  config.check_supported()
  assert config.activation_checkpointing.cpu_checkpointing is True


def test_scanned_gpt_with_cpu_checkpointing_equals_plain_checkpointing():
  """Stage 3, fp32, 3 steps: same losses and parameters (1e-6) as activation checkpointing with
  the layer inputs kept on the device."""
  _assert_same(_train(_gpt_engine(3, True), _gpt_data()),
               _train(_gpt_engine(3, False), _gpt_data()))


def test_loop_model_through_units_with_cpu_checkpointing_equals_plain_checkpointing():
  data = [regression_batch(N, 64, i) for i in range(STEPS)]
  factory = lambda rngs: LoopNet(rngs, 3, 64)  # noqa: E731
  cfg = lambda offload: _config(3, offload, stage3_param_persistence_threshold=0)  # noqa: E731
  _assert_same(_train(make_engine(cfg(True), factory, mse), data),
               _train(make_engine(cfg(False), factory, mse), data))


def _cuda_text(engine, batch=None, init_args=()) -> str:
  from jax import export
  batch = _gpt_data()[0] if batch is None else batch
  state = engine.init(jax.random.key(0), *init_args)
  batch = engine.shard_batch(batch)
  return export.export(engine.jitted_step(batch), platforms=("cuda",))(state, batch).mlir_module()


def _placements(text: str, kind: str) -> int:
  return len(re.findall(r'_xla_buffer_placement = \\?"' + kind + r'\\?"', text))


def test_cuda_export_offloads_each_saved_layer_input_to_pinned_host():
  """The scan body copies its layer input [micro, seq, d_model] to pinned_host once and the
  backward body copies it back once; the step's jaxpr holds the L stacked copies as one host
  array [L, micro, seq, d_model] between the forward and the backward scan."""
  engine = _gpt_engine(3, True)
  state = engine.init(jax.random.key(0))
  batch = engine.shard_batch(_gpt_data()[0])
  traced = engine.jitted_step(batch).trace(state, batch)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  layer_input = f"tensor<1x{SMALL.seq_len}x{SMALL.d_model}xf32>"
  assert re.findall(r'placement = \\?"(\w+)\\?"}} : \(' + re.escape(layer_input), text) == [
      "pinned_host", "device"]
  assert _placements(text, "pinned_host") == 1
  jaxpr = str(traced.jaxpr)
  stacked = f"f32<host>[{SMALL.n_layers},1,{SMALL.seq_len},{SMALL.d_model}]"
  one = f"f32<host>[1,{SMALL.seq_len},{SMALL.d_model}]"
  assert set(re.findall(r"\w+<host>\[[\d,]*\]", jaxpr)) == {stacked, one}


def test_linen_scan_layers_and_units_tag_their_inputs():
  """jzero.linen_scan_layers tags the carry of its nn.scan (one pinned_host copy in the scan
  body) and the Linen units tag theirs: Dense_0's input, Dense_1's input and -- stage 3 prefetches,
  so Dense_1's gather waits for Dense_0's input -- that input once more."""
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(N, 16, 12)).astype(np.float32),
           "y": rng.normal(size=(N, 16, 3)).astype(np.float32)}
  engine = linen_engine(LinenScanned(), _config(3, True, stage3_param_persistence_threshold=0))
  text = _cuda_text(engine, batch, (batch,))
  assert _placements(text, "pinned_host") == 4
  assert len(re.findall(r'pinned_host"}} : \(tensor<1x16x32xf32>', text)) == 2  # scan, Dense_1


def test_cpu_checkpointing_that_offloads_nothing_warns():
  """A loop model in stage 1 has no gather units and no scan: nothing to offload, so a warning."""
  engine = make_engine(_config(1, True), lambda rngs: LoopNet(rngs, 2, 64), mse)
  state = engine.init(jax.random.key(0))
  with pytest.warns(jzero.JZeroWarning, match="cpu_checkpointing.*no activation was offloaded"):
    engine.train_step(state, engine.shard_batch(regression_batch(N, 64, 0)))
