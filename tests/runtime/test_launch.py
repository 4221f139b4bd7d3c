"""``jzero launch`` and jzero.runtime.distributed: hostfiles, ssh commands, SLURM, failures, preemption,
elastic resume. Several processes on 127.0.0.1 over gloo.

The training tests share one story (module fixtures): the default job (``jzero train`` with
configs/zero3.json, a tiny GPT) runs uninterrupted in this process on 8 devices; the same job
launched as 2 processes x 4 devices is preempted (SIGTERM to process 1) and checkpoints; that
checkpoint resumes as 4 processes x 2 devices, and in one process on 8 and on 4 devices. Every
loss must equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jzero
from jzero import cli
from jzero.errors import JZeroError
from jzero.runtime import launch
from launch_worker import Tiny, loss_fn
from zero_testing import SAME_MATH, free_port, make_engine, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "launch_worker.py"
FAILURE_BOUND_S = 60
TRAIN = ["--config", str(ROOT / "configs" / "zero3.json"), "--layers", "1", "--d-model", "32",
         "--heads", "2", "--seq-len", "16", "--no-progress"]
# Enough steps after the SIGTERM (sent after step 2) for JAX's preemption notice to reach every
# process through the coordination service: a step of this model takes ~0.1 s, and with 8 steps
# the job once finished before the agreed stop step came round.
STEPS = 30


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in subprocess_env().items() if not k.startswith("JZERO_")}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", **extra)
  return env


class _Reader:
  """Collects a child's output lines in a thread; waits for a pattern."""

  def __init__(self, stream):
    self.lines: list[str] = []
    self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
    self._thread.start()

  def _read(self, stream) -> None:
    for line in iter(stream.readline, ""):
      self.lines.append(line)

  def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      for line in list(self.lines):
        if m := re.search(pattern, line):
          return m
      time.sleep(0.05)
    raise AssertionError(f"no line matched {pattern!r} in {timeout} s:\n{self.text[-3000:]}")

  @property
  def text(self) -> str:
    self._thread.join(timeout=0.5)
    return "".join(self.lines)

  def failure(self) -> str:
    """The output's tail, and before it every line of a process the launcher reports lost."""
    text = self.text
    lost = re.findall(r"jzero launch: process (\d+) \(", text)
    own = [line for line in self.lines if lost and line.startswith(f"[{lost[0]}]")]
    return "".join(own[-60:]) + "\n...\n" + text[-3000:]


def _launch(args: list[str], **env: str) -> tuple[subprocess.Popen, _Reader]:
  p = subprocess.Popen([sys.executable, "-m", "jzero.runtime.launch", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=_env(**env), cwd=ROOT)
  return p, _Reader(p.stdout)


# -- hosts, slots, commands (no processes) ----------------------------------------------------------
HOSTS = "# two machines\nworker-0 slots=4\nworker-1 slots=2  # the small one\n"


def test_hostfile_and_slot_filters():
  hosts = launch.parse_hostfile(HOSTS)
  assert hosts == {"worker-0": 4, "worker-1": 2}
  assert launch.select_slots(hosts) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}
  assert launch.select_slots(hosts, include="worker-0:1,3@worker-1") == {
      "worker-0": [1, 3], "worker-1": [0, 1]}
  assert launch.select_slots(hosts, exclude="worker-0:0") == {"worker-0": [1, 2, 3],
                                                              "worker-1": [0, 1]}
  assert launch.select_slots(hosts, exclude="worker-1") == {"worker-0": [0, 1, 2, 3]}
  assert launch.select_slots(hosts, num_nodes=1, num_procs=2) == {"worker-0": [0, 1]}
  procs = launch.plan_processes(launch.select_slots(hosts, include="worker-0:2@worker-1:1"))
  assert [(p.process_id, p.host, p.local_rank, p.slot) for p in procs] == [
      (0, "worker-0", 0, 2), (1, "worker-1", 0, 1)]
  for bad, match in (("worker-0 4", "HOST slots=N"), ("a slots=1\na slots=2", "listed twice"),
                     ("", "no hosts")):
    with pytest.raises(JZeroError, match=match):
      launch.parse_hostfile(bad)
  for kwargs, match in (({"include": "worker-9"}, "not in the hostfile"),
                        ({"include": "worker-1:2"}, "slots 0..1"),
                        ({"include": "worker-1", "exclude": "worker-0"}, "together"),
                        ({"num_procs": 3}, "fewer slots")):
    with pytest.raises(JZeroError, match=match):
      launch.select_slots(hosts, **kwargs)


