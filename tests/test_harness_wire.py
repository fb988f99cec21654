"""The control-plane schema: round trips, and untrusted bytes that never crash a worker."""

from __future__ import annotations

import contextlib

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvlifetime.evidence import SchedulingStopped, TransferCompleted
from kvlifetime.grant import GrantId
from kvlifetime.harness import wire
from kvlifetime.harness.faults import FaultConfig, FaultyLink
from kvlifetime.harness.prefill import PrefillWorker
from kvlifetime.harness.transfer import InprocEngine, InprocTarget
from kvlifetime.source import Source

G = GrantId("inc", 3)

MESSAGES: list[wire.Message] = [
    wire.Assign(7, G, "prefill-0", (1, 2), (0, 4), (100, 200), 512),
    wire.Abort(7, G),
    wire.Query("req-7", G),
    wire.Tick(12),
    wire.Stop(),
    wire.EvidenceMsg(SchedulingStopped(G, 7, "prefill-0", 2)),
    wire.EvidenceMsg(TransferCompleted(G, 7, "prefill-0", 3)),
    wire.Rejected(7, G, "too long"),
    wire.TransferFailed(7, G, 2),
    wire.TickDone(-1),
    wire.Stats({"batches": 3}),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_round_trip(msg: wire.Message) -> None:
    got = wire.decode(wire.encode(msg), sender="prefill-0")
    if isinstance(msg, wire.EvidenceMsg):
        # The receiver stamps the connection's identity; the sender's source never travels.
        msg = wire.EvidenceMsg(attrs.evolve(msg.evidence, source=Source.peer("prefill-0")))
    assert got == msg


def test_evidence_is_stamped_with_the_connection_not_the_name_inside() -> None:
    frame = wire.encode(wire.EvidenceMsg(TransferCompleted(G, 7, "prefill-0", 3)))
    got = wire.decode(frame, sender="prefill-1")
    assert isinstance(got, wire.EvidenceMsg)
    assert got.evidence.source == Source.peer("prefill-1")
    assert isinstance(got.evidence, TransferCompleted)
    assert got.evidence.peer == "prefill-0"  # what it claims; the ledger refuses the mismatch
    with pytest.raises(wire.MalformedMessage, match="no identity"):
        wire.decode(frame)  # evidence from nobody in particular is nobody's evidence


def _frame(**body: object) -> bytes:
    out: bytes = msgpack.packb({"v": wire.SCHEMA_VERSION, **body})
    return out


def _assign(**over: object) -> bytes:
    body: dict[str, object] = {
        "t": "assign",
        "request": 1,
        "grant": ["i", 1],
        "peer": "p",
        "blocks": [1],
        "generations": [0],
        "addresses": [1],
        "tokens": 1,
    }
    return _frame(**{**body, **over})


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 2, "t": "tick", "n": 1}),
        msgpack.packb({"t": "tick", "n": 1}),
        _frame(t="tick"),
        _frame(t="tick", n=-5),
        _frame(t="tick", n=True),
        _frame(t="tick", n=1, extra=1),
        _frame(t="launch_missiles"),
        _frame(t="abort", request="", grant=["inc", 1]),
        _frame(t="abort", request=1, grant=["inc", 0]),
        _frame(t="abort", request=1, grant="inc#1"),
        _frame(t="evidence", evidence={"type": "TransferCompleted", "last_seq": -1}),
        _frame(t="evidence", evidence={"type": "Unheard"}),
        _frame(
            t="assign",
            request=1,
            grant=["i", 1],
            peer="p",
            blocks=[1],
            generations=[],
            addresses=[1],
            tokens=1,
        ),
        # Bounds: what a handler cannot take is refused here (issue 10).
        _frame(t="abort", request=-1, grant=["inc", 1]),
        _frame(t="abort", request=2**63, grant=["inc", 1]),
        _frame(t="abort", request="r" * 257, grant=["inc", 1]),
        _frame(t="abort", request=1, grant=["i" * 257, 1]),
        _frame(t="abort", request=1, grant=["inc", 2**63]),
        _frame(t="tick", n=2**63),
        _frame(t="tick_done", n=2**64 - 1),
        _frame(t="failed", request=1, grant=["inc", 1], seq=2**63),
        _frame(t="rejected", request=1, grant=["inc", 1], reason="r" * 4097),
        _frame(t="stats", counters={"x": 2**63}),
        _frame(t="stats", counters={"x" * 257: 1}),
        _assign(request=-1),
        _assign(peer="p" * 257),
        _assign(blocks=[2**63]),
        _assign(generations=[2**32]),
        _assign(tokens=2**63),
    ],
)
def test_malformed_frames_are_refused(frame: bytes) -> None:
    with pytest.raises(wire.MalformedMessage):
        wire.decode(frame)


