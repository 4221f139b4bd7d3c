"""The tier interface (jzero.tiers.base): a new tier is its own class plus one registry entry.

A tier whose update (:class:`jzero.tiers.base.Update`, the outermost link of the chain) hands each
step's clipping factor out of the jitted step (``update``'s outputs) and collects it after the
step (``after``) in its resource, registered by ``registry.register``: the
engine's step carries it out unchanged -- the run is bit for bit the plain one -- and every factor
arrives, equal to DeepSpeed's ``min(1, clip / (norm + 1e-6))`` of the step's own norm."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.tiers import registry
from jzero.tiers.base import Tier, Update
from zero_testing import SMALL, batches, ds_config, make_engine

N = 8


class ClipFactorLog(Tier):
  """Each step's clipping factor, taken out of the jit and kept in its resource (a list)."""

  name = "clip_factor_log"
  wraps = "step"  # outside the clipping: the factor arrives unapplied

  @classmethod
  def uses(cls, plan):
    return True

  @classmethod
  def open(cls, plan, config, tx):
    return []

  @classmethod
  def update(cls, plan, config, tx, resource, inner, *, elementwise):
    return FactorOut(inner)

  @classmethod
  def after_step(cls, plan, config, tx, resource):
    return lambda state, metrics, outputs: (
        resource.append(float(outputs[cls.name])) or state)


class FactorOut(Update):
  def __init__(self, inner):
    super().__init__(inner)

  @property
  def output_specs(self):
    return {**self.inner.output_specs, ClipFactorLog.name: P()}

  def update(self, grads, state, skip=None, factor=None):
    new, outputs = self.inner.update(grads, state, skip, factor)
    return new, {**outputs, ClipFactorLog.name: factor}


def _run(config, data):
  engine = make_engine(config)
  state = engine.init(jax.random.key(0))
  norms = []
  for batch in data:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    norms.append(float(metrics["grad_norm"]))
  return engine, state, norms


def test_a_registered_tier_gets_its_hooks_called():
  data = batches(SMALL.seq_len, N, 3)
  config = {**ds_config(2), "gradient_clipping": 0.05}
  plain, plain_state, _ = _run(config, data)
  assert plain.tiers == ()
  registry.register(ClipFactorLog)
  try:
    engine, state, norms = _run(config, data)
    assert engine.tiers == (ClipFactorLog,)
  finally:
    registry.unregister(ClipFactorLog)
  factors = engine.resources[ClipFactorLog.name]
  assert len(factors) == 3
  np.testing.assert_allclose(factors, [min(1.0, 0.05 / (n + 1e-6)) for n in norms], rtol=1e-6)
  assert min(factors) < 1.0  # the clip acted
  for a, b in zip(jax.tree.leaves(engine.logical_params(state)),
                  jax.tree.leaves(plain.logical_params(plain_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
