"""The optimizer and learning-rate schedule of a DeepSpeed config, rebuilt on optax.

DeepSpeed turns the config's ``optimizer`` block into a torch optimizer (``FusedAdam``,
``FusedLion``, ``torch.optim.SGD``) and its ``scheduler`` block into a ``deepspeed.runtime.
lr_schedules`` object that overwrites ``param_group["lr"]`` after every step. jzero builds one
``optax.GradientTransformation`` instead, ending in ``optax.scale_by_learning_rate(schedule)``: the
learning rate is a pure function of optax's own update count, which lives in the optimizer state,
so it is jitted, sharded and checkpointed with everything else and there is no host-side scheduler.
Every stage is elementwise, leaf by leaf, so the engine can run the transformation on sharded
leaves. Gradient clipping is not part of it: the engine clips by the true global norm over all
shards (``gradient_clipping``), as DeepSpeed's ZeRO optimizer does.

Which learning rate the k-th optimizer step uses (read in ``lr_schedules.py`` and ``engine.py``):

* Every DeepSpeed schedule starts at ``last_batch_iteration = -1`` and its constructor at once
  writes ``get_lr()`` of iteration -1 into the optimizer: ``warmup_min_lr`` for WarmupLR and
  WarmupDecayLR, ``lr_range_test_min_lr`` for LRRangeTest, and ``0.0`` for WarmupCosineLR (not
  ``warmup_min_ratio``: its ``get_lr`` returns 0 before the schedule has started).
* ``engine._take_model_step`` calls ``optimizer.step()`` first and ``lr_scheduler.step()`` after
  it, which sets ``last_batch_iteration += 1`` and writes the new ``get_lr()``.
* So optimizer step k (k = 0, 1, ...: the optax count) uses ``get_lr()`` of iteration ``k - 1``,
  which is what :func:`build_schedule` returns for count k. With WarmupLR the first two steps both
  use ``warmup_min_lr`` (iteration -1, then iteration 0 where ``log(1) = 0`` and ``0 / n = 0``);
  ``warmup_max_lr`` is first used by step ``n`` (log) or ``n + 1`` (linear), with
  ``n = max(2, warmup_num_steps)``.
* An fp16 step skipped for overflow does not call ``lr_scheduler.step()``. The optax count agrees
  as long as the engine leaves the whole optimizer state unchanged on a skipped step.

Numerics: schedules compute in float32. The cosine ``(1 + cos(pi p)) / 2`` is evaluated as
``sin(pi (1 - p) / 2) ** 2`` with ``1 - p`` formed from integers: the same value without the
cancellation near the end of the decay, so small learning rates keep their relative precision.
"""

from __future__ import annotations

import difflib
import math
import warnings
from typing import Annotated, Callable

import jax
import jax.numpy as jnp
import optax

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from jzero.config.blocks import Flag, number
from jzero.config.messages import show
from jzero.errors import ConfigError, JZeroWarning, NotSupportedError
from jzero.tiers.host_adam import HostAdamSettings

__all__ = ["Schedule", "build_schedule", "build_optimizer", "host_adam_settings"]

Schedule = Callable[[jax.Array | int], jax.Array]

# -- each type's params: pydantic models with DeepSpeed's (or torch's) defaults -----------------------

Real = Annotated[float, number(False)]
Integer = Annotated[int, number(True)]
# torch.optim's own checks ("Invalid learning rate", "Invalid beta parameter at index 0", ...),
# which DeepSpeed's fused optimizers skip: a negative rate trains uphill, a beta of 1 or more
# makes the moments grow without bound
NonNegative = Annotated[float, number(False, lo=0)]
MaybeNonNegative = Annotated[float | None, number(False, lo=0, nullable=True)]


def _below_one(value: float) -> float:
  if value >= 1:
    raise ValueError(f"must be in [0, 1) (a moment's decay rate), got {show(value)}")
  return value


