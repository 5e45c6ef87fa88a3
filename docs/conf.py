"""Sphinx configuration of the pyro_fed documentation (`make docs`; CI builds it, warnings as errors)."""

import shutil
import zlib
from pathlib import Path

import pyro_fed

ROOT = Path(__file__).resolve().parents[1]

project = "pyro_fed"
author = "the pyro_fed developers"
copyright = "2026, the pyro_fed developers"
release = version = pyro_fed.__version__

extensions = [
    "myst_nb",  # Markdown pages and the tutorial notebooks, rendered with their stored outputs
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
myst_enable_extensions = ["dollarmath", "amsmath"]
nb_execution_mode = "off"  # the notebooks are committed with outputs; the test suite executes them
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]

# Every cross-reference is checked (nitpicky), and those into Python, PyTorch, NumPy, Pyro, ArviZ, xarray and
# SciPy link to their documentation (intersphinx). Where their inventories cannot be fetched (an offline
# build, as in this project's CI), each falls back to an empty local inventory: its references then stay
# plain text rather than failing the build, while every reference to pyro_fed is still checked.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(torch|numpy|np|collections|os|pyro|arviz|xarray|scipy)(\..*)?")]
# the metrics' alias for draws in any of their forms (spelled out in that module's docstring), and Pyro's
# poutine trace, which type hints name by its short name
nitpick_ignore = [("py:class", "Draws"), ("py:class", "Trace")]
GENERATED = Path(__file__).parent / "generated"
shutil.rmtree(GENERATED, ignore_errors=True)
GENERATED.mkdir()
OFFLINE = GENERATED / "empty.inv"
OFFLINE.write_bytes(
    b"# Sphinx inventory version 2\n# Project: offline\n# Version: 0\n"
    b"# The remainder of this file is compressed using zlib.\n" + zlib.compress(b"")
)
intersphinx_mapping = {
    name: (url, (None, str(OFFLINE)))
    for name, url in {
        "python": "https://docs.python.org/3",
        "torch": "https://docs.pytorch.org/docs/stable",
        "numpy": "https://numpy.org/doc/stable",
        "pyro": "https://docs.pyro.ai/en/stable",
        "arviz": "https://python.arviz.org/en/stable",
        "xarray": "https://docs.xarray.dev/en/stable",
        "scipy": "https://docs.scipy.org/doc/scipy",
    }.items()
}
intersphinx_timeout = 5
html_theme = "furo"
html_title = f"pyro_fed {release}"

# The tutorials live in tutorials/, where the test suite runs them; Sphinx reads documents only below docs/,
# so they are copied at each build (the benchmark pages include benchmarks/results/ files by relative path).
(GENERATED / "tutorials").mkdir()
for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
    shutil.copy(notebook, GENERATED / "tutorials" / notebook.name)
