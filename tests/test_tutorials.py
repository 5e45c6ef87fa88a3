"""Every notebook in tutorials/ runs end to end at smoke size (``CI`` set), in this environment."""

import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))

# The kernelspec "python3" found first may belong to another Python (a user-level kernelspec wins over this
# environment's). This first cell, run in the kernel, fails the test if the kernel is not this environment,
# where pyro_fed is installed: a clear message instead of an ImportError in some later cell.
CHECK_INTERPRETER = f"""
import sys
assert sys.prefix == {sys.prefix!r}, f"the notebook kernel runs {{sys.executable}}, not {sys.executable!r}"
"""


def test_there_are_tutorials():
    assert NOTEBOOKS, f"no notebooks in {TUTORIALS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_tutorial_runs(path, monkeypatch):
    # the notebooks read CI to pick their smoke size; the kernel inherits this process's environment
    monkeypatch.setenv("CI", "1")
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(CHECK_INTERPRETER))
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",  # jupyter_client launches a "python" kernelspec with sys.executable
        timeout=600,  # per cell
        resources={"metadata": {"path": str(path.parent)}},  # run in tutorials/, as a reader would
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any cell error
