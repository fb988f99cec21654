"""What each Mooncake status proves (the adapter), the in-process engine's hard semantics, and
the real engine over TCP on loopback.

Tests that need Mooncake run for real when ``mooncake.engine`` imports; with
``KVLIFETIME_REQUIRE_MOONCAKE=1`` (set by .ci/run) they fail instead of skipping.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mooncake_helpers import need_mooncake

from kvlifetime.adapters.inproc import InprocEngine, InprocTarget
from kvlifetime.adapters.mooncake import (
    GrantTransfers,
    UnsafeTransport,
    batch_ended,
    require_protocol_v2,
    tcp_protocol,
)
from kvlifetime.adapters.transfer import Status
from kvlifetime.evidence import Evidence, SchedulingStopped, TransferCompleted, TransferQuiesced
from kvlifetime.grant import GrantId

G = GrantId("inc", 1)


def tracker(protocol: int = 2) -> GrantTransfers:
    return GrantTransfers(G, 5, "prefill-0", protocol=protocol)


# --------------------------------------------------------------------------- status -> evidence


def test_status_codes() -> None:
    assert batch_ended(0) is True
    assert batch_ended(-1) is False
    assert batch_ended(-2) is False
    assert batch_ended(0, protocol=1) is False  # v1 COMPLETED: bytes only left the sender


def test_completed_batches_complete_the_grant() -> None:
    t = tracker()
    s1, s2 = t.post(), t.post()
    assert t.finish() == []  # everything posted, nothing ended yet
    assert t.on_status(s2, 0) == []  # out of order: 1 still unproven
    assert t.on_status(s1, 0) == [TransferCompleted(G, 5, "prefill-0", 2)]
    assert t.concluded


def test_failed_batch_proves_nothing_ever() -> None:
    t = tracker()
    s1, s2 = t.post(), t.post()
    t.finish()
    assert t.on_status(s1, -1) == []
    assert t.on_status(s2, 0) == []  # later completions cannot cover the failed batch
    assert not any(isinstance(e, TransferQuiesced | TransferCompleted) for e in t.sent)


def test_abort_gives_scheduling_stopped_then_quiesced() -> None:
    t = tracker()
    s1 = t.post()
    assert t.stop() == [SchedulingStopped(G, 5, "prefill-0", 1)]
    assert t.stop() == []  # idempotent
    assert t.on_status(s1, 0) == [TransferQuiesced(G, 5, "prefill-0", 1)]
    with pytest.raises(Exception, match="scheduling stopped"):
        t.post()


def test_abort_before_any_post_closes_at_once() -> None:
    t = tracker()
    assert t.stop() == [
        SchedulingStopped(G, 5, "prefill-0", 0),
        TransferQuiesced(G, 5, "prefill-0", 0),
    ]


def test_protocol_v1_completed_proves_nothing() -> None:
    t = tracker(protocol=1)
    s1 = t.post()
    t.finish()
    assert t.on_status(s1, 0) == []


def test_protocol_v1_is_refused() -> None:
    assert tcp_protocol({"MC_TCP_PROTO": "1"}) == 1
    assert tcp_protocol({}) == 2
    with pytest.raises(UnsafeTransport):
        require_protocol_v2({"MC_TCP_PROTO": "1"})
    require_protocol_v2({})


def test_profile_rows_match_the_adapter() -> None:
    """Every status row of the Mooncake PROFILE, checked against what the adapter does with that
    status (``batch_ended``, ``GrantTransfers``, ``MooncakeEngine``): a row that says a status
    yields more, less or other evidence than the adapter emits fails here."""
    import re
    import threading

    from kvlifetime.adapters.mooncake import PROFILE, MooncakeEngine
    from kvlifetime.profiles import NOTHING

    def emitted(code: int, protocol: int) -> set[type[Evidence]]:
        # Both ends a grant can have: the normal end, and scheduling stopped early.
        out: set[type[Evidence]] = set()
        for end in ("finish", "stop"):
            t = tracker(protocol)
            seq = t.post()
            evs = getattr(t, end)() + t.on_status(seq, code)
            out |= {type(e) for e in evs if not isinstance(e, SchedulingStopped)}
        return out

    checked = []
    for row in PROFILE.rows:
        got: set[type[Evidence]] = set()
        m = re.search(r"get_batch_transfer_status == (-?\d+)", row.status)
        if m is not None:
            code, protocol = int(m.group(1)), 1 if "protocol v1" in row.status else 2
            got = emitted(code, protocol)
            assert batch_ended(code, protocol) == (row.evidence != NOTHING), row.status
        elif row.status.startswith("submit refused"):
            # A fake engine whose submit is refused with each batch id the row names.
            for bid in map(int, re.findall(r"-?\d+", row.status.split("batch id", 1)[1])):
                eng = MooncakeEngine.__new__(MooncakeEngine)
                eng._engine = type("E", (), {"batch_transfer_async_write": lambda *a, b=bid: b})()
                eng._target, eng._src, eng._futures = "t", 0, {}
                eng._next, eng._lock = 1, threading.Lock()
                status = eng.wait(eng.submit([(0, 0, 4096)]), 0)
                assert status is Status.FAILED, (row.status, bid)
                got |= emitted(int(status), 2)
        else:
            continue  # operations, not statuses: pinned by their own tests (row.test)
        checked.append(row.status)
        assert got == set(row.evidence_classes), (row.status, got)
        for cls in got:
            assert row.claims <= cls.PROVES, (row.status, cls)
    assert len(checked) >= 4  # v2 COMPLETED, v1 COMPLETED, FAILED, submit refused


# --------------------------------------------------------------------------- in-process engine


def test_inproc_failed_batch_still_lands_later(inproc: tuple[InprocTarget, InprocEngine]) -> None:
    target, engine = inproc
    engine.staging[:4096] = 7
    bad = target.address(0) + target.nbytes + 4096  # outside the registered range
    h = engine.submit([(0, target.address(0), 4096), (0, bad, 4096)])
    assert engine.wait(h, 1.0) is Status.FAILED
    assert not target.array[:4096].any()  # reported FAILED before the other slice landed
    engine.advance(1)
    assert not target.array[:4096].any()
    engine.advance(3)
    assert (target.array[:4096] == 7).all()  # ... and it landed after all


def test_inproc_unregister_is_not_revocation(inproc: tuple[InprocTarget, InprocEngine]) -> None:
    target, engine = inproc
    engine.staging[:4096] = 9
    bad = target.address(0) + target.nbytes
    h1 = engine.submit([(0, target.address(4096), 4096), (0, bad, 4096)])  # accepted part
    target.unregister()
    assert engine.wait(h1, 1.0) is Status.FAILED
    engine.advance(10)
    assert (target.array[4096:8192] == 9).all()  # accepted before unregister: it landed
    h2 = engine.submit([(0, target.address(0), 4096)])
    assert engine.wait(h2, 1.0) is Status.FAILED  # new writes are refused, 0 bytes
    assert not target.array[:4096].any()


# --------------------------------------------------------------------------- the real engine


def test_real_engine_completed_means_landed() -> None:
    need_mooncake()
    from kvlifetime.adapters.mooncake import MooncakeEngine, MooncakeTarget

    target = MooncakeTarget(8 * 4096)
    engine = MooncakeEngine(target.descriptor(), 4 * 4096)
    try:
        engine.staging[:8192] = 5
        h = engine.submit([(0, target.address(0), 4096), (4096, target.address(8192), 4096)])
        assert engine.wait(h, 30) is Status.COMPLETED
        assert (target.array[:4096] == 5).all() and (target.array[8192:12288] == 5).all()
        # A slice outside every registered buffer: the batch FAILS (refused, 0 bytes).
        bad = target.address(0) + target.nbytes + (1 << 20)
        h = engine.submit([(0, bad, 4096)])
        assert engine.wait(h, 30) is Status.FAILED
        # A FAILED batch's good slice still lands: FAILED proves nothing about it.
        engine.staging[:4096] = 6
        h = engine.submit([(0, target.address(4096), 4096), (0, bad, 4096)])
        assert engine.wait(h, 30) is Status.FAILED
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (target.array[4096:8192] == 6).all():
            time.sleep(0.01)
        assert (target.array[4096:8192] == 6).all()
    finally:
        engine.close()
        target.close()


def test_real_engine_proof_vs_naive() -> None:
    need_mooncake()
    from kvlifetime.harness.loop import run
    from kvlifetime.harness.settings import PushSettings

    proof = run(PushSettings(backend="mooncake", policy="proof", requests=800, seed=11))
    assert proof.contaminated_blocks == 0 and proof.leaked_blocks == 0
    assert proof.ended_mid_transfer / proof.requests >= 0.20
    naive = run(PushSettings(backend="mooncake", policy="naive", requests=800, seed=11))
    assert naive.contaminated_blocks > 0
    np.testing.assert_equal(naive.requests, proof.requests)
