"""Checkpoints: resharding across stages, device counts and precisions; exact resume in a new
process; a save killed part-way; consolidation (peak host memory), import, inspect; bad input."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
import safetensors.numpy
from safetensors import safe_open

import jzero
from jzero import checkpoint
from jzero.checkpoint.layout import opt_leaves
from jzero.cli import main as cli_main
from jzero.errors import CheckpointError, JZeroWarning
from jzero.models import GPTConfig

from checkpoint_helpers import (RESUME_AT, RESUME_JOBS, RESUME_STEPS, flat, resume_engine, train,
                                wide_engine)
from zero_testing import SMALL, batches, ds_config, make_engine

TESTS = Path(__file__).parents[1]
HELPER = TESTS / "checkpoint_helpers.py"


def _mesh(n: int) -> jzero.ZeroMesh:
  return jzero.MeshSpec.from_dict({"axes": {"data": n}}).build(devices=jax.devices()[:n])


def _engine(stage: int, n: int, precision: str = "fp32", model: GPTConfig = SMALL, **kw):
  cfg = ds_config(stage, precision=precision)
  cfg.update(kw)
  return make_engine(cfg, model=model, mesh=_mesh(n))


def _subprocess(*args: str, timeout: float = 300) -> str:
  env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  done = subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True,
                        env=env, timeout=timeout)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


# --- a synthetic train state with known logical values -------------------------------------------


def _truth(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
  """Logical fp32 params and Adam moments for SMALL, random, so every element is distinct."""
  abstract = flat(make_engine(0).model.abstract_params(None, None))
  rng = np.random.default_rng(seed)
  return {group: {p: rng.standard_normal(x.shape).astype(np.float32) * scale
                  for p, x in abstract.items()}
          for group, scale in (("params", 0.1), ("mu", 0.01), ("nu", 1e-4))}


def _layout(leaf, x: np.ndarray, partitioned: bool) -> np.ndarray:
  """A logical array in a plan's layout: zero-padded at the end of the shard dim."""
  if not partitioned or leaf.pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[leaf.shard_dim] = (0, leaf.pad)
  return np.pad(x, widths)


def _moment(name: str) -> str | None:
  parts = name.split("/")
  return next((m for m in ("mu", "nu") if m in parts[:3]), None)


def _place(engine, truth: dict) -> jzero.TrainState:
  """The TrainState ``engine`` would hold with these logical values, placed with device_put."""
  abstract = engine.abstract_state()
  plan = engine.plan
  leaves = {f"{g}/{l.path}": l for g in ("params", "master") for l in plan.leaf_list()}
  leaves.update(opt_leaves(plan, engine.tx))
  shardings = [x.sharding for x in jax.tree.leaves(abstract)]
  values = []
  for (name, x), sharding in zip(flat(abstract).items(), shardings):
    leaf = leaves.get(name)
    if name.startswith("params/"):
      v = _layout(leaf, truth["params"][leaf.path], leaf.param_partitioned)
    elif name.startswith("master/"):
      v = _layout(leaf, truth["params"][leaf.path], leaf.state_partitioned)
    elif leaf is not None:
      v = _layout(leaf, truth[_moment(name)][leaf.path], leaf.state_partitioned)
    elif name == "rng":
      v = np.asarray(jax.random.key_data(jax.random.key(3)))
    elif name.startswith("loss_scale/"):
      v = np.asarray(getattr(engine.scaler.init(), name.split("/")[1]))
    else:  # step, skipped, optimizer counts
      v = np.full(x.shape, 7)
    values.append(jax.device_put(np.asarray(v).astype(x.dtype), sharding))
  return jax.tree.unflatten(jax.tree.structure(abstract), values)


