"""The programs an engine builds for its plan, each once: :class:`Programs`.

An engine's plan fixes what its programs compute with (:class:`jzero.train.step.StepParts`) and
the train state's layout (PartitionSpecs and memory kinds, :mod:`jzero.train.state`). For that
plan :class:`Programs` holds the fused step of every step variant asked for
(:func:`jzero.train.step.build_step`; the variant is the delayed update's, written in the state:
:class:`jzero.tiers.delayed.Variant`, None without it), the two-jit step ``wall_clock_breakdown``
times, the evaluation, the hpZ refresh of the secondary partitions, and the stage-3 gathered groups
as the model runs. A new plan gets new programs; nothing here reads or writes the engine.
"""

from __future__ import annotations

from typing import Any, Hashable

from jzero.comm import layouts
from jzero.train import step as step_lib
from jzero.train import state as state_lib
from jzero.train.state import TrainState

__all__ = ["Programs"]

PyTree = Any


class Programs:
  """The jitted programs of one plan (see the module docstring)."""

  def __init__(self, parts: step_lib.StepParts):
    self.parts = parts
    self._fused: dict[Hashable, Any] = {}
    self._split: dict[Hashable, tuple[Any, Any]] = {}
    self._eval = self._refresh = None
    self._gathered: tuple[int, ...] | None = None

  def specs(self, variant: Any = None) -> TrainState:
    """PartitionSpecs of the train state (with the delayed update's carried state, for the step
    of ``variant``)."""
    parts = self.parts
    return state_lib.state_specs(parts.plan, parts.opt, parts.delayed, variant)

  def kinds(self, variant: Any = None) -> TrainState:
    """Memory kinds of the train state (as :meth:`specs`)."""
    parts = self.parts
    return state_lib.state_memory_kinds(parts.plan, parts.opt, parts.delayed, variant)

  def has(self, variant: Any, fused: bool = True) -> bool:
    """The step of ``variant`` is built (in one jit, or as two with ``fused=False``)."""
    return variant in (self._fused if fused else self._split)

  def fused(self, batch: PyTree, variant: Any = None) -> Any:
    """The jitted step ``(state, batch) -> (state, metrics, outputs)`` of ``variant``."""
    if variant not in self._fused:
      self._fused[variant] = step_lib.build_step(self.parts, self.specs(variant),
                                                 self.kinds(variant), batch)
    return self._fused[variant]

  def split(self, batch: PyTree, variant: Any = None) -> tuple[Any, Any]:
    """The step of ``variant`` as two jits, ``(state, batch) -> grads`` and ``(state, *grads)
    -> (state, metrics, outputs)``."""
    if variant not in self._split:
      self._split[variant] = step_lib.build_split_step(self.parts, self.specs(variant),
                                                       self.kinds(variant), batch)
    return self._split[variant]

  @property
  def variants(self) -> tuple:
    """The variants of the fused steps built so far."""
    return tuple(self._fused)

  def gathered(self, state: Any = None, batch: PyTree = None) -> tuple[int, ...] | None:
    """The groups stage 3 gathers at once as the model runs
    (:func:`jzero.train.step.gathered_groups`), measured from ``state`` and ``batch`` the first
    time both are given, then kept; None before."""
    if self._gathered is None and state is not None and batch is not None:
      variant = getattr(getattr(state, "delayed", None), "variant", None)
      self._gathered = step_lib.gathered_groups(self.parts, self.specs(variant), state, batch)
    return self._gathered

  def evaluate(self) -> Any:
    """``(params, secondary, model_state, batch) -> (mean loss, mean aux)``
    (:func:`jzero.train.step.build_eval`)."""
    if self._eval is None:
      self._eval = step_lib.build_eval(self.parts)
    return self._eval

  def refresh(self) -> Any:
    """``params -> secondary``: hpZ's secondary partitions, by the code the step refreshes them
    with (:func:`jzero.comm.layouts.refresh_program`)."""
    if self._refresh is None:
      self._refresh = layouts.refresh_program(self.parts.plan)
    return self._refresh
