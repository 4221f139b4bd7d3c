"""Processes, devices and data: joining a several-process job, the launcher, the data loader.

* :mod:`jzero.runtime.distributed` -- ``jax.distributed`` from flags, ``jzero launch``, SLURM, Open
  MPI or Kubernetes; preemption (SIGTERM) at a step every process agrees on.
* :mod:`jzero.runtime.launch` -- ``jzero launch`` (DeepSpeed's ``deepspeed`` launcher).
* :mod:`jzero.runtime.data` -- the data loader and the embedded corpus.
* :mod:`jzero.runtime.logs` -- where jzero's log goes: nowhere from the library, stdout from
  ``jzero.initialize`` and the ``jzero`` command.
* :mod:`jzero.runtime.quiet_start` -- where CUDA cannot run, JAX's CUDA plugin stays unloaded (a quiet
  start), until a GPU compile (``jzero aot``) loads its compiler.

Nothing here imports JAX at package import: ``jzero.runtime.quiet_start`` runs first.
"""

__all__: list[str] = []
