"""The compiled train step's peak device bytes, by arithmetic: what ``memory_analysis()`` of jzero's
step will say before it is compiled.

:func:`jzero.analysis.estimate.estimate` is ZeRO's arithmetic of the model states (what lives
across steps). The step holds more while it runs, and the compiled peak is the most of it alive
at once. :func:`step_memory` adds it up in two phases, each term per device:

**Backward** (with one layer recomputed at a time, the peak is in the backward pass of the last
micro-batch):

* *state* -- the arguments: compute params as placed, the fp32 master and optimizer state (and
  hpZ's secondary partition), less what an offload keeps on the host;
* *grads* -- the micro-batch's gradient in the compute dtype, laid out as the plan's gradient
  sharding (partitioned in stages 2-3, whole in stages 0-1; jzero keeps gradients on the device
  under every offload);
* *accumulator* -- with gradient accumulation (gas > 1) the fp32 sum of the micro-batches'
  gradients, in the same layout: 4 bytes per element, twice the gradient's;
* *saved* -- what the forward pass keeps for the backward pass, every layer: with activation
  checkpointing the layer inputs (b·s·h elements); with ``cpu_checkpointing`` none on the device
  (the compiled program keeps them in host memory); without checkpointing what jzero's remat
  policy saves (``dots_with_no_batch_dims_saveable``: the outputs of the layer's weight matmuls
  and its input, (6h + mlp_width x matrices) elements per token). In stage 3 with gradient
  accumulation, where XLA pipelines the layer scan's all-gathers, it keeps most of these stacks
  twice (:data:`SAVED_COPIES_STAGE3_ACCUMULATING`; not with qwZ, whose gathers are its own);
* *working* -- one layer's backward with its forward recomputed: the attention scores in fp32
  (b·heads·s²), the MLP's hidden activations, hidden-sized temporaries and the fp32 logits of the
  micro-batch;
* *gathered* -- stage 3: the gathered layer and the next one, prefetched;

the saved activations in the dtype the layers pass along (``activation_bytes``, read from the
model's traced forward by :func:`jzero.models.gpt.residual_dtype`: the embedded GPT's residual
stream is fp32 even with bf16 parameters, because ``nnx.Embed`` promotes its lookup to its
``param_dtype``).

**Update**: the state, the gradients and the accumulator, plus the fp32 gradient partition the
optimizer reads (converted from the compute dtype; with gas > 1 the accumulator itself, reduced
to its partition first in stage 1); with hpZ the new secondary partition twice instead (it is
written, then laid out again for the next step); with the optimizer state streamed from host
memory (``offload_optimizer.device: cpu``, jzero's "stream" update) one parameter leaf's master
and optimizer state in and out at a time -- a whole stacked leaf, all its layers.

The peak is the larger phase. The counts of the working set's buffers and of the gathered layers
are effective numbers, XLA's packing of its temporaries into one buffer included, fit to the
memory analysis of 33 compiles of the embedded GPT by XLA's GPU compiler (jax 0.10.2): 7B, 13B,
70B, 1T, 1.3B and the default shape on 1 to 64 H100 / A100 / RTX 3090 devices, stages 0-3,
micro-batch 1-4, gas 1-4, no, per-block and host checkpointing, ZeRO++. Over those, the median
|estimate / compiled - 1| is 3% and the worst 7%. Where a step's natural peak exceeds about 77%
of a compile-only target's memory, XLA's rematerialization pass recomputes more to shrink it
(its log says so), and the estimate stays above the compiled peak (by 21-32% in the two cases
seen, both far over any budget). ``bench/plan_questions.py`` prints estimate against compile for
every candidate the questions' searches compile; a different model, compiler or remat policy
needs the counts checked again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jzero.analysis import update_memory

__all__ = ["StepMemory", "step_memory", "step_peak", "ATTENTION_COPIES",
           "HIDDEN_TEMPORARIES", "MLP_TEMPORARIES", "LOGITS", "GATHERED_LAYERS",
           "SAVED_COPIES_STAGE3_ACCUMULATING"]

# Effective numbers of buffers alive at the peak, XLA's packing of its temporaries included (fit to
# the compiles the module docstring names; see there)
ATTENTION_COPIES = 2.0  # b·heads·s² fp32 score-sized buffers of a layer's backward
HIDDEN_TEMPORARIES = 24.0  # b·s·h-sized fp32 buffers of a layer's backward
MLP_TEMPORARIES = 2.25  # b·s·mlp_width-sized fp32 buffers (per matrix reading the MLP input)
LOGITS = 1.5  # b·s·vocab-sized fp32 buffers
GATHERED_LAYERS = 2.25  # stage 3: layers of full parameters (this one, the next prefetched)
SAVED_COPIES_STAGE3_ACCUMULATING = 1.85  # stage 3 with gas > 1: most saved stacks kept twice


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Per-device bytes of one step by part (module docstring); ``peak`` is what to compare with
  the compiled ``memory_analysis()`` (arguments + outputs + temporaries - aliased)."""

  state: float
  grads: float
  accumulator: float
  saved: float
  working: float
  gathered: float
  update: float

  @property
  def backward(self) -> float:
    return (self.state + self.grads + self.accumulator + self.saved + self.working
            + self.gathered)

  @property
  def update_phase(self) -> float:
    return self.state + self.grads + self.accumulator + self.update

  @property
  def peak(self) -> float:
    return max(self.backward, self.update_phase)

  @property
  def phase(self) -> str:
    """Where the peak is: "backward" or "update"."""
    return "backward" if self.backward >= self.update_phase else "update"

  def parts(self) -> dict[str, float]:
    """The parts of the phase the peak is in, bytes by name."""
    if self.phase == "update":
      out = {"state": self.state, "gradients": self.grads, "fp32 accumulator": self.accumulator,
             "update": self.update}
    else:
      out = {"state": self.state, "gradients": self.grads, "fp32 accumulator": self.accumulator,
             "saved activations": self.saved, "layer working set": self.working,
             "gathered layers": self.gathered}
    return {k: v for k, v in out.items() if v}


