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


def test_a_layer_scan_touches_one_layer_of_its_stacked_buffers_per_trip():
  # a scan that keeps each layer's activation (ys, stacked [layers, N]) and reads stacked weights:
  # each trip reads one row of ws and writes one row of ys -- the cost of a trip must not grow with
  # the number of layers (counted whole, a 16-layer trip would cost about 4 x a 4-layer one)
  def per_trip(layers):
    def f(ws, x):
      return lax.scan(lambda h, w: (jnp.tanh(h * w), h), x, ws)
    a, b = (memory_traffic(_hlo(f, jnp.ones((k, N)), jnp.ones(N))) for k in (layers, 2 * layers))
    return (b - a) / layers

  assert per_trip(16) == pytest.approx(per_trip(4), rel=0.02)
