"""Workers survive every frame the schema accepts (issue 10, item 6).

``test_harness_wire`` shows that ``wire.decode`` takes exactly the frames the schema describes
and refuses the rest with ``MalformedMessage``. That is not enough: a frame the schema
*accepts* goes on to a handler, and a handler that raises kills the worker (one ``Assign`` with
request -1 did: ``plan()`` seeds numpy with it). Here frames are
built from the schema with adversarial values - edges of every int range, empty and unicode
strings, grants of other incarnations and never issued, replays, reorderings, ticks going back
and jumping ahead, addresses and blocks outside the arena - and every frame ``decode`` accepts
is handed to the workers' handlers. Nothing may raise, no handler may fail, and afterwards the
workers still do their job. Every frame is decoded through ``wire_schema_helpers.decode_checked``:
the decoder takes exactly the frames the schema describes, whole, and refuses the rest, typed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from wire_schema_helpers import decode_checked

from kvlifetime.adapters.inproc import InprocEngine, InprocTarget
from kvlifetime.errors import MalformedEvidence
from kvlifetime.evidence import BY_NAME, TransferCompleted, from_dict
from kvlifetime.grant import GrantId
from kvlifetime.harness import wire
from kvlifetime.harness.faults import FaultConfig, plan
from kvlifetime.harness.push_initiator import PrefillWorker
from kvlifetime.harness.push_owner import DecodeWorker
from kvlifetime.harness.settings import POLICIES, PushSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.source import Source

PEER = "prefill-0"
BB = 512  # block bytes: small, the fuzz is about lifetimes, not bandwidth
NBLOCKS = 256  # decode's arena; room for every request even if the garbage quarantines some
STAGING = 256  # prefill's staging slots: FAILED batches keep theirs
REQUESTS = 10
FAULTS = FaultConfig(p_lose=0.0, p_malformed=0.0, crash=False)  # the garbage comes from here
INT64_MAX = 2**63 - 1
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _decode(frame: bytes, sender: str | None = PEER) -> wire.Message:
    # Held to the schema (``wire_schema_helpers``): refused exactly when the frame is not a
    # message, and a message taken is the frame's body, field for field. Every frame either
    # worker is handed, and every frame prefill sends, goes through here.
    return decode_checked(frame, sender)


def _receive(worker: DecodeWorker, frames: list[bytes], sender: str = PEER) -> None:
    worker.receive(frames, sender)


# ------------------------------------------------------------------ the rig


@attrs.define
class Rig:
    seed: int
    target: InprocTarget
    engine: InprocEngine
    prefill: PrefillWorker
    decode: DecodeWorker | None = None
    grants: list[tuple[int | str, GrantId]] = attrs.field(factory=list)  # seen in Assigns
    sent: list[bytes] = attrs.field(factory=list)  # every frame either side sent, for replays
    held: list[bytes] = attrs.field(factory=list)  # prefill's frames held back (reordered)
    serial: int = 0  # of the test's own valid grants

    @property
    def base(self) -> int:
        return self.target.address(0)

    def addr(self, block: int) -> int:
        return self.target.address(block * BB)


@contextlib.contextmanager
def rig(seed: int, policy: str | None = None) -> Iterator[Rig]:
    target = InprocTarget(NBLOCKS * BB)
    engine = InprocEngine(target.descriptor(), STAGING * BB, straggle_ticks=FAULTS.straggle_ticks)
    try:
        prefill = PrefillWorker(
            engine,
            peer=PEER,
            seed=seed,
            faults=FAULTS,
            block_bytes=BB,
            target=target.descriptor(),
            link_salt=1000,
        )
        r = Rig(seed, target, engine, prefill)
        if policy is not None:
            cfg = PushSettings(
                policy=policy,
                requests=REQUESTS,
                seed=seed,
                block_bytes=BB,
                num_blocks=NBLOCKS,
                arrivals_per_tick=2,
                faults=FAULTS,
            )
            r.decode = DecodeWorker(cfg, target, BlockLedger(NBLOCKS))
        yield r
    finally:
        engine.close()
        target.close()


# ------------------------------------------------------------------ adversarial values

EDGE_INTS = [
    0,
    1,
    2,
    3,
    -1,
    -2,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    INT64_MAX - 1,
    INT64_MAX,
    2**63,
    2**64 - 1,
    -(2**63),
]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(0, 40), st.integers(-(2**63), 2**64 - 1))
names = st.one_of(
    st.sampled_from([PEER, "prefill-1", "decode", "", "é", "\x00", "👀" * 3, "x" * 256, "x" * 257]),
    st.text(max_size=12),
)


def _grant(data: st.DataObject, r: Rig) -> object:
    options: list[st.SearchStrategy[Any]] = [
        st.tuples(names, ints).map(list),  # of another incarnation, or none at all
        st.sampled_from([["inc", 1], ["", 1], ["inc", 0], ["inc"], "inc#1", None]),
    ]
    if r.grants:
        known = [g for _, g in r.grants]
        options += [
            st.sampled_from(known).map(lambda g: [g.incarnation, g.serial]),  # a live one
            st.tuples(st.sampled_from(known), ints).map(  # its incarnation, another serial
                lambda t: [t[0].incarnation, t[1]]
            ),
        ]
    if r.decode is not None:
        inc = r.decode.ledger.incarnation
        options.append(ints.map(lambda s: [inc, s]))  # never issued (or long released)
    return data.draw(st.one_of(*options))


def _request(data: st.DataObject, r: Rig) -> object:
    options: list[st.SearchStrategy[Any]] = [ints, names, st.sampled_from([True, None, 1.5])]
    if r.grants:
        options.append(st.sampled_from([req for req, _ in r.grants]))
    return data.draw(st.one_of(*options))


def _assign_body(data: st.DataObject, r: Rig) -> dict[object, object]:
    request = _request(data, r)
    n = data.draw(st.integers(0, 7))
    number = request if isinstance(request, int) and not isinstance(request, bool) else -1
    if 0 <= number <= INT64_MAX and data.draw(st.booleans()):
        n = plan(r.seed, number, FAULTS).nblocks  # the length its plan wants: gets further in
    blocks = [data.draw(st.one_of(st.integers(0, NBLOCKS - 1), ints)) for _ in range(n)]
    addresses: list[int] = []
    for b in blocks:
        in_arena = 0 <= b < NBLOCKS
        addresses.append(
            data.draw(
                st.one_of(
                    st.just(r.addr(b) if in_arena else r.base),  # where it should be
                    st.integers(0, NBLOCKS - 1).map(r.addr),  # another block of the arena
                    st.sampled_from(
                        [
                            r.base + 1,  # unaligned: straddles two blocks
                            r.base - BB,  # before the arena
                            r.addr(NBLOCKS),  # past its end
                            r.addr(NBLOCKS) - BB // 2,  # half in, half out
                        ]
                    ),
                    ints,
                )
            )
        )
    m = n if data.draw(st.integers(0, 9)) else data.draw(st.integers(0, 7))  # lengths differ
    return {
        "request": request,
        "grant": _grant(data, r),
        "peer": data.draw(st.one_of(st.just(PEER), names)),
        "blocks": blocks,
        "generations": [data.draw(st.one_of(st.integers(0, 3), ints)) for _ in range(m)],
        "addresses": addresses,
        "tokens": data.draw(st.one_of(st.integers(0, 5000), ints)),
    }


def _evidence_body(data: st.DataObject, r: Rig) -> dict[object, object]:
    kind = data.draw(st.sampled_from(sorted(BY_NAME)))
    body: dict[object, object] = {"type": kind}
    for f in attrs.fields(BY_NAME[kind]):
        if f.name == "source" or not data.draw(st.integers(0, 12)):
            continue  # a field left out (or the source a message may not name)
        if f.name == "grant_id":
            body[f.name] = _grant(data, r)
        elif f.name == "request":
            body[f.name] = _request(data, r)
        elif f.name == "peer":
            body[f.name] = data.draw(st.one_of(st.just(PEER), names))
        elif f.name in ("last_seq", "through_seq"):
            body[f.name] = data.draw(ints)
        else:
            body[f.name] = data.draw(st.one_of(names, ints, st.none()))
    if not data.draw(st.integers(0, 15)):  # extra keys, of mixed types
        body[data.draw(st.sampled_from(["source", "extra", b"bin"]))] = 1
        body[b"other"] = "x"
    return body


KINDS = sorted(wire._SCHEMA)


def _body(data: st.DataObject, r: Rig, kind: str) -> dict[object, object]:
    if kind == "assign":
        return _assign_body(data, r)
    if kind in ("abort", "query"):
        return {"request": _request(data, r), "grant": _grant(data, r)}
    if kind == "tick":
        return {"n": data.draw(_tick(r))}
    if kind == "tick_done":
        return {"n": data.draw(ints)}
    if kind == "evidence":
        return {"evidence": _evidence_body(data, r)}
    if kind == "rejected":
        reason = data.draw(st.one_of(names, st.sampled_from(["r" * 4096, "r" * 4097])))
        return {"request": _request(data, r), "grant": _grant(data, r), "reason": reason}
    if kind == "failed":
        return {"request": _request(data, r), "grant": _grant(data, r), "seq": data.draw(ints)}
    if kind == "stats":
        return {"counters": data.draw(st.dictionaries(names, ints, max_size=4))}
    return {}


FAR = INT64_MAX - 10**6  # the furthest tick drawn (INT64_MAX itself: test_the_end_of_time)


def _tick(r: Rig) -> st.SearchStrategy[int]:
    now = min(r.prefill.now, FAR - 100)
    return st.one_of(
        st.just(now + 1),  # the next tick
        st.just(now),  # the same tick again
        st.integers(0, max(0, now)),  # back in time
        st.integers(now + 2, now + 50),  # skipping ahead
        st.integers(now, FAR),  # far ahead
    )


def _frame(data: st.DataObject, r: Rig, kinds: list[str]) -> bytes | None:
    kind = data.draw(st.sampled_from(kinds))
    body = {"v": wire.SCHEMA_VERSION, "t": kind, **_body(data, r, kind)}
    if not data.draw(st.integers(0, 20)):
        body[data.draw(st.sampled_from(["extra", b"extra", "v2"]))] = 0  # refused: extra field
    try:
        out: bytes = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError, UnicodeEncodeError):
        return None  # not even msgpack: the decoder's own tests cover bytes
    return out


# ------------------------------------------------------------------ feeding the workers


def _collect(r: Rig, frames: list[bytes]) -> None:
    """Prefill's own output decodes (it never sends what the schema refuses)."""
    for f in frames:
        _decode(f)  # raises if prefill produced something decode would refuse
    r.sent.extend(frames)


