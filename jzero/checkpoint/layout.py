"""A checkpoint directory on disk: names, ``latest``, the file list with checksums, the JSON.

Everything here is host work on files; nothing touches a device. The layout::

  DIR/
    latest                      text: the tag of the newest complete checkpoint, e.g. "20"
    20/                         one checkpoint; its tag (default: the step) names the directory
      state/                    Orbax PyTree (OCDBT + zarr3): the TrainState as nested dicts
      meta/jzero.json           the JSON description (see jzero.checkpoint.save)
      weights16/                with gather_16bit_weights_on_model_save: params-only Orbax PyTree
      jzero_files.json          written after the commit: every file's size and checksum
      _CHECKPOINT_METADATA ...  Orbax's own

**Complete or not there.** A checkpoint is *complete* when Orbax has committed it (renamed its
temporary directory to ``DIR/<tag>``) and jzero has recorded its file list (``jzero_files.json``,
written atomically after the commit); :func:`is_complete` is that test, and every reader and
writer goes by it. A save killed at any moment leaves either nothing under the tag's name (a
temporary directory, removed by the next :class:`~jzero.checkpoint.Checkpointer`), or an
*incomplete* ``DIR/<tag>`` (killed between the commit and the file list), or a complete checkpoint
that ``latest`` does not name yet (killed before ``latest`` moved). Readers resolve "the latest"
with :func:`resume_tag`: the newest complete checkpoint among the one ``latest`` names and those
saved to become it (``save_latest``, recorded in the JSON) -- so the last two cases resume where
the save meant to -- warning about each incomplete directory they pass over. Asked for an
incomplete tag explicitly, they refuse it naming the complete ones. The next save at an incomplete
tag replaces it (renamed away, deleted, then Orbax writes the new one through its own temporary
directory); a complete checkpoint is never overwritten. With several processes only the primary
writes, renames or deletes.

**Names.** A tag is a directory name (:func:`check_tag`): no '/' or '\\', at most
:data:`MAX_TAG_BYTES` bytes. The checkpoint directory may be any path the file system takes --
spaces, unicode -- except one holding a backslash, which Orbax and tensorstore read as a separator
(the arrays would land in another directory): :func:`check_path` refuses it before anything is
written or read. A checkpoint records its tag; asked for by a tag (or by ``latest``), a directory
whose name is not that tag (renamed, or another checkpoint copied under it) is refused, as is a
``latest`` that names a tag which is not there -- no other checkpoint is restored in its place. A
checkpoint's own directory passed as such (a copy named ``best``) restores.

**Integrity.** After Orbax commits a checkpoint, jzero reads every file of it back once and
records its size and an XXH3-128 checksum in ``jzero_files.json`` (written atomically), and only
then moves ``latest``. :func:`open_checkpoint` -- used by every reader: restore, convert, inspect
-- checks every file against that list before reading any array, so a missing, truncated or
bit-flipped file (data, array metadata, or the JSON) is a :class:`CheckpointError` naming the
file. XXH3 is a non-cryptographic hash: it detects accidental damage (bit rot, a bad copy), not
deliberate tampering. The cost is one read of the checkpoint at save (in the background thread)
and one at load; docs/checkpoints.md gives the measured seconds per GB.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp
import xxhash
from flax import traverse_util
from flax.core import meta as flax_meta

from jzero.errors import CheckpointError, JZeroWarning
from jzero.sharding.opt_layout import OptLayout
from jzero.sharding.plan import LeafPlan, Plan, flatten_paths, path_str

__all__ = ["FORMAT", "FORMAT_VERSION", "META_FILE", "FILES_FILE", "LATEST_FILE", "WEIGHTS16",
           "DELETING", "ORBAX_TMP", "CHECKSUM", "MAX_TAG_BYTES", "check_path", "nest", "module_names", "leaf_names",
           "opt_leaves", "array_leaves", "array_handler", "check_tag", "is_complete", "latest_tag",
           "all_tags", "incomplete_tags", "resume_tag", "latest_step", "checkpoint_dir",
           "write_atomic", "record_files", "recorded_files", "verify_files", "read_metadata", "optimizer_name",
           "open_checkpoint"]

PyTree = Any
FORMAT = "jzero-checkpoint"
FORMAT_VERSION = 2  # 2: checksums in the file list, client_state, tags
META_FILE = "jzero.json"
FILES_FILE = "jzero_files.json"
LATEST_FILE = "latest"
WEIGHTS16 = "weights16"
DELETING = ".jzero-deleting"
ORBAX_TMP = ".orbax-checkpoint-tmp"
CHECKSUM = "xxh3_128"
#: the longest tag (bytes): a file name's 255 less the suffixes of a save's temporary directory
MAX_TAG_BYTES = 200
_READ_CHUNK_BYTES = 1 << 20
_REPLICA_PARALLEL_MIN_BYTES = 1 << 20


# --- names of the stored arrays ------------------------------------------------------------------


def nest(flat: dict[str, Any]) -> dict:
  """The nested dict of a {'a/b/c': leaf} mapping (what Orbax stores and restores)."""
  return traverse_util.unflatten_dict(flat, sep="/")


def module_names(tree: PyTree) -> dict[str, str]:
  """Each leaf's '/'-joined path -> the module's own name for it.

  Linen's metadata boxes (``nn.with_logical_partitioning``, ``nn.with_partitioning``) are pytree
  nodes: in the params tree a boxed kernel's path ends in the box's field, ``.../kernel/value``,
  while the module built without boxes names it ``.../kernel``. Plain weights (safetensors, the
  params-only Orbax checkpoints) use the module's names.
  """
  return dict(zip(flatten_paths(tree), flatten_paths(flax_meta.unbox(tree))))


def leaf_names(model: PyTree, stored: dict[str, Any]) -> dict[str, str]:
  """Each leaf path of ``model`` -> its name in ``stored`` ({name: ...} of plain weights): the
  module's own name (:func:`module_names`), or the path itself where ``stored`` was written with
  the boxes' names (before they were unboxed)."""
  return {p: (p if p in stored and name not in stored else name)
          for p, name in module_names(model).items()}


