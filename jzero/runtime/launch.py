"""``jzero launch``: start a training script as several processes, on one machine or many.

DeepSpeed's launcher, for JAX::

  jzero launch --num_processes 2 --num_cpu_devices 4 train.py --config ds.json   # one machine
  jzero launch --hostfile hosts --master_port 29500 train.py ...                 # several, ssh
  jzero launch --num_processes 2 -- jzero train --config ds.json                # a command
  python -m jzero.runtime.launch ...                                             # the same

What runs where. Without ``--hostfile`` every process runs on this machine. A hostfile is
DeepSpeed's: one ``HOST slots=N`` line per machine (``#`` starts a comment); a slot is one
process (on GPUs, one process per GPU: process ``slot`` of a host drives local device ``slot``).
``--num_nodes K`` keeps the first K hosts, ``--num_gpus``/``--num_processes N`` the first N slots
of each, ``--include``/``--exclude`` name hosts and slots as ``host1:0,1@host2`` (a host without
``:`` means all its slots). Processes are numbered host by host, slot by slot.

How they start. Processes on this machine (``localhost``, ``127.0.0.1`` or its host name) are
spawned directly; the others through ``ssh HOST 'cd CWD && export ...; exec PYTHON -u script
...'`` (the same Python path and working directory on every host, as DeepSpeed assumes;
``--dry-run`` prints the commands without running anything). A ``.py`` file, or any file that is
not executable, runs under this Python (``python -u script``); an executable file (a Python
interpreter given by path, a shell script) or a command on ``PATH`` runs as itself. Every process
gets ``JZERO_COORDINATOR`` (``--master_addr:--master_port``), ``JZERO_NUM_PROCESSES``,
``JZERO_PROCESS_ID``, ``JZERO_LOCAL_RANK`` (and torch-style ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), ``JZERO_NUM_CPU_DEVICES`` with
``--num_cpu_devices`` (simulated CPU devices per process, joined over gloo) and the variables of
an environment file: ``$JZERO_ENV_FILE`` / ``$DS_ENV_FILE``, else ``.jzero_env`` or
``.deepspeed_env`` in the working directory or the home directory (``KEY=VALUE`` lines).
``jzero.init_distributed()`` -- called by ``jzero.initialize`` -- reads them.

Output. Each line a process prints comes out prefixed with its number: ``[1] ...``.

Failures. The launcher watches its processes. When one exits with an error or is killed, it says
which (``jzero launch: process 1 (localhost, local rank 1) was killed by SIGKILL``), kills the
others at once and exits non-zero (the failed process's status; 128 + signal for a signal).
SIGTERM or Ctrl-C to the launcher is passed to every process as SIGTERM: a preemption, which
``jzero train`` (and scripts using :func:`jzero.runtime.distributed.should_stop`) answer by saving a
checkpoint at a step all processes agree on and exiting 0. A second signal kills them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from jzero.errors import JZeroError

__all__ = ["Proc", "parse_hostfile", "parse_filter", "select_slots", "plan_processes",
           "process_env", "command_line", "read_env_file", "add_launch_arguments", "run_launch",
           "main"]

DEFAULT_MASTER_PORT = 29500
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# Variables of the launcher's environment passed on to remote hosts (local processes get all).
REMOTE_PREFIXES = ("JAX_", "XLA_", "JZERO_", "PYTHON", "NCCL_", "CUDA_", "TF_CPP_", "LD_LIBRARY")


@dataclasses.dataclass(frozen=True)
class Proc:
  """One process of the job: its global number, host, number on the host and slot."""
  process_id: int
  host: str
  local_rank: int
  slot: int


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
  """``{host: slots}`` in file order from DeepSpeed's ``HOST slots=N`` lines."""
  hosts: dict[str, int] = {}
  for number, raw in enumerate(text.splitlines(), 1):
    line = raw.split("#", 1)[0].strip()
    if not line:
      continue
    parts = line.split()
    slots = [p for p in parts[1:] if p.startswith("slots=")]
    if len(parts) != 2 or len(slots) != 1 or not slots[0][6:].isdigit() or int(slots[0][6:]) < 1:
      raise JZeroError(f"{source} line {number}: {raw.strip()!r} is not 'HOST slots=N' (N >= 1), "
                       f"e.g. 'worker-1 slots=8'.")
    if parts[0] in hosts:
      raise JZeroError(f"{source} line {number}: host {parts[0]!r} is listed twice; give each host "
                       f"one line with all its slots.")
    hosts[parts[0]] = int(slots[0][6:])
  if not hosts:
    raise JZeroError(f"{source} lists no hosts; give one 'HOST slots=N' line per machine.")
  return hosts


