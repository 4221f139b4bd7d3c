"""One order of collectives on every process (jzero.comm.collective_order).

Statically: in the compiled step of every stage, ZeRO++, the offload tiers, fp16's skip branch and
accumulation 1 and 2, each computation's collective-bearing instructions (collectives, and loops /
branches holding them) form one chain of data dependencies, so XLA's CPU runtime cannot run two at
once -- and without the chain they do not (the check can fail); and none of them is a
reduce-scatter (an all-to-all + a local sum instead, which computes what psum_scatter does). End to
end: 2 processes x 1 device and 2 x 4 over gloo, stages 0-3 with no clipping and 2 accumulation
steps, each trained twice.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import user_script_worker
from collective_order_worker import BATCH, RUNS, STAGES, STEPS, model_config
from jzero.analysis.hlo import collectives, unordered_collectives
from jzero.comm import collective_order
from jzero.sharding.mesh import MeshSpec
from jzero.sharding.plan import flatten_paths
from zero_testing import (SMALL, batches, ds_config, engine_run, free_port, make_engine,
                          subprocess_env)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "collective_order_worker.py"
NODE2X4 = str(ROOT / "configs" / "mesh" / "node2x4.yaml")


def _no_clip(config: dict) -> dict:
  return {**config, "gradient_clipping": 0.0}


SETTINGS = {
    # every stage, accumulation 1 and 2 each on two of them (the chain inside the micro-batch loop)
    **{f"stage{s}-gas{g}": (lambda s=s, g=g: _no_clip(ds_config(s, gas=g)), None)
       for s, g in ((0, 1), (1, 2), (2, 1), (3, 2))},
    "zeropp-all": (lambda: _no_clip(ds_config(
        3, stage3_param_persistence_threshold=0, zero_quantized_weights=True,
        zero_hpz_partition_size=4, zero_quantized_gradients=True)), NODE2X4),
    "offload-param": (lambda: _no_clip(ds_config(3, offload_param={"device": "cpu"},
                                                 offload_optimizer={"device": "cpu"})), None),
    "delayed-update": (lambda: _no_clip(ds_config(2, offload_optimizer={
        "device": "cpu", "delayed_update": True})), None),
    "fp16-clip": (lambda: {**ds_config(3, gas=2), "fp16": {"enabled": True}}, None),
}


def _compiled_step(config: dict, mesh) -> str:
  engine = make_engine(config, mesh=mesh)
  state = engine.init(jax.random.key(0))
  batch = engine.shard_batch(batches(SMALL.seq_len, engine.global_batch_size, 1)[0])
  return engine.compile_step(state, batch).as_text()


@pytest.fixture
def chained(monkeypatch):
  """Chain this process's programs as if its mesh spanned several processes (the chain is only
  applied there: ``collective_order.needed``)."""
  monkeypatch.setattr(collective_order, "needed", lambda mesh: True)


def test_one_process_needs_no_chain():
  assert not collective_order.needed(MeshSpec.default().build(jax.devices()).mesh)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_collective_waits_for_the_previous_one(setting, chained):
  """... and no reduce-scatter is left for gloo (its own races, module docstring)."""
  make, mesh = SETTINGS[setting]
  hlo = _compiled_step(make(), mesh)
  kinds = {c.kind for c in collectives(hlo)}
  assert len(collectives(hlo)) >= 2 and "reduce-scatter" not in kinds, kinds
  assert unordered_collectives(hlo) == []


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("axes", [("node", "local"), ("local",)])
def test_reduce_scatter_by_all_to_all_is_psum_scatter(axes, tiled):
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  n = int(np.prod([mesh.shape[a] for a in axes]))
  spec = P(("node", "local"))
  rows = 2 * n if tiled else n  # tiled: each device keeps 2 rows; else one row, the dim dropped
  x = jax.device_put(np.random.default_rng(0).standard_normal((8, 3, rows, 5)).astype(np.float32),
                     NamedSharding(mesh, spec))

  def run(reduce_scatter):
    return np.asarray(jax.shard_map(lambda x: reduce_scatter(x[0])[None], mesh=mesh,
                                    in_specs=spec, out_specs=spec, check_vma=False)(x))

  by_all_to_all = functools.partial(collective_order._reduce_scatter_by_all_to_all, axis_name=axes,
                                    scatter_dimension=1, axis_size=n, tiled=tiled)
  expected = run(lambda x: lax.psum_scatter(x, axes, scatter_dimension=1, tiled=tiled))
  np.testing.assert_allclose(run(by_all_to_all), expected, rtol=1e-6)


def test_the_nvme_tier_step_is_chained(tmp_path, chained):
  config = _no_clip(ds_config(2, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)}))
  assert unordered_collectives(_compiled_step(config, None)) == []


def test_the_user_script_step_is_chained(chained):
  """tests/user_script_worker.py's model: its untied head (a gather unit) has a bias, which stays
  replicated, so the smallest output of the unit's backward region is the bias gradient -- which
  the region's last collective (the kernel's reduce-scatter) does not feed; the chain must leave
  the region through the kernel's gradient instead."""
  script = user_script_worker
  engine = make_engine(script.config(3), lambda rngs: script.GPT(rngs), script.loss_fn)
  state = engine.init(jax.random.key(0), params=script.given_weights())
  batch = engine.shard_batch({"tokens": np.zeros((script.BATCH, script.SEQ + 1), np.int32)})
  assert unordered_collectives(engine.compile_step(state, batch).as_text()) == []


