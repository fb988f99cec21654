"""``StepRows`` (the step-columnar ledger's requests and grants, issue 32) held to the
object-per-request ``BlockLedger`` step by step: the same requests and grants, the same evidence
in the same batches, the same ends, expiries and collects; after each step the same state for
every live request, the same open grants, the same refusals, the same transitions per request
and the same releases in the same order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_helpers import evidence_of

from kvlifetime.errors import (
    BlockUnavailable,
    ContradictoryEvidence,
    InsufficientEvidence,
    KVLifetimeError,
)
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    PeerLost,
    TransferCompleted,
)
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.ledger import BlockLedger
from kvlifetime.ledger.block_rows import READ, WRITE, BlockRows
from kvlifetime.ledger.request_rows import EVENTS, STATES, Moves
from kvlifetime.ledger.step_rows import StepRows
from kvlifetime.spec.proof import CODE_OF

blocks = st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True).map(sorted)
access = st.sampled_from([Access.READ, Access.WRITE])
peers = st.sampled_from(["pa", "pb", "pc"])  # shared: PeerLost and fences name several grants
op = st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 40), blocks, st.sampled_from([None, 5.0, 10.0])),
    st.tuples(st.just("acquire_and_grant"), st.integers(0, 40), blocks, access, peers),
    st.tuples(
        st.just("grant"),
        st.integers(0, 30),
        st.integers(1, 4),
        access,
        peers,
        st.sampled_from([None, 3.0, 7.0]),
    ),
    st.tuples(st.just("revoke_peer"), peers),
    st.tuples(st.just("force_release"), st.integers(0, 30)),
    st.tuples(st.just("set_deadline"), st.integers(0, 30), st.sampled_from([None, 5.0, 8.0])),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("stale"), st.integers(0, 60), st.integers(1, 7)),
    st.tuples(
        st.just("prove"),
        st.integers(1, 7),
        st.lists(st.tuples(st.integers(0, 60), st.integers(0, 3)), min_size=1, max_size=6),
    ),
    st.tuples(
        st.just("end"),
        st.sampled_from(["rejected", "finished"]),
        st.lists(st.integers(0, 30), min_size=1, max_size=4),
    ),
    st.tuples(st.just("expire"), st.sampled_from([4.0, 6.0, 11.0])),
    st.tuples(st.just("collect")),
)

_ACCESS = {Access.READ: READ, Access.WRITE: WRITE}


class Pair:
    """The object ledger and the columns, driven alike."""

    def __init__(self) -> None:
        self.led = BlockLedger(16, counts="engine", incarnation="rows")
        self.cols = StepRows(16)
        self.keys: list[str] = []  # every request key ever used, in order of first use
        self.grants: list[tuple[Grant, int]] = []  # every grant ever made: (object, row)

    def live(self) -> list[str]:
        return [k for k in self.keys if k in self.cols.slot_of]

    def _key(self, pick: int) -> str:
        """An earlier key (live or released), or a new one."""
        if pick < len(self.keys) and pick % 3:
            return self.keys[pick]
        key = f"r{len(self.keys)}"
        self.keys.append(key)
        return key

    def both(self, obj: Callable[[], Any], cols: Callable[[], Any]) -> tuple[Any, Any]:
        """Each side's result, or the type of the error it raised: the same on both."""
        try:
            a: Any = obj()
        except KVLifetimeError as e:
            a = type(e)
        try:
            b: Any = cols()
        except KVLifetimeError as e:
            b = type(e)
        assert (a if isinstance(a, type) else None) == (b if isinstance(b, type) else None)
        return a, b

    def acquire(self, pick: int, ids: list[int], deadline: float | None) -> None:
        key, arr = self._key(pick), _ids(ids)
        self.both(
            lambda: self.led.acquire(key, arr, deadline=deadline),
            lambda: self.cols.acquire(key, arr, deadline),
        )

    def acquire_and_grant(self, pick: int, ids: list[int], acc: Access, peer: str) -> None:
        key, arr = self._key(pick), _ids(ids)
        g, row = self.both(
            lambda: self.led.acquire_and_grant(key, arr, peer, acc),
            lambda: self.cols.acquire_and_grant(key, arr, _ACCESS[acc], None, peer),
        )
        if not isinstance(g, type):
            assert g.id.serial == self.cols.grants.serial[row]  # the same serials, in order
            self.grants.append((g, row))

    def grant(self, pick: int, n: int, acc: Access, peer: str, deadline: float | None) -> None:
        live = self.live()
        if not live:
            return
        key = live[pick % len(live)]
        held = self.led.blocks_of(key)
        arr = _ids(sorted(held.tolist())[:n]) if len(held) else _ids([0])
        g, row = self.both(
            lambda: self.led.grant(key, peer, arr, acc, deadline=deadline),
            lambda: self.cols.grant_on(key, arr, _ACCESS[acc], peer, deadline),
        )
        if not isinstance(g, type):
            self.grants.append((g, row))

    def prove(self, code: int, picks: list[tuple[int, int]]) -> None:
        # Grants of live requests: by serial (a key released and used again is a new request,
        # and its old grants are stale: the ``stale`` step drives those).
        live = self.cols.grants.row_of_serial
        usable = [(g, r) for g, r in self.grants if g.id.serial in live]
        if not usable:
            return
        if code == CODE_OF[PeerLost]:  # about a peer: every open grant of it
            g, _ = usable[picks[0][0] % len(usable)]
            outcome = self.led.apply_many([PeerLost(g.peer)])
            moves: Moves = []
            self.cols.prove_peer(g.peer, code, None, moves)
            assert not outcome.refused
            self.same_moves(outcome.transitions, moves)
            return
        chosen: dict[int, tuple[Grant, int, int]] = {}
        for pick, seq in picks:
            g, r = usable[pick % len(usable)]
            chosen.setdefault(r, (g, r, seq))  # distinct grants in one batch
        items = list(chosen.values())
        outcome = self.led.apply_many([evidence_of(code, g, seq) for g, _, seq in items])
        moves = []
        refused = self.cols.prove(
            [r for _, r, _ in items], code, [s for _, _, s in items], moves, fence="f"
        )
        assert all(isinstance(x.error, ContradictoryEvidence) for x in outcome.refused)
        assert refused == [x.position for x in outcome.refused]
        self.same_moves(outcome.transitions, moves)

    def stale(self, pick: int, code: int) -> None:
        """Evidence about any grant ever made (its request maybe released), or about one never
        issued: the object ledger refuses it or not, with the same error, as the rows' lookup
        by serial does."""
        if not self.grants:
            return
        g, _ = self.grants[pick % len(self.grants)]
        if pick % 5 == 0:  # a serial not issued yet, in this ledger's incarnation
            unissued = GrantId("rows", self.cols.grants.next_serial + 3)
            g = Grant(unissued, g.request, g.peer, g.blocks, g.generations, g.access)
        ev = evidence_of(code, g, 0)
        if isinstance(ev, PeerLost):
            return  # about a peer, not a grant
        outcome = self.led.apply_many([ev])
        (got,) = self.cols.rows_of([g.id.serial], [g.request], [g.peer])
        if isinstance(got, KVLifetimeError):
            assert [type(r.error) for r in outcome.refused] == [type(got)]
            return
        assert not outcome.refused or isinstance(outcome.refused[0].error, ContradictoryEvidence)
        moves: Moves = []
        refused = self.cols.prove([got], code, [0], moves, fence="f")
        assert refused == [r.position for r in outcome.refused]
        self.same_moves(outcome.transitions, moves)

    def revoke_peer(self, peer: str) -> None:
        fired = self.led.apply(AccessRevoked(peer, fence=f"fence-{peer}"))
        moves: Moves = []
        self.cols.prove_peer(peer, CODE_OF[AccessRevoked], f"fence-{peer}", moves)
        self.same_moves(fired, moves)

    def force_release(self, pick: int) -> None:
        if not self.keys:
            return
        key = self.keys[pick % len(self.keys)]
        a, b = self.both(
            lambda: self.led.force_release(key, "test"),
            lambda: self.cols.force_release(key, []),
        )
        if not isinstance(a, type):
            assert sorted(a.tolist()) == sorted(b.tolist())

    def set_deadline(self, pick: int, deadline: float | None) -> None:
        live = self.live()
        if live:
            key = live[pick % len(live)]
            self.led.set_deadline(key, deadline)
            self.cols.set_deadline(key, deadline)

    def end(self, event: str, picks: list[int]) -> None:
        if not self.keys:
            return
        # Any key ever used: live ones, and released ones (DoubleRelease on both).
        keys = list(dict.fromkeys(self.keys[p % len(self.keys)] for p in picks))
        refused_obj = []
        fired: list[Any] = []
        for i, key in enumerate(keys):
            try:
                fired += self.led.reject(key) if event == "rejected" else self.led.finish(key)
            except KVLifetimeError as e:
                refused_obj.append((i, type(e)))
        moves: Moves = []
        refused = self.cols.end(keys, event, moves)
        assert [(i, type(e)) for i, e in refused] == refused_obj
        self.same_moves(fired, moves)

    def release(self, pick: int) -> None:
        if not self.keys:
            return
        key = self.keys[pick % len(self.keys)]
        a, b = self.both(lambda: self.led.release(key), lambda: self.cols.release(key, []))
        if a is InsufficientEvidence:
            assert self.led.unproven(key) == self.cols.unproven(key)
        elif not isinstance(a, type):
            assert sorted(a.tolist()) == sorted(b.tolist())

    def expire(self, now: float) -> None:
        assert self.led.expire(now) == self.cols.expire(now, [])

    def collect(self) -> None:
        obj = self.led.collect_releasable()
        cols = self.cols.collect([])
        assert list(obj) == list(cols)
        for key, ids in obj.items():
            assert sorted(ids.tolist()) == sorted(cols[key].tolist()), key

    def same_moves(self, fired: Any, moves: Moves) -> None:
        obj: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for t in fired:
            obj[t.request].append((t.event, t.target))
        got: dict[Hashable, list[tuple[str, str]]] = defaultdict(list)
        for slot, event, target in moves:
            got[self.cols.key_of[slot]].append((EVENTS[event], STATES[target]))
        assert dict(got) == dict(obj)

    def check(self) -> None:
        live = self.led._table.requests  # (the object ledger's own table: what it holds)
        assert sorted(self.live()) == sorted(live)
        for key in self.live():
            assert self.cols.state(key) == self.led.state(key).value, key
            assert len(self.cols.open_rows(key)) == len(self.led.open_grants(key)), key
        assert self.led.stats().unsafe_releases == self.cols.unsafe_releases
        for key in self.live():
            fenced = self.cols.fenced_by.get(self.cols.slot_of[key])
            assert live[key].fenced_by == fenced, key
        counts, rows = self.led._blocks, self.cols.blocks
        for name in ("sharers", "unsettled", "readers", "generation"):
            assert getattr(counts, name).tolist() == getattr(rows, name).tolist(), name
        for slot, reason in self.cols.quarantine_reason.items():
            key = str(self.cols.key_of[slot])
            if self.cols.state(key) == "quarantined":
                assert live[key].quarantine_reason == reason, key