def _check_state(engine, state: jzero.TrainState, truth: dict) -> None:
  """``state`` holds ``truth`` exactly, in ``engine``'s layout and shardings, padding zero."""
  plan = engine.plan
  abstract = engine.abstract_state()
  expected = [x.sharding for x in jax.tree.leaves(abstract)]
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(state), expected))
  leaves = opt_leaves(plan, engine.tx)
  by_path = {leaf.path: leaf for leaf in plan.leaf_list()}
  for name, x in flat(state).items():
    x = np.asarray(x)
    if name.startswith(("params/", "master/")):
      leaf = by_path[name.split("/", 1)[1]]
      want = truth["params"][leaf.path]
      if name.startswith("params/"):
        want = want.astype(plan.compute_dtype)
    elif leaves.get(name) is not None:
      leaf, want = leaves[name], truth[_moment(name)][leaves[name].path]
    else:
      continue
    region = tuple(slice(0, s) for s in leaf.shape)
    np.testing.assert_array_equal(x[region], want, err_msg=name)
    padding = np.ones(x.shape, bool)
    padding[region] = False
    assert not np.any(x[padding]), f"{name}: padding is not zero"
  assert int(state.step) == 7 and int(state.skipped) == 7
  np.testing.assert_array_equal(state.rng, jax.random.key_data(jax.random.key(3)))
  assert all(int(c) == 7 for n, c in flat(state.opt_state).items() if leaves.get(
      "opt_state/" + n) is None)


# --- resharding ----------------------------------------------------------------------------------


def test_reshard_matrix_stages_and_device_counts(tmp_path):
  """Saved with stage S on N devices, restored with stage S' on 4: params, Adam moments, counts,
  step exactly equal in logical shapes, padding zero, arrays in the target's shardings."""
  truth = _truth()
  sources = [(stage, n) for stage in range(4) for n in (2, 8)]
  for stage, n in sources:
    engine = _engine(stage, n)
    engine.save_checkpoint(_place(engine, truth), tmp_path / f"s{stage}n{n}", 7)
  checkpoint.wait_until_finished()
  for target_stage in range(4):
    target = _engine(target_stage, 4)
    for stage, n in sources:
      state = target.load_checkpoint(tmp_path / f"s{stage}n{n}")
      _check_state(target, state, truth)


def test_reshard_across_precisions(tmp_path):
  """fp32 params <-> bf16 fp32-master: the truth carries over exactly, compute params are cast
  from it; the loss scale is kept only when the precision is the same."""
  truth = _truth(1)
  bf16 = _engine(3, 8, "bf16")
  bf16.save_checkpoint(_place(bf16, truth), tmp_path / "bf16", 7)
  fp32 = _engine(1, 2)
  fp32.save_checkpoint(_place(fp32, truth), tmp_path / "fp32", 7)
  checkpoint.wait_until_finished()
  _check_state(fp32, fp32.load_checkpoint(tmp_path / "bf16"), truth)
  target = _engine(2, 4, "bf16")
  state = target.load_checkpoint(tmp_path / "fp32")
  _check_state(target, state, truth)
  assert state.params["pos"].dtype == jnp.bfloat16 and state.master["pos"].dtype == jnp.float32

  fp16 = _engine(1, 4, "fp16")
  state = fp16.load_checkpoint(tmp_path / "bf16")
  assert float(state.loss_scale.scale) == float(fp16.scaler.init().scale)


def test_other_optimizer_needs_params_only(tmp_path):
  truth = _truth(2)
  source = _engine(2, 8)
  source.save_checkpoint(_place(source, truth), tmp_path, 7)
  checkpoint.wait_until_finished()
  lion = _engine(3, 4, optimizer={"type": "Lion", "params": {"lr": 1e-4}})
  with pytest.raises(CheckpointError, match="another optimizer.*AdamW.*Lion.*params_only=True"):
    lion.load_checkpoint(tmp_path)
  state = lion.load_checkpoint(tmp_path, params_only=True)
  np.testing.assert_array_equal(np.asarray(lion.logical_params(state)["pos"]),
                                truth["params"]["pos"])
  assert int(state.step) == 0
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state))
  state, metrics = lion.train_step(state, lion.shard_batch(batches(SMALL.seq_len, 4, 1)[0]))
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


