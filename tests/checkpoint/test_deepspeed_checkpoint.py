"""DeepSpeed checkpoints in, without torch: real ZeRO 1/2/3 checkpoints written by DeepSpeed
0.19.8 (tests/data/deepspeed, README there) read, checked bit for bit against DeepSpeed's own
zero_to_fp32, and resumed in jzero at stages 1-3 on 2 and 8 devices, continuing DeepSpeed's losses;
a crafted .pt refused; damaged / missing rank files named; the CLI's inspect and convert."""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import shutil
import tracemalloc
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jzero
from jzero import checkpoint
from jzero.checkpoint.deepspeed_pt import load_pt
from jzero.cli import main as cli_main
from jzero.errors import CheckpointError, JZeroWarning
from zero_testing import make_engine

DATA = Path(__file__).parents[1] / "data" / "deepspeed"
FP32 = ("zero1_fp32_w2", "zero2_fp32_w2", "zero3_fp32_w2")
BF16 = ("zero2_bf16_w2", "zero3_bf16_w2")
SAVED_AT = 5  # DeepSpeed saved after step 5; losses.jsonl holds steps 1-10

#: fp32: a run resumed from the checkpoint continues DeepSpeed's losses within this (relative;
#: the issue's bound). Measured: <= 3.2e-7 (float rounding of another framework's kernels).
FP32_RTOL = 2e-5


# -- the torch model of the README, in Flax NNX, and the mapping of its names ---------------------

class Block(nnx.Module):
  """Pre-LN block: ``x + proj(attn(ln1(x)))``, ``x + out(gelu_tanh(fc(ln2(x))))``."""

  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    self.proj = nnx.Linear(d, d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
    self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
    self.out = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads)  # torch's view
    attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    x = x + self.proj(attn.reshape(b, t, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))


