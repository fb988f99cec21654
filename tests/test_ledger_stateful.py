"""Property-based tests of BlockLedger.

- a differential test: the ledger's derived ``block_state`` of one block against the
  ``BlockLifecycle`` specification machine, through random single-holder histories;
- a hypothesis ``RuleBasedStateMachine`` driving the ledger with adversarial evidence (stale,
  mismatched, duplicated, reordered, contradictory) against an independent shadow model, with the
  safety invariants checked after every step; run again with ``checked=True``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvlifetime import errors
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, Grant, GrantId, RequestKey
from kvlifetime.ledger import BlockLedger, Counts
from kvlifetime.spec.lifecycles import BlockLifecycle
from kvlifetime.spec.vocabulary import BlockState, RequestState

# =========================================================================== differential


@dataclasses.dataclass
class BlockFactsModel:
    """``spec.vocabulary.BlockFacts`` for the one block under test, counted after each event."""

    holders: int = 0
    live_holders: int = 0
    open_grants: int = 0
    open_write_grants: int = 0


OPS = ("acquire", "grant_w", "grant_r", "partial", "close", "lease", "end", "lost", "free")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_block_state_agrees_with_block_lifecycle_spec(data: st.DataObject) -> None:
    checked = data.draw(st.booleans(), label="checked")
    L = BlockLedger(1, checked=checked, incarnation="diff")
    facts = BlockFactsModel()
    spec = BlockLifecycle(facts)
    req: RequestKey | None = None
    serial = 0
    grants: dict[int, Grant] = {}  # open grants of the current holder
    stopped: set[int] = set()
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        state = L.state(req) if req is not None else None
        running = state is RequestState.ADMITTED
        ops = []
        if req is None:
            ops.append("acquire")
        if running:
            ops += ["grant_w", "grant_r", "end"]
        if grants:
            ops += ["partial", "close", "lease", "lost"]
        if state is not None and state is not RequestState.ADMITTED:
            ops.append("free")
        if not ops:
            break
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "acquire":
            serial += 1
            req = f"r{serial}"
            L.acquire(req, [0])
            facts.holders, facts.live_holders = 1, 1
            spec.send("acquired")
        elif op in ("grant_w", "grant_r"):
            assert req is not None
            access = Access.WRITE if op == "grant_w" else Access.READ
            g = L.grant(req, f"peer{len(grants) % 2}", [0], access)
            grants[g.id.serial] = g
            facts.open_grants += 1
            facts.open_write_grants += access is Access.WRITE
            spec.send("exposed")
        elif op == "partial":
            g = grants[data.draw(st.sampled_from(sorted(grants)), label="grant")]
            L.apply(SchedulingStopped.of(g, 1))
            stopped.add(g.id.serial)
        elif op == "close":
            g = grants.pop(data.draw(st.sampled_from(sorted(grants)), label="grant"))
            was_quarantined = L.state(g.request) is RequestState.QUARANTINED
            if g.id.serial in stopped:
                L.apply(TransferQuiesced.of(g, 1))
            else:
                L.apply(TransferCompleted.of(g, 1))
            facts.open_grants -= 1
            facts.open_write_grants -= g.access is Access.WRITE
            spec.send("grant_closed")
            assert was_quarantined or L.state(g.request) is not RequestState.QUARANTINED
        elif op in ("lease", "lost"):
            assert req is not None
            g = grants[data.draw(st.sampled_from(sorted(grants)), label="grant")]
            before = L.state(req)
            L.apply(LeaseExpired.of(g) if op == "lease" else PeerLost(g.peer))
            after = L.state(req)
            if after is RequestState.QUARANTINED and before is not RequestState.QUARANTINED:
                spec.send("quarantined")
            else:
                assert after is before
        elif op == "end":
            assert req is not None
            if data.draw(st.booleans(), label="reject"):
                L.reject(req)
            else:
                L.finish(req)
            facts.live_holders = 0
            spec.send("holder_ended")
            if L.state(req) is RequestState.QUARANTINED:
                spec.send("quarantined")
        elif op == "free":
            assert req is not None
            facts.holders = 0
            if L.state(req) is RequestState.TRANSFER_QUIESCED:
                how = data.draw(st.sampled_from(["release", "collect", "force"]), label="how")
                if how == "release":
                    assert L.release(req).tolist() == [0]
                elif how == "collect":
                    assert list(L.collect_releasable()) == [req]
                else:
                    assert L.force_release(req, "clean").tolist() == [0]
                spec.send("holder_released")
            else:
                assert grants
                assert L.force_release(req, "test").tolist() == [0]
                spec.send("force_released")
            req, grants, facts.open_grants, facts.open_write_grants = None, {}, 0, 0
            stopped.clear()
        assert BlockState(int(L.block_state([0])[0])) is spec.state, op
    assert L.stats().blocks_by_state[spec.state.label] == 1


# =========================================================================== the shadow model

PEERS = ("p0", "p1", "p2")
SEEN: Counter[str] = Counter()  # what the runs reached (for tuning; asserted nowhere)
KEYS: tuple[RequestKey, ...] = ("a", "b", "c", 1, 2)
NUM_BLOCKS = 8
_ENDED_OPEN = ("rejected", "cancel_received", "scheduling_stopped", "finished")


@dataclasses.dataclass
class SGrant:
    grant: Grant
    deadline: float | None
    cancel: bool = False
    last_seq: int | None = None
    through: int = 0
    revoked: bool = False
    suspect: str | None = None
    was_closed: bool = False  # closure is sticky in the ledger

    @property
    def closed(self) -> bool:
        return (
            self.was_closed
            or self.revoked
            or (self.last_seq is not None and self.through >= self.last_seq)
        )

    @property
    def stopped(self) -> bool:
        return self.revoked or self.last_seq is not None

    @property
    def acked(self) -> bool:
        return self.cancel or self.stopped


@dataclasses.dataclass
class SReq:
    key: RequestKey
    excl: set[int]
    deadline: float | None
    shared: set[int] = dataclasses.field(default_factory=set)
    state: str = "admitted"
    grants: dict[int, SGrant] = dataclasses.field(default_factory=dict)
    quarantine_reason: str | None = None

    def open(self) -> list[SGrant]:
        return [g for g in self.grants.values() if not g.closed]

    def holds(self) -> set[int]:
        return self.excl | self.shared


class Shadow:
    """What the ledger must look like, written from the contract alone (README,
    docs/evidence.md, docs/block.md)."""

    def __init__(self) -> None:
        self.reqs: dict[RequestKey, SReq] = {}
        self.generation = [0] * NUM_BLOCKS
        self.released_keys: set[RequestKey] = set()
        self.released_grants: list[Grant] = []
        self.issued = 0
        self.unsafe = 0
        self.refused: Counter[str] = Counter()

    def holders(self, b: int) -> list[SReq]:
        return [r for r in self.reqs.values() if b in r.holds()]

    def block_state(self, b: int) -> BlockState:
        hs = self.holders(b)
        if not hs:
            return BlockState.FREE
        covering = [
            (r, g) for r in self.reqs.values() for g in r.open() if b in g.grant.blocks.tolist()
        ]
        if any(r.state == "admitted" for r in hs):
            return BlockState.EXPOSED if covering else BlockState.OWNED
        if not covering:
            return BlockState.QUIESCED
        if any(r.state == "quarantined" for r, _ in covering):
            return BlockState.QUARANTINED
        return BlockState.DRAINING

    def advance(self, r: SReq) -> list[tuple[str, str, str]]:
        """The chain of named transitions the evidence now proves (docs/request.md)."""
        out: list[tuple[str, str, str]] = []
        while True:
            op = r.open()
            s = r.state
            if s == "rejected" and all(g.acked for g in op):
                n = "cancel_received"
            elif s == "cancel_received" and all(g.stopped for g in op):
                n = "scheduling_stopped"
            elif s in _ENDED_OPEN and any(g.suspect for g in op):
                n = "quarantined"
                r.quarantine_reason = next(g.suspect for g in op if g.suspect)
            elif s in ("scheduling_stopped", "finished", "quarantined") and not op:
                n = "transfer_quiesced"
            else:
                return out
            out.append((n, s, n))
            SEEN[n] += 1
            r.state = n

    def sticky_close(self) -> None:
        for r in self.reqs.values():
            for g in r.grants.values():
                g.was_closed = g.closed


class LedgerMachine(RuleBasedStateMachine):
    CHECKED = False
    COUNTS: Counts = "ledger"

    def __init__(self) -> None:
        super().__init__()
        self.L = BlockLedger(
            NUM_BLOCKS, checked=self.CHECKED, incarnation="inc", counts=self.COUNTS
        )
        self.m = Shadow()
        self.now = 0.0
        self.applied: list[Evidence] = []

    @initialize(
        peers=st.lists(st.sampled_from(PEERS), min_size=3, max_size=3),
        accesses=st.lists(st.sampled_from(Access), min_size=3, max_size=3),
        deadlines=st.lists(st.none() | st.floats(0, 20), min_size=3, max_size=3),
    )
    def start(
        self, peers: list[str], accesses: list[Access], deadlines: list[float | None]
    ) -> None:
        self.L.allocate("seed", 0)  # the ledger owns the free list from here on
        self.m.reqs["seed"] = SReq("seed", set(), None)
        # Start from a busy ledger: three running requests with two blocks and a grant each.
        for key, peer, access, dl in zip(KEYS[:3], peers, accesses, deadlines, strict=True):
            ids = self.L.allocate(key, 2)
            self.m.reqs[key] = SReq(key, set(ids.tolist()), None)
            g = self.L.grant(key, peer, ids, access, deadline=dl)
            self.m.issued += 1
            self.m.reqs[key].grants[g.id.serial] = SGrant(g, dl)

    # ------------------------------------------------------------------ helpers

    def key(self, data: st.DataObject) -> RequestKey:
        """Mostly a live request (where the interesting refusals are), sometimes any key."""
        live = [k for k in self.m.reqs if k != "seed"]
        return data.draw(st.sampled_from(live * 8 + list(KEYS)), label="key")

    def refused(
        self,
        exc: type[errors.KVLifetimeError] | tuple[type[errors.KVLifetimeError], ...],
        call: Any,
        *args: Any,
    ) -> None:
        fp = self.L.fingerprint()
        try:
            call(*args)
        except exc as e:
            SEEN[type(e).__name__] += 1
            if isinstance(e, errors.EvidenceError):
                self.m.refused[e.kind] += 1
        else:
            raise AssertionError(f"{call!r}{args} was not refused with {exc}")
        assert self.L.fingerprint() == fp, "a refusal changed the ledger"

    def live_grants(self) -> list[tuple[SReq, SGrant]]:
        return [(r, g) for r in self.m.reqs.values() for g in r.grants.values()]

    def expect_apply(self, ev: Evidence) -> None:
        """Predict the outcome of any evidence from the shadow alone, then apply it."""
        m = self.m
        gid = getattr(ev, "grant_id", None)
        if gid is None:  # peer-wide
            assert isinstance(ev, AccessRevoked | PeerLost)
            targets = [(r, g) for r, g in self.live_grants() if g.grant.peer == ev.peer]
            # Every open grant to the peer, in the order they were issued.
            targets = sorted(
                ((r, g) for r, g in targets if not g.closed), key=lambda rg: rg[1].grant.id.serial
            )
        else:
            if gid.incarnation != "inc" or gid.serial > m.issued:
                return self.refused(errors.MismatchedEvidence, self.L.apply, ev)
            live = {g.grant.id: (r, g) for r, g in self.live_grants()}
            if gid not in live:
                return self.refused(errors.StaleEvidence, self.L.apply, ev)
            r, g = live[gid]
            req = getattr(ev, "request", None)
            if req != g.grant.request or type(req) is not type(g.grant.request):
                return self.refused(errors.MismatchedEvidence, self.L.apply, ev)
            if ev.peer != g.grant.peer:  # type: ignore[attr-defined]
                return self.refused(errors.MismatchedEvidence, self.L.apply, ev)
            seq = getattr(ev, "last_seq", None)
            if (
                isinstance(ev, SchedulingStopped | TransferCompleted)
                and g.last_seq is not None
                and seq != g.last_seq
            ):
                return self.refused(errors.ContradictoryEvidence, self.L.apply, ev)
            targets = [(r, g)]
        expected: list[tuple[Any, ...]] = []
        for r, g in targets:
            if g.closed:
                continue  # a closed grant of a live request: checked above, else a no-op
            if isinstance(ev, CancelReceived):
                g.cancel = True
            elif isinstance(ev, SchedulingStopped):
                g.cancel, g.last_seq = True, ev.last_seq
            elif isinstance(ev, TransferQuiesced):
                g.through = max(g.through, ev.through_seq)
            elif isinstance(ev, TransferCompleted):
                g.cancel, g.last_seq = True, ev.last_seq
                g.through = max(g.through, ev.last_seq)
            elif isinstance(ev, AccessRevoked):
                g.revoked = True
            elif isinstance(ev, LeaseExpired | PeerLost) and not g.closed and g.suspect is None:
                g.suspect = "lease_expired" if isinstance(ev, LeaseExpired) else "peer_lost"
            if r.state != "admitted":
                expected += [(r.key, *t) for t in m.advance(r)]
        m.sticky_close()
        got = self.L.apply(ev)
        self.applied.append(ev)
        assert [(t.request, t.event, t.source, t.target) for t in got] == expected
        assert all(t.cause == ev.kind for t in got)

    # ------------------------------------------------------------------ owner-side rules

    @rule(data=st.data(), n=st.sampled_from([1, 2, 3, 0]), dl=st.none() | st.floats(0, 30))
    def allocate(self, data: st.DataObject, n: int, dl: float | None) -> None:
        key = self.key(data)
        m = self.m
        r = m.reqs.get(key)
        alloc = self.L.allocate
        free = [b for b in range(NUM_BLOCKS) if not m.holders(b)]
        illegal = r is not None and r.state != "admitted"
        if illegal and n > len(free):  # both wrong: either error will do
            return self.refused((errors.IllegalTransition, errors.OutOfBlocks), alloc, key, n)
        if illegal:
            return self.refused(errors.IllegalTransition, alloc, key, n)
        if n > len(free):
            return self.refused(errors.OutOfBlocks, alloc, key, n)
        ids = self.L.allocate(key, n, deadline=dl).tolist()
        assert len(set(ids)) == n
        # Never a block someone holds (quarantined, draining, shared, ...): only free ones.
        assert set(ids) <= set(free), (ids, free)
        if r is None:
            r = m.reqs[key] = SReq(key, set(), dl)
            m.released_keys.discard(key)
        elif dl is not None:
            r.deadline = dl  # a deadline given with more blocks replaces the request's
        r.excl |= set(ids)

    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        key = self.key(data)
        m = self.m
        held = sorted(b for b in range(NUM_BLOCKS) if m.holders(b))
        candidates = held + ([b for b in range(NUM_BLOCKS) if b not in held][:1])
        ids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
        r = m.reqs.get(key)
        forbidden = (
            (r is not None and r.state != "admitted")
            or any(not m.holders(b) for b in ids)
            or (r is not None and bool(r.holds() & set(ids)))
            # Only an open write grant unsettles a block (draining or quarantined under read
            # grants only is still shareable: a reader does not change the content).
            or any(
                g.grant.access is Access.WRITE and set(ids) & set(g.grant.blocks.tolist())
                for rr in m.reqs.values()
                for g in rr.open()
            )
        )
        if forbidden:
            exc = errors.IllegalTransition if r is not None and r.state != "admitted" else None
            share = functools.partial(self.L.acquire, shared=True)
            return self.refused(exc or errors.BlockUnavailable, share, key, ids)
        SEEN["shared " + "/".join(sorted({m.block_state(b).label for b in ids}))] += 1
        self.L.acquire(key, ids, shared=True)
        if r is None:
            r = m.reqs[key] = SReq(key, set(), None)
            m.released_keys.discard(key)
        r.shared |= set(ids)

    @rule(
        peer=st.sampled_from(PEERS),
        access=st.sampled_from(Access),
        dl=st.none() | st.floats(0, 30),
        data=st.data(),
    )
    def grant(self, peer: str, access: Access, dl: float | None, data: st.DataObject) -> None:
        m = self.m
        holding = [k for k, r in m.reqs.items() if r.holds()]
        if not holding:
            return
        key = data.draw(st.sampled_from(holding), label="key")
        r = m.reqs[key]
        ids = data.draw(
            st.lists(st.sampled_from(sorted(r.holds())), min_size=1, max_size=3, unique=True)
        )
        if r.state != "admitted":
            return self.refused(errors.IllegalTransition, self.L.grant, key, peer, ids, access)
        multi = any(len(m.holders(b)) > 1 for b in ids)
        if access is Access.WRITE and multi:
            return self.refused(errors.BlockUnavailable, self.L.grant, key, peer, ids, access)
        fp = self.L.fingerprint()
        try:
            g = self.L.grant(key, peer, ids, access, deadline=dl)
        except errors.BlockUnavailable:
            # Stricter than the contract only for a write grant by a sharer that is the last holder.
            assert access is Access.WRITE and set(ids) & r.shared
            assert self.L.fingerprint() == fp
            return
        m.issued += 1
        assert g.id == GrantId("inc", m.issued)
        assert g.blocks.tolist() == ids
        assert g.generations.tolist() == [m.generation[b] for b in ids]
        r.grants[g.id.serial] = SGrant(g, dl)

    @rule(data=st.data(), shared=st.booleans(), access=st.sampled_from(Access))
    def grant_many(self, data: st.DataObject, shared: bool, access: Access) -> None:
        """``acquire_and_grant_many`` of a step whose items overlap (each item's own ids
        distinct, drawn from two or three blocks, held ones first): it must be the single
        calls in order, and the invariants (never one block under two exclusive holders or
        a write grant on a shared block) hold after it."""
        m = self.m
        held = sorted(b for b in range(NUM_BLOCKS) if m.holders(b))
        free = [b for b in range(NUM_BLOCKS) if b not in held]
        pool = (held + free)[: data.draw(st.sampled_from([2, 3]), label="pool")]
        n = data.draw(st.integers(2, 4), label="items")
        items: list[Any] = []
        for _ in range(n):
            key = data.draw(st.sampled_from([*KEYS, "n1", "n2"]), label="key")
            ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True))
            items.append((key, ids, data.draw(st.sampled_from(PEERS)), access))
        ref = self.L.copy()
        want_grants, want_refused = [], []
        for i, item in enumerate(items):
            try:
                want_grants.append(ref.acquire_and_grant(*item, shared=shared))
            except errors.UsageError as e:
                want_refused.append((i, type(e), str(e)))
        out = self.L.acquire_and_grant_many(items, shared=shared)
        got = [(g.request, g.blocks.tolist(), g.peer, g.access) for g in out.grants]
        assert got == [(g.request, g.blocks.tolist(), g.peer, g.access) for g in want_grants]
        assert [(r.position, type(r.error), str(r.error)) for r in out.refused] == want_refused
        assert self.L.fingerprint() == ref.fingerprint()
        SEEN[f"grant_many {len(out.grants)} of {n}"] += 1
        for g in out.grants:  # the shadow follows: holds (as acquire would count them), grant
            r = m.reqs.get(g.request)
            if r is None:
                r = m.reqs[g.request] = SReq(g.request, set(), None)
                m.released_keys.discard(g.request)
            got_ids = set(g.blocks.tolist())
            if shared or self.COUNTS == "engine":
                r.shared |= got_ids - r.excl
            else:
                r.excl |= got_ids
            m.issued += 1
            assert g.id == GrantId("inc", m.issued)
            r.grants[g.id.serial] = SGrant(g, None)

    @rule(data=st.data(), reject=st.booleans())
    def end(self, data: st.DataObject, reject: bool) -> None:
        key = self.key(data)
        m = self.m
        r = m.reqs.get(key)
        call = self.L.reject if reject else self.L.finish
        if r is None:
            exc = errors.DoubleRelease if key in m.released_keys else errors.UnknownRequest
            return self.refused(exc, call, key)
        if r.state != "admitted":
            return self.refused(errors.IllegalTransition, call, key)
        first = "rejected" if reject else "finished"
        r.state = first
        expected = [(first, "admitted", first), *m.advance(r)]
        got = call(key)
        assert [(t.event, t.source, t.target) for t in got] == expected

    def _expected_release(self, r: SReq) -> set[int]:
        return {b for b in r.holds() if len(self.m.holders(b)) == 1}

    def _forget(self, r: SReq, freed: set[int]) -> None:
        m = self.m
        for b in freed:
            m.generation[b] += 1
        m.released_grants += [g.grant for g in r.grants.values()]
        del m.reqs[r.key]
        m.released_keys.add(r.key)

    def _ended(self, key: RequestKey, call: Any, *args: Any) -> SReq | None:
        """The model's request ``key`` if a release call may act on it; otherwise ``None``,
        once ``call(key, *args)`` was checked to be refused (unknown, released, not ended)."""
        m = self.m
        r = m.reqs.get(key)
        if r is None:
            exc = errors.DoubleRelease if key in m.released_keys else errors.UnknownRequest
            self.refused(exc, call, key, *args)
            return None
        if r.state == "admitted":
            self.refused(errors.IllegalTransition, call, key, *args)
            return None
        return r

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = self.key(data)
        r = self._ended(key, self.L.release)
        if r is None:
            return
        if r.state != "transfer_quiesced":
            # Nothing is released without every grant proven closed.
            assert r.open()
            fp = self.L.fingerprint()
            try:
                self.L.release(key)
            except errors.InsufficientEvidence as e:
                SEEN["InsufficientEvidence"] += 1
                assert set(e.unproven) == {f"{g.grant.id} ({g.grant.peer})" for g in r.open()}
                assert all(e.unproven.values())
            else:
                raise AssertionError("released with an open grant")
            assert self.L.fingerprint() == fp
            return
        assert not r.open()
        freed = self._expected_release(r)
        assert set(self.L.release(key).tolist()) == freed
        SEEN["released"] += 1
        self._forget(r, freed)

    @precondition(lambda self: any(r.state == "transfer_quiesced" for r in self.m.reqs.values()))
    @rule()
    def collect(self) -> None:
        m = self.m
        ready = [r for r in m.reqs.values() if r.state == "transfer_quiesced"]
        expected: dict[RequestKey, set[int]] = {}
        for r in ready:
            freed = self._expected_release(r)
            expected[r.key] = freed
            self._forget(r, freed)
        got = {k: set(v.tolist()) for k, v in self.L.collect_releasable().items()}
        # A block two of them held goes back once, attributed to whichever let go last.
        assert sorted(map(repr, got)) == sorted(map(repr, expected))
        assert set().union(*got.values()) == set().union(*expected.values())
        assert sum(map(len, got.values())) == sum(map(len, expected.values()))
        for k, ids in got.items():
            assert ids <= next(r for r in ready if r.key == k).holds()
        assert self.L.collect_releasable() == {}

    @rule(data=st.data())
    def force_release(self, data: st.DataObject) -> None:
        key = self.key(data)
        m = self.m
        r = self._ended(key, self.L.force_release, "test")
        if r is None:
            return
        if r.state != "transfer_quiesced":
            assert r.open()
            m.unsafe += 1
        freed = self._expected_release(r)
        assert set(self.L.force_release(key, "test").tolist()) == freed
        self._forget(r, freed)

    @rule(step=st.floats(0, 10))
    def expire(self, step: float) -> None:
        m = self.m
        self.now += step
        newly = set()
        for r in m.reqs.values():
            for g in r.open():
                dl = g.deadline if g.deadline is not None else r.deadline
                if dl is not None and dl <= self.now and g.suspect is None:
                    g.suspect = "deadline"
            if r.state != "admitted":
                before = r.state
                m.advance(r)
                if r.state == "quarantined" and before != "quarantined":
                    newly.add(repr(r.key))
        assert {repr(k) for k in self.L.expire(self.now)} == newly

    # ------------------------------------------------------------------ evidence rules

    @rule(data=st.data(), kind=st.integers(0, 6), seq=st.integers(0, 4))
    def evidence(self, data: st.DataObject, kind: int, seq: int) -> None:
        grants = [g.grant for _, g in self.live_grants()]
        if not grants:
            return
        g = data.draw(st.sampled_from(grants))
        ev: Evidence = [
            CancelReceived.of(g),
            SchedulingStopped.of(g, seq),
            TransferQuiesced.of(g, seq),
            TransferCompleted.of(g, seq),
            AccessRevoked.of(g),
            LeaseExpired.of(g),
            TransferQuiesced.of(g, seq + 2),
        ][kind]
        self.expect_apply(ev)

    @rule(peer=st.sampled_from(PEERS), revoke=st.booleans())
    def peer_wide(self, peer: str, revoke: bool) -> None:
        self.expect_apply(AccessRevoked(peer) if revoke else PeerLost(peer))

    @precondition(lambda self: bool(self.applied))
    @rule(data=st.data())
    def duplicate_or_reordered(self, data: st.DataObject) -> None:
        # Any earlier evidence again: a duplicate, a late (reordered) report, or a stale one
        # whose request has been released since.
        self.expect_apply(data.draw(st.sampled_from(self.applied)))

    @precondition(lambda self: bool(self.m.released_grants))
    @rule(data=st.data(), seq=st.integers(0, 3))
    def stale(self, data: st.DataObject, seq: int) -> None:
        g = data.draw(st.sampled_from(self.m.released_grants))
        self.expect_apply(TransferCompleted.of(g, seq))

    @rule(data=st.data(), what=st.sampled_from(["peer", "request", "incarnation", "serial"]))
    def mismatched(self, data: st.DataObject, what: str) -> None:
        grants = [g.grant for _, g in self.live_grants()]
        if not grants:
            return
        g = data.draw(st.sampled_from(grants))
        if what == "peer":
            ev = SchedulingStopped(g.id, g.request, g.peer + "x", 0)
        elif what == "request":
            other: RequestKey = str(g.request) if isinstance(g.request, int) else g.request + "x"
            ev = SchedulingStopped(g.id, other, g.peer, 0)
        elif what == "incarnation":
            ev = SchedulingStopped(GrantId("old", g.id.serial), g.request, g.peer, 0)
        else:
            ev = SchedulingStopped(GrantId("inc", self.m.issued + 1), g.request, g.peer, 0)
        self.expect_apply(ev)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def whole_state_matches_shadow(self) -> None:
        L, m = self.L, self.m
        assert sorted(map(repr, L.live_requests())) == sorted(map(repr, m.reqs))
        for key, r in m.reqs.items():
            assert L.state(key).value == r.state, key
            assert {g.id.serial for g in L.open_grants(key)} == {
                g.grant.id.serial for g in r.open()
            }
            assert {g.id for g in L.grants_of(key)} == {g.grant.id for g in r.grants.values()}
            assert set(L.blocks_of(key).tolist()) == r.holds()
        ids = np.arange(NUM_BLOCKS)
        assert L.holders(ids).tolist() == [len(m.holders(b)) for b in range(NUM_BLOCKS)]
        assert L.generation(ids).tolist() == m.generation
        assert [BlockState(int(c)) for c in L.block_state(ids)] == [
            m.block_state(b) for b in range(NUM_BLOCKS)
        ]

    @invariant()
    def exclusive_holders_are_unique(self) -> None:
        owners: dict[int, RequestKey] = {}
        for r in self.m.reqs.values():
            for b in r.excl:
                assert b not in owners, f"block {b} held exclusively by {owners[b]} and {r.key}"
                owners[b] = r.key

    @invariant()
    def no_write_grant_open_on_a_shared_block(self) -> None:
        for r in self.m.reqs.values():
            for g in r.open():
                if g.grant.access is Access.WRITE:
                    assert self.L.holders(g.grant.blocks).tolist() == [1] * len(g.grant.blocks)

    @invariant()
    def grant_counters_match_open_grants(self) -> None:
        # The per-block counters behind O(batch) shared acquire and open_access: open write
        # grants (of running and ended requests alike) and open read grants, recomputed from
        # the shadow model.
        writes, reads = [0] * NUM_BLOCKS, [0] * NUM_BLOCKS
        for r in self.m.reqs.values():
            for g in r.open():
                for b in g.grant.blocks.tolist():
                    if g.grant.access is Access.WRITE:
                        writes[b] += 1
                    else:
                        reads[b] += 1
        inside = self.L.inspect()
        if inside.tracking:  # kept from the first shared acquire (or open_access) on
            assert inside.unsettled.tolist() == writes
            assert inside.readers.tolist() == reads
        # open_access, asked of a copy while the ledger does not keep the counters yet (the
        # first call would build them, and the run would no longer cover the first shared
        # acquire building them).
        L = self.L if inside.tracking else self.L.copy()
        want = [2 if w else 1 if r else 0 for w, r in zip(writes, reads, strict=True)]
        assert L.open_access(np.arange(NUM_BLOCKS)).tolist() == want

    @invariant()
    def free_plus_held_is_total(self) -> None:
        st_ = self.L.stats(now=self.now)
        held = int(np.count_nonzero(self.L.holders(np.arange(NUM_BLOCKS))))
        assert self.L.free_count() + held == NUM_BLOCKS
        assert sum(st_.blocks_by_state.values()) == NUM_BLOCKS
        assert st_.blocks_by_state["free"] == NUM_BLOCKS - held
        assert st_.unsafe_releases == self.m.unsafe
        assert st_.refused_evidence == dict(self.m.refused)
        assert st_.open_grants == sum(len(r.open()) for r in self.m.reqs.values())
        quarantined = {
            repr(r.key): r.quarantine_reason
            for r in self.m.reqs.values()
            if r.state == "quarantined"
        }
        assert {repr(q.request): q.reason for q in st_.quarantined} == quarantined


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


LedgerMachine.TestCase.settings = _settings(250)
test_ledger_stateful = LedgerMachine.TestCase


class CheckedLedgerMachine(LedgerMachine):
    CHECKED = True


CheckedLedgerMachine.TestCase.settings = _settings(80)
test_ledger_stateful_checked = CheckedLedgerMachine.TestCase


# =========================================================================== engine counts


class EngineCountsMachine(LedgerMachine):
    """``counts="engine"`` against the same shadow: the engine's reference counts decide when
    a block is free, the ledger guards exposure only. Every hold is counted alike (``shared``
    makes no difference), ``allocate`` is refused, a release returns every block the request
    held, and a block's generation is bumped when no request holds it any more."""

    COUNTS = "engine"

    @initialize(
        peers=st.lists(st.sampled_from(PEERS), min_size=3, max_size=3),
        accesses=st.lists(st.sampled_from(Access), min_size=3, max_size=3),
        deadlines=st.lists(st.none() | st.floats(0, 20), min_size=3, max_size=3),
        overlap=st.booleans(),
    )
    def start(
        self,
        peers: list[str],
        accesses: list[Access],
        deadlines: list[float | None],
        overlap: bool,
    ) -> None:
        # Three running requests with two blocks each (the engine's choice: maybe overlapping,
        # a prefix-cache hit) and a grant each where the rules allow one.
        for i, (key, peer, access, dl) in enumerate(
            zip(KEYS[:3], peers, accesses, deadlines, strict=True)
        ):
            ids = [i, i + 1] if overlap else [2 * i, 2 * i + 1]
            self.hold_or_refused(key, ids, shared=bool(i % 2))
            if key in self.m.reqs:  # refused under an open write grant of the one before
                self.grant_or_refused(key, peer, ids, access, dl)

    def hold_or_refused(self, key: RequestKey, ids: list[int], *, shared: bool) -> None:
        m = self.m
        r = m.reqs.get(key)
        call = functools.partial(self.L.acquire, shared=shared)
        if r is not None and r.state != "admitted":
            return self.refused(errors.IllegalTransition, call, key, ids)
        unsettled = any(
            g.grant.access is Access.WRITE and set(ids) & set(g.grant.blocks.tolist())
            for rr in m.reqs.values()
            for g in rr.open()
        )
        if unsettled or (r is not None and bool(r.holds() & set(ids))):
            return self.refused(errors.BlockUnavailable, call, key, ids)
        SEEN["engine hold " + "/".join(sorted({m.block_state(b).label for b in ids}))] += 1
        call(key, ids)
        if r is None:
            r = m.reqs[key] = SReq(key, set(), None)
            m.released_keys.discard(key)
        r.shared |= set(ids)

    def grant_or_refused(
        self, key: RequestKey, peer: str, ids: list[int], access: Access, dl: float | None
    ) -> None:
        m = self.m
        r = m.reqs[key]
        if r.state != "admitted":
            return self.refused(errors.IllegalTransition, self.L.grant, key, peer, ids, access)
        covering = [
            (rr, g)
            for rr in m.reqs.values()
            for g in rr.open()
            if set(ids) & set(g.grant.blocks.tolist())
        ]
        if access is Access.WRITE:
            forbidden = any(len(m.holders(b)) > 1 for b in ids) or bool(covering)
        else:
            forbidden = any(rr is not r and g.grant.access is Access.WRITE for rr, g in covering)
        if forbidden:
            SEEN[f"engine {access.value} grant refused"] += 1
            return self.refused(errors.BlockUnavailable, self.L.grant, key, peer, ids, access)
        g = self.L.grant(key, peer, ids, access, deadline=dl)
        m.issued += 1
        assert g.id == GrantId("inc", m.issued)
        assert g.generations.tolist() == [m.generation[b] for b in ids]
        r.grants[g.id.serial] = SGrant(g, dl)

    @rule(data=st.data(), n=st.sampled_from([1, 2, 0]), dl=st.none() | st.floats(0, 30))
    def allocate(self, data: st.DataObject, n: int, dl: float | None) -> None:
        # The engine's allocator hands out blocks in this mode.
        self.refused(errors.WrongCountsMode, self.L.allocate, self.key(data), n)

    @rule(data=st.data(), shared=st.booleans())
    def share(self, data: st.DataObject, shared: bool) -> None:
        ids = data.draw(
            st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3, unique=True)
        )
        self.hold_or_refused(self.key(data), ids, shared=shared)

    @rule(
        peer=st.sampled_from(PEERS),
        access=st.sampled_from(Access),
        dl=st.none() | st.floats(0, 30),
        data=st.data(),
    )
    def grant(self, peer: str, access: Access, dl: float | None, data: st.DataObject) -> None:
        holding = [k for k, r in self.m.reqs.items() if r.holds()]
        if not holding:
            return
        key = data.draw(st.sampled_from(holding), label="key")
        ids = data.draw(
            st.lists(
                st.sampled_from(sorted(self.m.reqs[key].holds())),
                min_size=1,
                max_size=3,
                unique=True,
            )
        )
        self.grant_or_refused(key, peer, ids, access, dl)

    def _expected_release(self, r: SReq) -> set[int]:
        return set(r.holds())  # every block it held: the engine's counts decide the rest

    def _forget(self, r: SReq, freed: set[int]) -> None:
        m = self.m
        others = set().union(*(o.holds() for o in m.reqs.values() if o is not r))
        for b in r.holds() - others:
            m.generation[b] += 1  # no request holds it any more
        m.released_grants += [g.grant for g in r.grants.values()]
        del m.reqs[r.key]
        m.released_keys.add(r.key)

    @invariant()
    def mode_is_kept(self) -> None:
        assert self.L.counts == "engine"
        assert self.L.copy().counts == "engine"


EngineCountsMachine.TestCase.settings = _settings(200)
test_ledger_stateful_engine_counts = EngineCountsMachine.TestCase


class CheckedEngineCountsMachine(EngineCountsMachine):
    CHECKED = True


CheckedEngineCountsMachine.TestCase.settings = _settings(50)
test_ledger_stateful_engine_counts_checked = CheckedEngineCountsMachine.TestCase
