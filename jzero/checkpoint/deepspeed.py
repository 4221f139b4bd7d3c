"""DeepSpeed ZeRO checkpoints in, without torch: named fp32 master weights and Adam moments.

A DeepSpeed checkpoint ``DIR/<tag>/`` (``DIR/latest`` names the tag) holds, per data-parallel rank,
the rank's partition of the fp32 master and of the optimizer state, as flat vectors:

* **Stage 1 / 2** (and bf16 at stage 2): ``mp_rank_00_model_states.pt`` lists the parameters'
  names and shapes per param group (``param_shapes``); ``[bf16_]zero_pp_rank_<r>_mp_rank_00_
  optim_states.pt`` holds rank r's slice of each group's flat vector
  (``single_partition_of_fp32_groups``) and the base optimizer's state of that slice
  (``exp_avg``, ``exp_avg_sq``, ``step``). A group's full vector is its ranks' slices end to end;
  each parameter lies in it in ``param_shapes`` order (plus ``param_alignment_paddings``), and the
  vector's end is padded to a multiple of ``2 x world_size``.
* **Stage 3**: every rank holds ``ceil(numel / world_size)`` elements of *every* parameter (the
  last rank's zero-padded), laid end to end in ``fp32_flat_groups``; a parameter is its ranks'
  pieces at the same offset, joined and cut to its numel. The model states are per rank
  (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``).

The moments lie exactly as the master does, so one gather serves all three. DeepSpeed's own
``zero_to_fp32.py`` (copied into every checkpoint directory) is the reference for this layout; the
files are read by :mod:`jzero.checkpoint.deepspeed_pt` (no torch, no code from the file), each
rank's data memory-mapped, so :func:`stream_fp32` gathers one parameter at a time and
:func:`convert_deepspeed` writes a safetensors file with about one parameter in host memory.
:func:`read_deepspeed` gathers everything into a :class:`DeepSpeedCheckpoint`;
:func:`jzero.checkpoint.deepspeed_import.import_deepspeed` places it in an engine.

Not read (each refused with a message saying so): model- or pipeline-parallel checkpoints
(``mp_rank_01``, ``layer_*``), frozen parameters and module buffers, DeepSpeed's elastic layout of
the optimizer state, and for the moments any optimizer but Adam / AdamW.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from jzero.checkpoint.deepspeed_pt import load_pt
from jzero.checkpoint.weights import _safetensors_header, _write_chunks
from jzero.errors import CheckpointError
from jzero.config.blocks import DTYPES

__all__ = ["DeepSpeedCheckpoint", "read_deepspeed", "stream_fp32", "convert_deepspeed",
           "describe_deepspeed", "find_deepspeed"]

#: Keys DeepSpeed's ``save_checkpoint`` writes into the model states itself; the rest is the
#: ``client_state`` the user passed.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions",
})
_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_KINDS = ("fp32",) + _MOMENTS
_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


@dataclasses.dataclass(frozen=True)
class DeepSpeedCheckpoint:
  """A DeepSpeed ZeRO checkpoint, gathered: named full tensors and the training position.

  Attributes:
    directory: the checkpoint's tag directory.
    tag: its tag (e.g. ``global_step5``).
    zero_stage: the ZeRO stage that wrote it.
    world_size: the data-parallel ranks that wrote it.
    dtype: the run's precision: "fp32", "bf16" or "fp16".
    params: the fp32 master, ``{torch name: float32 array in torch's shape}``.
    exp_avg: Adam's first moment, named and shaped as ``params``.
    exp_avg_sq: Adam's second moment, named and shaped as ``params``.
    step: the optimizer's update count (torch's Adam ``step``: bias correction reads it).
    global_steps: DeepSpeed's ``global_steps`` (skipped fp16 steps included).
    skipped_steps: steps DeepSpeed skipped for an fp16 overflow.
    lr_scheduler: the LR scheduler's ``state_dict()`` (e.g. ``{"last_batch_iteration": 4}``),
      None without a scheduler.
    client_state: what the run passed to ``save_checkpoint(..., client_state=...)``.
    optimizer: "Adam" (L2 weight decay) or "AdamW" (decoupled); "Adam or AdamW" when the file
      does not say and the weight decay is not 0.
    param_groups: per optimizer param group, its hyperparameters (``lr``, ``betas``, ``eps``,
      ``weight_decay``) and the names of its parameters (``names``).
    ds_config: the run's DeepSpeed config.
    ds_version: the DeepSpeed version that wrote it.
  """

  directory: str
  tag: str
  zero_stage: int
  world_size: int
  dtype: str
  params: dict[str, np.ndarray]
  exp_avg: dict[str, np.ndarray]
  exp_avg_sq: dict[str, np.ndarray]
  step: int
  global_steps: int
  skipped_steps: int
  lr_scheduler: dict | None
  client_state: dict
  optimizer: str
  param_groups: tuple[dict, ...]
  ds_config: dict
  ds_version: str


# -- the files ---------------------------------------------------------------------------------

def find_deepspeed(directory: str | os.PathLike, tag: str | int | None = None) -> Path | None:
  """The tag directory of a DeepSpeed checkpoint at ``directory`` (the save directory, whose
  ``latest`` names the tag, or a tag directory itself), or None when it is not one. An int
  ``tag`` also finds DeepSpeed's ``global_step<tag>``."""
  root = Path(directory)
  if tag is None and not any(root.glob("*model_states.pt")) and (root / "latest").is_file():
    tag = (root / "latest").read_text().strip()
  candidates = [root] if tag is None else [root / str(tag), root / f"global_step{tag}"]
  return next((d for d in candidates if any(d.glob("*model_states.pt"))), None)