# --- exact resume in a new process ---------------------------------------------------------------


def test_resume_in_new_process_is_bitwise_exact(tmp_path):
  """20 steps straight == 10 steps, save, restore in a new process, 10 steps: losses and params
  bitwise, fp32 and fp16 (WarmupLR across the resume point; fp16's dynamic loss scale). The save is
  asynchronous and the state is donated to the next step while it is written."""
  straight = {}
  for job in RESUME_JOBS:
    engine = resume_engine(job)
    state, first = train(engine, engine.init(jax.random.key(0)), RESUME_AT)
    engine.save_checkpoint(state, tmp_path / job, client_state={"job": job})
    saved = {p: np.asarray(x) for p, x in flat(engine.logical_params(state)).items()}
    state, rest = train(engine, state, RESUME_STEPS)
    straight[job] = (rest, flat(engine.logical_params(state)), saved)
  checkpoint.wait_until_finished()
  _subprocess("resume", str(tmp_path), str(tmp_path / "resumed.npz"))
  resumed = np.load(tmp_path / "resumed.npz")
  for job, (losses, params, _) in straight.items():
    np.testing.assert_array_equal(resumed[f"{job}/losses"], np.asarray(losses))
    for path, x in params.items():
      np.testing.assert_array_equal(resumed[f"{job}/{path}"], np.asarray(x), err_msg=path)
  meta = checkpoint.read_metadata(tmp_path / "fp16")
  assert meta["data_position"] == {"step": RESUME_AT} and meta["client_state"] == {"job": "fp16"}
  assert meta["precision"] == "fp16" and meta["stage"] == 3

  # A real training state, onto another stage and device count: the fp32 truth is unchanged.
  other = _engine(1, 2)
  restored = flat(other.logical_params(other.load_checkpoint(tmp_path / "fp32")))
  for path, x in straight["fp32"][2].items():
    np.testing.assert_array_equal(np.asarray(restored[path]), x)


# --- a save killed part-way ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
  """A finalized checkpoint (step 1) of a 128 MiB model of 4 MiB leaves, and its weights."""
  directory = tmp_path_factory.mktemp("wide")
  engine = wide_engine()
  state = engine.init(jax.random.key(0))
  engine.save_checkpoint(state, directory, 1)
  checkpoint.writer(directory).close()  # done writing: the subprocesses below save there
  return directory, {p: np.asarray(x) for p, x in flat(engine.logical_params(state)).items()}


def _bytes_under(path: Path) -> int:
  try:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
  except FileNotFoundError:  # a file renamed while listing
    return 0