Beta = Annotated[float, number(False, lo=0), AfterValidator(_below_one)]
Betas = tuple[Beta, Beta]


class _Params(BaseModel):
  model_config = ConfigDict(extra="forbid", frozen=True)


class AdamParams(_Params):
  """FusedAdam's (and torch.optim.Adam / AdamW's) parameters."""

  lr: NonNegative = 1e-3
  betas: Betas = (0.9, 0.999)
  eps: NonNegative = 1e-8
  weight_decay: NonNegative = 0.0
  bias_correction: Flag = True
  adam_w_mode: Flag = True
  amsgrad: Flag = False
  torch_adam: Flag = False  # torch.optim.Adam(W) instead of FusedAdam: the same math
  set_grad_none: Flag = True  # FusedAdam.zero_grad behaviour: nothing to do in JAX


class LionParams(_Params):
  """DeepSpeed's FusedLion / DeepSpeedCPULion parameters."""

  lr: NonNegative = 1e-3
  betas: Betas = (0.9, 0.999)
  weight_decay: NonNegative = 0.0
  set_grad_none: Flag = True


class SGDParams(_Params):
  """torch.optim.SGD's parameters (DeepSpeed looks the type up by its exact name)."""

  lr: NonNegative = 1e-3
  momentum: NonNegative = 0.0
  dampening: Real = 0.0
  weight_decay: NonNegative = 0.0
  nesterov: Flag = False


class WarmupLRParams(_Params):
  warmup_min_lr: NonNegative = 0.0
  warmup_max_lr: MaybeNonNegative = None  # the optimizer's lr (DeepSpeed >= 0.17.2)
  warmup_num_steps: Integer = 1000
  warmup_type: str = "log"
  last_batch_iteration: Integer = -1


class WarmupDecayLRParams(WarmupLRParams):
  total_num_steps: Integer  # required
  warmup_max_lr: MaybeNonNegative = 0.001


class WarmupCosineLRParams(_Params):
  total_num_steps: Integer  # required
  warmup_min_ratio: Real = 0.0
  warmup_num_steps: Integer = 1000
  cos_min_ratio: Real = 0.0001
  warmup_type: str = "log"
  last_batch_iteration: Integer = -1


class LRRangeTestParams(_Params):
  lr_range_test_min_lr: NonNegative = 1e-3
  lr_range_test_step_size: Integer = 2000
  lr_range_test_step_rate: Real = 1.0
  lr_range_test_staircase: Flag = False
  last_batch_iteration: Integer = -1


_SCHEDULE_PARAMS: dict[str, type[_Params]] = {
  "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
  "WarmupCosineLR": WarmupCosineLRParams, "LRRangeTest": LRRangeTestParams,
}
_OPTIMIZER_PARAMS: dict[str, type[_Params]] = {
  "adam": AdamParams, "adamw": AdamParams, "lion": LionParams, "SGD": SGDParams,
}


def _read_params(block: dict, section: str, model: type[_Params]) -> _Params:
  """``block["params"]`` validated by ``model``; every problem (an unknown key with the closest
  known one, a missing required key, a value of the wrong type) is one line of a ConfigError."""
  try:
    return model.model_validate(dict(block.get("params") or {}))
  except ValidationError as error:
    known = list(model.model_fields)
    lines = []
    given = dict(block.get("params") or {})
    for problem in error.errors():
      name = f"{section}.params.{'.'.join(str(part) for part in problem['loc'])}"
      field = str(problem["loc"][0]) if problem["loc"] else ""
      if problem["type"] in ("too_long", "too_short") or (
          len(problem["loc"]) > 1 and problem["type"] == "missing"):
        # a pair given with one number or three (betas: [0.9])
        lines.append(f"{section}.params.{field}: expected two numbers (e.g. [0.9, 0.999]), got "
                     f"{show(given.get(field))}; give exactly two.")
      elif problem["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(problem["loc"][0]), known, n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        lines.append(f'{name}: unknown parameter for {section} type "{block["type"]}".{hint} '
                     f"Valid parameters: {', '.join(known)}.")
      elif problem["type"] == "missing":
        what = (" (for a HF Trainer config, the total number of optimizer steps of the run)"
                if field == "total_num_steps" else "")
        lines.append(f'{name}: required by {section} type "{block["type"]}" but missing; add '
                     f"it{what}.")
      elif problem["type"] == "value_error":
        lines.append(f"{name}: {problem['ctx']['error']}; fix it.")
      elif problem["type"].startswith(("float", "int")):  # e.g. an "auto" left unresolved
        expected = "a number" if problem["type"].startswith("float") else "an integer"
        lines.append(f"{name}: expected {expected}, got {show(problem['input'])}; set one.")
      else:
        lines.append(f"{name}: {problem['msg']}, got {show(problem['input'])}.")
    raise ConfigError("\n".join(lines)) from None


