# Every target does its own set-up: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
ARGS   ?=

.PHONY: run test lint fmt fuzz bench bench-engine bench-venv gpu-check rdma-deps rdma-check soak clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# Best effort: link the system's pyverbs where it is installed (never installs it).
	-@VENV=$(VENV) bash scripts/rdma-deps.sh --link 2>/dev/null || true
	@rm -f $(VENV)/.installed-*; touch $@

## run: start the daemon on its embedded default (host memory, 127.0.0.1)
run: $(STAMP)
	$(VENV)/bin/transferd serve $(ARGS)

## test: the whole suite (unit, integration with real daemons, netns where allowed)
test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check transferd rpc_server client tests benchmarks fuzzing examples
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix transferd rpc_server client tests benchmarks fuzzing examples

## fuzz: atheris fuzz targets (fuzzing/: decoder, connections, peer handshake and headers,
## command dispatch) for FUZZ_SECONDS in all (default 240), seeded from docs/protocol.md's
## frames; installs atheris into the venv (docs/security.md, "Fuzzing"). Not in `make test`.
FUZZ_SECONDS ?= 240
fuzz: $(STAMP)
	@$(PY) -c 'import atheris' 2>/dev/null || $(PY) -m pip install -q atheris || \
		echo "fuzz: atheris could not be installed: the fallback driver runs the targets"
	$(PY) -m fuzzing.run --seconds $(FUZZ_SECONDS) $(ARGS)

## bench: every figure, side by side with its baseline (see docs/benchmarks.md)
bench: $(STAMP)
	$(PY) -m benchmarks $(ARGS)

## bench-engine: the transfer engine's figures only (issue 3); ARGS=--quick for a short run
bench-engine: $(STAMP)
	$(PY) -m benchmarks --only engine $(ARGS)

## soak: 16 clients and 3 daemons under mixed load for SOAK_SECONDS (default 180), every
## byte checked at the end; benchmarks/results/soak.json and soak.png (docs/operations.md)
SOAK_SECONDS ?= 180
soak: $(STAMP)
	@# The PNG needs the optional plot extra; without it the soak runs and says so.
	-@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q -e '.[plot]'
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m benchmarks.soak $(ARGS)

## bench-venv: Mooncake and NIXL for the engine figures, in .bench-venv (never a dependency)
BENCH_VENV ?= .bench-venv
bench-venv:
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	-$(BENCH_VENV)/bin/python -m pip install -q mooncake-transfer-engine-non-cuda
	-$(BENCH_VENV)/bin/python -m pip install -q --no-deps nixl nixl-cu12
	-$(BENCH_VENV)/bin/python -m pip install -q numpy
	@echo "Mooncake needs libibverbs.so.1 even over TCP (Debian: apt-get install libibverbs1)."

## gpu-check: GPU tests and benchmarks and a report under $(OUT) (docs/gpu.md); no venv,
## nothing installed: the machine's own python3 (PYTHON=...) with the checkout on the path.
## ARGS=--dry-run exercises the script's plumbing where there is no GPU.
gpu-check:
	bash scripts/gpu-check.sh $(ARGS)

## rdma-deps: pyverbs from the system (python3-pyverbs), linked into the venv (docs/rdma.md)
rdma-deps: $(STAMP)
	VENV=$(VENV) bash scripts/rdma-deps.sh

## rdma-check: tests/rdma over soft-RoCE (rdma_rxe) or real NICs; a report in $(OUT) (docs/rdma.md)
rdma-check: $(STAMP)
	bash scripts/rdma-check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