def test_without_the_chain_the_runtime_may_reorder_them(monkeypatch):
  """The check can fail: the same step compiled without the chain has unordered collectives."""
  monkeypatch.setattr(collective_order, "needed", lambda mesh: False)
  make, mesh = SETTINGS["stage3-gas2"]
  assert len(unordered_collectives(_compiled_step(make(), mesh))) >= 10


def test_the_chain_changes_no_bit():
  """The identity the chain inserts keeps every value, -0.0 and NaN included."""
  x = np.array([0.0, -0.0, np.nan, np.inf, -3.5, 1e-45], np.float32)
  for token in (np.array([np.nan], np.float32), np.array([7], np.int32), np.array(-0.0, np.float32)):
    out = np.asarray(jax.jit(collective_order.identity_after)(x, token))
    assert out.tobytes() == x.tobytes()
  ints = np.array([-(2 ** 31), 5, 2 ** 31 - 1], np.int32)
  assert np.array_equal(jax.jit(collective_order.identity_after)(ints, x[:1]), ints)


# --- several processes ---------------------------------------------------------------------------


def _launch(tmp_path_factory, processes: int, devices: int) -> Path:
  out = tmp_path_factory.mktemp(f"order{processes}x{devices}")
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(processes), str(port),
                             str(devices), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env())
           for i in range(processes)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"
  return out


@pytest.fixture(scope="module", params=[(2, 1), (2, 4)], ids=["2x1", "2x4"])
def job(request, tmp_path_factory) -> tuple[int, Path]:
  processes, devices = request.param
  return processes * devices, _launch(tmp_path_factory, processes, devices)


def _run(out: Path, stage: int, run: int) -> dict[str, np.ndarray]:
  with np.load(out / f"stage{stage}_run{run}.npz") as f:
    return {k: f[k] for k in f.files}


def _one_process(stage: int, devices: int) -> dict[str, np.ndarray]:
  cfg = model_config()
  config = _no_clip(ds_config(stage, micro=BATCH // devices // 2, gas=2))
  engine = make_engine(config, model=cfg, mesh=MeshSpec.default().build(jax.devices()[:devices]))
  _, params, losses = engine_run(engine, batches(cfg.seq_len, BATCH, STEPS))
  return {"losses": np.array(losses), **flatten_paths(params)}


@pytest.mark.parametrize("stage", STAGES)
def test_processes_repeat_bit_for_bit_and_match_one_process(job, stage):
  """No abort (the job fixture), the same bits in every run, and the one-process result.

  The one-process run (this process, on as many of its devices) computes the same program; its
  sums differ in order only: gloo and XLA's in-process all-reduce add the devices' contributions
  in different orders, and XLA's CPU matmuls split their reductions by the threads a process
  gives each device. One reordering of an n-term float32 sum is at most n - 1 roundings (7 x 2^-24
  = 4.2e-7 relative for 8 terms); losses and parameters must stay within 1e-6, about twice that
  (measured: 2 x 1 bit for bit in separate processes, 2 x 4 1.1e-7)."""
  devices, out = job
  runs = [_run(out, stage, r) for r in range(RUNS)]
  for other in runs[1:]:
    assert runs[0].keys() == other.keys()
    for name in runs[0]:
      assert runs[0][name].tobytes() == other[name].tobytes(), name
  single = _one_process(stage, devices)
  assert runs[0].keys() == single.keys() and len(single["losses"]) == STEPS
  diffs = {name: float(np.linalg.norm(runs[0][name] - value)) / max(float(np.linalg.norm(value)),
                                                                     1e-30)
           for name, value in single.items()}
  print(f"BOUND order {devices} devices stage {stage} vs one process: measured "
        f"{max(diffs.values()):.3g} <= bound 1e-06")
  assert max(diffs.values()) <= 1e-6, diffs