def _tag_dir(directory: str | os.PathLike, tag: str | int | None) -> Path:
  found = find_deepspeed(directory, tag)
  if found is None:
    root = Path(directory)
    tags = sorted(p.name for p in (root.iterdir() if root.is_dir() else [])
                  if p.is_dir() and any(p.glob("*model_states.pt")))
    which = f"tag {tag!r}" if tag is not None else "the tag its 'latest' file names"
    raise CheckpointError(
        f"{root} is not a DeepSpeed checkpoint: no *_model_states.pt under {which} nor in it. "
        f"Give the directory passed to DeepSpeed's save_checkpoint (its tags with model states: "
        f"{tags or 'none'}), or one tag's directory.")
  return found


@dataclasses.dataclass(frozen=True)
class _Files:
  """What one checkpoint's files say, before any parameter is gathered."""

  directory: Path
  model: dict  # rank 0's model states
  optim: list[dict]  # each rank's ``optimizer_state_dict``
  files: list[Path]  # every file read, model states first

  @property
  def world_size(self) -> int:
    return len(self.optim)

  @property
  def stage(self) -> int:
    return self.optim[0]["zero_stage"]


def _open(directory: str | os.PathLike, tag: str | int | None) -> _Files:
  """Reads the model states and every rank's optimizer states (pickles; data memory-mapped)."""
  where = _tag_dir(directory, tag)
  names = sorted(p.name for p in where.iterdir())
  if any(n.startswith("layer_") or re.search(r"mp_rank_0*[1-9]\d*_", n) for n in names):
    raise CheckpointError(f"{where} holds a model- or pipeline-parallel DeepSpeed checkpoint "
                          f"(mp_rank_01 / layer_* files); jzero reads data-parallel ZeRO "
                          f"checkpoints only. Convert it with DeepSpeed's ds_to_universal first.")
  optim = [(m.group(1) or "", int(m.group(2)), where / n) for n in names
           if (m := _OPTIM_FILE.match(n))]
  if not optim:
    raise CheckpointError(f"{where} holds no *_optim_states.pt files: it was saved without ZeRO "
                          f"(or its optimizer states are gone): there is no fp32 master to read.")
  prefixes = {p for p, _, _ in optim}
  model_file = where / ("mp_rank_00_model_states.pt" if (where / "mp_rank_00_model_states.pt")
                        .exists() else "zero_pp_rank_0_mp_rank_00_model_states.pt")
  model = load_pt(model_file)
  if not isinstance(model, dict) or "param_shapes" not in model:
    raise CheckpointError(f"{model_file} is not DeepSpeed's model states (no param_shapes in it).")
  world = model.get("dp_world_size", len(optim))
  wanted = {f"{p}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for p in prefixes
            for r in range(world)}
  missing = sorted(wanted - set(names))
  if len(prefixes) > 1 or missing or len(optim) != world:
    raise CheckpointError(
        f"{where}: the run had {world} data-parallel ranks, but its optimizer files are "
        f"{sorted(str(f.name) for _, _, f in optim)}" + (f"; missing: {missing}" if missing else "")
        + ". A rank's save was lost or another run's files were mixed in; use a complete tag.")
  files = [model_file] + [f for _, _, f in sorted(optim, key=lambda x: x[1])]
  states = []
  for f in files[1:]:
    content = load_pt(f)
    state = content.get("optimizer_state_dict") if isinstance(content, dict) else None
    if not isinstance(state, dict) or "zero_stage" not in state:
      raise CheckpointError(f"{f} is not a ZeRO optimizer state (no optimizer_state_dict."
                            f"zero_stage in it).")
    counts = state.get("partition_count")
    if (max(counts) if isinstance(counts, list) else counts) != world:
      raise CheckpointError(f"{f} was written by a rank of {counts} partitions, the run had "
                            f"{world} data-parallel ranks: another run's file was mixed in.")
    states.append(state)
  for key, what in (("frozen_param_shapes", "frozen parameters"), ("buffer_names", "buffers")):
    if model.get(key):
      raise CheckpointError(
          f"{model_file}: the model has {what} ({list(model[key])[:5]}), which jzero's reader "
          f"does not gather; DeepSpeed's zero_to_fp32.py in the checkpoint directory does.")
  return _Files(where, model, states, files)


