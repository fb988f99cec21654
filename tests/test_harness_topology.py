"""The topology knobs of the push harness (``FaultConfig``): several prefill ranks per request,
a crash whose handed-over writes land after the initiator is gone, and a transport that
re-delivers an old slice. Each: planted and counted by the oracle exactly, then end to end on
the in-process engine, where naive shows the violation and proof does not (or, for a transport
that lies about DONE, where the oracle shows that no evidence protects against it)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from harness_helpers import child_processes

from kvlifetime.adapters.inproc import LOG_AFTER_DEATH, InprocEngine, InprocTarget
from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import GrantId
from kvlifetime.harness import pattern, wire
from kvlifetime.harness.faults import FaultConfig
from kvlifetime.harness.loop import run
from kvlifetime.harness.push_owner import DecodeWorker
from kvlifetime.harness.result import RunResult
from kvlifetime.harness.settings import PushSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import RequestState

SEED = 11
N = 1000
BB = 4096

_cache: dict[tuple[str, FaultConfig], RunResult] = {}


def report(policy: str, faults: FaultConfig) -> RunResult:
    key = (policy, faults)
    if key not in _cache:
        _cache[key] = run(PushSettings(policy=policy, requests=N, seed=SEED, faults=faults))
    return _cache[key]


# --------------------------------------------------------------------------- tensor parallel

TP = FaultConfig(tp_ranks=2)


def _assigns(frames: list[bytes]) -> list[wire.Assign]:
    out = []
    for f in frames:
        m = wire.decode(f)
        if isinstance(m, wire.Assign):
            out.append(m)
    return out


def test_each_rank_has_its_own_grant_and_release_needs_every_rank() -> None:
    cfg = PushSettings(num_blocks=16, requests=1, arrivals_per_tick=1, faults=TP)
    target = InprocTarget(cfg.num_blocks * cfg.block_bytes)
    try:
        w = DecodeWorker(cfg, target, BlockLedger(cfg.num_blocks))
        peers = ["prefill-0/rank0", "prefill-0/rank1"]
        outs = w.tick_ranks(0, peers, True)
        (a0,), (a1,) = _assigns(outs[0]), _assigns(outs[1])
        assert (a0.peer, a1.peer) == tuple(peers) and a0.grant != a1.grant
        assert a0.blocks == a1.blocks  # every rank writes (its part of) every block
        key = int(a0.request)
        last = -(-len(a0.blocks) // 2)

        def completed(grant: GrantId, peer: str) -> bytes:
            return wire.encode(wire.EvidenceMsg(TransferCompleted(grant, key, peer, last)))

        # Rank 1 may not speak for rank 0: refused, counted, nothing changes.
        w.receive([completed(a0.grant, peers[0])], sender=peers[1])
        assert w.count.unauthorized_refused == 1
        assert len(w.ledger.open_grants(key)) == 2
        # Rank 0's own proof closes rank 0's grant only: not consumed, not releasable.
        w.receive([completed(a0.grant, peers[0])], sender=peers[0])
        assert [g.peer for g in w.ledger.open_grants(key)] == [peers[1]]
        assert not w.reqs[key].consumed
        w.ledger.reject(key, "client abort")
        assert w.ledger.collect_releasable() == {}  # rank 1 may still be writing
        w.receive([completed(a1.grant, peers[1])], sender=peers[1])
        assert w.ledger.state(key) is RequestState.TRANSFER_QUIESCED
        assert list(w.ledger.collect_releasable()) == [key]
    finally:
        target.close()


def test_tensor_parallel_ranks_naive_late_writes_proof_none() -> None:
    naive, proof = report("naive", TP), report("proof", TP)
    assert naive.topology["tp_ranks"] == proof.topology["tp_ranks"] == 2
    assert naive.seen("late_writes") > 0 and naive.unsafe_releases > 0
    assert proof.seen("late_writes") == 0 and proof.contaminated_blocks == 0
    assert proof.leaked_blocks == 0 and proof.quarantined_blocks == 0
    assert proof.unauthorized_refused == 0  # each rank spoke for its own grant only
    assert proof.completed > 0 and proof.peer_crashes == 1
    # One fence per rank: each rank's grants are closed by its own AccessRevoked.
    assert proof.fences["inproc_initiator_reaped"] % 2 == 0
    # Two ranks land a landing each per block written.
    one = report("proof", FaultConfig())
    assert proof.seen("writes") > 1.8 * one.seen("writes")
    assert multiprocessing.active_children() == [] and child_processes() == []


# --------------------------------------------------------------------------- land after crash


def test_a_dead_initiators_handed_over_slice_lands_from_the_target_and_a_cut_ends_it() -> None:
    target = InprocTarget(4 * BB)
    try:
        w = pattern.words(7, [1, 2, 3], [0, 0, 0])
        engine = InprocEngine(target.descriptor(), 3 * BB, handover_region=5)
        pattern.fill(engine.staging, w, BB)
        s1, s2, s3 = ((i * BB, target.address((i + 1) * BB), BB) for i in range(3))
        t1 = engine.hand_over([s1], due=4)
        t2 = engine.hand_over([s2], due=6)
        t3 = engine.hand_over([s3], due=6)
        engine.wait(engine.submit([s3], ticket=t3), 1.0)  # landed by the initiator: retired
        assert t1 and t2 and len(target.landings()) == 1
        engine.close()  # the initiator is gone; slices 1 and 2 were handed over, not landed
        assert target.take_over(5, now=2) == 2
        assert target.advance(3) == 0  # each lands at its own due tick, not before
        assert target.advance(4) == 1
        rows = target.landings()
        assert rows.tolist() == [[BB, BB | LOG_AFTER_DEATH, int(w[0])]]
        assert (target.array[BB : 2 * BB].view(np.uint64) == w[0]).all()
        assert target.cut(5) == 1  # the fence's half at the target: slice 2 never lands
        assert target.advance(100) == 0 and target.pending_after_death() == 0
        assert (target.landed_after_death, target.cut_by_fence) == (1, 1)
    finally:
        target.close()


def test_the_oracle_counts_a_late_landing_after_death_and_a_late_redelivery_exactly() -> None:
    cfg = PushSettings(num_blocks=4, block_bytes=BB)
    target = InprocTarget(4 * BB)
    try:
        d = DecodeWorker(cfg, target, BlockLedger(4))
        w = pattern.words(1, [0, 1, 2], [0, 0, 0])
        d.oracle.granted(1, [0, 1, 2], w)
        d.oracle.freed([0, 1])  # released too early; block 2 is still request 1's
        engine = InprocEngine(target.descriptor(), 3 * BB, handover_region=0)
        pattern.fill(engine.staging, w, BB)
        engine.hand_over([(0, target.address(0), BB)], due=1)
        engine.wait(engine.redeliver([(BB, target.address(BB), BB)]), 1.0)  # PLANTED: late
        engine.wait(engine.redeliver([(2 * BB, target.address(2 * BB), BB)]), 1.0)  # its own
        engine.close()
        target.take_over(0, now=0)
        target.advance(1)  # PLANTED: request 1's handed-over slice lands in free block 0
        d.observe()
        c = d.oracle.counts()
        assert (c.writes, c.late_writes, c.late_into_free) == (3, 2, 2)
        assert (c.after_death, c.late_after_death) == (1, 1)
        assert (c.redelivered, c.late_redelivered) == (2, 1)
    finally:
        target.close()


LAC = FaultConfig(land_after_crash=True)


def test_landing_after_the_crash_naive_counts_them_proofs_fence_cuts_them() -> None:
    naive, proof = report("naive", LAC), report("proof", LAC)
    assert naive.topology["landed_after_death"] == naive.seen("after_death") > 0
    assert naive.seen("late_after_death") > 0  # the crash victims' blocks were reused
    assert proof.seen("late_writes") == 0 and proof.seen("after_death") == 0
    assert proof.topology["cut_by_fence"] > 0  # what the fence discarded at the target
    assert proof.leaked_blocks == 0 and proof.quarantined_blocks == 0


def test_without_the_targets_cut_the_proof_policys_fence_would_not_end_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fence is what ends them: reaping the initiator alone leaves the handed-over slices
    landing, into blocks the fence let go."""
    monkeypatch.setattr(InprocTarget, "cut", lambda self, region: 0)
    r = run(PushSettings(policy="proof", requests=N, seed=SEED, faults=LAC))
    assert r.seen("late_after_death") > 0 and r.seen("late_writes") == r.seen("late_after_death")


