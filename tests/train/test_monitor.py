"""jzero.train.monitor and jzero.analysis.flops: DeepSpeed's tensorboard / csv_monitor / wandb
blocks write every step's metrics, read back here and compared with the console's losses; the
throughput's FLOPs, peak and model FLOPs utilization."""

from __future__ import annotations

import collections
import csv
import logging
import re
import struct
import time
import types

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jzero.analysis import flops
from jzero.analysis.hlo import matmul_flops
from jzero.config import Config
from jzero.errors import ConfigError, NotSupportedError
from jzero.models import GPTConfig
from jzero.train.loop import train_loop
from jzero.train.monitor import step_events
from zero_testing import batches, ds_config, make_engine

TINY = GPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16)
N = 8  # train_batch_size: one sample per simulated device


def _engine(**monitors):
  config = {**ds_config(0), "steps_per_print": 1, **monitors}
  return make_engine(config, model=TINY, tokens_per_sample=TINY.seq_len)


def _tensorboard_events(log_dir):
  """tag -> [(step, value)] of an event file, read record by record (TFRecord framing: length,
  masked CRC32C of the length, the Event proto, its masked CRC32C) with tensorboardX's protos."""
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c

  (path,) = log_dir.glob("events.out.tfevents.*")
  data, pos = path.read_bytes(), 0
  scalars, texts = collections.defaultdict(list), {}
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
    body = data[pos + 12:pos + 12 + length]
    assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(body)
    pos += 16 + length
    event = event_pb2.Event.FromString(body)
    for value in event.summary.value:
      if value.HasField("simple_value"):
        scalars[value.tag].append((event.step, value.simple_value))
      elif value.HasField("tensor"):
        texts[value.tag.split("/text_summary")[0]] = value.tensor.string_val[0].decode()
  return scalars, texts


def _csv_rows(log_dir, tag):
  with open(log_dir / (tag.replace("/", "_") + ".csv"), newline="") as f:
    header, *rows = list(csv.reader(f))
  return header, [(int(step), float(value)) for step, value in rows]


def test_tensorboard_and_csv_hold_every_step_with_the_console_losses(tmp_path, caplog):
  engine = _engine(tensorboard={"enabled": True, "output_path": str(tmp_path / "logs"),
                                "job_name": "tiny"},
                   csv_monitor={"enabled": True, "output_path": str(tmp_path / "logs"),
                                "job_name": "tiny_csv"})
  data = batches(TINY.seq_len, N, 3)
  state = engine.init(jax.random.key(0))
  logger = logging.getLogger("jzero")  # (it does not propagate to caplog's root handler)
  logger.addHandler(caplog.handler)
  try:
    result = train_loop(engine, state, lambda step: engine.shard_batch(data[step]), 3,
                        progress=False)
  finally:
    logger.removeHandler(caplog.handler)
  console = [float(m[1]) for m in re.finditer(r"step \d+: loss (\d+\.\d+)", caplog.text)]
  assert console == [round(loss, 4) for loss in result.losses]

  # DeepSpeed's layout: the loss at the samples seen before the step, lr after it
  scalars, texts = _tensorboard_events(tmp_path / "logs" / "tiny")
  assert [step for step, _ in scalars["Train/Samples/train_loss"]] == [0, 8, 16]
  assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx(result.losses,
                                                                               rel=1e-7)  # fp32
  assert scalars["Train/Samples/lr"] == [(8, pytest.approx(1e-3)), (16, pytest.approx(1e-3)),
                                         (24, pytest.approx(1e-3))]
  assert [step for step, _ in scalars["Train/Samples/grad_norm"]] == [8, 16, 24]
  assert "Train/Samples/loss_scale" not in scalars  # fp16 only, as DeepSpeed
  # the step that compiled has no throughput; the others have tokens = samples x seq_len
  tokens = dict(scalars["Train/Samples/tokens_per_second"])
  samples = dict(scalars["Train/Samples/samples_per_second"])
  assert sorted(tokens) == [16, 24] and sorted(samples) == [16, 24]
  assert tokens[24] == pytest.approx(samples[24] * TINY.seq_len, rel=1e-6)
  assert all(0 < mfu < 1 for _, mfu in scalars["Train/Samples/mfu"])
  report = engine.memory_report(result.state)
  assert scalars["Memory/measured_bytes/params"] == [(8, report.measured_bytes("params"))]
  assert scalars["Memory/predicted_bytes/optimizer"] == [
      (8, pytest.approx(report.predicted_bytes("optimizer")))]
  assert '"stage": 0' in texts["DeepSpeed/config"]

  header, rows = _csv_rows(tmp_path / "logs" / "tiny_csv", "Train/Samples/train_loss")
  assert header == ["step", "train_loss"]
  assert rows == list(zip([0, 8, 16], result.losses))  # every digit
  assert _csv_rows(tmp_path / "logs" / "tiny_csv", "Train/Samples/lr")[1] == [
      (8, pytest.approx(1e-3)), (16, pytest.approx(1e-3)), (24, pytest.approx(1e-3))]
  with open(tmp_path / "logs" / "tiny_csv" / "deepspeed_config.csv", newline="") as f:
    config = dict(csv.reader(f))
  assert config["train_batch_size"] == "8"


