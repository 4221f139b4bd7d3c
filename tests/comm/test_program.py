"""comm/program.py: the XLA options a program is compiled with."""

import jax
import pytest

from jzero.comm import program
from jzero.errors import JZeroWarning


def test_an_option_the_compiler_does_not_know_is_dropped_and_named():
  # jax 0.11's GPU compiler no longer knows xla_gpu_enable_pipelined_all_gather: a compile that
  # passes it fails ("No such compile option"). jzero keeps the options the compiler knows and
  # says which one it dropped.
  gone = "xla_gpu_option_no_release_has"
  kept = "xla_gpu_enable_latency_hiding_scheduler"
  with pytest.warns(JZeroWarning, match=gone):
    known = program._known_options(jax.devices()[0], ((kept, True), (gone, True)))
  assert known == {kept}


def test_options_the_compiler_knows_all_survive():
  options = (("xla_gpu_enable_latency_hiding_scheduler", True),
             ("xla_gpu_all_gather_combine_threshold_bytes", 50_000_000),
             ("xla_gpu_reduce_scatter_combine_threshold_bytes", 62_500_000))
  assert program._known_options(jax.devices()[0], options) == {n for n, _ in options}
