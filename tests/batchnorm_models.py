"""Two vision models with batch statistics, as Flax users write them, and their losses.

* :class:`ResNet` (Linen): a ResNet v1 in the form of flax's ``examples/imagenet/models.py``
  (written here, not copied) -- compact blocks built from ``conv`` / ``norm`` partials,
  ``nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name="batch")``
  (the axis name that example gave its ``pmap`` axis), a projection shortcut with its own norm,
  the last norm of a block zero-initialised, a 7x7 stride-2 stem and max-pool, global average
  pooling -- shrunk through its constructor arguments (4 filters, one stage of one block, as
  flax's own test size ``stage_sizes=[1]``).
* :class:`CNN` (NNX): ``nnx.Conv`` (no bias: the BatchNorm's takes its place) + ``nnx.BatchNorm``
  (no axis name, NNX's default) twice, then ``nnx.Dropout`` holding the model's ``rngs`` (the way
  NNX documents it) and a linear head.

Images are 32x32x3, 10 classes.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import jzero
from zero_testing import make_engine

IMAGE, CLASSES = (32, 32, 3), 10


class ResNetBlock(nn.Module):
  """Two 3x3 convolutions and a shortcut (projected where the shape changes)."""

  filters: int
  conv: Any
  norm: Any
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
    if x.shape != y.shape:
      x = self.norm(name="norm_proj")(self.conv(self.filters, (1, 1), self.strides,
                                                name="conv_proj")(x))
    return self.act(x + y)


class ResNet(nn.Module):
  """ResNet v1: ``stage_sizes`` blocks per stage, ``num_filters`` doubling per stage."""

  stage_sizes: Sequence[int]
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                   dtype=self.dtype, axis_name="batch")
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        x = ResNetBlock(self.num_filters * 2 ** i, conv=conv, norm=norm, act=nn.relu,
                        strides=(2, 2) if i > 0 and j == 0 else (1, 1))(x)
    x = jnp.mean(x, axis=(1, 2))
    return jnp.asarray(nn.Dense(self.num_classes, dtype=self.dtype)(x), self.dtype)


def small_resnet() -> ResNet:
  """One stage of one block, 4 filters (flax's own test size, ``stage_sizes=[1]``)."""
  return ResNet(stage_sizes=[1], num_classes=CLASSES, num_filters=4)


def resnet_loss(model, batch, rng=None):
  """flax's imagenet loss: cross-entropy of the logits; BatchNorm on the batch's statistics in
  training (``rng`` given), on the running ones in evaluation."""
  logits = model(batch["image"], train=rng is not None)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


class CNN(nnx.Module):
  """Two conv + BatchNorm + relu stages, pooled, dropout, a linear head."""

  def __init__(self, rngs: nnx.Rngs, width: int = 8, rate: float = 0.25):
    self.conv1 = nnx.Conv(IMAGE[-1], width, (3, 3), strides=2, use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=2, use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(2 * width, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.head = nnx.Linear(2 * width, CLASSES, rngs=rngs)

  def features(self, x):
    x = nnx.relu(self.bn1(self.conv1(x)))
    return jnp.mean(nnx.relu(self.bn2(self.conv2(x))), axis=(1, 2))

  def __call__(self, x):
    return self.head(self.drop(self.features(x)))


def cnn_loss(model, batch):
  return optax.softmax_cross_entropy_with_integer_labels(model(batch["image"]),
                                                         batch["label"]).mean()


def images(batch_size: int, steps: int, seed: int = 0) -> list[dict]:
  """``steps`` batches of images and labels: each image its class's fixed random pattern plus as
  much noise, so there is something to learn."""
  rng = np.random.default_rng(seed)
  patterns = rng.normal(size=(CLASSES, *IMAGE)).astype(np.float32)
  out = []
  for _ in range(steps):
    labels = rng.integers(0, CLASSES, batch_size).astype(np.int32)
    noise = rng.normal(size=(batch_size, *IMAGE)).astype(np.float32)
    out.append({"image": patterns[labels] + noise, "label": labels})
  return out


def stream_key(rng: jax.Array, tag: str) -> jax.Array:
  """The key jzero reseeds an NNX model's RNG streams of ``tag`` from, for the loss's ``rng``
  (docs/coming-from-flax.md: ``fold_in(rng, crc32(tag))``)."""
  return jax.random.fold_in(rng, zlib.crc32(tag.encode()))


# -- engines ---------------------------------------------------------------------------------------
#: flax's imagenet optimizer: lr 0.1 per 256 images (so 0.0125 for a batch of 32), Nesterov 0.9
LR, MOMENTUM, BATCH = 0.1 * 32 / 256, 0.9, 32


def config(stage: int, gas: int, devices: int = 8, *, sgd_block: bool = True) -> dict:
  """fp32, a global batch of BATCH images in ``gas`` micro-batches, no gradient clipping (flax's
  imagenet has none), every stage-3 leaf partitioned (persistence threshold 0); with
  ``sgd_block`` flax's imagenet optimizer as a DeepSpeed config says it (torch's SGD, Nesterov
  momentum 0.9, constant lr)."""
  cfg = {"train_micro_batch_size_per_gpu": BATCH // (devices * gas),
         "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
  if sgd_block:
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM,
                                                  "nesterov": True}}
  return cfg


def nesterov_sgd() -> optax.GradientTransformation:
  """flax's imagenet optimizer in optax (the reference loops' and ``initialize(optimizer=)``'s)."""
  return optax.sgd(LR, momentum=MOMENTUM, nesterov=True)


def engine_for(kind: str, stage: int, gas: int, devices: int = 8):
  """The ResNet (``kind="resnet"``, optimizer from the config) or the NNX CNN (``"cnn"``, the
  optax optimizer given to initialize) under ``config(stage, gas, devices)``, on the first
  ``devices`` devices."""
  mesh = jzero.MeshSpec.default().build(jax.devices()[:devices])
  if kind == "resnet":
    return make_engine(config(stage, gas, devices), small_resnet(), resnet_loss, mesh=mesh,
                       init_inputs=lambda b: (b["image"],), sample_batch=images(BATCH, 1)[0])
  return make_engine(config(stage, gas, devices, sgd_block=False), CNN, cnn_loss, mesh=mesh,
                     optimizer=nesterov_sgd())