@settings(max_examples=1500, deadline=None)
@given(st.lists(op, max_size=60))
def test_the_columns_step_as_the_ledger_does(ops: list[tuple[Any, ...]]) -> None:
    pair = Pair()
    for o in ops:
        name, *args = o
        getattr(pair, name)(*args)
        pair.check()


def test_a_step_of_many_requests_releases_them_in_the_order_they_were_proven() -> None:
    pair = Pair()
    for i in range(3):
        pair.acquire_and_grant(99, [i], Access.READ, "pa")  # three new requests
    pair.end("finished", [0, 1, 2])
    code = CODE_OF[TransferCompleted]
    pair.prove(code, [(2, 1), (0, 1), (1, 1)])  # the third request's grant first
    pair.check()
    assert list(pair.cols.collect([])) == ["r2", "r0", "r1"]


@pytest.mark.parametrize("n", [1, 64])
def test_rows_and_slots_are_reused_after_a_release(n: int) -> None:
    cols = StepRows()
    for round_ in range(3):
        keys = [f"r{round_}-{i}" for i in range(n)]
        rows = cols.grant(cols.admit(keys))
        moves: Moves = []
        assert cols.end(keys, "finished", moves) == []
        assert cols.prove(rows, CODE_OF[TransferCompleted], [0] * n, moves) == []
        assert list(cols.collect(moves)) == keys
    assert len(cols.key_of) == n and len(cols.grants.req) == n  # reused, not grown


