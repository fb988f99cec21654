"""A ledger that starts over an arena a previous incarnation's peers may still reach."""

from __future__ import annotations

import numpy as np
import pytest

from kvlifetime.errors import (
    BlockUnavailable,
    InvalidField,
    MismatchedEvidence,
    OutOfBlocks,
    UnauthorizedEvidence,
)
from kvlifetime.evidence import AccessRevoked, TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.harness.decode import SimConfig, run
from kvlifetime.harness.transfer import InprocEngine, InprocTarget, Status
from kvlifetime.ledger import BlockLedger
from kvlifetime.machines import BlockState, RequestState
from kvlifetime.source import Source

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
    naive = run(SimConfig(policy="proof", requests=1500, seed=11, restart="naive"))
    guarded = run(SimConfig(policy="proof", requests=1500, seed=11, restart="guarded"))
    assert naive.lost_to_restart > 0 and guarded.lost_to_restart == naive.lost_to_restart
    assert naive.contaminated_blocks > 0
    assert naive.refused_evidence.get("mismatched_evidence", 0) > 0  # the old grants' proof
    assert guarded.contaminated_blocks == 0
    assert guarded.reclaimed_blocks["inproc_initiator_reaped"] >= 2048  # the whole arena
    assert guarded.quarantined_blocks == 0 and guarded.leaked_blocks == 0