def _flat_groups(files: _Files, kind: str) -> list[list[np.ndarray]]:
  """Each rank's flat vectors (one per param group / stage-3 sub-group) of ``kind``: the fp32
  master or one Adam moment."""
  key = "single_partition_of_fp32_groups" if files.stage <= 2 else "fp32_flat_groups"
  base = "base_optimizer_state" if files.stage <= 2 else "optimizer_state_dict"
  out = []
  for rank, state in enumerate(files.optim):
    masters = state.get(key)
    if not isinstance(masters, list):
      raise CheckpointError(f"{files.files[rank + 1]}: no {key} in its optimizer state; not a "
                            f"ZeRO stage-{files.stage} checkpoint DeepSpeed 0.10+ wrote.")
    if kind == "fp32":
      out.append(masters)
      continue
    torch_state = state.get(base)
    if not isinstance(torch_state, dict) or "param_groups" not in torch_state:
      raise CheckpointError(f"{files.files[rank + 1]}: its optimizer state is in DeepSpeed's "
                            f"elastic layout (a list per group), which jzero does not read; save "
                            f"with zero_optimization.elastic_checkpoint: false.")
    ids = [i for group in torch_state["param_groups"] for i in group["params"]]
    flats = [torch_state["state"][i][kind] for i in ids]
    if [f.shape for f in flats] != [m.shape for m in masters]:
      raise CheckpointError(f"{files.files[rank + 1]}: {kind} has the shapes "
                            f"{[f.shape for f in flats]}, the fp32 partitions "
                            f"{[m.shape for m in masters]}.")
    out.append(flats)
  return out


def _param_shapes(files: _Files) -> list[dict[str, tuple[int, ...]]]:
  return [{name: tuple(int(n) for n in shape) for name, shape in group.items()}
          for group in files.model["param_shapes"]]