# --------------------------------------------------------------------------- re-delivery

BEFORE = FaultConfig(p_redeliver=0.05)
AFTER = FaultConfig(p_redeliver=0.05, redeliver_after_done=True)


def test_redelivery_before_done_naive_counts_it_proof_is_safe() -> None:
    naive, proof = report("naive", BEFORE), report("proof", BEFORE)
    assert naive.seen("redelivered") > 0 and naive.seen("late_redelivered") > 0
    assert proof.seen("redelivered") > 0  # they happened under proof too ...
    assert proof.seen("late_writes") == 0  # ... all before DONE: into blocks still held
    assert proof.contaminated_blocks == 0 and proof.leaked_blocks == 0


def test_redelivery_after_done_lands_late_under_proof_too() -> None:
    """A transport that lies about DONE: the proof was sound evidence for what the transport
    said, and the re-delivered slice lands after it. The oracle shows it, for proof too; every
    late write of the proof policy is such a re-delivery."""
    proof = report("proof", AFTER)
    assert proof.seen("late_redelivered") > 0
    assert proof.seen("late_writes") == proof.seen("late_redelivered")
    naive = report("naive", AFTER)
    assert naive.seen("late_redelivered") >= proof.seen("late_redelivered")


def test_topology_knobs_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvlifetime.cli import main

    args = ["simulate", "--requests", "200", "--seed", "5", "--tp-ranks", "2"]
    args += ["--land-after-crash", "--p-redeliver", "0.1", "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["topology"]["tp_ranks"] == 2 and d["late_writes"] == 0
    assert d["oracle"]["redelivered"] > 0


# --------------------------------------------------------------------------- on the real engines


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_two_ranks_and_re_delivery_on_a_real_engine(backend: str) -> None:
    # Two prefill ranks (each its own process, socket and grant) and 2% re-delivered slices,
    # over Mooncake TCP and NIXL/UCX: naive lets writes land late (the arena diff sees them),
    # proof none, and every rank's grant is proven or fenced.
    if backend == "mooncake":
        from mooncake_helpers import need_mooncake

        need_mooncake()
    else:
        from nixl_helpers import need_nixl

        need_nixl()
    faults = FaultConfig(tp_ranks=2, p_redeliver=0.02)
    naive = run(
        PushSettings(backend=backend, policy="naive", requests=200, seed=SEED, faults=faults)
    )
    proof = run(
        PushSettings(backend=backend, policy="proof", requests=200, seed=SEED, faults=faults)
    )
    assert naive.seen("late_writes") > 0
    assert proof.seen("late_writes") == 0 and proof.contaminated_blocks == 0
    assert proof.leaked_blocks == 0 and proof.quarantined_blocks == 0
    assert proof.topology["tp_ranks"] == 2
