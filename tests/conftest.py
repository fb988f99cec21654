"""Shared test hygiene.

``structlog.testing.capture_logs`` configures structlog and leaves it configured when it exits,
so a later test in the same process would see kvlifetime's events printed to stdout (and a CLI
test reading JSON from stdout would read them too). Every test starts and ends with structlog
unconfigured, as an application that never configured it would be.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import structlog

from kvlifetime.adapters.inproc import InprocEngine, InprocTarget

# tests/in_vllm/ drives vLLM's real scheduler: it runs in the vLLM venv (`make test-vllm`, which
# CI runs after `make test`), not in the main one, where vLLM is not installed.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["in_vllm"]
# tests/in_sglang/ drives SGLang 0.5.23's real disaggregation classes: it runs in the SGLang venv
# (`make test-sglang`), not in the main one. With KVLIFETIME_REQUIRE_SGLANG=1 (CI's test-sglang)
# it is always collected, so a venv without SGLang fails there instead of running nothing.
if not importlib.util.find_spec("sglang") and os.environ.get("KVLIFETIME_REQUIRE_SGLANG") != "1":
    collect_ignore.append("in_sglang")


@pytest.fixture(autouse=True)
def _structlog_unconfigured() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def inproc() -> Iterator[tuple[InprocTarget, InprocEngine]]:
    """A small in-process target (16 blocks of 4 KiB) and an engine writing into it, whose
    FAILED batches' other slices land 3 ticks later."""
    target = InprocTarget(16 * 4096)
    engine = InprocEngine(target.descriptor(), 8 * 4096, straggle_ticks=3)
    yield target, engine
    engine.close()
    target.close()
