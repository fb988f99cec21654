"""What the vLLM benchmarks share: the environment vLLM needs on a CPU machine with the hub
offline, interleaved rounds with ratios taken within a round; the machine, the figures' JSON and
the table are ``bench.common``'s (named here too), which the SGLang bench shares.

Importing this module sets the environment (before vLLM is imported) and writes the offline
Hugging Face cache if it is missing (``vllm-tests/write-hf-cache.py``: opt-125m's config, no
weights), as ``tests/in_vllm/conftest.py`` does. Run the benchmarks with the vLLM venv
(``make vllm-venv``): ``.venv-vllm/bin/python -m bench.vllm_scheduler`` / ``bench.vllm_blockpool``.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench import common
from bench.common import own_profile as own_profile
from bench.common import table as table
from bench.common import write_json as write_json

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", str(ROOT / ".vllm-hf"))


def write_hf_cache() -> None:
    """The offline cache vLLM's ModelConfig reads (only the scheduler bench needs it)."""
    subprocess.run(
        [sys.executable, str(ROOT / "vllm-tests" / "write-hf-cache.py"), os.environ["HF_HOME"]],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def machine() -> dict[str, Any]:
    """What the figures were measured on (``bench.common.machine``) and vLLM's version."""
    import vllm

    return common.machine(vllm=vllm.__version__)


def quiet_run(fn: Callable[[], Any]) -> Any:
    """One timed run with the collector off (collected before): the variants see the same heap."""
    gc.collect()
    gc.disable()
    try:
        return fn()
    finally:
        gc.enable()


def interleaved(
    variants: Mapping[str, Callable[[], float]], rounds: int, base: str
) -> dict[str, dict[str, Any]]:
    """Run every variant once per round, in an order that alternates from round to round; every
    ratio is taken within a round (this machine's speed drifts over a minute: a ratio of
    medians taken apart would measure the drift). Returns per variant: the median, the
    per-round figures, and (ratio median, min, max) to ``base``."""
    names = list(variants)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        per_round.append({k: float(quiet_run(variants[k])) for k in order})
    out: dict[str, dict[str, Any]] = {}
    for k in names:
        ratios = [x[k] / x[base] for x in per_round]
        out[k] = {
            "median": statistics.median(x[k] for x in per_round),
            "rounds": [x[k] for x in per_round],
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out