def step_memory(model: Any, *, state: float, grad_elements: float, micro_batch: int,
                gradient_accumulation: int, checkpointing: str, stage: int,
                param_bytes: int, activation_bytes: int, update_elements: float,
                hpz_secondary: float = 0.0, stream_elements: float = 0.0,
                streamed_update: bool = False, quantized_gathers: bool = False,
                grads_in_flight: float | None = None, accumulated_elements: float | None = None,
                upload: float = 0.0, store_group: float = 0.0) -> StepMemory:
  """The step's device bytes by part (module docstring).

  Args:
    model: the GPT's shape (``jzero.models.GPTConfig``: layers, widths, heads, sequence,
      vocabulary).
    state: bytes of the arguments on the device (params, master, optimizer state, hpZ's
      secondary; what offload keeps on the host excluded).
    grad_elements: gradient elements per device as the plan places them.
    micro_batch, gradient_accumulation: b and gas.
    checkpointing: "none", "block" (activation checkpointing) or "offload" (``cpu_checkpointing``).
    stage: the ZeRO stage (stage 3 gathers layers).
    param_bytes: bytes per compute parameter; activation_bytes: per activation element
      (:func:`jzero.models.gpt.residual_dtype`).
    update_elements: elements of the fp32 gradient partition the update reads.
    hpz_secondary: bytes of hpZ's secondary partition (0: no hpZ).
    stream_elements: optimizer offload: elements of the largest parameter leaf's partition,
      whose master and optimizer state the streamed update holds on the device at once.
    streamed_update: the optimizer state is streamed from the host (``offload_optimizer``).
    quantized_gathers: stage 3 gathers through ZeRO++'s qwZ (its own int8 gathers, not XLA's
      pipelined all-gathers, which keep the saved stacks twice under gradient accumulation).
    grads_in_flight: bytes of gradient the backward holds when the gradients leave the device as
      they are produced (``"cpu_adam"``, :mod:`jzero.analysis.update_memory`); None: the plan's
      gradient layout, ``param_bytes`` x ``grad_elements``.
    accumulated_elements: elements the device sums in fp32 over the micro-batches (None:
      ``grad_elements``; 0 when the host sums them).
    upload: bytes of new params uploaded beside the state after the step (``"cpu_adam"``).
    store_group: bytes of the NVMe store's update group on the device (its master and moments).
  """
  m, b = model, micro_batch
  s, h, f = m.seq_len, m.d_model, m.mlp_width
  mlp_in = 2 if m.gated_mlp else 1  # matrices reading the MLP input
  tokens = b * s
  if checkpointing == "block":
    saved = m.n_layers * tokens * h * activation_bytes
  elif checkpointing == "offload":
    saved = 0.0
  else:
    saved = m.n_layers * tokens * (6 * h + mlp_in * f) * activation_bytes
  working = 4 * (ATTENTION_COPIES * b * m.n_heads * s * s + MLP_TEMPORARIES * mlp_in * tokens * f
                 + HIDDEN_TEMPORARIES * tokens * h + LOGITS * tokens * m.vocab_size)
  layer = 4 * h * h + (mlp_in + 1) * h * f
  gathered = GATHERED_LAYERS * layer * param_bytes if stage == 3 else 0.0
  if stage == 3 and gradient_accumulation > 1 and not quantized_gathers:
    saved *= SAVED_COPIES_STAGE3_ACCUMULATING
  # the fp32 gradient the update reads: converted from the compute dtype, or (gas > 1) the
  # accumulator itself -- reduced to its partition first in stage 1
  fp32_grad = 4 * update_elements if gradient_accumulation == 1 or stage == 1 else 0.0
  # hpZ's new secondary comes after the update, the uploaded params after the host's
  update = max(fp32_grad, 2 * hpz_secondary, upload) + store_group
  if streamed_update:
    update += 24 * stream_elements  # one leaf's master + moments in, and their new values out
  accumulated = grad_elements if accumulated_elements is None else accumulated_elements
  return StepMemory(
      state=state, grads=param_bytes * grad_elements if grads_in_flight is None else grads_in_flight,
      accumulator=4 * accumulated if gradient_accumulation > 1 else 0.0, saved=saved,
      working=working, gathered=gathered, update=update)


