"""What the engine says about the steps it ran, on the host after each step: the log line every
``steps_per_print`` steps, the monitor's events (:mod:`jzero.train.monitor`), the throughput and
model FLOPs utilization (:mod:`jzero.analysis.flops`), and the warning on the first step skipped
for a non-finite fp32 gradient. :class:`StepReporter` keeps what that needs between steps; it never
waits on a step that is still running except to report on it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np

from jzero.analysis import flops as flops_lib
from jzero.analysis.hlo import StepTiming
from jzero.errors import JZeroError, JZeroWarning
from jzero.train import monitor as monitor_lib

__all__ = ["StepReporter", "abstract_arguments"]

logger = logging.getLogger("jzero")


@dataclasses.dataclass
class StepReporter:
  """Reports on one engine's steps (module docstring).

  ``devices``: this process's devices; ``peak_dtype``: the compute dtype MFU's peak is read for;
  ``schedule``: the config's lr schedule (``count -> lr``), None with a client optimizer.
  """

  config: Any
  devices: list
  peak_dtype: Any
  monitor: monitor_lib.Monitor
  tokens_per_sample: int | None = None
  schedule: Callable[[Any], Any] | None = None
  timings: list[StepTiming] = dataclasses.field(default_factory=list)
  # the jitted functions of each step variant with the abstract arguments to lower them again,
  # and their matmul FLOPs per device, by variant key; the key of the variant that ran last
  _lowerings: dict = dataclasses.field(default_factory=dict, repr=False)
  _flops: dict = dataclasses.field(default_factory=dict, repr=False)
  _ran: Any = dataclasses.field(default=None, repr=False)
  # throughput: (step, time) when the last report on a step was done; a step compiled since
  _clock: tuple[int, float] | None = dataclasses.field(default=None, repr=False)
  _compiled: bool = dataclasses.field(default=False, repr=False)
  _unchecked_skip: Any = dataclasses.field(default=None, repr=False)  # (step, overflow array)
  _warned_skip: bool = dataclasses.field(default=False, repr=False)
  _reported_memory: bool = dataclasses.field(default=False, repr=False)
  _last_lr: Any = dataclasses.field(default=None, repr=False)  # the last step's lr (on device)
  # reads the updates the last step's state has applied (the schedule's count), on the host
  _applied: Callable[[], int] | None = dataclasses.field(default=None, repr=False)

  @property
  def batch_size(self) -> int:
    return self.config.train_batch_size

  def next_lr(self) -> float:
    """The learning rate the next step uses: DeepSpeed's ``get_lr()`` between steps, which its
    engine also logs (after ``lr_scheduler.step()``). With the config's schedule, the schedule at
    the count of updates applied so far -- a skipped fp16 step applies none, so the next step's lr
    is then the skipped step's own, as DeepSpeed's scheduler does not step either; before the
    first step, its first value. With a client optimizer, its ``learning_rate`` hyperparameter
    (``optax.inject_hyperparams``) of the last step -- the schedule is inside the transformation,
    so the next step's is known only once it runs -- or the config's ``lr`` before it; NaN
    without one."""
    if self.schedule is not None:
      return float(self.schedule(self.applied()))
    if self._last_lr is not None:
      return float(self._last_lr)
    optimizer = self.config.optimizer
    lr = optimizer.params.get("lr") if optimizer is not None else None
    return float("nan") if lr is None else float(lr)

  def applied(self) -> int:
    """The updates the last state has applied: the schedule's count (0 before any state)."""
    return 0 if self._applied is None else self._applied()

  def resumed(self, applied: Callable[[], int]) -> None:
    """A new or restored state is next; ``applied()`` reads its applied updates."""
    self._applied, self._last_lr = applied, None

  def running(self, key: Any, compiled: bool, lowerings: Callable[[], list]) -> None:
    """The step variant ``key`` is about to run (``compiled``: it was just built);
    ``lowerings()``: its [(jitted fn, abstract args)], read the first time the variant runs."""
    self._ran = key
    self._compiled |= compiled
    if key not in self._lowerings:
      self._lowerings[key] = lowerings()

  def timed(self, key: Any, compiled: bool, grads_fn, update_fn, after_step, step: int, state: Any,
            batch: Any) -> tuple[Any, dict]:
    """``wall_clock_breakdown``: runs step ``step`` as its two jits, each timed to completion
    (``block_until_ready``), then ``after_step(state, metrics, outputs)``; the timing is appended
    to :attr:`timings`. Returns (state, metrics)."""
    lowerings = [(grads_fn, abstract_arguments((state, batch)))]
    self.running(key, compiled, lambda: lowerings)
    t0 = time.perf_counter()
    grads = jax.block_until_ready(grads_fn(state, batch))
    t1 = time.perf_counter()
    if len(lowerings) == 1:
      lowerings.append((update_fn, abstract_arguments((state, *grads))))
    state, metrics, outputs = jax.block_until_ready(update_fn(state, *grads))
    state = after_step(state, metrics, outputs)
    self.timings.append(StepTiming(step=step, forward_backward_s=t1 - t0,
                                   optimizer_s=time.perf_counter() - t1))
    return state, metrics

  def throughput(self, step_seconds: float) -> monitor_lib.Throughput:
    """What steps of ``step_seconds`` each make per second for the variant that ran last (see
    :meth:`jzero.Engine.throughput`)."""
    if self._ran is None:
      raise JZeroError("engine.throughput(...) needs a step first: it reads the FLOPs of the step "
                       "that ran (state, metrics = engine.train_step(state, batch)).")
    if self._ran not in self._flops:
      self._flops[self._ran] = sum(flops_lib.step_flops(fn.lower(*args).compile())
                                   for fn, args in self._lowerings[self._ran])
    return monitor_lib.Throughput(
        step_seconds=step_seconds, samples_per_step=self.batch_size,
        tokens_per_step=(self.batch_size * self.tokens_per_sample
                         if self.tokens_per_sample else None),
        flops_per_step=self._flops[self._ran], devices=len(self.devices),
        peak=flops_lib.peak_flops(self.peak_dtype, self.devices))

  def after_step(self, step: int, metrics: dict, memory_report: Callable[[], Any],
                 applied: Callable[[], int] | None = None) -> None:
    """Reports on step ``step`` (1-based, just dispatched): the first-skip warning, the log line
    and the monitor's events (``memory_report()`` once, at the first event). ``applied()``
    reads the updates the step's state has applied (:meth:`next_lr`)."""
    self._last_lr, self._applied = metrics["lr"], applied
    self._warn_first_skip(step, metrics["overflow"])
    every = self.config.steps_per_print
    printing = every and step % every == 0 and jax.process_index() == 0  # one per job
    if not (printing or self.monitor.enabled):  # (the monitor writes on process 0 only)
      return
    throughput = self._measure_throughput(step, metrics)
    if self.monitor.enabled:
      timing = self.timings[-1] if self.config.wall_clock_breakdown and self.timings else None
      events = monitor_lib.step_events(
          step, self.batch_size, metrics, fp16=self.config.precision == "fp16", lr=self.next_lr(),
          throughput=throughput, timing=timing, memory_stats=self.devices[0].memory_stats())
      if not self._reported_memory:
        self._reported_memory = True
        events += monitor_lib.memory_events(memory_report(), step * self.batch_size)
      self.monitor.write_events(events)
    if printing:
      self._log_step(step, metrics, throughput)
    self._clock = (step, time.perf_counter())  # the reporting is not the step's time

  def _measure_throughput(self, step: int, metrics: dict) -> monitor_lib.Throughput | None:
    """Waits for the step; the throughput since the last step reported on (None for the first,
    or when a step compiled in between)."""
    jax.block_until_ready(metrics["loss"])
    now, previous = time.perf_counter(), self._clock
    compiled, self._compiled = self._compiled, False
    if previous is None or compiled or step <= previous[0]:
      return None
    return self.throughput((now - previous[1]) / (step - previous[0]))

  def _warn_first_skip(self, step: int, overflow: jax.Array) -> None:
    """Warns the first time a step was skipped for a gradient that was not finite (fp16's loss
    scaler and bf16's check skip steps as their normal work, logged with the metrics instead). The
    flag read is the previous step's, after this step was dispatched: the device is never left idle
    waiting."""
    if self.config.precision != "fp32" or self._warned_skip:
      return
    previous, self._unchecked_skip = self._unchecked_skip, (step, overflow)
    if previous is not None and bool(previous[1]):
      self._warned_skip = True
      warnings.warn(
          f"step {previous[0]}: the gradient was not finite (NaN or inf), so the step was skipped: "
          f"parameters and optimizer state are unchanged. metrics['overflow'] flags such steps "
          f"and metrics['skipped'] counts them. Look for NaN or inf in the batch, an integer input "
          f"out of an embedding's range, or a loss that divides by zero.", JZeroWarning,
          stacklevel=5)

  def _log_step(self, step: int, metrics: dict, throughput: monitor_lib.Throughput | None) -> None:
    lr = float(metrics["lr"])
    line = (f"step {step}: loss {float(metrics['loss']):.4f} | grad_norm "
            f"{float(metrics['grad_norm']):.3f}{'' if np.isnan(lr) else f' | lr {lr:.3e}'} | "
            f"loss_scale {float(metrics['loss_scale']):g}"
            f"{' | overflow: step skipped' if bool(metrics['overflow']) else ''}")
    if self.config.wall_clock_breakdown and self.timings:
      t = self.timings[-1]
      line += (f" | time (ms) fwd+bwd {t.forward_backward_s * 1e3:.1f} | optimizer "
               f"{t.optimizer_s * 1e3:.1f} | total {t.total_s * 1e3:.1f}")
    if throughput is not None:
      rate = throughput.tokens_per_second
      line += (f" | {rate:,.0f} tokens/s" if rate is not None
               else f" | {throughput.samples_per_second:,.1f} samples/s")
      line += "" if throughput.mfu is None else f" | MFU {throughput.mfu:.1%}"
    logger.info(line)


def abstract_arguments(tree: Any) -> Any:
  """``tree``'s arrays as ShapeDtypeStructs with their shardings: what lowers a jitted step again
  after its arguments were donated."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                     sharding=getattr(x, "sharding", None)), tree)
