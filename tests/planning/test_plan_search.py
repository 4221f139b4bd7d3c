"""`jzero plan` (jzero/planning/search.py): which candidates fit or are pruned, and why, for given
GPU specs; the 7B and 1T reasoning by arithmetic; the cost model's formula; compiling candidates
for the CPU target (cached) and for a GPU topology (device twin of an offload candidate); the
written config training under `jzero train`; bad input named by its flag. No wall times."""

import json

import pytest

from jzero import cli
from jzero.config import Config
from jzero.errors import ConfigError
from jzero.models import GPTConfig
from jzero.planning import plan_for
from jzero.planning.candidates import Candidate, Job, candidates, gpt_for_params
from jzero.planning.cost import Resources, cpu_hardware, gpu_hardware, predict
from zero_testing import needs_cuda_compiler

TINY = GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32)
SMALL = GPTConfig(n_layers=2, seq_len=32)  # d 256: MLP leaves over the persistence threshold


def _rows(plan, **fields):
  return [r for r in plan.rows
          if all(getattr(r.candidate, k) == v for k, v in fields.items())]


def test_7b_on_8_h100_stage_0_does_not_fit_and_stages_1_to_3_do_with_activations():
  plan = plan_for(7e9, gpu="h100", devices=8, compile=False)
  assert plan.job.model.num_params() == 6_748_037_120  # the 7b preset, as in the aot 7B table
  ddp = _rows(plan, stage=0)
  assert ddp and all(r.status == "pruned" and "device" in r.reason for r in ddp)
  assert min(r.device_bytes for r in ddp) > 107.9e9  # 16 Ψ of model states alone
  for stage, model_states in ((1, 37.11e9), (2, 25.31e9), (3, 13.50e9)):  # the 7B table
    row, = _rows(plan, stage=stage, micro_batch=1, checkpointing="block", offload_optimizer=None,
                 offload_param=None)
    assert row.status == "fits", row.reason
    assert row.device_bytes > model_states  # + activations, gathered layers, logits
    assert row.device_bytes - model_states < 5e9
  # without checkpointing, micro-batch 4 holds 122 GB of activations: pruned at every stage
  big = _rows(plan, micro_batch=4, checkpointing="none", offload_optimizer=None, offload_param=None)
  assert big and all(r.status == "pruned" for r in big)
  assert plan.chosen is not None and plan.chosen.candidate.stage in (1, 2, 3)
  assert "beat the runner-up" in str(plan) and "PREDICTIONS" in str(plan)


def test_1t_on_2_a100_nodes_offloads_params_and_optimizer_or_says_why_not():
  plan = plan_for(1e12, gpu="a100", devices=8, nodes=2, host_memory=1.5e12, compile=False)
  assert plan.job.model.n_layers == 128 and plan.job.model.d_model == 25600  # ZeRO-Infinity's 1T
  chosen = plan.chosen.candidate
  assert chosen.stage == 3 and chosen.offload_param == "nvme" and chosen.offload_optimizer == "nvme"
  on_device = _rows(plan, offload_param=None)
  assert on_device and all(r.status == "pruned" and "device" in r.reason for r in on_device)
  # the optimizer in host memory needs 12 B x 1e12 / 2 nodes = 6 TB per node: more than 1.5 TB
  host_opt = _rows(plan, offload_optimizer="cpu", offload_ratio=1.0, offload_param="nvme")
  assert host_opt and all("host" in r.reason and r.host_bytes > 6e12 for r in host_opt)
  config = plan.deepspeed_config()
  assert config["zero_optimization"]["offload_param"]["buffer_size"] >= 7.8e9 / 16
  # one node's worth of host memory and NVMe: nothing fits, and every row says why
  small = plan_for(1e12, gpu="a100", devices=8, nodes=2, host_memory=1.5e12, nvme_bytes=1.5e12,
                   compile=False)
  assert small.chosen is None and all(r.reason for r in small.rows)
  with pytest.raises(ConfigError, match="no candidate fits"):
    small.deepspeed_config()


def test_cost_model_terms_overlap_and_bound():
  hw = gpu_hardware("h100", 8)
  assert hw.peak_flops.value == 989.5e12 and "datasheet" in hw.peak_flops.source
  assert hw.hbm_bandwidth.value == 3.35232e12 and "spec" in hw.hbm_bandwidth.source
  assert all(c.source for c in hw.constants().values())
  r = Resources(flops=989.5e12 * 0.5, memory_bytes=0, intra_node_bytes=450e9 * 2,
                inter_node_bytes=0, overlap=0.5, pcie_bytes=64e9 * 0.25, host_update_bytes=0,
                nvme_traffic=0, source="test")
  p = predict(r, hw)  # compute 1 s, network 2 s half hidden, PCIe 0.25 s after the step
  assert p.terms["compute"] == pytest.approx(1.0) and p.terms["network"] == pytest.approx(2.0)
  assert p.seconds == pytest.approx(max(1.0, 1.0) + 1.0 + 0.25) and p.bound == "network"


