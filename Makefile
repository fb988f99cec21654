# Two entry points for a fresh machine: `make demo` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NIXL_PKGS := nixl==1.5.1 nixl-cu13==1.5.1

.PHONY: accel demo demo-preflight demo-mooncake demo-nixl soak test lint typecheck bench docs clean system-deps \
	vllm-venv vllm-src vllm-hf vllm-baseline test-vllm vllm033-venv test-vllm-033 clean-vllm spin-anchor verify-depth \
	sglang-venv test-sglang clean-sglang

# Python packages: the library with every extra (the harness, Prometheus, Mooncake, the
# report's plots, the documentation site), NIXL and the test tools, in a local virtual
# environment.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test,docs,harness,prometheus,mooncake,report]'
	# NIXL, lean: no torch, no CUDA libraries (an extra cannot say --no-deps; plain
	# `pip install nixl` pulls about 3 GB of them). Only numpy is needed to import it.
	$(BIN)/pip install -q --no-deps $(NIXL_PKGS)
	touch $(STAMP) $(DEMO_STAMP)

# What `make demo` needs and no more: the library with the harness and the report extras.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml
	@echo "make demo: installing kvlifetime[harness,report] into $(VENV) (first time: about a minute)"
	@$(PY) -m venv $(VENV)
	@$(BIN)/pip install -q -U pip
	@$(BIN)/pip install -q -e '.[harness,report]'
	@touch $(DEMO_STAMP)

# Debian packages some tests need: graphviz (svg diagrams), libibverbs1 & co (Mooncake's
# import), spin (the model-checker anchor), chromium (the report's browser test), gcc and
# python3-dev (make accel compiles the ledger's hot path). Installed when running as root with apt-get; otherwise install them yourself
# (the tests that need them say which package is missing).
DEBS := graphviz libibverbs1 librdmacm1 libnuma1 spin chromium gcc python3-dev
system-deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u 2>/dev/null)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing >/dev/null; \
	  else echo "note: missing Debian packages:$$missing (need root to install)"; fi; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check kvlifetime tests examples bench
	$(BIN)/ruff format --check kvlifetime tests examples bench

typecheck: $(STAMP)
	$(BIN)/mypy

# The optional accelerator: the ledger's and the verifier's hot paths compiled by mypyc from
# their own source, in place (kvlifetime/ledger/*.so, kvlifetime/verify/*.so; about 2.5 min on
# 2 loaded cores). `python hatch_build.py --clean` removes
# it; KVLIFETIME_PURE=1 runs the sources beside it. Not needed to install or run kvlifetime.
accel: system-deps $(STAMP)
	$(BIN)/python hatch_build.py

# The suite runs on the compiled modules (tests/test_accel.py fails if they are not the ones
# imported) and runs the pure path's differential tests too. TEST_JOBS pytest-xdist workers, a
# test file to a worker (its module fixtures built once); TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
test: system-deps $(STAMP) lint typecheck accel
	KVLIFETIME_REQUIRE_ACCEL=1 $(BIN)/pytest -n $(TEST_JOBS) --dist loadfile

# DEMO_ARGS: e.g. `--requests 100` (CI runs each demo target that small); the default is 1,000
# requests per run, about a minute in all on 2 cores; `--requests 10000` is the manual's size.
DEMO_ARGS ?=

# Before anything is installed or run, one line and exit 1 for what `make demo` cannot do itself:
# a Python older than 3.11, a Python without venv, or no Graphviz `dot` (installed here when
# running as root with apt-get).
demo-preflight:
	@command -v $(PY) >/dev/null 2>&1 || { \
	  echo "make demo: $(PY) not found: install Python 3.11 or newer, or run make demo PY=/path/to/python3"; exit 1; }
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make demo: needs Python 3.11 or newer; $(PY) is $$($(PY) -V 2>&1): run make demo PY=python3.11 (or newer)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -c 'import ensurepip' 2>/dev/null || { \
	  echo "make demo: $(PY) cannot make a virtual environment: install python3-venv (apt-get install python3-venv)"; exit 1; }
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u 2>/dev/null)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make demo: installing Graphviz (apt-get install graphviz)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends graphviz >/dev/null || exit 1; \
	  else \
	    echo "make demo: Graphviz's dot is not installed and cannot be installed here (not root with apt-get): install graphviz (apt-get install graphviz, dnf install graphviz, brew install graphviz), then make demo again"; exit 1; \
	  fi; }

