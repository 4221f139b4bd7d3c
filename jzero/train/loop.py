"""The resumable training loop: :func:`~jzero.train.loop.train_loop`, what ``jzero train`` runs, for any model.

A loop over optimizer steps ``start + 1 .. steps`` with what a long job needs around
:meth:`jzero.Engine.train_step`: a progress bar (on a terminal or in a notebook; written to a log
file or a pipe it would add two lines a step, so there only the engine's loss line every
``steps_per_print`` steps is printed), asynchronous checkpoints at the end and every
``save_every`` steps (keeping the last ``keep``), each step's loss appended to a file, an fp16 run
stopped when the loss scale can back off no further (DeepSpeed stops there too), and preemption:
when any process gets SIGTERM every process stops after the same step
(:meth:`jzero.Engine.reached_preemption`), saves it and returns, so running the same command
again resumes (:func:`init_or_resume`). The result says how fast the steps ran
(:class:`~jzero.train.monitor.Throughput`: tokens/s, samples/s and model FLOPs utilization, from the
median step after the first); the config's monitors get every step from the engine.

::

  state, start = init_or_resume(engine, jax.random.key(0), "ckpt")
  result = train_loop(engine, state, lambda step: engine.shard_batch(my_batch(step)),
                      steps=1000, start=start, checkpoint_dir="ckpt", save_every=100)
  sys.exit(result.exit_status)
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax

from jzero import checkpoint
from jzero.errors import JZeroError
from jzero.runtime import distributed
from jzero.train.engine import Engine
from jzero.train.monitor import Throughput
from jzero.train.precision import MIN_SCALE_ERROR
from jzero.train.state import TrainState

__all__ = ["LoopResult", "init_or_resume", "train_loop"]

PREEMPTED_UNSAVED = 143  # SIGTERM's status: stopped with nowhere to save


@dataclasses.dataclass
class LoopResult:
  """What :func:`train_loop` did.

  Attributes:
    state: the last state (after the last step taken).
    start: the step the loop started from.
    losses: each step's loss, in order.
    step_times: each step's wall time in seconds (the first includes compiling).
    throughput: what the median step after the first (the only one, if one) makes per second:
      tokens (with ``initialize(tokens_per_sample=...)``), samples, model FLOPs utilization and the
      peak it is measured against (:meth:`Engine.throughput`); None when no step ran.
    preempted: the loop stopped early for SIGTERM (saved when ``checkpoint_dir`` was given).
    exit_status: 0, or 143 when preempted with no ``checkpoint_dir`` to save to.
  """

  state: TrainState
  start: int
  losses: list[float]
  step_times: list[float]
  throughput: Throughput | None = None
  preempted: bool = False
  exit_status: int = 0


def _interactive(stream: Any) -> bool:
  """A terminal, or a Jupyter kernel's output (where tqdm.auto draws a widget, as tqdm tells a
  kernel); not a log file or a pipe."""
  if stream.isatty():
    return True
  ipython = sys.modules.get("IPython")
  shell = ipython.get_ipython() if ipython is not None else None
  return shell is not None and "IPKernelApp" in shell.config


def init_or_resume(engine: Engine, rng: jax.Array, checkpoint_dir: str | Path | None = None, *,
                   require: bool = False) -> tuple[TrainState, int]:
  """A fresh state (:meth:`Engine.init`), or the latest checkpoint in ``checkpoint_dir`` when
  there is one; returns ``(state, step it is at)``.

  The directory is claimed for this run first (:func:`jzero.checkpoint.writer`): one that another
  run saves into, or that cannot be written, is refused before any device work.

  Raises:
    JZeroError: ``require`` and no checkpoint to resume from.
    CheckpointError: ``checkpoint_dir`` in use by another run, or not writable.
  """
  if checkpoint_dir:
    checkpoint.writer(checkpoint_dir)
  latest = checkpoint.latest_step(checkpoint_dir) if checkpoint_dir else None
  if require and latest is None:
    raise JZeroError(f"--resume: no checkpoint in --checkpoint-dir {checkpoint_dir!r} to "
                     f"resume from.")
  state = engine.init(rng)
  if latest is None:
    return state, 0
  state = engine.load_checkpoint(checkpoint_dir)
  return state, int(state.step)


def train_loop(engine: Engine, state: TrainState, batch_at: Callable[[int], Any], steps: int, *,
               start: int = 0, checkpoint_dir: str | Path | None = None, save_every: int = 0,
               keep: int | None = None, losses_file: str | Path | None = None,
               progress: bool = True,
               on_step: Callable[[int, dict], None] | None = None) -> LoopResult:
  """Trains from step ``start`` to ``steps``; see the module docstring.

  Args:
    engine: the engine; ``state`` its train state at step ``start``.
    batch_at: step index (0-based) -> the sharded global batch of that step
      (:meth:`Engine.shard_batch`).
    steps: the step to stop after.
    checkpoint_dir: save here after the last step, every ``save_every`` steps and when preempted.
    keep: keep only the last ``keep`` checkpoints.
    losses_file: append ``STEP LOSS`` lines (process 0) at full precision.
    progress: show a progress bar (process 0; a widget under Jupyter) when stderr is a terminal
      or a notebook's.
    on_step: called with (step number, metrics) after each step.

  Raises:
    JZeroError: fp16 overflowed with the loss scale at its minimum.
  """
  from tqdm.auto import tqdm  # noqa: PLC0415 (a notebook widget or text: chosen at call time)
  from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: PLC0415

  primary = jax.process_index() == 0
  result = LoopResult(state=state, start=start, losses=[], step_times=[])
  bar = tqdm(range(start, steps), desc="train", unit="step", dynamic_ncols=True, initial=start,
             total=steps, disable=not (progress and primary and _interactive(sys.stderr)))
  with logging_redirect_tqdm(loggers=[logging.getLogger("jzero")]):
    for step in bar:
      batch = batch_at(step)
      t0 = time.perf_counter()
      with distributed.explained_peer_loss():  # a peer lost shows when the loss is read, too
        result.state, metrics = engine.train_step(result.state, batch)  # logs every steps_per_print
        loss = float(metrics["loss"])  # waits for the step
      result.step_times.append(time.perf_counter() - t0)
      if bool(metrics["min_scale_overflow"]):
        raise JZeroError(f"step {step + 1}: {MIN_SCALE_ERROR} (fp16 overflow with the loss scale "
                         f"at min_loss_scale; DeepSpeed stops here too)")
      result.losses.append(loss)
      if losses_file and primary:
        with open(losses_file, "a") as f:
          f.write(f"{step + 1} {loss!r}\n")
      bar.set_postfix(loss=f"{loss:.3f}", lr=f"{float(metrics['lr']):.2e}")
      if on_step is not None:
        on_step(step + 1, metrics)
      saved = checkpoint_dir and (step + 1 == steps or (save_every and (step + 1) % save_every == 0))
      if saved:
        engine.save_checkpoint(result.state, checkpoint_dir, keep=keep)  # async
      if step + 1 < steps and engine.reached_preemption(step + 1):  # SIGTERM: all stop here
        bar.close()
        result.preempted = True
        if not checkpoint_dir:
          print(f"jzero: process {jax.process_index()}: stopped by SIGTERM after step {step + 1}; "
                f"nothing saved (no --checkpoint-dir)", file=sys.stderr)
          result.exit_status = PREEMPTED_UNSAVED
          return _with_throughput(engine, result)
        if not saved:
          engine.save_checkpoint(result.state, checkpoint_dir, keep=keep)
        engine.wait_for_checkpoints()
        if primary:
          print(f"jzero: preempted (SIGTERM): every process stopped after step {step + 1}; "
                f"checkpoint at step {checkpoint.latest_step(checkpoint_dir)} in "
                f"{checkpoint_dir}; run the same command again to resume")
        return _with_throughput(engine, result)
  bar.close()
  if checkpoint_dir:
    engine.wait_for_checkpoints()
  return _with_throughput(engine, result)


def _with_throughput(engine: Engine, result: LoopResult) -> LoopResult:
  if result.step_times:
    steady = result.step_times[1:] or result.step_times
    result.throughput = engine.throughput(statistics.median(steady))
  return result
