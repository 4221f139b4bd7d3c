"""`jzero plan` (jzero/planning/search.py): which candidates fit or are pruned, and why, for given
GPU specs; the seed's questions by arithmetic (7B on 8 H100; 10B on one RTX 3090, 13B with ZeRO-2
on 8 A100-40GB and 1T on 16 A100 with Adam on the host, `jzero estimate` agreeing; 70B on 64 H100)
and by the search's compiles (13B on 8 A100-40GB, no flags; the offload questions cold); the
closing hint when nothing fits, each remedy checked; one budget; the cost model's formula;
compiling candidates for the CPU target (cached) and for a GPU topology (device twin of an offload
candidate); the time budget; written configs with DeepSpeed's field types, training under `jzero
train`; bad input named by its flag. No wall times."""

import json
import shlex

import pytest

from deepspeed_fields import problems
from jzero import cli
from jzero.analysis.tables import format_bytes
from jzero.config import Config
from jzero.config.blocks import CPU_ADAM, STREAM
from jzero.errors import ConfigError
from jzero.models import GPTConfig
from jzero.planning import plan_for
from jzero.planning.candidates import (Candidate, Job, candidates, estimated,
                                       gpt_for_params)
from jzero.planning.cost import Resources, cpu_hardware, gpu_hardware, predict
from jzero.planning.plan_report import (estimate_command, format_plan, search_line, stage_lines,
                                        why_chosen)
from jzero.planning.search import MODEL
from zero_testing import needs_cuda_compiler

TINY = GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32)
SMALL = GPTConfig(n_layers=2, seq_len=32)  # d 256: MLP leaves over the persistence threshold


def _rows(plan, **fields):
  return [r for r in plan.rows
          if all(getattr(r.candidate, k) == v for k, v in fields.items())]


def test_7b_on_8_h100_stage_0_does_not_fit_and_the_summary_says_why_per_stage():
  plan = plan_for(7e9, gpu="h100", devices=8, compile=False)
  assert plan.job.model.num_params() == 6_748_037_120  # the 7b preset, as in the aot 7B table
  # one budget: 84.98 GB x 0.90 (XLA_PYTHON_CLIENT_MEM_FRACTION) x 0.95 margin, in every row
  assert plan.usable == pytest.approx(84_978_434_048 * 0.90 * 0.95)
  usable = format_bytes(plan.usable)
  assert all(f"> {usable} usable" in r.reason for r in plan.rows if "device" in r.reason)
  ddp = _rows(plan, stage=0)
  assert ddp and all(r.status == "pruned" and "device" in r.reason for r in ddp)
  assert min(r.device_bytes for r in ddp) > 107.9e9  # 16 Ψ of model states alone
  for stage, model_states in ((1, 37.11e9), (2, 25.31e9), (3, 13.50e9)):  # the 7B table
    row, = _rows(plan, stage=stage, micro_batch=1, checkpointing="block", offload_optimizer=None,
                 offload_param=None)
    assert row.status == "fits", row.reason
    # + the step's gradients, their fp32 accumulator (gas 4), activations, gathered layers
    assert model_states < row.device_bytes < 2 * model_states
  # without checkpointing, micro-batch 4 keeps 32 layers of fp32 activations: pruned everywhere
  big = _rows(plan, micro_batch=4, checkpointing="none", offload_optimizer=None, offload_param=None)
  assert big and all(r.status == "pruned" for r in big)
  assert plan.chosen is not None and plan.chosen.candidate.stage in (1, 2, 3)
  text = str(plan)
  assert "the runner-up" in text and "PREDICTIONS" in text
  # the summary, without --all: DDP's smallest candidate and the bytes that rule it out
  ddp_line, = [line for line in stage_lines(plan) if "DDP" in line]
  assert "does not fit" in ddp_line and f"> {usable} usable" in ddp_line and "state" in ddp_line
  assert ddp_line.strip() in format_plan(plan, limit=5)


def _estimate_says(plan, capsys):
  """The device and host-per-node figures ``jzero estimate`` prints for the plan's chosen
  candidate, run as the plan's closing line says (plan_report.estimate_command)."""
  command = estimate_command(plan)
  assert command and command in format_plan(plan)
  capsys.readouterr()
  assert cli.main(shlex.split(command)[1:]) == 0
  out = capsys.readouterr().out
  line, = [line for line in out.splitlines()
           if line.startswith("  ZeRO") and "host" in line and "optimizer->cpu" in line]
  device = line.split(": ", 1)[1].split(" (", 1)[0]
  host = line.rsplit("host ", 1)[1].removesuffix("/node")
  return device, host


