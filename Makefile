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

.PHONY: install test conformance docs gpu-wheels gpu-check

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
	$(BIN)/python -m pytest -n 2 --dist worksteal

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

# The wheels scripts/gpu-check carries to a GPU machine that has torch, JAX and the test tools but
# no package registry (docs/gpu.md): Keras with the two packages of its own it lacks there, and
# Liger-Kernel; CPython 3.12 on x86-64, about 4 MB.
GPU_WHEELS := .whl/gpu
GPU_WHEEL_PINS := keras==3.15.1 namex==0.1.0 optree==0.20.0 liger-kernel==0.8.5
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)

# On the GPU machine, with its own Python (docs/gpu.md); without a GPU it only checks, in one line.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu-check