def test_the_bounds_are_inclusive() -> None:
    top = 2**63 - 1
    m = wire.decode(
        _assign(request=top, blocks=[top], generations=[2**32 - 1], addresses=[2**64 - 1])
    )
    assert isinstance(m, wire.Assign) and m.request == top and m.addresses == (2**64 - 1,)
    assert wire.decode(_assign(request="r" * 256, tokens=top)) is not None
    assert wire.decode(_frame(t="tick", n=top)) == wire.Tick(top)
    assert wire.decode(_frame(t="tick_done", n=-1)) == wire.TickDone(-1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_malformed(frame: bytes) -> None:
    with contextlib.suppress(wire.MalformedMessage):
        wire.decode(frame)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(wire._SCHEMA)), st.dictionaries(st.text(max_size=10), _json))
def test_random_fields_only_raise_malformed(kind: str, fields: dict[str, object]) -> None:
    with contextlib.suppress(wire.MalformedMessage):
        wire.decode(_frame(**{**fields, "t": kind}))


def test_garbage_from_the_faulty_link_is_refused() -> None:
    link = FaultyLink(1, 1, FaultConfig(p_malformed=1.0, p_lose=0, p_dup=0, p_delay=0))
    good = wire.encode(wire.Tick(1))
    for i in range(50):
        link.offer(good, i)
    frames = link.due(100)
    assert link.garbage == 50 and len(frames) == 100
    refused = 0
    for f in frames:
        try:
            wire.decode(f)
        except wire.MalformedMessage:
            refused += 1
    assert refused == 50


def test_prefill_worker_logs_refuses_and_keeps_running() -> None:
    target = InprocTarget(64 * 4096)
    engine = InprocEngine(target.descriptor(), 16 * 4096)
    try:
        worker = PrefillWorker(
            engine,
            peer="prefill-0",
            seed=1,
            faults=FaultConfig(p_lose=0, p_dup=0, p_delay=0, p_malformed=0),
            block_bytes=4096,
            target=target.descriptor(),
        )
        with capture_logs() as logs:
            for frame in (b"\x00garbage", _frame(t="nope")):
                try:
                    worker.handle(wire.decode(frame))
                except wire.MalformedMessage as e:
                    worker.refuse(e, frame)
        assert worker.counters["malformed_refused"] == 2
        assert [e["event"] for e in logs] == ["message_refused", "message_refused"]
        assert all(e["log_level"] == "error" for e in logs)
        # ... and it still works: a request gets written and completed.
        worker.handle(
            wire.Assign(
                0, G, "prefill-0", (0, 1), (0, 0), (target.address(0), target.address(4096)), 1
            )
        )
        out: list[bytes] = []
        for n in range(1, 40):
            out += worker.tick(n)
        kinds = [wire.decode(f, sender="prefill-0") for f in out]
        assert (
            any(
                isinstance(m, wire.EvidenceMsg) and isinstance(m.evidence, TransferCompleted)
                for m in kinds
            )
            or worker.counters["rejected"] == 1
        )
    finally:
        engine.close()
        target.close()
