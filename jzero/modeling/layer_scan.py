"""What a model calls so that ZeRO-3 gathers its parameters one layer at a time.

A model whose layers are stacked over a leading axis runs them with :func:`scan_layers`::

  def __call__(self, x):
    graphdef, stacked = nnx.split(self.blocks)          # every leaf has a leading layer axis
    def layer(x, params):
      return nnx.merge(graphdef, params)(x)
    return jzero.scan_layers(layer, x, stacked)

Outside a jzero engine this is a plain ``lax.scan``. Inside an engine the stacked leaves arrive as
:class:`~jzero.comm.zero_param.ZeroParam` objects (stage-3 partitions, or stage-2 parameters whose
gradient is reduce-scattered); ``scan_layers`` gathers each layer's parameters at the top of the
scan body, so only one layer is ever full on a device, and each layer's gradient is
reduce-scattered inside the backward scan, so only partitions of it accumulate.

Models that run their layers in a Python loop need nothing of this:
:mod:`jzero.modeling.gather_units` gathers each module's parameters when it is called.

Inside an engine (every stage, so stages differ only in placement) the body is rematerialised
under a policy that saves only the outputs of the layer's matmuls with its weights
(``dots_with_no_batch_dims_saveable``) and never a gathered parameter: backward gathers the layer
again instead of keeping L full layers alive, and recomputes the cheap elementwise work. On this
project's CPU measurements that is also faster than keeping everything (the saved activations
cost more memory traffic than the recompute). When the config has an ``activation_checkpointing``
block the body is rematerialised whole (only the layer inputs are kept), which is what
DeepSpeed's per-layer activation checkpointing does.

With ``activation_checkpointing.cpu_checkpointing: true`` (DeepSpeed's activation offload) those
kept layer inputs live in host memory (``pinned_host``) between forward and backward: the body
tags every array of its input with ``checkpoint_name(x, LAYER_INPUT)`` (:func:`name_layer_inputs`)
and the policy is ``save_and_offload_only_these_names`` with that name offloadable from
``device`` to ``pinned_host`` and nothing saveable. JAX's remat then copies each layer's input to
the host in forward (the scan stacks those copies into one host buffer of L inputs) and back to
the device right before that layer's recompute in backward. :mod:`jzero.modeling.gather_units` tags
its regions' inputs the same way, so loop models offload every unit's input. The values and so the
losses and gradients are unchanged (the copies are exact); only where the residuals live changes.
The CPU backend drops the placement (no host memory space in its compiled HLO; ``memory_analysis()``
reports the same temp bytes with and without offload, docs/offload.md "Activation offload"); the
CUDA lowering carries the ``annotate_device_placement`` pair per scanned layer body.

The engine sets the policy with :func:`engine_context` while it traces the loss; models never do.

A Flax Linen model builds its stacked layers with :func:`linen_scan_layers` instead, inside its
``setup`` or ``@nn.compact`` ``__call__`` (so that the engine's policy is known)::

  Blocks = jzero.linen_scan_layers(Block, length=n_layers)   # Block: (carry, x) -> (carry, y)
  x, _ = Blocks(name="blocks")(x, None)                      # stacked_layers = ("blocks",)

It is ``nn.scan`` over ``nn.map_variables(Block, "params", trans_in_fn=gather)``: Linen slices each
layer's partitions out of the stack, the layer's parameters are gathered at the top of the body,
and the body is rematerialised under the same policy as :func:`scan_layers`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Iterator

import jax
from flax import linen as nn
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jzero.comm.zero_param import ZeroParam, read_sources
from jzero.errors import NotSupportedError

__all__ = ["gather", "remat", "scan_layers", "linen_scan_layers", "engine_context", "TraceLog",
           "LayerPolicy", "current_layer_policy", "current_policy", "name_layer_inputs", "LAYER_INPUT"]

#: The ``checkpoint_name`` of the layer inputs that ``cpu_checkpointing`` moves to the host.
LAYER_INPUT = "jzero_layer_input"
#: Where ``cpu_checkpointing`` keeps them (DeepSpeed copies checkpoints to pinned CPU memory).
ACTIVATION_MEMORY_KIND = "pinned_host"


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
  """How the engine wants each scanned layer rematerialised.

  Attributes:
    checkpoint_activations: keep only the layer inputs (DeepSpeed activation checkpointing);
      otherwise keep the outputs of the layer's matmuls with its weights and nothing else.
    prefetch: a gather unit may gather while the unit before it computes
      (``stage3_prefetch_bucket_size`` > 0; see :mod:`jzero.modeling.gather_units`).
    offload_inputs: with ``checkpoint_activations``, keep the layer inputs in ``pinned_host``
      memory between forward and backward (``cpu_checkpointing``).
  """

  checkpoint_activations: bool = False
  prefetch: bool = False
  offload_inputs: bool = False

  def __post_init__(self):
    if self.offload_inputs and not self.checkpoint_activations:
      raise ValueError("offload_inputs (cpu_checkpointing) needs checkpoint_activations")

  def jax_policy(self) -> Callable[..., bool]:
    if self.offload_inputs:
      return jax.checkpoint_policies.save_and_offload_only_these_names(
          names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
          offload_src="device", offload_dst=ACTIVATION_MEMORY_KIND)
    if self.checkpoint_activations:
      return jax.checkpoint_policies.nothing_saveable
    # Never a gathered weight: "save anything except the gathered name" does not work, because the
    # value *entering* a checkpoint_name (the all-gather's output) is itself saveable.
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


_POLICY: contextvars.ContextVar[LayerPolicy | None] = contextvars.ContextVar(
    "jzero_layer_policy", default=None)


@dataclasses.dataclass
class TraceLog:
  """What the engine learns while it traces the loss.

  Attributes:
    tagged: the number of arrays each :func:`name_layer_inputs` call tagged (a
      ``cpu_checkpointing`` run whose sum is 0 offloaded nothing: no remat region ran).
    gathered: the full-parameter elements each :func:`gather` call materialised from stage-3
      partitions (one entry per group gathered together: a scanned layer, a unit's call). Its
      maximum is the step's largest gathered group as the model really runs -- which the plan
      cannot know when a unit runs inside the model's own ``nn.scan`` (one layer's slice per call).
  """

  tagged: list[int] = dataclasses.field(default_factory=list)
  gathered: list[int] = dataclasses.field(default_factory=list)


_LOG: contextvars.ContextVar[TraceLog | None] = contextvars.ContextVar(
    "jzero_trace_log", default=None)


@contextlib.contextmanager
def engine_context(policy: LayerPolicy) -> Iterator[TraceLog]:
  """Used by the engine while tracing the loss: sets the remat policy of :func:`scan_layers` and
  yields the :class:`TraceLog` that :func:`name_layer_inputs` and :func:`gather` write to."""
  log = TraceLog()
  token, log_token = _POLICY.set(policy), _LOG.set(log)
  try:
    yield log
  finally:
    _POLICY.reset(token)
    _LOG.reset(log_token)


def gather(tree: Any) -> Any:
  """Replaces every :class:`~jzero.comm.zero_param.ZeroParam` in ``tree`` by the full parameter
  (identity on arrays)."""
  is_param = lambda x: isinstance(x, ZeroParam)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_param)
  log = _LOG.get()
  if log is not None:  # the engine is tracing: record the group's size (stage-3 partitions)
    gathered = sum(math.prod(x.shape) for x in leaves if is_param(x) and x.full is None)
    if gathered:
      log.gathered.append(gathered)
  leaves = read_sources(leaves)  # e.g. the NVMe tier's partitions: one host callback
  return jax.tree.unflatten(treedef, [x.gather() if is_param(x) else x for x in leaves])


def current_layer_policy() -> LayerPolicy:
  """The layer policy of the engine tracing now (the default one outside an engine)."""
  return _POLICY.get() or LayerPolicy()


def current_policy() -> Callable[..., bool]:
  """The remat policy of the engine tracing now (the default one outside an engine)."""
  return current_layer_policy().jax_policy()


def name_layer_inputs(tree: Any) -> Any:
  """Tags every array of ``tree`` (a layer's input, inside its remat region) as
  :data:`LAYER_INPUT` when the current engine offloads layer inputs; identity otherwise.
  ZeroParams (parameter partitions) are left as they are."""
  if not current_layer_policy().offload_inputs:
    return tree
  count = 0

  def tag(x):
    nonlocal count
    if not isinstance(x, jax.Array):
      return x
    count += 1
    return checkpoint_name(x, LAYER_INPUT)

  tree = jax.tree.map(tag, tree, is_leaf=lambda x: isinstance(x, ZeroParam))
  log = _LOG.get()
  if log is not None:
    log.tagged.append(count)
  return tree


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
  policy = _POLICY.get()
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=policy.jax_policy(), prevent_cse=False)


def remat(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` rematerialised as the current engine asks (unchanged outside an engine).

  With ``cpu_checkpointing`` every array argument of ``fn`` is a layer input kept in
  ``pinned_host`` until backward (as DeepSpeed's ``checkpoint(fn, *args)`` offloads its tensor
  arguments); pass weights that the engine already holds as ZeroParams, not as gathered arrays.
  """
  if _POLICY.get() is None:
    return fn

  def named(*args, **kwargs):
    args, kwargs = name_layer_inputs((args, kwargs))
    return fn(*args, **kwargs)

  return _checkpointed(named)


def scan_layers(layer: Callable[[Any, Any], Any], carry: Any, stacked_params: Any, *,
                unroll: int = 1) -> Any:
  """Runs ``carry = layer(carry, params_i)`` for each layer i of ``stacked_params``.

  Args:
    layer: (carry, one layer's parameters) -> new carry.
    carry: the input of the first layer (activations).
    stacked_params: pytree whose leaves have a leading layer axis (ZeroParams in an engine).
    unroll: passed to ``lax.scan``.

  Returns:
    The output of the last layer.

  Raises:
    NotSupportedError: ``stacked_params`` holds NNX state besides parameters (a BatchNorm's
      statistics): ``layer`` returns only the carry, so what the layers write would be lost.
  """
  kept = [type(v).__name__ for v in jax.tree.leaves(
      stacked_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
          if isinstance(v, nnx.Variable) and not isinstance(v, (nnx.Param, nnx.RngState))]
  if kept:
    raise NotSupportedError(
        f"jzero.scan_layers got stacked layers holding {sorted(set(kept))} variables besides "
        f"their parameters (BatchNorm statistics): the scan returns only the carry, so what the "
        f"layers write there would be lost. Run such layers in a Python loop (ZeRO-3 gathers "
        f"each as a unit) or normalise them without statistics (LayerNorm, RMSNorm).")

  def body(c, params):
    return layer(name_layer_inputs(c), gather(params)), None

  out, _ = lax.scan(_checkpointed(body), carry, stacked_params, unroll=unroll)
  return out


def linen_scan_layers(block: type[nn.Module], length: int, *, variable_axes: dict | None = None,
                      split_rngs: dict | None = None, **scan_kwargs: Any) -> type[nn.Module]:
  """The Flax Linen counterpart of :func:`scan_layers`: ``length`` stacked copies of ``block``.

  Call it inside the model's ``setup`` or ``@nn.compact`` method (the engine's remat policy is
  read then). Outside an engine it is a plain ``nn.scan``.

  Args:
    block: a Linen module class called as ``block(...)(carry, x) -> (carry, y)`` (``nn.scan``'s
      convention); its ``params`` get a leading layer axis.
    length: number of layers.
    variable_axes, split_rngs: added to ``nn.scan``'s (``{"params": 0}``, ``{"params": True}``).
    **scan_kwargs: passed to ``nn.scan`` (``in_axes``, ``unroll``, ...).

  Returns:
    A module class; list its instance's name in ``stacked_layers``.
  """
  policy = _POLICY.get()
  if policy is not None and policy.offload_inputs:
    block = _naming_carry(block)
  layer = nn.map_variables(block, "params", trans_in_fn=gather, init=True)
  if policy is not None:
    layer = nn.remat(layer, policy=policy.jax_policy(), prevent_cse=False)
  return nn.scan(layer, variable_axes={"params": 0, **(variable_axes or {})},
                 split_rngs={"params": True, **(split_rngs or {})}, length=length, **scan_kwargs)


def _naming_carry(block: type[nn.Module]) -> type[nn.Module]:
  """A subclass of the Linen ``block`` that tags its carry with :func:`name_layer_inputs`."""

  class Named(block):  # type: ignore[valid-type, misc]

    def __call__(self, carry, *args, **kwargs):
      return super().__call__(name_layer_inputs(carry), *args, **kwargs)

  Named.__name__, Named.__qualname__ = block.__name__, block.__qualname__
  Named.__module__ = block.__module__
  return Named
