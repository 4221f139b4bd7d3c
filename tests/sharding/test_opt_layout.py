"""Where an optimizer's state lives and what its update sees (:mod:`jzero.sharding.opt_layout`):
the state's layout from the transformation's own init, device-free (a plan of ShapeDtypeStructs),
and the whole view's conversions on 8 simulated devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jzero.sharding.mesh import MeshSpec
from jzero.sharding.opt_layout import OptLayout, View
from jzero.sharding.planner import Dtypes, Layout, make_plan

S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731


@pytest.fixture(scope="module")
def plan():
  mesh = MeshSpec.default().build()
  shapes = {"w": S(36, 20), "rows": S(64, 4096), "b": S(20), "scale": S()}
  return make_plan(shapes, Layout(stage=3, mesh=mesh, persistence_threshold=0),
                   Dtypes(jnp.float32))


def test_an_elementwise_optimizer_keeps_the_partition_view(plan):
  opt = OptLayout.of(plan, optax.adamw(1e-3))
  assert opt.view is View.PARTITION
  twins = {l.path: l.twin.path for l in opt.leaves if l.twin is not None}
  assert twins == {f"0/{m}/{p}": p for m in ("mu", "nu") for p in ("b", "rows", "scale", "w")}
  assert opt.specs()[0].mu["w"] == plan.state_spec(plan.leaves["w"])
  assert opt.specs()[0].count == P()


def test_factored_statistics_are_split_or_kept_whole(plan):
  """adafactor: the factored rows of the 64 x 4096 leaf (4096 >= SPLIT_MIN_NUMEL, divisible by 8)
  are split, the small ones kept whole; the whole view; the twin v of the unfactored leaves."""
  opt = OptLayout.of(plan, optax.adafactor(1e-3, min_dim_size_to_factor=8))
  assert opt.view is View.WHOLE
  leaves = {l.path: l for l in opt.leaves}
  v_col = leaves["0/v_col/rows"]
  assert v_col.twin is None and v_col.shape == (4096,) and v_col.split_dim == 0
  assert leaves["0/v_row/w"].twin is None and leaves["0/v_row/w"].split_dim is None
  assert leaves["0/v/b"].twin.path == "b"
  per_device = opt.bytes_per_device()
  assert per_device["partitioned"] > 0 and 0 < per_device["replicated"] < 4096 * 4


def test_multi_transform_labels_see_the_parameter_tree(plan):
  seen = []

  def labels(params):
    seen.append(params)
    return {k: "frozen" if k == "rows" else "train" for k in params}
  OptLayout.of(plan, optax.multi_transform(
      {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels))
  assert seen and all(set(p) == {"w", "rows", "b", "scale"} for p in seen)


def test_the_whole_view_cuts_the_padding_and_restores_it(plan):
  """Twins and masters cut to their logical shapes and padded back with zeros, on their
  shardings, inside a jit."""
  opt = OptLayout.of(plan, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
  master = plan.map(lambda l: jnp.arange(np.prod(plan.state_shape(l)), dtype=jnp.float32)
                    .reshape(plan.state_shape(l)))
  master = jax.device_put(master, plan.shardings(plan.state_specs()))

  def roundtrip(m):
    view = opt.params_to_view(m)
    return view, opt.params_from_view(view)
  view, back = jax.jit(roundtrip)(master)
  assert view["w"].shape == (36, 20) and back["w"].shape == plan.state_shape(plan.leaves["w"])
  w = np.asarray(back["w"])
  np.testing.assert_array_equal(w[:, :20] if w.shape[1] > 20 else w[:36], np.asarray(view["w"]))
  assert back["w"].sharding.is_equivalent_to(plan.sharding(plan.state_spec(plan.leaves["w"])), 2)
