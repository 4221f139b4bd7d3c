"""A user's own optax transformations against a plain one-device optax loop: a small NNX model with
dimensions no device count divides and a LayerNorm (:class:`Tiny`), its data, the plain loop
(:func:`plain_run`) and the engine run (:func:`engine_run_with`), used by
tests/train/test_client_optimizers.py."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

import jzero
from zero_testing import max_relative_diff

VOCAB, WIDTH, HIDDEN, SEQ = 16, 12, 20, 8


class Tiny(nnx.Module):
  """Embedding (16 x 12), LayerNorm (12), two dense layers (12 -> 20 -> 16): 12 and 20 are
  divisible by neither 8 nor 4 devices, so most leaves are padded where they are partitioned
  (``width`` and ``hidden`` give other sizes)."""

  def __init__(self, rngs: nnx.Rngs, width: int = WIDTH, hidden: int = HIDDEN):
    self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
    self.ln = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.ln(self.embed(tokens))
    return self.out(jax.nn.gelu(self.up(x)))


def token_loss(model, batch):
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def data(steps: int, batch: int = 8, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [{"tokens": rng.integers(0, VOCAB, (batch, SEQ + 1)).astype(np.int32)}
          for _ in range(steps)]


def config(stage: int, micro: int = 1) -> dict:
  """A DeepSpeed config that leaves the optimizer to the client's transformation: no clipping
  (DeepSpeed's default clips at 1.0), every stage-3 param partitioned."""
  return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def loss_of_params(loss_fn=token_loss):
  graphdef, template = nnx.split(nnx.eval_shape(lambda: Tiny(nnx.Rngs(0))), nnx.Param)

  def loss(params, batch):
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, params)
    return loss_fn(nnx.merge(graphdef, state), batch)
  return loss


def plain_run(tx: optax.GradientTransformation, params, batches: list[dict], *,
              float64: bool = False, loss_fn=token_loss, hook=None):
  """The plain loop: the whole batch on one device, ``tx`` as given. Returns (params, losses,
  auxes). ``hook(step, tx_state)`` may return a replacement state (an lr change mid-run)."""
  if float64:
    with jax.enable_x64(True):
      return plain_run(tx, jax.tree.map(lambda x: np.asarray(x, np.float64), params), batches,
                       loss_fn=loss_fn, hook=hook)
  loss = loss_of_params(loss_fn)
  has_aux = isinstance(jax.eval_shape(loss, params, batches[0]), tuple)

  @jax.jit
  def step(p, s, batch):
    if has_aux:
      (value, aux), g = jax.value_and_grad(loss, has_aux=True)(p, batch)
    else:
      (value, g), aux = jax.value_and_grad(loss)(p, batch), None
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, value, aux

  params = jax.device_put(params, jax.devices()[0])
  s = tx.init(params)
  losses, auxes = [], []
  for i, batch in enumerate(batches):
    if hook is not None:
      s = hook(i, s)
    params, s, value, aux = step(params, s, batch)
    losses.append(float(value))
    auxes.append(aux)
  return params, losses, auxes


def engine_run_with(tx, stage: int, batches: list[dict], *, devices: int = 8, loss_fn=token_loss,
                    hook=None, model=Tiny, **initialize_kw):
  """``tx`` as ``initialize(optimizer=tx)`` at ``stage`` on the first ``devices`` devices.
  Returns (engine, final state, initial logical params, final logical params, losses, metrics)."""
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))
  micro = len(batches[0]["tokens"]) // devices if batches else 1
  engine = jzero.initialize(model, loss_fn, config(stage, micro), mesh=mesh, optimizer=tx,
                            **initialize_kw)
  state = engine.init(jax.random.key(0))
  initial = jax.tree.map(np.asarray, engine.logical_params(state))
  losses, metrics = [], []
  for i, batch in enumerate(batches):
    if hook is not None:
      state = hook(i, state)
    state, m = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(m["loss"]))
    metrics.append(jax.tree.map(np.asarray, m))
  final = jax.tree.map(np.asarray, engine.logical_params(state))
  return engine, state, initial, final, losses, metrics


def leafwise_errors(params, reference) -> dict[str, float]:
  """Leaf path -> relative distance in norm."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(k): max_relative_diff(a, b)
          for (k, a), b in zip(flat, jax.tree.leaves(reference))}


