"""The state outside a step: :class:`StateIO`, the part of :class:`jzero.Engine` that reads a
train state back (its parameters, the arrays tiers hold outside it, the memory report), saves and
restores checkpoints (:mod:`jzero.checkpoint`), and brings states and weights in from DeepSpeed,
plain Flax + optax runs and weight files -- each a call of a :mod:`jzero.checkpoint` or
:mod:`jzero.analysis` function handed the plan, the state and the resources, never the engine. A
state made here is the engine's next (:meth:`jzero.train.step_runner.StepRunner.start`: its step
count and learning rate are the restored ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jzero import checkpoint
from jzero.analysis import memory_report as memory_report_lib
from jzero.tiers import registry
from jzero.train import state as state_lib
from jzero.train.state import TrainState

__all__ = ["StateIO"]

PyTree = Any


class StateIO:
  """The engine's methods on states outside a step (module docstring); :class:`jzero.Engine`
  has them."""

  # -- the state read back, with what the tiers hold outside it -----------------------------------
  def logical_params(self, state: TrainState, dtype: Any = jnp.float32) -> PyTree:
    """Parameters in the model's own shapes (padding removed), replicated, in ``dtype``: the fp32
    master in mixed precision, the params themselves in fp32."""
    self.check_live(state, "logical_params")
    return state_lib.logical_params(self._require_plan(), self.full_state(state), dtype)

  def full_state(self, state: TrainState) -> TrainState:
    """``state`` with the arrays the tiers hold outside it read in (the NVMe store's masters,
    optimizer state and params, laid out by the plan): what checkpoints save."""
    plan = self._require_plan()
    return registry.full_state(self.tiers, plan, self._open(), state)

  # -- checkpoints (jzero.checkpoint) -------------------------------------------------------------
  def save_checkpoint(self, state: TrainState, directory: str | Path | None = None,
                      tag: str | int | None = None, *, client_state: dict | None = None,
                      keep: int | None = None, save_latest: bool = True) -> str:
    """DeepSpeed's ``save_checkpoint(save_dir, tag, client_state, save_latest)`` with the state
    passed first: an asynchronous sharded save of ``state`` as ``directory/<tag>`` (default tag:
    its step); returns the tag (:func:`jzero.checkpoint.save_checkpoint`)."""
    if hasattr(state, "opt_state"):  # (a DeepSpeed-style call is refused by the checkpoint)
      self.check_live(state, "save_checkpoint")
    tag = checkpoint.save_checkpoint(self.plan, state, self.resources, directory, tag,
                                     config=self.config, tx=self.tx, keep=keep,
                                     client_state=client_state, save_latest=save_latest)
    self.runner.preemption.saved = (Path(directory), int(tag) if str(tag).isdigit() else None)
    return tag

  def load_checkpoint(self, directory: str | Path, tag: str | int | None = None, *,
                      params_only: bool = False, sample_batch: Any = None,
                      with_client_state: bool = False) -> Any:
    """A checkpoint of any stage / device count in this engine's placement: the TrainState, or
    ``(state, client_state)`` (:func:`jzero.checkpoint.load_checkpoint`; the plan is made if
    the engine has none)."""
    target = self.abstract_state(sample_batch)
    out = checkpoint.load_checkpoint(self.plan, target, self._open(), directory, tag,
                                     config=self.config, tx=self.tx, scaler=self.scaler,
                                     delayed=self.delayed, params_only=params_only,
                                     with_client_state=with_client_state)
    state = self.runner.start(self.with_secondary(out[0] if with_client_state else out),
                              self.delayed)
    return (state, out[1]) if with_client_state else state

  def import_deepspeed(self, ds: Any, convert: Callable[[dict], PyTree], *,
                       rng: jax.Array | None = None, sample_batch: Any = None) -> TrainState:
    """A DeepSpeed run's checkpoint ``ds`` continued in this engine's plan
    (:func:`jzero.checkpoint.import_deepspeed`)."""
    target = self.abstract_state(sample_batch)
    state = checkpoint.import_deepspeed(
        self.plan, target, self._open(), ds, convert, model=self.model, config=self.config,
        tx=self.tx, scaler=self.scaler, delayed=self.delayed, rng=rng, sample_batch=sample_batch)
    return self.runner.start(self.with_secondary(state), self.delayed)

  def import_optax(self, params: PyTree, opt_state: PyTree, *, step: int | None = None,
                   rng: jax.Array | None = None, sample_batch: Any = None,
                   **collections: PyTree) -> TrainState:
    """A plain Flax + optax run continued in this engine's plan, at any stage and device count:
    its parameters and optax state (matched to ``engine.tx``'s up to stateless stages), laid out
    and sharded by the plan (:func:`jzero.checkpoint.import_optax`). Its Orbax checkpoint:
    ``engine.import_optax(**checkpoint.read_optax(directory))``."""
    target = self.abstract_state(sample_batch)
    state = checkpoint.import_optax(
        self.plan, target, self._open(), params, opt_state, model=self.model, tx=self.tx,
        scaler=self.scaler, delayed=self.delayed, step=step, rng=rng, sample_batch=sample_batch,
        **collections)
    return self.runner.start(self.with_secondary(state), self.delayed)

  def load_weights(self, path: str | Path, *, sample_batch: Any = None) -> PyTree:
    """Plain weights (safetensors, a Hugging Face index, a params-only Orbax checkpoint) as a
    params tree for :meth:`init`'s ``params=``, placed by the plan, each process reading only what
    its devices hold (:func:`jzero.checkpoint.load_weights`; the plan is made if needed)."""
    return checkpoint.load_weights(self.make_plan(sample_batch), self.model, path,
                                   sample_batch=sample_batch)

  def load_model_state(self, path: str | Path, *, sample_batch: Any = None) -> dict:
    """The model state (BatchNorm's statistics) of plain weights that hold it, for :meth:`init`'s
    ``model_state=`` (:func:`jzero.checkpoint.load_model_state`)."""
    return checkpoint.load_model_state(self.model, path, sample_batch=sample_batch)

  def wait_for_checkpoints(self) -> None:
    """Blocks until every pending save is finalized (``latest`` moved)."""
    checkpoint.wait_until_finished()

  def memory_report(self, state: TrainState, batch: PyTree = None):
    """Measured per-device bytes next to the estimator's prediction
    (:mod:`jzero.analysis.memory_report`)."""
    plan = self._require_plan()
    # compiled first: tracing the step tells the gathered working set as the model really runs
    compiled = self.compile_step(state, batch) if batch is not None else None
    return memory_report_lib.memory_report(plan, state, self._open(), config=self.config,
                                           tx=self.tx, compiled=compiled,
                                           gathered=self.gathered_working_set(state, batch))

  def bind(self, params: PyTree, model_state: PyTree = None) -> Any:
    """The user's model built from logical params (e.g. :meth:`logical_params`) and, for a model
    with state, ``model_state`` (``state.model_state``), for evaluation on the host: BatchNorm
    statistics of the batch it is called with are that batch's own."""
    return self.model.bind(params, model_state=model_state)

