"""Shared by the tests that need Mooncake's transfer engine."""

from __future__ import annotations

import os

import pytest

from kvlifetime.adapters.mooncake import mooncake_available


def need_mooncake() -> None:
    """Skip without Mooncake, unless ``KVLIFETIME_REQUIRE_MOONCAKE=1`` (set by .ci/run): then
    fail, so that a missing engine can never hide behind a skip."""
    if mooncake_available():
        return
    if os.environ.get("KVLIFETIME_REQUIRE_MOONCAKE") == "1":
        pytest.fail("KVLIFETIME_REQUIRE_MOONCAKE=1 but mooncake.engine does not import")
    pytest.skip("mooncake-transfer-engine-non-cuda is not installed")