def to_prefill(r: Rig, frame: bytes) -> list[bytes]:
    """What ``prefill_main`` does with a frame; returns what prefill sends back."""
    out: list[bytes] = []
    try:
        msg = _decode(frame, None)  # prefill's connection carries no evidence for it to take
    except wire.MalformedMessage as e:
        event("prefill: refused")
        r.prefill.refuse(e, frame)
        return out
    event(f"prefill: {msg.TYPE}")
    if isinstance(msg, wire.Assign):
        r.grants.append((msg.request, msg.grant))
    if isinstance(msg, wire.Tick):
        out = r.prefill.tick(msg.n)
        _collect(r, out)
    elif isinstance(msg, wire.Stop):
        out = [wire.encode(wire.Stats(r.prefill.stats()))]
    else:
        r.prefill.handle(msg)
    assert r.prefill.counters["handler_failed"] == 0
    return out


def to_decode(r: Rig, frames: list[bytes], sender: str = PEER) -> None:
    assert r.decode is not None
    _receive(r.decode, frames, sender)
    for f in frames:  # ... and straight to the handler, as an engine's own loop may
        try:
            msg = _decode(f, sender)
        except wire.MalformedMessage:
            event("decode: refused")
            continue
        event(f"decode: {msg.TYPE}")
        r.decode.handle(msg, sender)


