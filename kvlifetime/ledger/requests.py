"""The request table: every live request and its grants, and the ledger's tallies.

Per-request work is O(1) dict work: a request's record by key (and by its int32 slot, the id
written in the per-block ``owner`` array), a grant's record by serial and the open ones per
peer, the requests ready to release (in the order they became so), those with a deadline, and
the keys released lately (to tell a double release from an unknown key). The ledger never grows
with history: a released request and its grants are forgotten.

The facade (``BlockLedger``) validates every argument and holds the lock: the methods here take
validated values (a plain ``str`` / ``int`` key, finite deadlines) and never check them again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvlifetime.errors import (
    DoubleRelease,
    DuplicateRequest,
    HolderLimit,
    IllegalTransition,
    KVLifetimeError,
    UnknownRequest,
    show,
)
from kvlifetime.grant import (
    Access,
    BlockIds,
    Generations,
    Grant,
    PeerId,
    RequestKey,
)
from kvlifetime.ledger.batch import views
from kvlifetime.ledger.events import Event, enabled, note, note_released
from kvlifetime.ledger.grant_table import GrantTable
from kvlifetime.ledger.records import GrantRecord, RequestRecord
from kvlifetime.ledger.snapshot import copy_slots
from kvlifetime.ledger.transitions import advance, fire
from kvlifetime.ledger.values import Transition
from kvlifetime.spec.vocabulary import RequestState

if TYPE_CHECKING:
    from kvlifetime.ledger.batch import FreshGrants, Holds
    from kvlifetime.ledger.blocks import BlockCounts

_ADMITTED = RequestState.ADMITTED.value
_TRANSFER_QUIESCED = RequestState.TRANSFER_QUIESCED.value
_QUARANTINED = RequestState.QUARANTINED.value

# How many released request keys are remembered to tell a double release from an unknown key.
RECENTLY_RELEASED = 4096


class RequestTable:
    """The live requests and grants of one ledger (touched only under its lock)."""

    __slots__ = (
        "by_slot",
        "checked",
        "clock",
        "grants",
        "incarnation",
        "next_slot",
        "pending",
        "recently_released",
        "reclaimed",
        "refused",
        "releasable",
        "requests",
        "timed",
        "unsafe_releases",
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> RequestTable:
        # A blank instance for ``snapshot.copy_slots``: compiled by mypyc (the optional
        # accelerator), the class is created blank only by a ``__new__`` of its own.
        return object.__new__(cls)

    def __init__(self, incarnation: str, *, checked: bool) -> None:
        self.incarnation = incarnation  # in every grant id: another ledger's never matches
        self.checked = checked  # mirror every transition into python-statemachine
        self.requests: dict[RequestKey, RequestRecord] = {}
        self.by_slot: dict[int, RequestRecord] = {}
        self.next_slot = 0
        self.grants = GrantTable(incarnation)  # the live requests' grants, by serial and peer
        self.releasable: dict[RequestKey, None] = {}  # requests in transfer_quiesced (ordered)
        self.timed: dict[RequestKey, None] = {}  # requests with a deadline somewhere
        self.recently_released: collections.OrderedDict[RequestKey, None] = (
            collections.OrderedDict()
        )
        self.clock: float | None = None  # last ``now`` passed to expire()
        self.unsafe_releases = 0
        self.refused: collections.Counter[str] = collections.Counter()  # error kind -> count
        self.reclaimed: collections.Counter[str] = collections.Counter()  # fence -> blocks
        # Log events noted under the lock, emitted by the facade once it is released. Empty
        # (and never appended to) while nobody listens.
        self.pending: list[Event] = []

    # ------------------------------------------------------------------ requests

    def admit(self, request: RequestKey, deadline: float | None) -> RequestRecord:
        """A new record for ``request`` (a key the facade validated)."""
        if request in self.requests:
            raise DuplicateRequest(request)
        slot = self.next_slot
        self.next_slot = (slot + 1) & 0x7FFFFFFF
        req = RequestRecord(request, slot, None)
        if self.checked:
            req.machine = _lifecycle(req)
        self.requests[request] = req
        self.by_slot[slot] = req
        self.recently_released.pop(request, None)
        if deadline is not None:
            self.set_deadline(req, deadline)
        if enabled():
            self.pending.append(("info", "request_admitted", {"request": request}))
        return req

    def get(self, request: RequestKey, *, ending: bool = False) -> RequestRecord:
        """The live request.

        ``ending``: the call ends or lets go of the request (reject, finish, release,
        force_release), so a recently released key is a ``DoubleRelease``; for every other call
        (queries, grant, set_deadline) it is simply unknown.
        """
        req = self.requests.get(request)
        if req is None:
            if ending and request in self.recently_released:
                raise DoubleRelease(f"request {show(request)} was already released")
            raise UnknownRequest(request)
        return req

    def running_or_new(self, request: RequestKey) -> RequestRecord | None:
        """The record of ``request`` if it runs, ``None`` if it is not admitted yet; a request
        that has ended may acquire nothing (``IllegalTransition``)."""
        req = self.requests.get(request)
        if req is not None and req.state != _ADMITTED:
            raise IllegalTransition("request", request, req.state, "acquire")
        return req

    def hold(
        self,
        blocks: BlockCounts,
        request: RequestKey,
        req: RequestRecord | None,
        arr: BlockIds,
        shared: bool,
        deadline: float | None,
        first: Callable[[], None] | None = None,
    ) -> RequestRecord:
        """``request`` (record ``req``, ``None``: admitted here) holds ``arr``: the per-block
        checks, then admission and its deadline, then the hold counted. ``first`` runs before
        anything changes (a refusal there, like one from admission, changes nothing)."""
        blocks.check_hold(arr, req, shared, self.requests)
        try:
            if first is not None:
                first()
            if req is None:
                req = self.admit(request, deadline)
            elif deadline is not None:
                self.set_deadline(req, deadline)
        except BaseException:
            blocks.unmark(arr, shared)
            raise
        blocks.record_hold(req, arr, shared)
        self.note_held(request, arr, shared)
        return req

    def take_fresh(self, blocks: BlockCounts, req: RequestRecord, n: int) -> BlockIds:
        """``allocate``'s last step: ``n`` fresh blocks for ``req``, logged as held."""
        ids = blocks.allocate(req, n)
        self.note_held(req.key, ids, False)
        return ids

    def note_held(self, request: RequestKey, arr: BlockIds, shared: bool) -> None:
        """Log that ``request`` now holds ``arr`` (``blocks_held``): what a replay needs to
        hold the same blocks, shared or not, before any grant names them."""
        if enabled():
            self.pending.append(
                (
                    "info",
                    "blocks_held",
                    {"request": request, "blocks": arr.tolist(), "shared": shared},
                )
            )

    def hold_many(self, blocks: BlockCounts, step: Holds, shared: bool) -> None:
        """Every request of ``step`` holds its ids (``acquire_many``): all or nothing."""
        reqs = [self.running_or_new(key) for key in step.keys]
        blocks.check_hold_many(step, reqs, shared, self.requests)
        # Every check passed: from here on nothing is refused.
        try:
            recs = [
                r if r is not None else self.admit(k, None)
                for k, r in zip(step.keys, reqs, strict=True)
            ]
        except BaseException:  # keys were validated: only a bug gets here
            blocks.unmark(step.allids, shared)
            raise
        blocks.record_hold_many(step, recs, shared)
        if enabled():
            for key, part in zip(
                step.keys, views(step.allids, step.starts, step.lens), strict=True
            ):
                self.note_held(key, part, shared)

    def hold_and_grant(
        self,
        blocks: BlockCounts,
        request: RequestKey,
        arr: BlockIds,
        peer: PeerId,
        access: Access,
        shared: bool,
        deadline: float | None,
    ) -> Grant:
        """``request`` holds ``arr`` and ``peer`` may access them, all or nothing: the one step
        of ``acquire_and_grant`` and of its batch call. Refused exactly where ``acquire`` then
        ``grant`` would be; no check that the request holds the blocks: it just took them."""
        req = self.running_or_new(request)
        if access is Access.WRITE and len(arr):
            blocks.check_write_on_hold(arr, shared)

        # Counted first: HolderLimit from the counters changes nothing. Decided inside the
        # call, after ``check_hold``: the ledger's first shared hold starts the per-block
        # counters there, and this grant must be counted in them too.
        def count() -> None:
            if blocks.tracking:
                blocks.count_open(arr, access)

        req = self.hold(blocks, request, req, arr, shared, deadline, count)
        return self.open_grant(req, peer, arr, blocks.generation.take(arr), access, None)

    def grant_fresh(
        self, blocks: BlockCounts, step: FreshGrants, shared: bool, deadline: float | None
    ) -> list[Grant] | None:
        """``acquire_and_grant_many`` of requests none of which is live yet, in one pass of
        numpy work: the same holds, grants, counts and log events as ``hold_and_grant`` of each
        item in order. ``None`` (nothing changed) where any of them might be refused: the
        caller then takes each item on its own."""
        requests = self.requests
        if any(k in requests for k in step.keys):
            return None
        allids, access = step.allids, step.access
        if not blocks.fresh_holds_allowed(allids, shared, access is Access.WRITE):
            return None
        if blocks.tracking:
            try:
                blocks.count_open_many(allids, access, len(step.keys))
            except HolderLimit:
                return None  # counted nothing: each item says which one is refused
        parts = views(allids, step.starts, step.lens)
        generations = views(blocks.generation.take(allids), step.starts, step.lens)
        recs: list[RequestRecord] = []
        grants: list[Grant] = []
        for key, peer, part, gens in zip(step.keys, step.peers, parts, generations, strict=True):
            req = self.admit(key, deadline)
            recs.append(req)
            self.note_held(key, part, shared)
            grants.append(self.open_grant(req, peer, part, gens, access, None))
        blocks.record_fresh_holds(recs, allids, parts)
        return grants

    def refused_item(self, call: str, e: KVLifetimeError, request: object) -> None:
        """Log one refused item of a batch call (``{call}_refused``, naming the ``request`` it
        was about): the batch returns it as data instead of raising."""
        if enabled():
            self.pending.append(
                (
                    "warning",
                    f"{call}_refused",
                    {"error": e.kind, "message": str(e), "request": show(request)},
                )
            )

    def end(self, request: RequestKey, event: str, cause: str) -> list[Transition]:
        """The owner ends ``request`` (``event``: rejected or finished): the one implementation
        of ``reject`` / ``finish`` and of their batch calls."""
        req = self.get(request, ending=True)
        out: list[Transition] = []
        fire(self, req, event, cause, out)
        advance(self, req, cause, None, out)
        if enabled():
            note(self.pending, out)
        return out

    def let_go(
        self, reqs: Sequence[RequestRecord], blocks: BlockCounts, out: list[Transition]
    ) -> list[BlockIds]:
        """Forget ``reqs`` (their release fired, into ``out``) and let go of their holds;
        return, per request, the blocks ``release`` returns."""
        for req in reqs:
            self.forget(req, blocks)
        results = blocks.let_go(reqs, self.reclaimed)
        if enabled():
            note_released(self.pending, reqs, results, out)
        return results

    def collect_releasable(self, blocks: BlockCounts) -> dict[RequestKey, BlockIds]:
        """Release every request whose grants are all closed, in the order they became so."""
        if not self.releasable:
            return {}
        reqs = [self.requests[k] for k in self.releasable]
        out: list[Transition] = []
        for req in reqs:
            fire(self, req, "released", "collect_releasable", out)
        freed = self.let_go(reqs, blocks, out)
        return {req.key: ids for req, ids in zip(reqs, freed, strict=True)}

    def force_release(self, blocks: BlockCounts, request: RequestKey, reason: str) -> BlockIds:
        """Release ``request`` even with open grants (``BlockLedger.force_release``): counted
        and logged as unsafe unless every grant is closed."""
        req = self.get(request, ending=True)
        out: list[Transition] = []
        if req.state == _TRANSFER_QUIESCED:
            fire(self, req, "released", "force_release", out)
        else:
            open_grants = [str(r.grant.id) for r in req.open.values()]
            fire(self, req, "force_released", "force_release", out)
            self.unsafe_releases += 1
            if enabled():
                self.pending.append(
                    (
                        "warning",
                        "force_released",
                        {"request": request, "reason": reason, "open_grants": open_grants},
                    )
                )
        return self.let_go([req], blocks, out)[0]

    def set_deadline(self, req: RequestRecord, deadline: float | None) -> None:
        req.deadline = deadline
        if deadline is not None:
            self.timed[req.key] = None

    def forget(self, req: RequestRecord, blocks: BlockCounts) -> None:
        """The ledger never grows with history: a released request and its grants are gone."""
        key = req.key
        del self.requests[key]
        del self.by_slot[req.slot]
        self.releasable.pop(key, None)
        self.timed.pop(key, None)
        self.grants.forget(req, blocks)
        rr = self.recently_released
        rr[key] = None
        if len(rr) > RECENTLY_RELEASED:
            rr.popitem(last=False)

    def unproven(self, req: RequestRecord) -> dict[str, tuple[str, ...]]:
        return {f"{r.grant.id} ({r.grant.peer})": tuple(r.unproven()) for r in req.open.values()}

    # ------------------------------------------------------------------ grants

    def open_grant(
        self,
        req: RequestRecord,
        peer: PeerId,
        arr: BlockIds,
        generations: Generations,
        access: Access,
        deadline: float | None,
    ) -> Grant:
        """Record a new open grant of ``req`` (every check done, counted per block)."""
        g = self.grants.open(req, peer, arr, generations, access, deadline)
        if deadline is not None:
            self.timed[req.key] = None
        if enabled():
            self.pending.append(("info", "grant_opened", g.describe()))
        return g

    def close(self, rec: GrantRecord) -> None:
        """``rec`` is proven over: no longer open (it stays among its request's grants)."""
        self.grants.close(rec)

    # ------------------------------------------------------------------ deadlines

    def expire(self, now: float) -> list[RequestKey]:
        """Quarantine ended requests with an open grant whose deadline is ``<= now``; return
        those this call quarantined (``BlockLedger.expire``)."""
        self.clock = now
        newly: list[RequestKey] = []
        for key in list(self.timed):
            req = self.requests[key]
            marked = False
            for rec in req.open.values():
                dl = rec.deadline if rec.deadline is not None else req.deadline
                if dl is not None and dl <= now and rec.suspect is None:
                    rec.mark_suspect("deadline")
                    marked = True
            if marked and req.state != _ADMITTED:
                out: list[Transition] = []
                advance(self, req, "expire", None, out)
                if enabled():
                    note(self.pending, out)
                # Only if this call quarantined it: it may already have been (PeerLost).
                if any(t.target == _QUARANTINED for t in out):
                    newly.append(key)
            # Nothing left to time out; a quarantined request waits for proof only.
            if req.state != _ADMITTED and (
                not req.open or req.state in (_QUARANTINED, _TRANSFER_QUIESCED)
            ):
                self.timed.pop(key, None)
        return newly

    # ------------------------------------------------------------------ snapshots

    def copy(self) -> RequestTable:
        """An independent copy: each record copied once (``RequestRecord.copy``), every map
        rebuilt over the copies; every other field by its kind (``snapshot.copy_slots``)."""
        requests = {key: req.copy() for key, req in self.requests.items()}
        if self.checked:
            for req in requests.values():
                req.machine = _lifecycle(req, start=req.state)
        return copy_slots(
            self,
            requests=requests,
            by_slot={req.slot: req for req in requests.values()},
            grants=self.grants.rebuilt(requests),
            pending=[],
        )

    def sizes(self) -> dict[str, int]:
        """Entries of each map (``BlockLedger.inspect``)."""
        out = {
            name: len(getattr(self, name))
            for name in ("requests", "by_slot", "releasable", "timed", "recently_released")
        }
        out["grants"], out["by_peer"] = len(self.grants.records), len(self.grants.by_peer)
        return out

    def fingerprint(self) -> tuple[Any, ...]:
        """The observable state of every live request (grant serials included), sorted."""
        reqs = []
        for key, req in self.requests.items():
            reqs.append(
                (
                    repr(key),
                    req.state,
                    tuple(tuple(a.tolist()) for a in req.excl),
                    tuple(tuple(a.tolist()) for a in req.shared),
                    req.deadline,
                    tuple(
                        (s, r.grant.peer, r.grant.access.value, r.deadline, r.key())
                        for s, r in sorted(req.grants.items())
                    ),
                )
            )
        reqs.sort()
        return tuple(reqs)


def _lifecycle(req: RequestRecord, start: str | None = None) -> Any:
    # The specification loads only for a checked ledger (an unchecked one never imports
    # python-statemachine).
    from kvlifetime.spec.lifecycles import RequestLifecycle

    if start is None:
        return RequestLifecycle(req)
    return RequestLifecycle(req, start_value=start)
