"""Flags every device-using subcommand shares: simulated devices, the mesh file, joining a
several-process job (:func:`join`), and keeping host-only commands off accelerators."""

from __future__ import annotations

import argparse
import os

from jzero.errors import JZeroError

__all__ = ["DEFAULT_DEVICES", "add_device_args", "add_process_args", "check_process_args", "join",
           "host_only"]

DEFAULT_DEVICES = 8


def add_device_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--devices", type=int, default=None,
                 help="number of SIMULATED CPU devices (default 8, for trying jzero on a "
                      "laptop; started by `jzero launch` or a cluster: the launcher's "
                      "--num_cpu_devices, else the accelerators); on GPUs or TPUs pass --devices "
                      "0 to use the accelerators JAX finds")
  p.add_argument("--mesh", default=None,
                 help="mesh file (configs/mesh/*.yaml); default: all devices on one data axis")


def add_process_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("several processes (jax.distributed; run the same command in each)")
  g.add_argument("--coordinator", default=None,
                 help="HOST:PORT of process 0's coordinator (with --num-processes, --process-id); "
                      "--devices then counts each process's devices")
  g.add_argument("--num-processes", type=int, default=None, help="number of processes")
  g.add_argument("--process-id", type=int, default=None, help="this process's index, from 0")


def check_process_args(args: argparse.Namespace) -> None:
  given = [a is not None for a in (args.coordinator, args.num_processes, args.process_id)]
  if any(given) and not all(given):
    raise JZeroError("--coordinator, --num-processes and --process-id go together: give all three "
                     "(the same coordinator and count in every process) or none.")
  if all(given):
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      raise JZeroError(f"--process-id {args.process_id} must be in [0, --num-processes "
                       f"{args.num_processes}).")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise JZeroError(f"--coordinator {args.coordinator!r} must be HOST:PORT, e.g. 127.0.0.1:7777.")


def join(args: argparse.Namespace) -> None:
  """Simulated devices, then the process job (:func:`jzero.runtime.distributed.init_distributed`):
  from the flags, from `jzero launch`'s environment, or from a cluster's (SLURM, Open MPI,
  Kubernetes)."""
  from jzero.runtime import distributed  # noqa: PLC0415 (imports JAX: not for --help)
  devices = args.devices
  if devices is None:  # launched: the launcher's --num_cpu_devices, or the real accelerators
    launched = (args.coordinator is not None or distributed.ENV_COORDINATOR in os.environ
                or distributed.cluster_environment() is not None)
    devices = 0 if launched else DEFAULT_DEVICES
  if args.coordinator is not None:
    distributed.init_distributed(args.coordinator, args.num_processes, args.process_id,
                                 num_cpu_devices=devices or None)
  else:
    distributed.init_distributed(num_cpu_devices=devices or None)


def host_only() -> None:
  """convert / inspect are host work: unless JAX has started, keep it off any accelerator (a
  training job may be using it)."""
  import jax  # noqa: PLC0415
  from jax._src import xla_bridge  # noqa: PLC0415 (backends_are_initialized: no public home)

  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
