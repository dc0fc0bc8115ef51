# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export PIPELINE_HOME ?= $(CURDIR)/.demo
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__LOAD_EXAMPLES := False

.PHONY: venv demo demo-tools airflow sandbox test test-fast lint bench lock clean

venv: $(VENV)/.installed

# torch and torchvision first, together (the pair must match: the VL processors import torchvision); then the project
# (editable) with its pins and the lock, the pair held. TORCH_INDEX empty: pip's configured indexes (PyPI's builds,
# CUDA-enabled, which run on CPU; 7.8 GB venv). TORCH_INDEX=https://download.pytorch.org/whl/cpu: PyTorch's CPU builds.
TORCH_INDEX ?=
$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==26.3
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[test]' -r requirements.txt -c constraints.txt
	touch $@

demo: venv
	$(BIN)/python -m scripts.demo

# A tool-using policy that learns on CPU (needs root: the local sandbox server): the tiny tool model learns to call
# the code tool (preset local_tool_learning) beside a control run without the tool; prints tool-call rate, tool
# success rate and reward of the first and last steps, writes a plot (scripts/demo_tools.py).
demo-tools: venv
	bash scripts/system_packages.sh demo-tools
	$(BIN)/python -m scripts.demo_tools

# Airflow with its UI on the local profile (prints the URL; no login, local use only). Ctrl-C stops it.
airflow: venv
	$(BIN)/python -m scripts.airflow_local

# The local E2B-compatible code sandbox server (needs root), for the code and MCP tools: prints the E2B_* settings
# to export; Ctrl-C stops it and its sandboxes.
sandbox: venv
	$(BIN)/python -m pipeline_steps.sandbox.launcher

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Python may cache bytecode in the test runs, as it does by default: pytest then keeps each test module's rewritten
# asserts in __pycache__ for the next run instead of rewriting them in every worker (about 5 s of CPU a worker).
test test-fast: export PYTHONDONTWRITEBYTECODE :=

# The whole suite (CI runs this): lint, then every test, on TEST_WORKERS pytest-xdist workers. Rules: tests/conftest.py.
# 3, not 4: the suite is CPU-bound (95% of both cores), and a fourth worker's Airflows, Ray clusters and trainings
# only add contention. Adjacent fresh-clone runs on 2026-11-29: 3 workers 19 m 00 s (1,930 s of CPU), 4 workers
# 20 m 31 s (2,163 s).
TEST_WORKERS ?= 3
test: lint
	bash scripts/system_packages.sh test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=10 tests

# Everything not marked slow (no real Airflow, Ray or training end to end, nothing over about 5 s of CPU): about
# 3 minutes on two cores (2 m 47 s and 2 m 48 s, lint included, measured twice on 2026-11-29). Short tests that wait
# little: 4 workers (2 m 53 s) edge out 3 (2 m 58 s).
FAST_TEST_WORKERS ?= 4
test-fast: lint
	bash scripts/system_packages.sh test
	$(BIN)/python -m pytest -q -n $(FAST_TEST_WORKERS) -m "not slow" --durations=5 tests

bench: venv
	$(BIN)/python -m benchmarks $(BENCH)

# Re-lock after changing requirements.txt (in a fresh venv built from requirements.txt alone).
lock:
	$(BIN)/pip freeze --exclude-editable | grep -v '^torch==\|^torchvision==\|^nvidia-\|^triton==\|^cuda-' > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:
	rm -rf $(AIRFLOW_HOME) $(PIPELINE_HOME)