def test_the_seeds_offload_questions_fit_with_the_gradients_streamed_to_the_host(capsys):
  """Issue 46's questions by arithmetic: 10B on one RTX 3090 with 256 GB of host memory and 13B
  with ZeRO-2 on 8 A100-40GB (at the default batch, accumulating on the host) fit once the
  gradients leave the device in the backward pass and Adam runs on the host ("cpu_adam"); `jzero estimate` prices the chosen configuration at the same
  bytes. 1T on 2 x 8 A100-80GB with 1.5 TB of host memory and 28 TB of NVMe per node needs the
  host Adam with the optimizer state on NVMe, which the engine does not run yet: the planner does
  not offer it, and nothing fits."""
  ten = plan_for(10e9, gpu="rtx3090", devices=1, host_memory=256e9, compile=False)
  c = ten.chosen.candidate
  assert (c.stage, c.offload_optimizer, c.update, c.offload_param) == (3, "cpu", CPU_ADAM, "cpu")
  psi = ten.job.model.num_params()
  assert ten.chosen.device_bytes <= ten.usable
  # per node: params, new params, the arriving bf16 gradient, master and moments (18Ψ), and
  # the layer inputs cpu_checkpointing keeps there
  acts = 28 * c.micro_batch * 2048 * 5504 * 4 if c.checkpointing == "offload" else 0
  assert ten.chosen.host_bytes == pytest.approx(18 * psi + acts, rel=1e-3)
  # ZeRO-2 keeps the 10B's bf16 params (20.94 GB) and a layer's working set: over 21.52 GB
  zero2 = min(_rows(ten, stage=2), key=lambda r: r.device_bytes)
  assert zero2.status == "pruned" and zero2.parts["state"] == pytest.approx(2 * psi, rel=1e-3)
  # at the default global batch (4 sequences per device) one micro-batch's activations are over
  # memory: the host Adam with its gradients accumulated in host memory fits, 2 x 2
  thirteen = plan_for(13e9, gpu="a100-40gb", devices=8, stages=(2,), compile=False)
  c = thirteen.chosen.candidate
  assert (c.stage, c.update, c.micro_batch, c.gradient_accumulation) == (2, CPU_ADAM, 2, 2)
  assert thirteen.chosen.device_bytes <= thirteen.usable
  # the streamed update keeps the gradient partition and its fp32 update on the device: too big
  stream = [r for r in thirteen.rows if r.candidate.offload_optimizer == "cpu"
            and r.candidate.offload_update == STREAM]
  assert stream and all(r.status == "pruned" for r in stream)
  trillion = plan_for(1e12, gpu="a100", devices=8, nodes=2, host_memory=1.5e12, nvme_bytes=28e12,
                      compile=False)
  assert trillion.chosen is None
  assert not [r for r in trillion.rows if r.candidate.update == CPU_ADAM
              and r.candidate.offload_optimizer == "nvme"]
  # the optimizer in host memory needs 12 B x 1e12 / 2 nodes = 6 TB per node: more than 1.5 TB
  host_opt = _rows(trillion, offload_optimizer="cpu", offload_ratio=1.0, offload_param="nvme")
  assert host_opt and all("host" in r.reason and r.host_bytes > 6e12 for r in host_opt)
  for plan in (ten, thirteen):  # the host Adam is what device: cpu runs: DeepSpeed's own config
    assert problems(plan.deepspeed_config()) == []
    device, host = _estimate_says(plan, capsys)
    assert (device, host) == (format_bytes(plan.chosen.device_bytes),
                              format_bytes(plan.chosen.host_bytes))