def opt_leaves(plan: Plan, tx: optax.GradientTransformation) -> dict[str, LeafPlan | None]:
  """For each optimizer-state array name: the plan leaf it is laid out like (a parameter's twin,
  :mod:`jzero.sharding.opt_layout`), or None (counts, factored statistics...)."""
  return {"opt_state/" + l.path: l.twin for l in OptLayout.of(plan, tx).leaves}


def array_leaves(plan: Plan, tx: optax.GradientTransformation,
                 state: Any) -> dict[str, LeafPlan | None]:
  """Stored array name -> its plan leaf (params, master, param-like optimizer state) or None."""
  leaves = {}
  for leaf in plan.leaf_list():
    leaves[f"params/{leaf.path}"] = leaf
    if state.master is not None:
      leaves[f"master/{leaf.path}"] = leaf
    if getattr(state, "delayed", None) is not None:  # the carried gradient (jzero.tiers.delayed)
      leaves[f"delayed/grads/{leaf.path}"] = leaf
  leaves.update(opt_leaves(plan, tx))
  return leaves


def array_handler() -> ocp.PyTreeCheckpointHandler:
  """Orbax's PyTree handler for trees of jax.Arrays, without replica-parallel writes in one process.

  Replica-parallel saving splits a replicated array among the processes that hold a replica; in a
  single process it only adds a slicing op per array, which JAX compiles on the first save (seconds
  for a model's worth of shapes). Across processes it is kept for slices of at least 1 MiB.
  """
  handler = ocp.type_handlers.ArrayHandler(
      use_replica_parallel=jax.process_count() > 1,
      min_slice_bytes_for_replica_parallel=_REPLICA_PARALLEL_MIN_BYTES)
  return ocp.PyTreeCheckpointHandler(
      type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, handler)))


# --- tags and directories ------------------------------------------------------------------------


def check_path(directory: str | os.PathLike) -> Path:
  """``directory`` as an absolute path Orbax and tensorstore read as written (module docstring,
  *Names*): a backslash is refused."""
  path = Path(directory).absolute()
  if "\\" in str(path):
    raise CheckpointError(
        f"checkpoint directory {str(path)!r} holds a backslash, which Orbax and tensorstore read "
        f"as a path separator: the arrays would be written to {str(path).replace(chr(92), '/')!r} "
        f"instead. Choose a directory name without '\\'.")
  return path