def parse_filter(spec: str, hosts: dict[str, int], flag: str) -> dict[str, list[int] | None]:
  """``host1:0,1@host2`` as ``{"host1": [0, 1], "host2": None}`` (None: every slot)."""
  out: dict[str, list[int] | None] = {}
  for part in spec.split("@"):
    host, _, slots = part.partition(":")
    if host not in hosts:
      raise JZeroError(f"{flag} {spec!r}: host {host!r} is not in the hostfile "
                       f"({', '.join(hosts)}).")
    if not slots:
      out[host] = None
      continue
    try:
      picked = [int(s) for s in slots.split(",")]
    except ValueError:
      raise JZeroError(f"{flag} {spec!r}: slots of {host!r} must be numbers, e.g. "
                       f"'{host}:0,1'.") from None
    bad = [s for s in picked if not 0 <= s < hosts[host]]
    if bad:
      raise JZeroError(f"{flag} {spec!r}: {host!r} has slots 0..{hosts[host] - 1}, not {bad}.")
    out[host] = sorted(set(picked))
  return out


def select_slots(hosts: dict[str, int], *, include: str | None = None, exclude: str | None = None,
                 num_nodes: int | None = None, num_procs: int | None = None
                 ) -> dict[str, list[int]]:
  """The slots to run on, ``{host: [slot, ...]}``, after DeepSpeed's filters."""
  if include and exclude:
    raise JZeroError("--include and --exclude cannot be used together; give one of them.")
  chosen = {h: list(range(n)) for h, n in hosts.items()}
  if include:
    wanted = parse_filter(include, hosts, "--include")
    chosen = {h: (s if wanted[h] is None else wanted[h]) for h, s in chosen.items() if h in wanted}
  if exclude:
    for h, dropped in parse_filter(exclude, hosts, "--exclude").items():
      if dropped is None:
        chosen.pop(h, None)
      elif h in chosen:
        chosen[h] = [s for s in chosen[h] if s not in dropped]
  if num_nodes is not None:
    if num_nodes < 1 or num_nodes > len(chosen):
      raise JZeroError(f"--num_nodes {num_nodes}: {len(chosen)} host(s) are available "
                       f"({', '.join(chosen) or 'none'}).")
    chosen = dict(list(chosen.items())[:num_nodes])
  if num_procs is not None:
    if num_procs < 1:
      raise JZeroError(f"--num_processes {num_procs} must be >= 1.")
    short = {h: len(s) for h, s in chosen.items() if len(s) < num_procs}
    if short:
      raise JZeroError(f"--num_processes {num_procs} per host, but {short} have fewer slots.")
    chosen = {h: s[:num_procs] for h, s in chosen.items()}
  chosen = {h: s for h, s in chosen.items() if s}
  if not chosen:
    raise JZeroError("no slots are left to run on after --include / --exclude.")
  return chosen


def plan_processes(slots: dict[str, list[int]]) -> list[Proc]:
  """Processes numbered host by host, slot by slot."""
  procs = []
  for host, host_slots in slots.items():
    for local_rank, slot in enumerate(host_slots):
      procs.append(Proc(len(procs), host, local_rank, slot))
  return procs


def read_env_file(path: str | os.PathLike | None = None) -> dict[str, str]:
  """``KEY=VALUE`` lines of the environment file (see the module docstring); {} if none."""
  if path is None:
    path = os.environ.get("JZERO_ENV_FILE") or os.environ.get("DS_ENV_FILE")
  if path is None:
    for folder in (Path.cwd(), Path.home()):
      for name in (".jzero_env", ".deepspeed_env"):
        if (folder / name).is_file():
          path = folder / name
          break
      if path is not None:
        break
  if path is None:
    return {}
  env = {}
  for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
    line = raw.strip()
    if not line or line.startswith("#"):
      continue
    key, sep, value = line.partition("=")
    if not sep or not key.strip().isidentifier():
      raise JZeroError(f"environment file {path} line {number}: {raw!r} is not KEY=VALUE.")
    env[key.strip()] = value.strip()
  return env


def is_local(host: str) -> bool:
  return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def process_env(proc: Proc, world: int, local_world: int, master_addr: str, master_port: int,
                num_cpu_devices: int | None, extra: dict[str, str]) -> dict[str, str]:
  """The variables one process gets on top of the inherited environment."""
  env = dict(extra)
  env.update({
      "JZERO_COORDINATOR": f"{master_addr}:{master_port}",
      "JZERO_NUM_PROCESSES": str(world), "JZERO_PROCESS_ID": str(proc.process_id),
      "JZERO_LOCAL_RANK": str(proc.local_rank),
      "RANK": str(proc.process_id), "WORLD_SIZE": str(world), "LOCAL_RANK": str(proc.local_rank),
      "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master_addr,
      "MASTER_PORT": str(master_port), "PYTHONUNBUFFERED": "1",
  })
  if num_cpu_devices:
    env["JZERO_NUM_CPU_DEVICES"] = str(num_cpu_devices)
  else:
    env["JZERO_LOCAL_DEVICE_IDS"] = str(proc.slot)
  return env


