"""The control-plane schema: round trips, and untrusted bytes that never crash a worker."""

from __future__ import annotations

import contextlib

import attrs
import msgpack
import pytest
import wire_schema_helpers as schema
from hypothesis import event, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from wire_schema_helpers import decode_checked

from kvlifetime.adapters.inproc import InprocEngine, InprocTarget
from kvlifetime.evidence import BY_NAME, Evidence, SchedulingStopped, TransferCompleted, to_wire
from kvlifetime.grant import GrantId
from kvlifetime.harness import wire
from kvlifetime.harness.faults import FaultConfig, FaultyLink
from kvlifetime.harness.push_initiator import PrefillWorker
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


# ------------------------------------------------------------------ held to the schema
#
# Each frame below goes through ``decode_checked``: refused with ``MalformedMessage`` exactly
# when the independent restatement of the schema (``wire_schema_helpers``) says it is not a
# message, and a message decoded from it encodes back to the very body it came from. A decoder
# that accepts garbage, refuses a message, or coerces a field fails here.

I64, U32, U64 = schema.I64, schema.U32, schema.U64
GRANT = ["inc", 3]

# One valid body per type (every field at a plain value) ...
VALID: dict[str, dict[str, object]] = {
    "assign": {
        "request": 7,
        "grant": GRANT,
        "peer": "prefill-0",
        "blocks": [1, 2],
        "generations": [0, 4],
        "addresses": [100, 200],
        "tokens": 512,
    },
    "abort": {"request": 7, "grant": GRANT},
    "query": {"request": "req-7", "grant": GRANT},
    "tick": {"n": 12},
    "stop": {},
    "evidence": {"evidence": to_wire(SchedulingStopped(G, 7, "prefill-0", 2))},
    "rejected": {"request": 7, "grant": GRANT, "reason": "too long"},
    "failed": {"request": 7, "grant": GRANT, "seq": 2},
    "tick_done": {"n": -1},
    "stats": {"counters": {"batches": 3}},
    "read_assign": {
        "request": 7,
        "grant": GRANT,
        "peer": "decode-0",
        "blocks": [1, 2],
        "generations": [0, 4],
        "addresses": [100, 200],
    },
    "reads_checked": {"request": 7, "grant": GRANT, "seq": 1, "blocks": [1, 2], "stale": [0, 1]},
    "reader_pending": {"n": 3, "grants": 0},
}

# ... and, per kind of field, values the schema refuses and values at its edges it takes.
NOT_INTS: list[object] = [True, False, 1.0, "1", None, [1], {"n": 1}, b"1"]
BAD: dict[str, list[object]] = {
    "int": [*NOT_INTS, -1, I64 + 1, U64],
    "int1": [*NOT_INTS, 0, -1, I64 + 1],
    "int-1": [*NOT_INTS, -2, I64 + 1],
    "text": [1, None, b"x", "", "x" * 257, ["x"]],
    "reason": [1, None, b"x", "", "x" * 4097],
    "request": [True, 1.5, None, b"r", "", -1, I64 + 1, "r" * 257, [7]],
    "grant": [
        "inc#3",
        None,
        ["inc"],
        ["inc", 3, 0],
        ["", 3],
        ["i" * 257, 3],
        ["inc", 0],
        ["inc", -1],
        ["inc", True],
        ["inc", 1.0],
        [3, "inc"],
        {"inc": 3},
        [b"inc", 3],
    ],
    "ids": ["1", None, [True], [-1], [1.0], [I64 + 1], [None], {"0": 1}],
    "gens": [[True], [-1], [U32 + 1], [1.0], "0"],
    "addrs": [[True], [-1], [1.0], [None], "0"],  # over 2**64 - 1: msgpack cannot carry it
    "stale": [[2], [-1], [True], [0.0]],
    "counters": [[["x", 1]], {"x": -1}, {"x": True}, {"": 1}, {"x" * 257: 1}, {"x": I64 + 1}, 3],
    "evidence": [None, [], "TransferCompleted", {"type": "Unheard"}, {}],
}
EDGE: dict[str, list[object]] = {
    "int": [0, I64],
    "int1": [1, I64],
    "int-1": [-1, 0, I64],
    "text": ["x", "x" * 256, "é👀"],
    "reason": ["x", "x" * 4096],
    "request": [0, I64, "r", "r" * 256],
    "grant": [["i", 1], ["i" * 256, I64]],
    "ids": [[0], [I64, 0]],
    "gens": [[0, U32]],
    "addrs": [[0, U64]],
    "stale": [[1, 0]],
    "counters": [{}, {"x" * 256: I64, "y": 0}],
    "evidence": [],
}
FIELD_KIND: dict[tuple[str, str], str] = {
    **{(t, "request"): "request" for t in VALID if "request" in VALID[t]},
    **{(t, "grant"): "grant" for t in VALID if "grant" in VALID[t]},
    ("assign", "peer"): "text",
    ("read_assign", "peer"): "text",
    ("assign", "tokens"): "int",
    ("tick", "n"): "int",
    ("tick_done", "n"): "int-1",
    ("reader_pending", "n"): "int",
    ("reader_pending", "grants"): "int",
    ("failed", "seq"): "int1",
    ("reads_checked", "seq"): "int1",
    ("rejected", "reason"): "reason",
    ("stats", "counters"): "counters",
    ("evidence", "evidence"): "evidence",
    ("reads_checked", "stale"): "stale",
    **{(t, "blocks"): "ids" for t in ("assign", "read_assign", "reads_checked")},
    **{(t, "generations"): "gens" for t in ("assign", "read_assign")},
    **{(t, "addresses"): "addrs" for t in ("assign", "read_assign")},
}


