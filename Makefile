# Two entry points: `make demo` and `make test`. Each creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint benchmark

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build on this machine's disk; the package itself accepts a range
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python examples/titanic.py --out output/titanic

lint: $(BIN)/.installed
	$(BIN)/ruff check pyro_fed tests examples benchmarks tutorials
	$(BIN)/ruff format --check pyro_fed tests examples benchmarks tutorials

test: $(BIN)/.installed lint
	$(BIN)/python -m pytest

benchmark: $(BIN)/.installed
	$(BIN)/python benchmarks/step_cost.py
