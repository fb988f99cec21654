"""Who may end a request (issue 20, items 6 and 8): every control message about a grant is acted
on only when it comes from that grant's peer on that grant's connection, and a message the
ledger refuses changes no harness bookkeeping either. Sans-IO: the workers are fed frames
directly, as their sockets would, with the connection's identity beside them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import pytest
from harness_helpers import QUIET as HARNESS_QUIET
from structlog.testing import capture_logs

from kvlifetime.adapters.inproc import InprocTarget
from kvlifetime.evidence import SchedulingStopped, TransferCompleted, TransferQuiesced
from kvlifetime.grant import GrantId
from kvlifetime.harness import wire
from kvlifetime.harness.owner import Ending
from kvlifetime.harness.pull_owner import SourceOwner
from kvlifetime.harness.push_owner import DecodeWorker
from kvlifetime.harness.settings import PullSettings, PushSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import RequestState

BB = 512
NBLOCKS = 256
QUIET = attrs.evolve(HARNESS_QUIET, tp_ranks=2)
RANKS = ["prefill-0/rank0", "prefill-0/rank1"]
NEXT = ["prefill-1/rank0", "prefill-1/rank1"]


@pytest.fixture
def decode() -> Iterator[DecodeWorker]:
    cfg = PushSettings(
        requests=8, arrivals_per_tick=4, block_bytes=BB, num_blocks=NBLOCKS, faults=QUIET
    )
    target = InprocTarget(NBLOCKS * BB)
    try:
        w = DecodeWorker(cfg, target, BlockLedger(NBLOCKS))
        yield w
    finally:
        target.close()


def _snapshot(w: DecodeWorker) -> dict[str, Any]:
    """Everything a refused message must leave as it was (the refusal counter aside)."""
    count = attrs.asdict(w.count)
    count.pop("unauthorized_refused")
    return {
        "count": count,
        "states": {k: w.ledger.state(k) for k in w.reqs},
        "reqs": {k: (r.ended, r.consumed, r.finished, r.last_news) for k, r in w.reqs.items()},
        "stats": attrs.asdict(w.ledger.stats()),
    }


def _admit(w: DecodeWorker, ranks: list[str], n: int = 0) -> None:
    w.tick_ranks(n, ranks, True)
    w.now = n + 1  # news after the admission tick: last_news would move if it were acted on


CONTROL = [
    pytest.param(lambda k, g: wire.Rejected(k, g, "over capacity"), id="rejected"),
    pytest.param(lambda k, g: wire.TransferFailed(k, g, 1), id="failed"),
]


@pytest.mark.parametrize("make", CONTROL)
@pytest.mark.parametrize(
    "sender",
    [
        "stranger",  # a connection no grant is to
        "prefill-1/rank0",  # another prefill (a later incarnation's name)
        RANKS[1],  # another tensor rank of the same request
    ],
)
def test_only_the_grants_peer_can_end_a_request(
    decode: DecodeWorker, make: Any, sender: str
) -> None:
    w = decode
    _admit(w, RANKS)
    key = min(w.reqs)
    g0 = w.reqs[key].grants[0].id  # rank 0's grant
    before = _snapshot(w)
    with capture_logs() as logs:
        w.receive([wire.encode(make(key, g0))], sender)
    assert _snapshot(w) == before  # nothing moved: not the request, not a counter
    assert w.ledger.state(key) is RequestState.ADMITTED and w.reqs[key].ended is None
    assert w.count.unauthorized_refused == 1
    refused = [e for e in logs if e["event"] == "message_refused"]
    assert [e["kind"] for e in refused] == [wire.UnauthorizedMessage.kind]
    assert refused[0]["sender"] == sender and refused[0]["log_level"] == "error"
    # The grant's own peer, on its own connection, is heard.
    w.receive([wire.encode(make(key, g0))], RANKS[0])
    assert w.reqs[key].ended is not None
    assert w.ledger.state(key) is RequestState.REJECTED
    assert w.count.unauthorized_refused == 1


@pytest.mark.parametrize("make", CONTROL)
def test_a_fenced_incarnation_can_end_nothing(decode: DecodeWorker, make: Any) -> None:
    w = decode
    _admit(w, RANKS)
    for rank in RANKS:
        w.fenced(rank, "test_fence")  # its requests end; it is heard no more
    _admit(w, NEXT, n=2)
    live = [k for k, r in w.reqs.items() if r.ended is None]
    assert live
    key = live[0]
    before = _snapshot(w)
    for fenced in RANKS:
        for g in w.reqs[key].grants:  # about the new incarnation's grants, and under its name
            w.receive([wire.encode(make(key, g.id))], fenced)
    assert _snapshot(w) == before
    assert w.count.unauthorized_refused == 2 * len(RANKS)


def test_a_message_about_a_grant_never_issued_acts_on_nothing(decode: DecodeWorker) -> None:
    w = decode
    _admit(w, RANKS)
    key = min(w.reqs)
    before = _snapshot(w)
    w.receive([wire.encode(wire.Rejected(key, GrantId("other", 1), "no"))], RANKS[0])
    after = _snapshot(w)
    assert after["count"].pop("unknown_refused") == before["count"].pop("unknown_refused") + 1
    assert after == before


# --------------------------------------------------------------------------- the pull owner

READER = "decode-0"
PULL_QUIET = attrs.evolve(QUIET, tp_ranks=1)


@pytest.fixture
def owner() -> Iterator[SourceOwner]:
    cfg = PullSettings(requests=4, block_bytes=BB, num_blocks=NBLOCKS, faults=PULL_QUIET)
    source = InprocTarget(NBLOCKS * BB)
    try:
        yield SourceOwner(cfg, source, BlockLedger(NBLOCKS))
    finally:
        source.close()


def _ev(ev: Any) -> bytes:
    return wire.encode(wire.EvidenceMsg(ev))


def test_a_refused_contradictory_stop_leaves_the_pull_owner_as_the_ledger_left_it(
    owner: SourceOwner,
) -> None:
    """A SchedulingStopped the ledger refuses (contradictory: another last_seq) used to
    overwrite the owner's ``stopped_at``; the true TransferQuiesced then never concluded the
    request. The owner follows the ledger's verdict."""
    o = owner
    o.tick(0, READER, True)
    key = min(o.reqs)
    g = o.reqs[key].grant
    o.receive([_ev(SchedulingStopped(g.id, key, READER, 1))], READER)
    r = o.reqs[key]
    assert r.stopped_at == 1 and r.outcome is Ending.ABORTED
    counts = attrs.asdict(o.count)
    o.receive([_ev(SchedulingStopped(g.id, key, READER, 3))], READER)  # refused: contradicts
    assert o.ledger.stats().refused_evidence.get("contradictory_evidence") == 1
    assert r.stopped_at == 1 and attrs.asdict(o.count) == counts  # nothing of the owner's moved
    o.receive([_ev(TransferQuiesced(g.id, key, READER, 1))], READER)
    assert r.concluded  # the ledger's view (the grant is closed) and the owner's agree
    assert not o.ledger.open_grants(key)