def valid_assign(r: Rig, request: int) -> wire.Assign:
    """A well-formed Assign for a fresh grant of the test's own incarnation."""
    r.serial += 1
    n = plan(r.seed, request, FAULTS).nblocks
    first = (r.serial * 7) % (NBLOCKS - 8)
    blocks = tuple(range(first, first + n))
    return wire.Assign(
        request,
        GrantId("fuzz", r.serial),
        PEER,
        blocks,
        (0,) * n,
        tuple(r.addr(b) for b in blocks),
        64,
    )


def _clean(seed: int, request: int) -> bool:
    p = plan(seed, request, FAULTS)
    return p.abort_after is None and p.tokens <= FAULTS.capacity_tokens and not any(p.fails)


def _completed(frames: list[bytes], grant: GrantId) -> bool:
    for f in frames:
        msg = _decode(f)
        ev = getattr(msg, "evidence", None)
        if isinstance(ev, TransferCompleted) and ev.grant_id == grant:
            return True
    return False


def prefill_still_works(r: Rig) -> None:
    """After the garbage: a fresh, well-formed request is written and completed, and every
    job the garbage left (its batches due at ticks that were skipped included) concludes."""
    request = next(k for k in range(10**6, 10**6 + 1000) if _clean(r.seed, k))
    a = valid_assign(r, request)
    r.prefill.handle(a)
    out: list[bytes] = []
    start = r.prefill.now + 1
    # Long enough for the slowest batch the fault model allows (a late one) to land.
    for n in range(start, start + 80 + FAULTS.late_ticks[1]):
        out += r.prefill.tick(n)
    _collect(r, out)
    assert _completed(out, a.grant), r.prefill.stats()
    assert not r.prefill.busy(), r.prefill.stats()
    assert r.prefill.counters["handler_failed"] == 0