def check_tag(tag: Any) -> str:
  """A checkpoint tag names a directory: a non-empty string without '/' or '\\', at most
  :data:`MAX_TAG_BYTES` long (DeepSpeed's ``tag``)."""
  if isinstance(tag, bool) or not isinstance(tag, (str, int)) or (isinstance(tag, int) and tag < 0):
    raise CheckpointError(f"a checkpoint tag is a directory name (a string, or a non-negative step "
                          f"number); got {tag!r}.")
  tag = str(tag)
  if (not tag or tag in (".", "..", LATEST_FILE) or "/" in tag or os.sep in tag or "\\" in tag
      or tag.startswith(".") or ORBAX_TMP in tag or tag.endswith(DELETING)):
    raise CheckpointError(f"checkpoint tag {tag!r} cannot name a checkpoint directory: use letters, "
                          f"digits, '_', '-' or '.' (not first), e.g. 'epoch_3' or '1200'.")
  if len(tag.encode()) > MAX_TAG_BYTES:
    raise CheckpointError(f"checkpoint tag {tag[:40]!r}... is {len(tag.encode())} bytes long; a tag "
                          f"names a directory, and with the suffix Orbax adds while it writes "
                          f"({ORBAX_TMP!r}) it must fit a file name's 255 bytes: use at most "
                          f"{MAX_TAG_BYTES} bytes.")
  return tag


def _is_checkpoint(path: Path) -> bool:
  return (path / "meta" / META_FILE).is_file()


def is_complete(path: Path) -> bool:
  """Committed by Orbax and recorded by jzero (module docstring): the one test of completeness."""
  return path.is_dir() and (path / FILES_FILE).is_file() and _is_checkpoint(path)


def latest_tag(directory: str | os.PathLike) -> str | None:
  """The tag ``DIR/latest`` holds, or None if there is no such file. (What to restore when no tag
  is given is :func:`resume_tag`.)"""
  path = Path(directory).absolute() / LATEST_FILE
  if not path.is_file():
    return None
  text = path.read_text().strip()
  try:
    return check_tag(text)
  except CheckpointError:
    raise CheckpointError(f"{path} should name a checkpoint, but holds {text[:40]!r}. Rewrite it "
                          f"with the tag to restore (one of {all_tags(directory)}) or pass the "
                          f"tag explicitly.") from None


def all_tags(directory: str | os.PathLike) -> list[str]:
  """Tags of the complete checkpoints in ``directory`` (committed by Orbax and recorded by
  jzero), oldest first: by the step they hold, then by name."""
  root = Path(directory).absolute()
  if not root.is_dir():
    return []
  found = [(_recorded(path, "step", -1), path.name) for path in root.iterdir() if is_complete(path)]
  return [name for _, name in sorted(found, key=lambda x: (x[0], len(x[1]), x[1]))]


def incomplete_tags(directory: str | os.PathLike) -> list[str]:
  """Tags whose directory exists but holds no complete checkpoint (a save killed after Orbax's
  commit and before jzero's file list), by name."""
  root = Path(directory).absolute()
  if not root.is_dir():
    return []
  return sorted(p.name for p in root.iterdir()
                if p.is_dir() and not is_complete(p) and _looks_like_tag(p.name)
                and (_is_checkpoint(p) or (p / "state").is_dir() or (p / "meta").is_dir()))


def _looks_like_tag(name: str) -> bool:
  try:
    return check_tag(name) == name
  except CheckpointError:
    return False


def _recorded(path: Path, key: str, default: Any) -> Any:
  """One entry of a checkpoint's JSON (``default`` where it cannot be read)."""
  try:
    value = json.loads((path / "meta" / META_FILE).read_text())[key]
  except (OSError, ValueError, KeyError, TypeError):
    return default
  return int(value) if key == "step" else value


def resume_tag(directory: str | os.PathLike) -> str | None:
  """The checkpoint to restore when no tag is given: the newest complete one among the one
  ``latest`` names and those saved to become ``latest`` (a save killed before it moved
  ``latest``); None if there is none. Warns about every incomplete directory passed over."""
  root = Path(directory).absolute()
  named = latest_tag(root)
  incomplete = incomplete_tags(root)
  if incomplete:
    warnings.warn(f"{root}: skipping incomplete checkpoint(s) {incomplete} (their save was cut "
                  f"off after Orbax's commit, before jzero recorded the files); the next save "
                  f"under such a tag replaces it.", JZeroWarning, stacklevel=3)
  complete = all_tags(root)
  if named is not None and not (root / named).exists():
    raise CheckpointError(f"{root / LATEST_FILE} names checkpoint {named!r}, which is not in "
                          f"{root} (deleted or moved since it was saved); jzero does not guess "
                          f"another. Restore one by its tag (complete: {complete}), or write the "
                          f"tag to restore into {root / LATEST_FILE}.")
  if named in complete:
    _holding_its_tag(root / named)
  candidates = [t for t in complete  # (a copy under another name is no candidate)
                if (t == named or _recorded(root / t, "save_latest", False) is True)
                and str(_recorded(root / t, "tag", t)) == t]
  if named is not None and named not in candidates:
    warnings.warn(f"{root / LATEST_FILE} names {named!r}, which is not a complete checkpoint; "
                  f"restoring the newest complete one instead.", JZeroWarning, stacklevel=3)
  return candidates[-1] if candidates else None