def step_peak(e: Any, model: Any, *, micro_batch: int, checkpointing: str, activation_bytes: int,
              quantized_gathers: bool = False) -> StepMemory:
  """The step's device bytes for the configuration of an estimate
  (:func:`jzero.analysis.estimate.estimate` of the model's leaves, with its update and gradient
  accumulation): what ``jzero plan`` prices a candidate at and ``jzero estimate`` prints as the
  step's peak -- the state the estimate leaves on the device, the gradients where its update
  keeps them (:mod:`jzero.analysis.update_memory`), and the step's temporaries
  (:func:`step_memory`).

  Args:
    e: the estimate (:class:`jzero.analysis.estimate.Estimate`).
    model: the GPT's shape (``jzero.models.GPTConfig``).
    micro_batch, checkpointing, activation_bytes, quantized_gathers: as :func:`step_memory`.
  """
  n, psi, stage, p = e.devices, e.num_params, e.stage, e.param_bytes
  device = e.bytes["device"]
  state = sum(v for kind, v in device.items() if kind != "grads")
  grad_elements = psi / n if stage >= 2 else psi
  share = e.offload_ratio
  streams = update_memory.streams_gradients(e.update)
  kept = 1 - share if streams else 1.0  # the share of the update that runs on the device
  partition = (psi - e.persistent_params) / n if stage == 3 else psi / n
  return step_memory(
      model, state=state, grad_elements=grad_elements, micro_batch=micro_batch,
      gradient_accumulation=e.gradient_accumulation, checkpointing=checkpointing, stage=stage,
      param_bytes=p, activation_bytes=activation_bytes,
      update_elements=kept * (psi / n if stage else psi), hpz_secondary=e.secondary,
      stream_elements=e.largest_leaf / n if stage else e.largest_leaf,
      streamed_update=e.update == update_memory.STREAM,
      quantized_gathers=quantized_gathers,
      grads_in_flight=device["grads"] if streams and stage >= 2 else None,
      accumulated_elements=kept * grad_elements if streams and stage >= 2 else None,
      upload=share * update_memory.upload_bytes(stage, p, partition, n, e.offload_param is None)
      if streams else 0.0,
      store_group=_store_group(e))


def _store_group(e: Any) -> float:
  """The NVMe store's update group on the device: its master and moments, K x min(sub_group,
  Ψ/N) (0 under any other update)."""
  if e.update != update_memory.STORE:
    return 0.0
  elements = e.offload_ratio * e.num_params / e.devices
  per_element = e.bytes["nvme"].get("optimizer", 0.0) / elements if elements else 0.0
  return per_element * min(e.sub_group, elements)
