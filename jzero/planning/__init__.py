"""Plans for hardware you may not have: the real step compiled for a GPU topology, and the search
for the config that runs a job fastest there.

* :mod:`jzero.planning.aot` -- the step compiled for a GPU topology that is not present
  (``jzero aot``; GPU target configs in ``gpu_specs/``), with the scheduler's memory limit a run
  has; :mod:`~jzero.planning.overlap` resolves ``stage3_max_live_parameters: "auto"`` and
  advises the knobs that raise the overlap; :mod:`~jzero.planning.loop_overlap` splits it by
  place (inside the gradient-accumulation loop or outside) and kind.
* :mod:`jzero.planning.search` -- ``jzero plan``: candidates priced by arithmetic
  (:mod:`~jzero.planning.candidates`), compiled in order of predicted time until one is proven to
  fit (:mod:`~jzero.planning.compiled`),
  ranked by the cost model (:mod:`~jzero.planning.cost`), reported by
  :mod:`~jzero.planning.plan_report`. :func:`plan_for` is its Python entry point; it lives here,
  not in ``jzero.analysis``, because it builds engines and ``analysis`` sits below ``train``.
"""

from jzero.planning.search import Plan, plan_for

__all__ = ["Plan", "plan_for"]
