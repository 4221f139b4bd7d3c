"""Filling Hugging Face's ``"auto"`` values and DeepSpeed's batch triple
(:meth:`jzero.Config.resolve`).

``auto_values`` (keys :data:`AUTO_VALUE_KEYS`) fill what the trainer knows (micro-batch size,
accumulation, clipping, learning rate, fp16 / bf16, ...); the model's hidden size (read from the
attributes :data:`HIDDEN_SIZE_NAMES`) fills the bucket and persistence sizes as Hugging Face does,
and without one they are an error, as in Hugging Face; ``stage3_max_live_parameters: "auto"`` stays
"auto" in stage 3 (jzero chooses the prefetch: :func:`jzero.modeling.gather_units.prefetches`);
every other "auto" takes DeepSpeed's default for its field, with a warning. The batch triple is
then completed and checked as DeepSpeed's ``_set_batch_related_parameters`` does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from jzero.config.blocks import (Bf16Config, Fp16Config, OffloadOptimizerConfig, OffloadParamConfig,
                                 ZeroConfig)
from jzero.config.messages import report, show, warn
from jzero.errors import ConfigError

__all__ = ["AUTO_VALUE_KEYS", "HIDDEN_SIZE_NAMES", "fill", "batch_triple"]

AUTO_VALUE_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "gradient_clipping", "lr",
                   "betas", "eps", "weight_decay", "warmup_num_steps", "fp16", "bf16")
# The attributes a model, or its ``config`` / ``cfg``, gives its width in
# (jzero.modeling.model_adapter reads them): Hugging Face, Flax's examples (Gemma: embed_dim), GPTs.
HIDDEN_SIZE_NAMES = ("hidden_size", "d_model", "embed_dim", "emb_dim")
# DeepSpeed's FusedAdam defaults: the value of an "auto" optimizer param auto_values lacks.
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _fill_batch(data: dict, auto: dict, missing: list[str]) -> None:
  """An "auto" batch key takes ``auto_values``, else is derived from the other two as DeepSpeed
  derives a missing one; a gradient_accumulation_steps that cannot be derived is 1 (said)."""
  if data["train_batch_size"] == "auto":
    data["train_batch_size"] = None  # derived: micro * gas * data-parallel size
  micro = data["train_micro_batch_size_per_gpu"]
  if micro == "auto" or (micro is None and data["train_batch_size"] is None):
    data["train_micro_batch_size_per_gpu"] = auto.get("micro_batch_size")
    if data["train_micro_batch_size_per_gpu"] is None and data["train_batch_size"] is None:
      if micro == "auto":
        missing.append('train_micro_batch_size_per_gpu: is "auto" and train_batch_size does not '
                       "fix it; pass jzero.initialize(..., auto_values={'micro_batch_size': N}) "
                       "(CLI: --micro-batch N)")
  if data["gradient_accumulation_steps"] == "auto":
    gas = auto.get("gradient_accumulation_steps")
    derivable = data["train_batch_size"] is not None and isinstance(
        data["train_micro_batch_size_per_gpu"], int)
    if gas is None and not derivable:
      gas = 1
      warn('gradient_accumulation_steps is "auto" and neither auto_values nor '
            "train_batch_size / train_micro_batch_size_per_gpu fix it: using 1 (DeepSpeed's "
            "default)")
    data["gradient_accumulation_steps"] = gas


def _field_default(block: type[BaseModel], key: str) -> Any:
  """The default of a block's field given by name or alias."""
  field = next(f for name, f in block.model_fields.items() if key in (name, f.alias))
  return field.get_default(call_default_factory=True)


_NAMES = ", ".join(HIDDEN_SIZE_NAMES[:-1]) + f" or {HIDDEN_SIZE_NAMES[-1]}"