def latest_step(directory: str | os.PathLike) -> int | None:
  """The optimizer step held by the checkpoint :func:`resume_tag` chooses, or None."""
  tag = resume_tag(directory)
  return None if tag is None else int(read_metadata(directory, tag)["step"])


def checkpoint_dir(directory: str | os.PathLike, tag: str | int | None = None) -> Path:
  """The absolute directory of checkpoint ``tag`` (default: ``latest``); ``directory`` may be a
  checkpoint's own directory. Relative paths are taken from the current directory."""
  root = check_path(directory)
  if root.exists() and not root.is_dir():
    raise CheckpointError(f"checkpoint directory {str(directory)!r} is a file, not a checkpoint "
                          f"directory.")
  if not root.is_dir():
    raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist.")
  if _is_checkpoint(root):
    if tag is not None and root.name != str(tag):
      raise CheckpointError(f"{root} is the checkpoint {root.name!r}, not {str(tag)!r}.")
    return root
  if tag is None:
    tag = resume_tag(root)
    if tag is None:
      named, tags = latest_tag(root), all_tags(root)
      if named is not None:
        raise CheckpointError(f"{root / LATEST_FILE} names {named!r}, but {root / named} is not a "
                              f"complete checkpoint (complete checkpoints present: {tags}).")
      hint = (f"complete checkpoints present: {tags}; pass one explicitly" if tags else
              "it holds no complete checkpoint")
      raise CheckpointError(f"{root} has no '{LATEST_FILE}' file ({hint}).")
    return _holding_its_tag(root / tag)
  tag = check_tag(tag)
  path = root / tag
  if not path.is_dir():
    unfinished = sorted(p.name for p in root.glob(f"{tag}{ORBAX_TMP}*"))
    why = " (its save never finished)" if unfinished else ""
    raise CheckpointError(f"{root} has no checkpoint {tag!r}{why}; complete checkpoints: "
                          f"{all_tags(root)}.")
  if not is_complete(path):
    raise CheckpointError(f"{path} is an incomplete checkpoint: its save was cut off after "
                          f"Orbax's commit and before jzero recorded its files ({FILES_FILE}), so "
                          f"it cannot be trusted. Restore a complete one ({all_tags(root)}); the "
                          f"next save under {tag!r} replaces it.")
  return _holding_its_tag(path)


def _holding_its_tag(path: Path) -> Path:
  """``path``, a checkpoint asked for by its tag, if it holds the checkpoint saved under that tag;
  else (renamed, or another copied under its name) a CheckpointError naming both. A checkpoint's
  own directory passed as such (a copy named ``best``) is not asked for by a tag."""
  saved = _recorded(path, "tag", None)  # (format 1 recorded none)
  if saved is not None and str(saved) != path.name:
    raise CheckpointError(
        f"{path} holds checkpoint {saved!r} (step {_recorded(path, 'step', '?')}), saved under "
        f"that tag and renamed or copied to {path.name!r} since: restoring it as {path.name!r} "
        f"would resume from the wrong step. Rename the directory back to {saved!r}, or pass the "
        f"directory itself ({path}).")
  return path