demo: demo-preflight $(DEMO_STAMP)
	$(BIN)/kvlifetime demo --out out $(DEMO_ARGS)

demo-mooncake: demo-preflight system-deps $(STAMP)
	$(BIN)/kvlifetime demo --out out --backend mooncake $(DEMO_ARGS)

demo-nixl: demo-preflight $(STAMP)
	$(BIN)/kvlifetime demo --out out --backend nixl $(DEMO_ARGS)

# The long proof run with fences, 50,000 requests, on each backend (minutes on Mooncake).
soak: system-deps $(STAMP)
	$(BIN)/python -m bench.soak --backend inproc --out out/soak-inproc.json
	$(BIN)/python -m bench.soak --backend mooncake --out out/soak-mooncake.json
	$(BIN)/python -m bench.soak --backend nixl --out out/soak-nixl.json

# The generated pages (tables, diagrams, engine profiles) into docs/, then the site into
# out/site, strictly (a broken link or an unresolved reference fails). make test builds it too.
docs: $(STAMP)
	$(BIN)/kvlifetime docs --out docs --figures kvlifetime/report/lifecycle-svg
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP) vllm-venv vllm-hf system-deps sglang-venv
	$(BIN)/python -m bench
	# The step-columnar rows beside the object ledger (issue 32), a small and a large step.
	$(BIN)/python -m bench.step_rows --per-step 16 --out out/bench-step-rows-16.json
	$(BIN)/python -m bench.step_rows --per-step 256 --out out/bench-step-rows-256.json
	$(BIN)/python -m bench.step_kernel --per-step 16 --out out/bench-step-kernel-16.json
	$(BIN)/python -m bench.step_kernel --per-step 256 --out out/bench-step-kernel-256.json
	$(MAKE) spin-anchor
	# The compiled checker beside SPIN on the same generated model (issue 34), and at depth.
	$(BIN)/python -m bench.compiled_spin --out out/bench-compiled-spin.json
	$(BIN)/python -m bench.compiled_targets --out out/bench-compiled-targets.json
	# The guard's cost inside vLLM 0.34 (its real Scheduler and BlockPool), in the vLLM venv.
	$(VLLM_VENV)/bin/python -m bench.vllm_scheduler --out out/bench-vllm-scheduler.json 2>/dev/null
	$(VLLM_VENV)/bin/python -m bench.vllm_blockpool --out out/bench-vllm-blockpool.json 2>/dev/null
	# The guard's cost in SGLang 0.5.23's decode tick and prefill inflight queue, in its venv.
	$(SGLANG_VENV)/bin/python -m bench.sglang_cost --out out/bench-sglang.json

# SPIN beside `kvlifetime verify` on the same configurations (the Promela model generated by
# `kvlifetime promela`): one table, both checkers' verdicts compared (exit 1 if they
# disagree). Tens of minutes; not in test.
spin-anchor: system-deps $(STAMP)
	$(BIN)/python -m bench.spin_anchor --out out

# The verifier's depth targets (3x2x3 every fault kind at one and two faults per run; 2x2x2
# with the per-kind bounds only), each stopped at 10 minutes. Tens of minutes; not in test.
verify-depth: $(STAMP)
	$(BIN)/python bench/verify_depth.py --limit 600

clean:
	rm -rf $(VENV) out .mypy_cache .pytest_cache .ruff_cache

# vLLM's own scheduler and KV-connector unit tests, on CPU (see vllm-tests/README.md): a venv
# of their own (torch's CPU build, vLLM without its CUDA dependencies), the tests from vLLM's
# source distribution, an offline Hugging Face cache with opt-125m's config. VLLM_VERSION is the
# release the baseline (vllm-tests/expected-outcomes.json) was recorded on; the stamps carry it,
# so a checkout that moves to another release rebuilds the venv and the sources.
VLLM_VERSION := 0.34.0
VLLM_VENV := .venv-vllm
VLLM_SRC := .vllm-src
VLLM_HF := .vllm-hf
VLLM_STAMPS := $(VLLM_VENV)/.installed-$(VLLM_VERSION) $(VLLM_SRC)/.extracted-$(VLLM_VERSION) \
	$(VLLM_HF)/.written