def _ids(ids: list[int]) -> npt.NDArray[np.int64]:
    arr = np.array(ids, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def test_a_step_of_new_requests_is_granted_as_one_by_one() -> None:
    """``acquire_and_grant_many``'s one-call path (new requests, distinct blocks) leaves the
    rows as the one-by-one calls do; a batch that cannot take it is taken one by one."""
    one, many = StepRows(32), StepRows(32)
    keys = ["a", "b", "c"]
    allids = _ids([0, 1, 2, 3, 4, 5])
    rows = [one.acquire_and_grant(k, allids[2 * i : 2 * i + 2], READ) for i, k in enumerate(keys)]
    assert many.acquire_and_grant_many(keys, allids, [2, 2, 2], READ) == rows
    for name in ("sharers", "unsettled", "readers", "generation"):
        assert getattr(one.blocks, name).tolist() == getattr(many.blocks, name).tolist()
    assert [many.held[many.slot_of[k]][0].tolist() for k in keys] == [[0, 1], [2, 3], [4, 5]]
    # A write grant over a block "a" holds: refused on its own, the others granted.
    out = many.acquire_and_grant_many(["d", "e"], _ids([9, 1]), [1, 1], WRITE)
    assert isinstance(out[0], int) and isinstance(out[1], BlockUnavailable)


def test_distinct_tells_a_repeat_anywhere() -> None:
    rows = BlockRows(8)
    assert rows.distinct(_ids([0, 3, 5])) and rows.distinct(_ids([]))
    assert not rows.distinct(_ids([0, 3, 0])) and not rows.distinct(_ids([7, 1, 2, 1]))
    assert rows.distinct(_ids([1, 2]))  # an earlier call's stamps do not matter


def test_an_overdue_ended_request_is_quarantined_by_expire_on_both() -> None:
    pair = Pair()
    pair.acquire(99, [0], 5.0)  # r0: a request-wide deadline
    pair.grant(0, 1, Access.READ, "pa", None)
    pair.acquire(99, [1], None)  # r1: its grant's own deadline
    pair.grant(1, 1, Access.READ, "pb", 3.0)
    pair.acquire(99, [2], None)  # r2: a deadline set later
    pair.grant(2, 1, Access.READ, "pc", None)
    pair.set_deadline(2, 4.0)
    pair.end("rejected", [0, 1, 2])
    moves: Moves = []
    assert pair.cols.expire(6.0, moves) == pair.led.expire(6.0) == ["r0", "r1", "r2"]
    pair.check()
    assert {pair.cols.quarantine_reason[pair.cols.slot_of[k]] for k in ["r0", "r1", "r2"]} == {
        "deadline"
    }
    # The fence ends it: released on both, in the same order.
    for peer in ("pc", "pa", "pb"):
        pair.revoke_peer(peer)
    pair.check()
    pair.collect()


def test_the_holder_limit_is_kept_as_the_ledger_keeps_it() -> None:
    """A block at the holder limit is held by no one more: ``HolderLimit``, nothing changed,
    on both (a limit of 2 here; the real one is the uint16 counter's)."""
    from kvlifetime.errors import HolderLimit
    from kvlifetime.ledger.engine_counts import EngineCounts

    led = BlockLedger(8, counts="engine")
    led._blocks = EngineCounts(8, max_sharers=2)  # (the ledger's own counts, limited)
    cols = StepRows(8, max_sharers=2)
    for key in ("a", "b"):
        led.acquire(key, [3])
        cols.acquire(key, _ids([3]))
    with pytest.raises(HolderLimit):
        led.acquire("c", [3])
    with pytest.raises(HolderLimit):
        cols.acquire("c", _ids([3]))
    assert led._blocks.sharers.tolist() == cols.blocks.sharers.tolist()
    assert "c" not in cols.slot_of
    out = cols.acquire_and_grant_many(["c", "d"], _ids([3, 4]), [1, 1], READ)
    assert isinstance(out[0], HolderLimit) and isinstance(out[1], int)


def test_evidence_about_a_released_grant_is_stale_on_both() -> None:
    pair = Pair()
    pair.acquire_and_grant(99, [0], Access.READ, "pa")
    pair.end("finished", [0])
    pair.prove(CODE_OF[TransferCompleted], [(0, 0)])
    pair.collect()
    assert not pair.live()
    for code in (CODE_OF[TransferCompleted], CODE_OF[CancelReceived], CODE_OF[AccessRevoked]):
        pair.stale(1, code)  # the released grant: StaleEvidence on both
        (got,) = pair.cols.rows_of([1], ["r0"], ["pa"])
        assert type(got).__name__ == "StaleEvidence"
    pair.check()


def test_a_key_used_again_after_its_release_is_a_new_request() -> None:
    """(Found by the generated runs.) The old request's grant is stale for both, though a live
    request has its key again: the steps only prove grants live by serial."""
    pair = Pair()
    for o in [("acquire", 0, [0], None), ("acquire_and_grant", 0, [0], Access.READ, "pa"),
              ("revoke_peer", "pa"), ("acquire", 0, [0], None), ("end", "rejected", [1]),
              ("collect",), ("acquire", 1, [0], None), ("prove", 1, [(0, 0)]),
              ("stale", 0, CODE_OF[CancelReceived])]:  # fmt: skip
        getattr(pair, str(o[0]))(*o[1:])
        pair.check()
    assert pair.live() == ["r0", "r1", "r2"] and not pair.cols.open_rows("r1")
