"""Memory and communication you can see: the estimator, the measured report, the compiled HLO.

* :mod:`jzero.analysis.estimate` -- ZeRO's arithmetic per stage and tier (``jzero estimate``).
* :mod:`jzero.analysis.memory_report` -- live bytes per device and tier next to the estimate.
* :mod:`jzero.analysis.hlo` -- collectives, bytes and matmul FLOPs read from the compiled HLO;
  step timings.
* :mod:`jzero.analysis.flops` -- a compiled step's FLOPs and the peak MFU divides them by.
* :mod:`jzero.analysis.tables` -- text / HTML tables and plots the reports share.
"""

__all__: list[str] = []
