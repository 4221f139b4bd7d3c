"""Models with batch statistics (BatchNorm) at every ZeRO stage: a ResNet as flax's imagenet
example writes it (Linen, ``nn.BatchNorm(axis_name="batch")``) and an NNX CNN with
``nnx.BatchNorm`` and an ``nnx.Dropout`` holding the model's ``rngs`` (tests/batchnorm_models.py).

One module-scoped run trains each model 10 fp32 steps on 8 devices at every stage, with the
micro-batch 4 x 1 and 1 x 4 alternating over the stages (each stage sees both across the two
models), flax's imagenet optimizer (SGD, Nesterov momentum 0.9), against a plain single-device
optax loop over the same global batches that accumulates over the same micro-batches (micro-batch
i of a step: row block i of each device's slice). The gas-1 runs of stage 0 (ResNet) and stage 1
(CNN) save at step 5; the checkpoint is restored into the same engine (steps 6-10 bit for bit) and
into an engine on 4 of the devices at another stage.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax import lax
from safetensors import safe_open

import batchnorm_models as models
import jzero
from jzero import checkpoint
from jzero.cli import main as cli_main
from jzero.sharding.plan import flatten_paths
from zero_testing import SAME_MATH, VS_ONE_DEVICE, max_relative_diff

N, STEPS, SAVE_AT = 8, 10, 5
#: (model, stage) -> gradient_accumulation_steps (a micro-batch of 4 x 1 or 1 x 4 per device)
RUNS = {("resnet", 0): 1, ("resnet", 1): 4, ("resnet", 2): 1, ("resnet", 3): 4,
        ("cnn", 0): 4, ("cnn", 1): 1, ("cnn", 2): 4, ("cnn", 3): 1}
SAVES = {"resnet": 0, "cnn": 1}  # the stage whose run saves at SAVE_AT (gas 1)
ON_FOUR = {"resnet": 3, "cnn": 2}  # the stage the checkpoint continues at on 4 devices (gas 1)


# -- the plain loop --------------------------------------------------------------------------------
def _micro_batches(batch: dict, devices: int, gas: int) -> dict:
  """A step's global micro-batches, [gas, devices * micro, ...]: micro-batch i holds row block i
  of every device's slice, device after device (as the engine's step splits them)."""
  return jax.tree.map(lambda x: x.reshape((devices, gas, -1) + x.shape[1:]).swapaxes(0, 1)
                      .reshape((gas, -1) + x.shape[1:]), batch)


def _resnet_micro_loss(p, s, mb, keys):
  """The ResNet's training loss on one global micro-batch and the statistics it leaves. The model
  names its statistics' axis "batch" (a pmap axis): the loop binds that name over its one device
  with vmap."""
  def apply(x):
    return models.small_resnet().apply({"params": p, **s}, x, train=True,
                                            mutable=["batch_stats"])
  logits, new = jax.vmap(apply, axis_name="batch")(mb["image"][None])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits[0], mb["label"]).mean()
  return loss, jax.tree.map(lambda x: x[0], new)


def _cnn_model(p, s):
  graphdef, params, stats, rngs = nnx.split(models.CNN(nnx.Rngs(0)), nnx.Param, nnx.BatchStat,
                                            nnx.RngState)
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, p))
  nnx.replace_by_pure_dict(stats, jax.tree.map(jnp.asarray, s))
  return nnx.merge(graphdef, params, stats, rngs)


def _cnn_micro_loss(p, s, mb, keys):
  """The CNN's loss on one global micro-batch: the features (BatchNorm) of the whole micro-batch,
  each device slice's dropout drawn as the engine reseeds the model's stream for that device's key
  (tag "default": the factory gets ``nnx.Rngs(key)``), then the head."""
  model = _cnn_model(p, s["batch_stats"])
  h = model.features(mb["image"])
  rows = h.shape[0] // keys.shape[0]
  dropped = []
  for d in range(keys.shape[0]):
    nnx.reseed(model, default=models.stream_key(keys[d], "default"))
    dropped.append(model.drop(h[d * rows:(d + 1) * rows]))
  logits = model.head(jnp.concatenate(dropped))
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, mb["label"]).mean()
  return loss, {"batch_stats": nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))}


@functools.lru_cache(maxsize=None)
def _reference_step(kind: str):
  """One step of the plain loop: the mean gradient over the micro-batches (a scan, each forward
  pass starting from the statistics the one before left), then optax's Nesterov SGD. Micro-batch
  i's device slices get the engine's loss keys ``fold_in(fold_in(fold_in(train_key, step),
  device), i)``."""
  micro_loss = {"resnet": _resnet_micro_loss, "cnn": _cnn_micro_loss}[kind]
  tx = models.nesterov_sgd()

  @functools.partial(jax.jit, static_argnums=(4, 5))
  def step(p, opt, s, batch, gas, devices, train_key, index):
    def body(carry, xs):
      grads, total, s = carry
      mb, i = xs
      base = jax.random.fold_in(train_key, index)
      keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(base, d), i)
                        for d in range(devices)])
      (loss, s), g = jax.value_and_grad(micro_loss, has_aux=True)(p, s, mb, keys)
      return (jax.tree.map(jnp.add, grads, g), total + loss, s), None

    start = (jax.tree.map(jnp.zeros_like, p), jnp.zeros(()), s)
    (grads, total, s), _ = lax.scan(body, start, (_micro_batches(batch, devices, gas),
                                                  jnp.arange(gas)))
    updates, opt = tx.update(jax.tree.map(lambda g: g / gas, grads), opt, p)
    return optax.apply_updates(p, updates), opt, s, total / gas

  return step, tx


def _loop(kind: str, start: tuple, data: list[dict], schedule: list[tuple[int, int]],
          train_key: jax.Array):
  """The plain single-device optax loop from ``start`` (params, model state) over ``data``,
  step k accumulating over ``schedule[k]`` = (gas, devices)'s micro-batches and drawing those
  devices' dropout keys. Returns (params, statistics, losses)."""
  step, tx = _reference_step(kind)
  params, stats = jax.tree.map(jnp.asarray, start)
  opt, losses = tx.init(params), []
  for index, (batch, (gas, devices)) in enumerate(zip(data, schedule)):
    params, opt, stats, loss = step(params, opt, stats, batch, gas, devices, train_key, index)
    losses.append(float(loss))
  return jax.device_get(params), jax.device_get(stats), losses


