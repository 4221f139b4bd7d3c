"""Where each optimizer update keeps the gradients, its buffers and the new params
(jzero/analysis/update_memory.py), in the estimator's tiers and in the step's peak
(jzero/analysis/step_memory.step_peak): no offload, the streamed and host updates, the NVMe store's,
and ZeRO-Offload's schedule ("cpu_adam": gradients off the device in the backward pass, Adam on
the host). Every figure is worked out by hand from Ψ, N and the layer's size."""

import pytest

from jzero.analysis import update_memory
from jzero.analysis.estimate import ParamShape, estimate
from jzero.analysis.step_memory import step_memory, step_peak
from jzero.errors import ConfigError
from jzero.models import GPTConfig

GB = 1e9
# a stack of 4 layers of 3M elements each, and 2M elements outside it (the embedding's kind)
LEAVES = [ParamShape((4, 1000, 3000), stacked=True), ParamShape((1000, 2000))]
PSI, LAYER, OTHERS = 14_000_000, 3_000_000, 2_000_000


def _est(stage=2, devices=8, **kwargs):
  return estimate(LEAVES, stage, devices, persistence_threshold=0, **kwargs)


def test_the_default_update_is_the_engines():
  """device: cpu runs the host Adam for the config's Adam (jzero.tiers.host_step.resolve_update),
  and the estimator assumes it, as DeepSpeed's estimator assumes its CPU Adam."""
  assert update_memory.default_update(None) is None
  assert update_memory.default_update("cpu") == update_memory.CPU_ADAM
  assert update_memory.default_update("cpu", "cpu") == update_memory.CPU_ADAM
  assert update_memory.default_update("cpu", "nvme") == update_memory.STREAM  # as the engine's
  assert update_memory.default_update("nvme") == "store"
  assert _est(offload_optimizer="cpu").update == update_memory.CPU_ADAM
  assert _est().update is None


def test_streamed_and_host_updates_keep_the_gradient_partition_on_the_device():
  plain = _est()
  stream = _est(offload_optimizer="cpu", offload_update="stream")
  assert stream.bytes["device"]["grads"] == plain.bytes["device"]["grads"] == 2 * PSI / 8
  assert stream.bytes["device"]["optimizer"] == 0
  assert stream.bytes["host"] == {"params": 0, "grads": 0, "optimizer": 12 * PSI / 8}
  host = _est(offload_optimizer="cpu", offload_update="host")
  assert host.bytes["device"]["grads"] == 2 * PSI / 8
  assert host.bytes["host"]["grads"] == 4 * PSI / 8  # the fp32 partition the host computation reads


@pytest.mark.parametrize("devices", [1, 8])
def test_cpu_adam_keeps_only_the_gradient_in_flight_on_the_device(devices):
  n = devices
  e = _est(devices=n, offload_optimizer="cpu", offload_update="cpu_adam")
  assert e.name == "ZeRO-2 + optimizer->cpu"  # the default update: not named
  # the layer being reduced, whole and its partition, and the leaves outside the stack
  assert e.bytes["device"] == {"params": 2 * PSI, "grads": 2 * (LAYER * (1 + 1 / n) + OTHERS),
                               "optimizer": 0}
  # host per process: master and moments, the arriving 16-bit partition, the new 16-bit params
  assert e.bytes["host"] == {"params": 2 * PSI / n, "grads": 2 * PSI / n,
                             "optimizer": 12 * PSI / n}
  # stage 1: the full local gradient, reduced once at the end
  one = _est(stage=1, devices=n, offload_optimizer="cpu", offload_update="cpu_adam")
  assert one.bytes["device"]["grads"] == 2 * PSI and one.bytes["host"]["grads"] == 2 * PSI / n


def test_cpu_adam_sums_micro_batches_in_fp32_and_carries_one_more_with_the_delayed_update():
  kw = dict(offload_optimizer="cpu", offload_update="cpu_adam")
  assert _est(gradient_accumulation=4, **kw).bytes["host"]["grads"] == 4 * PSI / 8
  delayed = _est(delayed_update=True, **kw)
  assert delayed.bytes["host"]["grads"] == 2 * 2 * PSI / 8
  assert "delayed_grads" not in delayed.bytes["device"]  # the carried gradient is the host's
  streamed = _est(delayed_update=True, offload_optimizer="cpu", offload_update="stream")
  assert streamed.bytes["device"]["delayed_grads"] == 4 * PSI / 8  # jzero.tiers.delayed's