def test_lr_is_the_next_steps_as_deepspeed_logs_it(tmp_path):
  """DeepSpeed's engine writes ``get_lr()`` after ``lr_scheduler.step()``: the lr event at k x
  train_batch_size samples is the lr step k+1 uses, and after a skipped fp16 step (no scheduler
  step) step k's own. Step 2's batch holds a token past the vocabulary (a NaN loss: skipped);
  each event is checked against the lr the next step reports using, and get_lr() of DeepSpeed's
  engine over this one (the 4-tuple's first)."""
  warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                           "warmup_num_steps": 10, "warmup_type": "linear"}}
  engine = _engine(scheduler=warmup, fp16={"enabled": True, "initial_scale_power": 8},
                   csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "lr"})
  engine.check_input_ids = False
  data = batches(TINY.seq_len, N, 4)
  data[1] = {**data[1], "tokens": data[1]["tokens"].copy()}
  data[1]["tokens"][0, 3] = TINY.vocab_size + 44
  state, used, skipped, next_lr = engine.init(jax.random.key(0)), [], [], []
  deepspeed_engine, *_ = engine
  assert deepspeed_engine.get_lr() == [pytest.approx(float(engine.schedule(0)))]
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    used.append(float(metrics["lr"]))
    skipped.append(bool(metrics["overflow"]))
    next_lr.append(deepspeed_engine.get_lr()[0])
  assert skipped == [False, True, False, False]
  logged = _csv_rows(tmp_path / "lr", "Train/Samples/lr")[1]
  assert [samples for samples, _ in logged] == [8, 16, 24, 32]
  # WarmupLR's count k lr: the first two steps share count 0's (DeepSpeed's scheduler)
  schedule = [float(engine.schedule(count)) for count in range(4)]
  assert used == pytest.approx([schedule[0], schedule[1], schedule[1], schedule[2]])
  assert [lr for _, lr in logged] == pytest.approx(used[1:] + [schedule[3]])  # the next step's
  assert logged[1][1] == pytest.approx(used[1])  # the skipped step: its own
  assert next_lr == pytest.approx([lr for _, lr in logged])
  assert used[2] != pytest.approx(used[3])  # the warm-up moves: the test can tell steps apart


def test_step_events_follow_deepspeed_names_and_axes():
  """fp16's loss scale, the breakdown's times and GPU memory, without an engine: step 3 of 8
  samples writes the loss at 16 samples seen, the rest at 24; an unknown lr is left out."""
  metrics = {"loss": 2.5, "lr": float("nan"), "loss_scale": 1024.0, "grad_norm": 0.5}
  timing = types.SimpleNamespace(forward_backward_s=0.25, optimizer_s=0.125)
  events = step_events(3, 8, metrics, fp16=True, timing=timing,
                       memory_stats={"bytes_in_use": 100, "peak_bytes_in_use": 150, "other": 1})
  assert events == [
      ("Train/Samples/train_loss", 2.5, 16), ("Train/Samples/loss_scale", 1024.0, 24),
      ("Train/Samples/grad_norm", 0.5, 24),
      ("Train/Samples/elapsed_time_ms_forward_backward", 250.0, 24),
      ("Train/Samples/elapsed_time_ms_step", 125.0, 24),
      ("Train/Samples/memory_bytes_in_use", 100.0, 24),
      ("Train/Samples/memory_peak_bytes_in_use", 150.0, 24)]