def _body(kind: str, **over: object) -> dict[str, object]:
    return {"v": wire.SCHEMA_VERSION, "t": kind, **VALID[kind], **over}


def _pack(body: object) -> bytes:
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def test_the_tables_cover_every_field_of_the_schema() -> None:
    assert set(VALID) == set(wire._SCHEMA) == set(schema.FIELDS)
    for kind, (_cls, fields) in wire._SCHEMA.items():
        assert set(VALID[kind]) == set(fields) == set(schema.FIELDS[kind]), kind
        assert {f for t, f in FIELD_KIND if t == kind} == set(fields), kind


@pytest.mark.parametrize("kind", sorted(VALID))
def test_each_type_round_trips_exactly_at_its_edges(kind: str) -> None:
    bodies = [_body(kind)]
    for field in VALID[kind]:
        for v in EDGE[FIELD_KIND[kind, field]]:
            over = {field: v}
            for other in schema.PARALLEL.get(kind, ()):  # parallel lists keep one length
                if isinstance(v, list) and field in schema.PARALLEL[kind] and other != field:
                    over[other] = [0] * len(v)
            bodies.append(_body(kind, **over))
    for body in bodies:
        msg = decode_checked(_pack(body), sender="prefill-0")
        assert type(msg) is wire._SCHEMA[kind][0]


def _fit(kind: str, field: str, v: object) -> object:
    """A bad list for one of parallel lists, at their length: refused for its values, not
    for a length the other lists do not share."""
    valid = VALID[kind][field]
    if field in schema.PARALLEL.get(kind, ()) and isinstance(v, list) and isinstance(valid, list):
        return (v + valid)[: len(valid)]
    return v


def _refusals(kind: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for field in VALID[kind]:
        out += [
            _body(kind, **{field: _fit(kind, field, bad)}) for bad in BAD[FIELD_KIND[kind, field]]
        ]
        missing = _body(kind)
        del missing[field]
        out.append(missing)
    out.append(_body(kind, extra=1))
    out.append(_body(kind, **{"v": 2}))
    out.append(_body(kind, **{"v": True}))
    out.append(_body(kind, **{"v": 1.0}))  # equal to 1, and not the schema's version
    out.append({k: v for k, v in _body(kind).items() if k != "v"})
    for field in schema.PARALLEL.get(kind, ()):
        out.append(_body(kind, **{field: VALID[kind][field][:1]}))  # type: ignore[index]
    if kind in schema.PARALLEL:
        out.append(_body(kind, **{key: [] for key in schema.PARALLEL[kind]}))
    return out


@pytest.mark.parametrize("kind", sorted(VALID))
def test_every_field_refuses_what_the_schema_does_not_take(kind: str) -> None:
    """One bad value at a time, in every field of every type: each is refused, typed."""
    for body in _refusals(kind):
        frame = _pack(body)
        assert not schema.conforms(schema.body_of(frame)), body  # the table is garbage
        with pytest.raises(wire.MalformedMessage) as e:
            wire.decode(frame, sender="prefill-0")
        assert e.value.kind == "malformed_message"


@pytest.mark.parametrize("kind", sorted(BY_NAME))
def test_evidence_with_a_field_left_out_is_refused(kind: str) -> None:
    """Evidence on the wire names every field of its class: one left out is refused, never
    filled in. A ``SchedulingStopped`` or ``TransferCompleted`` without ``last_seq`` used to
    decode with ``last_seq=0`` ("nothing was posted"): the strongest claim, from a field
    nobody sent. (Found by the fuzz test held to the schema.)"""
    g = G
    examples = {
        "SchedulingStopped": SchedulingStopped(g, 7, "prefill-0", 2),
        "TransferCompleted": TransferCompleted(g, 7, "prefill-0", 3),
    }
    full = to_wire(examples.get(kind) or _some(kind, g))
    assert decode_checked(_pack({"v": 1, "t": "evidence", "evidence": full}), sender="p")
    for name in [k for k in full if k != "type"]:
        body = {"v": 1, "t": "evidence", "evidence": {k: v for k, v in full.items() if k != name}}
        assert not schema.conforms(body)
        with pytest.raises(wire.MalformedMessage, match="missing"):
            wire.decode(_pack(body), sender="p")


def _some(kind: str, g: GrantId) -> Evidence:
    """One valid piece of evidence of class ``kind`` about grant ``g``."""
    cls = BY_NAME[kind]
    values: dict[str, object] = {
        "grant_id": g,
        "request": 7,
        "peer": "prefill-0",
        "last_seq": 2,
        "through_seq": 2,
    }
    names = [f.name for f in attrs.fields(cls) if f.name != "source"]
    return cls(source=Source.peer("prefill-0"), **{n: values[n] for n in names if n in values})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_refused_unless_they_are_a_message(frame: bytes) -> None:
    with contextlib.suppress(wire.MalformedMessage):
        decode_checked(frame, sender="prefill-0")


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(wire._SCHEMA)), st.dictionaries(st.text(max_size=10), _json))
def test_random_fields_are_refused_unless_they_are_a_message(
    kind: str, fields: dict[str, object]
) -> None:
    with contextlib.suppress(wire.MalformedMessage):
        decode_checked(_frame(**{**fields, "t": kind}), sender="prefill-0")