def _runs_as_itself(script: str) -> bool:
  """An executable file that is not Python source (a Python interpreter given by path, a shell
  script, a binary), or a command on ``PATH`` when no file of that name is here."""
  path = Path(script)
  if path.exists():
    return path.is_file() and path.suffix != ".py" and os.access(path, os.X_OK)
  return shutil.which(script) is not None


def _program(script: str, script_args: Sequence[str], module: bool, no_python: bool = False
             ) -> list[str]:
  """The program every process runs: ``python -u [-m] script ...`` for a Python script or module,
  or the command itself with ``--no_python`` or when ``script`` is an executable (``jzero launch
  -- /venv/bin/python train.py``, ``-- ./run.sh``) or a command on ``PATH`` that is no file here
  (``jzero launch -- jzero train ...``: a console script is itself a Python program)."""
  if module and no_python:
    raise JZeroError("--module and --no_python exclude each other: a module runs under python.")
  if no_python or (not module and _runs_as_itself(script)):
    return [script, *script_args]
  return [sys.executable, "-u", *(["-m"] if module else []), script, *script_args]


def command_line(proc: Proc, env: dict[str, str], program: list[str], *, ssh_port: int | None = None
                 ) -> list[str]:
  """The argv that starts ``proc``: the program itself here, an ssh command for another host."""
  if is_local(proc.host):
    return program
  passed = {k: v for k, v in os.environ.items() if k.startswith(REMOTE_PREFIXES)}
  passed.update(env)
  exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(passed.items()))
  remote = (f"cd {shlex.quote(os.getcwd())} && export {exports}; exec "
            f"{' '.join(shlex.quote(a) for a in program)}")
  return ["ssh", "-o", "BatchMode=yes", *(["-p", str(ssh_port)] if ssh_port else []), proc.host,
          remote]


def _describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with status {code}"


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(prefix + line)
    out.flush()
  stream.close()


