"""jzero.train.optim against pure-Python transcriptions of DeepSpeed's schedules and optimizers.

The ``_DS*`` classes below transcribe ``deepspeed/runtime/lr_schedules.py`` (master): constructor at
``last_batch_iteration=-1`` writing ``get_lr()`` into the optimizer, ``step()`` incrementing it. The
driver runs them the way ``engine._take_model_step`` does: ``optimizer.step()`` (which reads the
current lr), then ``lr_scheduler.step()``.

Tolerance: the schedules compute in float32, whose rounding alone is up to 6e-8 relative; the
comparisons allow 5e-7 (a few float32 ulps) against DeepSpeed's float64 arithmetic.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jzero.errors import ConfigError, JZeroWarning, NotSupportedError
from jzero.train.optim import build_optimizer, build_schedule

# The schedules in fp32 against DeepSpeed's formulas in float64: a few fp32 operations on values
# <= 1 (a product, a quotient, a cos or log), each rounding within u = 6e-8: <= 8u = 4.8e-7.
RTOL = 5e-7
STEPS = 301
# The optimizers in fp32 against a float64 numpy loop, 10 steps on N(0, 1) params and gradients:
# each step rounds ~10 elementwise operations (<= 10u = 6e-7 relative), summed over 10 steps
# <= 6e-6 < OPT_RTOL; OPT_ATOL for the elements the updates carry through zero.
OPT_RTOL, OPT_ATOL = 1e-5, 1e-6


class _Optimizer:

  def __init__(self, lr):
    self.param_groups = [{"lr": lr}]


class _DSWarmupLR:

  def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
               warmup_type="log", last_batch_iteration=-1):
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
      raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    self.optimizer = optimizer
    if warmup_max_lr is None:
      warmup_max_lr = optimizer.param_groups[0]["lr"]
    self.min_lr = warmup_min_lr
    self.delta_lr = warmup_max_lr - warmup_min_lr
    self.warmup_num_steps = max(2, warmup_num_steps)
    self.warmup_type = warmup_type if warmup_type in ("log", "linear") else "log"
    self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
    self.last_batch_iteration = last_batch_iteration
    if last_batch_iteration == -1:
      self.optimizer.param_groups[0]["lr"] = self.get_lr()

  def get_lr(self):
    if self.last_batch_iteration < 0:
      return self.min_lr
    return self.min_lr + self.delta_lr * self._get_gamma()

  def _warmup_gamma(self):
    if self.warmup_type == "log":
      return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
    return self.last_batch_iteration / self.warmup_num_steps

  def _get_gamma(self):
    if self.last_batch_iteration < self.warmup_num_steps:
      return self._warmup_gamma()
    return 1.0

  def step(self):
    self.last_batch_iteration += 1
    self.optimizer.param_groups[0]["lr"] = self.get_lr()


class _DSWarmupDecayLR(_DSWarmupLR):

  def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
               warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
    self.total_num_steps = total_num_steps
    super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                     last_batch_iteration)

  def _get_gamma(self):
    if self.last_batch_iteration < self.warmup_num_steps:
      return self._warmup_gamma()
    return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
               / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class _DSWarmupCosineLR:

  def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
               cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
      raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    self.optimizer = optimizer
    self.total_num_steps = total_num_steps
    self.last_batch_iteration = last_batch_iteration
    self.cos_min_ratio = cos_min_ratio
    self.warmup_type = warmup_type if warmup_type in ("log", "linear") else "log"
    self.warmup_min_ratio = warmup_min_ratio
    self.warmup_num_steps = max(2, warmup_num_steps)
    self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
    self.org_lr = optimizer.param_groups[0]["lr"]
    if last_batch_iteration == -1:
      self.optimizer.param_groups[0]["lr"] = self.get_lr()

  def get_lr_ratio(self):
    if self.last_batch_iteration < 0:
      return 0.0
    if self.last_batch_iteration < self.warmup_num_steps:
      if self.warmup_type == "log":
        ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
      else:
        ratio = self.last_batch_iteration / self.warmup_num_steps
      return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
    real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
    real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
    cosine_progress = min(1.0, real_last_step / real_total_steps)
    ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
    return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

  def get_lr(self):
    if self.last_batch_iteration < 0:
      return 0.0
    return self.org_lr * self.get_lr_ratio()

  def step(self):
    self.last_batch_iteration += 1
    self.optimizer.param_groups[0]["lr"] = self.get_lr()


class _DSLRRangeTest:

  def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
               lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
    self.optimizer = optimizer
    self.min_lr = lr_range_test_min_lr
    self.step_size = lr_range_test_step_size
    self.step_rate = lr_range_test_step_rate
    self.staircase = lr_range_test_staircase
    self.last_batch_iteration = last_batch_iteration
    if last_batch_iteration == -1:
      self.optimizer.param_groups[0]["lr"] = self.min_lr

  def get_lr(self):
    interval = float(self.last_batch_iteration + 1) / self.step_size
    if self.staircase:
      interval = math.floor(interval)
    return self.min_lr * (1 + self.step_rate * interval)

  def step(self):
    self.last_batch_iteration += 1
    self.optimizer.param_groups[0]["lr"] = self.get_lr()


_DS_SCHEDULES = {
  "WarmupLR": _DSWarmupLR,
  "WarmupDecayLR": _DSWarmupDecayLR,
  "WarmupCosineLR": _DSWarmupCosineLR,
  "LRRangeTest": _DSLRRangeTest,
}


def _deepspeed_lrs(kind, params, base_lr, steps=STEPS):
  """The lr of each DeepSpeed optimizer step: optimizer.step() reads it, then scheduler.step()."""
  optimizer = _Optimizer(base_lr)
  scheduler = _DS_SCHEDULES[kind](optimizer, **params)
  lrs = []
  for _ in range(steps):
    lrs.append(optimizer.param_groups[0]["lr"])
    scheduler.step()
  return np.array(lrs)


def _jax_lrs(schedule, steps=STEPS):
  return np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(steps)), np.float64)


SCHEDULE_CASES = [
  ("WarmupLR", {}),
  ("WarmupLR", {"warmup_num_steps": 100}),
  ("WarmupLR", {"warmup_num_steps": 100, "warmup_type": "linear"}),
  ("WarmupLR", {"warmup_num_steps": 1, "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3}),
  ("WarmupLR", {"warmup_num_steps": 37, "warmup_min_lr": 1e-6, "warmup_type": "linear"}),
  ("WarmupDecayLR", {"total_num_steps": 250, "warmup_num_steps": 50}),
  ("WarmupDecayLR", {"total_num_steps": 250, "warmup_num_steps": 50, "warmup_type": "linear",
                     "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4}),
  ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 60}),
  ("WarmupCosineLR", {"total_num_steps": 200, "warmup_num_steps": 30}),
  ("WarmupCosineLR", {"total_num_steps": 280, "warmup_num_steps": 25, "warmup_min_ratio": 0.1,
                      "cos_min_ratio": 0.0, "warmup_type": "linear"}),
  ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 40, "cos_min_ratio": 0.05}),
  ("LRRangeTest", {}),
  ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 7,
                   "lr_range_test_step_rate": 0.5}),
  ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10,
                   "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("kind,params", SCHEDULE_CASES)
def test_schedule_matches_deepspeed(kind, params):
  base_lr = 3e-4
  ours = _jax_lrs(build_schedule({"type": kind, "params": params}, base_lr))
  np.testing.assert_allclose(ours, _deepspeed_lrs(kind, params, base_lr), rtol=RTOL, atol=0)


def test_schedule_first_steps_off_by_one():
  warmup = _jax_lrs(build_schedule({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, 1e-3))
  # Steps 0 and 1 both use warmup_min_lr; step n (=10) is the first with warmup_max_lr (log).
  assert warmup[0] == warmup[1] == 0.0
  assert warmup[9] < 1e-3 and warmup[10] == np.float32(1e-3)
  linear = {"warmup_num_steps": 10, "warmup_type": "linear"}
  linear = _jax_lrs(build_schedule({"type": "WarmupLR", "params": linear}, 1e-3))
  assert linear[0] == linear[1] == 0.0 and linear[10] < 1e-3 and linear[11] == np.float32(1e-3)
  cosine = {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.2}
  cosine = _jax_lrs(build_schedule({"type": "WarmupCosineLR", "params": cosine}, 1e-3))
  # WarmupCosineLR's constructor writes lr 0, not warmup_min_ratio * lr.
  assert cosine[0] == 0.0 and cosine[1] == pytest.approx(2e-4, rel=RTOL)


def test_constant_schedule_without_scheduler():
  np.testing.assert_array_equal(_jax_lrs(build_schedule(None, 2e-4), 5), np.float32(2e-4))


def test_schedule_accepts_a_traced_scalar_count():
  schedule = build_schedule({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, 1e-3)
  assert jax.jit(schedule)(jnp.int32(3)).dtype == jnp.float32
  assert float(jax.jit(schedule)(3)) == pytest.approx(1e-3 * math.log(3) / math.log(10), rel=RTOL)


def test_schedule_errors():
  with pytest.raises(NotSupportedError, match=r"scheduler.type: 'OneCycle'.*WarmupLR"):
    build_schedule({"type": "OneCycle", "params": {}}, 1e-3)
  with pytest.raises(NotSupportedError, match="scheduler.type: 'StepLR'"):
    build_schedule({"type": "StepLR", "params": {}}, 1e-3)
  with pytest.raises(ConfigError, match=r'scheduler.params.warmup_num_step:.*"warmup_num_steps"'):
    build_schedule({"type": "WarmupLR", "params": {"warmup_num_step": 10}}, 1e-3)
  for bad in (0, -5, 2.5, True):
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps: (must be a positive "
                                          "integer|expected an integer)"):
      build_schedule({"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 9, "warmup_num_steps": bad}}, 1e-3)
  with pytest.raises(ConfigError, match="scheduler.params.total_num_steps: required"):
    build_schedule({"type": "WarmupDecayLR", "params": {}}, 1e-3)
  with pytest.raises(ConfigError, match="scheduler.params.warmup_max_lr: expected a number"):
    build_schedule({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}, 1e-3)
  with pytest.raises(NotSupportedError, match="scheduler.params.last_batch_iteration"):
    build_schedule({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, 1e-3)
  with pytest.warns(JZeroWarning, match="warmup_type"):
    build_schedule({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, 1e-3)


def _run(tx, params, grads):
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in grads:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def _numpy_adam(p, grads, lrs, b1, b2, eps, wd, decoupled):
  """FusedAdam's multi_tensor_adam kernel (ADAM_MODE_1 decoupled, ADAM_MODE_0 L2) in float64."""
  m, v = np.zeros_like(p), np.zeros_like(p)
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    if not decoupled:
      g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    if decoupled:
      update = update + wd * p
    p = p - lr * update
  return p


