"""Driving the jitted steps from the host: :class:`StepRunner`.

Per ``train_step`` call, on the host: the step count (read from the state once, then counted), the
step variant the delayed update asks for (:meth:`jzero.tiers.delayed.DelayedUpdate.variant`),
written into the state, the fused step -- or with ``wall_clock_breakdown`` the two timed jits -- of
that variant, the tiers' work after the jitted step
(:meth:`jzero.train.step.StepParts.run_after_step`), the report on it
(:class:`jzero.train.reporting.StepReporter`), and across processes the preemption save
(:class:`jzero.train.preemption.PreemptionWatch`). The engine owns one runner; the programs are its
argument.

A step that fails while it is traced -- nothing ran, the state is not donated -- on a batch the
model cannot take (float token ids) is a DataError naming the batch's leaves
(:func:`jzero.train.input_checks.explain_trace_error`). A step a tier could not write
(:class:`jzero.errors.StepNotCommitted`) is not counted: the step count is read again from the
state its ``finish()`` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from jzero.errors import JZeroError, StepNotCommitted
from jzero.train import input_checks, reporting
from jzero.train.step import trace_loss
from jzero.train.update import applied_updates
from jzero.train.preemption import PreemptionWatch
from jzero.train.programs import Programs

__all__ = ["StepRunner"]

PyTree = Any


@dataclasses.dataclass
class StepRunner:
  """An engine's host-side step driver (module docstring). ``step``: steps taken by the state the
  last call returned (None: read from the next state given)."""

  reporter: reporting.StepReporter
  preemption: PreemptionWatch = dataclasses.field(default_factory=PreemptionWatch)
  step: int | None = None

  @staticmethod
  def variant(delayed: Any, state: Any | None, step: int | None, fused: bool = True) -> Any:
    """The step variant the delayed update ``delayed`` asks for (None: the plain step; ``state``
    and ``step`` None: the steady step)."""
    return delayed.variant(state, step, fused) if delayed is not None else None

  def start(self, state: Any, delayed: Any) -> Any:
    """``state``, a state the engine just made or restored, as the next one: its step count and
    the updates it has applied (the lr the next step uses) read now, so that they are the
    state's before its first step."""
    self.step = int(state.step)
    self.reporter.resumed(_applied_updates(state, delayed))
    return state

  def run(self, programs: Programs, fused: bool, state: Any, batch: PyTree,
          memory_report: Callable[[Any], Any], save: Callable[[Any, Any], Any],
          wait: Callable[[], None]) -> tuple[Any, dict]:
    """One step of ``state`` on ``batch`` (in one jit, or the two timed ones when not
    ``fused``); ``memory_report(state)``, ``save(state, directory)`` and ``wait()``: the
    engine's, for the report and the preemption save."""
    parts, delayed = programs.parts, programs.parts.delayed
    if self.step is None:
      self.step = int(state.step)
    variant = self.variant(delayed, state, self.step, fused=fused)
    if delayed is not None:
      state = delayed.labelled(state, variant)
    built = programs.has(variant, fused)
    given = state
    try:
      if not fused:
        grads_fn, update_fn = programs.split(batch, variant)
        state, metrics = self.reporter.timed(("split", variant), not built, grads_fn, update_fn,
                                             parts.run_after_step, self.step + 1, state, batch)
      else:
        fn = programs.fused(batch, variant)
        lowering = lambda: [(fn, reporting.abstract_arguments((state, batch)))]
        self.reporter.running(("fused", variant), not built, lowering)
        state, metrics, outputs = fn(state, batch)
        state = parts.run_after_step(state, metrics, outputs)  # e.g. the NVMe store's update
    except StepNotCommitted:
      self.step = None  # the state its finish() returns is read at the next step
      raise
    except Exception as e:  # pylint: disable=broad-except  (explained or re-raised)
      if not built and not isinstance(e, JZeroError) and not any(
          getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(given)):
        # failed while the step was traced (nothing ran): a batch the model cannot take
        input_checks.explain_trace_error(programs.parts.plan, batch,
                                         lambda b: trace_loss(programs.parts, b), e)
      raise
    self.step += 1
    self.reporter.after_step(self.step, metrics, lambda: memory_report(state),
                             _applied_updates(state, delayed))
    if jax.process_count() > 1:  # a preemption the script does not poll for
      self.preemption.after_step(self.step, lambda d: save(state, d), wait)
    return state, metrics


def _applied_updates(state: Any, delayed: Any) -> Callable[[], int]:
  """Reads, when called, the updates ``state`` has applied (:func:`applied_updates`) from its
  counters on the host. Holds those scalars, not the state: the next step donates them, and the
  reporter is handed the next state's by then."""
  step, skipped = state.step, state.skipped
  ready = state.delayed.ready if delayed is not None else None
  return lambda: int(applied_updates(np.asarray(step), np.asarray(skipped), delayed,
                                     None if ready is None else np.asarray(ready)))