def _slice(flats: list[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
  """Elements [start, stop) of the flats laid end to end, as pieces."""
  pieces, base = [], 0
  for flat in flats:
    lo, hi = max(start - base, 0), min(stop - base, flat.size)
    if lo < hi:
      pieces.append(flat[lo:hi])
    base += flat.size
  return pieces


def _locations(files: _Files) -> dict[str, tuple[tuple[int, ...], Any]]:
  """Every parameter's shape and a function ``gather(rank flats) -> flat fp32 array``, checked
  against the partitions' sizes as zero_to_fp32 does."""
  shapes, world = _param_shapes(files), files.world_size
  sizes = [[f.size for f in rank] for rank in _flat_groups(files, "fp32")]
  out = {}
  if files.stage <= 2:
    paddings = files.optim[0].get("param_alignment_paddings") or [None] * len(shapes)
    for g, group in enumerate(shapes):
      offset, length = 0, sizes[0][g]
      for i, (name, shape) in enumerate(group.items()):
        n = math.prod(shape)
        out[name] = (shape, lambda flats, g=g, o=offset, n=n: np.concatenate(
            _slice([rank[g] for rank in flats], o, o + n)))
        offset += n + (paddings[g][i] if paddings[g] else 0)
      align = lambda x: 2 * world * math.ceil(x / (2 * world))
      if align(offset) != align(length * world):
        raise CheckpointError(f"{files.directory}: param group {g} takes {offset} elements, its "
                              f"partitions hold {length} x {world}: the files do not fit together.")
  else:
    offset = 0
    for name, shape in {k: v for group in shapes for k, v in group.items()}.items():
      n = math.prod(shape)
      part = math.ceil(n / world)
      out[name] = (shape, lambda flats, o=offset, part=part, n=n: np.concatenate(
          [p for rank in flats for p in _slice(rank, o, o + part)])[:n])
      offset += part
    if offset != sum(sizes[0]):
      raise CheckpointError(f"{files.directory}: the parameters take {offset} elements per rank, "
                            f"the partitions hold {sum(sizes[0])}: the files do not fit together.")
  for alias, source in (files.model.get("shared_params") or {}).items():
    out[alias] = out[source]
  return out


def stream_fp32(directory: str | os.PathLike, tag: str | int | None = None,
                kinds: tuple[str, ...] = ("fp32",)
                ) -> Iterator[tuple[str, tuple[np.ndarray, ...]]]:
  """``(torch name, arrays)`` one parameter at a time, ``arrays`` one float32 array in torch's
  shape per entry of ``kinds`` ("fp32": the master, "exp_avg", "exp_avg_sq"). Only the
  parameter's pieces are read from the memory-mapped rank files."""
  return _stream(_open(directory, tag), kinds)


def _stream(files: _Files, kinds: tuple[str, ...]
            ) -> Iterator[tuple[str, tuple[np.ndarray, ...]]]:
  flats = {kind: _flat_groups(files, kind) for kind in kinds}
  for name, (shape, gather) in _locations(files).items():
    yield name, tuple(gather(flats[k]).astype(np.float32, copy=False).reshape(shape)
                      for k in kinds)


# -- the optimizer and the position --------------------------------------------------------------

def _torch_state(files: _Files) -> dict:
  return files.optim[0]["base_optimizer_state" if files.stage <= 2 else "optimizer_state_dict"]


def _optimizer(files: _Files) -> tuple[str, tuple[dict, ...]]:
  """The optimizer's name and param groups, checked to be Adam's (refusing others by what they
  lack)."""
  torch_state = _torch_state(files)
  first = _files_state(files, torch_state)
  missing = [k for k in _MOMENTS + ("step",) if k not in first
             and not (k == "step" and "step" in torch_state["param_groups"][0])]
  block = (files.model.get("ds_config") or {}).get("optimizer") or {}
  kind = str(block.get("type", "")).lower()
  group0 = torch_state["param_groups"][0]
  if missing or (kind and kind not in ("adam", "adamw")) or group0.get("amsgrad"):
    what = (f"DeepSpeed optimizer {block['type']!r}" if kind
            else f"an optimizer whose state holds {sorted(first)}")
    lacks = (f"it has no {missing}" if missing else "it ran with amsgrad (max_exp_avg_sq), "
             "which optax's Adam does not keep" if group0.get("amsgrad")
             else "its update rule is not Adam's")
    raise CheckpointError(
        f"{files.directory} was trained with {what}: jzero imports Adam / AdamW (exp_avg, "
        f"exp_avg_sq, step) and {lacks}. Import the weights alone: jzero convert --from-deepspeed "
        f"DIR --safetensors FILE, then checkpoint.load_weights.")
  if kind:
    decoupled = kind == "adamw" or (block.get("params") or {}).get("adam_w_mode", True)
  else:
    decoupled = group0.get("decoupled_weight_decay", group0.get("adam_w_mode"))
  name = ("AdamW" if decoupled else "Adam" if decoupled is not None
          or not any(g["weight_decay"] for g in torch_state["param_groups"]) else "Adam or AdamW")
  shapes = _param_shapes(files)
  groups = []
  for g, group in enumerate(torch_state["param_groups"]):
    hyper = {k: (tuple(group[k]) if k == "betas" else group[k]) for k in _ADAM_HYPERPARAMETERS}
    groups.append({**hyper, "names": list(shapes[g]) if g < len(shapes) else []})
  if not group0.get("bias_correction", True):
    raise CheckpointError(f"{files.directory}: its Adam ran without bias correction, which "
                          f"optax's Adam always applies; the run cannot continue in jzero.")
  return name, tuple(groups)


def _files_state(files: _Files, torch_state: dict) -> dict:
  state = torch_state.get("state") or {}
  if not state:
    raise CheckpointError(f"{files.files[1]}: the optimizer state is empty (saved before the "
                          f"first step?), so there are no moments to import.")
  return next(iter(state.values()))


def _step(files: _Files) -> int:
  """torch Adam's update count: the per-parameter ``step`` (DeepSpeed's FusedAdam: the group's)."""
  torch_state = _torch_state(files)
  value = _files_state(files, torch_state).get("step", torch_state["param_groups"][0].get("step"))
  return int(np.asarray(value).item())


def _precision(ds_config: dict) -> str:
  for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
    if (ds_config.get(key) or {}).get("enabled"):
      return name
  return "fp32"


def read_deepspeed(path: str | os.PathLike, tag: str | int | None = None) -> DeepSpeedCheckpoint:
  """Reads a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, any world size; fp32 or mixed
  precision, whose fp32 master is in the same files) into named full fp32 tensors and its
  training position. No torch, no code from the files.

  Args:
    path: the directory given to DeepSpeed's ``save_checkpoint`` (``latest`` names the tag), or
      one tag's directory.
    tag: the checkpoint to read (``"global_step5"``, or 5); default: the one ``latest`` names.

  Raises:
    CheckpointError: not a DeepSpeed checkpoint, a missing / truncated / altered file (named), a
      layout the files do not fit, or an optimizer other than Adam / AdamW (naming what its state
      lacks).
  """
  files = _open(path, tag)
  optimizer, groups = _optimizer(files)
  tensors: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in _KINDS}
  for name, arrays in _stream(files, _KINDS):
    for kind, array in zip(_KINDS, arrays):
      tensors[kind][name] = array
  model = files.model
  scheduler = model.get("lr_scheduler")
  return DeepSpeedCheckpoint(
      directory=str(files.directory), tag=files.directory.name, zero_stage=files.stage,
      world_size=files.world_size, dtype=_precision(model.get("ds_config") or {}),
      params=tensors["fp32"], exp_avg=tensors["exp_avg"], exp_avg_sq=tensors["exp_avg_sq"],
      step=_step(files), global_steps=int(model.get("global_steps", 0)),
      skipped_steps=int(model.get("skipped_steps", 0)),
      lr_scheduler=dict(scheduler) if scheduler is not None else None,
      client_state={k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS},
      optimizer=optimizer, param_groups=groups, ds_config=dict(model.get("ds_config") or {}),
      ds_version=str(model.get("ds_version")))


# -- jzero convert / jzero inspect ---------------------------------------------------------------

def convert_deepspeed(directory: str | os.PathLike, safetensors: str | os.PathLike, *,
                      tag: str | int | None = None, dtype: str = "fp32") -> dict:
  """DeepSpeed's ``zero_to_fp32`` without torch: the fp32 master as a safetensors file of torch
  names and shapes, streamed -- the header from the shapes, then one gathered parameter at a
  time -- to a temporary name, renamed when complete.

  Returns:
    ``{"tag", "step", "dtype", "tensors", "total_bytes", "largest_bytes", "output"}``.
  """
  if dtype not in DTYPES:
    raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
  target = Path(safetensors)
  if target.exists():
    raise CheckpointError(f"{target} already exists; remove it or choose another output path.")
  files = _open(directory, tag)
  out_dtype = np.dtype(DTYPES[dtype])
  shapes = {name: shape for name, (shape, _) in _locations(files).items()}
  sizes = [math.prod(s) * out_dtype.itemsize for s in shapes.values()]
  tmp = target.with_name(target.name + ".tmp")
  try:
    with open(tmp, "wb") as f:
      f.write(_safetensors_header(shapes, out_dtype, {"format": "pt", "deepspeed_tag":
                                                      files.directory.name}))
      for _, (array,) in _stream(files, ("fp32",)):
        _write_chunks(f, array, out_dtype)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  os.replace(tmp, target)
  return {"tag": files.directory.name, "step": int(files.model.get("global_steps", 0)),
          "dtype": str(out_dtype), "tensors": len(shapes), "total_bytes": sum(sizes),
          "largest_bytes": max(sizes), "output": str(target)}


def describe_deepspeed(directory: str | os.PathLike, tag: str | int | None = None) -> str:
  """``jzero inspect`` of a DeepSpeed checkpoint: stage, world size, tag, step, precision,
  optimizer, scheduler, client state, every parameter's name and shape, and bytes. Reads the
  pickles only (no parameter is gathered)."""
  files = _open(directory, tag)
  model = files.model
  locations = _locations(files)
  try:
    optimizer, groups = _optimizer(files)
    hyper = "; ".join(", ".join(f"{k} {g[k]}" for k in _ADAM_HYPERPARAMETERS) for g in groups)
    optimizer = f"{optimizer} ({hyper}), update count {_step(files)}"
  except CheckpointError as e:
    optimizer = f"not importable: {e}"
  n_params = sum(math.prod(shape) for shape, _ in locations.values())
  client = {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS}
  on_disk = sum(f.stat().st_size for f in files.directory.iterdir() if f.is_file())
  lines = [
      f"DeepSpeed checkpoint {files.directory}",
      f"  tag {files.directory.name!r}, global step {model.get('global_steps')} (skipped "
      f"{model.get('skipped_steps', 0)}), written by DeepSpeed {model.get('ds_version')}",
      f"  ZeRO stage {files.stage}, world size {files.world_size}, precision "
      f"{_precision(model.get('ds_config') or {})}",
      f"  optimizer {optimizer}",
      f"  lr scheduler {(model.get('ds_config') or {}).get('scheduler', {}).get('type', 'none')}"
      f" state {model.get('lr_scheduler')}",
  ]
  if client:
    lines.append(f"  client state: {client}")
  width = max(len(name) for name in locations)
  lines.append("")
  lines.append(f"  {'parameter'.ljust(width)}  {'shape'.ljust(12)}  fp32 bytes")
  lines += [f"  {name.ljust(width)}  {str(list(shape)).ljust(12)}  {math.prod(shape) * 4:>10,}"
            for name, (shape, _) in locations.items()]
  lines.append("")
  lines.append(f"  {len(locations)} parameters, {n_params:,} elements: fp32 master "
               f"{n_params * 4:,} bytes, with Adam's two moments {n_params * 12:,} bytes")
  lines.append(f"  on disk: {on_disk:,} bytes in {sum(1 for f in files.directory.iterdir())} "
               f"files")
  return "\n".join(lines)
