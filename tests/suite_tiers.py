"""The suite's file lists, read by conftest.py (collection order, the slow marker) and by
test_suite_tiers.py; no JAX here, so a test can import it. tests/README.md says how to use the
tiers."""

# The files that take longest, longest first (measured: 2 CPU cores, --durations=0). `--dist
# loadfile` hands whole files to the workers in collection order (`--no-loadscope-reorder` keeps
# it), so the long files start first and the short ones fill in at the end: the two workers finish
# together. A file not listed runs after these, in its usual order.
LONGEST_FIRST = [
    "train/test_engine.py", "comm/test_collective_order.py", "train/test_client_optimizers.py",
    "modeling/test_gather_units.py", "tiers/test_host_step.py",
    "tiers/test_param_nvme.py", "modeling/test_hf_models.py", "comm/test_zeropp.py",
    "journeys/test_user_script.py", "modeling/test_model_state.py",
    "checkpoint/test_checkpoint.py", "checkpoint/test_optax_interop.py", "journeys/test_notebooks.py", "runtime/test_launch.py",
    "planning/test_aot.py", "planning/test_plan_search.py", "docs/test_snippets.py",
    "analysis/test_comm_volume.py", "planning/test_overlap.py", "planning/test_aot_tpu.py",
    "cli/test_cli.py",
    "tiers/test_offload.py", "tiers/test_delayed_update.py", "journeys/test_trust.py",
    "checkpoint/test_kill_resume.py", "checkpoint/test_deepspeed_checkpoint.py",
    "train/test_fp32_skip.py", "tiers/test_nvme.py", "train/test_monitor.py",
    "modeling/test_activation_offload.py",
]


#: The slow tier (``-m slow``; the fast tier, ``-m "not slow"``, is the rest: tests/README.md):
#: the longest files above and the others whose tests each build engines of several configs or
#: start processes. A new file is fast until it is listed here.
SLOW = frozenset(LONGEST_FIRST) | {
    "journeys/test_deepspeed_scripts.py", "journeys/test_first_hour.py",
    "journeys/test_migration.py", "journeys/test_errors.py", "runtime/test_multiprocess.py",
    "train/test_precision.py", "train/test_loop.py",
    "train/test_deepspeed_engine.py", "tiers/test_param_offload.py", "tiers/test_nvme_faults.py",
    "checkpoint/test_checkpoint_faults.py", "kernels/test_mosaic.py", "comm/test_param_array.py",
}