def test_a_refused_completion_after_a_stop_changes_no_outcome(owner: SourceOwner) -> None:
    o = owner
    o.tick(0, READER, True)
    key = min(o.reqs)
    g = o.reqs[key].grant
    o.receive([_ev(SchedulingStopped(g.id, key, READER, 1))], READER)
    counts = attrs.asdict(o.count)
    o.receive([_ev(TransferCompleted(g.id, key, READER, 2))], READER)  # refused: contradicts
    r = o.reqs[key]
    assert (r.outcome, r.concluded, r.stopped_at) == (Ending.ABORTED, False, 1)
    assert attrs.asdict(o.count) == counts


def test_the_pull_owner_hears_control_messages_only_from_the_grants_reader(
    owner: SourceOwner,
) -> None:
    o = owner
    o.tick(0, READER, True)
    key = min(o.reqs)
    g = o.reqs[key].grant
    before = attrs.asdict(o.count)
    pending = o.reader_pending
    frames = [
        wire.encode(wire.TransferFailed(key, g.id, 1)),
        wire.encode(wire.ReadsChecked(key, g.id, 1, (int(g.blocks[0]),), (1,))),
        wire.encode(wire.ReaderPending(0, 5)),
    ]
    o.receive(frames, "decode-1")
    after = attrs.asdict(o.count)
    assert after.pop("unauthorized_refused") == before.pop("unauthorized_refused") + 3
    assert after.pop("reads_refused") == before.pop("reads_refused") + 1
    assert after == before and o.reqs[key].outcome is None and o.reader_pending == pending
    o.receive(frames, READER)
    assert o.reqs[key].outcome is Ending.TRANSFER_FAILED and o.reader_pending == 5
    assert o.count.contaminated_blocks == 1  # the stale read: KV decode would compute from


# --------------------------------------------------------------------------- fenced connections
#
# A fenced connection's evidence goes to the ledger like any other, which refuses it (stale: the
# grant's request was released when the fence closed it; unauthorized: about another
# incarnation's grant), counts it in ``stats().refused_evidence`` and logs it; the worker's
# bookkeeping follows that verdict. Where the ledger has nothing to refuse (a grant the fence
# already closed, of a request still live: a no-op), the worker refuses it at the connection.


def _fenced_snapshot(w: DecodeWorker | SourceOwner) -> dict[str, Any]:
    """What fenced evidence must leave as it was (the refusal counters aside)."""
    count = attrs.asdict(w.count)
    count.pop("unauthorized_refused")
    stats = attrs.asdict(w.ledger.stats())
    stats.pop("refused_evidence")
    reqs = {k: attrs.asdict(r, recurse=False) for k, r in w.reqs.items()}
    for r in reqs.values():
        r.pop("plan", None)
    return {
        "count": count,
        "stats": stats,
        "fingerprint": w.ledger.fingerprint(),
        "reqs": {k: {n: repr(v) for n, v in r.items()} for k, r in reqs.items()},
    }