def _wandb_records(path):
  """The records of a wandb run file: W&B's header, then LevelDB's log format (32 KiB blocks of
  chunks: CRC32C, length, type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4)."""
  from wandb.proto import wandb_internal_pb2

  data = path.read_bytes()
  assert data[:4] == b":W&B"
  pos, records, pending = 7, [], b""
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
      pos += 32768 - pos % 32768
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def _wandb_run_file(root, timeout_s: float = 60.0):
  """The records of the one offline run under ``root``, once its exit record (finish's last) is
  written: wandb's service process writes the file, and under load it may still be writing when
  finish() returns."""
  deadline = time.monotonic() + timeout_s
  while True:
    paths = list(root.glob("wandb/offline-run-*/run-*.wandb"))
    records = _wandb_records(paths[0]) if len(paths) == 1 else []
    if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
      assert len(paths) == 1, paths
      return records
    time.sleep(0.5)


def test_wandb_offline_run_logs_every_step(tmp_path, monkeypatch):
  pytest.importorskip("wandb")  # the monitor extra (in the test extra)
  for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                      "WANDB_CONSOLE": "off"}.items():
    monkeypatch.setenv(name, value)
  engine = _engine(wandb={"enabled": True, "project": "jzero-test", "group": "tiny"})
  data = batches(TINY.seq_len, N, 2)
  state, losses = engine.init(jax.random.key(0)), []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  engine.monitor.close()  # finishes the run: its file is complete

  records = _wandb_run_file(tmp_path)
  run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
  assert (run.project, run.run_group) == ("jzero-test", "tiny")
  history = collections.defaultdict(list)
  for record in records:
    if record.WhichOneof("record_type") == "history":
      items = {item.key or "/".join(item.nested_key): item.value_json
               for item in record.history.item}
      for key, value in items.items():
        if key.startswith("Train/"):
          history[key].append((int(items["_step"]), float(value)))
  assert history["Train/Samples/train_loss"] == [(0, pytest.approx(losses[0], rel=1e-12)),
                                                 (8, pytest.approx(losses[1], rel=1e-12))]
  assert [step for step, _ in history["Train/Samples/lr"]] == [8, 16]


def test_an_enabled_monitor_without_its_package_names_the_extra(monkeypatch):
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "tensorboardX" else real(name, *a))
  with pytest.raises(ConfigError, match=r'tensorboard.enabled: needs the tensorboardX package'
                                        r'(.|\n)*pip install "jzero\[monitor\]"'):
    make_engine({**ds_config(0), "tensorboard": {"enabled": True}}, model=TINY,
                mesh=object())  # the mesh is not looked at: the error comes first


def test_monitor_blocks_are_read_as_deepspeed_reads_them():
  config = Config.load({"tensorboard": {"enabled": True, "output_path": "logs/",
                                        "job_name": "train_bert"},
                        "csv_monitor": {"enabled": True}, "wandb": {"team": "t"}})
  assert (config.tensorboard.output_path, config.tensorboard.job_name) == ("logs/", "train_bert")
  assert config.csv_monitor.job_name == "DeepSpeedJobName" and config.wandb.project == "deepspeed"
  with pytest.raises(ConfigError, match="tensorboard.enable: unknown key; did you mean 'enabled'"):
    Config.load({"tensorboard": {"enable": True}})
  with pytest.raises(NotSupportedError, match=r"comet.enabled=true \(the Comet monitor"):
    Config.load({"comet": {"enabled": True, "project": "p"}}).check_supported()
  Config.load({"comet": {"enabled": False}}).check_supported()  # off: nothing to refuse


