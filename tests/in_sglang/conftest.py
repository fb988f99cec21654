"""Scenario tests on SGLang 0.5.23's real disaggregation classes (run by ``make test-sglang``, in
the SGLang venv built by ``sglang-tests/setup-venv.sh``). Nothing here skips: without SGLang,
Mooncake's engine or the guard, the import below fails and so does every test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import mooncake.engine  # noqa: E402, F401  (Debian's libibverbs1 & co: make system-deps)
import sglang  # noqa: E402
from sglang_driver import Rig  # noqa: E402

SGLANG_VERSION = "0.5.23"


def pytest_report_header() -> str:
    return f"sglang {sglang.__version__} (scenarios written for {SGLANG_VERSION})"


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    """Every rig a test starts, closed (both processes ended) when it ends. A guarded rig's
    refusal counters must then be exactly what its scenario expects
    (``rig.expected_refusals``, none unless it says so): a refusal nobody expected is the guard
    saying that something it was given (or did) was wrong, even when the bytes came out right."""
    started: list[Rig] = []
    yield started
    try:
        for rig in started:
            if rig.guarded:
                seen = rig.refusals()
                expected = {side: rig.expected_refusals.get(side, {}) for side in seen}
                assert seen == expected, "the guards' refusals are not the scenario's"
    finally:
        for rig in started:
            rig.close()
