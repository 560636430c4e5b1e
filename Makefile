# Targets mirror CI: install, test, lint, bench, demo.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test test-solvers lint format bench bench-peers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned explicitly and installed first: an open range would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,plot,cpsat,hf]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python examples/demo.py

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The torch-free core alone (what `pip install` without torch supports).
test-solvers: install
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check solvers checkmate tests examples benchmarks
	$(BIN)/ruff format --check solvers checkmate tests examples benchmarks
	$(BIN)/mypy

format: install
	$(BIN)/ruff format solvers checkmate tests examples benchmarks
	$(BIN)/ruff check --fix solvers checkmate tests examples benchmarks

bench: install
	$(BIN)/python -m benchmarks.run

bench-peers: install
	$(BIN)/python -m benchmarks.peers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
