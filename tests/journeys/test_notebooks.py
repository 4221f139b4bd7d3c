"""The notebooks run top to bottom headless, from any directory (each asserts its own key numbers
inside), and are committed with their outputs, plots included, so that a reader on GitHub sees
what they produce.
(notebooks/zero3_to_flax.ipynb is executed by tests/checkpoint/test_checkpoint.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("name", ["which_stage_fits", "same_loss", "what_zeropp_saves",
                                  "where_everything_lives", "plan_candidates"])
def test_notebook_executes_and_is_committed_with_its_plots(name, tmp_path):
  import nbclient
  import nbformat

  path = NOTEBOOKS / f"{name}.ipynb"
  committed = nbformat.read(path, as_version=4)
  images = [o for c in committed.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert images, f"{path.name} is committed without its plots: run notebooks/build_{name}.py"
  notebook = nbformat.read(path, as_version=4)
  # run from elsewhere: a notebook reads no file relative to the directory it runs in
  nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
  # (its printed float distances are this CPU's rounding: the notebook's own asserts carry the
  # bounds, not a comparison with the committed printout)
  assert not [o for c in committed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"], "committed with an error output"