def test_cpu_adam_with_the_nvme_store_keeps_the_gradient_where_the_state_is():
  n = 8
  e = _est(stage=3, devices=n, offload_optimizer="nvme", offload_param="nvme",
           offload_update="cpu_adam", gradient_accumulation=2, sub_group_size=1_000_000)
  assert e.bytes["nvme"]["optimizer"] == 12 * PSI / n and e.bytes["nvme"]["grads"] == 4 * PSI / n
  assert e.bytes["nvme"]["params"] == 2 * PSI / n
  # host: one update group of state and fp32 gradient (sub_group_size 1M of the 1.75M
  # partition), no new params (they go to the store)
  assert e.bytes["host"] == {"params": 0, "grads": 0, "optimizer": (12 + 4) * 1_000_000}
  store = _est(stage=3, devices=n, offload_optimizer="nvme", sub_group_size=1_000_000)
  assert store.update == "store" and store.bytes["host"]["optimizer"] == 12 * 1_000_000
  assert store.bytes["device"]["grads"] == 2 * PSI / n


def test_a_parameter_count_alone_has_no_layer_in_flight_unless_given():
  e = estimate(7e9, 2, 8, offload_optimizer="cpu", offload_update="cpu_adam")
  assert e.bytes["device"]["grads"] == 0
  layer = 12 * 4096**2
  given = estimate(7e9, 3, 8, offload_optimizer="cpu", offload_update="cpu_adam",
                   gathered=(layer, 0))
  assert given.bytes["device"]["grads"] == 2 * layer * (1 + 1 / 8)


def test_bad_updates_are_refused():
  with pytest.raises(ConfigError, match="cpu_adam"):
    _est(offload_optimizer="cpu", offload_update="fast")
  with pytest.raises(ConfigError, match="needs offload_optimizer"):
    _est(offload_update="cpu_adam")


# -- the step's peak ---------------------------------------------------------------------------
GPT = GPTConfig(vocab_size=1000, seq_len=128, d_model=256, n_layers=4, n_heads=4)


def _leaves():
  from jzero.modeling.model_adapter import as_model
  from jzero.models import GPT as Model
  from jzero.analysis.estimate import param_shapes

  adapter = as_model(lambda rngs: Model(GPT, rngs=rngs))
  return param_shapes(adapter.abstract_params(None, None), adapter.stacked_layers)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_cpu_adam_step_has_no_fp32_update_nor_accumulator_on_the_device(stage):
  leaves, n = _leaves(), 4
  common = dict(micro_batch=2, checkpointing="block", activation_bytes=4)
  kw = dict(offload_optimizer="cpu", gradient_accumulation=2)
  adam = estimate(leaves, stage, n, offload_update="cpu_adam", **kw)
  stream = estimate(leaves, stage, n, offload_update="stream", **kw)
  a, s = step_peak(adam, GPT, **common), step_peak(stream, GPT, **common)
  psi = adam.num_params
  assert s.accumulator == 4 * psi / n and a.accumulator == 0  # the host sums in fp32
  assert s.grads == 2 * psi / n and a.grads == adam.bytes["device"]["grads"]
  # the same activations and working set: the backward phases differ by the gradients only
  assert (s.saved, s.working, s.gathered) == (a.saved, a.working, a.gathered)
  assert s.backward - a.backward == pytest.approx(s.grads + s.accumulator - a.grads)
  # after the backward pass only the upload: stage 2's partitions gathered into the donated
  # params, stage 3's new partition before the old one goes
  partition = (psi - adam.persistent_params) / n if stage == 3 else psi / n
  assert a.update == 2 * partition
  assert a.phase == "backward" and a.peak < s.peak
  direct = step_memory(GPT, state=sum(v for k, v in adam.bytes["device"].items() if k != "grads"),
                       grad_elements=psi / n, gradient_accumulation=2, stage=stage, param_bytes=2,
                       update_elements=0, grads_in_flight=a.grads, accumulated_elements=0,
                       upload=2 * partition, **common)
  assert direct == a


def test_the_stores_update_group_is_on_the_device_in_the_update_phase():
  leaves = _leaves()
  common = dict(micro_batch=1, checkpointing="none", activation_bytes=4)
  store = estimate(leaves, 3, 2, offload_optimizer="nvme", sub_group_size=10_000)
  plain = estimate(leaves, 3, 2)
  assert (step_peak(store, GPT, **common).update
          - step_peak(plain, GPT, **common).update) == 12 * 10_000
  one = estimate(leaves, 2, 1, offload_optimizer="cpu", offload_update="cpu_adam")
  assert step_peak(one, GPT, **common).update == 0  # one device: the upload is the params