# ------------------------------------------------------------------ the fuzz tests


@FUZZ
@given(st.integers(0, 3), st.data())
def test_prefill_worker_survives_every_accepted_frame(seed: int, data: st.DataObject) -> None:
    with rig(seed) as r:
        for _ in range(data.draw(st.integers(1, 25), label="steps")):
            action = data.draw(
                st.sampled_from(["frame", "frame", "frame", "valid", "tick", "tick", "replay"])
            )
            if action == "frame":
                frame = _frame(data, r, KINDS)
                if frame is not None:
                    r.sent.append(frame)
                    to_prefill(r, frame)
            elif action == "valid":
                a = valid_assign(r, data.draw(st.integers(0, 40)))
                to_prefill(r, wire.encode(a))
            elif action == "tick":
                to_prefill(r, wire.encode(wire.Tick(data.draw(_tick(r)))))
            elif r.sent:
                # a duplicate of anything seen so far, either direction
                to_prefill(r, data.draw(st.sampled_from(r.sent)))
        prefill_still_works(r)


def _pump(r: Rig, n: int, admit: bool, hold: st.DataObject | None = None) -> None:
    """One lock-step tick, as ``decode.run`` does it, without the processes."""
    assert r.decode is not None
    back: list[bytes] = []
    for f in r.decode.tick(n, PEER, admit):
        r.sent.append(f)
        back += to_prefill(r, f)
    out = [f for f in back if not isinstance(_decode(f), wire.TickDone)]
    if hold is not None and out and not hold.draw(st.integers(0, 3)):
        k = hold.draw(st.integers(1, len(out)))
        r.held += out[:k]  # delivered later, in another order
        out = out[k:]
    to_decode(r, out)


