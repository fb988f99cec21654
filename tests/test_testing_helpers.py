"""``kvlifetime.testing``: the helpers an engine's own test suite imports."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from structlog.testing import capture_logs

from kvlifetime.errors import EvidenceError
from kvlifetime.evidence import Evidence, SchedulingStopped, TransferQuiesced
from kvlifetime.grant import Grant
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import RequestState
from kvlifetime.testing import (
    adversarial_evidence,
    assert_transitions,
    checked_ledger,
    new_checked_ledger,
)

ledger = checked_ledger(8)


def test_checked_ledger_fixture(ledger: BlockLedger) -> None:
    assert ledger.checked and ledger.num_blocks == 8


def test_assert_transitions_passes_and_explains_a_mismatch() -> None:
    led = new_checked_ledger(4)
    with capture_logs() as logs:
        ids = led.allocate("r", 1)
        g = led.grant("r", "p", ids)
        led.allocate("r-2", 1)  # a key that shares a prefix: never matched
        led.reject("r-2")
        led.reject("r")
        led.apply(SchedulingStopped.of(g, 0))
        led.collect_releasable()
    assert_transitions(
        logs,
        "r",
        ["rejected", "cancel_received", "scheduling_stopped", "transfer_quiesced", "released"],
    )
    with pytest.raises(AssertionError, match="differ at position 1"):
        assert_transitions(logs, "r", ["rejected", "scheduling_stopped"])


def test_importing_testing_needs_neither_pytest_nor_hypothesis() -> None:
    code = (
        "import sys; sys.modules['pytest'] = None; sys.modules['hypothesis'] = None\n"
        "import kvlifetime.testing as t; print(t.assert_transitions.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "assert_transitions"


_LED = BlockLedger(4, incarnation="adv")
_IDS = _LED.allocate("a", 2)
_G1 = _LED.grant("a", "p1", _IDS[:1])
_G2 = _LED.grant("a", "p2", _IDS[1:])


@settings(max_examples=150, deadline=None)
@given(adversarial_evidence([_G1, _G2]))
def test_adversarial_evidence_never_frees_an_unproven_block(evs: list[Evidence]) -> None:
    led = _LED.copy()
    led.reject("a")
    for ev in evs:
        with contextlib.suppress(EvidenceError):
            led.apply(ev)
    released = led.collect_releasable()
    if released:
        # Only when both grants were really closed by what the sequence held.
        for g in (_G1, _G2):
            assert _closed_by(g, evs)
    else:
        assert led.state("a") is not RequestState.RELEASED


def _closed_by(g: Grant, evs: list[Evidence]) -> bool:
    from kvlifetime.evidence import AccessRevoked, TransferCompleted

    mine = [
        e
        for e in evs
        if getattr(e, "grant_id", None) == g.id and getattr(e, "peer", None) == g.peer
    ]
    if any(isinstance(e, (AccessRevoked, TransferCompleted)) for e in mine):
        return True
    stops = [e.last_seq for e in mine if isinstance(e, SchedulingStopped)]
    quiet = max((e.through_seq for e in mine if isinstance(e, TransferQuiesced)), default=0)
    return bool(stops) and quiet >= stops[0]


def test_captured_logs_captures_then_leaves_structlog_unconfigured() -> None:
    import structlog

    from kvlifetime.ledger import BlockLedger
    from kvlifetime.testing import assert_transitions, captured_logs

    assert not structlog.is_configured()
    ledger = BlockLedger(4)
    with captured_logs() as logs:
        ledger.allocate("a", 1)
        ledger.reject("a")
    assert_transitions(
        logs, "a", ["rejected", "cancel_received", "scheduling_stopped", "transfer_quiesced"]
    )
    assert not structlog.is_configured()
