"""Monitoring as DeepSpeed configures it: ``tensorboard``, ``csv_monitor`` and ``wandb``.

A DeepSpeed config's monitor blocks work unchanged::

  "tensorboard": {"enabled": true, "output_path": "logs/", "job_name": "train_gpt"},
  "csv_monitor": {"enabled": true, "output_path": "logs/", "job_name": "train_gpt"},
  "wandb": {"enabled": true, "project": "gpt", "group": "zero3", "team": "my-team"}

and write what DeepSpeed writes, where it writes it, so that dashboards and scripts keep working:

* events named ``Train/Samples/<metric>`` whose x-axis is the number of samples seen:
  ``train_loss`` at the samples seen before the step (the parameters the loss was computed
  with), ``lr`` and, in fp16, ``loss_scale`` after it (DeepSpeed logs the loss in ``backward`` and
  the rest after ``step`` has added ``train_batch_size``);
* ``lr`` is the learning rate the *next* step uses, as DeepSpeed logs it: its engine's ``step()``
  writes ``get_lr()`` after ``_take_model_step`` has called ``lr_scheduler.step()``, so the event
  at k x ``train_batch_size`` samples is step k+1's lr -- and after a skipped fp16 step, which
  does not step the scheduler, step k's own (DeepSpeed's engine over jzero's,
  :meth:`jzero.train.deepspeed_engine.DeepSpeedEngine.get_lr`, returns the same);
* TensorBoard: one event file (written with tensorboardX; TensorBoard reads it) in
  ``output_path/job_name``, on disk after every step; the config as the text ``DeepSpeed/config``;
* CSV: in ``output_path/job_name``, one file per metric named after its tag
  (``Train_Samples_train_loss.csv``) with the header ``step,<metric>`` and one
  ``<samples>,<value>`` row per step -- the "step" column holds the samples, as DeepSpeed's
  does; the config in ``deepspeed_config.csv``;
* wandb: ``wandb.init(project, group, entity=team)``, each event ``wandb.log({tag: value},
  step=samples)``, the config in ``wandb.config``. ``WANDB_MODE=offline`` keeps the run on disk.

Only process 0 writes (DeepSpeed's rank 0), every optimizer step (DeepSpeed writes every step, not
every ``steps_per_print``). The engine writes them (:meth:`jzero.Engine.train_step`), as
DeepSpeed's engine does, so a script's own loop gets them with no code of its own.

Where jzero differs, and why:

* more metrics, under the same prefix: ``grad_norm``; ``samples_per_second``,
  ``tokens_per_second`` (with ``initialize(tokens_per_sample=...)``) and ``mfu``
  (:class:`Throughput`) per step, from the wall time between the ends of consecutive steps (the
  step that compiled has none); with ``wall_clock_breakdown`` the step's two jits as
  ``elapsed_time_ms_forward_backward`` and ``elapsed_time_ms_step`` (DeepSpeed's name for the
  optimizer step: jzero's forward and backward are one program); where the runtime reports device
  memory (GPU), ``memory_bytes_in_use`` and ``memory_peak_bytes_in_use``; and once, at the first
  step, the memory report's bytes per category as ``Memory/measured_bytes/<category>`` and
  ``Memory/predicted_bytes/<category>`` (the placement does not change between steps).
* ``loss_scale`` is written in fp16 only, as DeepSpeed does; the lr is left out where it is
  unknown (a client optimizer without ``optax.inject_hyperparams``).
* with a client optimizer (``jzero.initialize(optimizer=optax.inject_hyperparams(...)(...))``)
  the lr written is the one the step used: its schedule lives inside the optax transformation,
  so the next step's lr is known only once that step runs. With the config's ``scheduler``, the
  lr is DeepSpeed's, the next step's.
* the console line every ``steps_per_print`` steps shows the lr the step used, beside that
  step's loss (DeepSpeed's progress line prints ``get_lr()``, the next step's).
* a CSV file that already exists is appended to without a second header (DeepSpeed writes the
  header again in each new process, so a resumed run's file has two).
* an enabled monitor reads the step's scalars, so the host waits for each step, as DeepSpeed's
  ``loss.item()`` does; with no monitor nothing waits.
* ``comet`` and ``trackio`` are refused when enabled (jzero.config.support), not ignored.

The writers' packages are an extra, ``pip install "jzero[monitor]"`` (tensorboardX, wandb); a
config that enables a monitor whose package is missing is a ConfigError naming the extra, raised
by :func:`jzero.initialize` before any device work.
"""

from __future__ import annotations

import atexit
import csv
import dataclasses
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from jzero.analysis.flops import Peak
from jzero.config import Config
from jzero.errors import ConfigError

