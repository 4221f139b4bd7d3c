"""Three public DeepSpeed training scripts as a jzero user runs them (tests/deepspeed_scripts/:
HelloDeepSpeed's BERT, DeepSpeedExamples' CIFAR-10, DeepSpeed-Chat's supervised fine-tuning), their
models in Flax and their DeepSpeed calls kept: each runs, and each of its DeepSpeed calls is checked
here. The lines that differ from the originals are in each script's docstring and in
docs/coming-from-deepspeed.md."""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from deepspeed_scripts import cifar10_deepspeed_flax, hello_deepspeed_flax, sft_deepspeed_flax
from jzero.train.deepspeed_engine import DeepSpeedOptimizer

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "tests" / "deepspeed_scripts"


def test_hello_deepspeed_trains_saves_and_resumes_bit_for_bit(tmp_path):
  """initialize(model=, model_parameters=, config=) with bf16 and ZeRO-1 + CPU offload;
  model(**batch) / backward / step; save_checkpoint(save_dir=, client_state=) every 3 steps;
  load_checkpoint(load_dir=) -> (_, client_state) resumes at checkpoint_step + 1 with the losses
  of the uninterrupted run."""
  through = hello_deepspeed_flax.train(checkpoint_dir=str(tmp_path / "through"), num_iterations=8)
  assert through["global_steps"] == 7 and len(through["losses"]) == 7
  assert through["num_params"] > 0 and all(np.isfinite(through["losses"]))

  first = hello_deepspeed_flax.train(checkpoint_dir=str(tmp_path / "run"), num_iterations=6)
  assert first["losses"] == through["losses"][:5]  # steps 1-5, saved at 3
  resumed = hello_deepspeed_flax.train(load_checkpoint_dir=str(tmp_path / "run"),
                                       num_iterations=8)
  assert resumed["client_state"] == {"checkpoint_step": 3} and resumed["start_step"] == 4
  assert resumed["global_steps"] == 7
  assert resumed["losses"] == through["losses"][3:]


def test_cifar10_trains_from_its_loader_and_tests_in_eval_mode():
  """add_config_arguments, init_distributed, initialize(args=, model=, model_parameters=,
  training_data=, config=) with the original's fp16 config; the 4-tuple's loader; local_rank,
  fp16_enabled(); backward / step; eval() then model_engine(images) returns the logits."""
  args = cifar10_deepspeed_flax.add_argument(["--epochs", "6", "--stage", "2"])
  out = cifar10_deepspeed_flax.main(args)
  assert out["target_dtype"] == np.float16  # the original's fp16 default
  assert out["global_steps"] == 6 * 10  # 160 samples, train_batch_size 16
  assert isinstance(out["optimizer"], DeepSpeedOptimizer)
  losses = out["epoch_losses"]
  assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
  assert out["accuracy"] > 0.1, out  # better than chance on class-coloured images


def test_sft_fine_tunes_with_its_own_optimizer_and_evaluates_perplexity():
  """initialize(model=, optimizer=, args=, config=, dist_init_required=True) at ZeRO-3; the
  4-tuple's lr_scheduler is None (the schedule is in the optax optimizer); train() / eval();
  eval-mode model(**batch) returns Hugging Face's output with .loss; module carries the trained
  weights."""
  args = sft_deepspeed_flax.parse_args(["--num_train_epochs", "3"])
  out = sft_deepspeed_flax.main(args)
  assert out["lr_scheduler"] is None and out["global_steps"] == 3 * 4
  ppl = out["perplexities"]
  assert all(map(math.isfinite, ppl)) and ppl[-1] < ppl[0] / 2, ppl
  assert isinstance(out["trained"], nnx.Module)
  before = sft_deepspeed_flax.TinyCausalLM(16, nnx.Rngs(0))
  assert not np.allclose(np.asarray(out["trained"].lm_head.kernel[...]),
                         np.asarray(before.lm_head.kernel[...]))


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_every_difference_a_script_lists_is_named_in_the_docs(script):
  """Each line a script's docstring lists as differing from its original is on the docs page."""
  doc = (SCRIPTS / script).read_text().split('"""')[1]
  differences = doc.split("names each):")[1]
  page = (ROOT / "docs" / "coming-from-deepspeed.md").read_text()
  originals = re.findall(r"\* ``([^`]+)``", differences)
  assert originals, script
  for original in originals:
    assert f"`{original}`" in page, original
  assert jax.local_device_count() == 8  # the scripts' batches assume the suite's devices
