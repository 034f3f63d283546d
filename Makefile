# The two first commands of the README: `make demo` and `make test`. Both set up .venv first.
# STACK picks the tested torch/fbgemm/torchrec trio (scripts/install.sh): 2.13 (default, in
# .venv) or 2.14 (torch 2.14.1 + fbgemm 1.9.0 + torchrec 1.9.2, in .venv-2.14):
#   make setup STACK=2.14      make test-fast STACK=2.14      (or VENV=.venv-2.14)
ifdef STACK
VENV ?= $(if $(filter 2.13,$(STACK)),.venv,.venv-$(STACK))
else
VENV ?= .venv
STACK := $(or $(patsubst .venv-%,%,$(filter .venv-%,$(notdir $(VENV)))),2.13)
endif
BIN := $(VENV)/bin

.PHONY: setup system-deps demo test test-fast lint protos docs vectors bench clean
# The venv, then the C++ client (clients/cpp -> build/cpp; the default stack only): where its
# packages are missing (`make system-deps`) it says so in one line and its tests skip;
# DELTAD_REQUIRE_CPP=1 (CI) makes that an error.
setup:
	@DELTAD_VENV=$(VENV) DELTAD_STACK=$(STACK) bash scripts/install.sh
	@if [ "$(STACK)" = 2.13 ]; then DELTAD_VENV=$(VENV) bash scripts/build_cpp.sh; fi

# As root: the Debian packages of the C++ client (scripts/build_cpp.sh) and promtool
# (tests/test_alerts.py); .ci/run runs it. Without them `make setup` skips the C++ client.
system-deps:
	@bash scripts/system_deps.sh

demo: setup
	$(BIN)/deltad demo

test: setup
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check deltad trainer consumers bench tests
	$(BIN)/ruff format --check deltad trainer consumers bench tests
	$(BIN)/mypy
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --durations=30

# Day-to-day lane: everything but the multi-process training, subprocess and long tests.
# Budget: under 3 min on 2 cores; the slowest tests are listed so a new one that breaks the
# budget shows itself (tests/conftest.py shares one Redis and one PKI across tests).
# PYTHONDONTWRITEBYTECODE cleared: the tests start ~20 deltad processes and rewrite ~60 test
# modules; with it set (as on these machines) each recompiles from source every run (~4 s).
test-fast: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m "not slow" --durations=15

lint: setup
	$(BIN)/ruff check deltad trainer consumers bench tests
	$(BIN)/ruff format --check deltad trainer consumers bench tests
	$(BIN)/mypy

protos: setup
	$(BIN)/python scripts/gen_protos.py

# Regenerate docs/cli.md, docs/metrics.md and the PrometheusRule (tests/test_docs.py fails on
# a stale one), and the conformance vectors (tests/test_conformance.py fails on a changed wire).
docs: setup
	$(BIN)/python scripts/gen_docs.py

vectors: setup
	$(BIN)/python scripts/record_vectors.py

bench: setup
	$(BIN)/deltad bench

clean:
	rm -rf $(VENV) build/cpp .pytest_cache .mypy_cache .ruff_cache
