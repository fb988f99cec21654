#!/usr/bin/env bash
# Builds the venv in which vLLM's (VLLM_VERSION, default 0.34.0) scheduler, connector API and unit tests run on a CPU
# machine: torch's CPU build, vLLM without its CUDA dependencies, the pure-Python packages the
# v1 core and its tests import (pinned in requirements.txt), and kvlifetime itself (editable,
# with its test and harness extras, for the project's own tests/vllm/).
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
$PY -m venv "$VENV"
B="$VENV/bin"
"$B/pip" install -q -U pip
# The CPU build of torch (a plain `torch` request would pull a multi-GB CUDA build).
"$B/pip" install -q torch==2.13.0
# Without its dependencies: they include CUDA builds and compiled kernels that do not run here.
"$B/pip" install -q --no-deps "vllm==${VLLM_VERSION:-0.34.0}"
"$B/pip" install -q -r "$HERE/requirements.txt"
"$B/pip" install -q -e "$HERE/..[test,harness]"
