"""Delayed parameter update (DPU): step t updates with step t-1's gradient (ZeRO-Offload, opt-in).

``zero_optimization.offload_optimizer.delayed_update: true`` is jzero's own key: DeepSpeed's config
schema has no switch for the one-step delayed parameter update of the ZeRO-Offload paper (Ren et
al., 2021). It needs ``offload_optimizer.device: cpu`` (refused otherwise, before any device work):
hiding the host update is its only purpose, and it changes the math.

**The math.** Write p_t for the parameters after step t (p_0: the initial ones), b_t for step t's
global batch, G(p, b) for the step's gradient -- reduced over the devices, accumulated over the
micro-batches, unscaled (fp16) and clipped by *its own* global norm -- and U(p, g) for one optax
update (which also advances the optimizer state). A plain step is p_t = U(p_{t-1}, G(p_{t-1}, b_t)).
With the delayed update, step t computes g_t = G(p_{t-1}, b_t) with the parameters it is given and
updates with the gradient the previous step computed::

    p_1 = p_0                               (step 1 only computes and keeps g_1)
    p_t = U(p_{t-1}, g_{t-1}),  g_{t-1} = G(p_{t-2}, b_{t-1})     for t >= 2

so every gradient is applied exactly once, one step late, and each was computed with parameters one
update older than a plain run's. The last step's gradient stays carried in the state (and in its
checkpoint) until a further step applies it.

**Not a tier, a transformation.** The delayed update changes *when* a gradient is applied, not where
state lives: :class:`DelayedUpdate` is shaped like optax's wrappers (``MultiSteps``,
``apply_if_finite``) -- ``init`` makes its own state, ``update`` turns the step's gradient into the
one to apply and the state to carry -- but it transforms the gradient the step's update applies
rather than wrapping the optax transformation: the optimizer state lives in host memory (it needs
``device: cpu``), and the carried gradient must stay on the device, where the next step's update
reads it before that state is brought in. The step (:func:`jzero.train.update.local_update`), the
state's layout, the init, the checkpoint restore and the host's choice of step variant call it
directly.

**The state.** :class:`DelayedGrads` -- the carried gradient and whether it is ready to apply --
is the train state's ``delayed`` field: fp32, in the plan's *state layout* (partitioned over the
ZeRO axes like the reduced gradient, padded like the master), in device memory. It costs 4 bytes
per parameter / N per device, which the estimator (``estimate(..., delayed_update=True)``) and the
memory report ("delayed_grads") count. Checkpoints save it and restore it (resharded like the
master), so a resumed run is exact; restoring a checkpoint without it (or ``params_only``) starts
with nothing carried, so the first step after the restore only computes its gradient.

**Overlap.** Inside one step the optimizer update of g_{t-1} (host state brought in and written
back, or the host computation) reads nothing the forward and backward of step t produce, so XLA is
free to run them concurrently -- the overlap DeepSpeed's DPU gets from its CPU thread. Only writing
the new parameters into the (donated) parameter buffers waits for the forward and backward's reads.
To keep a ``lax.cond`` (a scheduling barrier) out of the step, the engine compiles two variants when
no overflow check is on: a *prime* step for when nothing is carried (it applies no update), and the
*steady* step, which always applies. It knows which one a state needs without reading the device:
the ``ready`` flag it returned last is known true; any other state's flag is read once.

**Warm-up.** The ZeRO-Offload paper starts the delayed update only after the first training
steps, whose gradients change fastest. ``offload_optimizer.delayed_update_warmup: W`` (jzero's
key, default 0) runs steps 1..W as plain steps (p_t = U(p_{t-1}, G(p_{t-1}, b_t)), nothing
carried); from step W+1 the delayed update runs as above, step W+1 taking the place of step 1
(it computes and carries g_{W+1} and applies nothing). The engine picks the *warm-up* step
(a third compiled variant, :data:`WARMUP`) from its host-side step count, so the step has no cond
on it; a run resumed inside the warm-up continues it.

**fp16 / overflow.** The overflow check, the unscaling and the clipping happen when a gradient is
computed: if g_t overflows, step t backs the loss scale off (and counts the step as skipped) at
once, as a plain run does, and carries g_t as not ready, so step t+1 applies no update. The steps'
``grad_norm`` and ``overflow`` metrics are those of the gradient computed in the step, ``loss`` is
the loss at p_{t-1}, and ``lr`` is the rate of the update applied in the step (the next one if
none). Gradient accumulation is unchanged: the carried gradient is the step's accumulated one.
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.sharding.plan import flatten_paths

__all__ = ["DelayedGrads", "DelayedUpdate", "WARMUP", "enabled", "warmup_steps"]

PyTree = Any
PREFIX = "delayed"  # the train state's field, and the checkpoint's array names' first part
#: The variant of a warm-up step: it applies its own gradient and carries nothing.
WARMUP = "warmup"


class DelayedGrads(NamedTuple):
  """The gradient a delayed-update step carries to the next one.

  Attributes:
    grads: fp32 gradients in the plan's state layout (unscaled, clipped), on the device.
    ready: bool scalar: ``grads`` holds a gradient the next step applies (False after init, after
      a restore without one, and after an fp16 overflow).
  """

  grads: PyTree
  ready: jax.Array


def enabled(zero: Any) -> bool:
  """Whether ``zero_optimization`` asks for the delayed update.

  Raises:
    ConfigError: ``delayed_update`` without ``offload_optimizer.device: cpu``.
  """
  block = zero.offload_optimizer
  if block is not None and block.delayed_update_warmup and not block.delayed_update:
    raise ConfigError(
        f"zero_optimization.offload_optimizer.delayed_update_warmup="
        f"{block.delayed_update_warmup} has no delayed update to warm up: set delayed_update: "
        f"true, or remove delayed_update_warmup.")
  if block is None or not block.delayed_update:
    return False
  if block.device != "cpu":
    raise ConfigError(
        f"zero_optimization.offload_optimizer.delayed_update=true needs "
        f"offload_optimizer.device: cpu (got {block.device!r}): the delayed parameter update "
        f"exists to hide the host optimizer step behind the next forward and backward, and it "
        f"changes the math by one step. Set device: cpu, or remove delayed_update.")
  return True


def warmup_steps(zero: Any) -> int:
  """Plain steps before the delayed update starts (0 when it is off)."""
  return zero.offload_optimizer.delayed_update_warmup if enabled(zero) else 0


class DelayedUpdate:
  """The delayed update of one engine (module docstring).

  Its steps come in variants the host picks, so no step holds a ``lax.cond`` over them:
  :data:`WARMUP`, the prime step ``False`` (nothing carried: apply nothing), the steady step
  ``True`` (apply the carried gradient), or ``None`` (read the carried flag in the step). The
  steady step may assume a gradient is carried when no overflow check can make one unready; the
  ``ready`` array of the state the last steady or prime step returned is known true, any other
  state's flag is read from the device once.
  """

  #: The key of its variant in a step's variants.
  name = "delayed"

  def __init__(self, warmup: int, static_ready: bool | None):
    self.warmup, self.static_ready = warmup, static_ready
    self._ready_seen: Any = None  # the ready array of the last state a step returned

  @classmethod
  def from_config(cls, config: Any) -> DelayedUpdate | None:
    """The delayed update a resolved config asks for, or None (refusals: :func:`enabled`)."""
    zero = config.zero_optimization
    if not enabled(zero):
      return None
    return cls(warmup_steps(zero), None if config.checks_overflow else True)

  # -- its state: the train state's ``delayed`` field ------------------------------------------
  @staticmethod
  def specs(plan: Any) -> DelayedGrads:
    """PartitionSpecs of the carried state: the gradient in the state layout."""
    return DelayedGrads(grads=plan.state_specs(), ready=P())

  @staticmethod
  def memory_kinds(plan: Any, device: str | None) -> DelayedGrads:
    """Memory kinds of the carried state: all on the device (``device``: its kind)."""
    return DelayedGrads(grads=plan.map(lambda _: device), ready=device)

  @staticmethod
  def init(state_layout: PyTree) -> DelayedGrads:
    """Nothing carried: zeros shaped like the state layout (traced inside the engine's init)."""
    return DelayedGrads(grads=jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                                           state_layout), ready=jnp.zeros((), bool))

  @staticmethod
  def restore_names(abstract: Any, stored: dict, params_only: bool) -> list[str]:
    """The carried state's array names a restore reads: all of them when the checkpoint has
    them (and the restore is not ``params_only``), else none (``abstract``: the engine's abstract
    TrainState; ``stored``: the checkpoint's array table)."""
    if abstract.delayed is None or params_only:
      return []
    names = [f"{PREFIX}/{n}" for n in flatten_paths(abstract.delayed)]
    return names if all(n in stored for n in names) else []

  def restored(self, abstract: Any, shardings: Any, read: dict[str, jax.Array], stored: dict,
               params_only: bool) -> DelayedGrads:
    """The carried state of a restore: the checkpoint's (:meth:`restore_names`, read into
    ``read``), else nothing carried (``shardings``: the state's, expanded to ``abstract``)."""
    names = self.restore_names(abstract, stored, params_only)
    if names:
      return jax.tree.unflatten(jax.tree.structure(abstract.delayed), [read[n] for n in names])
    return jax.jit(self.init, out_shardings=shardings.delayed)(abstract.delayed.grads)

  # -- in the step -----------------------------------------------------------------------------
  @staticmethod
  def update(carried: DelayedGrads, grads: PyTree, overflow: jax.Array,
             variant: Hashable) -> tuple[PyTree, Any, DelayedGrads]:
    """The gradient to update with, whether to skip the update, and what to carry.

    Args:
      carried: the state's carried gradient (g_{t-1}).
      grads: this step's unscaled, clipped gradient (g_t).
      overflow: g_t overflowed (fp16): carry it as not ready.
      variant: what is known statically about ``carried.ready`` (None: read it), or
        :data:`WARMUP`: a plain step, which applies g_t (unless it overflowed) and carries
        ``carried`` unchanged.

    Returns:
      (gradient to apply, skip -- True, False or a bool array --, the new DelayedGrads).
    """
    if variant == WARMUP:
      return grads, overflow, carried
    new = DelayedGrads(grads=grads, ready=jnp.logical_not(overflow))
    skip = jnp.logical_not(carried.ready) if variant is None else not variant
    return carried.grads, skip, new

  @staticmethod
  def checks_finite(variant: Hashable) -> bool:
    """fp32: whether a non-finite gradient norm skips the step of ``variant`` (the steady step
    always applies; the engine warns)."""
    return variant == WARMUP

  @staticmethod
  def applied_steps(carried: DelayedGrads, applied: jax.Array) -> jax.Array:
    """The count of updates applied (the lr schedule's step): the carried one is not yet."""
    return applied - carried.ready.astype(applied.dtype)

  # -- on the host -----------------------------------------------------------------------------
  def variant(self, state: Any, step: int | None, fused: bool) -> Hashable:
    """The step variant ``state`` needs at host step ``step`` (``state`` and ``step`` None: the
    steady step, e.g. for :meth:`jzero.Engine.jitted_step`); ``fused``: one jit (False: the timed
    two-jit step of ``wall_clock_breakdown``, which reads the carried flag)."""
    if step is not None and step < self.warmup:
      return WARMUP
    if not fused:
      return None
    if state is not None and self._needs_prime(state):
      return False
    return self.static_ready

  def _needs_prime(self, state: Any) -> bool:
    """The state carries no gradient and the steady step would apply one."""
    if self.static_ready is None or state.delayed.ready is self._ready_seen:
      return False
    return not bool(state.delayed.ready)

  def seen(self, state: Any, variant: Hashable) -> None:
    """The step of ``variant`` returned ``state``."""
    if self.static_ready is not None and variant in (True, False):  # a warm-up carries nothing
      self._ready_seen = state.delayed.ready