@needs_cuda_compiler
def test_10b_on_one_rtx_3090_is_planned_cold_with_adam_on_the_host(tmp_path):
  """`jzero plan --params 10e9 --gpu rtx3090 --devices 1 --host-memory 256GB` with a cold
  cache: the first compile (its device twin: FLOPs and collectives, ~30 s) ends the search at a
  candidate whose bytes come from the memory model, which no compile-only GPU can place."""
  plan = plan_for(10e9, gpu="rtx3090", devices=1, host_memory=256e9, cache_dir=tmp_path)
  chosen = plan.chosen
  assert chosen.status == "fits" and chosen.compiled is not None and not chosen.compiled.cached
  assert chosen.device_from == MODEL and chosen.candidate.update == CPU_ADAM
  # one compile ends the search: the only candidate predicted to fit ("exhausted") or the first
  # of several ("proven")
  assert plan.search.stop in ("proven", "exhausted") and plan.search.compiled == 1
  assert chosen.device_bytes == estimated(chosen.candidate, plan.job, plan.hardware).device_bytes
  assert chosen.resources.source == "compiled"


def test_nothing_fits_and_the_hint_names_only_what_would_help():
  """10B on one RTX 3090 with 128 GB of host memory and no NVMe: nothing fits (the host Adam's
  18Ψ is 188 GB), and each remedy the closing paragraph names makes a candidate fit when given."""
  one = plan_for(10e9, gpu="rtx3090", devices=1, host_memory=128e9, nvme_bytes=0.0, compile=False)
  assert "GeForce RTX 3090" in one.hardware.name and one.chosen is None
  assert all(format_bytes(one.usable) in r.reason for r in one.rows if "device" in r.reason)
  with pytest.raises(ConfigError, match="no candidate fits"):
    one.deepspeed_config()
  text = why_chosen(one)
  assert one.remedies and all(remedy in text for remedy in one.remedies)
  host, = [r for r in one.remedies if "host memory per node" in r]
  # (NVMe helps only the host Adam with its state on NVMe, which the engine does not run yet)
  assert not [r for r in one.remedies if "NVMe per node" in r]
  nodes, = [r for r in one.remedies if "nodes of this kind" in r]
  given = dict(host_memory=128e9, nvme_bytes=0.0)
  for remedy, change in ((host, "host_memory"),):
    amount = float(remedy.split(" GB")[0].replace(",", "")) * 1e9
    fits = plan_for(10e9, gpu="rtx3090", devices=1, compile=False, **{**given, change: amount})
    assert fits.chosen is not None and fits.chosen.name == remedy.split(": ")[-1]
    short = plan_for(10e9, gpu="rtx3090", devices=1, compile=False,
                     **{**given, change: amount * 0.99})
    assert short.chosen is None  # the least that helps
  count = int(nodes.split(" nodes")[0])
  assert plan_for(10e9, gpu="rtx3090", devices=1, nodes=count, compile=False, global_batch=4 * count,
                  **given).chosen is not None
  # a plan no remedy helps says so instead of guessing
  tiny = plan_for(10e9, gpu="rtx3090", devices=1, host_memory=1e9, nvme_bytes=0.0,
                  stages=(0,), compile=False)
  assert tiny.chosen is None and tiny.remedies == ()
  assert "no more host memory or NVMe" in why_chosen(tiny)


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
  # ZeRO-Offload's schedule (gradients off the device in the backward pass, Adam on the host:
  # what device: cpu runs for the config's Adam) on the host tier, whole, in stages 1-3, at every
  # micro-batch split (the sum accumulated in host memory); the host tier's other candidates, whole
  # and partial, name the streamed update
  assert {(c.stage, c.offload_optimizer, c.offload_ratio, c.gradient_accumulation) for c in one
          if c.update == CPU_ADAM} == {(s, "cpu", 1.0, gas) for s in (1, 2, 3)
                                       for gas in (1, 2, 4)}
  assert {(c.offload_update, c.offload_ratio) for c in one if c.offload_optimizer == "cpu"} == {
      (None, 1.0), (STREAM, 1.0), (STREAM, 0.5)}
  # a TPU target: one micro-batch per step (jzero refuses the host's sum in the loop there)
  tpu = candidates(job, 8, host_sum_in_loop=False)
  assert {c.gradient_accumulation for c in tpu if c.update == CPU_ADAM} == {1}
  assert set(one) - set(tpu) == {c for c in one if c.update == CPU_ADAM
                                 and c.gradient_accumulation > 1}
  assert not any(c.offload_param for c in one if c.stage != 3)
  for c in one:  # every candidate is a config jzero takes
    config = Config.load(c.deepspeed_config(job, 8))
    if c.offload_optimizer == "cpu":  # the update named where it is not the default
      assert config.zero_optimization.offload_optimizer.update == c.offload_update
      assert ("[stream]" in c.name) == (c.offload_update == STREAM)
    config.check_supported()
  two = candidates(job, 16, nodes=2, micro_batches=(2,))
  assert {c.zeropp for c in two if c.stage == 3} >= {("hpz",), ("qwz", "qgz")}
  hpz = Candidate(3, 2, 1, "offload", "cpu", 0.5, None, ("hpz", "qwz"))
  config = hpz.deepspeed_config(job, 16, devices_per_node=8)
  zero = config["zero_optimization"]
  assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5}
  assert zero["zero_hpz_partition_size"] == 8 and zero["zero_quantized_weights"] is True
  with pytest.raises(ValueError, match="devices_per_node"):
    hpz.deepspeed_config(job, 16)
  assert config["activation_checkpointing"] == {"cpu_checkpointing": True}
  assert config["train_batch_size"] == 32
  assert gpt_for_params(7e9).d_model == 4096 and gpt_for_params(1.3e9).d_model == 2048


