# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export PIPELINE_HOME ?= $(CURDIR)/.demo
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export PYTHONPATH := $(CURDIR)

.PHONY: venv demo test bench lock clean

venv: $(VENV)/.installed

# torch alone first, from the CPU wheel; then everything else with torch held by the lock.
$(VENV)/.installed: requirements.txt constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==26.3
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt -c constraints.txt
	touch $@

demo: venv
	$(BIN)/python -m scripts.demo

test: venv
	$(BIN)/python -m pytest -q tests

bench: venv
	$(BIN)/python -m benchmarks $(BENCH)

# Re-lock after changing requirements.txt (in a fresh venv built from requirements.txt alone).
lock:
	$(BIN)/pip freeze | grep -v '^torch==' > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:
	rm -rf $(AIRFLOW_HOME) $(PIPELINE_HOME)
