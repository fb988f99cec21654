"""Scenario tests through vLLM 0.33's real scheduler (run by ``make test-vllm``, in the vLLM
venv). The environment vLLM needs on a CPU machine with the hub offline is set here, before
vLLM is imported: the model config the scheduler reads is written by
``vllm-tests/write-hf-cache.py`` (the public architecture of facebook/opt-125m, no weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM 0.34 refuses every config on x86 without triton-cpu unless no CUDA device is named.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
if "HF_HOME" not in os.environ:
    os.environ["HF_HOME"] = str(ROOT / ".vllm-hf")
subprocess.run(
    [sys.executable, str(ROOT / "vllm-tests" / "write-hf-cache.py"), os.environ["HF_HOME"]],
    check=True,
    stdout=subprocess.DEVNULL,
)