# -- the engine runs -------------------------------------------------------------------------------
def _steps(engine, state, batches, save: Path | None = None) -> tuple:
  """Trains ``state`` on ``batches`` (saving it into ``save`` before the step of SAVE_AT); returns
  (state, losses, (logical params, model state))."""
  losses = []
  for step, batch in enumerate(batches):
    if save is not None and step == SAVE_AT:
      engine.save_checkpoint(state, save)
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, losses, jax.device_get((engine.logical_params(state), state.model_state))


def _train(kind: str, stage: int, gas: int, data: list[dict], start: tuple | None,
           directory: Path | None) -> dict:
  """10 steps of ``kind`` at ``stage`` from ``engine.init(key(0))`` (or from ``start``, the
  parameters and statistics it makes); with ``directory``: saved at SAVE_AT, then restored into
  the same engine and into an engine on 4 devices at stage ON_FOUR, each trained to the end."""
  engine = models.engine_for(kind, stage, gas)
  if start is None:
    state = engine.init(jax.random.key(0))
  else:
    state = engine.init(jax.random.key(0), params=start[0], model_state=start[1])
  out = {"engine": engine, "train_key": jax.random.wrap_key_data(np.asarray(state.rng)),
         "initial": jax.device_get((engine.logical_params(state), state.model_state)),
         "partitioned": {l.path for l in engine.plan.leaf_list() if l.param_partitioned}}
  out["state"], out["losses"], out["final"] = _steps(engine, state, data, directory)
  if directory is not None:
    engine.wait_for_checkpoints()
    _, out["resumed_losses"], out["resumed"] = _steps(engine, engine.load_checkpoint(directory),
                                                      data[SAVE_AT:])
    four = models.engine_for(kind, ON_FOUR[kind], 1, devices=4)
    _, out["four_losses"], out["four"] = _steps(four, four.load_checkpoint(directory),
                                                data[SAVE_AT:])
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every engine run of RUNS and the plain loops they are checked against."""
  data = models.images(models.BATCH, STEPS)
  root = tmp_path_factory.mktemp("model_state")
  results, start = {}, {}
  for (kind, stage), gas in RUNS.items():
    directory = root / kind if SAVES[kind] == stage else None
    results[kind, stage] = _train(kind, stage, gas, data, start.get(kind), directory)
    start.setdefault(kind, results[kind, stage]["initial"])
  references = {}
  for kind in ("resnet", "cnn"):
    key = results[kind, 0]["train_key"]
    for gas in (1, 4):
      references[kind, gas] = _loop(kind, start[kind], data, [(gas, N)] * STEPS, key)
  # the CNN continued on 4 devices draws 4 devices' dropout keys from the checkpoint on
  references["cnn", "four"] = _loop("cnn", start["cnn"], data, [(1, N)] * SAVE_AT + [(
      1, 4)] * (STEPS - SAVE_AT), results["cnn", 0]["train_key"])
  return data, results, references, root


def _relative(a, b) -> float:
  """||a - b|| / ||b|| of all the leaves of two trees together, in float64."""
  flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
  return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


def _check_params(params, reference, where: str) -> None:
  """The parameters within VS_ONE_DEVICE (1e-5) of the plain loop's, all of them as one vector.
  Not leaf by leaf: a BatchNorm bias feeding the next BatchNorm (through relu / max-pool, the
  ResNet's stem and blocks) is a near-null direction -- its gradient is a sum that nearly cancels,
  so the bias stays near 1e-5 while kernels are O(1), and its relative rounding error is large
  for any float32 evaluation: measured on this model up to 3e-5 for jzero and 1.2e-5 for plain
  float32 optax against the float64 loop (both far below 1e-5 of the whole parameter vector). A
  leaf's real error -- a lost micro-batch, a stale partition, local statistics -- moves the whole
  vector by orders of magnitude more (a wrong bias of norm 1e-3 alone: 4e-4)."""
  error = _relative(params, reference)
  worst = max((max_relative_diff(x, y), k) for (k, x), y in zip(
      flatten_paths(params).items(), jax.tree.leaves(reference)))
  print(f"BOUND {where}: parameters {error:.2g} from the plain loop (worst leaf {worst[1]} "
        f"{worst[0]:.2g})")
  assert error <= VS_ONE_DEVICE, where


@pytest.mark.parametrize("kind", ["resnet", "cnn"])
def test_every_stage_matches_a_plain_loop_with_its_batch_statistics(runs, kind):
  """Stages 0-3 against the plain loop: losses within SAME_MATH (1e-6) relative, batch
  statistics within VS_ONE_DEVICE (1e-5), parameters as :func:`_check_params` says; every run
  starts from the same parameters and statistics (BatchNorm's 0 / 1), the statistics trained,
  and stage 3 partitions every leaf (each gathered by its unit)."""
  _, results, references, _ = runs
  initial = results[kind, 0]["initial"]
  assert set(initial[1]) == {"batch_stats"}
  for stage in range(4):
    run, gas = results[kind, stage], RUNS[kind, stage]
    ref_params, ref_stats, ref_losses = references[kind, gas]
    where = f"{kind}, stage {stage}, gas {gas}"
    assert max_relative_diff(run["initial"], initial) == 0.0, where
    loss_error = np.max(np.abs(np.array(run["losses"]) - ref_losses) / np.array(ref_losses))
    stats_error = max_relative_diff(run["final"][1], ref_stats)
    print(f"BOUND {where}: losses {loss_error:.2g}, statistics {stats_error:.2g}")
    np.testing.assert_allclose(run["losses"], ref_losses, rtol=SAME_MATH, err_msg=where)
    assert stats_error <= VS_ONE_DEVICE, where
    assert max_relative_diff(run["final"][1], initial[1]) > 0.01, where  # not left at 0 / 1
    _check_params(run["final"][0], ref_params, where)
  assert results[kind, 3]["partitioned"] == set(flatten_paths(initial[0])), "stage 3 partitions"
  assert references[kind, 1][2][-1] < references[kind, 1][2][0]


@pytest.mark.parametrize("kind", ["resnet", "cnn"])
def test_restart_is_bitwise_and_continues_on_four_devices_at_another_stage(runs, kind):
  """Restored into the same engine, steps 6-10 repeat the uninterrupted run bit for bit
  (parameters and statistics included). Restored on 4 devices at another stage they match the
  plain loop continued from step 5 -- for the CNN with 4 devices' dropout keys -- within the
  bounds of the 8-device runs."""
  _, results, references, _ = runs
  run = results[kind, SAVES[kind]]
  assert run["resumed_losses"] == run["losses"][SAVE_AT:]
  assert max_relative_diff(run["resumed"], run["final"]) == 0.0
  where = f"{kind} on 4 devices at stage {ON_FOUR[kind]}"
  ref_params, ref_stats, ref_losses = references[kind, "four" if kind == "cnn" else 1]
  np.testing.assert_allclose(run["four_losses"], ref_losses[SAVE_AT:], rtol=SAME_MATH,
                             err_msg=where)
  assert max_relative_diff(run["four"][1], ref_stats) <= VS_ONE_DEVICE, where
  _check_params(run["four"][0], ref_params, where)


def test_a_plain_flax_checkpoint_with_statistics_continues_in_jzero_and_goes_back(runs, tmp_path):
  """flax's imagenet layout -- a ``CheckpointManager`` step with items ``params``, ``batch_stats``
  and ``opt_state`` -- written by the plain loop after step 5 continues in jzero (the ResNet at
  stage 3, micro-batch 1 x 4) through ``import_optax(**read_optax(dir))``: steps 6-10 and the
  statistics are the plain loop's own. Written back out (``export_optax``) the statistics are an
  item beside ``params``, bit for bit the state's."""
  data, results, references, _ = runs
  run, gas = results["resnet", 3], RUNS["resnet", 3]
  engine, key = run["engine"], run["train_key"]
  step, tx = _reference_step("resnet")
  params, stats = jax.tree.map(jnp.asarray, results["resnet", 0]["initial"])
  opt = tx.init(params)
  for index in range(SAVE_AT):
    params, opt, stats, _ = step(params, opt, stats, data[index], gas, N, key, index)
  manager = ocp.CheckpointManager(tmp_path / "plain")
  manager.save(SAVE_AT, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt),
      batch_stats=ocp.args.StandardSave(stats["batch_stats"])))
  manager.wait_until_finished()
  manager.close()

  state = engine.import_optax(**checkpoint.read_optax(tmp_path / "plain"))
  assert int(state.step) == SAVE_AT
  assert max_relative_diff(jax.device_get(state.model_state), jax.device_get(stats)) == 0.0
  state, losses, (final_params, final_stats) = _steps(engine, state, data[SAVE_AT:])
  ref_params, ref_stats, ref_losses = references["resnet", gas]
  np.testing.assert_allclose(losses, ref_losses[SAVE_AT:], rtol=SAME_MATH)
  assert max_relative_diff(final_stats, ref_stats) <= VS_ONE_DEVICE
  _check_params(final_params, ref_params, "resnet imported from a plain flax checkpoint")

  engine.save_checkpoint(state, tmp_path / "jzero")
  engine.wait_for_checkpoints()
  out = checkpoint.export_optax(tmp_path / "jzero", tmp_path / "out", engine.tx)
  back = checkpoint.read_optax(out.parent)
  assert set(back) >= {"params", "opt_state", "batch_stats"}
  assert max_relative_diff(back["batch_stats"], jax.device_get(state.model_state["batch_stats"])
                           ) == 0.0