@pytest.mark.parametrize("kwargs, flag", [
    (dict(gpu="v100"), "--gpu"), (dict(devices=0), "--devices"), (dict(nodes=-1), "--nodes"),
    (dict(global_batch=12), "--global-batch"), (dict(margin=1.5), "--margin"),
    (dict(precision="int8"), "--precision"), (dict(mem_fraction=1.5), "--mem-fraction"),
    (dict(time_budget=0), "--time-budget"), (dict(compile_top=-1), "--compile-top")])
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
                   offload_param=None, offload_update=STREAM)
  adam, = _rows(plan, checkpointing="none", offload_optimizer="cpu", offload_param=None,
                offload_update=None)
  assert plain.compiled and offload.compiled is plain.compiled  # one compile: the same twin
  assert adam.compiled is plain.compiled
  assert plan.search.compiled == 1 and plain.device_from == "compiled"
  # gradients streamed to the host: no twin holds what it holds, its bytes are the model's
  assert adam.device_from == MODEL and adam.estimate_ratio is None
  assert adam.device_bytes == estimated(adam.candidate, plan.job, plan.hardware).device_bytes
  assert adam.resources.source == "compiled" and adam.resources.flops == plain.resources.flops
  # never the twin's peak: the twin's less the optimizer state the offload keeps on the host,
  # or the streamed update's bytes by arithmetic if larger, and labelled so
  e = estimated(offload.candidate, plan.job, plan.hardware)
  assert e.offloaded_bytes > 0
  assert offload.device_bytes == max(plain.compiled.peak - e.offloaded_bytes, e.offload_floor)
  assert offload.device_from == ("twin - offload" if offload.device_bytes > e.offload_floor
                                 else "update phase (estimate)")
  assert offload.device_bytes < plain.device_bytes == plain.compiled.peak
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


@needs_cuda_compiler
def test_13b_on_8_a100_40gb_chooses_a_fitting_candidate_without_any_flag(tmp_path):
  """The ZeRO write-ups' example, as a new user asks it: the search compiles candidates in order
  of predicted time until one is proven to fit by its compile (one compile here, ~50 s cold)."""
  plan = plan_for(13e9, gpu="a100-40gb", devices=8, cache_dir=tmp_path)
  chosen = plan.chosen
  assert chosen is not None and chosen.status == "fits" and chosen.compiled is not None
  assert chosen.device_bytes <= plan.usable
  assert plan.search.stop == "proven" and plan.search.compiled >= 1
  # "too big" only by a compile; candidates predicted to fit stay listed, untried
  assert all(r.compiled and r.reason for r in plan.rows if r.status == "too big")
  assert plan.search.untried == sum(r.status == "not compiled" for r in plan.rows) > 0
  # every compiled row shows estimate / compiled, within the estimator's 20% (a row whose
  # gradients leave the device takes the model's bytes, never a compiled figure)
  for r in plan.rows:
    if r.compiled is not None and r.device_from != MODEL:
      assert r.estimate_ratio is not None and abs(r.estimate_ratio - 1) < 0.2, r.name
  text = str(plan)
  assert "proven to fit" in text and "est/compiled" in text and chosen.name in text
  # jzero's own offload_optimizer.update is the one key DeepSpeed's config class lacks
  assert problems(plan.deepspeed_config()) == (
      ["zero_optimization.offload_optimizer.update: not a field of DeepSpeed's config"]
      if chosen.candidate.offload_update else [])


