"""What the report tests share: skips that CI turns into failures, and real harness results."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

HAS_DOT = shutil.which("dot") is not None
# CI sets KVLIFETIME_REQUIRE_GRAPHVIZ=1 / KVLIFETIME_REQUIRE_CHROMIUM=1: there a missing `dot`
# or a missing chromium fails these tests, never skips them.
SKIP_NO_DOT = not HAS_DOT and os.environ.get("KVLIFETIME_REQUIRE_GRAPHVIZ") != "1"
needs_dot = pytest.mark.skipif(SKIP_NO_DOT, reason="Graphviz `dot` not installed")


def chromium_or_skip() -> None:
    from kvlifetime.report.browser import find_chromium

    if find_chromium() is None and os.environ.get("KVLIFETIME_REQUIRE_CHROMIUM") != "1":
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")


REQUESTS = 150  # a second or two per run: enough for quarantine, fences and late writes
SEED = 3


def write_results(path: Path) -> Path:
    """Three real harness runs (naive, timeout, proof), as ``kvlifetime demo`` writes them."""
    from kvlifetime.harness.loop import run
    from kvlifetime.harness.settings import PushSettings

    runs = [
        run(PushSettings(policy=p, requests=REQUESTS, seed=SEED)).to_dict()
        for p in ("naive", "timeout", "proof")
    ]
    path.write_text(json.dumps(runs, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
