# Every target does its own set-up: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
ARGS   ?=

.PHONY: run test lint fmt bench gpu-check rdma-check clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $@

## run: start the daemon on its embedded default (host memory, 127.0.0.1)
run: $(STAMP)
	$(VENV)/bin/transferd serve $(ARGS)

## test: the whole suite (unit, integration with real daemons, netns where allowed)
test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check transferd rpc_server client tests benchmarks
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix transferd rpc_server client tests benchmarks

## bench: every figure, side by side with its baseline (see docs/benchmarks.md)
bench: $(STAMP)
	$(PY) -m benchmarks $(ARGS)

## gpu-check: GPU tests and benchmarks, on a machine with a CUDA device
gpu-check: $(STAMP)
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