def _problem(seed=0, n=64, steps=10):
  rng = np.random.default_rng(seed)
  p = rng.normal(size=n)
  grads = [rng.normal(size=n) for _ in range(steps)]
  return p, grads


@pytest.mark.parametrize("name,adam_w_mode,decoupled", [
  ("Adam", True, True),
  ("Adam", False, False),
  ("adamw", True, True),
  ("AdamW", False, True),  # DeepSpeed: type AdamW is decoupled whatever adam_w_mode says
  ("ADAM", None, True),  # adam_w_mode defaults to true
])
def test_adam_matches_fused_adam(name, adam_w_mode, decoupled):
  p, grads = _problem()
  params = {"lr": 1e-2, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
            "torch_adam": False}
  if adam_w_mode is not None:
    params["adam_w_mode"] = adam_w_mode
  tx, _ = build_optimizer({"type": name, "params": params}, None)
  ours = _run(tx, jnp.asarray(p, jnp.float32), [jnp.asarray(g, jnp.float32) for g in grads])
  expected = _numpy_adam(p, grads, [1e-2] * 10, 0.8, 0.95, 1e-6, 0.1, decoupled)
  np.testing.assert_allclose(ours, expected, rtol=OPT_RTOL, atol=OPT_ATOL)


def test_adam_defaults_and_schedule_wiring():
  p, grads = _problem(seed=1, steps=12)
  scheduler = {"type": "WarmupDecayLR",
               "params": {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_max_lr": 1e-2}}
  tx, _ = build_optimizer({"type": "Adam", "params": {}}, scheduler)
  ours = _run(tx, jnp.asarray(p, jnp.float32), [jnp.asarray(g, jnp.float32) for g in grads])
  lrs = _deepspeed_lrs("WarmupDecayLR", scheduler["params"], 1e-3, steps=12)
  expected = _numpy_adam(p, grads, lrs, 0.9, 0.999, 1e-8, 0.0, True)
  np.testing.assert_allclose(ours, expected, rtol=OPT_RTOL, atol=OPT_ATOL)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch(nesterov):
  p, grads = _problem(seed=2)
  lr, momentum, wd = 0.05, 0.9, 0.01
  params = {"lr": lr, "momentum": momentum, "weight_decay": wd, "nesterov": nesterov}
  tx, _ = build_optimizer({"type": "SGD", "params": params}, None)
  ours = _run(tx, jnp.asarray(p, jnp.float32), [jnp.asarray(g, jnp.float32) for g in grads])
  expected, buf = p.copy(), None  # torch.optim.SGD._single_tensor_sgd, dampening 0
  for g in grads:
    g = g + wd * expected
    buf = g.copy() if buf is None else momentum * buf + g
    expected = expected - lr * (g + momentum * buf if nesterov else buf)
  np.testing.assert_allclose(ours, expected, rtol=OPT_RTOL, atol=OPT_ATOL)


def test_plain_sgd_keeps_no_momentum_buffer():
  tx, _ = build_optimizer({"type": "SGD", "params": {"lr": 0.1}}, None)
  assert not any(leaf.size > 1 for leaf in jax.tree.leaves(tx.init(jnp.zeros(1000))))


def test_lion_matches_fused_lion():
  p, grads = _problem(seed=3)
  lr, b1, b2, wd = 3e-3, 0.9, 0.99, 0.1
  tx, _ = build_optimizer({"type": "Lion", "params": {"lr": lr, "betas": [b1, b2],
                                                     "weight_decay": wd}}, None)
  ours = _run(tx, jnp.asarray(p, jnp.float32), [jnp.asarray(g, jnp.float32) for g in grads])
  expected, m = p.copy(), np.zeros_like(p)  # multi_tensor_lion LionFunctor
  for g in grads:
    c = b1 * m + (1 - b1) * g
    expected = expected * (1 - lr * wd) - lr * np.sign(c)
    m = b2 * m + (1 - b2) * g
  np.testing.assert_allclose(ours, expected, rtol=OPT_RTOL, atol=OPT_ATOL)


@pytest.mark.parametrize("name", ["AdamW", "Lion", "SGD"])
def test_transformation_is_elementwise_per_leaf(name):
  params = {"momentum": 0.9} if name == "SGD" else {}
  tx, _ = build_optimizer({"type": name, "params": {**params, "weight_decay": 0.1}}, None)
  p, grads = _problem(seed=4, n=10, steps=3)
  whole = _run(tx, jnp.asarray(p, jnp.float32), [jnp.asarray(g, jnp.float32) for g in grads])
  split = _run(tx, (jnp.asarray(p[:3], jnp.float32), jnp.asarray(p[3:], jnp.float32)),
               [(jnp.asarray(g[:3], jnp.float32), jnp.asarray(g[3:], jnp.float32)) for g in grads])
  np.testing.assert_array_equal(np.concatenate(split), whole)


def test_optimizer_errors():
  with pytest.raises(ConfigError, match='no "optimizer" block.*jzero.initialize'):
    build_optimizer(None, None)
  with pytest.raises(NotSupportedError, match=r"optimizer.type: 'Lamb'.*Adam, AdamW, Lion.*SGD"):
    build_optimizer({"type": "Lamb", "params": {}}, None)
  with pytest.raises(NotSupportedError, match="optimizer.type: 'sgd'.*exact case"):
    build_optimizer({"type": "sgd", "params": {}}, None)
  with pytest.raises(ConfigError, match=r'optimizer.params.weight_decy:.*"weight_decay"'):
    build_optimizer({"type": "AdamW", "params": {"weight_decy": 0.1}}, None)
  with pytest.raises(ConfigError, match="'max_grad_norm' is not supported as an optimizer "
                                        "parameter, please switch to using the deepspeed "
                                        "parameter 'gradient_clipping'"):
    build_optimizer({"type": "Adam", "params": {"max_grad_norm": 1.0}}, None)
  with pytest.raises(NotSupportedError, match="optimizer.params.amsgrad"):
    build_optimizer({"type": "Adam", "params": {"amsgrad": True}}, None)
  with pytest.raises(NotSupportedError, match="optimizer.params.bias_correction"):
    build_optimizer({"type": "Adam", "params": {"bias_correction": False}}, None)
  with pytest.raises(NotSupportedError, match="optimizer.params.dampening"):
    build_optimizer({"type": "SGD", "params": {"momentum": 0.9, "dampening": 0.1}}, None)
  with pytest.raises(ConfigError, match="optimizer.params.nesterov"):
    build_optimizer({"type": "SGD", "params": {"nesterov": True}}, None)
  with pytest.raises(ConfigError, match="optimizer.params.betas"):
    build_optimizer({"type": "Adam", "params": {"betas": [0.9]}}, None)
  with pytest.raises(ConfigError, match="optimizer.params.lr: expected a number"):
    build_optimizer({"type": "Adam", "params": {"lr": "auto"}}, None)


def test_warmup_max_lr_defaults_to_optimizer_lr():
  _, schedule = build_optimizer({"type": "AdamW", "params": {"lr": 5e-4}},
                                {"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
  assert float(schedule(100)) == np.float32(5e-4)
  _, schedule = build_optimizer({"type": "Lion", "params": {}},
                                {"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
  assert float(schedule(100)) == np.float32(1e-3)  # FusedLion's default lr
