"""What a loss returns besides the loss comes back as the step's metrics by meaning
(:mod:`jzero.train.aux_metrics`): scalars averaged over the global batch, ``jzero.Sum`` / ``Max``
/ ``Min`` / ``Mean`` reduced as asked, per-example arrays gathered in the batch's order, any other
array refused naming it; ``(loss, logits)`` as flax's tutorials write it; a loss of the wrong
type refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero.errors import JZeroError
from jzero.train import aux_metrics
from optax_testing import Tiny, config, data, plain_run


def rich_loss(model, batch):
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  per_example = per_token.mean(axis=1)
  return per_token.mean(), {
      "mean_loss": per_example.mean(),                       # a scalar: averaged
      "total": jzero.Sum(per_example.sum()),                 # summed over the global batch
      "worst": jzero.Max(per_example.max()),
      "best": jzero.Min(per_example.min()),
      "counts": jzero.Sum(jnp.bincount(tokens[:, 0], length=16)),  # an array, summed
      "per_example": per_example,                            # one value per example: gathered
  }


def tutorial_loss(model, batch):
  """flax's NNX tutorial shape: (loss, logits)."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, logits


def _engine_metrics(loss_fn, batches, gas=2):
  cfg = dict(config(2), gradient_accumulation_steps=gas)
  engine = jzero.initialize(Tiny, loss_fn, cfg, optimizer=optax.sgd(0.1))
  state = engine.init(jax.random.key(0))
  initial = jax.tree.map(np.asarray, engine.logical_params(state))
  out = []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    out.append(jax.tree.map(np.asarray, metrics))
  return initial, out


def test_aux_reduced_by_meaning_over_micro_batches_and_devices():
  """8 devices x 2 micro-batches: each aux value equals the plain loop's on the whole batch."""
  batches = data(2, batch=16)
  initial, metrics = _engine_metrics(rich_loss, batches)
  _, _, plain = plain_run(optax.sgd(0.1), initial, batches, loss_fn=rich_loss)
  for m, aux in zip(metrics, plain):
    aux = jax.tree.map(lambda x: np.asarray(getattr(x, "value", x)),
                       aux, is_leaf=lambda x: hasattr(x, "op"))
    for key in ("mean_loss", "total", "worst", "best"):
      assert m[key].shape == () and m[key] == pytest.approx(float(aux[key]), rel=1e-6), key
    np.testing.assert_array_equal(m["counts"], aux["counts"])
    assert m["per_example"].shape == (16,)
    np.testing.assert_allclose(m["per_example"], aux["per_example"], rtol=1e-6)


def test_loss_and_logits_as_flax_tutorials_write_it():
  batches = data(1, batch=8)
  initial, metrics = _engine_metrics(tutorial_loss, batches, gas=1)
  _, _, plain = plain_run(optax.sgd(0.1), initial, batches, loss_fn=tutorial_loss)
  assert metrics[0]["aux"].shape == (8, 8, 16)
  np.testing.assert_allclose(metrics[0]["aux"], np.asarray(plain[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("returned,message", [
    (lambda loss: (loss, 1, 2), "tuple of 3 values"),
    (lambda loss: "loss", "str"),
    (lambda loss: 3, "int"),
    (lambda loss: loss.astype(jnp.int32), "dtype int32"),
    (lambda loss: jnp.stack([loss, loss]), "shape (2,)"),
])
def test_a_loss_of_the_wrong_kind_is_refused(returned, message):
  with pytest.raises(JZeroError, match=message.replace("(", r"\(").replace(")", r"\)")):
    aux_metrics.split_loss(returned(jnp.float32(1.0)))


def test_an_array_aux_that_is_not_per_example_is_refused_naming_it():
  aux = {"hist": jnp.zeros(7)}
  with pytest.raises(JZeroError, match=r"aux\['hist'\] has shape \(7,\)"):
    aux_metrics.mark(aux, micro_batch=2)


def test_an_aux_key_the_step_reports_is_refused():
  with pytest.raises(JZeroError, match="'loss'"):
    aux_metrics.into_metrics({"loss": 1.0}, {"loss": 2.0})


def test_marks_reduce_over_micro_batches_as_named():
  stacked = aux_metrics.mark({"m": jnp.ones(()), "s": jzero.Sum(jnp.ones(())),
                              "x": jzero.Max(jnp.zeros(())), "e": jnp.ones((3, 2))}, 3)
  stacked = jax.tree.map(lambda v: jnp.stack([v, 2 * v]), stacked)
  out = aux_metrics.over_micro_batches(stacked)
  assert float(out["m"].value) == 1.5 and float(out["s"].value) == 3.0
  assert float(out["x"].value) == 0.0 and out["e"].value.shape == (6, 2)