# Parallel pytest workers (pytest-xdist) for vLLM's tests; 1 runs them in one process.
VLLM_TEST_JOBS ?= 2
VLLM_RUN := $(VLLM_VENV)/bin/python vllm-tests/run.py --venv $(VLLM_VENV) --src $(VLLM_SRC) \
	--hf-home $(VLLM_HF) --jobs $(VLLM_TEST_JOBS)

$(VLLM_VENV)/.installed-$(VLLM_VERSION): vllm-tests/setup-venv.sh vllm-tests/requirements.txt pyproject.toml
	VLLM_VERSION=$(VLLM_VERSION) PY=$(PY) bash vllm-tests/setup-venv.sh $(VLLM_VENV)
	touch $@

$(VLLM_SRC)/.extracted-$(VLLM_VERSION): vllm-tests/fetch-src.sh
	VLLM_VERSION=$(VLLM_VERSION) bash vllm-tests/fetch-src.sh $(VLLM_SRC)
	touch $@

$(VLLM_HF)/.written: vllm-tests/write-hf-cache.py
	$(PY) vllm-tests/write-hf-cache.py $(VLLM_HF)
	touch $@

vllm-venv: $(VLLM_VENV)/.installed-$(VLLM_VERSION)
vllm-src: $(VLLM_SRC)/.extracted-$(VLLM_VERSION)
vllm-hf: $(VLLM_HF)/.written

# Without the guard: rewrites vllm-tests/expected-outcomes.json (commit it).
vllm-baseline: $(VLLM_STAMPS)
	$(VLLM_RUN) baseline

# With the guard's pytest plugin (KVLIFETIME_VLLM_PLUGIN overrides its name): every test id's
# outcome must equal the baseline's, or be one of the differences vllm-tests/intended.json lists
# with its reason and the test that pins it; then the project's own tests/in_vllm/.
test-vllm: $(VLLM_STAMPS)
	$(VLLM_RUN) guarded

# vLLM 0.33, still supported: its own venv, and the project's tests/in_vllm/ on its real
# classes. (Its own-suite comparison is not run: CI's time goes to the primary release's.)
VLLM033_VENV := .venv-vllm-033

$(VLLM033_VENV)/.installed: vllm-tests/setup-venv.sh vllm-tests/requirements.txt pyproject.toml
	VLLM_VERSION=0.33.0 PY=$(PY) bash vllm-tests/setup-venv.sh $(VLLM033_VENV)
	touch $@

vllm033-venv: $(VLLM033_VENV)/.installed

test-vllm-033: $(VLLM033_VENV)/.installed $(VLLM_HF)/.written
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 HF_HOME=$(CURDIR)/$(VLLM_HF) \
		$(VLLM033_VENV)/bin/python -m pytest tests/in_vllm -p no:cacheprovider -o addopts= -q

clean-vllm:
	rm -rf $(VLLM_VENV) $(VLLM_SRC) $(VLLM_HF) $(VLLM033_VENV)

# SGLang 0.5.23's disaggregation classes (decode/prefill queues, KV pools, radix cache, the
# Mooncake backend) on CPU, in a venv of their own (sglang-tests/setup-venv.sh: torch's CPU build,
# SGLang without its CUDA dependencies), driven by tests/in_sglang/ in two processes over
# Mooncake TCP on loopback.
SGLANG_VENV := .venv-sglang

$(SGLANG_VENV)/.installed: sglang-tests/setup-venv.sh sglang-tests/requirements.txt \
		sglang-tests/constraints.txt sglang-tests/torchvision_shim.py pyproject.toml
	PY=$(PY) bash sglang-tests/setup-venv.sh $(SGLANG_VENV)
	touch $@

sglang-venv: $(SGLANG_VENV)/.installed

# The scenarios, each with SGLang alone and with the guard installed.
test-sglang: system-deps $(SGLANG_VENV)/.installed
	$(SGLANG_VENV)/bin/pytest -o addopts=-q -p no:cacheprovider tests/in_sglang

clean-sglang:
	rm -rf $(SGLANG_VENV)
