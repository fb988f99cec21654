"""``StepLedger`` (the guard's step-columnar ledger) held to ``BlockLedger(counts="engine")``
call by call: the guard's step calls (a step's grants, READ grants on held blocks, ends, proofs,
lease expiries, fences, collects), with bad block ids among them, and ``BlockLedger``'s single
calls (every kind of evidence from every kind of source, about live, released, never-issued
and foreign grants; finishes and rejects of any key; deadlines and expiries); after each call
the same refusals, the same releases, the same state and open grants for every live request,
the same statistics."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_helpers import evidence_of

from kvlifetime.errors import (
    BlockOutOfRange,
    DuplicateBlockIds,
    IllegalTransition,
    InvalidBlockIds,
    InvalidField,
    MalformedEvidence,
    UnknownGrant,
    UnknownRequest,
)
from kvlifetime.evidence import AccessRevoked, Evidence, LeaseExpired, TransferCompleted
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.ledger import BlockLedger, StepLedger
from kvlifetime.source import Source
from kvlifetime.spec.proof import CODE_OF
from kvlifetime.spec.vocabulary import RequestState

ids = st.one_of(
    st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
    st.lists(st.integers(0, 11), min_size=2, max_size=4),  # repeats, sometimes
    st.lists(st.sampled_from([-1, 12, 99, 2**64]), min_size=1, max_size=2),  # out of range
    st.lists(st.sampled_from([True, 1.0, "3", None]), min_size=1, max_size=2),  # not ints
)
request = st.integers(0, 12).map(lambda i: f"r{i}")
op = st.one_of(
    st.tuples(
        st.just("grant_many"),
        st.lists(st.tuples(request, ids), min_size=1, max_size=4),
        st.sampled_from([Access.READ, Access.WRITE]),
    ),
    st.tuples(st.just("grant_read"), request, ids),
    st.tuples(st.just("end_many"), st.lists(request, min_size=1, max_size=3), st.booleans()),
    st.tuples(
        st.just("prove"),
        st.lists(st.integers(0, 30), min_size=1, max_size=4),
        st.sampled_from(["completed", "lease", "revoked"]),
    ),
    st.tuples(st.just("collect")),
    # BlockLedger's single calls, each a batch of one on the rows
    st.tuples(
        st.just("apply"),
        st.integers(0, 30),
        st.sampled_from(sorted(CODE_OF.values())),
        st.integers(0, 3),
        st.sampled_from(["local", "own", "other", "spoof", "stale", "foreign"]),
    ),
    st.tuples(st.just("single_end"), request, st.booleans()),
    st.tuples(
        st.just("acquire_and_grant"), request, ids, st.sampled_from([Access.READ, Access.WRITE])
    ),
    st.tuples(st.just("set_deadline"), request, st.sampled_from([None, 2.0, 5.0])),
    st.tuples(st.just("expire"), st.sampled_from([1.0, 3.0, 6.0])),
)


class Pair:
    def __init__(self) -> None:
        self.rows = StepLedger(16, incarnation="same")
        self.objs = BlockLedger(16, counts="engine", incarnation="same")
        self.issued: list[tuple[int, Grant]] = []  # (handle, the object ledger's grant)

    def grant_many(self, items: list[tuple[str, list[Any]]], access: Access) -> None:
        got = self.rows.grant_many(items, "peer", access)
        outcome = self.objs.acquire_and_grant_many([(r, i, "peer", access) for r, i in items])
        refused = {r.position: r.error for r in outcome.refused}
        grants = iter(outcome.grants)
        for i, handle in enumerate(got):
            if i in refused:
                assert type(handle) is type(refused[i]), (handle, refused[i])
            else:
                assert isinstance(handle, int), handle
                self.issued.append((handle, next(grants)))

    def grant_read(self, key: str, block_ids: list[Any]) -> None:
        try:
            handle: int | Exception = self.rows.grant_read(key, block_ids, "peer")
        except Exception as e:
            handle = e
        try:
            held: Any = self.objs.blocks_of(key) if key in self.objs.live_requests() else []
            arr = np.array(block_ids)
            new = np.setdiff1d(arr, held) if arr.dtype.kind == "i" else arr
            if len(new):
                self.objs.acquire(key, new)
            grant: Grant | Exception = self.objs.grant(key, "peer", block_ids, Access.READ)
        except Exception as e:
            grant = e
        if isinstance(grant, Exception):
            assert isinstance(handle, Exception), (handle, grant)
            # The object ledger may have held the new blocks before its grant was refused; the
            # rows' call is all or nothing: they agree again after the object ledger lets go.
            assert type(handle) is type(grant) or isinstance(grant, UnknownRequest), (
                handle,
                grant,
            )
        else:
            assert isinstance(handle, int), (handle, grant)
            self.issued.append((handle, grant))

    def end_many(self, keys: list[str], aborted: bool) -> None:
        got = self.rows.end_many(keys, aborted=aborted)
        outcome = (
            self.objs.reject_many(keys, reason="aborted")
            if aborted
            else self.objs.finish_many(keys)
        )
        assert [(i, type(e)) for i, e in got] == [
            (r.position, type(r.error)) for r in outcome.refused
        ]

    def prove(self, picks: list[int], claim: str) -> None:
        live = [
            (h, g)
            for h, g in self.issued
            if g.request in self.objs.live_requests() and self.rows.grant(h).id == g.id
        ]
        if not live:
            return
        chosen = [live[p % len(live)] for p in picks]
        chosen = list({h: (h, g) for h, g in chosen}.values())  # a grant once per batch
        handles = [h for h, _ in chosen]
        if claim == "completed":
            refused = self.rows.prove(handles, TransferCompleted)
            evidence: list[Any] = [TransferCompleted.of(g, 0) for _, g in chosen]
        elif claim == "lease":
            refused = self.rows.prove(handles, LeaseExpired)
            evidence = [LeaseExpired.of(g) for _, g in chosen]
        else:
            refused = self.rows.prove(handles, AccessRevoked, fence="f1")
            evidence = [AccessRevoked.of(g, fence="f1") for _, g in chosen]
        outcome = self.objs.apply_many(evidence)
        assert refused == [r.position for r in outcome.refused]

    def apply(self, pick: int, code: int, seq: int, how: str) -> None:
        """One piece of evidence about an issued grant (its request maybe released), from the
        local side, its own peer, a peer speaking for another, a peer about another's grant,
        about a serial never issued, or from another incarnation: the same refusal type, or
        none, from both."""
        if not self.issued:
            return
        _, g = self.issued[pick % len(self.issued)]
        ev = evidence_of(code, g, seq)
        if how == "own":
            ev = attrs.evolve(ev, source=Source.peer(g.peer))
        elif how == "other":  # a peer speaking for another
            ev = attrs.evolve(ev, source=Source.peer("someone-else"))
        elif how == "spoof":  # a peer speaking for itself about another peer's grant
            ev = attrs.evolve(ev, peer="someone-else", source=Source.peer("someone-else"))  # type: ignore[call-arg]
        elif how == "stale" and hasattr(ev, "grant_id") and ev.grant_id is not None:
            ev = attrs.evolve(ev, grant_id=GrantId("same", 10_000))  # type: ignore[call-arg]
        elif how == "foreign" and hasattr(ev, "grant_id") and ev.grant_id is not None:
            ev = attrs.evolve(ev, grant_id=GrantId("elsewhere", g.id.serial))  # type: ignore[call-arg]
        got = _raised(lambda: self.rows.apply(ev))
        want = _raised(lambda: self.objs.apply(ev))
        assert type(got) is type(want), (ev, got, want)

    def acquire_and_grant(self, key: str, block_ids: list[Any], access: Access) -> None:
        try:
            handle: int | Exception = self.rows.acquire_and_grant(key, block_ids, "peer", access)
        except Exception as e:
            handle = e
        try:
            grant: Grant | Exception = self.objs.acquire_and_grant(key, block_ids, "peer", access)
        except Exception as e:
            grant = e
        if isinstance(grant, Exception):
            assert type(handle) is type(grant), (handle, grant)
        else:
            assert isinstance(handle, int), (handle, grant)
            assert self.rows.grant(handle).describe() == grant.describe()
            self.issued.append((handle, grant))

    def single_end(self, key: str, aborted: bool) -> None:
        if aborted:
            got = _raised(lambda: self.rows.reject(key, "aborted"))
            want = _raised(lambda: self.objs.reject(key, "aborted"))
        else:
            got = _raised(lambda: self.rows.finish(key))
            want = _raised(lambda: self.objs.finish(key))
        assert type(got) is type(want), (got, want)

    def set_deadline(self, key: str, deadline: float | None) -> None:
        got = _raised(lambda: self.rows.set_deadline(key, deadline))
        want = _raised(lambda: self.objs.set_deadline(key, deadline))
        assert type(got) is type(want), (got, want)

    def expire(self, now: float) -> None:
        assert self.rows.expire(now) == self.objs.expire(now)

    def collect(self) -> None:
        got = self.rows.collect()
        want = self.objs.collect_releasable()
        assert list(got) == list(want)
        for key, arr in want.items():
            assert sorted(got[key].tolist()) == sorted(arr.tolist())

    def check(self) -> None:
        rows, objs = self.rows, self.objs
        assert sorted(rows.live_requests()) == sorted(objs.live_requests())  # type: ignore[type-var]
        for key in objs.live_requests():
            assert rows.state(key) is objs.state(key)
            assert [g.describe() for g in rows.open_grants(key)] == [
                g.describe() for g in objs.open_grants(key)
            ]
            assert sorted(rows.blocks_of(key).tolist()) == sorted(objs.blocks_of(key).tolist())
            assert rows.unproven(key) == objs.unproven(key)
        a, b = rows.stats(), objs.stats()
        assert a.blocks_by_state == b.blocks_by_state
        assert a.requests_by_state == b.requests_by_state
        assert a.open_grants == b.open_grants
        assert a.reclaimed_blocks == b.reclaimed_blocks
        assert a.refused_evidence == b.refused_evidence
        assert [(q.request, q.blocks, q.reason, q.since) for q in a.quarantined] == [
            (q.request, q.blocks, q.reason, q.since) for q in b.quarantined
        ]
        every = np.arange(16)
        assert rows.open_access(every).tolist() == objs.open_access(every).tolist()
        assert rows.block_state(every).tolist() == objs.block_state(every).tolist()
        assert rows.free_count() == objs.free_count()


def _raised(call: Any) -> BaseException | None:
    try:
        call()
    except Exception as e:
        return e
    return None


@settings(max_examples=600, deadline=None)
@given(st.lists(op, min_size=1, max_size=30))
def test_the_step_ledger_keeps_the_object_ledgers_semantics(ops: list[tuple[Any, ...]]) -> None:
    pair = Pair()
    for name, *args in ops:
        if name == "grant_read":
            key, block_ids = args
            # Only where the object ledger's acquire-then-grant is all or nothing too (the
            # guard reads on a running request whose blocks are valid).
            if key not in pair.objs.live_requests():
                continue
            if any(type(b) is not int or not 0 <= b < 16 for b in block_ids):
                continue
            if len(set(block_ids)) != len(block_ids):
                continue
        getattr(pair, name)(*args)
        pair.check()


@pytest.mark.parametrize(
    ("block_ids", "error"),
    [
        ([1, 1], DuplicateBlockIds),
        ([16], BlockOutOfRange),
        ([-1], BlockOutOfRange),
        ([2**70], BlockOutOfRange),
        ([True], InvalidBlockIds),
        ([1.0], InvalidBlockIds),
    ],
)
def test_bad_block_ids_in_a_step_are_refused_for_their_request_only(
    block_ids: list[Any], error: type[Exception]
) -> None:
    led = StepLedger(16)
    out = led.grant_many([("a", [0, 1]), ("b", block_ids), ("c", [2])], "p", Access.READ)
    assert isinstance(out[0], int) and isinstance(out[2], int)
    assert isinstance(out[1], error)
    assert sorted(led.live_requests()) == ["a", "c"]  # type: ignore[type-var]
    assert led.stats().open_grants == 2


def test_a_grant_is_built_only_when_asked_and_says_what_the_row_holds() -> None:
    led = StepLedger(16, incarnation="inc")
    (handle,) = led.grant_many([("a", [3, 4])], "p", Access.WRITE)
    assert isinstance(handle, int)
    g = led.grant(handle)
    assert g.id.incarnation == "inc" and g.request == "a" and g.peer == "p"
    assert g.access is Access.WRITE and g.blocks.tolist() == [3, 4]
    assert not g.blocks.flags.writeable and not g.generations.flags.writeable
    assert led.open_access([3, 4, 5]).tolist() == [2, 2, 0]


def test_a_read_grant_with_bad_ids_is_refused_and_changes_nothing() -> None:
    led = StepLedger(16)
    led.grant_many([("a", [0])], "p", Access.WRITE)
    before = (led.blocks_of("a").tolist(), led.stats())
    for bad, error in (([0, 1, 1], DuplicateBlockIds), ([1, 16], BlockOutOfRange)):
        with pytest.raises(error):
            led.grant_read("a", bad, "p")
        assert (led.blocks_of("a").tolist(), led.stats()) == before
    led.end_many(["a"], aborted=True)
    before = (led.blocks_of("a").tolist(), led.stats())
    with pytest.raises(IllegalTransition):  # ended: no new exposure
        led.grant_read("a", [1], "p")
    assert (led.blocks_of("a").tolist(), led.stats()) == before
    led.grant_read("new", [1], "p")  # as BlockLedger's acquire: a new request is admitted
    assert led.state("new") is RequestState.ADMITTED
    with pytest.raises(UnknownRequest):
        led.state("nobody")


def test_a_handle_that_is_not_a_live_grants_is_refused() -> None:
    led = StepLedger(16)
    (h,) = led.grant_many([("a", [0])], "p", Access.READ)
    assert isinstance(h, int) and led.grant(h).request == "a"
    led.end_many(["a"], aborted=False)
    led.prove([h], TransferCompleted)
    assert list(led.collect()) == ["a"]
    for bad in (h, -1, 99, "0", None, True):  # released, out of range, not an int
        with pytest.raises(UnknownGrant):
            led.grant(bad)  # type: ignore[arg-type]


def test_evidence_of_no_known_kind_and_bad_peers_are_typed_refusals() -> None:
    led = StepLedger(16)
    before = led.fingerprint()
    with pytest.raises(MalformedEvidence):
        led.apply(Evidence())
    with pytest.raises(MalformedEvidence):
        led.apply("TransferCompleted")  # type: ignore[arg-type]
    for peer in (["x"], "", 5):
        with pytest.raises(InvalidField):
            led.grant_many([("a", [0])], peer, Access.READ)  # type: ignore[arg-type]
        with pytest.raises(InvalidField):
            led.grant_read("a", [0], peer)  # type: ignore[arg-type]
    assert led.fingerprint() == before
    assert led.stats().refused_evidence == {"malformed_evidence": 2}