def test_sigkill_during_async_save_keeps_previous_checkpoint(wide_checkpoint):
  """Three times: a process restores step 1 and starts saving it (128 MiB of arrays) as a new
  step; it is SIGKILLed once its temporary directory holds 0, 4, 16 MiB. The killed step is
  never committed nor named by ``latest``, and step 1 restores exactly every time; the next
  Checkpointer removes the leftovers. (A kill at each phase of a save, injected at fixed points
  of the save code: tests/checkpoint/test_kill_resume.py.)"""
  directory, weights = wide_checkpoint
  engine = wide_engine()
  env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  written = []
  for step, kill_at in zip(range(2, 5), (0, 4 << 20, 16 << 20)):
    proc = subprocess.Popen([sys.executable, str(HELPER), "save", str(directory), str(step)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while True:
      tmp = list(directory.glob(f"{step}.orbax-checkpoint-tmp*"))
      if tmp and _bytes_under(tmp[0]) >= kill_at:
        break
      assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
      assert time.monotonic() < deadline, "the save never started"
      time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert not (directory / str(step)).exists(), "the save finished before the kill"
    written.append(_bytes_under(tmp[0]))
    assert checkpoint.latest_tag(directory) == "1" and checkpoint.all_tags(directory) == ["1"]
    restored = flat(engine.logical_params(engine.load_checkpoint(directory)))
    for path, x in weights.items():
      np.testing.assert_array_equal(np.asarray(restored[path]), x)
  print(f"bytes of the killed saves on disk after the kill: {written}")

  state = engine.load_checkpoint(directory)
  fresh = checkpoint.Checkpointer(directory)
  fresh.save(engine.plan, state, engine.resources, 10, config=engine.config, tx=engine.tx)
  fresh.close()
  assert not list(directory.glob("*.orbax-checkpoint-tmp*"))
  assert checkpoint.latest_tag(directory) == "10" and checkpoint.all_tags(directory) == ["1", "10"]


# --- consolidation, import, inspect --------------------------------------------------------------


def test_consolidation_streams_leaf_by_leaf(wide_checkpoint, tmp_path):
  """zero_to_fp32: the safetensors file holds the exact fp32 weights; the peak host memory of the
  conversion (a fresh process) is bounded by the largest leaf plus tensorstore's fixed overhead
  (its reader threads and their allocator arenas, ~30 MiB here), far below the 128 MiB model."""
  directory, weights = wide_checkpoint
  out = tmp_path / "model.safetensors"
  report = json.loads(_subprocess("convert", str(directory), str(out)).strip().splitlines()[-1])
  largest, total = report["largest_leaf"], report["total"]
  rss = report["anon_peak"] - report["anon_before"]
  print(f"consolidation of {total / 2**20:.1f} MiB, largest leaf {largest / 2**20:.1f} MiB: "
        f"anonymous memory grew by {rss / 2**20:.1f} MiB at its peak; tracemalloc peak "
        f"{report['tracemalloc_peak'] / 2**20:.2f} MiB")
  assert report["tracemalloc_peak"] < 3 * largest
  assert rss < 3 * largest + (48 << 20) < total
  with safe_open(str(out), framework="numpy") as f:
    assert sorted(f.keys()) == sorted(weights)
    for path, x in weights.items():
      np.testing.assert_array_equal(f.get_tensor(path), x)


def test_import_weights_into_any_stage(tmp_path):
  """Consolidated weights (safetensors fp32, Orbax bf16) -> load_weights -> engine.init under
  another stage and device count: logical params equal the checkpoint's."""
  truth = _truth(3)
  source = _engine(3, 8, "bf16")
  source.save_checkpoint(_place(source, truth), tmp_path / "ckpt", 7)
  checkpoint.wait_until_finished()
  checkpoint.consolidate(tmp_path / "ckpt", safetensors=tmp_path / "w.safetensors")
  checkpoint.consolidate(tmp_path / "ckpt", orbax=tmp_path / "w16", dtype="bf16")
  target = _engine(2, 4)
  state = target.init(jax.random.key(1), params=target.load_weights(tmp_path /
                                                                          "w.safetensors"))
  for path, x in flat(target.logical_params(state)).items():
    np.testing.assert_array_equal(np.asarray(x), truth["params"][path])
  w16 = checkpoint.read_weights(tmp_path / "w16")
  for path, x in truth["params"].items():
    assert w16[path].dtype == jnp.bfloat16
    np.testing.assert_array_equal(w16[path], x.astype(jnp.bfloat16))

  with pytest.raises(CheckpointError, match=r"do not fit the model's shapes: blocks/attn_out/bias: "
                     r"\(2, 64\) in the weights, \(2, 32\) in the model"):
    _engine(0, 2, model=GPTConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32)).load_weights(
        tmp_path / "w.safetensors")


def test_16bit_weights_written_at_save_and_keep_last(tmp_path):
  """stage3_gather_16bit_weights_on_model_save writes consolidated bf16 weights in each step;
  keep=2 leaves the two newest steps and latest names the newest."""
  truth = _truth(4)
  engine = _engine(3, 8, "bf16", zero_optimization={
      "stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
  state = _place(engine, truth)
  for step in (1, 2, 3, 4):
    engine.save_checkpoint(state, tmp_path, step, keep=2)
  checkpoint.writer(tmp_path).close()  # waits, and releases the directory (its lock file goes)
  assert checkpoint.all_tags(tmp_path) == ["3", "4"] and checkpoint.latest_tag(tmp_path) == "4"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4", "latest"]
  w16 = checkpoint.read_weights(tmp_path / "4" / checkpoint.WEIGHTS16)
  for path, x in truth["params"].items():
    np.testing.assert_array_equal(w16[path], x.astype(jnp.bfloat16))


class _Tiny(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)))

  def __call__(self, x):
    return x @ self.w


@pytest.fixture(scope="module")
def tiny_state():
  """A stage-3 engine of an 8 x 4 model and its initial state (saves take ~0.1 s)."""
  engine = make_engine(3, _Tiny, lambda model, batch: jnp.mean(model(batch["x"]) ** 2))
  return engine, engine.init(jax.random.key(0))


@pytest.mark.parametrize("keep", [1, 2, 3, 4, 5])
def test_keep_leaves_the_newest_k_across_runs(tiny_state, tmp_path, keep):
  """keep=K over 6 saves leaves exactly the newest K complete checkpoints, also when a second run
  (a new Checkpointer of the directory, as after a resume) saves 4..6 after a first one saved 1..3
  (the issue's --keep 3 left only 6, --keep 5 left 5 and 6)."""
  engine, state = tiny_state
  newest = lambda last: [str(s) for s in range(max(1, last - keep + 1), last + 1)]
  for first, last in ((1, 3), (4, 6)):
    run = checkpoint.Checkpointer(tmp_path, keep=keep)
    for step in range(first, last + 1):
      run.save(engine.plan, state._replace(step=jax.device_put(np.int32(step), state.step.sharding)),
               engine.resources, config=engine.config, tx=engine.tx)
    run.close()
    assert checkpoint.all_tags(tmp_path) == newest(last)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(newest(last) + ["latest"])
    assert checkpoint.latest_tag(tmp_path) == str(last)


class _BoxedMlp(linen.Module):
  """A Linen MLP whose first kernel is logically partitioned (boxed) when ``boxed``."""
  boxed: bool

  @linen.compact
  def __call__(self, x):
    init = linen.initializers.lecun_normal()
    if self.boxed:
      init = linen.with_logical_partitioning(init, ("embed", "mlp"))
    return linen.Dense(4, name="down")(jax.nn.relu(linen.Dense(16, kernel_init=init,
                                                               name="up")(x)))


def test_boxed_linen_weights_convert_under_the_modules_names(tmp_path):
  """jzero convert unboxes nn.with_logical_partitioning params ('up/kernel', not
  'up/kernel/value'), so the safetensors load into the module built without boxes, and back into
  the boxed one; the 16-bit weights saved with the checkpoint are named so too."""
  batch = {"x": np.ones((8, 8), np.float32)}

  def engine(boxed: bool):
    return make_engine(ds_config(3, stage3_gather_16bit_weights_on_model_save=True),
                       _BoxedMlp(boxed), lambda model, b: jnp.mean(model(b["x"]) ** 2),
                       sample_batch=batch, init_inputs=lambda b: (b["x"],))

  boxed = engine(True)
  state = boxed.init(jax.random.key(0))
  boxed.save_checkpoint(state, tmp_path / "ckpt")
  checkpoint.wait_until_finished()
  out = tmp_path / "w.safetensors"
  assert cli_main(["convert", str(tmp_path / "ckpt"), "--safetensors", str(out)]) == 0
  names = {"down/bias", "down/kernel", "up/bias", "up/kernel"}
  with safe_open(str(out), framework="numpy") as f:
    assert set(f.keys()) == names
  assert set(checkpoint.read_weights(tmp_path / "ckpt" / "0" / checkpoint.WEIGHTS16)) == names
  trained = flat(linen.meta.unbox(boxed.logical_params(state)))
  for target in (engine(False), boxed):
    loaded = target.init(jax.random.key(1), params=target.load_weights(out))
    for name, x in flat(linen.meta.unbox(target.logical_params(loaded))).items():
      np.testing.assert_array_equal(np.asarray(x), np.asarray(trained[name]))
  old_names = tmp_path / "boxed_names.safetensors"  # written before the names were unboxed
  safetensors.numpy.save_file({("up/kernel/value" if n == "up/kernel" else n): np.asarray(x)
                               for n, x in trained.items()}, str(old_names))
  assert set(flat(boxed.load_weights(old_names))) == set(flat(state.params))


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
  """A finalized stage-2 checkpoint of SMALL on 8 devices (step 7)."""
  directory = tmp_path_factory.mktemp("small")
  engine = _engine(2, 8)
  engine.save_checkpoint(_place(engine, _truth(5)), directory, 7)
  checkpoint.wait_until_finished()
  return directory


def test_inspect_and_convert_cli(small_checkpoint, tmp_path, capsys):
  assert cli_main(["inspect", str(small_checkpoint)]) == 0
  out = capsys.readouterr().out
  for text in ("step 7", "ZeRO stage 2", "precision fp32", "data=8 (8 cpu devices)",
               "optimizer AdamW", "opt_state/0/mu/blocks/qkv/kernel", "(2, 64, 192)", "float32",
               "98,304", "15 weight leaves, 118,144 parameters", "totals: ", "on disk: "):
    assert text in out, text
  out_file = tmp_path / "w.safetensors"
  assert cli_main(["convert", str(small_checkpoint), "--safetensors", str(out_file), "--dtype",
                   "bf16"]) == 0
  assert f"wrote {out_file}" in capsys.readouterr().out
  with safe_open(str(out_file), framework="numpy") as f:
    assert f.get_tensor("pos").dtype == jnp.bfloat16 and len(f.keys()) == 15

  assert cli_main(["inspect", str(tmp_path / "missing")]) == 2
  assert "jzero: error: checkpoint directory" in capsys.readouterr().err
  assert cli_main(["convert", str(small_checkpoint)]) == 2
  assert "nothing to write" in capsys.readouterr().err


def test_restoring_reads_only_data(small_checkpoint, tmp_path, monkeypatch):
  """Nothing in a checkpoint is executed: restoring works with pickle disabled, and every file
  besides OCDBT's (manifests, data files) and Orbax's commit marker is JSON."""
  def refuse(*args, **kwargs):
    raise AssertionError("a checkpoint was unpickled")

  for name in ("load", "loads", "Unpickler"):
    monkeypatch.setattr(pickle, name, refuse)
  _engine(1, 4).load_checkpoint(small_checkpoint)
  checkpoint.consolidate(small_checkpoint, orbax=tmp_path / "weights")
  checkpoint.read_weights(tmp_path / "weights")
  for root in (small_checkpoint / "7", tmp_path / "weights"):
    for path in root.rglob("*"):
      if path.is_file() and path.name not in ("manifest.ocdbt", "commit_success.txt") and (
          path.parent.name != "d"):
        json.loads(path.read_text())


# --- damaged checkpoints and wrong models --------------------------------------------------------


def _damaged(small_checkpoint: Path, tmp_path: Path) -> Path:
  copy = tmp_path / "copy"
  shutil.copytree(small_checkpoint, copy)
  return copy


def _data_file(step_dir: Path) -> Path:
  return max((p for p in (step_dir / "state").rglob("d/*")), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_data_file_is_named(small_checkpoint, tmp_path, damage):
  directory = _damaged(small_checkpoint, tmp_path)
  victim = _data_file(directory / "7")
  if damage == "delete":
    victim.unlink()
  else:
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  rel = str(victim.relative_to(directory / "7"))
  with pytest.raises(CheckpointError, match=f"file {rel} (is missing|has .* bytes but)") as info:
    _engine(2, 8).load_checkpoint(directory)
  assert f"there is no other complete checkpoint in {directory}" in str(info.value)  # step 7 only
  with pytest.raises(CheckpointError, match=rel):
    checkpoint.consolidate(directory, safetensors=tmp_path / "w.safetensors")


def test_checkpoint_without_file_list_is_incomplete_and_refused(small_checkpoint, tmp_path):
  """A step committed by Orbax whose file list is missing (killed in between) is incomplete: it
  cannot be checked, so no reader takes it -- by tag it is refused naming the complete ones, as
  `latest` it is skipped with a warning, and inspect labels it."""
  directory = _damaged(small_checkpoint, tmp_path)
  (directory / "7" / checkpoint.FILES_FILE).unlink()
  assert checkpoint.all_tags(directory) == [] and checkpoint.incomplete_tags(directory) == ["7"]
  with pytest.raises(CheckpointError, match=r"7 is an incomplete checkpoint.*\(\[\]\)"):
    _engine(2, 8).load_checkpoint(directory, 7)
  with pytest.warns(JZeroWarning, match=r"skipping incomplete checkpoint\(s\) \['7'\]"), \
      pytest.raises(CheckpointError, match=r"latest names '7'.*not a complete checkpoint"):
    checkpoint.consolidate(directory, safetensors=tmp_path / "w.safetensors")
  assert not list(tmp_path.glob("w.safetensors*"))
  assert "INCOMPLETE" in checkpoint.describe(directory, 7)


def test_corrupt_metadata_and_missing_steps(small_checkpoint, tmp_path):
  engine = _engine(2, 8)
  with pytest.raises(CheckpointError, match="does not exist"):
    engine.load_checkpoint(tmp_path / "nowhere")
  with pytest.raises(CheckpointError, match=r"no checkpoint '3'.*complete checkpoints: \['7'\]"):
    engine.load_checkpoint(small_checkpoint, 3)
  directory = _damaged(small_checkpoint, tmp_path)
  (directory / "latest").unlink()  # killed before its first `latest`: 7 was saved to become it
  assert checkpoint.resume_tag(directory) == "7" and checkpoint.latest_step(directory) == 7
  (directory / "other").mkdir()
  with pytest.raises(CheckpointError, match=r"no 'latest' file \(it holds no complete checkpoint"):
    engine.load_checkpoint(directory / "other")
  (directory / "7" / "meta" / checkpoint.META_FILE).write_text("{not json")
  with pytest.raises(CheckpointError, match="file meta/jzero.json has 9 bytes but"):
    engine.load_checkpoint(directory, 7)
  (directory / "7" / checkpoint.FILES_FILE).unlink()  # unverifiable: incomplete, refused
  with pytest.raises(CheckpointError, match="incomplete checkpoint"):
    engine.load_checkpoint(directory, 7)


def test_other_model_is_refused_naming_the_leaf(small_checkpoint):
  wider = _engine(2, 8, model=GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=16))
  with pytest.raises(CheckpointError, match=r"pos: \(32, 64\) in the checkpoint, \(16, 64\)"):
    wider.load_checkpoint(small_checkpoint)


def test_saving_twice_or_bad_arguments_is_refused(small_checkpoint):
  engine = _engine(2, 8)
  state = _place(engine, _truth(5))
  with pytest.raises(CheckpointError, match="already exists"):
    engine.save_checkpoint(state, small_checkpoint, 7)
  with pytest.raises(CheckpointError, match="JSON-serialisable"):
    engine.save_checkpoint(state, small_checkpoint, 8, client_state={"f": object()})
  with pytest.raises(CheckpointError, match="keep must be"):
    checkpoint.Checkpointer(small_checkpoint, keep=0)


# --- the notebook --------------------------------------------------------------------------------


def test_notebook_zero3_to_flax_executes(tmp_path):
  """notebooks/zero3_to_flax.ipynb runs headless, from a folder that is not notebooks/: ZeRO-3
  training, checkpoint, convert, plain Flax evaluation equal to the engine's (the notebook
  asserts it)."""
  import nbclient
  import nbformat

  path = TESTS.parent / "notebooks" / "zero3_to_flax.ipynb"
  notebook = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "validation loss: plain Flax" in outputs