def test_eval_uses_the_running_statistics(runs):
  """``eval_loss`` normalises by the trained running statistics: it matches the model evaluated
  with the plain loop's parameters and statistics (Linen ``train=False``, NNX ``model.eval()``),
  and is far from the same parameters evaluated with the batch's own statistics or with the
  initial ones."""
  data, results, references, _ = runs
  batch = data[0]
  for kind in ("resnet", "cnn"):
    run = results[kind, 3]
    ref_params, ref_stats, _ = references[kind, RUNS[kind, 3]]

    def evaluate(stats, running=True):
      if kind == "resnet":
        logits = jax.vmap(lambda x: models.small_resnet().apply(
            {"params": ref_params, **stats}, x, train=not running, mutable=["batch_stats"])[0],
            axis_name="batch")(batch["image"][None])[0]
      else:
        model = _cnn_model(ref_params, stats["batch_stats"])
        model.eval()  # dropout off, running statistics -- or the batch's, when not ``running``
        model.bn1.use_running_average = model.bn2.use_running_average = running
        logits = model(batch["image"])
      labels = batch["label"]
      return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())

    loss, expected = run["engine"].eval_loss(run["state"], batch), evaluate(ref_stats)
    np.testing.assert_allclose(loss, expected, rtol=VS_ONE_DEVICE, err_msg=kind)
    for other in (evaluate(ref_stats, running=False), evaluate(results[kind, 0]["initial"][1])):
      print(f"eval {kind}: {loss:.6g}, plain loop {expected:.6g}, otherwise {other:.6g}")
      assert abs(other - expected) > 10 * VS_ONE_DEVICE * expected, (kind, loss, other)


