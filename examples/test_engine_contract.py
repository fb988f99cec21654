"""The test an engine writes against kvlifetime's transition tables, with the plugin's fixtures.

A serving engine has its own names for what happens to a request on the abort path: the HTTP
layer aborts it, the prefill peer acknowledges the cancel, says it will post nothing more, and
its transfer engine reports the last transfer done. The engine maps each of its signals to a
named transition of the request lifecycle (here ``ENGINE_ABORT_PATH``); these tests check that
the mapping is a path of the table, that the real ledger fires exactly it, and that the engine
cannot release before the proof is in. No ``conftest.py`` is needed: ``checked_ledger``,
``ledger`` and ``captured_logs`` come from kvlifetime's pytest plugin.

    pytest examples/test_engine_contract.py
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import pytest

from kvlifetime import (
    BlockLedger,
    CancelReceived,
    Evidence,
    Grant,
    IllegalTransition,
    InsufficientEvidence,
    RequestState,
    SchedulingStopped,
    TransferQuiesced,
)
from kvlifetime.spec.table import request_table
from kvlifetime.testing import assert_transitions

# The engine's signal -> the named transition it must fire, in the order they come.
ENGINE_ABORT_PATH: list[tuple[str, str]] = [
    ("http_abort", "rejected"),
    ("cancel_ack", "cancel_received"),
    ("last_chunk_posted", "scheduling_stopped"),
    ("transfer_done", "transfer_quiesced"),
    ("pages_returned", "released"),
]


def engine_signal(ledger: BlockLedger, grant: Grant, signal: str) -> None:
    """The engine's handler: what each of its signals tells the ledger."""
    evidence: dict[str, Callable[[], Evidence]] = {
        "cancel_ack": lambda: CancelReceived.of(grant),
        "last_chunk_posted": lambda: SchedulingStopped.of(grant, 1),
        "transfer_done": lambda: TransferQuiesced.of(grant, 1),
    }
    if signal == "http_abort":
        ledger.reject(grant.request)
    elif signal == "pages_returned":
        ledger.release(grant.request)
    else:
        ledger.apply(evidence[signal]())


def test_the_engine_abort_path_is_a_path_of_the_request_table() -> None:
    table = request_table()
    state = table.initial
    for signal, transition in ENGINE_ABORT_PATH:
        rows = [r for r in table.rows if r.source == state and r.event == transition]
        assert rows, f"{signal}: the table has no {transition!r} from {state!r}"
        assert not rows[0].unsafe, f"{signal} takes an unsafe transition"
        state = rows[0].target
    assert state in table.finals


def test_the_ledger_fires_exactly_the_engine_path(
    checked_ledger: Callable[..., BlockLedger], captured_logs: list[MutableMapping[str, Any]]
) -> None:
    led = checked_ledger(8)
    grant = led.grant("req-1", "prefill-0", led.allocate("req-1", 4))
    for signal, _ in ENGINE_ABORT_PATH:
        engine_signal(led, grant, signal)
    assert_transitions(captured_logs, "req-1", [t for _, t in ENGINE_ABORT_PATH])
    assert led.free_count() == 8


@pytest.mark.parametrize("proven", range(len(ENGINE_ABORT_PATH) - 1))
def test_the_engine_cannot_return_pages_before_the_proof(ledger: BlockLedger, proven: int) -> None:
    grant = ledger.grant("req-2", "prefill-0", ledger.allocate("req-2", 2))
    for signal, _ in ENGINE_ABORT_PATH[:proven]:
        engine_signal(ledger, grant, signal)
    before = ledger.fingerprint()
    # Not ended yet: an illegal transition; ended, proof missing: insufficient evidence.
    with pytest.raises(InsufficientEvidence if proven else IllegalTransition):
        engine_signal(ledger, grant, "pages_returned")
    assert ledger.fingerprint() == before  # a refused release changes nothing
    assert ledger.state("req-2") is not RequestState.RELEASED


@pytest.mark.kvlifetime(num_blocks=64)
def test_the_ledger_fixture_takes_its_size_from_the_marker(ledger: BlockLedger) -> None:
    assert ledger.free_count() == 64
