"""Communication volume read from the compiled HLO, against ZeRO's theory."""

from __future__ import annotations

import functools

import jax
import pytest

import jzero
from jzero.analysis.hlo import collectives, comm_volume, zero_theory
from jzero.models import GPTConfig
from zero_testing import SMALL, batches, ds_config, make_engine


@functools.lru_cache(maxsize=None)
def _compiled(stage: int, cfg: GPTConfig = GPTConfig(), mesh=None, gas: int = 1, **zero):
  engine = make_engine(ds_config(stage, gas=gas, **zero), model=cfg, mesh=mesh)
  state = engine.init(jax.random.key(0))
  batch = engine.shard_batch(batches(cfg.seq_len, 8 * gas, 1)[0])
  return engine, engine.compile_step(state, batch)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_volume_matches_zero_theory_at_8_devices(stage):
  """DDP, ZeRO-1 and ZeRO-2 send 2 Psi (n-1)/n per device per step, ZeRO-3 3 Psi (n-1)/n.

  Stage 3 comes in a little under 3: parameters below stage3_param_persistence_threshold stay
  replicated and are gathered once per step, not twice.
  """
  engine, compiled = _compiled(stage)
  psi = sum(l.numel for l in engine.plan.leaf_list())
  volume = comm_volume(compiled, engine.mesh, num_params=psi, bytes_per_param=4)
  theory = zero_theory(stage, 8)
  assert abs(volume.total_psi / theory - 1) <= 0.05, volume.table()
  records = volume.to_records()  # the table's rows, as numbers (MiB rounded to 3 decimals)
  assert sum(r["bytes"] for r in records) == pytest.approx(volume.total_bytes,
                                                          abs=len(records) * 2**10)
  assert volume.table().splitlines()[-1].split()[0] == "total"
  assert volume._repr_html_().count("<tr>") == len(records) + 2  # header, rows, total
  kinds = volume.by_kind()
  if stage == 0:
    assert set(kinds) == {"all-reduce"}
  else:
    assert kinds["reduce-scatter"] / volume.psi_bytes == pytest.approx(7 / 8, rel=1e-6)


def test_stage2_reduce_scatters_every_micro_batch():
  engine, compiled = _compiled(2, SMALL, gas=2)
  psi = sum(l.numel for l in engine.plan.leaf_list())
  kinds = comm_volume(compiled, engine.mesh, num_params=psi, bytes_per_param=4).by_kind()
  assert kinds["reduce-scatter"] / (psi * 4) == pytest.approx(2 * 7 / 8, rel=1e-6)


def test_scan_trip_counts_are_counted():
  """Stage 3 gathers inside the layer scan: the gathers run once per layer, counted by trip count."""
  runs = {}
  for layers in (2, 4):
    cfg = GPTConfig(d_model=64, n_layers=layers, n_heads=4, seq_len=32)
    engine, compiled = _compiled(3, cfg, stage3_param_persistence_threshold=0)
    runs[layers] = sum(o.count for o in collectives(compiled.as_text(), engine.mesh)
                       if o.kind == "all-gather")
  # 11 stacked leaves per layer are gathered in forward; backward gathers (most of) them again
  per_layer = (runs[4] - runs[2]) / 2
  assert 11 < per_layer <= 22, runs


def test_axes_tell_intra_from_inter_node_traffic():
  mesh = jzero.MeshSpec.from_dict(
      {"axes": {"node": 2, "local": 4}, "zero_axes": ["local"], "batch_axes": ["node", "local"]})
  engine, compiled = _compiled(2, SMALL, mesh=mesh)
  psi = sum(l.numel for l in engine.plan.leaf_list())
  by_axes = comm_volume(compiled, engine.mesh, num_params=psi, bytes_per_param=4).by_axes()
  # reduce-scatter + all-gather inside a node, the partitions' all-reduce across nodes
  assert by_axes[("local",)] / (psi * 4) == pytest.approx(2 * 3 / 4, rel=0.01)
  assert by_axes[("node",)] / (psi * 4) == pytest.approx(2 * 1 / 2 / 4, rel=0.01)


def test_parses_iota_and_explicit_replica_groups():
  mesh = jzero.MeshSpec.from_dict({"axes": {"node": 2, "local": 4}}).build()
  hlo = """HloModule m

ENTRY %main (p: f32[8]) -> f32[64] {
  %p = f32[8]{0} parameter(0)
  %ag = f32[32]{0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %ag2 = f32[16]{0} all-gather(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %rs = f32[4]{0} reduce-scatter(%ag), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %ar = (f32[64]{0}, f32[]) all-reduce(%ag), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}
}
"""
  ops = {o.name: o for o in collectives(hlo, mesh)}
  assert (ops["ag"].axes, ops["ag"].group_size, ops["ag"].full_bytes) == (("local",), 4, 128)
  assert ops["ag2"].axes == ("node",) and ops["ag2"].group_size == 2
  assert ops["rs"].full_bytes == 4 * 4 * 8 and ops["rs"].axes == ("node", "local")
  assert ops["ar"].full_bytes == 64 * 4 + 4 and ops["ar"].axes == ("node",)
  assert ops["ar"].sent_bytes == pytest.approx(2 * 1 / 2 * 260)