def _refusals(logs: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    return [
        (e["event"], e.get("error") if e["event"] == "evidence_refused" else e.get("kind"))
        for e in logs
        if e["event"] in ("evidence_refused", "message_refused")
    ]


def test_a_fenced_prefills_evidence_is_the_ledgers_to_refuse(decode: DecodeWorker) -> None:
    w = decode
    _admit(w, RANKS)
    done, gone = sorted(w.reqs)[:2]
    for g in w.reqs[done].grants:  # consumed: it decodes on, its grants closed
        w.receive([_ev(TransferCompleted.of(g, 1))], g.peer)
    assert w.reqs[done].consumed
    old = w.reqs[gone].grants[0]
    kept = w.reqs[done].grants[0]
    for rank in RANKS:
        w.fenced(rank, "test_fence")
    assert gone not in w.reqs and done in w.reqs  # released by the fence; still decoding
    _admit(w, NEXT, n=2)
    new_key = max(w.reqs)
    new = w.reqs[new_key].grants[0]
    assert new.peer == NEXT[0]
    before = _fenced_snapshot(w)
    frames = [
        _ev(TransferCompleted.of(old, 1)),  # its own grant, released: stale
        _ev(TransferCompleted.of(new, 1)),  # the next incarnation's, in its name: unauthorized
        _ev(TransferCompleted(new.id, new_key, RANKS[0], 1)),  # ... in its own: unauthorized
        _ev(TransferCompleted.of(kept, 1)),  # closed, request live: a no-op to the ledger
    ]
    with capture_logs() as logs:
        w.receive(frames, RANKS[0])
    assert w.ledger.stats().refused_evidence == {
        "stale_evidence": 1,
        "unauthorized_evidence": 2,
    }
    assert _refusals(logs) == [
        ("evidence_refused", "stale_evidence"),
        ("evidence_refused", "unauthorized_evidence"),
        ("evidence_refused", "unauthorized_evidence"),
        ("message_refused", wire.UnauthorizedMessage.kind),
    ]
    assert w.count.unauthorized_refused == 3  # the ledger's two, and the no-op at the connection
    assert _fenced_snapshot(w) == before  # nothing else moved: not a request, not a counter
    assert w.ledger.state(new_key) is RequestState.ADMITTED and not w.reqs[new_key].consumed


def test_a_fenced_readers_evidence_is_the_ledgers_to_refuse() -> None:
    cfg = PullSettings(
        requests=8, arrivals_per_tick=4, block_bytes=BB, num_blocks=NBLOCKS, faults=PULL_QUIET
    )
    source = InprocTarget(NBLOCKS * BB)
    try:
        o = SourceOwner(cfg, source, BlockLedger(NBLOCKS))
        o.tick(0, READER, True)
        first = sorted(o.reqs)
        live = o.reqs[first[1]].grant
        o.fenced(READER, "test_fence")  # before prefill ended them: their grants closed, live
        assert o.ledger.state(first[1]) is RequestState.ADMITTED and not o.ledger.open_grants(
            first[1]
        )
        before = _fenced_snapshot(o)
        with capture_logs() as logs:
            o.receive([_ev(TransferCompleted.of(live, 1))], READER)  # a no-op to the ledger
        assert o.ledger.stats().refused_evidence == {}
        assert _refusals(logs) == [("message_refused", wire.UnauthorizedMessage.kind)]
        assert o.count.unauthorized_refused == 1 and _fenced_snapshot(o) == before

        o.tick(1, "decode-1", True)  # prefill ends the first ones: released; the next admitted
        assert not o.ledger.stats().quarantined
        new_key = max(o.reqs)
        new = o.reqs[new_key].grant
        assert new.peer == "decode-1"
        before = _fenced_snapshot(o)
        frames = [
            _ev(TransferCompleted.of(live, 1)),  # its own grant, released: stale
            _ev(TransferCompleted.of(new, 1)),  # the next reader's, in its name: unauthorized
            _ev(TransferCompleted(new.id, new_key, READER, 1)),  # ... in its own: unauthorized
        ]
        with capture_logs() as logs:
            o.receive(frames, READER)
        assert o.ledger.stats().refused_evidence == {
            "stale_evidence": 1,
            "unauthorized_evidence": 2,
        }
        assert _refusals(logs) == [
            ("evidence_refused", "stale_evidence"),
            ("evidence_refused", "unauthorized_evidence"),
            ("evidence_refused", "unauthorized_evidence"),
        ]
        assert o.count.unauthorized_refused == 1 + 2  # the stale one is the ledger's alone
        assert _fenced_snapshot(o) == before
        assert o.reqs[new_key].outcome is None and o.ledger.open_grants(new_key)
    finally:
        source.close()
