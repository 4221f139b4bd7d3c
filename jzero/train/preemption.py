"""Preemption in a script that does not poll for it (several processes; see
:mod:`jzero.runtime.distributed`): :class:`PreemptionWatch`, which the engine asks after each step.

A script that calls ``engine.reached_preemption(step)`` after each step (as
:func:`jzero.train.loop.train_loop` does) decides itself when to save and stop. One that does not
still stops cleanly: the engine asks, with the step number every process shares; at the sync point
every process saves this step to the directory of the script's last ``save_checkpoint`` and raises
:class:`jzero.Preempted` once the save is complete -- or, with no such directory, raises it at
once, saying nothing was saved. The process is the script's to end: the engine never exits it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from jzero.errors import Preempted
from jzero.runtime import distributed

__all__ = ["PreemptionWatch"]


@dataclasses.dataclass
class PreemptionWatch:
  """The engine's side of preemption: the script's polls seen at the last step, and where the
  script last saved (``(directory, step)``, step None for a tag that is not a number)."""

  saved: tuple[Path, int | None] | None = None
  _polls_seen: int | None = None

  def after_step(self, step: int, save: Callable[[Path], None],
                 wait_for_saves: Callable[[], None]) -> None:
    """Raises :class:`jzero.Preempted` at the sync point of a preemption the script did not poll
    for since the last step, after ``save(directory)`` (unless step ``step`` is saved there
    already) and ``wait_for_saves()``."""
    previous, self._polls_seen = self._polls_seen, distributed.polls()
    if previous != self._polls_seen or not distributed.reached_sync_point(step):
      return  # the first step, a script that polls, or no preemption
    if self.saved is None:
      raise Preempted(
          f"preempted (SIGTERM) at step {step}; nothing saved: the script neither polls "
          f"engine.reached_preemption(step) nor has saved with engine.save_checkpoint, so jzero "
          f"had nowhere to save. Poll reached_preemption after each step and save when it is "
          f"true (jzero.train.loop.train_loop does).", step=step, directory=None)
    directory, saved_step = self.saved
    if saved_step != step:
      save(directory)
    wait_for_saves()
    raise Preempted(f"preempted (SIGTERM): every process stopped after step {step}, saved in "
                    f"{directory}; run the same command to resume from it.", step=step,
                    directory=str(directory))