__all__ = ["Event", "Monitor", "Throughput", "step_events", "memory_events", "check_packages"]

Event = tuple[str, float, int]  # DeepSpeed's (tag, value, samples seen)
TRAIN = "Train/Samples/"
EXTRA = "monitor"  # pip install "jzero[monitor]"
_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}  # block -> module it needs


@dataclasses.dataclass(frozen=True)
class Throughput:
  """How fast steps ran: wall time per step and what it makes per second.

  Attributes:
    step_seconds: wall time of one step.
    samples_per_step: ``train_batch_size``.
    tokens_per_step: samples x ``tokens_per_sample``; None when the engine was not told it.
    flops_per_step: the compiled step's matmul FLOPs per device (:mod:`jzero.analysis.flops`).
    devices: devices of this process (each runs ``flops_per_step``).
    peak: the peak of those devices together, with its source; None where none is known.
  """

  step_seconds: float
  samples_per_step: int
  tokens_per_step: int | None = None
  flops_per_step: float | None = None
  devices: int = 1
  peak: Peak | None = None

  @property
  def samples_per_second(self) -> float:
    return self.samples_per_step / self.step_seconds

  @property
  def tokens_per_second(self) -> float | None:
    return None if self.tokens_per_step is None else self.tokens_per_step / self.step_seconds

  @property
  def mfu(self) -> float | None:
    """Model FLOPs utilization, FLOP/s achieved over the peak (None without FLOPs or a peak)."""
    if not self.flops_per_step or self.peak is None:
      return None
    return self.flops_per_step * self.devices / self.step_seconds / self.peak.flops_per_second

  def __str__(self) -> str:
    parts = [f"{self.tokens_per_second:,.0f} tokens/s"] if self.tokens_per_step else []
    parts.append(f"{self.samples_per_second:,.1f} samples/s")
    if self.mfu is not None:
      parts.append(f"MFU {self.mfu:.1%} of {self.peak}")
    return ", ".join(parts)


def step_events(step: int, samples_per_step: int, metrics: dict, *, fp16: bool,
                lr: float | None = None, throughput: Throughput | None = None, timing: Any = None,
                memory_stats: dict | None = None) -> list[Event]:
  """DeepSpeed's events of optimizer step ``step`` (1-based), and jzero's (module docstring).
  ``lr``: the learning rate the next step uses, which DeepSpeed logs (default: the step's own,
  ``metrics["lr"]``)."""
  before, after = (step - 1) * samples_per_step, step * samples_per_step
  events = [(TRAIN + "train_loss", float(metrics["loss"]), before)]
  lr = float(metrics["lr"] if lr is None else lr)
  if not math.isnan(lr):
    events.append((TRAIN + "lr", lr, after))
  if fp16:
    events.append((TRAIN + "loss_scale", float(metrics["loss_scale"]), after))
  events.append((TRAIN + "grad_norm", float(metrics["grad_norm"]), after))
  if throughput is not None:
    rates = {"samples_per_second": throughput.samples_per_second,
             "tokens_per_second": throughput.tokens_per_second, "mfu": throughput.mfu}
    events += [(TRAIN + name, value, after) for name, value in rates.items() if value is not None]
  if timing is not None:
    events += [(TRAIN + "elapsed_time_ms_forward_backward", timing.forward_backward_s * 1e3, after),
               (TRAIN + "elapsed_time_ms_step", timing.optimizer_s * 1e3, after)]
  for name in ("bytes_in_use", "peak_bytes_in_use"):
    if memory_stats and name in memory_stats:
      events.append((TRAIN + f"memory_{name}", float(memory_stats[name]), after))
  return events


def memory_events(report: Any, samples: int) -> list[Event]:
  """A :class:`~jzero.analysis.memory_report.MemoryReport`'s bytes per category, measured and
  predicted, at ``samples``."""
  return [(f"Memory/{kind}_bytes/{record['category']}", record[kind], samples)
          for record in report.to_records() for kind in ("measured", "predicted")]


class _Writer(Protocol):
  def write_events(self, events: list[Event]) -> None: ...
  def write_config(self, config: dict) -> None: ...
  def close(self) -> None: ...


