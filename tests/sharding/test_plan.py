"""The placement plan: shard dimensions, padding, persistence, specs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jzero.comm import program
from jzero.comm.program import CPU_OPTIONS
from jzero.sharding.mesh import MeshSpec
from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.planner import Dtypes, Layout, make_plan


def _abstract(**shapes):
  return {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}


@pytest.fixture(scope="module")
def mesh():
  return MeshSpec.default().build()


def _leaves(plan):
  return {l.path: l for l in plan.leaf_list()}


def test_shard_dim_first_divisible_else_least_padding(mesh):
  plan = make_plan(_abstract(a=(24, 5), b=(5, 16), c=(3, 5), d=(), s=(4, 10, 24)),
                   Layout(stage=1, mesh=mesh, stacked=lambda p: p == "s"), Dtypes(jnp.float32))
  leaves = _leaves(plan)
  assert (leaves["a"].shard_dim, leaves["a"].pad) == (-2, 0)
  assert (leaves["b"].shard_dim, leaves["b"].pad) == (-1, 0)
  # c: neither 3 nor 5 divides by 8; padding dim 0 (3 -> 8) costs 25 elements, dim 1 (5 -> 8) 24.
  assert (leaves["c"].shard_dim, leaves["c"].padded) == (-1, 8)
  assert leaves["d"].shard_dim is None and not leaves["d"].state_partitioned
  # stacked leaves are never split along the layer axis
  assert leaves["s"].shard_dim == -1 and leaves["s"].stacked
  assert plan.state_spec(leaves["s"]) == P(None, None, "data")
  assert plan.local_numel(leaves["c"], True) * 8 == 3 * 8


@pytest.mark.parametrize("stage, param, grad, state", [
    (0, False, False, False), (1, False, False, True), (2, False, True, True), (3, True, True, True)])
def test_stage_table(mesh, stage, param, grad, state):
  leaf = make_plan(_abstract(w=(64, 64)), Layout(stage=stage, mesh=mesh, persistence_threshold=0),
                   Dtypes(jnp.float32)).leaf_list()[0]
  assert (leaf.param_partitioned, leaf.grad_partitioned, leaf.state_partitioned) == (
      param, grad, state)


def test_persistence_thresholds(mesh):
  shapes = _abstract(small=(8, 8), mid=(16, 16), big=(64, 64), layers=(4, 8, 16))
  plan = make_plan(shapes, Layout(stage=3, mesh=mesh, persistence_threshold=300,
                                  stacked=lambda p: p == "layers"), Dtypes(jnp.float32))
  leaves = _leaves(plan)
  # per-layer size counts for stacked leaves: 8*16 = 128 < 300
  assert [leaves[k].param_partitioned for k in ("small", "mid", "big", "layers")] == [
      False, False, True, False]
  assert all(l.state_partitioned and l.grad_partitioned for l in leaves.values())
  capped = make_plan(shapes, Layout(stage=3, mesh=mesh, persistence_threshold=300,
                                    model_persistence_threshold=64 + 256,
                                    stacked=lambda p: p == "layers"), Dtypes(jnp.float32))
  # smallest first until the total cap: small (64) and mid (256) fit, layers (512) does not
  assert {l.path: l.param_partitioned for l in capped.leaf_list()} == {
      "small": False, "mid": False, "layers": True, "big": True}


def test_opt_specs_follow_master_layout(mesh):
  plan = make_plan(_abstract(w=(64, 8), b=(8,)), Layout(stage=2, mesh=mesh), Dtypes(jnp.bfloat16))
  specs = OptLayout.of(plan, optax.adamw(1e-3)).specs()
  adam = specs[0]
  assert adam.mu == {"b": P("data"), "w": P("data", None)}
  assert adam.count == P()
  assert plan.has_master


def test_multi_axis_zero_spec():
  mesh = MeshSpec.from_dict({"axes": {"node": 2, "local": 4}}).build()
  plan = make_plan(_abstract(w=(16, 3)), Layout(stage=3, mesh=mesh, persistence_threshold=0),
                   Dtypes(jnp.float32))
  assert plan.param_spec(plan.leaf_list()[0]) == P(("node", "local"), None)
  # CPU: no collective combiner to configure; the memory-keeping options (plan.CPU_OPTIONS)
  assert program.compile_options(plan) == CPU_OPTIONS
