# Two entry points for a fresh machine: `make demo` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-mooncake test lint typecheck bench docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test,harness,prometheus]'
	touch $(STAMP)

$(VENV)/.mooncake: $(STAMP)
	$(BIN)/pip install -q -e '.[mooncake]'
	touch $(VENV)/.mooncake

lint: $(STAMP)
	$(BIN)/ruff check kvlifetime tests examples bench
	$(BIN)/ruff format --check kvlifetime tests examples bench

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) lint typecheck
	$(BIN)/pytest

demo: $(STAMP)
	$(BIN)/kvlifetime demo --out out

demo-mooncake: $(VENV)/.mooncake
	$(BIN)/kvlifetime demo --out out --backend mooncake

docs: $(STAMP)
	$(BIN)/kvlifetime docs --out docs

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) out .mypy_cache .pytest_cache .ruff_cache
