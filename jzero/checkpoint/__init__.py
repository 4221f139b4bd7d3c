"""Checkpoints: sharded asynchronous save / restore of the train state, resharding, conversion.

One module per phase:

* :mod:`jzero.checkpoint.layout` -- the directory on disk: tags, ``latest``, the file list with
  sizes and checksums that every reader verifies, the JSON description.
* :mod:`jzero.checkpoint.save` -- :class:`Checkpointer`: the complete train state as it lies on the
  devices, written asynchronously by Orbax, committed atomically, never lost at program exit;
  :mod:`jzero.checkpoint.claim` -- one writer per directory (a lock naming its holder), the
  directory checked writable before each save.
* :mod:`jzero.checkpoint.restore` -- :func:`load_checkpoint` into any stage, device count, mesh or
  precision, each device reading only its own shard.
* :mod:`jzero.checkpoint.weights` -- DeepSpeed's ``zero_to_fp32`` (:func:`consolidate`) and
  importing plain weights for fine-tuning, each process reading only its shard
  (:func:`load_weights`).
* :mod:`jzero.checkpoint.describe` -- ``jzero inspect``.
* :mod:`jzero.checkpoint.deepspeed` -- DeepSpeed ZeRO checkpoints read without torch
  (:func:`read_deepspeed`, ``.pt`` files through :mod:`jzero.checkpoint.deepspeed_pt`) and
  :mod:`jzero.checkpoint.deepspeed_import` -- continuing their run in an engine
  (:func:`import_deepspeed`).
* :mod:`jzero.checkpoint.optax_import` -- a plain Flax + optax run's Orbax checkpoint read
  (:func:`read_optax`) and continued in an engine (:func:`import_optax`);
  :mod:`jzero.checkpoint.optax_export` -- a jzero checkpoint written as such a run's
  (:func:`export_optax`).

A checkpoint is named by a *tag*, DeepSpeed's word: by default the optimizer step (``DIR/20``), or
any name (``engine.save_checkpoint(state, DIR, tag="epoch_0")``); ``DIR/latest`` holds the tag of
the newest finalized one. Every path may be relative. Nothing in a checkpoint is executable: JSON,
and Orbax's OCDBT / zarr array store, whose metadata is JSON too (no pickle anywhere).
"""

from jzero.checkpoint.deepspeed import (DeepSpeedCheckpoint, convert_deepspeed,
                                        describe_deepspeed, find_deepspeed, read_deepspeed,
                                        stream_fp32)
from jzero.checkpoint.deepspeed_import import import_deepspeed
from jzero.checkpoint.describe import describe
from jzero.checkpoint.optax_export import export_optax
from jzero.checkpoint.optax_import import import_optax, read_optax
from jzero.checkpoint.layout import (CHECKSUM, FILES_FILE, LATEST_FILE, META_FILE, WEIGHTS16,
                                     all_tags, incomplete_tags, is_complete, latest_step,
                                     latest_tag, read_metadata, resume_tag)
from jzero.checkpoint.restore import load_checkpoint
from jzero.checkpoint.save import Checkpointer, save_checkpoint, wait_until_finished, writer
from jzero.checkpoint.weights import (ConsolidateReport, consolidate, load_model_state,
                                      load_weights, read_weights)

__all__ = [
    "Checkpointer", "save_checkpoint", "writer", "load_checkpoint", "wait_until_finished",
    "latest_tag",
    "latest_step", "resume_tag", "all_tags", "incomplete_tags", "is_complete", "read_metadata", "consolidate", "ConsolidateReport",
    "load_weights", "load_model_state", "read_weights", "describe", "CHECKSUM", "FILES_FILE",
    "LATEST_FILE", "META_FILE", "WEIGHTS16", "DeepSpeedCheckpoint", "read_deepspeed",
    "import_deepspeed", "convert_deepspeed", "describe_deepspeed", "find_deepspeed",
    "stream_fp32", "read_optax", "import_optax", "export_optax",
]