def _fill_zero(data: dict, hidden_size: int | None, missing: list[str]) -> None:
  """The hidden-size keys (``rules``) from ``hidden_size``, else one line each in ``missing``;
  any other "auto" of the blocks DeepSpeed validates takes the field's default, with a warning."""
  zero = data["zero_optimization"]
  rules = {"reduce_bucket_size": lambda h: h * h}
  if zero["stage"] == 3:
    rules["stage3_prefetch_bucket_size"] = lambda h: int(0.9 * h * h)
    rules["stage3_param_persistence_threshold"] = lambda h: 10 * h
  for key, rule in rules.items():
    if zero[key] != "auto":
      continue
    if hidden_size is None:
      missing.append(f'zero_optimization.{key}: is "auto"; pass jzero.initialize(..., '
                     f"hidden_size=H) (read from the model's {_NAMES} when it or its config "
                     "has one); jzero derives it from that like Hugging Face")
    else:
      zero[key] = rule(hidden_size)
  blocks = {"zero_optimization": (zero, ZeroConfig),
            "zero_optimization.offload_param": (zero["offload_param"], OffloadParamConfig),
            "zero_optimization.offload_optimizer": (zero["offload_optimizer"],
                                                    OffloadOptimizerConfig),
            "fp16": (data["fp16"], Fp16Config), "bf16": (data["bf16"], Bf16Config)}
  kept = set(rules) | ({"stage3_max_live_parameters"} if zero["stage"] == 3 else set())
  for where, (block, model) in blocks.items():
    for key in [key for key, value in (block or {}).items()
                if value == "auto" and not (model is ZeroConfig and key in kept)]:
      del block[key]  # DeepSpeed drops "auto" keys: the field's default applies
      default = _field_default(model, key)
      if model is ZeroConfig and key == "overlap_comm":
        default = f"{show(zero['stage'] == 3)} (true for stage 3)"
      warn(f'{where}.{key} is "auto": using DeepSpeed\'s default '
            f"{default if isinstance(default, str) else show(default)}")


def _fill_optimizer(data: dict, auto: dict, missing: list[str]) -> None:
  if data["optimizer"] is None:
    return
  params = data["optimizer"]["params"]
  for key, value in params.items():
    if value != "auto":
      continue
    if key in auto:
      params[key] = auto[key]
    elif key in _ADAM_DEFAULTS:
      params[key] = _ADAM_DEFAULTS[key]
      warn(f'optimizer.params.{key} is "auto" and auto_values has no {key!r}: using '
            f"DeepSpeed's FusedAdam default {show(params[key])}")
    else:
      missing.append(f'optimizer.params.{key}: is "auto" but jzero only fills lr, betas, eps '
                     "and weight_decay; give a value")


def _fill_scheduler(data: dict, auto: dict, total_num_steps: int | None,
                    missing: list[str]) -> None:
  if data["scheduler"] is None:
    return
  optimizer = data["optimizer"]
  fills = {
      "warmup_min_lr": 0,
      "warmup_max_lr": optimizer["params"].get("lr", 1e-3) if optimizer else auto.get("lr"),
      "total_num_steps": total_num_steps,
      "warmup_num_steps": auto.get("warmup_num_steps"),
  }
  how = {
      "warmup_max_lr": "there is no optimizer block; pass jzero.initialize(..., "
                       "auto_values={'lr': LR})",
      "total_num_steps": "pass jzero.initialize(..., total_num_steps=N) (CLI: --steps N)",
      "warmup_num_steps": "pass jzero.initialize(..., auto_values={'warmup_num_steps': N}) "
                          "(CLI: --warmup-steps N)",
  }
  params = data["scheduler"]["params"]
  for key, value in params.items():
    if value != "auto":
      continue
    if fills.get(key) is not None:
      params[key] = fills[key]
      if key == "warmup_min_lr":
        warn('scheduler.params.warmup_min_lr is "auto": using 0 (what Hugging Face fills)')
    else:
      missing.append(f'scheduler.params.{key}: is "auto"; '
                     + how.get(key, "jzero has no value for it; give a value"))