def _positive(value: int, key: str) -> int:
  if value <= 0:
    raise ConfigError(f"{key}: must be a positive integer, got {value!r}; set one.")
  return value


def _warmup_type(value: object) -> str:
  if value not in ("log", "linear"):
    warnings.warn(
      f'scheduler.params.warmup_type: unknown value {value!r}; using "log" as DeepSpeed does. '
      f'Set "log" or "linear" to silence this warning.',
      JZeroWarning,
      stacklevel=3,
    )
    return "log"
  return value


def _warmup_fraction(it: jax.Array, num_steps: int, warmup_type: str) -> jax.Array:
  """DeepSpeed's warmup gamma of iteration ``it >= 0``, before it is clamped to 1."""
  if warmup_type == "linear":
    return it.astype(jnp.float32) / num_steps
  return jnp.log1p(it.astype(jnp.float32)) * (1.0 / math.log(num_steps))


def build_schedule(scheduler: dict | None, base_lr: float) -> Schedule:
  """Builds DeepSpeed's learning-rate schedule as a function of the optax update count.

  Args:
    scheduler: the config's ``scheduler`` block ``{"type": ..., "params": {...}}``, free of
      "auto"; None for a constant learning rate.
    base_lr: the optimizer's learning rate (``optimizer.params.lr`` or its default).

  Returns:
    A jittable ``schedule(count) -> float32 array`` (elementwise over ``count``): the learning rate
    DeepSpeed uses for optimizer step ``count`` (0 for the first step), i.e. ``get_lr()`` at
    ``last_batch_iteration = count - 1``.
  """
  if scheduler is None:
    return lambda count: jnp.full(jnp.shape(count), base_lr, jnp.float32)
  kind = scheduler.get("type")
  if kind not in _SCHEDULE_PARAMS:
    raise NotSupportedError(
      f"scheduler.type: {kind!r} is not supported by jzero; the supported types are "
      f"{', '.join(_SCHEDULE_PARAMS)} (not OneCycle nor torch.optim.lr_scheduler classes). Use "
      f"one of them, or remove the scheduler block and pass your own optax optimizer."
    )
  params = _read_params(scheduler, "scheduler", _SCHEDULE_PARAMS[kind])
  if params.last_batch_iteration != -1:
    raise NotSupportedError(
      f"scheduler.params.last_batch_iteration: {params.last_batch_iteration!r} is not "
      f"supported; remove it (jzero resumes the schedule from the checkpointed optimizer state)."
    )

  if kind == "LRRangeTest":
    min_lr, rate = params.lr_range_test_min_lr, params.lr_range_test_step_rate
    step_size = _positive(params.lr_range_test_step_size,
                          "scheduler.params.lr_range_test_step_size")
    staircase = params.lr_range_test_staircase

    def range_test(count):
      # interval = (last_batch_iteration + 1) / step_size = count / step_size
      count = jnp.asarray(count, jnp.int32)
      interval = count // step_size if staircase else count.astype(jnp.float32) / step_size
      return (min_lr * (1.0 + rate * interval)).astype(jnp.float32)

    return range_test

  # DeepSpeed master raises for a non-positive warmup_num_steps, then uses max(2, n).
  num_steps = max(2, _positive(params.warmup_num_steps, "scheduler.params.warmup_num_steps"))
  warmup_type = _warmup_type(params.warmup_type)

  if kind == "WarmupCosineLR":
    decay_steps = max(1, params.total_num_steps - num_steps)
    min_ratio, cos_min = params.warmup_min_ratio, params.cos_min_ratio

    def warmup_cosine(count):
      it = jnp.asarray(count, jnp.int32) - 1
      fraction = _warmup_fraction(jnp.maximum(it, 0), num_steps, warmup_type)
      warm = min_ratio + (1.0 - min_ratio) * fraction
      # 1 - min(1, progress) with progress = (it - num_steps + 1) / decay_steps
      left = jnp.maximum(decay_steps - (it - num_steps + 1), 0).astype(jnp.float32) / decay_steps
      cosine = jnp.maximum(0.0, cos_min + (1.0 - cos_min) * jnp.sin(0.5 * math.pi * left) ** 2)
      ratio = jnp.where(it < 0, 0.0, jnp.where(it < num_steps, warm, cosine))
      return (base_lr * ratio).astype(jnp.float32)

    return warmup_cosine

  min_lr = params.warmup_min_lr
  max_lr = base_lr if params.warmup_max_lr is None else params.warmup_max_lr
  total = getattr(params, "total_num_steps", None)  # WarmupDecayLR only

  def warmup(count):
    # Iteration -1 (the constructor) and iteration 0 both give warmup_min_lr.
    it = jnp.maximum(jnp.asarray(count, jnp.int32) - 1, 0)
    after = 1.0
    if total is not None:
      after = jnp.maximum(0.0, (total - it).astype(jnp.float32) / max(1, total - num_steps))
    gamma = jnp.where(it < num_steps, _warmup_fraction(it, num_steps, warmup_type), after)
    return (min_lr + (max_lr - min_lr) * gamma).astype(jnp.float32)

  return warmup


