# Two entry points: `make demo` and `make test` (lint, docs, tests); `make docs` builds the site alone.
# Each creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint docs benchmark

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build on this machine's disk; the package itself accepts a range
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,docs]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python examples/titanic.py --out output/titanic

lint: $(BIN)/.installed
	$(BIN)/ruff check pyro_fed tests examples benchmarks tutorials docs
	$(BIN)/ruff format --check pyro_fed tests examples benchmarks tutorials docs

# the documentation site, warnings as errors (docs/_build/html/index.html)
docs: $(BIN)/.installed
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

test: $(BIN)/.installed lint docs
	$(BIN)/python -m pytest

benchmark: $(BIN)/.installed
	$(BIN)/python benchmarks/step_cost.py