def _die_with_parent() -> None:
  """In the child, before exec (Linux): SIGKILL it when the launcher dies, even by SIGKILL, so no
  process of the job outlives its launcher."""
  if sys.platform.startswith("linux"):
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _Job:
  """The running processes; stops them all when one fails."""

  def __init__(self, procs: list[Proc], argvs: list[list[str]], envs: list[dict[str, str]]):
    self.procs, self.children, self.pumps = procs, [], []
    self.signals = 0
    for proc, argv, env in zip(procs, argvs, envs):
      full_env = {**os.environ, **env}
      child = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace",
                               start_new_session=True, preexec_fn=_die_with_parent)
      pump = threading.Thread(target=_pump, args=(child.stdout, f"[{proc.process_id}] ", sys.stdout),
                              daemon=True)
      pump.start()
      self.children.append(child)
      self.pumps.append(pump)

  def _signal_all(self, sig: int) -> None:
    for child in self.children:
      if child.poll() is None:
        try:
          os.killpg(child.pid, sig)
        except ProcessLookupError:
          pass

  def on_signal(self, signum, frame) -> None:
    self.signals += 1
    if self.signals == 1:
      print(f"jzero launch: got {signal.Signals(signum).name}; passing SIGTERM to every process "
            f"(a preemption: they save and exit). Send it again to kill them.", file=sys.stderr,
            flush=True)
      self._signal_all(signal.SIGTERM)
    else:
      self._signal_all(signal.SIGKILL)

  def wait(self) -> int:
    """Waits for every process; the job's exit status."""
    while True:
      codes = [c.poll() for c in self.children]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i = failed[0]
        proc, code = self.procs[i], codes[i]
        others = [j for j, c in enumerate(codes) if c is None]
        after_sigterm = (" after SIGTERM (its log says whether it saved: a script that does not "
                         "poll engine.reached_preemption ends with jzero.Preempted, which says "
                         "where)") if self.signals else ""
        print(f"jzero launch: process {proc.process_id} ({proc.host}, local rank "
              f"{proc.local_rank}) {_describe_exit(code)}{after_sigterm}; "
              + (f"stopping the other {len(others)} process(es): {others}." if others else
                 "no other process is running."), file=sys.stderr, flush=True)
        self._signal_all(signal.SIGKILL)
        for c in self.children:
          c.wait()
        self._drain()
        return code if code > 0 else 128 - code
      if all(c == 0 for c in codes):
        self._drain()
        if self.signals:
          print("jzero launch: every process exited 0 after SIGTERM (stopped at a step they all "
                "reached; saved where their script saves).", file=sys.stderr, flush=True)
        return 0
      time.sleep(0.1)

  def _drain(self) -> None:
    for pump in self.pumps:
      pump.join(timeout=5)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
  """The launcher's options (DeepSpeed's names) and the script with its arguments."""
  p.add_argument("--hostfile", default=None,
                 help="DeepSpeed hostfile: one 'HOST slots=N' line per machine (default: this "
                      "machine only)")
  p.add_argument("--include", "-i", default=None,
                 help="hosts/slots to use, e.g. 'worker-0:0,1@worker-1' (all slots of worker-1)")
  p.add_argument("--exclude", "-e", default=None,
                 help="hosts/slots to leave out, same form as --include")
  p.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts")
  p.add_argument("--num_gpus", "--num_processes", dest="num_procs", type=int, default=None,
                 help="processes per host (the first N slots of each; default: all slots; "
                      "without a hostfile, processes on this machine, default 1)")
  p.add_argument("--num_cpu_devices", type=int, default=None,
                 help="simulated CPU devices per process, joined over gloo (for trying a "
                      "multi-process job without accelerators)")
  p.add_argument("--master_addr", default=None,
                 help="address of process 0's coordinator (default: the first host; 127.0.0.1 "
                      "when it is this machine)")
  p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT,
                 help=f"coordinator port (default {DEFAULT_MASTER_PORT})")
  p.add_argument("--ssh_port", type=int, default=None, help="ssh port of the remote hosts")
  p.add_argument("--env_file", default=None,
                 help="KEY=VALUE file exported to every process (default: $JZERO_ENV_FILE, "
                      "$DS_ENV_FILE, or .jzero_env / .deepspeed_env in the working or home "
                      "directory)")
  p.add_argument("--module", "-m", action="store_true",
                 help="run the script as a Python module (python -m), e.g. '--module jzero train'")
  p.add_argument("--no_python", "--no-python", action="store_true",
                 help="run the script as a command, not under python (default for a command "
                      "on PATH that is no file here, e.g. '-- jzero train ...')")
  p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                 help="print each process's command and environment; start nothing")
  p.add_argument("script", help="the training script (or module with --module)")
  p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def run_launch(args: argparse.Namespace) -> int:
  """Starts the job ``args`` describes and waits for it; returns the exit status."""
  if args.hostfile:
    path = Path(args.hostfile)
    if not path.is_file():
      raise JZeroError(f"--hostfile {args.hostfile!r} does not exist.")
    hosts = parse_hostfile(path.read_text(), str(path))
  else:
    if args.include or args.exclude:
      raise JZeroError("--include / --exclude select hosts of a --hostfile; give one.")
    hosts = {"localhost": args.num_procs or 1}
  slots = select_slots(hosts, include=args.include, exclude=args.exclude,
                       num_nodes=args.num_nodes, num_procs=args.num_procs)
  procs = plan_processes(slots)
  first = procs[0].host
  master = args.master_addr or ("127.0.0.1" if is_local(first) else first)
  extra = read_env_file(args.env_file)
  program = _program(args.script, args.script_args, args.module, args.no_python)
  envs = [process_env(p, len(procs), len(slots[p.host]), master, args.master_port,
                      args.num_cpu_devices, extra) for p in procs]
  argvs = [command_line(p, e, program, ssh_port=args.ssh_port) for p, e in zip(procs, envs)]
  if args.dry_run:
    for p, e, argv in zip(procs, envs, argvs):
      where = "local" if is_local(p.host) else "ssh"
      print(f"# process {p.process_id}: host {p.host} slot {p.slot} ({where})")
      if is_local(p.host):
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(e.items())), end=" ")
      print(shlex.join(argv))
    return 0
  print(f"jzero launch: {len(procs)} process(es) on {len(slots)} host(s) "
        f"({', '.join(f'{h}: slots {s}' for h, s in slots.items())}); coordinator "
        f"{master}:{args.master_port}", file=sys.stderr, flush=True)
  job = _Job(procs, argvs, envs)
  print("jzero launch: " + ", ".join(f"process {p.process_id} pid {c.pid}"
                                     for p, c in zip(procs, job.children)), file=sys.stderr,
        flush=True)
  previous = {s: signal.signal(s, job.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return job.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m jzero.runtime.launch ...``: the same as ``jzero launch ...``."""
  parser = argparse.ArgumentParser(prog="python -m jzero.runtime.launch",
                                   description=__doc__.split("\n\n")[0])
  add_launch_arguments(parser)
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  try:
    return run_launch(args)
  except JZeroError as e:
    print(f"jzero: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
