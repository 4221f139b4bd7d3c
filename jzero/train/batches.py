"""Batches on their way into an engine's steps: checked before any device work
(:mod:`jzero.train.input_checks`) against what the engine's steps were built for, and placed on
the mesh -- the global batch, or each process's own rows assembled across processes
(:meth:`Batches.shard`). :class:`Batches` remembers the first batch's structure and the shapes the
steps were built for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from jzero.errors import DataError
from jzero.runtime.data import local_rows
from jzero.sharding.mesh import ZeroMesh
from jzero.train import input_checks

__all__ = ["Batches"]

PyTree = Any


@dataclasses.dataclass
class Batches:
  """An engine's batch sizes (``config``: the resolved Config) and what its steps were built for.

  ``trace_loss(batch)``: traces the loss abstractly on ``batch``'s shapes (None before the engine
  has a plan): a batch of new trailing shapes is checked against the model with it."""

  config: Any
  mesh: ZeroMesh
  _structure: Any = None  # the steps are built for the first batch's structure
  _shapes: list = dataclasses.field(default_factory=list)  # ... and these trailing shapes

  @property
  def global_size(self) -> int:
    return self.config.train_batch_size

  def check(self, batch: PyTree, trace_loss: Callable[[PyTree], Any] | None) -> None:
    """A global batch of arrays of the first batch's structure and ``train_batch_size`` rows,
    of shapes the model takes."""
    input_checks.check_arrays(batch)
    if self._structure is None:
      self._structure = jax.tree.structure(batch)
    input_checks.check_batch(batch, self._structure, self.global_size,
                             self.config.train_micro_batch_size_per_gpu,
                             self.config.gradient_accumulation_steps, self.mesh.dp_size)
    self.check_shapes(batch, trace_loss)

  def check_shapes(self, batch: PyTree, trace_loss: Callable[[PyTree], Any] | None) -> None:
    if trace_loss is not None:  # shapes the model cannot take (input_checks.check_new_shapes)
      input_checks.check_new_shapes(batch, self._shapes, trace_loss)

  def check_eval(self, batch: PyTree, trace_loss: Callable[[PyTree], Any] | None) -> None:
    """An eval batch: arrays whose leading dimension is a multiple of the data-parallel size."""
    input_checks.check_arrays(batch)
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
      if not np.shape(x) or np.shape(x)[0] % self.mesh.dp_size:
        raise DataError(f"eval batch leaf {jax.tree_util.keystr(path) or 'batch'} has shape "
                        f"{tuple(np.shape(x))}; its leading dimension must be a multiple of the "
                        f"data-parallel size {self.mesh.dp_size}.")
    self.check_shapes(batch, trace_loss)

  def local_rows(self) -> np.ndarray:
    """The rows of the global batch this process's devices hold, ascending."""
    return local_rows(self.mesh.sharding(self.mesh.batch_spec()), self.global_size)

  def shard(self, batch: PyTree, sharding: Callable[[], jax.sharding.Sharding],
            process_local: bool | None, trace_loss: Callable[[PyTree], Any] | None,
            id_plan: Any = None) -> PyTree:
    """``batch`` (the global batch, or this process's rows; None: told apart by the leading
    dimension) placed by ``sharding()``, asked once the batch passed its checks (see
    :meth:`jzero.Engine.shard_batch`); ``id_plan``: the plan whose embedding tables bound the
    batch's integer ids (:func:`jzero.train.input_checks.check_input_ids`; None: not checked)."""
    input_checks.check_arrays(batch)
    if id_plan is not None:
      input_checks.check_input_ids(id_plan, batch)
    lead = {np.shape(x)[0] if np.shape(x) else None for x in jax.tree.leaves(batch)}
    if process_local is None:
      process_local = jax.process_count() > 1 and lead != {self.global_size}
    if not process_local:
      self.check(batch, trace_loss)
      return jax.device_put(batch, sharding())
    n_local = len(self.local_rows())
    if lead != {n_local}:
      raise DataError(
          f"batch leaves have leading dimensions {sorted(lead, key=str)}; give either the global "
          f"batch (train_batch_size = {self.global_size} rows: micro "
          f"{self.config.train_micro_batch_size_per_gpu} x gas "
          f"{self.config.gradient_accumulation_steps} x data-parallel size {self.mesh.dp_size}) "
          f"or this process's part of it, which must have {n_local} rows (the rows "
          f"engine.local_rows() names: `batch[engine.local_rows()]`).")
    shape = lambda x: (self.global_size,) + np.shape(x)[1:]
    self.check(jax.tree.map(lambda x: np.broadcast_to(np.zeros((), np.asarray(x).dtype),
                                                      shape(x)), batch), trace_loss)
    placed = sharding()
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        placed, np.asarray(x), shape(x)), batch)
