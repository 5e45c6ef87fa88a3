"""Sphinx configuration of the pyro_fed documentation (`make docs`; CI builds it, warnings as errors)."""

import shutil
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
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
myst_enable_extensions = ["dollarmath", "amsmath"]
nb_execution_mode = "off"  # the notebooks are committed with outputs; the test suite executes them
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"pyro_fed {release}"

# The tutorials live in tutorials/, where the test suite runs them; Sphinx reads documents only below docs/,
# so they are copied at each build (the benchmark pages include benchmarks/results/ files by relative path).
GENERATED = Path(__file__).parent / "generated"
shutil.rmtree(GENERATED, ignore_errors=True)
(GENERATED / "tutorials").mkdir(parents=True)
for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
    shutil.copy(notebook, GENERATED / "tutorials" / notebook.name)