def test_matmul_flops_count_every_run_of_a_loop_body():
  n, layers = 128, 4

  def scanned(ws, x):
    return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()

  def unrolled(ws, x):
    for i in range(layers):
      x = jnp.tanh(x @ ws[i])
    return x.sum()

  ws, x = jnp.ones((layers, n, n)), jnp.ones((n, n))
  grad_ws = lambda f: jax.jit(jax.grad(f)).lower(ws, x).compile()  # noqa: E731
  # forward, and in backward the weights' and the activations' gradients: 3 matmuls per layer
  assert flops.step_flops(grad_ws(scanned)) == 3 * layers * 2 * n**3
  # XLA's cost analysis counts the loop body once
  assert grad_ws(scanned).cost_analysis()["flops"] < 1.1 * 3 * 2 * n**3
  # without a loop both see the same matmuls (the first layer needs no input gradient)
  compiled = grad_ws(unrolled)
  assert flops.step_flops(compiled) == (3 * layers - 1) * 2 * n**3
  assert flops.step_flops(compiled) == pytest.approx(compiled.cost_analysis()["flops"], rel=0.01)
  batched = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b)).lower(
      jnp.ones((3, 64, 32)), jnp.ones((3, 32, 16))).compile()
  assert flops.step_flops(batched) == 2 * 3 * 64 * 32 * 16


def test_matmul_flops_read_a_cublas_gemm():
  """A GPU program whose gemm autotuning chose cuBLAS calls it as a custom call that carries the
  dot's dimension numbers (XLA's text for it, shortened)."""
  config = ('{"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{'
            '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
            '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')
  hlo = f"""HloModule m

ENTRY %main (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {{
  %p0 = f32[64,32]{{1,0}} parameter(0)
  %p1 = f32[32,16]{{1,0}} parameter(1)
  %gemm = (f32[64,16]{{1,0}}, s8[4194304]{{0}}) custom-call(f32[64,32]{{1,0}} %p0, \
f32[32,16]{{1,0}} %p1), custom_call_target="__cublas$gemm", backend_config={config}
  ROOT %out = f32[64,16]{{1,0}} get-tuple-element(%gemm), index=0
}}
"""
  assert matmul_flops(hlo) == 2 * 64 * 16 * 32


def test_peaks_name_their_source():
  h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  peak = flops.peak_flops(jnp.bfloat16, [h100] * 8)
  assert peak.flops_per_second == 8 * 989.5e12 and "NVIDIA datasheet, dense" in peak.source
  assert flops.peak_flops(jnp.float32, [h100]).flops_per_second == 494.5e12  # tf32
  pcie = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 PCIe")
  assert flops.peak_flops(jnp.bfloat16, [pcie]).flops_per_second == 756.5e12
  assert flops.peak_flops(jnp.bfloat16, [types.SimpleNamespace(
      platform="gpu", device_kind="NVIDIA L4")]).flops_per_second == 121e12  # the planner's specs
  assert flops.peak_flops(jnp.bfloat16, [types.SimpleNamespace(
      platform="gpu", device_kind="Tesla K80")]) is None  # unknown: no MFU rather than a guess
  cpu = flops.peak_flops(jnp.float32)
  assert cpu.flops_per_second > 1e9 and cpu.source.startswith("measured on this host")
  assert flops.peak_flops(jnp.float32) is cpu  # measured once


def test_loop_reports_tokens_per_second_and_mfu_from_the_compiled_step(tmp_path):
  engine = _engine()
  data = batches(TINY.seq_len, N, 3)
  result = train_loop(engine, engine.init(jax.random.key(0)),
                      lambda step: engine.shard_batch(data[step]), 3, progress=False)
  t = result.throughput
  step_seconds = sorted(result.step_times[1:])[0]  # the median of two is their mean; check one
  assert t.tokens_per_second == pytest.approx(t.samples_per_second * TINY.seq_len)
  assert t.samples_per_second == pytest.approx(N / t.step_seconds)
  assert step_seconds <= t.step_seconds <= max(result.step_times[1:])
  # one sample of seq_len tokens per device: 6 FLOPs per parameter and token (forward 2,
  # backward 4), plus attention's two matmuls; the embedding lookup is no matmul, the tied
  # output head is one
  params = sum(leaf.numel for leaf in engine.plan.leaf_list())
  assert 0.9 < t.flops_per_step / (6 * params * TINY.seq_len) < 1.3
  assert t.mfu == pytest.approx(t.flops_per_step * 8 / t.step_seconds / t.peak.flops_per_second)
  assert f"MFU {t.mfu:.1%} of" in str(t) and "measured on this host" in str(t)
