"""A ledger that starts over an arena a previous incarnation's peers may still reach."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from kvlifetime.adapters.inproc import InprocEngine, InprocTarget
from kvlifetime.adapters.transfer import Status
from kvlifetime.errors import (
    BlockUnavailable,
    InvalidField,
    MismatchedEvidence,
    OutOfBlocks,
    UnauthorizedEvidence,
)
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Evidence,
    LeaseExpired,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, Grant
from kvlifetime.harness.loop import run
from kvlifetime.harness.settings import PushSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.source import Source
from kvlifetime.spec.vocabulary import BlockState, RequestState

OLD = "previous-incarnation"


def test_a_naive_restart_hands_out_blocks_an_old_peer_may_still_write() -> None:
    # What the guard exists for: a fresh ledger knows nothing of the old grants.
    old = BlockLedger(4)
    g = old.grant("a", "p0", old.allocate("a", 4), Access.WRITE)
    fresh = BlockLedger(4)  # the process restarted; the arena did not
    assert fresh.free_count() == 4
    with pytest.raises(MismatchedEvidence):
        fresh.apply(TransferCompleted.of(g, 1))  # the old grant's proof cannot help here either


def _failed_batch_with_a_straggler(engine: InprocEngine, target: InprocTarget) -> None:
    """The previous incarnation's request wrote block 0 in a batch that FAILED: its slice into
    block 0 is still to land (``straggle_ticks`` later)."""
    engine.staging[:4096] = 0xAB
    bad = target.address(0) + target.nbytes + 4096
    h = engine.submit([(0, target.address(0), 4096), (0, bad, 4096)])
    assert engine.wait(h, 1.0) is Status.FAILED


def test_restart_over_a_failed_batchs_straggler_naive_vs_guarded() -> None:
    # The case: a ledger re-created over the same arena hands out block 0, then the
    # FAILED batch's leftover slice writes all 4096 of its bytes into it.
    target = InprocTarget(4 * 4096)
    engine = InprocEngine(target.descriptor(), 4096, straggle_ticks=2)
    try:
        _failed_batch_with_a_straggler(engine, target)
        naive = BlockLedger(4)  # the restarted process: every block free
        ids = naive.allocate("new", 1)
        assert ids.tolist() == [0]
        target.array[:4096] = 0x11  # the new owner's KV
        engine.advance(2)
        assert int(np.count_nonzero(target.array[:4096] == 0xAB)) == 4096  # all of it, B's block

        _failed_batch_with_a_straggler(engine, target)
        guarded = BlockLedger.after_restart(4, peers=["prefill-0"])
        with pytest.raises(OutOfBlocks):
            guarded.allocate("new", 1)  # nothing is handed out before the fence
        engine.advance(4)  # the straggler lands in a block nobody holds
        engine.close()  # the fence: the copy thread joined, its late slices dropped
        guarded.apply(AccessRevoked("prefill-0", fence="inproc_engine_closed"))
        assert guarded.collect_releasable()[OLD].tolist() == [0, 1, 2, 3]
        assert guarded.allocate("new", 1).tolist() == [0]
        target.array[:4096] = 0x11
        assert int(np.count_nonzero(target.array[:4096] == 0x11)) == 4096  # and it stays so
    finally:
        engine.close()
        target.close()


def test_after_restart_every_block_is_quarantined_until_fenced() -> None:
    led = BlockLedger.after_restart(8, peers=["p0", "p1"])
    st = led.stats()
    assert led.free_count() == 0
    assert st.blocks_by_state[BlockState.QUARANTINED.label] == 8
    assert [(q.request, q.blocks, q.reason) for q in st.quarantined] == [
        (OLD, 8, "previous_incarnation")
    ]
    with pytest.raises(OutOfBlocks):
        led.allocate("new", 1)
    with pytest.raises(BlockUnavailable):
        led.acquire("new", [0], shared=True)
    # A peer cannot end it by saying so; one fence of two is not enough.
    with pytest.raises(UnauthorizedEvidence):
        led.apply(AccessRevoked("p0", source=Source.peer("p0")))
    led.apply(AccessRevoked("p0", fence="f"))
    assert led.state(OLD) is RequestState.QUARANTINED
    assert led.collect_releasable() == {}
    led.apply(AccessRevoked("p1", fence="f"))
    freed = led.collect_releasable()
    assert freed[OLD].tolist() == list(range(8))
    assert led.free_count() == 8
    assert led.generation(np.arange(8)).tolist() == [1] * 8
    assert led.stats().reclaimed_blocks == {"f": 8}
    assert led.allocate("new", 8).tolist() == list(range(8))


def test_after_restart_only_the_exposed_blocks() -> None:
    led = BlockLedger.after_restart(6, peers=["p0"], exposed=[4, 5], request="old-0")
    assert led.free_count() == 4
    assert led.allocate("r", 4).tolist() == [0, 1, 2, 3]
    assert led.state("old-0") is RequestState.QUARANTINED


def test_the_previous_incarnations_evidence_stays_refused() -> None:
    old = BlockLedger(4)
    g = old.grant("a", "p0", old.allocate("a", 4), Access.WRITE)
    led = BlockLedger.after_restart(4, peers=["p0"])
    with pytest.raises(MismatchedEvidence):
        led.apply(TransferCompleted.of(g, 1))
    assert led.stats().refused_evidence == {"mismatched_evidence": 1}
    assert led.state(OLD) is RequestState.QUARANTINED


@pytest.mark.parametrize("peers", [[], "p0", None])
def test_after_restart_needs_the_peers(peers: object) -> None:
    with pytest.raises(InvalidField):
        BlockLedger.after_restart(4, peers=peers)  # type: ignore[arg-type]


def test_decode_restart_naive_vs_guarded() -> None:
    """The harness: decode restarts mid-run while the prefill peer's writes are still in
    flight. Naive: the new ledger reuses blocks that old writes land in. Guarded: quarantined
    until fenced, nothing contaminated."""
    naive = run(PushSettings(policy="proof", requests=1500, seed=11, restart="naive"))
    guarded = run(PushSettings(policy="proof", requests=1500, seed=11, restart="guarded"))
    assert naive.lost_to_restart > 0 and guarded.lost_to_restart == naive.lost_to_restart
    assert naive.contaminated_blocks > 0
    assert naive.refused_evidence.get("mismatched_evidence", 0) > 0  # the old grants' proof
    assert guarded.contaminated_blocks == 0
    assert guarded.reclaimed_blocks["inproc_initiator_reaped"] >= 2048  # the whole arena
    assert guarded.quarantined_blocks == 0 and guarded.leaked_blocks == 0


# --------------------------------------------------------------------------- only a fence ends it

# Every claim but a fence's, about the restart's quarantine grant. The old peer's new connection
# can read the grant id off an ``Assign`` (the incarnation is this ledger's): it must still not
# be able to lift the quarantine by saying its transfers are over.
CLAIMS: list[tuple[str, Callable[[Grant], Evidence]]] = [
    ("CancelReceived", CancelReceived.of),
    ("SchedulingStopped-0", lambda g: SchedulingStopped.of(g, 0)),
    ("SchedulingStopped-5", lambda g: SchedulingStopped.of(g, 5)),
    ("TransferQuiesced", lambda g: TransferQuiesced.of(g, through_seq=5)),
    ("TransferCompleted-0", lambda g: TransferCompleted.of(g, 0)),
    ("TransferCompleted-5", lambda g: TransferCompleted.of(g, 5)),
    ("LeaseExpired", LeaseExpired.of),
]
# Who says it: the process itself, the old peer over its own connection, another peer.
SOURCES: list[tuple[str, Source | None, type[Exception]]] = [
    ("local", None, MismatchedEvidence),
    ("the-grants-peer", Source.peer("p0"), MismatchedEvidence),
    ("another-peer", Source.peer("p1"), UnauthorizedEvidence),
]


def _restarted() -> tuple[BlockLedger, Grant]:
    led = BlockLedger.after_restart(6, peers=["p0", "p1"], exposed=[0, 1, 2, 3])
    led.allocate("new", 1)  # a live request beside the quarantine, that nothing may touch
    (g,) = [g for g in led.grants_of(OLD) if g.peer == "p0"]
    return led, g


def _whole(led: BlockLedger) -> tuple[Any, ...]:
    """Everything a refusal must leave as it was, evidence counters aside."""
    st = led.stats(now=1.0)
    return (
        led.fingerprint(),
        attrs.evolve(st, refused_evidence={}),
        led.free_count(),
        {str(g.id): led.proof_of(g).key() for g in led.grants_of(OLD)},
        led.unproven(OLD),
    )


@pytest.mark.parametrize("batch", [False, True], ids=["apply", "apply_many"])
@pytest.mark.parametrize(("who", "source", "exc"), SOURCES, ids=[s[0] for s in SOURCES])
@pytest.mark.parametrize(("kind", "make"), CLAIMS, ids=[c[0] for c in CLAIMS])
def test_no_claim_lifts_a_restart_quarantine_only_a_fence_does(
    kind: str,
    make: Callable[[Grant], Evidence],
    who: str,
    source: Source | None,
    exc: type[Exception],
    batch: bool,
) -> None:
    led, g = _restarted()
    ev = make(g)
    if source is not None:
        ev = attrs.evolve(ev, source=source)
    if kind == "LeaseExpired" and source is not None:
        exc = UnauthorizedEvidence  # a peer may never claim time passed, about any grant
    before = _whole(led)
    if batch:
        out = led.apply_many([ev])
        assert out.transitions == ()
        assert [(r.position, r.item, type(r.error)) for r in out.refused] == [(0, ev, exc)]
    else:
        with pytest.raises(exc):
            led.apply(ev)
    assert led.collect_releasable() == {}
    assert _whole(led) == before
    assert led.stats().refused_evidence == {exc.kind: 1}  # type: ignore[attr-defined]
    assert led.state(OLD) is RequestState.QUARANTINED
    # The fences of both peers still end it (a claim of p0 did not get in their way).
    led.apply(AccessRevoked("p0", fence="f"))
    assert led.collect_releasable() == {}
    p1 = next(r for r in led.grants_of(OLD) if r.peer == "p1")
    led.apply(AccessRevoked.of(p1, fence="f"))
    assert led.collect_releasable()[OLD].tolist() == [0, 1, 2, 3]


def test_every_claim_at_once_does_not_lift_it_either() -> None:
    """A whole batch of them, from the grant's own peer and locally, both of its grants: the
    quarantine holds, every piece refused and counted, and nothing else changed."""
    led, _ = _restarted()
    before = _whole(led)
    batch: list[Evidence] = []
    for g in led.grants_of(OLD):
        for _, make in CLAIMS:
            batch += [make(g), attrs.evolve(make(g), source=Source.peer(g.peer))]
    out = led.apply_many(batch)
    assert out.transitions == () and len(out.refused) == len(batch)
    # A peer may never claim time passed, whatever the grant: unauthorized before anything else.
    peers_lease = [
        r for r in out.refused if isinstance(r.item, LeaseExpired) and not r.item.source.is_local
    ]
    assert {type(r.error) for r in peers_lease} == {UnauthorizedEvidence}
    assert {type(r.error) for r in out.refused if r not in peers_lease} == {MismatchedEvidence}
    assert led.collect_releasable() == {}
    assert _whole(led) == before
    assert led.stats().refused_evidence == {
        "mismatched_evidence": len(batch) - len(peers_lease),
        "unauthorized_evidence": len(peers_lease),
    }


def test_a_fence_of_one_grant_from_the_local_side_ends_that_grant_only() -> None:
    led, g = _restarted()
    before = _whole(led)
    with pytest.raises(UnauthorizedEvidence):  # the peer cannot fence itself by saying so
        led.apply(attrs.evolve(AccessRevoked.of(g), source=Source.peer("p0")))
    assert _whole(led) == before
    led.apply(AccessRevoked.of(g, fence="f"))
    assert led.proof_of(g).closed
    assert led.state(OLD) is RequestState.QUARANTINED
    # Closed by the fence: a later claim about it is still the previous incarnation's word.
    with pytest.raises(MismatchedEvidence):
        led.apply(TransferCompleted.of(g, 0))
    led.apply(AccessRevoked("p1", fence="f"))
    assert led.collect_releasable()[OLD].tolist() == [0, 1, 2, 3]


def test_a_copy_keeps_the_restart_rule() -> None:
    led, g = _restarted()
    twin = led.copy()
    with pytest.raises(MismatchedEvidence):
        twin.apply(TransferCompleted.of(g, 0))
    assert twin.collect_releasable() == {}
