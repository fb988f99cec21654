"""GrantProof: what accumulated evidence adds up to, independent of arrival order
(docs/evidence.md)."""

from __future__ import annotations

import itertools

import pytest

from kvlifetime.errors import ContradictoryEvidence
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import GrantId
from kvlifetime.spec.proof import GrantProof

GID = GrantId("inc", 1)


def cancel() -> CancelReceived:
    return CancelReceived(GID, "r", "p")


def stopped(last_seq: int) -> SchedulingStopped:
    return SchedulingStopped(GID, "r", "p", last_seq)


def quiesced(through_seq: int) -> TransferQuiesced:
    return TransferQuiesced(GID, "r", "p", through_seq)


def completed(last_seq: int) -> TransferCompleted:
    return TransferCompleted(GID, "r", "p", last_seq)


def revoked() -> AccessRevoked:
    return AccessRevoked("p", GID, "r")


def lease() -> LeaseExpired:
    return LeaseExpired(GID, "r", "p")


def apply(proof: GrantProof, *evs: Evidence) -> list[bool]:
    changed = []
    for ev in evs:
        proof.check(ev)
        changed.append(proof.record(ev))
    return changed


def test_fresh_grant_is_open() -> None:
    p = GrantProof()
    assert not p.closed
    assert not p.cancel_acknowledged
    assert not p.scheduling_stopped
    assert p.suspect is None
    assert p.unproven() == [
        "cancel_received",
        "scheduling_stopped",
        "transfers_ended through the last posted transfer",
    ]


@pytest.mark.parametrize(
    "evs",
    [
        (stopped(3), quiesced(3)),
        (quiesced(3), stopped(3)),
        (quiesced(5), stopped(3)),  # quiesced beyond the last posted: still closes
        (stopped(3), quiesced(1), quiesced(3)),
        (completed(4),),
        (quiesced(2), completed(4)),
        (revoked(),),
        (cancel(), revoked()),
        (stopped(9), revoked()),
        (stopped(0),),  # nothing was ever posted
    ],
)
def test_closes(evs: tuple[Evidence, ...]) -> None:
    p = GrantProof()
    apply(p, *evs)
    assert p.closed
    assert p.unproven() == []
    assert p.scheduling_stopped and p.cancel_acknowledged


@pytest.mark.parametrize(
    "evs",
    [
        (cancel(),),
        (stopped(3),),
        (quiesced(3),),
        (quiesced(100),),  # on its own, never: the peer may still post more
        (stopped(3), quiesced(2)),
        (quiesced(2), stopped(3)),
        (cancel(), quiesced(4), lease()),
        (lease(),),
        (PeerLost("p"),),
    ],
)
def test_stays_open(evs: tuple[Evidence, ...]) -> None:
    p = GrantProof()
    apply(p, *evs)
    assert not p.closed
    assert p.unproven()


def test_closing_is_order_independent() -> None:
    evs = [cancel(), stopped(4), quiesced(2), quiesced(4), lease()]
    keys = set()
    for order in itertools.permutations(evs):
        p = GrantProof()
        apply(p, *order)
        assert p.closed
        keys.add(p.key()[:4])  # everything but suspicion: a lease after closing marks nothing
    assert keys == {(True, 4, 4, False)}


def test_unproven_names_what_is_missing() -> None:
    p = GrantProof()
    apply(p, stopped(5), quiesced(3))
    assert p.unproven() == ["transfers_ended through seq 5"]


@pytest.mark.parametrize("ev", [cancel(), stopped(2), quiesced(2), completed(2), revoked()])
def test_duplicates_are_idempotent(ev: Evidence) -> None:
    p = GrantProof()
    assert apply(p, ev) == [True]
    key = p.key()
    assert apply(p, ev, ev) == [False, False]
    assert p.key() == key


def test_weaker_transfer_quiesced_is_a_no_op() -> None:
    p = GrantProof()
    apply(p, quiesced(5))
    assert apply(p, quiesced(2)) == [False]
    assert p.through_seq == 5
    apply(p, stopped(5))
    assert p.closed
    assert apply(p, quiesced(0)) == [False]
    assert p.closed


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (stopped(3), stopped(4)),
        (stopped(3), completed(2)),
        (completed(3), stopped(0)),
        (completed(3), completed(5)),
    ],
)
def test_contradiction_raises_and_changes_nothing(first: Evidence, second: Evidence) -> None:
    p = GrantProof()
    apply(p, first)
    key = p.key()
    with pytest.raises(ContradictoryEvidence) as exc:
        p.check(second)
    assert exc.value.evidence is second
    assert "last_seq" in str(exc.value)
    assert p.key() == key


def test_same_last_seq_from_both_kinds_agrees() -> None:
    p = GrantProof()
    apply(p, stopped(3), completed(3))
    assert p.closed


def test_suspect_never_closes() -> None:
    p = GrantProof()
    apply(p, cancel(), lease(), PeerLost("p"))
    assert p.suspect == "lease_expired"  # the first reason is kept
    assert not p.closed
    apply(p, stopped(2))
    assert not p.closed
    apply(p, quiesced(2))  # late proof still closes a suspect grant
    assert p.closed


def test_closed_grant_is_not_made_suspect() -> None:
    p = GrantProof()
    apply(p, completed(1))
    assert apply(p, lease()) == [False]
    assert p.suspect is None


def test_scheduling_stopped_zero_closes_alone() -> None:
    p = GrantProof()
    assert apply(p, stopped(0)) == [True]
    assert p.closed
    assert p.last_seq == 0


def test_copy_is_independent() -> None:
    p = GrantProof()
    apply(p, stopped(3))
    q = p.copy()
    assert q.key() == p.key()
    apply(q, quiesced(3))
    assert q.closed and not p.closed
    assert "last_seq=3" in repr(p)
