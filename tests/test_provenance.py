"""Who may prove what: every claim from a lying peer, and from a peer speaking for another,
is refused with ``UnauthorizedEvidence``, logged, counted, and changes nothing."""

from __future__ import annotations

import attrs
import pytest

from kvlifetime.adapters.inproc import InprocTarget
from kvlifetime.errors import UnauthorizedEvidence
from kvlifetime.evidence import (
    EVIDENCE_CLASSES,
    AccessRevoked,
    Claim,
    Evidence,
    PeerLost,
    TransferCompleted,
    about,
)
from kvlifetime.grant import Access, Grant
from kvlifetime.harness import wire
from kvlifetime.harness.push_owner import DecodeWorker
from kvlifetime.harness.settings import PushSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.provenance import RESTS_ON_PEER, RULES, rules_matrix
from kvlifetime.source import LOCAL, Source
from kvlifetime.spec.vocabulary import RequestState
from kvlifetime.testing import captured_logs

KINDS = [c.__name__ for c in EVIDENCE_CLASSES]


def _two_peers() -> tuple[BlockLedger, Grant, Grant]:
    led = BlockLedger(8)
    a = led.grant("ra", "p0", led.allocate("ra", 2), Access.WRITE)
    b = led.grant("rb", "p1", led.allocate("rb", 2), Access.WRITE)
    led.reject("ra")  # ended: a wrongly accepted claim would move it
    return led, a, b


def _lies(own: Grant, other: Grant) -> list[tuple[str, Evidence]]:
    """Everything peer p0 may not say: each claim kind about its own grant that only the local
    side may make, and every kind about p1's grant or in p1's name."""
    liar = Source.peer(own.peer)
    out: list[tuple[str, Evidence]] = []
    for kind in KINDS:
        ev = about(own, kind, 1)
        if not all(RULES[c].own_peer for c in ev.PROVES):
            out.append((f"{kind} about its own grant", attrs.evolve(ev, source=liar)))
        out.append(
            (f"{kind} about another's grant", attrs.evolve(about(other, kind, 1), source=liar))
        )
    # Its own grant, but in another peer's name (the message says it is p1).
    forged = TransferCompleted(own.id, own.request, other.peer, 1, source=liar)
    out.append(("TransferCompleted in another's name", forged))
    out.append(("AccessRevoked of every grant to itself", AccessRevoked(own.peer, source=liar)))
    out.append(("PeerLost of another", PeerLost(other.peer, source=liar)))
    return out


@pytest.mark.parametrize("case", range(len(_lies(*_two_peers()[1:]))))
def test_a_lying_peer_changes_nothing(case: int) -> None:
    led, own, other = _two_peers()
    what, ev = _lies(own, other)[case]
    before = led.fingerprint()
    with captured_logs() as logs, pytest.raises(UnauthorizedEvidence):
        led.apply(ev)
    assert led.fingerprint() == before, what
    assert led.stats().refused_evidence == {"unauthorized_evidence": 1}
    assert [e["error"] for e in logs if e["event"] == "evidence_refused"] == [
        "unauthorized_evidence"
    ]
    assert led.state("ra") is RequestState.REJECTED


def test_the_same_claims_from_the_right_source_are_taken() -> None:
    led, own, _ = _two_peers()
    peer = Source.peer(own.peer)
    # The peer's own claims about its own grant: believed on its word.
    led.apply(TransferCompleted(own.id, own.request, own.peer, 1, source=peer))
    assert led.state("ra") is RequestState.TRANSFER_QUIESCED
    # Revocation from the local side (a fence observed complete) closes the other.
    led.finish("rb")
    led.apply(AccessRevoked("p1", fence="test_fence", source=LOCAL))
    assert led.state("rb") is RequestState.TRANSFER_QUIESCED
    led.collect_releasable()
    assert led.stats().reclaimed_blocks == {"test_fence": 2}


def test_the_rules_are_one_table() -> None:
    assert set(RULES) == set(Claim)
    only_local = {c for c, r in RULES.items() if not r.own_peer}
    assert only_local == {Claim.ACCESS_REVOKED, Claim.DEADLINE_PASSED, Claim.HEARTBEAT_FAILED}
    assert all(r.local for r in RULES.values())
    on_word = {Claim.CANCEL_RECEIVED, Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED}
    assert on_word == RESTS_ON_PEER
    assert [row["claim"] for row in rules_matrix()] == [c.value for c in RULES]


# --------------------------------------------------------------------------- over the wire


def _worker() -> tuple[DecodeWorker, InprocTarget, dict[str, Grant]]:
    target = InprocTarget(16 * 4096)
    led = BlockLedger(16)
    w = DecodeWorker(PushSettings(num_blocks=16), target, led)
    grants = {
        "p0": led.grant(1, "prefill-0", led.allocate(1, 2)),
        "p1": led.grant(2, "prefill-1", led.allocate(2, 2)),
    }
    led.reject(1)
    led.reject(2)
    return w, target, grants


def test_a_peer_revoking_itself_over_the_wire_is_refused() -> None:
    # The case: one frame EvidenceMsg(AccessRevoked("prefill-0")), sent by prefill-0.
    w, target, _ = _worker()
    try:
        before = w.ledger.fingerprint()
        frame = wire.encode(wire.EvidenceMsg(AccessRevoked("prefill-0")))
        w.receive([frame], sender="prefill-0")
        assert w.ledger.fingerprint() == before
        assert w.ledger.state(1) is RequestState.REJECTED  # still waiting for real proof
        assert w.count.unauthorized_refused == 1
    finally:
        target.close()


def test_every_claim_over_the_wire_from_a_liar() -> None:
    w, target, g = _worker()
    try:
        before = w.ledger.fingerprint()
        frames = []
        for kind in KINDS:
            frames.append(wire.encode(wire.EvidenceMsg(about(g["p1"], kind, 1))))
            ev = about(g["p0"], kind, 1)
            if not all(RULES[c].own_peer for c in ev.PROVES):
                frames.append(wire.encode(wire.EvidenceMsg(ev)))
        w.receive(frames, sender="prefill-0")
        assert w.ledger.fingerprint() == before
        assert w.count.unauthorized_refused == len(frames)
        assert w.ledger.stats().refused_evidence == {"unauthorized_evidence": len(frames)}
        # The honest claim, from the right connection, still works afterwards.
        ok = wire.encode(wire.EvidenceMsg(TransferCompleted.of(g["p0"], 1)))
        w.receive([ok], sender="prefill-0")
        assert w.ledger.state(1) is RequestState.TRANSFER_QUIESCED
    finally:
        target.close()
