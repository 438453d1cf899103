# Two entry points, each setting up its own environment on a fresh machine:
#   make conformance   the main job: normkit's conformance report on the installed backends
#                      (reports in out/conformance.json and out/conformance.md)
#   make test          lint (ruff), types (mypy), then the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 is pinned for development and CI only (a CPU wheel on these machines);
# the library itself accepts torch >= 2.4.
TORCH_PIN := torch==2.13.0

.PHONY: install test conformance docs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[all,test]'
	touch $@

test: install docs
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

conformance: install
	$(BIN)/normkit info
	mkdir -p out
	$(BIN)/normkit conformance --json out/conformance.json --markdown out/conformance.md

# The docs site with the API reference from the docstrings; --strict fails on a broken reference.
docs: $(VENV)/.docs-installed
	$(BIN)/mkdocs build --strict --quiet

$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@
