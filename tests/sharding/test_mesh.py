"""Mesh files, the default mesh and simulated devices."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jzero.errors import MeshError
from jzero.sharding.mesh import MeshSpec, simulate_cpu_devices

MESHES = Path(__file__).parents[2] / "configs" / "mesh"


def test_default_mesh_is_one_data_axis():
  zm = MeshSpec.default().build()
  assert dict(zm.mesh.shape) == {"data": 8} and zm.zero_size == zm.dp_size == 8


@pytest.mark.parametrize("name, shape, zero, replicas", [
    ("data8.yaml", {"data": 8}, 8, ()),
    ("data.yaml", {"data": 8}, 8, ()),
    ("node2x4.yaml", {"node": 2, "local": 4}, 8, ()),
    ("hybrid2x4.yaml", {"node": 2, "local": 4}, 4, ("node",)),
])
def test_shipped_mesh_files(name, shape, zero, replicas):
  zm = MeshSpec.load(MESHES / name).build()
  assert dict(zm.mesh.shape) == shape
  assert zm.zero_size == zero and zm.dp_size == 8 and zm.replica_axes == replicas


@pytest.mark.parametrize("raw, match", [
    ({"axes": {"data": 0}}, "positive integer or -1"),
    ({"axes": {"a": -1, "b": -1}}, "only one axis size may be -1"),
    ({"axes": {"data": 8}, "batch_axes": []}, "carry no batch"),
    ({"axes": {"a": 2, "b": 4}, "batch_axes": ["a", "b"], "zero_axes": ["c"]}, "not mesh axes"),
    ({"axes": {"data": 8}, "extra": 1}, "unknown key"),
    ([1, 2], "expected a mapping"),
])
def test_bad_mesh_descriptions(raw, match):
  with pytest.raises(MeshError, match=match):
    MeshSpec.from_dict(raw, source="m.yaml")


def test_minus_one_fills_and_mismatch_explains():
  assert dict(MeshSpec.from_dict({"axes": {"node": 2, "local": -1}}).build().mesh.shape) == {
      "node": 2, "local": 4}
  with pytest.raises(MeshError, match="does not divide the 8 devices"):
    MeshSpec.from_dict({"axes": {"node": 3, "local": -1}}).build()


def test_simulate_after_start_with_other_count_is_refused():
  jax.devices()  # the backend is up with 8 devices (tests/conftest.py)
  simulate_cpu_devices(8)  # same count: fine
  with pytest.raises(MeshError, match="already started with 8"):
    simulate_cpu_devices(4)