def _check_adam(params: AdamParams) -> None:
  """Refuses the Adam settings jzero does not implement."""
  if params.amsgrad:
    raise NotSupportedError(
      "optimizer.params.amsgrad: true is not supported (DeepSpeed's default FusedAdam refuses it "
      "too, and optax's AMSGrad takes the maximum of bias-corrected moments, unlike torch); set "
      "it to false."
    )
  if not params.bias_correction:
    raise NotSupportedError(
      "optimizer.params.bias_correction: false is not supported (optax's Adam always corrects "
      "the moment bias); remove it or set it to true."
    )


def _adam(params: AdamParams, decoupled: bool) -> list[optax.GradientTransformation]:
  _check_adam(params)
  adam = optax.scale_by_adam(*params.betas, params.eps)
  decay = optax.add_decayed_weights(params.weight_decay)
  # Decoupled (FusedAdam adam_w_mode, torch AdamW): p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd p).
  # Otherwise (FusedAdam mode 0, torch Adam): L2, wd * p added to the gradient before the moments.
  return [adam, decay] if decoupled else [decay, adam]


def _lion(params: LionParams) -> list[optax.GradientTransformation]:
  # FusedLion: p = p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g); m = b2 * m + (1 - b2) * g
  return [optax.scale_by_lion(*params.betas), optax.add_decayed_weights(params.weight_decay)]


def _sgd(params: SGDParams) -> list[optax.GradientTransformation]:
  momentum = params.momentum
  if params.dampening != 0:
    raise NotSupportedError(
      "optimizer.params.dampening: only 0 is supported (optax's momentum trace has no "
      "dampening); remove it or set it to 0."
    )
  if params.nesterov and momentum <= 0:
    raise ConfigError(
      "optimizer.params.nesterov: Nesterov momentum requires a momentum and zero dampening (as "
      "torch.optim.SGD says); set optimizer.params.momentum > 0 or nesterov to false."
    )
  # torch: g += wd * p; buf = momentum * buf + g (buf = g at the first step, as optax's zero-started
  # trace gives); g += momentum * buf if nesterov else g = buf. No momentum, no trace (no memory).
  stages = [optax.add_decayed_weights(params.weight_decay)]
  if momentum:
    stages.append(optax.trace(momentum, nesterov=params.nesterov))
  return stages


