"""Helpers an engine's own test suite imports (as ``structlog.testing`` does for structlog).

The fixtures themselves (``ledger``, ``checked_ledger``, ``captured_logs``) come from
kvlifetime's pytest plugin, ``kvlifetime.pytest_plugin``, which pytest loads by itself once
kvlifetime is installed: a test just names them. This module holds what they are built on and
what a test calls:

- ``new_checked_ledger`` — a ``BlockLedger(checked=True)`` that mirrors every transition into
  the specification and fails loudly on disagreement;
- ``checked_ledger`` — builds a pytest fixture of one size under a name of your choice (for a
  ``conftest.py`` that wants ``ledger64 = checked_ledger(64, name="ledger64")``); it is *not* a
  fixture itself: a test taking ``checked_ledger`` gets the plugin's factory fixture;
- ``captured_logs`` — ``structlog.testing.capture_logs`` that leaves structlog unconfigured
  again afterwards (so kvlifetime goes back to emitting nothing);
- ``assert_transitions`` — a captured log (``structlog.testing.capture_logs``) follows an
  expected sequence of named transitions for one request;
- ``adversarial_evidence`` — a hypothesis strategy of stale, forged, duplicated, reordered and
  contradictory evidence for a set of grants.

pytest and hypothesis are test-only dependencies: they are imported when a helper that needs
them is called, so importing this module never requires them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from kvlifetime.evidence import (
    CancelReceived,
    Evidence,
    SchedulingStopped,
    TransferQuiesced,
    about,
    to_dict,
)
from kvlifetime.grant import Grant, GrantId, RequestKey
from kvlifetime.ledger import BlockLedger

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy


def new_checked_ledger(num_blocks: int = 16, *, incarnation: str | None = None) -> BlockLedger:
    """A ledger that checks every request transition against the specification."""
    return BlockLedger(num_blocks, checked=True, incarnation=incarnation)


def checked_ledger(num_blocks: int = 16, *, name: str = "ledger") -> Any:
    """Build a pytest fixture named ``name`` giving a fresh checked ledger per test.

    In a ``conftest.py``: ``ledger64 = kvlifetime.testing.checked_ledger(64, name="ledger64")``;
    a test then takes ``ledger64`` as an argument. (Without a conftest, the plugin's ``ledger``
    fixture and ``@pytest.mark.kvlifetime(num_blocks=64)`` do the same.) Any disagreement
    between the compiled tables and the specification raises ``SpecDisagreement`` inside the
    call that caused it; refused evidence is counted in ``stats().refused_evidence`` for the
    test to read.
    """
    import pytest  # test-only dependency

    @pytest.fixture(name=name)
    def _fixture() -> Iterator[BlockLedger]:
        ledger = new_checked_ledger(num_blocks)
        yield ledger

    return _fixture


@contextlib.contextmanager
def captured_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """``structlog.testing.capture_logs()``, leaving structlog as it found it.

    ``capture_logs`` configures structlog and leaves it configured when it exits; kvlifetime
    logs only once structlog is configured, so afterwards it would print its events to stdout
    for the rest of the process. This restores the unconfigured default when that is what it
    found.
    """
    import structlog
    from structlog.testing import capture_logs

    was_configured = structlog.is_configured()
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        if not was_configured:
            structlog.reset_defaults()


def transitions_of(captured: Sequence[Mapping[str, Any]], request: RequestKey) -> list[str]:
    """The named transitions logged for ``request`` (exact key match, never a prefix)."""
    return [
        str(e.get("transition"))
        for e in captured
        if e.get("event") == "request_transition"
        and e.get("request") == request
        and type(e.get("request")) is type(request)
    ]


def assert_transitions(
    captured: Sequence[Mapping[str, Any]], request: RequestKey, expected: Sequence[str]
) -> None:
    """Assert that the log shows exactly ``expected`` named transitions for ``request``.

    ``captured`` is what ``structlog.testing.capture_logs()`` collected (or JSON lines parsed
    into dicts). On failure the message shows both sequences and where they part.
    """
    got = transitions_of(captured, request)
    want = list(expected)
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if at is None:
        at = min(len(got), len(want))
    raise AssertionError(
        f"request {request!r}: transitions differ at position {at}\n"
        f"  expected: {want}\n"
        f"  logged:   {got}"
    )


def to_jsonl(captured: Sequence[Mapping[str, Any]]) -> str:
    """Captured log entries as JSON lines, the input of ``kvlifetime replay``."""
    return "".join(json.dumps(dict(e), sort_keys=True, default=str) + "\n" for e in captured)


# ------------------------------------------------------------------ hypothesis


def _forge(g: Grant, how: str) -> Evidence:
    if how == "other_incarnation":
        return CancelReceived(GrantId(g.id.incarnation + "-old", g.id.serial), g.request, g.peer)
    if how == "other_peer":
        return CancelReceived(g.id, g.request, g.peer + "-forged")
    if how == "other_request":
        other: RequestKey = f"{g.request}-forged" if isinstance(g.request, str) else g.request + 1
        return SchedulingStopped(g.id, other, g.peer, 0)
    return TransferQuiesced(GrantId(g.id.incarnation, g.id.serial + 10_000), g.request, g.peer, 1)


# The strategy's short names for the evidence a peer may honestly send about its grant.
_HONEST_KINDS = {
    "cancel": "CancelReceived",
    "stopped": "SchedulingStopped",
    "quiesced": "TransferQuiesced",
    "completed": "TransferCompleted",
    "revoked": "AccessRevoked",
    "lease": "LeaseExpired",
    "peer_lost": "PeerLost",
}


def adversarial_evidence(
    grants: Sequence[Grant], *, max_seq: int = 3, max_size: int = 24
) -> SearchStrategy[list[Evidence]]:
    """Sequences of evidence about ``grants``: honest, duplicated, reordered, stale (pass grants
    of requests the test releases to get evidence about an old generation), forged (another
    request, peer or incarnation, a grant never issued),
    contradictory (two ``last_seq``), suspicion only (``LeaseExpired``, ``PeerLost``).

    Whatever a sequence holds, a ledger must refuse what is wrong with a typed error and never
    release a block whose grant the sequence did not close.
    """
    from hypothesis import strategies as st  # test-only dependency

    if not grants:
        raise ValueError("adversarial_evidence needs at least one grant")
    seq = st.integers(min_value=0, max_value=max_seq)
    grant = st.sampled_from(list(grants))

    def one(g: Grant, kind: str, n: int) -> Evidence:
        if kind in _HONEST_KINDS:
            return about(g, _HONEST_KINDS[kind], n)
        return _forge(g, kind)

    kinds = st.sampled_from(
        [
            "cancel",
            "stopped",
            "quiesced",
            "completed",
            "revoked",
            "lease",
            "peer_lost",
            "other_incarnation",
            "other_peer",
            "other_request",
            "never_issued",
        ]
    )
    single = st.builds(one, grant, kinds, seq)
    base = st.lists(single, max_size=max_size)

    def mangle(evs: list[Evidence], dup: list[int], order: list[int]) -> list[Evidence]:
        # Duplicates and reordering on top of whatever the base drew.
        out = list(evs)
        for i in dup:
            if out:
                out.insert(i % (len(out) + 1), out[i % len(out)])
        if order and out:
            keyed = sorted(range(len(out)), key=lambda i: order[i % len(order)])
            out = [out[i] for i in keyed]
        return out[:max_size]

    idx = st.lists(st.integers(min_value=0, max_value=1000), max_size=4)
    return st.builds(mangle, base, idx, idx)


def evidence_dicts(evs: Sequence[Evidence]) -> list[dict[str, Any]]:
    """Evidence as plain data, for a readable assertion message."""
    return [to_dict(e) for e in evs]