def test_dry_run_prints_ssh_commands(tmp_path, capsys, monkeypatch):
  (tmp_path / "hosts").write_text(HOSTS)
  (tmp_path / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n# comment\nFOO=bar baz\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("JZERO_ENV_FILE", raising=False)
  monkeypatch.delenv("DS_ENV_FILE", raising=False)
  assert cli.main(["launch", "--hostfile", "hosts", "--num_gpus", "2", "--master_port", "4242",
                   "--dry-run", "train.py", "--deepspeed_config", "ds.json"]) == 0
  out = capsys.readouterr().out
  commands = [line for line in out.splitlines() if line.startswith("ssh ")]
  assert len(commands) == 4
  for i, command in enumerate(commands):
    host = "worker-0" if i < 2 else "worker-1"
    assert f" {host} " in command
    assert f"JZERO_PROCESS_ID={i} " in command and "JZERO_NUM_PROCESSES=2" not in command
    assert "JZERO_NUM_PROCESSES=4" in command and "JZERO_COORDINATOR=worker-0:4242" in command
    assert f"JZERO_LOCAL_DEVICE_IDS={i % 2} " in command
    assert "NCCL_IB_DISABLE=1" in command and "FOO='\"'\"'bar baz'\"'\"'" in command
    assert command.endswith("train.py --deepspeed_config ds.json'")
    assert f"cd {tmp_path}" in command


def test_a_command_on_path_runs_as_itself(tmp_path, monkeypatch):
  """``jzero launch -- jzero train ...`` (the form a DeepSpeed user types) runs the console
  script, not ``python jzero``; a file of that name here, or ``--module``, still runs under
  python; ``--no_python`` forces the command."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "trainer").write_text("#!/bin/sh\n")
  (bin_dir / "trainer").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
  monkeypatch.chdir(tmp_path)
  assert launch._program("trainer", ["train"], module=False) == ["trainer", "train"]
  assert launch._program("train.py", ["-x"], module=False)[1:] == ["-u", "train.py", "-x"]
  assert launch._program("trainer", ["train"], module=True)[1:] == ["-u", "-m", "trainer", "train"]
  assert launch._program("./run.sh", [], module=False, no_python=True) == ["./run.sh"]
  (tmp_path / "trainer").write_text("print('a script named like the command')\n")
  assert launch._program("trainer", [], module=False)[1:] == ["-u", "trainer"]
  with pytest.raises(JZeroError, match="--module and --no_python"):
    launch._program("trainer", [], module=True, no_python=True)


def test_an_executable_path_runs_as_itself(tmp_path):
  """``jzero launch -- /abs/venv/bin/python script.py`` runs the interpreter on the script in
  every process (it ran ``python -u /abs/venv/bin/python``: 'source code cannot contain null
  bytes'); an executable ``.py`` file still runs under python."""
  script = tmp_path / "hello.py"
  script.write_text("import os\nprint('hello from', os.environ['JZERO_PROCESS_ID'])\n")
  script.chmod(0o755)
  assert launch._program(sys.executable, [str(script)], module=False) == [sys.executable,
                                                                          str(script)]
  assert launch._program(str(script), [], module=False)[1:] == ["-u", str(script)]
  p, out = _launch(["--num_processes", "2", "--", sys.executable, str(script)])
  assert p.wait(timeout=60) == 0, out.text
  assert {"[0] hello from 0\n", "[1] hello from 1\n"} <= set(out.lines), out.text


# -- failures ---------------------------------------------------------------------------------------
def test_sigkill_under_launcher_stops_the_job(tmp_path):
  """A hostfile of two local names, --include picks one slot of each; process 1 is SIGKILLed at
  step 3: the launcher names it, kills process 0 and exits non-zero."""
  (tmp_path / "hosts").write_text("localhost slots=2\n127.0.0.1 slots=2\n")
  p, out = _launch(["--hostfile", str(tmp_path / "hosts"), "--include", "localhost:1@127.0.0.1:0",
                    "--num_cpu_devices", "1", "--master_port", str(free_port()), str(WORKER),
                    "1000"])
  try:
    pids = {int(m[0]): int(m[1]) for m in
            re.findall(r"process (\d) pid (\d+)", out.wait_for(r"process 1 pid \d+").string)}
    assert out.wait_for(r"^\[0\] joined via jzero launch as 0/2")
    assert out.wait_for(r"^\[1\] joined via jzero launch as 1/2")
    out.wait_for(r"^\[1\] process 1 step 3 ")
    out.wait_for(r"^\[0\] \[jzero\] step 3: loss")  # the engine's step report (steps_per_print 1)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    code = p.wait(timeout=FAILURE_BOUND_S)
    took = time.monotonic() - t0
  finally:
    p.kill()
  assert code != 0 and took < FAILURE_BOUND_S
  assert "process 1 (127.0.0.1, local rank 0) was killed by SIGKILL" in out.text, out.text[-2000:]
  assert not re.search(r"^\[1\] \[jzero\] step", out.text, re.M)  # process 0 reports for the job
  with pytest.raises(ProcessLookupError):
    os.kill(pids[0], 0)


@pytest.mark.parametrize("saves", [True, False], ids=["saved-before", "never-saved"])
def test_sigterm_stops_a_script_that_never_polls(tmp_path, saves):
  """SIGTERM to the launcher of a script that never polls reached_preemption: the engine's own
  check stops every process at one step boundary -- saving that step where the script saved
  before, or saying it had nowhere to save -- by raising jzero.Preempted (the engine never exits
  the process itself), and the launcher says so."""
  ckpt = tmp_path / "ckpt"
  p, out = _launch(["--num_processes", "2", "--num_cpu_devices", "1", "--master_port",
                    str(free_port()), str(WORKER), "1000", "--no-poll",
                    *(["--save-dir", str(ckpt)] if saves else [])])
  try:
    out.wait_for(r"^\[1\] process 1 step 4 ")
    p.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    code = p.wait(timeout=FAILURE_BOUND_S)
    took = time.monotonic() - t0
  finally:
    p.kill()
  assert took < FAILURE_BOUND_S, out.text[-2000:]
  stops = re.findall(r"(?:stopped after|preempted \(SIGTERM\) at) step (\d+)", out.text)
  assert stops, out.text[-3000:]
  stop = int(stops[0])  # inside train_step of that step, before the script printed it
  assert 4 < stop < 1000 and max(int(m) for m in re.findall(r"process 0 step (\d+) ",
                                                            out.text)) == stop - 1
  assert code == 1, out.text[-3000:]  # the script ends with the exception it did not catch
  assert "jzero.errors.Preempted: preempted (SIGTERM)" in out.text
  assert "after SIGTERM (its log says whether it saved" in out.text
  if saves:
    from jzero import checkpoint
    assert checkpoint.latest_step(ckpt) == stop and checkpoint.all_tags(ckpt) == ["2", str(stop)]
    assert f"every process stopped after step {stop}, saved in {ckpt}" in out.text
  else:
    assert len(set(stops)) == 1  # both processes, at the same step
    assert "nothing saved: the script neither polls engine.reached_preemption" in out.text


def test_slurm_job_survivor_exits_naming_the_lost_process():
  """Two tasks started as `srun` would (SLURM variables, no launcher) join through jzero.initialize;
  process 1 is SIGKILLed at step 3; process 0 exits non-zero within the bound, naming task 1."""
  job_id = free_port() % 4096  # jax derives the coordinator port from the job id
  procs, outs = [], []
  for i in range(2):
    env = _env(SLURM_JOB_ID=str(job_id), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_STEP_NUM_NODES="1",
               JZERO_NUM_CPU_DEVICES="1", JZERO_HEARTBEAT_TIMEOUT="10")
    procs.append(subprocess.Popen([sys.executable, str(WORKER), "1000"], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs.append(_Reader(procs[-1].stdout))
  try:
    for i in range(2):
      outs[i].wait_for(rf"joined via slurm as {i}/2")
    pid = int(outs[1].wait_for(r"pid (\d+)")[1])
    outs[1].wait_for(r"process 1 step 3 ")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    code = procs[0].wait(timeout=FAILURE_BOUND_S)
    took = time.monotonic() - t0
  finally:
    for p in procs:
      p.kill()
  assert code != 0 and took < FAILURE_BOUND_S
  text = outs[0].text
  assert re.search(r"Task 1 heartbeat timeout|stopped sending heartbeats\):\s*1\b", text), text[-3000:]


# -- preemption, resume, elastic resume (the default job) -------------------------------------------
def _losses(path: Path) -> dict[int, float]:
  return {int(s): float(l) for s, l in (line.split() for line in path.read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
  """The default job in this process on 8 devices."""
  losses = tmp_path_factory.mktemp("one") / "losses"
  assert cli.main(["train", *TRAIN, "--steps", str(STEPS), "--losses-file", str(losses)]) == 0
  return _losses(losses)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> tuple[Path, dict[int, float], str]:
  """The default job as 2 processes x 4 devices; SIGTERM to process 1 after step 2."""
  out_dir = tmp_path_factory.mktemp("preempted")
  ckpt, losses = out_dir / "ckpt", out_dir / "losses"
  p, out = _launch(["--num_processes", "2", "--num_cpu_devices", "4", "--master_port",
                    str(free_port()), "--module", "jzero", "train", *TRAIN, "--steps", str(STEPS),
                    "--checkpoint-dir", str(ckpt), "--losses-file", str(losses)])
  try:
    pid = int(out.wait_for(r"process 1 pid (\d+)")[1])
    deadline = time.monotonic() + 300
    while not (losses.exists() and len(losses.read_text().splitlines()) >= 2):
      assert p.poll() is None and time.monotonic() < deadline, out.failure()
      time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
    code = p.wait(timeout=300)
  finally:
    p.kill()
  assert code == 0, out.failure()
  return ckpt, _losses(losses), out.text


def test_launched_job_matches_one_process_and_stops_on_sigterm(uninterrupted, preempted):
  ckpt, losses, text = preempted
  step = jzero.checkpoint.latest_step(ckpt)
  assert 2 <= step < STEPS, text[-2000:]
  assert "every process stopped after step" in text
  assert sorted(losses) == list(range(1, step + 1))
  np.testing.assert_allclose([losses[s] for s in losses], [uninterrupted[s] for s in losses],
                             rtol=SAME_MATH)
  assert re.search(r"^\[0\] jzero: ZeRO stage 3", text, re.M)  # process 0 reports, prefixed


def test_preempted_job_resumes_on_4_processes_x_2_devices(uninterrupted, preempted, tmp_path):
  ckpt, _, _ = preempted
  step = jzero.checkpoint.latest_step(ckpt)
  shutil.copytree(ckpt, tmp_path / "ckpt")
  losses = tmp_path / "losses"
  p, out = _launch(["--num_processes", "4", "--num_cpu_devices", "2", "--master_port",
                    str(free_port()), "--module", "jzero", "train", *TRAIN, "--steps", str(STEPS),
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "--losses-file",
                    str(losses)])
  assert p.wait(timeout=400) == 0, out.failure()
  assert f"resumed from {tmp_path / 'ckpt'} at step {step}" in out.text
  resumed = _losses(losses)
  assert sorted(resumed) == list(range(step + 1, STEPS + 1))
  np.testing.assert_allclose([resumed[s] for s in resumed], [uninterrupted[s] for s in resumed],
                             rtol=SAME_MATH)


def test_preempted_job_resumes_in_one_process_on_8_devices(uninterrupted, preempted, tmp_path):
  """`jzero train --resume` of the 2 x 4 checkpoint in this process (1 x 8): the same global batch,
  the uninterrupted run's losses."""
  ckpt, _, _ = preempted
  step = jzero.checkpoint.latest_step(ckpt)
  shutil.copytree(ckpt, tmp_path / "ckpt")
  losses = tmp_path / "losses"
  assert cli.main(["train", *TRAIN, "--steps", str(STEPS), "--checkpoint-dir",
                   str(tmp_path / "ckpt"), "--resume", "--losses-file", str(losses)]) == 0
  resumed = _losses(losses)
  assert sorted(resumed) == list(range(step + 1, STEPS + 1))
  np.testing.assert_allclose([resumed[s] for s in resumed], [uninterrupted[s] for s in resumed],
                             rtol=SAME_MATH)


def test_preempted_job_resumes_in_one_process_on_4_devices(uninterrupted, preempted):
  """Elastic: dp 8 -> 4. With train_batch_size pinned the global batch is kept (micro 4 -> 8) and
  the losses continue; with the config's micro batch kept instead, the warning says what changed."""
  from jzero.config import Config
  from jzero.runtime.data import ByteCorpus
  from jzero.models import GPTConfig

  ckpt, _, _ = preempted
  step = jzero.checkpoint.latest_step(ckpt)
  model_cfg = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
  mesh = jzero.MeshSpec.from_dict({"axes": {"data": 4}}).build(jax.devices()[:4])
  base = Config.load(ROOT / "configs" / "zero3.json").to_dict()
  with pytest.warns(jzero.JZeroWarning, match="global batch of 32 samples per step; this engine "
                    "uses 16"):
    engine = make_engine(base, model=model_cfg, mesh=mesh, total_num_steps=STEPS)
    engine.load_checkpoint(ckpt)
  pinned = {**base, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}
  engine = make_engine(pinned, model=model_cfg, mesh=mesh, total_num_steps=STEPS)
  state = engine.load_checkpoint(ckpt)
  corpus = ByteCorpus.load(None, seq_len=16)
  for s in range(step, STEPS):
    state, metrics = engine.train_step(state, engine.shard_batch(corpus.batch(s, 32)))
    np.testing.assert_allclose(float(metrics["loss"]), uninterrupted[s + 1], rtol=SAME_MATH)


def test_shard_batch_takes_this_process_rows():
  """In one process the local rows are the whole batch; a wrong row count is refused clearly."""
  engine = make_engine({"train_batch_size": 8, "optimizer": {
      "type": "SGD", "params": {"lr": 0.1}}}, Tiny, loss_fn)
  np.testing.assert_array_equal(engine.local_rows(), np.arange(8))
  with pytest.raises(jzero.DataError, match="must have 8 rows"):
    engine.shard_batch({"x": np.zeros((3, 8), np.float32)}, process_local=True)


# -- reproducibility across processes (issue 12, point 4) -------------------------------------------
def _worker_job(out: Path, devices: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """tests/multiprocess_worker.py (ZeRO-3 GPT, per-layer gathers in the layer scan, save + restore
  half-way) as 2 processes x ``devices``; its losses and final parameters."""
  port = free_port()
  worker = Path(__file__).parents[1] / "multiprocess_worker.py"
  procs = [subprocess.Popen([sys.executable, str(worker), str(i), "2", str(port), str(devices),
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env()) for i in range(2)]
  logs = [p.communicate(timeout=400)[0] for p in procs]
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"
  with np.load(out / "result.npz") as f:
    return f["losses"], {k: f[k] for k in f.files if k != "losses"}


def test_stage3_across_processes_is_bitwise_reproducible(tmp_path):
  """The same 2-process x 1-device stage-3 run twice: bitwise-identical losses and parameters,
  and within 1e-6 of one process on 2 devices. (2 x 4 devices against one process on 8:
  tests/runtime/test_multiprocess.py.)"""
  from jzero.sharding.plan import flatten_paths
  from multiprocess_worker import BATCH, STAGE3, STEPS as WORKER_STEPS
  from zero_testing import SMALL, batches, ds_config, engine_run, max_relative_diff

  runs = [_worker_job(tmp_path / f"run{r}", 1) for r in range(2)]
  (losses, params), (losses2, params2) = runs
  np.testing.assert_array_equal(losses, losses2)
  assert params.keys() == params2.keys()
  for k in params:
    np.testing.assert_array_equal(params[k], params2[k], err_msg=k)
  mesh = jzero.MeshSpec.from_dict({"axes": {"data": 2}}).build(jax.devices()[:2])
  engine = make_engine(ds_config(3, micro=BATCH // 2, **STAGE3), mesh=mesh)
  _, single, single_losses = engine_run(engine, batches(SMALL.seq_len, BATCH, WORKER_STEPS))
  np.testing.assert_allclose(losses, single_losses, rtol=SAME_MATH)
  assert max_relative_diff(params, flatten_paths(single)) <= SAME_MATH