@FUZZ
@given(st.integers(0, 3), st.sampled_from(POLICIES), st.data())
def test_decode_worker_survives_every_accepted_frame(
    seed: int, policy: str, data: st.DataObject
) -> None:
    with rig(seed, policy) as r:
        dw = r.decode
        assert dw is not None
        n = 0
        for _ in range(data.draw(st.integers(1, 25), label="steps")):
            action = data.draw(
                st.sampled_from(["pump", "pump", "decode", "decode", "prefill", "replay", "held"])
            )
            if action == "pump":
                _pump(r, n, dw.next_request < REQUESTS // 2, data)
                n += 1
            elif action == "decode":
                frame = _frame(data, r, KINDS)
                if frame is not None:
                    r.sent.append(frame)
                    sender = data.draw(st.sampled_from([PEER, PEER, PEER, "prefill-1"]))
                    to_decode(r, [frame], sender)
            elif action == "prefill":
                kinds = [k for k in KINDS if k not in ("tick", "stop")]  # decode owns time
                frame = _frame(data, r, kinds)
                if frame is not None:
                    r.sent.append(frame)
                    to_prefill(r, frame)
            elif action == "replay" and r.sent:
                frame = data.draw(st.sampled_from(r.sent))
                if data.draw(st.booleans()):
                    to_decode(r, [frame])
                elif not isinstance(_safe_decode(frame), wire.Tick | wire.Stop):
                    to_prefill(r, frame)
            elif action == "held" and r.held:
                order = data.draw(st.permutations(r.held))
                r.held.clear()
                to_decode(r, list(order))
        # The garbage ends; what was held back arrives, and the run goes on.
        to_decode(r, r.held)
        r.held.clear()
        fresh = range(dw.next_request, REQUESTS)
        clean = sum(_clean(seed, k) for k in fresh)
        before = dw.count.completed
        for _ in range(400):
            _pump(r, n, True)
            n += 1
            if dw.next_request == REQUESTS and dw.count.completed - before >= clean:
                break
        assert dw.next_request == REQUESTS
        assert dw.count.completed - before >= clean, dw.count
        assert r.prefill.counters["handler_failed"] == 0


def _safe_decode(frame: bytes) -> wire.Message | None:
    try:
        return _decode(frame)
    except wire.MalformedMessage:
        return None


@FUZZ
@given(st.booleans(), st.binary(max_size=120), st.data())
def test_raw_bytes_into_decode_and_the_handlers(
    patch: bool, raw: bytes, data: st.DataObject
) -> None:
    """Random bytes, and valid frames with a few bytes overwritten: whatever ``decode`` makes
    of them goes to both workers' handlers."""
    with rig(1, "proof") as r:
        a = valid_assign(r, 5)
        seeds = [
            wire.encode(a),
            wire.encode(wire.Abort(5, a.grant)),
            wire.encode(wire.Query(5, a.grant)),
            wire.encode(wire.Tick(3)),
            wire.encode(wire.Rejected(5, a.grant, "no")),
            wire.encode(wire.TransferFailed(5, a.grant, 1)),
            wire.encode(wire.EvidenceMsg(TransferCompleted(a.grant, 5, PEER, 2))),
        ]
        frame = raw
        if patch:
            base = bytearray(data.draw(st.sampled_from(seeds)))
            at = data.draw(st.integers(0, len(base) - 1))
            base[at] = data.draw(st.integers(0, 255))
            frame = bytes(base)
        to_prefill(r, frame)
        to_decode(r, [frame])
        prefill_still_works(r)


# ------------------------------------------------------------------ the cases


def _assign_frame(**over: object) -> bytes:
    body: dict[str, object] = {
        "v": wire.SCHEMA_VERSION,
        "t": "assign",
        "request": 1,
        "grant": ["inc", 1],
        "peer": PEER,
        "blocks": [0, 1],
        "generations": [0, 0],
        "addresses": [1 << 40, (1 << 40) + BB],
        "tokens": 64,
    }
    body.update(over)
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def test_an_assign_with_a_negative_request_is_refused_by_the_schema() -> None:
    # It used to pass, and then plan() raised ValueError outside any handler: the worker died.
    with pytest.raises(wire.MalformedMessage):
        wire.decode(_assign_frame(request=-1))


def test_an_assign_no_schema_checked_does_not_crash_the_prefill_worker() -> None:
    # Built in-process, past the schema: the handler checks what it takes itself.
    with rig(0) as r:
        for request in (-1, -(2**63), 2**64, True):
            a = wire.Assign(request, GrantId("x", 1), PEER, (0, 1), (0, 0), (r.addr(0),) * 2, 1)
            r.prefill.handle(a)
        assert r.prefill.counters["assign_refused"] == 4
        assert r.prefill.counters["handler_failed"] == 0
        prefill_still_works(r)


@pytest.mark.parametrize(
    "over",
    [
        {"blocks": [NBLOCKS, 0]},  # outside the target's arena
        {"addresses": [(1 << 40) + 1, (1 << 40) + BB]},  # unaligned: straddles two blocks
        {"addresses": [(1 << 40) + NBLOCKS * BB, (1 << 40)]},  # past the arena's end
        {"addresses": [(1 << 40) - BB, (1 << 40)]},  # before it
    ],
    ids=["block", "unaligned", "past_end", "before"],
)
def test_an_assign_outside_the_arena_posts_nothing(over: dict[str, object]) -> None:
    with rig(0) as r:
        request = next(k for k in range(100) if plan(0, k, FAULTS).nblocks == 2)
        r.prefill.handle(wire.decode(_assign_frame(request=request, **over)))
        assert r.prefill.counters["assign_refused"] == 1
        for n in range(1, 10):
            r.prefill.tick(n)
        assert r.prefill.counters["batches"] == 0 and r.engine.bytes_written == 0


def test_a_tick_that_skips_ahead_still_lands_what_was_due() -> None:
    with rig(0) as r:
        # A request whose first batch lands a few ticks after it was posted.
        k = next(k for k in range(1000) if _clean(0, k) and plan(0, k, FAULTS).latencies[0] > 0)
        a = valid_assign(r, k)
        r.prefill.handle(a)
        out = r.prefill.tick(1)  # posts batch 1, due later
        for n in range(10**9, 10**9 + 60):  # the tick it was due at is skipped
            out += r.prefill.tick(n)
        assert _completed(out, a.grant)
        assert not r.prefill.busy()


def test_time_never_goes_back() -> None:
    with rig(0) as r:
        r.prefill.tick(100)
        out = r.prefill.tick(5)
        assert [wire.decode(f) for f in out] == [wire.TickDone(5)]
        assert r.prefill.now == 100 and r.prefill.counters["stale_ticks_refused"] == 1
        prefill_still_works(r)


def test_the_end_of_time() -> None:
    # The last tick the schema takes: the worker answers it, and every later one is stale.
    with rig(0) as r:
        r.prefill.handle(valid_assign(r, 3))
        for f in r.prefill.tick(INT64_MAX):
            _decode(f)
        assert r.prefill.tick(INT64_MAX)[-1] == wire.encode(wire.TickDone(INT64_MAX))
        assert r.prefill.tick(7)[-1] == wire.encode(wire.TickDone(7))
        r.prefill.handle(valid_assign(r, 4))
        assert r.prefill.counters["handler_failed"] == 0
    with pytest.raises(wire.MalformedMessage):
        wire.decode(wire.encode(wire.Tick(INT64_MAX + 1)))


def test_from_dict_extra_keys_of_mixed_types_are_malformed() -> None:
    # sorted() of str and int (or bytes) keys raised TypeError instead.
    extras: list[dict[object, object]] = [{1: "x", "b": 2}, {b"k": 1, "s": 2}]
    for extra in extras:
        data: dict[object, object] = {"type": "PeerLost", "peer": PEER, **extra}
        with pytest.raises(MalformedEvidence):
            from_dict(data, source=Source.peer(PEER))