def _kind(optimizer: dict) -> str:
  """The optimizer block's type as :data:`_OPTIMIZER_PARAMS` names it (DeepSpeed lower-cases its
  own optimizer names, not torch's)."""
  name = optimizer.get("type")
  if isinstance(name, str) and name.lower() in ("adam", "adamw", "lion"):
    return name.lower()
  if name not in _OPTIMIZER_PARAMS:
    raise NotSupportedError(
      f"optimizer.type: {name!r} is not supported by jzero; the supported types are Adam, AdamW, "
      f"Lion (any case, as in DeepSpeed) and SGD (exact case, as torch.optim names it). Use one "
      f"of them, or pass an optax optimizer to jzero.initialize(optimizer=...)."
    )
  return name


def host_adam_settings(optimizer: dict) -> HostAdamSettings | None:
  """The settings of the fast host step (:class:`jzero.tiers.host_adam.HostAdam`) for the
  config's ``optimizer`` block (free of "auto"): Adam and AdamW have one, and it computes what
  :func:`build_optimizer`'s transformation computes, bit for bit on XLA:CPU; None for Lion and
  SGD, which keep the optax update. The learning rate and its schedule stay with the caller."""
  kind = _kind(optimizer)
  if kind not in ("adam", "adamw"):
    return None
  params = _read_params(optimizer, "optimizer", AdamParams)
  _check_adam(params)
  return HostAdamSettings(betas=tuple(params.betas), eps=params.eps,
                          weight_decay=params.weight_decay,
                          adam_w_mode=kind == "adamw" or params.adam_w_mode,
                          bias_correction=params.bias_correction)


def build_optimizer(
  optimizer: dict | None, scheduler: dict | None
) -> tuple[optax.GradientTransformation, Schedule]:
  """Builds the optax transformation and lr schedule of DeepSpeed's ``optimizer``/``scheduler``.

  Args:
    optimizer: the config's ``optimizer`` block ``{"type": ..., "params": {...}}``, free of "auto".
    scheduler: the config's ``scheduler`` block, or None for a constant learning rate.

  Returns:
    ``(tx, schedule)``: an elementwise transformation whose ``update(grads, state, params)`` needs
    ``params`` (weight decay) and returns the step to add to the parameters, and the schedule it
    applies (see :func:`build_schedule`), e.g. to log the learning rate of an optax count.
  """
  if optimizer is None:
    raise ConfigError(
      'optimizer: the config has no "optimizer" block; add one (e.g. {"type": "AdamW", "params": '
      '{"lr": 1e-4}}) or pass an optax optimizer to jzero.initialize(optimizer=...).'
    )
  kind = _kind(optimizer)
  if "max_grad_norm" in (optimizer.get("params") or {}):
    raise ConfigError(
      "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer "
      "parameter, please switch to using the deepspeed parameter 'gradient_clipping' see: "
      "https://www.deepspeed.ai/docs/config-json/#gradient-clipping for more details"
    )
  params = _read_params(optimizer, "optimizer", _OPTIMIZER_PARAMS[kind])
  schedule = build_schedule(scheduler, params.lr)
  if kind == "lion":
    stages = _lion(params)
  elif kind == "SGD":
    stages = _sgd(params)
  else:  # DeepSpeed: "AdamW" is always decoupled, "Adam" unless adam_w_mode is false.
    stages = _adam(params, decoupled=kind == "adamw" or params.adam_w_mode)
  return optax.chain(*stages, optax.scale_by_learning_rate(schedule)), schedule