def write_atomic(path: Path, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary file, fsync and rename."""
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


# --- the file list: sizes and checksums ----------------------------------------------------------


def _checksum(path: Path) -> str:
  """XXH3-128 of a file, read through one reused buffer (host memory stays at one chunk)."""
  digest, buffer = xxhash.xxh3_128(), bytearray(_READ_CHUNK_BYTES)
  view = memoryview(buffer)
  with open(path, "rb", buffering=0) as f:
    while n := f.readinto(buffer):
      digest.update(view[:n])
  return digest.hexdigest()


def _files(step_dir: Path) -> list[Path]:
  return [p for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != FILES_FILE]


def record_files(step_dir: Path) -> int:
  """Writes ``jzero_files.json``: size and checksum of every file of a committed checkpoint.
  Returns the bytes read."""
  files = {str(p.relative_to(step_dir)): {"size": p.stat().st_size, CHECKSUM: _checksum(p)}
           for p in _files(step_dir)}
  write_atomic(step_dir / FILES_FILE, json.dumps({"files": files}, indent=0))
  return sum(f["size"] for f in files.values())


def recorded_files(step_dir: Path) -> dict[str, int]:
  """{relative path: size} of the files a checkpoint's file list records ({} without a list)."""
  listing = step_dir / FILES_FILE
  if not listing.is_file():
    return {}
  return {rel: entry["size"] if isinstance(entry, dict) else entry
          for rel, entry in json.loads(listing.read_text())["files"].items()}


def verify_files(step_dir: Path) -> None:
  """Every file the save wrote exists with its size and checksum; else raises naming the first
  that does not (and the complete checkpoints to fall back to)."""
  listing = step_dir / FILES_FILE
  def others() -> str:
    tags = [t for t in all_tags(step_dir.parent) if t != step_dir.name]
    return (f"complete: {', '.join(tags)}" if tags else
            f"there is no other complete checkpoint in {step_dir.parent}")
  if not listing.is_file():
    raise CheckpointError(f"{step_dir} is an incomplete checkpoint: it has no {FILES_FILE} (its "
                          f"save was cut off after Orbax's commit), so its files cannot be "
                          f"checked. Restore a complete one ({others()}).")
  try:
    files = json.loads(listing.read_text())["files"]
    files = {rel: entry if isinstance(entry, dict) else {"size": entry}  # format 1: sizes only
             for rel, entry in files.items()}
    if not all(isinstance(e.get("size"), int) for e in files.values()):
      raise TypeError("a size is not an integer")
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(f"{listing} is not a valid file list ({e}); the checkpoint was modified "
                          f"after it was written. Restore another checkpoint ("
                          f"{others()}).") from None
  for rel, entry in files.items():
    path = step_dir / rel
    if not path.is_file():
      raise CheckpointError(f"checkpoint {step_dir} is incomplete: file {rel} is missing. The "
                            f"checkpoint was damaged after it was written; restore another one "
                            f"({others()}).")
    if path.stat().st_size != entry["size"]:
      raise CheckpointError(f"checkpoint {step_dir} is corrupt: file {rel} has "
                            f"{path.stat().st_size} bytes but {entry['size']} were written "
                            f"(truncated or overwritten). Restore another checkpoint ("
                            f"{others()}).")
    if CHECKSUM in entry and _checksum(path) != entry[CHECKSUM]:
      raise CheckpointError(f"checkpoint {step_dir} is corrupt: file {rel} does not match the "
                            f"checksum recorded when it was written (its bytes changed: bit rot, a "
                            f"bad copy, or an edit). Restore another checkpoint ("
                            f"{others()}).")


# --- the JSON description ------------------------------------------------------------------------


def read_metadata(directory: str | os.PathLike, tag: str | int | None = None) -> dict:
  """The JSON document of a checkpoint (default: the ``latest`` one) plus ``"path"``."""
  step_dir = checkpoint_dir(directory, tag)
  path = step_dir / "meta" / META_FILE
  try:
    meta = json.loads(path.read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{step_dir} is not a jzero checkpoint: {path} is missing.") from None
  except ValueError as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt.") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CheckpointError(f"{path} is not a jzero checkpoint description.")
  if meta.get("format_version", 0) > FORMAT_VERSION:
    raise CheckpointError(f"{step_dir} was written in checkpoint format "
                          f"{meta['format_version']} by jzero {meta['versions']['jzero']}; this "
                          f"jzero reads format {FORMAT_VERSION}. Upgrade jzero.")
  if "extra" in meta:  # format 1 called the client state "extra"
    meta["client_state"] = meta.pop("extra")
  meta["path"] = str(step_dir)
  return meta


def optimizer_name(config: dict) -> str:
  """The optimizer a checkpoint's recorded config names."""
  opt = config.get("optimizer") or {}
  return str(opt.get("type", "a client optimizer"))


def open_checkpoint(directory: str | os.PathLike, tag: str | int | None = None
                    ) -> tuple[Path, dict]:
  """(absolute checkpoint directory, its JSON) after checking every file against the file list."""
  step_dir = checkpoint_dir(directory, tag)
  verify_files(step_dir)
  return step_dir, read_metadata(step_dir)