def test_candidates_cover_the_issue_and_zeropp_only_across_nodes():
  job = Job(TINY, 32)
  one = candidates(job, 8)
  assert {c.stage for c in one} == {0, 1, 2, 3} and not any(c.zeropp for c in one)
  assert {c.micro_batch * c.gradient_accumulation for c in one} == {4}
  assert {c.checkpointing for c in one} == {"none", "block", "offload"}
  assert {(c.offload_optimizer, c.offload_ratio) for c in one if c.stage == 3} == {
      (None, 1.0), ("cpu", 1.0), ("cpu", 0.5), ("nvme", 1.0)}
  # a partial offload is stage 3's only (DeepSpeed's rule, which jzero's config enforces)
  assert {(c.offload_optimizer, c.offload_ratio) for c in one if c.stage in (1, 2)} == {
      (None, 1.0), ("cpu", 1.0), ("nvme", 1.0)}
  assert not any(c.offload_param for c in one if c.stage != 3)
  for c in one:  # every candidate is a config jzero takes
    Config.load(c.deepspeed_config(job, 8)).check_supported()
  two = candidates(job, 16, nodes=2, micro_batches=(2,))
  assert {c.zeropp for c in two if c.stage == 3} >= {("hpz",), ("qwz", "qgz")}
  config = Candidate(3, 2, 1, "offload", "cpu", 0.5, None, ("hpz", "qwz")).deepspeed_config(job, 16)
  zero = config["zero_optimization"]
  assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5}
  assert zero["zero_hpz_partition_size"] == "auto" and zero["zero_quantized_weights"] is True
  assert config["activation_checkpointing"] == {"cpu_checkpointing": True}
  assert config["train_batch_size"] == 32
  assert gpt_for_params(7e9).d_model == 4096 and gpt_for_params(1.3e9).d_model == 2048


@pytest.mark.parametrize("kwargs, flag", [
    (dict(gpu="v100"), "--gpu"), (dict(devices=0), "--devices"), (dict(nodes=-1), "--nodes"),
    (dict(global_batch=12), "--global-batch"), (dict(margin=1.5), "--margin"),
    (dict(precision="int8"), "--precision")])
def test_bad_input_is_one_error_naming_the_flag(kwargs, flag):
  with pytest.raises(ConfigError, match=flag):
    plan_for("default", compile=False, **kwargs)
  with pytest.raises(ConfigError, match="--params"):
    plan_for(10, compile=False)


def test_cli_error_names_the_flag(capsys, tmp_path):
  assert cli.main(["plan", "--gpu", "tpu9", "--compile-top", "0",
                   "--out", str(tmp_path / "x.json")]) == 2
  err = capsys.readouterr().err
  assert "--gpu" in err and "h100" in err and "Traceback" not in err
  assert cli.main(["plan", "--stages", "1,5", "--compile-top", "0"]) == 2
  assert "--stages" in capsys.readouterr().err


def test_cpu_target_compiles_candidates_reads_recompute_and_caches(tmp_path):
  hw = cpu_hardware(8, flops_per_second=1e11, memory_bandwidth=1e10)
  kwargs = dict(gpu=None, hardware=hw, stages=(1, 3), micro_batches=(2,), offload_tiers=(),
                checkpointing=("none", "block"), compile_top=3, cache_dir=tmp_path,
                global_batch=16)
  plan = plan_for(SMALL, **kwargs)
  compiled = {(r.candidate.stage, r.candidate.checkpointing): r for r in plan.rows if r.compiled}
  assert len(compiled) == 3 and all(r.resources.source == "compiled" for r in compiled.values())
  # compile_top 3: the candidate with the most predicted time (at these rates) is not compiled
  assert [(r.candidate.stage, r.candidate.checkpointing, r.status) for r in plan.rows
          if not r.compiled] == [(1, "block", "not compiled")]
  # the blocks' forward once more (not the output head's): between 1.1x and 4/3 the matmul FLOPs
  ratio = compiled[3, "block"].compiled.flops / compiled[3, "none"].compiled.flops
  assert 1.1 < ratio <= 4 / 3, ratio
  # stage 3 gathers every layer per micro-batch: more bytes than stage 1's one reduction
  assert (compiled[3, "none"].resources.intra_node_bytes
          > compiled[1, "none"].resources.intra_node_bytes)
  again = plan_for(SMALL, **kwargs)
  assert all(r.compiled.cached for r in again.rows if r.compiled)
  assert [r.name for r in again.ranked] == [r.name for r in plan.ranked]


@needs_cuda_compiler
def test_gpu_target_compiles_the_device_twin_of_an_offload_candidate(tmp_path):
  plan = plan_for(TINY, gpu="h100", devices=8, stages=(3,), micro_batches=(4,),
                  offload_tiers=("cpu",), checkpointing=("none",), compile_top=40,
                  cache_dir=tmp_path, global_batch=32)
  plain, = _rows(plan, checkpointing="none", offload_optimizer=None, offload_param=None)
  offload, = _rows(plan, checkpointing="none", offload_optimizer="cpu", offload_ratio=1.0,
                   offload_param=None)
  assert plain.compiled and offload.compiled and offload.compiled.cached  # the same twin
  assert offload.device_bytes < plain.device_bytes  # the optimizer state left the device
  assert plain.compiled.overlap > 0.9  # ZeRO-3's gathers run beside compute
  assert offload.resources.pcie_bytes > 0 and plain.resources.pcie_bytes == 0


def test_written_7b_config_trains_the_default_model_under_jzero_train(tmp_path, capsys):
  plan = plan_for(7e9, gpu="h100", devices=8, compile=False)
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(plan.deepspeed_config(nvme_path=str(tmp_path / "nvme"))))
  config = Config.load(path)
  assert config.zero_optimization.stage == plan.chosen.candidate.stage
  losses, text = tmp_path / "losses.txt", tmp_path / "plan.txt"
  text.write_text(str(plan))  # a small corpus: the plan's own table (the stdlib takes seconds)
  assert cli.main(["train", "--config", str(path), "--steps", "2", "--no-progress",
                   "--data", str(text), "--seq-len", "32", "--losses-file", str(losses)]) == 0
  assert len(losses.read_text().splitlines()) == 2