class _TensorBoard:
  """``tensorboard``: an event file in ``output_path/job_name``, written and flushed in the
  caller (tensorboardX's synchronous EventsWriter: its SummaryWriter queues events for a thread
  that writes them up to two minutes later)."""

  def __init__(self, log_dir: Path):
    from tensorboardX import summary  # noqa: PLC0415 (the monitor extra)
    from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415
    from tensorboardX.proto.event_pb2 import Event  # noqa: PLC0415

    log_dir.mkdir(parents=True, exist_ok=True)
    self.summary, self.event = summary, Event
    self.writer = EventsWriter(str(log_dir / "events"))

  def _write(self, summaries: list[tuple[Any, int]]) -> None:
    for summary, step in summaries:
      self.writer.write_event(self.event(wall_time=time.time(), step=step, summary=summary))
    self.writer.flush()

  def write_events(self, events: list[Event]) -> None:
    self._write([(self.summary.scalar(tag, value), samples) for tag, value, samples in events])

  def write_config(self, config: dict) -> None:
    self._write([(self.summary.text("DeepSpeed/config", json.dumps(config, indent=2)), 0)])

  def close(self) -> None:
    self.writer.close()


class _Csv:
  """``csv_monitor``: one ``<tag with / as _>.csv`` per metric in ``output_path/job_name``."""

  def __init__(self, log_dir: Path):
    self.log_dir = log_dir
    log_dir.mkdir(parents=True, exist_ok=True)

  def write_events(self, events: list[Event]) -> None:
    for tag, value, samples in events:
      path = self.log_dir / (tag.replace("/", "_").replace(" ", "_") + ".csv")
      new = not path.exists() or path.stat().st_size == 0
      with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
          writer.writerow(["step", tag.rsplit("/", 1)[-1]])
        writer.writerow([samples, value])

  def write_config(self, config: dict) -> None:
    with open(self.log_dir / "deepspeed_config.csv", "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(["key", "value"])
      writer.writerows((key, json.dumps(value) if isinstance(value, (dict, list)) else value)
                       for key, value in config.items())

  def close(self) -> None:
    pass


class _Wandb:
  """``wandb``: one run, ``wandb.init(project=, group=, entity=team)``."""

  def __init__(self, block: Any):
    import wandb  # noqa: PLC0415 (the monitor extra)

    self.wandb = wandb
    self.run = wandb.init(project=block.project, group=block.group, entity=block.team)

  def write_events(self, events: list[Event]) -> None:
    for tag, value, samples in sorted(events, key=lambda event: event[2]):  # steps only increase
      self.run.log({tag: value}, step=samples)

  def write_config(self, config: dict) -> None:
    self.run.config.update(config, allow_val_change=True)

  def close(self) -> None:
    self.run.finish()


def check_packages(config: Config) -> None:
  """Raises ConfigError when an enabled monitor's package is not installed (every process
  checks, so that all fail alike)."""
  missing = [(block, module) for block, module in _PACKAGES.items()
             if getattr(config, block).enabled and importlib.util.find_spec(module) is None]
  if missing:
    lines = [f"{block}.enabled: needs the {module} package, which is not installed"
             for block, module in missing]
    where = f"{config.source}: " if config.source else ""
    raise ConfigError(f"{where}monitors:\n" + "\n".join(f"  {line}" for line in lines) +
                      f'\n  install jzero\'s monitor extra: pip install "jzero[{EXTRA}]" (or '
                      f"pip install {' '.join(module for _, module in missing)}), or set "
                      f"enabled: false")


@dataclasses.dataclass
class Monitor:
  """The enabled writers of a config, on process 0 (none elsewhere); see the module docstring."""

  writers: tuple[_Writer, ...] = ()
  _closed: bool = dataclasses.field(default=False, repr=False)

  @property
  def enabled(self) -> bool:
    return bool(self.writers) and not self._closed

  @classmethod
  def from_config(cls, config: Config) -> Monitor:
    """Opens the writers ``config`` enables (process 0) and writes the config to them; closed at
    exit. Raises ConfigError when a writer's package is missing (:func:`check_packages`)."""
    check_packages(config)
    if jax.process_index() != 0:
      return cls()
    writers: list[_Writer] = []
    if config.tensorboard.enabled:
      writers.append(_TensorBoard(_log_dir(config.tensorboard)))
    if config.csv_monitor.enabled:
      writers.append(_Csv(_log_dir(config.csv_monitor)))
    if config.wandb.enabled:
      writers.append(_Wandb(config.wandb))
    monitor = cls(tuple(writers))
    if writers:
      for writer in writers:
        writer.write_config(config.to_dict())
      atexit.register(monitor.close)
    return monitor

  def write_events(self, events: list[Event]) -> None:
    if self.enabled:
      events = [(tag, float(np.asarray(value)), int(samples)) for tag, value, samples in events]
      for writer in self.writers:
        writer.write_events(events)

  def close(self) -> None:
    """Flushes and closes the writers (finishes the wandb run); later events are dropped."""
    if not self._closed:
      self._closed = True
      for writer in self.writers:
        writer.close()


def _log_dir(block: Any) -> Path:
  return Path(os.path.join(block.output_path, block.job_name))
