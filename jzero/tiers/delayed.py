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

**Not a tier, a link of the update.** The delayed update changes *when* a gradient is applied, not
where state lives: :class:`DelayedUpdate` is one optax-shaped link of the step's update chain
(:class:`jzero.tiers.base.Update`, like optax's ``MultiSteps``): ``init`` makes its own state,
``update`` carries the step's clipped gradient and hands the carried one to the links below it
(the non-finite skip, the host's update). The carried gradient stays on the device, where the next
step's update reads it before the host-memory optimizer state is brought in (it needs ``device:
cpu``). The host picks the step's variant (:meth:`DelayedUpdate.variant`) and writes it into the
state (:class:`DelayedGrads`' static ``variant``), so the step is a function of its state alone.

**The state.** :class:`DelayedGrads` -- the carried gradient, whether it is ready to apply, and
(static, part of its tree structure) the variant of the step it goes into -- is the train state's
``delayed`` field: fp32, in the plan's *state layout* (partitioned over the
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
*steady* step, which always applies (:class:`Variant`). It knows which one a state needs without
reading the device: a state a prime or steady step returned is labelled so, and its flag is known
true; any other state's flag is read once.

**Warm-up.** The ZeRO-Offload paper starts the delayed update only after the first training
steps, whose gradients change fastest. ``offload_optimizer.delayed_update_warmup: W`` (jzero's
key, default 0) runs steps 1..W as plain steps (p_t = U(p_{t-1}, G(p_{t-1}, b_t)), nothing
carried); from step W+1 the delayed update runs as above, step W+1 taking the place of step 1
(it computes and carries g_{W+1} and applies nothing). The engine picks the *warm-up* step
(a third compiled variant, :attr:`Variant.WARMUP`) from its host-side step count, so the step has no cond
on it; a run resumed inside the warm-up continues it.

**fp16 / overflow.** The overflow check, the unscaling and the clipping happen when a gradient is
computed: if g_t overflows, step t backs the loss scale off (and counts the step as skipped) at
once, as a plain run does, and carries g_t as not ready, so step t+1 applies no update. The steps'
``grad_norm`` and ``overflow`` metrics are those of the gradient computed in the step, ``loss`` is
the loss at p_{t-1}, and ``lr`` is the rate of the update applied in the step (the next one if
none). Gradient accumulation is unchanged: the carried gradient is the step's accumulated one.
"""


from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.sharding.plan import flatten_paths
from jzero.tiers.base import Update

__all__ = ["DelayedGrads", "DelayedUpdate", "Variant", "enabled", "warmup_steps"]

PyTree = Any
PREFIX = "delayed"  # the train state's field, and the checkpoint's array names' first part


class Variant(enum.Enum):
  """The compiled variants of a delayed-update step (module docstring), written into the state
  the step takes (:attr:`DelayedGrads.variant`)."""

  #: A plain step: it applies its own gradient and carries nothing new.
  WARMUP = "warmup"
  #: Nothing is carried: it applies no update and carries its gradient.
  PRIME = "prime"
  #: The carried gradient is ready: it applies it, with no condition in the step.
  APPLY = "apply"
  #: Whether the carried gradient is ready is read in the step (a state whose flag the host does
  #: not know without reading it, an overflow check that can make it unready, the timed step).
  READ = "read"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedGrads:
  """The gradient a delayed-update step carries to the next one.

  Attributes:
    grads: fp32 gradients in the plan's state layout (unscaled, clipped), on the device.
    ready: bool scalar: ``grads`` holds a gradient the next step applies (False after init, after
      a restore without one, and after an fp16 overflow).
    variant: static (part of the tree structure): the variant of the step this state goes into
      (:meth:`DelayedUpdate.variant` writes it; a step returns it as it came).
  """

  grads: PyTree
  ready: jax.Array
  variant: Variant = dataclasses.field(default=Variant.READ, metadata={"static": True})


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


class DelayedUpdate(Update):
  """The delayed update (module docstring): the link of the step's update that carries the
  gradient (``inner``: the links below it, set by :meth:`wrap`), and the host's choice of the
  step's :class:`Variant`. ``static_ready``: True when no overflow check can make a carried
  gradient unready (the steady step may assume one is carried); None otherwise."""

  def __init__(self, warmup: int, static_ready: bool | None, inner: Update | None = None):
    super().__init__(inner)
    self.warmup, self.static_ready = warmup, static_ready

  @classmethod
  def from_config(cls, config: Any) -> DelayedUpdate | None:
    """The delayed update a resolved config asks for, or None (refusals: :func:`enabled`)."""
    zero = config.zero_optimization
    if not enabled(zero):
      return None
    return cls(warmup_steps(zero), None if config.checks_overflow else True)

  def wrap(self, inner: Update) -> DelayedUpdate:
    """This delayed update as the link over ``inner``."""
    return type(self)(self.warmup, self.static_ready, inner)

  # -- its state: the train state's ``delayed`` field ------------------------------------------
  @staticmethod
  def specs(plan: Any, variant: Variant = Variant.READ) -> DelayedGrads:
    """PartitionSpecs of the carried state: the gradient in the state layout."""
    return DelayedGrads(grads=plan.state_specs(), ready=P(), variant=variant)

  @staticmethod
  def memory_kinds(plan: Any, device: str | None, variant: Variant = Variant.READ) -> DelayedGrads:
    """Memory kinds of the carried state: all on the device (``device``: its kind)."""
    return DelayedGrads(grads=plan.map(lambda _: device), ready=device, variant=variant)

  @staticmethod
  def fresh(layout: PyTree) -> DelayedGrads:
    """Nothing carried: zeros shaped like the state layout."""
    return DelayedGrads(grads=jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), layout),
                        ready=jnp.zeros((), bool))

  def init(self, layout: PyTree) -> dict:
    return {**(self.inner.init(layout) if self.inner is not None else {}),
            "delayed": self.fresh(layout)}

  @staticmethod
  def restore_names(abstract: Any, stored: dict, params_only: bool) -> list[str]:
    """The carried state's array names a restore reads: all of them when the checkpoint has
    them (and the restore is not ``params_only``), else none (``abstract``: the abstract
    TrainState; ``stored``: the checkpoint's array table)."""
    if abstract.delayed is None or params_only:
      return []
    names = [f"{PREFIX}/{n}" for n in flatten_paths(abstract.delayed)]
    return names if all(n in stored for n in names) else []

  def restored(self, target: Any, read: dict[str, jax.Array], stored: dict,
               params_only: bool) -> DelayedGrads:
    """The carried state of a restore: the checkpoint's (:meth:`restore_names`, read into
    ``read``), else nothing carried (``target``: the abstract TrainState, its leaves with their
    shardings)."""
    names = self.restore_names(target, stored, params_only)
    if names:
      return jax.tree.unflatten(jax.tree.structure(target.delayed), [read[n] for n in names])
    shardings = jax.tree.map(lambda x: x.sharding, target.delayed)
    return jax.jit(self.fresh, out_shardings=shardings)(target.delayed.grads)

  # -- in the step -----------------------------------------------------------------------------
  def update(self, grads: PyTree, state: Any, skip: Any = None,
             factor: jax.Array | None = None) -> tuple[Any, dict]:
    """Carries ``grads`` (g_t, clipped; ``skip``: it overflowed -- carried as not ready) and
    hands the carried g_{t-1} to the links below, skipped when it is not ready (what is known of
    that statically is the state's variant). A warm-up step hands g_t itself down and carries
    the state's unchanged."""
    carried = state.delayed
    variant = carried.variant
    if variant == Variant.WARMUP:
      return self.inner.update(grads, state, skip, factor)
    new = dataclasses.replace(carried, grads=grads, ready=jnp.logical_not(skip))
    apply_skip = (jnp.logical_not(carried.ready) if variant == Variant.READ
                  else variant == Variant.PRIME)
    result, outputs = self.inner.update(carried.grads, state, apply_skip, factor)
    return result._replace(delayed=new), outputs

  @staticmethod
  def checks_finite(carried: DelayedGrads) -> bool:
    """fp32: whether a non-finite gradient norm skips the step ``carried`` goes into (the steady
    step always applies; the engine warns)."""
    return carried.variant == Variant.WARMUP

  @staticmethod
  def applied_steps(ready: Any, applied: Any) -> Any:
    """The count of updates applied (the lr schedule's step): a carried one (``ready``) is not
    yet."""
    return applied - ready.astype(applied.dtype)

  # -- on the host -----------------------------------------------------------------------------
  def variant(self, state: Any, step: int | None, fused: bool = True) -> Variant:
    """The variant ``state`` needs at host step ``step`` (``state`` and ``step`` None: the steady
    step, e.g. for :meth:`jzero.Engine.jitted_step`); ``fused``: one jit (False: the timed two-jit
    step of ``wall_clock_breakdown``, which reads the carried flag)."""
    if step is not None and step < self.warmup:
      return Variant.WARMUP
    if not fused or self.static_ready is None:
      return Variant.READ
    if state is None or state.delayed.variant in (Variant.PRIME, Variant.APPLY):
      return Variant.APPLY  # a prime or steady step returned it: its flag is true
    return Variant.APPLY if bool(state.delayed.ready) else Variant.PRIME

  @staticmethod
  def labelled(state: Any, variant: Variant) -> Any:
    """``state`` with its carried state labelled for the step of ``variant``."""
    return state._replace(delayed=dataclasses.replace(state.delayed, variant=variant))