class TorchGPT(nnx.Module):
  """The README's torch GPT-2 (pre-LN, learned positions, untied head without bias)."""

  def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int,
               rngs: nnx.Rngs):
    self.wte = nnx.Embed(vocab, d_model, rngs=rngs)
    self.wpe = nnx.Embed(seq_len, d_model, rngs=rngs)
    self.blocks = nnx.List([Block(d_model, n_heads, rngs) for _ in range(n_layers)])
    self.ln_f = nnx.LayerNorm(d_model, epsilon=1e-5, rngs=rngs)
    self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

  def __call__(self, idx: jax.Array) -> jax.Array:
    x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def loss_fn(model: TorchGPT, batch: dict) -> jax.Array:
  logits = model(batch["inputs"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def convert(named: dict[str, np.ndarray]) -> dict:
  """torch names -> the NNX params tree: a Linear's ``weight`` [out, in] is a ``kernel`` [in, out],
  a LayerNorm's ``weight`` its ``scale``, an Embedding's ``weight`` its ``embedding``."""
  def linear(name: str, bias: bool = True) -> dict:
    kernel = {"kernel": named[f"{name}.weight"].T}
    return {**kernel, "bias": named[f"{name}.bias"]} if bias else kernel

  def norm(name: str) -> dict:
    return {"scale": named[f"{name}.weight"], "bias": named[f"{name}.bias"]}

  layers = 1 + max(int(k.split(".")[1]) for k in named if k.startswith("blocks."))
  return {
      "wte": {"embedding": named["wte.weight"]}, "wpe": {"embedding": named["wpe.weight"]},
      "blocks": {i: {"ln1": norm(f"blocks.{i}.ln1"), "qkv": linear(f"blocks.{i}.qkv"),
                     "proj": linear(f"blocks.{i}.proj"), "ln2": norm(f"blocks.{i}.ln2"),
                     "fc": linear(f"blocks.{i}.fc"), "out": linear(f"blocks.{i}.out")}
                 for i in range(layers)},
      "ln_f": norm("ln_f"), "head": linear("head", bias=False)}


# -- the runs ------------------------------------------------------------------------------------

def _json(name: str, file: str):
  return json.loads((DATA / name / file).read_text())


def _losses(name: str) -> np.ndarray:
  lines = (DATA / name / "losses.jsonl").read_text().splitlines()
  return np.array([json.loads(line)["loss"] for line in lines])


def _config(name: str, stage: int, offload: dict | None = None, **optimizer) -> dict:
  """The DeepSpeed run's config for jzero: its scheduler, clipping and precision, and the client
  torch.optim.AdamW of the README as an optimizer block."""
  ds = _json(name, "ds_config.json")
  params = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, **optimizer}
  cfg = {"train_batch_size": ds["train_batch_size"], "gradient_clipping": ds["gradient_clipping"],
         "optimizer": {"type": "AdamW", "params": params}, "scheduler": ds["scheduler"],
         "zero_optimization": {"stage": stage, **(offload or {})}}
  if ds.get("bf16", {}).get("enabled"):
    cfg["bf16"] = {"enabled": True}
  return cfg


_ENGINES: dict = {}


def _engine(name: str, stage: int, devices: int, offload: dict | None = None, **optimizer):
  """One engine per (precision, stage, devices): its step compiles once for every checkpoint."""
  cfg = _config(name, stage, offload, **optimizer)
  key = json.dumps([cfg, devices], sort_keys=True)
  if key not in _ENGINES:
    m = _json(name, "model.json")
    mesh = jzero.MeshSpec.from_dict({"axes": {"data": devices}}).build(
        devices=jax.devices()[:devices])
    _ENGINES[key] = make_engine(
        cfg, lambda rngs: TorchGPT(m["vocab"], m["d_model"], m["n_layers"], m["n_heads"],
                                   m["seq_len"], rngs), loss_fn, mesh=mesh)
  return _ENGINES[key]


def _continue(engine, state, name: str, steps: int = 5) -> np.ndarray:
  """Steps SAVED_AT+1 .. SAVED_AT+steps on DeepSpeed's global batches; their losses."""
  data = np.load(DATA / name / "batches.npz")
  losses = []
  for s in range(SAVED_AT, SAVED_AT + steps):
    batch = {k: data[k][s].astype(np.int32) for k in ("inputs", "targets")}
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return np.array(losses)


def bf16_bound() -> float:
  """What two bf16 runs may differ by, measured from DeepSpeed's own runs: steps 1-3 evaluate the
  same initial weights in every run (WarmupLR gives steps 1 and 2 a learning rate of 0), so there
  the bf16 runs' losses differ from the fp32 run's by bf16's error of the loss alone; two bf16
  runs each carrying that error differ by up to twice it. (0.0345 here, ~2^-7 relative: the loss
  is computed from bf16 logits and reported as bf16 numbers.)"""
  fp32 = _losses(FP32[0])[:3]
  return 2 * max(float(np.max(np.abs(_losses(b)[:3] - fp32))) for b in BF16)


CASES = [(name, stage, devices) for name in FP32 + BF16 for stage in (1, 2, 3)
         for devices in (2, 8)]


@pytest.mark.parametrize("name,stage,devices", CASES)
def test_resumed_run_continues_deepspeeds_losses(name, stage, devices):
  engine = _engine(name, stage, devices)
  ds = checkpoint.read_deepspeed(DATA / name / "checkpoint")
  state = engine.import_deepspeed(ds, convert)
  # placed in the plan: every leaf where the engine's shardings put it, the position restored
  want = [x.sharding for x in jax.tree.leaves(engine.abstract_state())]
  assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(state), want))
  adam, _, schedule = state.opt_state
  assert (int(state.step), int(adam.count), int(schedule.count)) == (SAVED_AT,) * 3
  logical = lambda tree: engine.plan.map(lambda leaf, x: np.asarray(leaf.to_logical(x)), tree)
  assert np.array_equal(logical(adam.mu)["blocks"][1]["fc"]["kernel"],
                        ds.exp_avg["blocks.1.fc.weight"].T)

  losses, reference = _continue(engine, state, name), _losses(name)[SAVED_AT:]
  if name in FP32:
    np.testing.assert_allclose(losses, reference, rtol=FP32_RTOL, atol=0)
  else:  # measured: <= 0.0173 (4.0e-3 relative), and ~1e-4 relative from DeepSpeed's fp32 run
    np.testing.assert_allclose(losses, reference, rtol=0, atol=bf16_bound())


@pytest.mark.parametrize("update", ["cpu_adam", "stream"])
def test_resumes_into_an_offloaded_plan(update):
  """ZeRO-Offload (its config's ``device: cpu``: the host Adam; and the streamed update): the
  moments are placed in host memory, where the plan keeps them -- the host Adam's numpy store
  (the train state holds placeholders), or the state's pinned_host arrays -- and the run goes on
  with DeepSpeed's losses."""
  name = "zero2_fp32_w2"
  engine = _engine(name, 2, 2, {"offload_optimizer": {"device": "cpu", "update": update}})
  state = engine.import_deepspeed(checkpoint.read_deepspeed(DATA / name / "checkpoint"), convert)
  mu = jax.tree.leaves(state.opt_state[0].mu)
  if update == "stream":
    assert {x.sharding.memory_kind for x in mu} == {"pinned_host"}
  else:
    assert all(x.size == 0 for x in mu)
    stored = jax.tree.leaves(engine.full_state(state).opt_state[0].mu)
    assert sum(x.size for x in stored) == sum(l.numel for l in engine.plan.leaf_list())
  np.testing.assert_allclose(_continue(engine, state, name), _losses(name)[SAVED_AT:],
                             rtol=FP32_RTOL, atol=0)