def test_convert_writes_the_statistics_beside_the_weights(runs, tmp_path, capsys):
  """``jzero convert`` of the ResNet's step-5 checkpoint: the Orbax output is Linen's variables
  dict, ``{"params", "batch_stats"}``, which plain Orbax restores and ``module.apply`` takes; the
  safetensors file names the statistics ``batch_stats/...``. From either, ``load_weights`` and
  ``load_model_state`` give back the checkpoint's parameters and statistics bit for bit."""
  data, results, _, root = runs
  engine = results["resnet", SAVES["resnet"]]["engine"]
  saved = engine.load_checkpoint(root / "resnet")
  params, stats = jax.device_get((engine.logical_params(saved), saved.model_state))
  files, variables = tmp_path / "resnet.safetensors", tmp_path / "variables"
  assert cli_main(["convert", str(root / "resnet"), "--safetensors", str(files), "--orbax",
                   str(variables)]) == 0
  assert "model state beside them: 6 arrays of batch_stats" in capsys.readouterr().out
  restored = ocp.PyTreeCheckpointer().restore(variables.absolute())
  assert set(restored) == {"params", "batch_stats"}
  assert max_relative_diff(restored, {"params": params, **stats}) == 0.0
  logits = jax.vmap(lambda x: models.small_resnet().apply(restored, x, train=False),
                    axis_name="batch")(data[0]["image"][None])[0]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, data[0]["label"]).mean()
  np.testing.assert_allclose(float(loss), engine.eval_loss(saved, data[0]), rtol=VS_ONE_DEVICE)
  with safe_open(str(files), framework="numpy") as f:
    assert "batch_stats/bn_init/mean" in f.keys() and "conv_init/kernel" in f.keys()
  for source in (files, variables):
    assert max_relative_diff(engine.load_weights(source), params) == 0.0, source
    assert max_relative_diff(engine.load_model_state(source), stats) == 0.0, source


def test_stacked_layers_with_statistics_are_refused_by_scan_layers():
  """``jzero.scan_layers`` returns only the carry: stacked layers holding BatchNorm statistics
  are refused (naming the variables and the fix), not trained with their statistics frozen."""
  @nnx.vmap(in_axes=0, out_axes=0)
  def stack(key):
    return nnx.BatchNorm(4, rngs=nnx.Rngs(key))

  graphdef, stacked = nnx.split(stack(jax.random.split(jax.random.key(0), 2)))
  with pytest.raises(jzero.errors.NotSupportedError, match=r"\['BatchStat'\] variables besides "
                     r"their parameters.*Python loop"):
    jzero.scan_layers(lambda x, p: nnx.merge(graphdef, p)(x), jnp.ones((2, 4)), stacked)
