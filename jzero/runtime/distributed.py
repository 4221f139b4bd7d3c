"""Joining a job of several processes (``jax.distributed``), and stopping it together.

:func:`init_distributed` is what ``jzero.initialize`` and ``jzero train`` call first. It finds out
whether this process is one of several and, if so, starts JAX's multi-process runtime
(``jax.distributed.initialize``) before JAX's backend starts. Where the job is described, in order:

1. the arguments (``coordinator``, ``num_processes``, ``process_id``), e.g. from ``jzero train
   --coordinator HOST:PORT --num-processes N --process-id I``;
2. the environment ``jzero launch`` gives every process it starts: ``JZERO_COORDINATOR``,
   ``JZERO_NUM_PROCESSES``, ``JZERO_PROCESS_ID``, ``JZERO_LOCAL_RANK`` and, with
   ``--num_cpu_devices``, ``JZERO_NUM_CPU_DEVICES``;
3. a cluster JAX recognises itself: SLURM (``srun``), Open MPI (``mpirun``), Kubernetes -- then
   ``jax.distributed.initialize()`` is called without arguments and reads the cluster's variables.

Nothing found: a single process, and nothing is started. Simulated CPU devices
(``num_cpu_devices``) talk to the other processes over gloo.

Failures. JAX's coordination service tracks every process by heartbeats; when one stops
(killed, its machine lost) every other process is terminated by the runtime with a message naming
the lost process ("The following tasks are unhealthy (stopped sending heartbeats): 1"). jzero sets
the heartbeat timeout to ``JZERO_HEARTBEAT_TIMEOUT`` seconds (default 30, JAX's own default is
100), so survivors blocked in a collective that will never complete are gone within about that
time. ``jzero launch`` does not wait for that: it stops the other processes as soon as one fails.

Preemption. :func:`should_stop` is a sync point every process calls once per step with the same
step number: after any process received SIGTERM, it returns True on every process *at the same
step* (JAX's preemption sync manager, ``multihost_utils.reached_preemption_sync_point``), so they
can all save that step's checkpoint and exit 0. In a single process it returns True once SIGTERM
arrived. With several processes JAX catches SIGTERM itself, so a script that never asks would
train on through its grace period: then the engine asks at each ``train_step`` and, at the sync
point, saves to the directory of the script's last ``engine.save_checkpoint`` and exits 0, or,
having nowhere to save, exits 143 at once (``Engine._stop_if_preempted``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from typing import Iterator, Sequence

from jzero.errors import JZeroError
from jzero.sharding.mesh import ENV_NUM_CPU_DEVICES, simulate_cpu_devices

__all__ = ["ProcessInfo", "init_distributed", "should_stop", "cluster_environment",
           "explained_peer_loss"]

DEFAULT_HEARTBEAT_TIMEOUT_S = 30
INIT_TIMEOUT_S = 300

# The variables `jzero launch` sets in every process it starts.
ENV_COORDINATOR = "JZERO_COORDINATOR"
ENV_NUM_PROCESSES = "JZERO_NUM_PROCESSES"
ENV_PROCESS_ID = "JZERO_PROCESS_ID"
ENV_LOCAL_RANK = "JZERO_LOCAL_RANK"
ENV_LOCAL_DEVICE_IDS = "JZERO_LOCAL_DEVICE_IDS"
ENV_HEARTBEAT_TIMEOUT = "JZERO_HEARTBEAT_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """Where this process stands in the job: ``source`` is how the job was found ("arguments",
  "jzero launch", a cluster name such as "slurm", or "single process")."""
  process_id: int
  num_processes: int
  source: str


_joined: ProcessInfo | None = None
_heartbeat_s = DEFAULT_HEARTBEAT_TIMEOUT_S
_sigterm = {"seen": False, "installed": False, "polls": 0}


def _cluster():
  from jax._src import clusters  # ClusterEnv has no public home in jax 0.10

  for env in clusters.ClusterEnv._cluster_types:
    if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
      return env
  return None


def cluster_environment() -> str | None:
  """The name of the cluster environment JAX would read (``"slurm"``, ``"ompi"``, ``"k8s"``...),
  or None. Opt-in environments (mpi4py) are not detected without being asked for."""
  env = _cluster()
  return None if env is None else env.name


def _int_env(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise JZeroError(f"environment variable {name}={value!r} must be an integer.") from None


def _backend_started() -> bool:
  from jax._src import xla_bridge  # backends_are_initialized has no public home in jax 0.10
  return xla_bridge.backends_are_initialized()


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, num_cpu_devices: int | None = None,
                     local_device_ids: Sequence[int] | None = None,
                     heartbeat_timeout: int | None = None) -> ProcessInfo:
  """Joins the job this process belongs to (see the module docstring); idempotent.

  Call before any JAX computation: ``jax.distributed`` must start before JAX's backend.
  ``num_cpu_devices`` (default ``JZERO_NUM_CPU_DEVICES``) simulates that many CPU devices in this
  process. Returns this process's :class:`ProcessInfo`.

  Raises:
    JZeroError: the description is incomplete, or JAX's backend already started.
  """
  global _joined
  import jax

  if _joined is not None:
    return _joined
  if jax.distributed.is_initialized():
    _joined = ProcessInfo(jax.process_index(), jax.process_count(), "already initialized")
    return _joined

  source = "arguments"
  if coordinator is None and num_processes is None and process_id is None:
    coordinator = os.environ.get(ENV_COORDINATOR) or None
    num_processes = _int_env(ENV_NUM_PROCESSES)
    process_id = _int_env(ENV_PROCESS_ID)
    source = "jzero launch"
    if coordinator is None and num_processes is None and process_id is None:
      source = cluster_environment() or "single process"
  elif None in (coordinator, num_processes, process_id):
    raise JZeroError("init_distributed: give coordinator, num_processes and process_id together "
                     "(the same coordinator and count in every process), or none of them.")
  if num_cpu_devices is None:
    num_cpu_devices = _int_env(ENV_NUM_CPU_DEVICES)
  if local_device_ids is None and os.environ.get(ENV_LOCAL_DEVICE_IDS):
    local_device_ids = [int(i) for i in os.environ[ENV_LOCAL_DEVICE_IDS].split(",")]

  if num_cpu_devices:
    simulate_cpu_devices(num_cpu_devices)
  if source not in ("arguments", "jzero launch", "single process") and _backend_started():
    try:  # e.g. a one-task SLURM allocation around a notebook: nothing to join
      if _cluster().get_process_count() == 1:
        source = "single process"
    except Exception:  # the cluster's own lookup failed: let jax.distributed say why below
      pass
  if source == "single process":
    _joined = ProcessInfo(0, 1, source)
    return _joined
  if source == "jzero launch" and None in (coordinator, num_processes, process_id):
    raise JZeroError(f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} go together; "
                     f"this process has only some of them. Start it with `jzero launch`, or set "
                     f"all three.")
  if _backend_started():
    raise JZeroError(
        f"this process is one of several ({source}), but JAX's backend already started, so it "
        f"can no longer join them. Call jzero.init_distributed() (or jzero.initialize) before any "
        f"JAX computation, e.g. right after the imports.")
  if num_cpu_devices or jax.config.jax_platforms == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  global _heartbeat_s
  heartbeat = heartbeat_timeout or _int_env(ENV_HEARTBEAT_TIMEOUT) or DEFAULT_HEARTBEAT_TIMEOUT_S
  _heartbeat_s = heartbeat
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids,
                             initialization_timeout=INIT_TIMEOUT_S,
                             heartbeat_timeout_seconds=heartbeat,
                             shutdown_timeout_seconds=max(heartbeat, 30))
  _joined = ProcessInfo(jax.process_index(), jax.process_count(), source)
  return _joined


@contextlib.contextmanager
def explained_peer_loss() -> Iterator[None]:
  """A collective that fails because another process is gone surfaces as a bare transport error
  ("Gloo AllGather failed ... Connection closed by peer"); inside this context (the engine's
  ``train_step``) it becomes a :class:`JZeroError` saying what it means and where the name of the
  lost process will appear, chained to the original."""
  import jax

  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    text = str(e)
    if jax.process_count() == 1 or not any(
        s in text for s in ("Gloo", "Connection closed", "UNAVAILABLE", "heartbeat")):
      raise
    raise JZeroError(
        f"process {jax.process_index()}: a collective failed, most likely because another process "
        f"of the job is gone (killed, crashed, or its machine lost). JAX's coordination service "
        f"names it ('Task N heartbeat timeout') within {_heartbeat_s} s, then ends this process; "
        f"if process 0 (the coordinator) is the lost one, it reports the coordination service "
        f"unreachable ('Socket closed') instead.") from e


def _on_sigterm(signum, frame) -> None:
  _sigterm["seen"] = True


def install_sigterm_handler() -> None:
  """In a single process: remember SIGTERM instead of dying, for :func:`should_stop`. (With
  several processes JAX's preemption notifier catches SIGTERM itself.)"""
  import jax

  if _sigterm["installed"] or jax.process_count() > 1:
    return
  try:
    signal.signal(signal.SIGTERM, _on_sigterm)
  except ValueError:  # not the main thread: SIGTERM keeps its default action
    pass
  _sigterm["installed"] = True


def should_stop(step: int) -> bool:
  """True on every process at the same ``step`` once any process got SIGTERM (a preemption).

  Every process must call it once per step, with the same increasing step numbers. Costs one
  small exchange with the coordination service per call when there are several processes. A
  script that calls it handles preemption itself; in one that never does, the engine's
  ``train_step`` asks instead (:meth:`jzero.Engine.train_step`).
  """
  _sigterm["polls"] += 1
  return reached_sync_point(step)


def polls() -> int:
  """How many times the script has called :func:`should_stop` (the engine's check reads it)."""
  return _sigterm["polls"]


def reached_sync_point(step: int) -> bool:
  """:func:`should_stop` without counting as the script's own check."""
  import jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    return multihost_utils.reached_preemption_sync_point(step)
  install_sigterm_handler()
  return _sigterm["seen"]
