# nxdi developer commands. Each target creates .venv when it is missing and installs into it.
#
#   make demo     set up, then run the main job (`nxdi demo`)
#   make test     set up, then `make lint` (ruff check, ruff format --check, mypy nxdi/core, import-linter), pytest
#   make lint     the same checks without the tests
#   make format   ruff format + ruff check --fix
#   make bench    set up, then `nxdi bench $(BENCH_ARGS)`
#   make test-xla the XLA tier (tests/xla) in its own environment, .venv-xla: torch-xla 2.9 needs
#                 torch 2.9 (a CUDA build from the package registry: ~4 GB download, ~7 GB installed)
#   make test-examples  the examples tier (tests/examples): the documentation's examples as written
#
# The install step is recorded in a stamp file and reruns only when pyproject.toml or this Makefile
# changes, so repeated runs start immediately.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nxdi-installed
# torch is pinned here (not in pyproject.toml, which admits the torch-neuronx releases): the CPU
# build of 2.13.0 is what the development machines and CI use, so no CUDA build is pulled.
TORCH ?= torch==2.13.0
PIP_ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
XLA_VENV ?= .venv-xla
XLA_BIN := $(XLA_VENV)/bin
XLA_STAMP := $(XLA_VENV)/.nxdi-installed
XLA_TORCH ?= torch==2.9.0 torch-xla==2.9.0

.PHONY: setup demo test lint format bench clean test-xla setup-xla test-examples

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install $(PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install $(PIP_ARGS) -e ".[dev]"
	$(BIN)/nxdi kernels || echo "make: nxdi's CPU kernels were not built (above says why); the CPU backend uses torch's kernels" >&2
	touch $(STAMP)

demo: setup
	$(BIN)/nxdi demo

# pytest exits 5 when it collected no tests; the suite always has tests, so that is a failure too.
# The suite runs in TEST_WORKERS pytest-xdist workers, each test file on one of them (its session
# fixtures built once), each worker on one torch thread (tests/conftest.py): 13 min of pytest on
# 2 cores where one process took 24-27. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests (exit 5): treating as failure" >&2; fi; \
	exit $$status

lint: setup
	$(BIN)/ruff check nxdi tests
	$(BIN)/ruff format --check nxdi tests
	$(BIN)/mypy nxdi/core
	$(BIN)/lint-imports

format: setup
	$(BIN)/ruff format nxdi tests
	$(BIN)/ruff check --fix nxdi tests

# The XLA tier: its own venv (the main one keeps torch 2.13), then tests/xla only. A registry that
# cannot serve torch-xla fails the set-up, saying so; the tier is never skipped.
setup-xla: $(XLA_STAMP)

$(XLA_BIN)/python:
	$(PYTHON) -m venv $(XLA_VENV)

$(XLA_STAMP): pyproject.toml Makefile | $(XLA_BIN)/python
	$(XLA_BIN)/python -m pip install $(PIP_ARGS) $(XLA_TORCH) || { \
	  echo "make test-xla: could not install $(XLA_TORCH) from the package registry; the XLA tier cannot run" >&2; exit 1; }
	$(XLA_BIN)/python -m pip install $(PIP_ARGS) -e ".[dev]"
	touch $(XLA_STAMP)

test-xla: setup-xla
	$(XLA_BIN)/pytest tests/xla -o addopts="-ra --strict-markers" $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no XLA tests (exit 5): treating as failure" >&2; fi; \
	exit $$status

# The examples tier: the guides' examples at the tensor-parallel degrees they name (slow on 2 cores).
test-examples: setup
	$(BIN)/pytest tests/examples -o addopts="-ra --strict-markers" $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no example tests (exit 5): treating as failure" >&2; fi; \
	exit $$status

bench: setup
	$(BIN)/nxdi bench $(BENCH_ARGS)

clean:
	rm -rf $(XLA_VENV)
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info
