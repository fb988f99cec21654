"""kvlifetime's pytest plugin, as a project that depends on kvlifetime meets it (``pytester``).

Three pytest sessions in all, each in its own process: an in-process session would leave
kvlifetime's lazily loaded modules behind in a state the rest of the suite must not see."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

FIXTURE_TESTS = """
import pytest
import structlog
from kvlifetime import IllegalTransition
from kvlifetime.testing import assert_transitions


def test_factory(checked_ledger):
    a, b = checked_ledger(4), checked_ledger(8, incarnation="decode-1")
    assert (a.num_blocks, b.num_blocks, b.incarnation) == (4, 8, "decode-1")
    assert a is not b and a.checked and b.checked


@pytest.mark.parametrize("n", [1, 2])
def test_ledger_is_fresh_per_test(ledger, n):
    assert ledger.num_blocks == 16 and ledger.live_requests() == []
    ledger.allocate(f"r{n}", 2)


def test_ledger_is_checked(ledger):
    assert ledger.checked
    ledger.allocate("r", 1)
    with pytest.raises(IllegalTransition):
        ledger.release("r")


@pytest.mark.kvlifetime(blocks=4)
def test_wrong_marker(ledger):
    pass


def test_logs(ledger, captured_logs):
    ledger.allocate("r", 1)
    ledger.reject("r")
    ledger.release("r")
    stages = ["rejected", "cancel_received", "scheduling_stopped", "transfer_quiesced"]
    assert_transitions(captured_logs, "r", [*stages, "released"])


def test_zz_structlog_left_unconfigured():
    assert not structlog.is_configured()
"""


def test_the_example_engine_test_passes_with_no_conftest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_engine_contract=(ROOT / "examples" / "test_engine_contract.py").read_text()
    )
    pytester.runpytest_subprocess("-q").assert_outcomes(passed=7)


def test_the_fixtures_come_from_the_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fixtures=FIXTURE_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:randomly")
    result.assert_outcomes(passed=6, errors=1)
    result.stdout.fnmatch_lines(["*takes num_blocks= and incarnation= only*"])
    # Without the plugin (its entry point is named "kvlifetime") the fixtures do not exist.
    result = pytester.runpytest_subprocess("-q", "-p", "no:kvlifetime", "-k", "factory")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'checked_ledger' not found*"])
