"""Several processes through ``jax.distributed``: 2 processes x 4 CPU devices over gloo.

The job (tests/multiprocess_worker.py) trains the small GPT under ZeRO stage 3 on one 8-device data
axis spanning both processes, checkpointing and restoring half-way. It must match the same run in
one process on 8 devices, each process must hold and write only its own shards, and its checkpoint
must restore in a single process.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import jzero
from jzero.sharding.plan import flatten_paths
from multiprocess_worker import BATCH, STAGE3, STEPS
from zero_testing import (SAME_MATH, SMALL, batches, ds_config, engine_run, make_engine,
                          max_relative_diff, multiprocess_job)

PROCESSES, DEVICES_PER_PROCESS = 2, 4


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("multiprocess")
  multiprocess_job(out, "stage3", PROCESSES, DEVICES_PER_PROCESS)
  return out


def _result(job: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  with np.load(job / "result.npz") as f:
    return f["losses"], {k: f[k] for k in f.files if k != "losses"}


def test_two_processes_match_one_process(job):
  losses, params = _result(job)
  engine = make_engine(ds_config(3, **STAGE3))
  _, single, single_losses = engine_run(engine, batches(SMALL.seq_len, BATCH, STEPS))
  assert len(losses) == STEPS
  np.testing.assert_allclose(losses, single_losses, rtol=SAME_MATH)
  assert max_relative_diff(params, flatten_paths(single)) <= SAME_MATH


def test_each_process_holds_and_writes_only_its_shards(job):
  for i in range(PROCESSES):
    held = json.loads((job / f"shards_{i}.json").read_text())
    assert held["local_devices"] == DEVICES_PER_PROCESS and held["global_devices"] == 8
    for path, shapes in held["shards"].items():
      assert len(shapes) == DEVICES_PER_PROCESS, path
  # Orbax writes one data store per process; each holds about half of the sharded state.
  state_dir = job / "ckpt" / str(STEPS) / "state"
  written = [sum(f.stat().st_size for f in (state_dir / f"ocdbt.process_{i}").rglob("*")
                 if f.is_file()) for i in range(PROCESSES)]
  assert all(w > 0 for w in written), written
  assert max(written) / min(written) < 1.2, written


def test_multiprocess_checkpoint_restores_in_one_process(job):
  _, params = _result(job)
  for stage, devices in ((3, 8), (1, 4)):
    mesh = jzero.MeshSpec.from_dict({"axes": {"data": devices}}).build(jax.devices()[:devices])
    engine = make_engine(ds_config(stage, **STAGE3), mesh=mesh)
    state = engine.load_checkpoint(job / "ckpt")
    assert int(state.step) == STEPS
    restored = flatten_paths(jax.tree.map(np.asarray, engine.logical_params(state)))
    assert restored.keys() == params.keys()
    for k in params:
      np.testing.assert_array_equal(restored[k], params[k], err_msg=k)