def batch_triple(train: int | None, micro: int | None, gas: int | None, dp: int,
                  source: str | None) -> tuple[int, int, int]:
  """DeepSpeed's ``_set_batch_related_parameters`` + ``_batch_assertion``, with a clear error."""
  given = (train, micro, gas)
  if train is not None and micro is not None and gas is not None:
    pass
  elif train is not None and micro is not None:
    gas = train // micro // dp
  elif train is not None and gas is not None:
    micro = train // dp // gas
  elif micro is not None and gas is not None:
    train = micro * gas * dp
  elif train is not None:
    micro, gas = train // dp, 1
  elif micro is not None:
    train, gas = micro * dp, 1
  else:
    raise ConfigError(report(source, "invalid batch size", [
        "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided (or "
        "pass jzero.initialize(..., auto_values={'micro_batch_size': N}))"]))
  if train == micro * gas * dp:  # train >= 1, so the derived values are > 0 too
    return train, micro, gas
  if given[0] is not None and None in given[1:]:  # a derived value that cannot be whole
    if given[1] is not None:
      derived, factor, unit = "gradient_accumulation_steps", f"train_micro_batch_size_per_gpu " \
          f"{given[1]} * data-parallel size {dp} = {given[1] * dp}", given[1] * dp
    elif given[2] is not None:
      derived, factor, unit = "train_micro_batch_size_per_gpu", f"gradient_accumulation_steps " \
          f"{given[2]} * data-parallel size {dp} = {given[2] * dp}", given[2] * dp
    else:
      derived, factor, unit = "train_micro_batch_size_per_gpu", f"the data-parallel size {dp}", dp
    raise ConfigError(report(source, "invalid batch size", [
        f"train_batch_size {train} is not a multiple of {factor}, so no whole {derived} "
        f"gives it; fix: a train_batch_size that is a multiple of {unit} (e.g. "
        f"{max(unit, train // unit * unit)}), or give {derived} too"]))

  raise ConfigError(report(source, "invalid batch size", [
      f"train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) * "
      f"gradient_accumulation_steps ({gas}) * data-parallel size ({dp}) = "
      f"{micro * gas * dp}; fix: give values with train_batch_size = "
      f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * {dp}, or give two of "
      'them (or "auto") and jzero derives the third'
  ]))


def fill(data: dict, source: str | None, *, dp_world_size: int, hidden_size: int | None = None,
         total_num_steps: int | None = None, auto_values: dict[str, Any] | None = None) -> dict:
  """:meth:`Config.resolve`'s first half: a config's ``to_dict()`` with every "auto" replaced
  (the batch triple completed by :func:`batch_triple` once validated); ``source`` names the file in
  errors."""
  auto = dict(auto_values or {})
  if unknown := [key for key in auto if key not in AUTO_VALUE_KEYS]:
    raise ConfigError(f"auto_values: unknown keys {unknown}; known: {list(AUTO_VALUE_KEYS)}")
  if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
    raise ConfigError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
  missing = []
  for name in ("fp16", "bf16"):
    if data[name]["enabled"] == "auto":
      data[name]["enabled"] = auto.get(name, False)
      if name not in auto:
        warn(f'{name}.enabled is "auto" and auto_values has no {name!r}: training without '
              f"{name} (DeepSpeed's default false); pass jzero.initialize(..., "
              f"auto_values={{{name!r}: True}}) to enable it")
  if data["gradient_clipping"] == "auto":
    data["gradient_clipping"] = auto.get("gradient_clipping", 1.0)
    if "gradient_clipping" not in auto:
      warn('gradient_clipping is "auto" and auto_values has no \'gradient_clipping\': '
            "clipping at 1.0 (DeepSpeed's default)")
  _fill_batch(data, auto, missing)
  _fill_zero(data, hidden_size, missing)
  _fill_optimizer(data, auto, missing)
  _fill_scheduler(data, auto, total_num_steps, missing)
  if missing:
    raise ConfigError(report(source, 'cannot resolve "auto"', missing))
  return data
