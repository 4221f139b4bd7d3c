"""Exceptions and warnings jzero raises.

Every error jzero raises for bad input is a :class:`JZeroError` whose message is one paragraph:
what is wrong, which key / file / leaf it is, and how to fix it. They are raised before any device
work starts, so a user never sees a traceback from inside JAX for a mistake in their input.
"""

from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["JZeroError", "ConfigError", "NotSupportedError", "MeshError", "CheckpointError",
           "DataError", "Preempted", "StepNotCommitted", "JZeroWarning", "refuse_deepspeed_call",
           "describe_io_error"]


class JZeroError(Exception):
  """Base class of all jzero errors."""


class ConfigError(JZeroError, ValueError):
  """A DeepSpeed-style config (or an argument that stands in for one) is invalid."""


class NotSupportedError(ConfigError):
  """A valid DeepSpeed setting that jzero does not implement (yet); the message names the key."""


class MeshError(ConfigError):
  """A mesh file or mesh description does not fit the devices present."""


class CheckpointError(JZeroError):
  """A checkpoint is missing, corrupt, incomplete or does not match the model."""


class DataError(JZeroError, ValueError):
  """Training data cannot be read or is too small for the requested batch."""


class Preempted(JZeroError):
  """The job was preempted (SIGTERM) and the script does not poll for it: every process stopped
  after the same step, ``step``, and saved it in ``directory`` (None: the script had saved
  nowhere, so nothing was saved). Raised by ``train_step`` after the save is complete; a script
  that catches it can exit as it likes, one that does not ends with its message."""

  def __init__(self, message: str, *, step: int, directory: str | None):
    super().__init__(message)
    self.step, self.directory = step, directory


class StepNotCommitted(JZeroError):
  """A step was computed but a tier could not write its share of it (the NVMe store's disk full,
  an I/O error). Nothing committed is lost: the tier still holds the previous step, ``committed``
  (``path``: where), and this error holds the computed step. Fix the cause (free space) and call
  :meth:`finish`, which writes the step and returns ``(state, metrics)`` as ``train_step`` would
  have -- or raises this error again if the write fails again. The state given to ``train_step``
  was donated to the step; the one :meth:`finish` returns is the one to train on."""

  def __init__(self, message: str, *, step: int, committed: int | None, path: str,
               finish: Callable[[], tuple[Any, dict]]):
    super().__init__(message)
    self.step, self.committed, self.path = step, committed, path
    self._finish = finish

  def finish(self) -> tuple[Any, dict]:
    """Writes the step (after the cause is fixed) and returns ``(state, metrics)``."""
    return self._finish()


class JZeroWarning(UserWarning):
  """A setting jzero accepts but handles differently from DeepSpeed (the message says how)."""


_TRAIN_STEP_HINT = (
    "{call}: jzero's engine has no separate forward, backward and step (DeepSpeed's "
    "loss = engine(batch); engine.backward(loss); engine.step()). One compiled call does all "
    "three on the state it returns: state, metrics = engine.train_step(state, batch) "
    "(metrics['loss'] is the loss; engine.eval_loss(state, batch) evaluates without an update).")


def refuse_deepspeed_call(call: str) -> Callable[..., Any]:
  """A method that refuses DeepSpeed's ``call`` (``engine(batch)``, ``engine.backward(loss)``,
  ``engine.step()``) with what jzero does instead."""
  def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise JZeroError(_TRAIN_STEP_HINT.format(call=call))
  return refuse


# the codes tensorstore puts first in its ValueError's message for a failed file operation
_IO_CODES = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "DATA_LOSS", "UNKNOWN", "INTERNAL",
             "UNAVAILABLE", "FAILED_PRECONDITION", "NOT_FOUND", "ABORTED", "DEADLINE_EXCEEDED")


def describe_io_error(error: BaseException) -> str | None:
  """The cause, in a line, when ``error`` is a file operation's failure (an OSError, or
  tensorstore's ValueError with an error code: a full disk, an I/O error, a file that vanished);
  None for anything else (a bug is not reported as a disk's fault)."""
  if isinstance(error, OSError):
    where = f" ({error.filename})" if error.filename else ""
    return f"{error.strerror or error}{where}"
  text = str(error)
  if isinstance(error, ValueError) and text.startswith(_IO_CODES):
    reason = re.search(r"(No space left on device|Read-only file system|Input/output error|"
                       r"Permission denied|Disk quota exceeded|No such file or directory)", text)
    path = re.search(r'"([^"]+)"', text)
    if reason:
      return f"{reason[1]}" + (f" ({path[1]})" if path else "")
    return text.splitlines()[0][:300]
  return None