def test_written_configs_have_deepspeeds_field_types_and_load_in_jzero():
  """Every candidate of the 70B x 64 H100 (8 nodes) and 1T x 16 A100 questions is written with
  the types DeepSpeed's config classes declare (tests/deepspeed_fields.py); hpZ's partition is
  the 8 GPUs of a node, an integer (DeepSpeed drops "auto": hpZ off)."""
  for params, gpu, nodes in ((70e9, "h100", 8), (1e12, "a100", 2)):
    plan = plan_for(params, gpu=gpu, devices=8, nodes=nodes, compile=False)
    for r in plan.rows:
      config = r.candidate.deepspeed_config(plan.job, 8 * nodes, devices_per_node=8)
      # jzero's own offload_optimizer.update is the one key DeepSpeed's config class lacks
      jzeros = (["zero_optimization.offload_optimizer.update: not a field of DeepSpeed's config"]
                if r.candidate.offload_update else [])
      assert problems(config) == jzeros, (r.name, problems(config))
      if "hpz" in r.candidate.zeropp:
        assert config["zero_optimization"]["zero_hpz_partition_size"] == 8
    hpz = [r for r in plan.rows if r.candidate.zeropp == ("hpz",)]
    assert hpz and all(r.parts.get("state", 0) > 0 for r in hpz)
    Config.load(hpz[0].candidate.deepspeed_config(plan.job, 8 * nodes,
                                                   devices_per_node=8)).check_supported()
  # hpZ's secondary partition (2 bytes x Ψ / 8 per device) is in its candidates' estimates
  plan = plan_for(70e9, gpu="h100", devices=8, nodes=8, compile=False)
  with_hpz, = _rows(plan, stage=3, zeropp=("hpz",), micro_batch=1, checkpointing="block",
                    offload_optimizer=None)
  without, = _rows(plan, stage=3, zeropp=(), micro_batch=1, checkpointing="block",
                   offload_optimizer=None, offload_param=None)
  secondary = 2 * plan.job.model.num_params() / 8
  assert with_hpz.parts["state"] - without.parts["state"] == pytest.approx(secondary, rel=0.01)
  # what the checker refuses
  assert problems({"zero_optimization": {"zero_hpz_partition_size": "auto"}})
  assert problems({"train_batch_size": 32.0, "bf16": {"enabled": 1}, "zero_optimization": {
      "stage": 4, "offload_param": {"device": "gpu"}, "overlap": True}}) == [
      "train_batch_size: 32.0 is not int>0", "bf16.enabled: 1 is not bool",
      "zero_optimization.stage: 4 is not one of (0, 1, 2, 3)",
      "zero_optimization.offload_param.device: 'gpu' is not one of ('none', 'cpu', 'nvme')",
      "zero_optimization.overlap: not a field of DeepSpeed's config"]


def test_search_stops_at_its_time_budget_and_says_so(tmp_path):
  hw = cpu_hardware(8, flops_per_second=1e11, memory_bandwidth=1e10)
  plan = plan_for(SMALL, gpu=None, hardware=hw, stages=(3,), micro_batches=(2,),
                  offload_tiers=(), checkpointing=("none",), cache_dir=tmp_path,
                  global_batch=16, time_budget=1e-9)
  assert plan.search.stop == "budget" and plan.search.compiled == 0 and plan.chosen is None
  assert plan.search.untried == 1 and [r.status for r in plan.rows] == ["not compiled"]
  assert "STOPPED: the time budget" in search_line(plan)
  assert "Raise --time-budget" in str(plan) and "Nothing fits" not in str(plan)


def test_cli_writes_the_memory_fraction_beside_the_config(tmp_path, capsys):
  out = tmp_path / "plan.json"
  assert cli.main(["plan", "--params", "7e9", "--compile-top", "0", "--mem-fraction", "0.85",
                   "--out", str(out)]) == 0
  text = capsys.readouterr().out
  assert (tmp_path / "plan.env").read_text() == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.85\n"
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.85" in text and "export $(cat" in text
  usable = format_bytes(84_978_434_048 * 0.85 * 0.95)
  assert f"usable per device: {usable}" in text and problems(json.loads(out.read_text())) == []
