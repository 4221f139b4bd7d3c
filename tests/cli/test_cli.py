"""The `jzero` command line end to end (subprocesses, tiny model)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import jzero
from jzero import cli
from jzero.config import Config
from jzero.errors import JZeroWarning
from zero_testing import free_port

CONFIGS = Path(__file__).parents[2] / "configs"
OWN_MODEL = Path(__file__).parents[1] / "own_model.py"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--no-progress"]


def _jzero(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jzero.cli", *args], capture_output=True,
                        text=True, env=env, timeout=600)


def _python(*cmd: str, **env: str) -> subprocess.CompletedProcess:
  """``python *cmd`` with the suite's environment less JAX_PLATFORMS (as a user's shell), plus env."""
  base = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  return subprocess.run([sys.executable, *cmd], capture_output=True, text=True,
                        env={**base, **env}, timeout=300)


# What the CUDA plugin's libraries print when they load without a driver (absl before its
# initialisation, and the cudart stub), and the plugin's version-check traceback at backend start.
PLUGIN_NOISE = ("All log messages before absl::InitializeLog()", "cudart_stub.cc",
                "Jax plugin configuration error")


def test_a_quiet_start_without_a_gpu():
  """`import jzero` writes nothing to stderr on a machine without an NVIDIA driver, whether or not
  JAX's CUDA plugin (the gpu-aot extra) is installed, and without touching file descriptors: the
  plugin is not loaded where CUDA cannot run (jzero.runtime.quiet_start). A script that imports
  JAX first still gets the three lines `import jax` itself prints, and nothing from the backends'
  start (where the plugin's traceback was)."""
  from jzero.runtime import quiet_start
  if quiet_start.cuda_can_run():
    pytest.skip("an NVIDIA driver is present: the plugin is loaded and its lines are not noise")
  for env in ({}, {"JAX_PLATFORMS": "cpu"}):
    imported = _python("-c", "import jzero, jax; jax.devices()", **env)
    assert imported.returncode == 0 and imported.stderr == "", (env, imported.stderr)
  closed = _python("-c", "import os; os.close(2); import jzero, jax; jax.devices(); print('ok')")
  assert closed.returncode == 0 and closed.stdout == "ok\n"  # a daemon without stderr
  helped = _python("-m", "jzero", "estimate", "--help")
  assert helped.returncode == 0 and helped.stderr == "" and "--params" in helped.stdout
  if not quiet_start.cuda_plugin_installed():
    return  # without the plugin there is nothing to hide; the rest shows what is hidden
  plain = _python("-c", "import jax; jax.devices()")
  assert "Jax plugin configuration error" in plain.stderr  # what the backends' start printed
  jax_first = _python("-c", "import jax; import jzero; jax.devices()")
  assert jax_first.returncode == 0
  lines = jax_first.stderr.splitlines()
  assert all(any(n in line for n in PLUGIN_NOISE[:2]) for line in lines), lines  # only those
  assert len(lines) < len(plain.stderr.splitlines())  # the backend's start added nothing
  assert sum("cudart_stub" in line for line in lines) <= 3, lines  # import jax's own three


def test_import_without_the_cuda_plugin(tmp_path):
  """A plain install has no CUDA plugin at all (no `jax_plugins` package): `import jzero` works
  and is silent. (It crashed there once: find_spec("jax_plugins.xla_cuda12") raises when the
  parent package is missing.) The suite's environment has the plugin, so the child sees a copy of
  its site-packages without the plugin's packages and their metadata."""
  import jax
  site = Path(jax.__file__).parents[1]
  plain = tmp_path / "site-packages"
  plain.mkdir()
  for entry in site.iterdir():
    if not entry.name.startswith(("jax_plugins", "jax_cuda", "libtpu")):  # nor the tpu-aot
      (plain / entry.name).symlink_to(entry)
  script = ("import site\n"
            f"site.addsitedir({str(plain)!r})  # its .pth files too: jzero's editable install\n"
            "import jzero, jax\n"
            "from jzero.runtime import quiet_start\n"
            "print(jax.devices()[0].platform, quiet_start.cuda_plugin_installed(), "
            "quiet_start.hidden())")
  run = _python("-S", "-c", script)
  assert run.returncode == 0 and run.stderr == "", run.stderr
  assert run.stdout.strip() == "cpu False ()"


def test_gpu_compile_loads_the_hidden_plugin():
  """Where CUDA cannot run, the plugin stays unloaded until a GPU compile asks for it: then its
  compiler registers and a CUDA topology is there to compile for; the CPU backend is unchanged."""
  from jzero.runtime import quiet_start
  if quiet_start.cuda_can_run() or not quiet_start.cuda_plugin_installed():
    pytest.skip("needs the gpu-aot extra on a machine without an NVIDIA driver")
  script = ("import jzero, jax\n"
            "from jzero.runtime import quiet_start\n"
            "hidden = quiet_start.hidden()\n"
            "from jzero.planning import aot\n"
            "devices = aot.gpu_devices('h100', 2)\n"
            "cuda = tuple(n for n in quiet_start.hidden() if 'cuda' in n)  # libtpu stays\n"
            "print(sorted(hidden), cuda, len(devices), devices[0].platform, "
            "jax.devices()[0].platform)")
  run = _python("-c", script)
  assert run.returncode == 0, run.stderr
  hidden, rest = run.stdout.strip().split("] ")
  assert "jax_plugins.xla_cuda12" in hidden and "jax_cuda12_plugin" in hidden
  assert rest == "() 2 gpu cpu"  # the compiler loaded; the CPU backend is still the default
  assert "Jax plugin configuration error" not in run.stderr  # no version check of a runtime


def test_train_summary_checkpoint_and_resume(tmp_path):
  ckpt = tmp_path / "ckpt"
  first = _jzero("train", "--config", str(CONFIGS / "zero3.json"), "--steps", "10",
                 "--checkpoint-dir", str(ckpt), *TINY)
  assert first.returncode == 0, first.stderr
  out = first.stdout
  assert "[jzero] step 10: loss" in out  # steps_per_print = 10 in the config
  assert "loss: start" in out and "tokens/s" in out
  assert re.search(r"throughput: [\d,]+ tokens/s, [\d.,]+ samples/s, MFU [\d.]+% of [\d.]+ TFLOP/s "
                   r"\(measured on this host", out)
  assert "measured/predicted" in out and "checkpoint at step 10" in out
  second = _jzero("train", "--config", str(CONFIGS / "zero3.json"), "--steps", "12",
                  "--checkpoint-dir", str(ckpt), *TINY)
  assert second.returncode == 0, second.stderr
  assert "resumed from" in second.stdout and "at step 10" in second.stdout
  assert "checkpoint at step 12" in second.stdout
  inspect = _jzero("inspect", str(ckpt))
  assert inspect.returncode == 0 and "step 12" in inspect.stdout and "ZeRO stage 3" in inspect.stdout


def test_train_a_model_defined_outside_jzero(tmp_path):
  """`jzero train --model tests/own_model.py:factory --config configs/zero3.json` trains the
  user's model with the loss_fn beside it; written to pipes there is no progress bar; --keep 3
  with a save every step leaves the newest 3 (it left only the newest)."""
  ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.txt"
  out = _jzero("train", "--model", str(OWN_MODEL) + ":factory", "--config",
               str(CONFIGS / "zero3.json"), "--steps", "5", "--seq-len", "16", "--losses-file",
               str(losses), "--checkpoint-dir", str(ckpt), "--save-every", "1", "--keep", "3")
  assert out.returncode == 0, out.stderr
  assert "model ByteMLP, 17.7K parameters; loss own_model.loss_fn" in out.stdout
  steps = [float(line.split()[1]) for line in losses.read_text().splitlines()]
  assert len(steps) == 5 and steps[-1] < steps[0] and "loss: start" in out.stdout
  assert "train:" not in out.stderr  # tqdm wrote its bar into the pipe
  assert sorted(p.name for p in ckpt.iterdir()) == ["3", "4", "5", "latest"]


@pytest.mark.parametrize("model", ["Regressor", "LinenRegressor"])
def test_train_own_model_on_npz_data_with_its_loss(tmp_path, capsys, model):
  """--data FILE.npz gives batches of its named arrays, --loss names the loss; a Linen class is
  built with no arguments and initialised with the module's init_inputs."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  np.savez(tmp_path / "xy.npz", x=x, y=x[:, :2] * 2)
  losses, config = tmp_path / "losses.txt", tmp_path / "ds.json"
  config.write_text(json.dumps({  # each step the whole data set: the loss falls every step
      "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}))
  assert cli.main(["train", "--config", str(config), "--steps", "4",
                   "--model", f"{OWN_MODEL}:{model}", "--loss", f"{OWN_MODEL}:regression_loss",
                   "--data", str(tmp_path / "xy.npz"), "--losses-file", str(losses)]) == 0
  out = capsys.readouterr().out
  assert "64 samples: x float32[4], y float32[2]" in out and "samples/s" in out, out
  assert f"model {model}, 10 parameters" in out
  steps = [float(line.split()[1]) for line in losses.read_text().splitlines()]
  assert len(steps) == 4 and all(b < a for a, b in zip(steps, steps[1:])), steps


def test_own_language_model_on_npy_tokens_takes_the_default_loss(tmp_path, capsys):
  """A module without loss_fn, on a .npy of token rows: next-token cross-entropy."""
  (tmp_path / "lm.py").write_text("from own_model import factory\n")
  tokens = np.random.default_rng(0).integers(0, 256, size=(64, 9), dtype=np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  assert cli.main(["train", "--config", str(CONFIGS / "zero2.json"), "--steps", "2", "--model",
                   f"{tmp_path / 'lm.py'}:factory", "--data", str(tmp_path / "tokens.npy")]) == 0
  out = capsys.readouterr().out
  assert "64 samples: tokens int32[9]" in out and "loss jzero.models.lm_loss" in out, out


def test_own_model_errors_name_the_flag_and_the_fix(tmp_path, capsys):
  """Each mistake is one paragraph naming what to change, before any training."""
  text = tmp_path / "text.txt"
  text.write_text("some text to train on. " * 200)
  np.savez(tmp_path / "xy.npz", x=np.zeros((64, 4), np.float32), y=np.zeros((64, 2), np.float32))
  net = tmp_path / "net.py"  # a module without a loss_fn
  net.write_text("from own_model import Regressor as Net\n")
  cases = [
      (["--model", str(OWN_MODEL)], "give MODULE:NAME or path/to/file.py:NAME"),
      (["--model", f"{OWN_MODEL}:missing"], "defines no 'missing' (its callables: ByteMLP, "),
      (["--model", "no_such_package.models:factory"], "no module 'no_such_package' on the path"),
      (["--model", f"{OWN_MODEL}:factory", "--layers", "2"], "--layers: the embedded GPT's shape"),
      (["--loss", f"{OWN_MODEL}:loss_fn"], "--loss goes with --model"),
      (["--model", f"{net}:Net", "--data", str(tmp_path / "xy.npz")],
       "no loss. Its module defines no loss_fn, and the --data batches (keys ['x', 'y'])"),
      (["--model", f"{OWN_MODEL}:Regressor", "--loss", f"{OWN_MODEL}:regression_loss", "--data",
        str(text)], f"--model '{OWN_MODEL}:Regressor' with the loss "
                    f"{OWN_MODEL}:regression_loss cannot take the batches of {text} "
                    f"({{tokens: int32[4, 65]}} per device): KeyError: 'x'. Text data gives"),
      (["--model", f"{OWN_MODEL}:factory", "--data", str(tmp_path / "xy.npz")],
       "cannot take the batches of"),
  ]
  for args, message in cases:
    assert cli.main(["train", "--config", str(CONFIGS / "zero3.json"), "--steps", "1",
                     *args]) == 2, args
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, (args, err)


def test_estimate_prints_the_classic_table():
  out = _jzero("estimate", "--params", "7e9", "--devices", "8")
  assert out.returncode == 0, out.stderr
  for number in ("112.00 GB", "38.50 GB", "26.25 GB", "14.00 GB"):
    assert number in out.stdout


def test_train_in_two_processes_reports_once_and_matches_one_process():
  """`jzero train` run in 2 processes x 4 CPU devices (gloo) is the 8-device job, reported once."""
  port = free_port()
  train = ["train", "--config", str(CONFIGS / "zero3.json"), "--steps", "3", *TINY]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-m", "jzero.cli", *train, "--devices", "4",
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                             "--process-id", str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
  outs = [p.communicate(timeout=400) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  single = _jzero(*train)
  assert single.returncode == 0, single.stderr

  def losses(out: str) -> list[float]:  # start, end, validation, printed to 4 decimals
    line = next(l for l in out.splitlines() if l.startswith("loss: start"))
    return [float(x) for x in re.findall(r"\d+\.\d{4}", line)]

  assert len(losses(single.stdout)) == 3
  # printed to 4 decimals: two roundings of <= 0.5e-4 each, plus the runs' own difference
  # (SAME_MATH relative on losses ~5, 5e-6): 1.5e-4
  np.testing.assert_allclose(losses(outs[0][0]), losses(single.stdout), atol=1.5e-4)
  assert "mesh data=8 (8 cpu devices)" in outs[0][0]
  assert "loss:" not in outs[1][0] and "jzero:" not in outs[1][0]  # process 1 stays quiet


def test_process_flags_are_checked_before_any_device_work():
  out = _jzero("train", "--config", str(CONFIGS / "zero3.json"), "--coordinator", "127.0.0.1:1",
               "--num-processes", "2")
  assert out.returncode == 2 and "go together" in out.stderr and "Traceback" not in out.stderr
  out = _jzero("train", "--config", str(CONFIGS / "zero3.json"), "--coordinator", "localhost",
               "--num-processes", "2", "--process-id", "0")
  assert out.returncode == 2 and "HOST:PORT" in out.stderr


def test_warnings_name_the_users_line_or_none(tmp_path):
  """A config warning reaches the terminal as ``jzero: warning: ...``, not pointing at the
  ``jzero`` script's ``sys.exit(main())`` (nor runpy's line under ``python -m``); the config's
  batch error then stops the command before any device work."""
  config = tmp_path / "ds.json"
  config.write_text(json.dumps({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1,
                                "flops_profiler": {"enabled": False}}))
  script = Path(sys.executable).parent / "jzero"  # the console script pip installed
  commands = [[sys.executable, "-m", "jzero.cli"]] + ([[str(script)]] if script.exists() else [])
  for command in commands:
    out = subprocess.run([*command, "train", "--config", str(config)], capture_output=True,
                         text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert out.returncode == 2 and "invalid batch size" in out.stderr, out.stderr
    warned = [line for line in out.stderr.splitlines() if "flops_profiler" in line]
    assert warned == ["jzero: warning: 'flops_profiler': jzero ignores this top-level key"], (
        command, out.stderr)
    assert "sys.exit" not in out.stderr and "runpy" not in out.stderr


def test_a_warning_from_the_users_own_file_keeps_its_line(tmp_path):
  """The command's warning format: the user's file keeps Python's format (file, line, category,
  source line); a line inside jzero, or in an installed package, is left out."""
  model = tmp_path / "model.py"
  model.write_text("import warnings\nwarnings.warn('check the vocabulary')\n")
  shown = cli.format_warning("check the vocabulary", UserWarning, str(model), 2)
  assert shown.startswith(f"{model}:2: UserWarning: check the vocabulary")
  assert "warnings.warn('check the vocabulary')" in shown  # the source line
  engine_py = str(Path(cli.__file__).parents[1] / "train" / "engine.py")
  assert cli.format_warning("unused key", JZeroWarning, engine_py, 10) == (
      "jzero: warning: unused key\n")
  assert cli.format_warning("old", DeprecationWarning, json.__file__, 1) == (
      "jzero: warning: DeprecationWarning: old\n")


def _bytes(text: str) -> float:
  value, unit = text.split()
  return float(value) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def test_offload_config_trains_and_predicts_host_bytes_per_process_before_training():
  """configs/ds_zero3_offload.json trains; before the first step process 0 prints the host bytes
  its 8 devices' shares add up to, the memory report's per-device host prediction times 8."""
  out = _jzero("train", "--config", str(CONFIGS / "ds_zero3_offload.json"), "--steps", "2", *TINY)
  assert out.returncode == 0, out.stderr
  before = re.search(r"offload: predicted model states per process \(8 devices\): host "
                     r"([\d.]+ k?M?G?B)", out.stdout)
  per_device = re.search(r"predicted per tier \(estimator\): .*host ([\d.]+ k?M?G?B)", out.stdout)
  assert before and per_device, out.stdout
  assert out.stdout.index(before[0]) < out.stdout.index("loss: start")
  assert abs(_bytes(before[1]) / (8 * _bytes(per_device[1])) - 1) < 0.01


# --- issue 47: DeepSpeed's host figures, jzero plan --no-advice, no silent micro-batch "auto" -----


@pytest.mark.parametrize("stage, optimizer, param, per_node, nodes, deepspeed", [
    # DeepSpeed 0.19.8's estimate_zero{2,3}_model_states_mem_needs(1.5e9, ..., zero_init=False)
    (2, "cpu", None, 8, 1, 72_000_000_000), (2, "cpu", None, 8, 2, 144_000_000_000),
    (2, None, None, 4, 4, 36_000_000_000), (2, "cpu", None, 4, 4, 144_000_000_000),
    (3, "cpu", "cpu", 8, 2, 72_000_000_000), (3, "cpu", None, 4, 4, 36_000_000_000),
    (3, None, None, 8, 1, 72_000_000_000)])
def test_deepspeeds_host_figure_is_its_estimators(stage, optimizer, param, per_node, nodes,
                                                  deepspeed):
  from jzero.analysis.estimate import estimate  # noqa: PLC0415
  est = estimate(1_500_000_000, stage, per_node, nodes, offload_optimizer=optimizer,
                 offload_param=param)
  assert est.deepspeed_host_per_node == pytest.approx(deepspeed, rel=1e-12)
  assert est.host_per_node < deepspeed  # jzero's state alone: the difference is printed
  assert estimate(1e9, 3, 8, offload_optimizer="nvme").deepspeed_host_per_node is None


def test_estimate_prints_deepspeeds_host_figure_and_why_it_differs():
  out = _jzero("estimate", "--params", "1.5e9", "--devices", "8", "--offload-optimizer", "cpu",
               "--offload-update", "stream")
  assert out.returncode == 0, out.stderr
  # the streamed update: the optimizer state alone on the host (12 B x 1.5e9 per node)
  assert "ZeRO-2 + optimizer->cpu (stream): jzero 18.00 GB, DeepSpeed 72.00 GB" in out.stdout
  adam = _jzero("estimate", "--params", "1.5e9", "--devices", "8", "--offload-optimizer", "cpu")
  # Adam on the host (what device: cpu runs for the config's Adam): the arriving gradient and
  # the new params beside it, (12 + 2 + 2) B x 1.5e9
  assert "ZeRO-2 + optimizer->cpu: jzero 24.00 GB, DeepSpeed 72.00 GB" in adam.stdout
  assert "fp32 copy per process" in out.stdout and "size host memory with the larger" in out.stdout


def test_plan_advice_can_be_turned_off(monkeypatch, tmp_path):
  from jzero.cli import plan as plan_cli  # noqa: PLC0415
  advised = []
  monkeypatch.setattr(plan_cli, "_advise", advised.append)
  common = ["plan", "--model", "default", "--compile-top", "0", "--out", str(tmp_path / "p.json")]
  assert cli.main(common + ["--no-advice"]) in (0, 1) and advised == []
  assert cli.main(common) in (0, 1) and len(advised) == 1


def test_train_micro_batch_auto_is_never_filled_in_silence():
  from jzero.cli.train import _micro_batch  # noqa: PLC0415
  auto = Config.load({"train_micro_batch_size_per_gpu": "auto"})
  with pytest.warns(jzero.JZeroWarning, match=r'"auto" .* using 4, jzero train\'s default; '
                    r"--micro-batch N sets it"):
    assert _micro_batch(argparse.Namespace(micro_batch=None), auto) == 4
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _micro_batch(argparse.Namespace(micro_batch=2), auto) == 2
    fixed = Config.load({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"})
    assert _micro_batch(argparse.Namespace(micro_batch=None), fixed) is None  # derived from 16