# list items at and past the edges of every list field's range, and of the wrong types
ITEMS = [0, 1, 2, -1, True, 1.0, None, "1", U32, U32 + 1, I64, I64 + 1, U64]


def _value(data: st.DataObject, kind: str, field: str) -> object:
    """Mostly a value from the tables (valid, at an edge, or one the schema refuses), else a
    random one; for a list field, often a list of the valid length with items at and past
    the edges (refused for an item, if at all, never only for its length)."""
    k = FIELD_KIND[kind, field]
    valid = VALID[kind][field]
    source = data.draw(st.integers(0, 5))
    if source == 5:
        return data.draw(_json)
    if source == 4 and isinstance(valid, list):
        n = len(valid)
        return data.draw(st.lists(st.sampled_from(ITEMS), min_size=n, max_size=n))
    if source >= 3 or not BAD[k]:
        return _fit(kind, field, data.draw(st.sampled_from([valid, *EDGE[k]])))
    return _fit(kind, field, data.draw(st.sampled_from(BAD[k])))


@pytest.mark.parametrize("kind", sorted(VALID))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_near_messages_are_taken_whole_or_refused(kind: str, data: st.DataObject) -> None:
    """A valid body with one field (now and then more) swapped for an edge, bad or random
    value, a field dropped or one added now and then: a message of the schema, taken
    exactly, or refused, typed."""
    body = _body(kind)
    fields = sorted(VALID[kind])
    if fields:
        chosen = {data.draw(st.sampled_from(fields))}
        while data.draw(st.integers(0, 3)) == 3:
            chosen.add(data.draw(st.sampled_from(fields)))
        for field in chosen:
            body[field] = _value(data, kind, field)
        if data.draw(st.integers(0, 9)) == 9:
            del body[data.draw(st.sampled_from(fields))]
    if data.draw(st.integers(0, 9)) == 9:
        body[data.draw(st.sampled_from(["extra", "v2", "T"]))] = data.draw(_json)
    if data.draw(st.integers(0, 19)) == 19:  # the envelope: another version, or type
        key = data.draw(st.sampled_from(["v", "t"]))
        body[key] = data.draw(st.sampled_from([0, 2, True, 1.0, "1", None, "tick", "assign"]))
    try:
        decode_checked(_pack(body), sender="prefill-0")
    except wire.MalformedMessage:
        event("refused")
    else:
        event("taken")


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(MESSAGES), st.data())
def test_mutated_messages_are_taken_whole_or_refused(
    msg: wire.Message, data: st.DataObject
) -> None:
    """A valid frame with bytes overwritten, cut short or extended: what decodes is a message
    whose every field passes the schema's checks and that encodes back to its body."""
    frame = bytearray(wire.encode(msg))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["set", "set", "set", "cut", "add"]))
        if op == "set" and frame:
            frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
        elif op == "cut" and frame:
            del frame[data.draw(st.integers(0, len(frame) - 1)) :]
        else:
            frame += data.draw(st.binary(min_size=1, max_size=4))
    try:
        decode_checked(bytes(frame), sender="prefill-0")
    except wire.MalformedMessage:
        event("refused")
    else:
        event("taken")


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