def test_bf16_bound_is_what_deepspeeds_runs_measure():
  """The bf16 bound is DeepSpeed's measurement, not a fitted number: the bf16 runs' losses at
  steps 1-3 (the same weights as the fp32 run's) are off by up to 0.0173, i.e. 0.9 of bf16's
  relative rounding 2^-8 of a loss near 4.85; the two DeepSpeed bf16 runs (stage 2, stage 3)
  report the same losses at bf16's resolution."""
  assert 0.03 < bf16_bound() < 0.04
  assert np.array_equal(_losses(BF16[0]), _losses(BF16[1]))


# -- the master, bit for bit ---------------------------------------------------------------------

def _numpy_reference(name: str, kind: str) -> dict[str, np.ndarray]:
  """zero_to_fp32's reassembly written out with numpy over the raw .pt contents (files read with
  jzero's unpickler, nothing of its reassembly used): ``kind`` "fp32" or a moment."""
  step = DATA / name / "checkpoint" / "global_step5"
  optim = sorted(step.glob("*optim_states.pt"))
  model = load_pt(sorted(step.glob("*model_states.pt"))[0])
  shapes = {k: tuple(v) for group in model["param_shapes"] for k, v in group.items()}
  states = [load_pt(f)["optimizer_state_dict"] for f in optim]
  world = len(states)
  if states[0]["zero_stage"] <= 2:  # one flat vector: the ranks' slices end to end
    flats = [s["single_partition_of_fp32_groups"][0] if kind == "fp32"
             else s["base_optimizer_state"]["state"][0][kind] for s in states]
    full, out, offset = np.concatenate(flats), {}, 0
    for k, shape in shapes.items():
      out[k] = full[offset:offset + math.prod(shape)].reshape(shape)
      offset += math.prod(shape)
    return out
  flats = [s["fp32_flat_groups"][0] if kind == "fp32"
           else s["optimizer_state_dict"]["state"][0][kind] for s in states]
  out, offset = {}, 0
  for k, shape in shapes.items():  # every rank holds ceil(n / world) of every parameter
    n = math.prod(shape)
    part = -(-n // world)
    out[k] = np.concatenate([f[offset:offset + part] for f in flats])[:n].reshape(shape)
    offset += part
  return out


@pytest.mark.parametrize("name", FP32 + BF16)
def test_master_is_zero_to_fp32_bit_for_bit(name):
  ds = checkpoint.read_deepspeed(DATA / name / "checkpoint")
  deepspeeds = np.load(DATA / name / "zero_to_fp32.npz")  # DeepSpeed's own zero_to_fp32 output
  for kind, got in (("fp32", ds.params), ("exp_avg", ds.exp_avg),
                    ("exp_avg_sq", ds.exp_avg_sq)):
    ours = _numpy_reference(name, kind)
    assert list(got) == list(ours) == (list(deepspeeds.files) if kind == "fp32" else list(ours))
    for k, x in got.items():
      assert x.dtype == np.float32 and x.shape == ours[k].shape
      assert np.array_equal(x.view(np.uint32), ours[k].view(np.uint32)), (kind, k)
      if kind == "fp32":
        assert np.array_equal(x.view(np.uint32), deepspeeds[k].view(np.uint32)), k
  stage = int(name[4])
  assert (ds.zero_stage, ds.world_size, ds.tag, ds.step, ds.global_steps) == (
      stage, 2, "global_step5", SAVED_AT, SAVED_AT)
  assert ds.lr_scheduler == {"last_batch_iteration": SAVED_AT - 1}
  assert ds.client_state == {"data_step": 5}
  assert ds.optimizer == "AdamW" and ds.dtype == ("bf16" if "bf16" in name else "fp32")
  assert [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in ds.param_groups] == [
      {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


def test_imported_state_saves_and_restores_as_a_jzero_checkpoint(tmp_path):
  name = "zero3_fp32_w2"
  engine = _engine(name, 2, 8)
  state = engine.import_deepspeed(checkpoint.read_deepspeed(DATA / name / "checkpoint"), convert)
  engine.save_checkpoint(state, tmp_path / "ckpt", client_state={"data_step": 5})
  engine.wait_for_checkpoints()
  restored, client = engine.load_checkpoint(tmp_path / "ckpt", with_client_state=True)
  assert client == {"data_step": 5} and int(restored.step) == SAVED_AT
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


# -- what the engine is told when the checkpoint and it disagree ----------------------------------

def test_other_optimizer_settings_warn_and_a_wrong_convert_is_refused():
  name = "zero1_fp32_w2"
  ds = checkpoint.read_deepspeed(DATA / name / "checkpoint")
  engine = _engine(name, 1, 2, weight_decay=0.0)
  with pytest.warns(JZeroWarning, match=r"weight_decay 0.1 in param group 0, 0.0 here"):
    engine.import_deepspeed(ds, convert)
  untransposed = lambda named: convert({k: v.T if k == "head.weight" else v
                                        for k, v in named.items()})
  with pytest.raises(CheckpointError, match=r"head/kernel: \(128, 64\) from convert, \(64, 128\)"):
    _engine(name, 1, 2).import_deepspeed(ds, untransposed)


# -- files that must not be read -----------------------------------------------------------------

class _RunsACommand:
  """Pickles as ``os.system(command)``: what a crafted checkpoint would run when unpickled."""

  def __init__(self, command: str):
    self.command = command

  def __reduce__(self):
    return os.system, (self.command,)


def _pt(path: Path, payload: bytes) -> Path:
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr(f"{path.stem}/data.pkl", payload)
    archive.writestr(f"{path.stem}/byteorder", "little")
  return path


def _copy(tmp_path: Path, name: str) -> Path:
  target = tmp_path / name
  shutil.copytree(DATA / name / "checkpoint", target)
  for f in target.rglob("*"):
    f.chmod(0o644 if f.is_file() else 0o755)
  return target


@pytest.mark.parametrize("protocol", [2, 4])  # GLOBAL and STACK_GLOBAL
def test_a_pickle_calling_os_system_is_refused_and_nothing_runs(tmp_path, protocol):
  marker = tmp_path / "ran"
  payload = pickle.dumps({"module": _RunsACommand(f"touch {marker}")}, protocol=protocol)
  with pytest.raises(CheckpointError, match=rf"refused to load the global "
                                            rf"{os.system.__module__}\.system"):
    load_pt(_pt(tmp_path / "evil.pt", payload))
  # as a rank file of a real checkpoint: refused naming the file
  ckpt = _copy(tmp_path, "zero2_fp32_w2")
  rank1 = ckpt / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
  _pt(rank1, payload)
  with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: refused"):
    checkpoint.read_deepspeed(ckpt)
  assert not marker.exists()


def test_a_truncated_or_missing_rank_file_is_named(tmp_path):
  ckpt = _copy(tmp_path, "zero3_bf16_w2")
  rank1 = ckpt / "global_step5" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
  rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
  with pytest.raises(CheckpointError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt is "
                                            r"not a readable torch \.pt file"):
    checkpoint.read_deepspeed(ckpt)
  rank1.unlink()
  with pytest.raises(CheckpointError, match=r"missing: \['bf16_zero_pp_rank_1_mp_rank_00_optim_"):
    checkpoint.read_deepspeed(ckpt)


# -- checkpoints DeepSpeed would write for other runs (files rewritten through a torch-free .pt
# writer: another world size, another optimizer) ---------------------------------------------------

class _Global:
  """A global of torch's the pickle names (pickle asks a reduce's function to be callable)."""

  def __init__(self, module: str, name: str):
    self.module, self.name = module, name

  def __call__(self, *args):
    raise NotImplementedError


class _Storage:
  def __init__(self, array: np.ndarray):
    self.array = array


class _PtPickler(pickle._Pickler):  # the pure-Python pickler: it lets save() write a GLOBAL
  """torch.save's pickle of a tree of numpy arrays, dicts, lists and scalars (protocol 2)."""

  def __init__(self, file, storages: list):
    super().__init__(file, protocol=2)
    self.storages = storages

  def save(self, obj, save_persistent_id=True):
    if isinstance(obj, _Global):
      self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
      return
    super().save(obj, save_persistent_id)

  def persistent_id(self, obj):
    if isinstance(obj, _Storage):
      array = obj.array
      self.storages.append(array)
      kind = {"float32": "FloatStorage", "bfloat16": "BFloat16Storage"}[array.dtype.name]
      return ("storage", _Global("torch", kind), str(len(self.storages) - 1), "cpu", array.size)
    return None

  def reducer_override(self, obj):
    if isinstance(obj, np.ndarray):
      array = np.ascontiguousarray(obj)
      strides = tuple(s // array.itemsize for s in array.strides)
      return (_Global("torch._utils", "_rebuild_tensor_v2"),
              (_Storage(array.reshape(-1)), 0, array.shape, strides, False,
               collections.OrderedDict()))
    if isinstance(obj, checkpoint.deepspeed_pt.DeepSpeedValue):  # e.g. LossScaler
      return _Global(*obj.type_name.rsplit(".", 1)), (), obj.attributes
    return NotImplemented


def _write_pt(path: Path, obj) -> None:
  """Writes ``obj`` as torch.save would, to a new file renamed over ``path`` (``obj`` may view a
  memory map of the old one)."""
  storages: list = []
  buffer = io.BytesIO()
  _PtPickler(buffer, storages).dump(obj)
  tmp = path.with_name(path.name + ".tmp")
  with zipfile.ZipFile(tmp, "w") as archive:
    archive.writestr(f"{path.stem}/data.pkl", buffer.getvalue())
    archive.writestr(f"{path.stem}/byteorder", "little")
    for key, array in enumerate(storages):
      archive.writestr(f"{path.stem}/data/{key}", array.tobytes())
  os.replace(tmp, path)


def _repartition(ds, world: int, stage: int, target: Path) -> None:
  """``ds`` written as DeepSpeed lays out a ``world``-rank stage-2 or stage-3 checkpoint (its
  padding rules: stage 2 pads the flat vector to a multiple of 2 x world, stage 3 each parameter
  to a multiple of world), with a tied alias of ``head.weight`` in ``shared_params``."""
  source = Path(ds.directory)
  model = load_pt(source / ("mp_rank_00_model_states.pt" if ds.zero_stage <= 2 else
                            "zero_pp_rank_0_mp_rank_00_model_states.pt"))
  model = {**model, "dp_world_size": world, "shared_params": {"lm_head.weight": "head.weight"},
           "module": {}}
  optim = load_pt(sorted(source.glob("*optim_states.pt"))[0])
  target.mkdir(parents=True)
  (target.parent / "latest").write_text(target.name)

  def flat(named):
    if stage == 2:
      whole = np.concatenate([x.reshape(-1) for x in named.values()])
      whole = np.pad(whole, (0, -whole.size % (2 * world)))
      return np.split(whole, world)
    pieces = [np.pad(x.reshape(-1), (0, -x.size % world)).reshape(world, -1)
              for x in named.values()]
    return list(np.concatenate(pieces, axis=1))

  masters, avg, avg_sq = flat(ds.params), flat(ds.exp_avg), flat(ds.exp_avg_sq)
  for rank in range(world):
    torch_state = {"state": {0: {"exp_avg": avg[rank], "exp_avg_sq": avg_sq[rank],
                                 "step": np.array(float(ds.step), np.float32)}},
                   "param_groups": optim["optimizer_state_dict"][
                       "base_optimizer_state" if ds.zero_stage <= 2 else "optimizer_state_dict"][
                       "param_groups"]}
    state = {"zero_stage": stage, "partition_count": world}
    if stage == 2:
      state.update(single_partition_of_fp32_groups=[masters[rank]],
                   base_optimizer_state=torch_state)
    else:
      state.update(fp32_flat_groups=[masters[rank]], optimizer_state_dict=torch_state)
    _write_pt(target / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
              {"optimizer_state_dict": state, "ds_version": ds.ds_version})
  for rank in range(1 if stage == 2 else world):
    _write_pt(target / ("mp_rank_00_model_states.pt" if stage == 2 else
                        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), model)


@pytest.mark.parametrize("stage", [2, 3])
def test_any_world_size_with_deepspeeds_padding(tmp_path, stage):
  """3 ranks: every 64-element parameter padded at stage 3, the flat vector at stage 2."""
  ds = checkpoint.read_deepspeed(DATA / "zero3_fp32_w2" / "checkpoint")
  _repartition(ds, 3, stage, tmp_path / "ckpt" / "global_step5")
  again = checkpoint.read_deepspeed(tmp_path / "ckpt")
  assert (again.world_size, again.zero_stage) == (3, stage)
  assert list(again.params) == list(ds.params) + ["lm_head.weight"]
  for kind in ("params", "exp_avg", "exp_avg_sq"):
    got, want = getattr(again, kind), getattr(ds, kind)
    assert all(np.array_equal(got[k], want[k]) for k in want), kind
    assert np.array_equal(got["lm_head.weight"], want["head.weight"])


def test_another_optimizer_is_refused_naming_what_it_lacks(tmp_path):
  ckpt = _copy(tmp_path, "zero2_fp32_w2")
  for f in (ckpt / "global_step5").glob("*optim_states.pt"):
    content = load_pt(f)
    torch_state = content["optimizer_state_dict"]["base_optimizer_state"]
    state = torch_state["state"][0]
    torch_state["state"][0] = {"momentum_buffer": state["exp_avg"]}  # torch.optim.SGD's
    _write_pt(f, content)
  with pytest.raises(CheckpointError, match=r"state holds \['momentum_buffer'\]: jzero imports "
                                            r"Adam / AdamW .* it has no \['exp_avg', 'exp_avg_sq',"
                                            r" 'step'\]"):
    checkpoint.read_deepspeed(ckpt)
  out = tmp_path / "weights.safetensors"  # the weights alone still convert
  assert cli_main(["convert", "--from-deepspeed", str(ckpt), "--safetensors", str(out)]) == 0


# -- jzero inspect / jzero convert ---------------------------------------------------------------

def test_cli_inspect_describes_a_deepspeed_checkpoint(capsys):
  assert cli_main(["inspect", str(DATA / "zero3_bf16_w2" / "checkpoint")]) == 0
  text = capsys.readouterr().out
  for line in ("tag 'global_step5', global step 5", "ZeRO stage 3, world size 2, precision bf16",
               "optimizer AdamW (lr 0.001, betas (0.9, 0.95), eps 1e-08, weight_decay 0.1), "
               "update count 5", "WarmupLR state {'last_batch_iteration': 4}",
               "client state: {'data_step': 5}", "blocks.0.qkv.weight   [192, 64]         49,152",
               "29 parameters, 118,528 elements: fp32 master 474,112 bytes"):
    assert line in text, line


def _peak_bytes(*argv: str) -> int:
  """Peak Python-allocated bytes (numpy's included) of ``jzero ARGV``, run in this process."""
  tracemalloc.start()
  assert cli_main(list(argv)) == 0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  return peak


@pytest.mark.parametrize("name", ["zero1_fp32_w2", "zero3_bf16_w2"])
def test_cli_convert_from_deepspeed_is_zero_to_fp32_streamed(tmp_path, name, capsys):
  out, source = tmp_path / "model.safetensors", str(DATA / name / "checkpoint")
  converting = _peak_bytes("convert", "--from-deepspeed", source, "--safetensors", str(out))
  assert "29 tensors" in capsys.readouterr().out
  reference = np.load(DATA / name / "zero_to_fp32.npz")
  weights = load_file(str(out))
  assert list(weights) == list(reference.files)
  assert all(np.array_equal(weights[k], reference[k]) for k in reference.files)
  # streamed: beyond the pickles (what inspect reads too), about one parameter is in memory at a
  # time -- the largest is 64 KiB of the 463 KiB
  largest, total = max(x.nbytes for x in weights.values()), sum(x.nbytes for x in weights.values())
  extra = converting - _peak_bytes("inspect", source)
  assert extra < 2 * largest < total / 3, (extra, largest)
  assert cli_main(["convert", "--from-deepspeed", source, "--safetensors", str(out)]) == 2
  assert "already exists" in capsys.readouterr().err


def test_notebook_deepspeed_resume_executes_and_is_committed_with_its_plot(tmp_path):
  """notebooks/deepspeed_resume.ipynb resumes two shared checkpoints and plots DeepSpeed's losses
  beside jzero's continuation (its own asserts carry the bounds), run from a folder that is not
  notebooks/ (it reads the checkpoints wherever it runs)."""
  import nbclient
  import nbformat

  path = Path(__file__).parents[2] / "notebooks" / "deepspeed_resume.ipynb"
  committed = nbformat.read(path, as_version=4)
  outputs = lambda nb: [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert any("image/png" in o.get("data", {}) for o in outputs(committed)), (
      "committed without its plot: run notebooks/build_deepspeed_resume.py")
  notebook = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  assert not [o for o in outputs(notebook) if o.get("output_type") == "error"]
  assert "zero2_fp32_w2: max relative distance" in "".join(o.get("text", "")
                                                             for o in outputs(notebook))
