"""The programs an engine builds for its plan, each once: :class:`Programs`.

An engine's plan fixes what its programs compute with (:class:`jzero.train.step.StepParts`) and
the train state's layout (PartitionSpecs and memory kinds, :mod:`jzero.train.state`). For that
plan :class:`Programs` holds the layout, the fused step of every step variant asked for
(:func:`jzero.train.step.build_step`), the two-jit step ``wall_clock_breakdown`` times, the
evaluation, and the hpZ refresh of the secondary partitions. A new plan (a restore into another
layout) gets new programs; nothing here
reads or writes the engine.
"""

from __future__ import annotations

from typing import Any, Hashable

import jax

from jzero.comm import layouts, program
from jzero.train import step as step_lib
from jzero.train import state as state_lib
from jzero.train.state import TrainState

__all__ = ["Programs", "variant_key"]

PyTree = Any


def variant_key(variants: dict | None) -> tuple:
  """A step variant (name -> the variant, e.g. the delayed update's) as a hashable, ordered
  key."""
  return tuple(sorted((variants or {}).items()))


class Programs:
  """The jitted programs of one plan (see the module docstring)."""

  def __init__(self, parts: step_lib.StepParts):
    self.parts = parts
    # the train state's layout, with the delayed update's carried state when there is one
    self.specs: TrainState = state_lib.state_specs(parts.plan, parts.tx, parts.delayed)
    self.kinds: TrainState = state_lib.state_memory_kinds(parts.plan, parts.tx, parts.delayed)
    self._fused: dict[Hashable, step_lib.BuiltStep] = {}
    self._split: dict[Hashable, tuple[step_lib.BuiltStep, Any]] = {}
    self._eval = self._refresh = None

  def has(self, variants: dict, fused: bool = True) -> bool:
    """The step of ``variants`` is built (in one jit, or as two with ``fused=False``)."""
    return variant_key(variants) in (self._fused if fused else self._split)

  def fused(self, batch: PyTree, variants: dict) -> Any:
    """The jitted step ``(state, batch) -> (state, metrics, outputs)`` of ``variants``."""
    key = variant_key(variants)
    if key not in self._fused:
      self._fused[key] = step_lib.build_step(self.parts, self.specs, self.kinds, batch, variants)
    return self._fused[key].fn

  def split(self, batch: PyTree, variants: dict | None) -> tuple[Any, Any]:
    """The step of ``variants`` as two jits, ``(state, batch) -> grads`` and ``(state, *grads)
    -> (state, metrics, outputs)``."""
    key = variant_key(variants)
    if key not in self._split:
      self._split[key] = step_lib.build_split_step(self.parts, self.specs, self.kinds, batch,
                                                   variants)
    grads, update = self._split[key]
    return grads.fn, update

  @property
  def variants(self) -> tuple:
    """The variants of the fused steps built so far."""
    return tuple(self._fused)

  @property
  def traced_gathered(self) -> int | None:
    """The largest group stage 3 gathered at once in the step traced last (None: none traced)."""
    traces = [b.trace for b in (*self._fused.values(), *(s[0] for s in self._split.values()))]
    traced = [t.gathered for t in traces if t.gathered is not None]
    return max(traced[-1], default=0) if traced else None

  def evaluate(self) -> Any:
    """``(params, secondary, model_state, batch) -> (mean loss, mean aux)``
    (:func:`jzero.train.step.build_eval`)."""
    if self._eval is None:
      self._eval = step_lib.build_eval(self.parts)
    return self._eval

  def refresh(self) -> Any:
    """``params -> secondary``: hpZ's secondary partitions, by the code the step refreshes them
    with (no compile options: it is also traced inside ``eval_shape(init)``)."""
    if self._refresh is None:
      plan = self.parts.plan
      specs, out = plan.param_specs(), plan.secondary_specs()
      refresh = lambda p: plan.map(lambda l, x: layouts.secondary_partition(plan, l, x), p)
      self._refresh = jax.jit(program.shard_map(plan, refresh, (specs,), out),
                              in_shardings=(plan.shardings(specs),),
                              out_shardings=plan.shardings(out))
    return self._refresh
