"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py as a jzero user runs it: a small CNN
classifier trained from ``initialize(training_data=...)``'s loader, then tested in eval mode.
Written for these tests after that script's ``main``: its DeepSpeed calls in its order, its config
(``get_ds_config``); the network in Flax NNX, CIFAR-10 replaced by synthetic 32x32 images (no
download), fewer epochs. MoE is left out (jzero refuses expert parallelism).

DeepSpeed calls (each runs here; tests/journeys/test_deepspeed_scripts.py checks them)::

  parser = deepspeed.add_config_arguments(parser)
  deepspeed.init_distributed()
  model_engine, optimizer, trainloader, __ = deepspeed.initialize(
      args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
  model_engine.local_rank; model_engine.bfloat16_enabled(); model_engine.fp16_enabled()
  for i, data in enumerate(trainloader): ...
  model_engine.backward(loss); model_engine.step(); loss.item()
  model_engine.eval(); outputs = model_engine(images)

Lines that differ from the original besides the imports and the model (docs/coming-from-deepspeed.md
names each):

* ``parameters = filter(lambda p: p.requires_grad, net.parameters())`` ->
  ``parameters = nnx.state(net, nnx.Param)``;
* ``outputs = model_engine(inputs); loss = criterion(outputs, labels)`` ->
  ``loss = model_engine((inputs, labels))``, with ``initialize(loss_fn=criterion)``: the loss is
  computed inside the compiled step;
* ``inputs, labels = data[0].to(local_device), data[1].to(local_device)`` -> ``inputs, labels =
  data``; ``.to(target_dtype)`` casts -> nothing (the config's precision casts inside the step);
* torch's accelerator and process-group lines (``get_accelerator().set_device``,
  ``torch.distributed.barrier``) -> nothing.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jzero as deepspeed

__all__ = ["Net", "SyntheticCifar", "add_argument", "get_ds_config", "criterion", "main", "test"]


def add_argument(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description="CIFAR")
  parser.add_argument("-e", "--epochs", default=30, type=int, help="number of total epochs")
  parser.add_argument("--local_rank", type=int, default=-1, help="local rank")
  parser.add_argument("--log-interval", type=int, default=2000, help="logging interval")
  parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
  parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
  parser = deepspeed.add_config_arguments(parser)
  return parser.parse_args(argv)


def get_ds_config(args: argparse.Namespace) -> dict:
  """The original's config, key for key."""
  return {
      "train_batch_size": 16,
      "steps_per_print": 2000,
      "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                               "weight_decay": 3e-7}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                   "warmup_num_steps": 1000}},
      "gradient_clipping": 1.0,
      "prescale_gradients": False,
      "bf16": {"enabled": args.dtype == "bf16"},
      "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False,
               "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
               "initial_scale_power": 15},
      "wall_clock_breakdown": False,
      "zero_optimization": {"stage": args.stage, "allgather_partitions": True,
                            "reduce_scatter": True, "allgather_bucket_size": 50000000,
                            "reduce_bucket_size": 50000000, "overlap_comm": True,
                            "contiguous_gradients": True, "cpu_offload": False},
  }


class Net(nnx.Module):
  """The original's LeNet-style network: two conv + pool layers, three dense layers."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 6, (5, 5), padding="VALID", rngs=rngs)
    self.conv2 = nnx.Conv(6, 16, (5, 5), padding="VALID", rngs=rngs)
    self.fc1 = nnx.Linear(16 * 5 * 5, 120, rngs=rngs)
    self.fc2 = nnx.Linear(120, 84, rngs=rngs)
    self.fc3 = nnx.Linear(84, 10, rngs=rngs)

  def __call__(self, x):
    pool = lambda y: nnx.max_pool(y, (2, 2), (2, 2))  # noqa: E731
    x = pool(nnx.relu(self.conv1(x)))
    x = pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)
    return self.fc3(nnx.relu(self.fc2(nnx.relu(self.fc1(x)))))


def criterion(model: Net, batch: tuple) -> jax.Array:
  """``nn.CrossEntropyLoss()`` of the model's output and the labels."""
  inputs, labels = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(inputs), labels).mean()


class SyntheticCifar:
  """CIFAR-10's shape: ``(image [32, 32, 3] in [-1, 1], label)`` samples; each class has its own
  mean colour, so there is something to learn."""

  def __init__(self, n: int, seed: int):
    rng = np.random.default_rng(seed)
    self.labels = rng.integers(0, 10, n).astype(np.int32)
    means = np.linspace(-0.5, 0.5, 10)[self.labels][:, None, None, None]
    noise = rng.normal(scale=0.3, size=(n, 32, 32, 3))
    self.images = np.clip(means + noise, -1, 1).astype(np.float32)

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, i: int) -> tuple:
    return self.images[i], self.labels[i]


def test(model_engine, testset: SyntheticCifar, test_batch_size: int = 4) -> float:
  """The original's test: accuracy of the engine's outputs in eval mode."""
  correct, total = 0, 0
  model_engine.eval()
  for start in range(0, len(testset) - test_batch_size + 1, test_batch_size):
    images = testset.images[start:start + test_batch_size]
    labels = testset.labels[start:start + test_batch_size]
    outputs = model_engine(images)
    predicted = np.argmax(np.asarray(outputs), 1)
    total += len(labels)
    correct += int((predicted == labels).sum())
  return correct / total


def main(args: argparse.Namespace) -> dict:
  deepspeed.init_distributed()
  trainset, testset = SyntheticCifar(160, seed=0), SyntheticCifar(40, seed=1)
  net = Net(nnx.Rngs(0))
  parameters = nnx.state(net, nnx.Param)
  ds_config = get_ds_config(args)
  model_engine, optimizer, trainloader, __ = deepspeed.initialize(
      args=args, model=net, model_parameters=parameters, training_data=trainset,
      config=ds_config, loss_fn=criterion)
  local_rank = model_engine.local_rank
  target_dtype = None
  if model_engine.bfloat16_enabled():
    target_dtype = jnp.bfloat16
  elif model_engine.fp16_enabled():
    target_dtype = jnp.float16
  epoch_losses = []
  for epoch in range(args.epochs):
    running_loss = 0.0
    for i, data in enumerate(trainloader):
      inputs, labels = data
      loss = model_engine((inputs, labels))
      model_engine.backward(loss)
      model_engine.step()
      running_loss += loss.item()
      if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
        print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
    epoch_losses.append(running_loss / len(trainloader))
  print("Finished Training")
  accuracy = test(model_engine, testset)
  return {"epoch_losses": epoch_losses, "accuracy": accuracy, "target_dtype": target_dtype,
          "global_steps": model_engine.global_steps, "optimizer": optimizer,
          "skipped_steps": model_engine.skipped_steps}
