#!/usr/bin/env bash
# Builds the venv in which SGLang 0.5.23's disaggregation classes (queues, KV pools, radix cache,
# Mooncake manager/sender/receiver/bootstrap server) run on a CPU machine, for tests/in_sglang/:
# torch's CPU build, SGLang without its CUDA dependencies, the modules its disaggregation and
# scheduler imports need (requirements.txt), torchvision's Python code (its CUDA ops never load:
# torchvision_shim.py), Mooncake's transfer engine, and kvlifetime itself (editable).
set -euo pipefail
VENV=${1:-.venv-sglang}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
C="$HERE/constraints.txt"
$PY -m venv "$VENV"
B="$VENV/bin"
"$B/pip" install -q -U pip
# torch first, the CPU build; every later install is constrained to it (-c).
"$B/pip" install -q torch==2.13.0
# Without its dependencies: they pin torch 2.14.1 (CUDA), sgl-kernel, flashinfer, ...
"$B/pip" install -q --no-deps -c "$C" sglang==0.5.23
"$B/pip" install -q -c "$C" -r "$HERE/requirements.txt"
# torchvision: without its dependencies (they would replace torch), and with the shim that lets
# its Python code import without its compiled ops.
"$B/pip" install -q --no-deps -c "$C" torchvision==0.28.0
SITE=$("$B/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$HERE/torchvision_shim.py" "$SITE/kvlifetime_sglang_torchvision_shim.py"
echo "import kvlifetime_sglang_torchvision_shim" > "$SITE/kvlifetime_sglang_torchvision.pth"
"$B/pip" install -q -c "$C" -e "$HERE/..[harness,mooncake]"
# The whole chain must import: the disaggregation queues and the Mooncake backend.
"$B/python" -c 'import torch, sglang; assert torch.__version__.startswith("2.13.0"), torch.__version__; assert sglang.__version__ == "0.5.23", sglang.__version__; import sglang.srt.disaggregation.decode, sglang.srt.disaggregation.prefill, sglang.srt.disaggregation.mooncake.conn, mooncake.engine'
