"""Frozen parameters cost nothing but their compute copy: LoRA-style fine-tuning of the default GPT
(rank-8 adapters on the attention projections, the base frozen with ``optax.multi_transform`` and
``optax.set_to_zero``). The frozen leaves have no optimizer state, no fp32 master, and their
gradients are neither computed nor reduced (the compiled step reduce-scatters the adapters'
gradient bytes only); the adapters train as a plain loop trains them."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from jzero.analysis.hlo import collectives
from jzero.models import GPTConfig, lm_loss
from jzero.models.gpt import lora_labels
from zero_testing import (assert_same_as_one_device, batches, engine_run, gpt_factory,
                          loss_of_params, make_engine)

LORA = GPTConfig(d_model=256, n_layers=8, n_heads=4, seq_len=64, lora_rank=8)  # the default GPT


def lora_tx():
  return optax.multi_transform({"lora": optax.adamw(1e-3), "frozen": optax.set_to_zero()},
                               lora_labels)


def _config(stage, precision="bf16"):
  cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
         "zero_optimization": {"stage": stage}}
  if precision == "bf16":
    cfg["bf16"] = {"enabled": True}
  return cfg


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_base_has_no_state_and_no_gradient(stage):
  """bf16 on 8 devices: optimizer, master and gradient bytes per device at most 1.1 x the
  adapters' share (8 + 4 + 2 bytes per trainable parameter / 8); every reduce-scatter of the
  compiled step together reduces at most 1.1 x the adapters' gradient elements."""
  engine = make_engine(_config(stage), model=LORA, optimizer=lora_tx())
  state = engine.init(jax.random.key(0))
  plan = engine.plan
  frozen = [l for l in plan.leaf_list() if l.frozen]
  trained = [l for l in plan.leaf_list() if not l.frozen]
  assert {l.path.split("/")[-1] for l in trained} == {"lora_a", "lora_b"}
  assert len(frozen) == len(plan.leaf_list()) - 4
  n_trained = sum(l.numel for l in trained)
  batch = engine.shard_batch(batches(LORA.seq_len, 8, 1)[0])
  report = engine.memory_report(state, batch)
  for category, per_param in (("optimizer", 8), ("master", 4), ("grads", 2)):
    share = per_param * n_trained / 8
    assert report.measured_bytes(category) <= 1.1 * share, (category, report.measured[category],
                                                            share)
  compiled = engine.jitted_step(batch).lower(state, batch).compile()
  ops = collectives(compiled.as_text(), engine.mesh)
  itemsize = {"f32": 4, "bf16": 2, "f16": 2, "u16": 2}
  scattered = sum(o.full_bytes * o.count // itemsize[o.payload[0]] for o in ops
                  if o.kind == "reduce-scatter")
  assert 0 < scattered <= 1.1 * n_trained, (scattered, n_trained)


def test_lora_adapters_train_as_the_plain_loop():
  """fp32, stage 3: losses and params (the frozen base unchanged, bit for bit) as the plain
  single-device loop with the same multi_transform."""
  cfg = GPTConfig(d_model=36, n_layers=2, n_heads=4, seq_len=16, lora_rank=4)
  data = batches(cfg.seq_len, 8, 4)
  engine = make_engine(dict(_config(3, "fp32"), zero_optimization={
      "stage": 3, "stage3_param_persistence_threshold": 0}), model=cfg, optimizer=lora_tx())
  initial, final, losses = engine_run(engine, data)
  loss = loss_of_params(gpt_factory(cfg), lm_loss)
  tx = lora_tx()

  def run(params, float64=False):
    with jax.enable_x64(float64):
      params = jax.tree.map(lambda x: np.asarray(x, np.float64 if float64 else np.float32),
                            params)
      opt, out = tx.init(params), []

      @jax.jit
      def step(p, o, b):
        v, g = jax.value_and_grad(loss)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, v
      for b in data:
        params, opt, v = step(params, opt, b)
        out.append(float(v))
      return params, out

  ref, ref_losses = run(initial)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  assert_same_as_one_device(final, ref, lambda: run(initial, float64=True)[0])
  labels = lora_labels(initial)
  for (path, a), b, label in zip(jax.tree_util.tree_leaves_with_path(final),
                                 jax.tree.leaves(initial), jax.tree.leaves(labels)):
    if label == "frozen":
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
