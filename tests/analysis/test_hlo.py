"""analysis/hlo.py: what the cost model reads from an optimized HLO module."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jzero.analysis.hlo import memory_traffic

N = 1 << 16  # float32 elements: 256 KiB


def _hlo(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def test_elementwise_work_reads_and_writes_its_bytes_once():
  # one fusion: x in, the result out
  assert memory_traffic(_hlo(lambda x: jnp.tanh(x * 2 + 1), jnp.ones(N))) == 2 * 4 * N


def test_loop_bodies_count_once_per_trip():
  def scanned(layers):
    return lambda x: lax.scan(lambda h, _: (jnp.tanh(h * 1.5 + 0.5), None), x, None,
                              length=layers)[0]

  four, eight = (memory_traffic(_hlo(scanned(k), jnp.ones(N))) for k in (4, 8))
  # four more trips of a body that reads and writes N floats (plus the loop counter's bytes)
  assert (eight - four) / 4 == pytest.approx(2 * 4 * N, rel=1e-3)


def test_matmuls_are_left_to_the_flops():
  assert memory_traffic(_hlo(lambda a, b: a @ b, jnp.ones((256, 256)), jnp.ones((256, 256)))) == 0
