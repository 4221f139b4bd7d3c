"""What every ``build_<name>.py`` here does with its cells: execute them top to bottom in a fresh
kernel (nbclient) and write ``<name>.ipynb`` with the outputs. The kernel runs in an empty
temporary folder: a notebook must run from any working directory, and one that reads a path
relative to where it runs fails here, not on a reader's machine."""

import tempfile
from pathlib import Path

import nbclient
import nbformat
from nbformat.v4 import new_notebook

HERE = Path(__file__).parent


def execute_and_write(cells: list, name: str) -> None:
  notebook = new_notebook(cells=cells, metadata={
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
  with tempfile.TemporaryDirectory() as elsewhere:
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": elsewhere}}).execute()
  nbformat.write(notebook, HERE / f"{name}.ipynb")
