"""``BlockLedger``: the facade a serving engine's allocator embeds.

A thin layer over the package's parts: every public call validates its arguments here, once
(``kvlifetime.inputs``), takes the one lock, and delegates, with validated values, to

- the per-block state (``blocks.BlockCounts``; ``LedgerCounts`` or ``EngineCounts`` by whose
  counts decide when a block is free, ``counts=``),
- the request table (``requests.RequestTable``) and its transitions (``transitions``, stepping
  the tables compiled from the specification, never a python-statemachine instance:
  ``checked=True`` adds one per request, for tests and debugging),
- evidence applied (``proofs``), the batch calls' helpers (``batch``), snapshots
  (``snapshot``), log events (``events``).

Thread safety: every public method holds one lock; evidence may arrive on transfer-engine
threads while the scheduler allocates. Logging never runs under it: a call notes its log events
while it holds the lock (only when structlog is configured) and emits them once it has let go,
so a log processor may call the ledger back, from its own thread or another.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvlifetime import errors, inputs
from kvlifetime.errors import (
    EvidenceError,
    IllegalTransition,
    InsufficientEvidence,
    OutOfBlocks,
    UsageError,
    show,
)
from kvlifetime.evidence import Evidence
from kvlifetime.grant import Access, BlockIds, Grant, PeerId, RequestKey
from kvlifetime.ledger import batch, proofs
from kvlifetime.ledger.batch import HoldAndGrant
from kvlifetime.ledger.blocks import COUNTS, MAX_SHARERS, Counts
from kvlifetime.ledger.engine_counts import EngineCounts
from kvlifetime.ledger.events import emit, log, started
from kvlifetime.ledger.ledger_counts import LedgerCounts
from kvlifetime.ledger.queries import MaxSharers, _Queries
from kvlifetime.ledger.requests import RequestTable
from kvlifetime.ledger.restart import PREVIOUS_INCARNATION, quarantine_previous
from kvlifetime.ledger.transitions import fire
from kvlifetime.ledger.values import (
    BatchOutcome,
    Refusal,
    Transition,
)
from kvlifetime.spec.vocabulary import ENDED_STATES, RequestState

__all__ = ["BlockLedger"]

_Key = TypeVar("_Key", bound=RequestKey)  # a mapping keyed by str, by int, or by both

_ADMITTED = RequestState.ADMITTED.value
_TRANSFER_QUIESCED = RequestState.TRANSFER_QUIESCED.value
_QUARANTINED = RequestState.QUARANTINED.value
_RELEASED = RequestState.RELEASED.value
_ENDED = frozenset(s.value for s in ENDED_STATES)


class BlockLedger(_Queries):
    """The lifetime of every block of one KV pool, guarded by evidence. See README "Embedding
    the ledger" and docs/ledger-api.md.

    Every public call validates its arguments (``kvlifetime.inputs``) before it touches
    anything: a refused call raises a ``KVLifetimeError`` and changes nothing, for anyone.
    """

    MAX_SHARERS: MaxSharers | int = MaxSharers()
    """The most requests that may hold one block shared (the ``sharers`` counter's limit):
    one more shared acquire is refused with ``HolderLimit``, never wrapped."""

    def __init__(
        self,
        num_blocks: int,
        *,
        checked: bool = False,
        incarnation: str | None = None,
        counts: Counts = "ledger",
    ) -> None:
        num_blocks = inputs.count(num_blocks, "num_blocks", 1)
        if num_blocks >= 2**31:
            raise errors.InvalidField("num_blocks must be < 2**31")
        checked = inputs.flag(checked, "checked")
        if incarnation is not None:
            incarnation = inputs.peer_id(incarnation, "incarnation")
        engine = inputs.choice(counts, "counts", COUNTS) == "engine"
        limit = min(int(type(self).MAX_SHARERS), MAX_SHARERS)
        blocks = EngineCounts(num_blocks, limit) if engine else LedgerCounts(num_blocks, limit)
        # Random per instance: a grant id from another ledger or an earlier process never matches.
        self._take(blocks, RequestTable(incarnation or uuid.uuid4().hex[:16], checked=checked))
        started(num_blocks, self._table.incarnation, "engine" if engine else "ledger")

    def _flush(self) -> None:
        """Emit the log events noted so far, outside the lock. Whichever call flushes takes
        every event noted until then, in the order noted; events of calls running at the same
        time on other threads may be emitted by them, interleaved with these."""
        with self._lock:
            pending = self._pending
            events = pending.copy()
            pending.clear()
        emit(log, events)

    # =================================================================== restart

    PREVIOUS_INCARNATION = PREVIOUS_INCARNATION  # the quarantine reason after a restart

    @classmethod
    def after_restart(
        cls,
        num_blocks: int,
        *,
        peers: Sequence[PeerId],
        exposed: npt.ArrayLike | None = None,
        request: RequestKey = "previous-incarnation",
        checked: bool = False,
        incarnation: str | None = None,
        counts: Counts = "ledger",
    ) -> BlockLedger:
        """A ledger that starts over an arena a previous incarnation's peers may still reach.

        The ledger is in memory; the KV arena may outlive it (memory kept by a supervisor,
        shared memory, a pool reused after an in-process reset). A fresh ``BlockLedger`` would
        start with every block free and hand out blocks a peer of the old process may still be
        writing. Here the blocks ``exposed`` (default: all) start held by ``request``, with one
        open write grant per peer in ``peers``, quarantined with reason
        ``previous_incarnation``: never handed out, counted in ``stats()``. Only a completed
        fence ends it - ``apply(AccessRevoked(peer, fence=...))`` for each peer, from the local
        side - after which ``collect_releasable()`` returns them under ``request``.

        Evidence about the previous incarnation's grants stays refused (``MismatchedEvidence``:
        another incarnation) and counted: a late report of the old process proves nothing here.
        So does every claim about the quarantine grants themselves (a ``TransferCompleted``,
        ``SchedulingStopped``, ``TransferQuiesced``, ``CancelReceived`` or ``LeaseExpired``,
        from the peer or from this process): they stand for the old access, which only a fence
        ends. Refused before anything changes, logged and counted like any refused evidence.
        ``counts`` as in the constructor (with ``"engine"``, ``request`` holds the blocks by the
        engine's counts; the engine keeps its own references to them until they are returned).
        """
        if isinstance(peers, str | bytes) or not isinstance(peers, Sequence):
            raise errors.InvalidField(
                f"peers must be a non-empty sequence of peer ids (who may still reach the "
                f"arena), got {show(peers)}"
            )
        # Read once, each one checked (and made a plain str) before any dict hashes it: an
        # unhashable or empty peer is InvalidField, never a TypeError.
        names = list(dict.fromkeys(inputs.peer_id(p) for p in inputs.materialised(peers, "peers")))
        if not names:
            raise errors.InvalidField(
                "peers must be a non-empty sequence of peer ids (who may still reach the arena)"
            )
        request = inputs.request_key(request)
        led = cls(num_blocks, checked=checked, incarnation=incarnation, counts=counts)
        ids = np.arange(num_blocks, dtype=np.int64) if exposed is None else exposed
        arr = inputs.block_ids(ids, led.num_blocks, unique=led._blocks.all_shared)
        try:
            with led._lock:
                quarantine_previous(led._table, led._blocks, request, arr, names)
        finally:
            if led._pending:
                led._flush()
        return led

    # =================================================================== admission and blocks

    def admit(self, request: RequestKey, *, deadline: float | None = None) -> None:
        """Admit a request that holds no block yet (allocate / acquire admit implicitly)."""
        request = inputs.request_key(request)
        deadline = inputs.optional_time(deadline, "deadline")
        try:
            with self._lock:
                self._table.admit(request, deadline)
        finally:
            if self._pending:
                self._flush()

    def allocate(self, request: RequestKey, n: int, *, deadline: float | None = None) -> BlockIds:
        """Take ``n`` free blocks from the ledger's own free list for ``request``.

        From the first call on, the ledger owns the free list: fresh blocks come from
        ``allocate``; ``acquire`` is then only for sharing held blocks.
        """
        request = inputs.request_key(request)
        n = inputs.count(n, "n")
        deadline = inputs.optional_time(deadline, "deadline")
        blocks = self._blocks
        blocks.check_allocates()
        try:
            with self._lock:
                table = self._table
                req = table.requests.get(request)
                if req is not None and req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "allocate")
                # Refused before the free list is built: a refusal leaves acquire() as it was.
                free = blocks.free_for_allocate()
                if n > free:
                    raise OutOfBlocks(n, free)
                if req is None:
                    req = table.admit(request, deadline)
                elif deadline is not None:
                    table.set_deadline(req, deadline)
                return table.take_fresh(blocks, req, n)
        finally:
            if self._pending:
                self._flush()

    def acquire(
        self,
        request: RequestKey,
        ids: npt.ArrayLike,
        *,
        shared: bool = False,
        deadline: float | None = None,
    ) -> None:
        """Record that ``request`` holds ``ids`` (handed out by the engine's own allocator).

        Exclusive: every block must be free. ``shared=True`` (a prefix-cache hit): every block
        must already be held and have no open write grant (its content is settled; open read
        grants do not unsettle it, even of a holder that ended). Refused blocks raise
        ``BlockUnavailable``.

        ``counts="engine"``: ``request`` holds ``ids`` by the engine's own counts; any number of
        requests may hold a block (``shared`` makes no difference). Refused
        (``BlockUnavailable``) where an open write grant covers a block (its content is
        unsettled) or ``request`` already holds one; ``HolderLimit`` at ``MAX_SHARERS``.
        """
        request = inputs.request_key(request)
        shared = inputs.flag(shared, "shared")
        deadline = inputs.optional_time(deadline, "deadline")
        shared = shared or self._blocks.all_shared
        arr = inputs.block_ids(ids, self.num_blocks, unique=shared)
        try:
            with self._lock:
                table = self._table
                req = table.requests.get(request)
                if req is not None and req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "acquire")
                table.hold(self._blocks, request, req, arr, shared, deadline)
        finally:
            if self._pending:
                self._flush()

    def acquire_many(self, holds: Mapping[_Key, npt.ArrayLike], *, shared: bool = False) -> None:
        """Many requests' ``acquire`` in one call: a scheduler step's new blocks (decode growing
        each running request by a block, a batch of prefills admitted together).

        The same as ``acquire(request, ids, shared=shared)`` for each item of ``holds`` in order,
        with the same refusals, but all or nothing: if any of them would be refused, this raises
        that refusal and nothing changes, for any request. The ids of every request are
        validated and checked together, as one batch; the per-request work is a dict lookup and
        a list append, so the call costs O(requests + blocks) with numpy's per-call overhead paid
        once per step instead of once per request.
        """
        batch.check_mapping(holds)
        shared = inputs.flag(shared, "shared")
        step = batch.holds(holds, self.num_blocks)
        if step is None:
            return
        blocks = self._blocks
        shared = shared or blocks.all_shared
        try:
            with self._lock:
                self._table.hold_many(blocks, step, shared)
        finally:
            if self._pending:
                self._flush()

    def acquire_and_grant(
        self,
        request: RequestKey,
        ids: npt.ArrayLike,
        peer: PeerId,
        access: Access = Access.WRITE,
        *,
        shared: bool = False,
        deadline: float | None = None,
    ) -> Grant:
        """``acquire(request, ids, shared=shared)`` then ``grant(request, peer, ids, access)``,
        in one call and all or nothing: a prefill that takes its blocks and sends their
        addresses to the peer that fills them, or a decode that exposes blocks it just took to
        the peer that reads them.

        Refused exactly where one of the two calls would be (``deadline`` is the request's, as
        in ``acquire``); a refusal changes nothing. One validation and one lock instead of two,
        and no check that the request holds the blocks: it just took them.
        """
        request = inputs.request_key(request)
        peer = inputs.peer_id(peer)
        inputs.instance(access, Access, "access")
        shared = inputs.flag(shared, "shared")
        deadline = inputs.optional_time(deadline, "deadline")
        blocks = self._blocks
        shared = shared or blocks.all_shared
        arr = inputs.block_ids(ids, self.num_blocks, unique=shared)
        try:
            with self._lock:
                return self._table.hold_and_grant(
                    blocks, request, arr, peer, access, shared, deadline
                )
        finally:
            if self._pending:
                self._flush()

    def acquire_and_grant_many(
        self,
        items: Sequence[HoldAndGrant],
        *,
        shared: bool = False,
        deadline: float | None = None,
    ) -> BatchOutcome:
        """``acquire_and_grant`` of many requests in one call: a scheduler step's prompts, each
        taking its blocks and exposing them to the peer that fills (or reads) them.

        Each item is ``(request, ids, peer)`` or ``(request, ids, peer, access)`` (``access``
        defaults to ``Access.WRITE``), acquired and granted or refused on its own, in order,
        exactly as ``acquire_and_grant(request, ids, peer, access, shared=shared,
        deadline=deadline)`` would be at that point (the same checks, the same typed error):
        each request's holds and grant are all or nothing, and a refused one changes nothing
        and is logged (``acquire_and_grant_refused``). Not all or nothing across items: one
        request's refusal never stops the others. Returns the grants opened (``grants``, one
        per item applied, in batch order) and the refusals as data, never raising for one bad
        item (an item that is not such a tuple is refused, ``InvalidField``); an ``items`` that
        is not a sequence, or a bad ``shared`` or ``deadline``, raises ``InvalidField`` and
        changes nothing. One lock for all.
        """
        batch_items = batch.items(items, "items", "(request, ids, peer[, access]) tuples")
        shared = inputs.flag(shared, "shared")
        deadline = inputs.optional_time(deadline, "deadline")
        blocks = self._blocks
        shared = shared or blocks.all_shared
        num_blocks = self.num_blocks
        table = self._table
        fresh = batch.fresh_grants(batch_items, num_blocks) if batch_items else None
        grants: list[Grant] = []
        refused: list[Refusal] = []
        try:
            with self._lock:
                if fresh is not None:
                    done = table.grant_fresh(blocks, fresh, shared, deadline)
                    if done is not None:
                        return BatchOutcome((), (), tuple(done))
                for i, item in enumerate(batch_items):
                    try:
                        request, arr, peer, access = batch.hold_and_grant(item, num_blocks, shared)
                        step = (blocks, request, arr, peer, access, shared, deadline)
                        grants.append(table.hold_and_grant(*step))
                    except UsageError as e:
                        refused.append(Refusal(i, item, e))
                        named = item[0] if type(item) is tuple and item else item
                        table.refused_item("acquire_and_grant", e, named)
            return BatchOutcome((), tuple(refused), tuple(grants))
        finally:
            if self._pending:
                self._flush()

    # =================================================================== grants

    def grant(
        self,
        request: RequestKey,
        peer: PeerId,
        blocks: npt.ArrayLike,
        access: Access = Access.WRITE,
        *,
        deadline: float | None = None,
    ) -> Grant:
        """Record that ``peer`` may now access ``blocks`` of ``request``: from here on only
        evidence can end it. Call it *before* the addresses leave the process.

        ``access`` is ``Access.WRITE`` unless given: a peer that writes into the blocks (push:
        prefill's transfer engine filling decode's pages). Pass ``Access.READ`` for a peer
        that only reads them (pull: decode reading prefill's blocks, as vLLM's NIXL path does;
        a peer copying a cached prefix out): read grants may be open on a shared block, write
        grants may not.

        ``request`` must be running and hold every block. A write grant is refused
        (``BlockUnavailable``) on a block another request holds (or, with the ledger's counts,
        that ``request`` holds shared); with ``counts="engine"`` also on a block any open grant
        covers, and a read grant on a block another request's open write grant covers."""
        request = inputs.request_key(request)
        peer = inputs.peer_id(peer)
        inputs.instance(access, Access, "access")
        deadline = inputs.optional_time(deadline, "deadline")
        try:
            with self._lock:
                req = self._table.get(request)
                if req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "grant")
                counts = self._blocks
                arr = counts.held_view(req, blocks)
                counts.check_grant(req, arr, access)
                if counts.tracking:
                    counts.count_open(arr, access)
                return self._table.open_grant(
                    req, peer, arr, counts.generation.take(arr), access, deadline
                )
        finally:
            if self._pending:
                self._flush()

    # =================================================================== the owner ends it

    def reject(self, request: RequestKey, reason: str = "rejected") -> list[Transition]:
        """The owner ended the request early (admission refusal, client abort, failure).

        The error response may go out now; nothing about the blocks changes. Evidence already
        gathered may fire further transitions inside this call.
        """
        request = inputs.request_key(request)
        inputs.text(reason, "reason")
        try:
            with self._lock:
                return self._table.end(request, "rejected", "reject")
        finally:
            if self._pending:
                self._flush()

    def reject_many(self, requests: Sequence[RequestKey], reason: str = "rejected") -> BatchOutcome:
        """``reject`` of many requests in one call (a step's aborts), as ``finish_many`` is
        ``finish``: each request rejected or refused on its own, in order, the outcome as data,
        refusals logged (``reject_refused``). A bad ``reason`` or a ``requests`` that is not a
        sequence raises ``InvalidField`` and changes nothing."""
        inputs.text(reason, "reason")
        return self._end_many(requests, "rejected", "reject")

    def finish(self, request: RequestKey) -> list[Transition]:
        """The normal end on the owner's side. Open grants still need their proof."""
        request = inputs.request_key(request)
        try:
            with self._lock:
                return self._table.end(request, "finished", "finish")
        finally:
            if self._pending:
                self._flush()

    def finish_many(self, requests: Sequence[RequestKey]) -> BatchOutcome:
        """``finish`` of many requests in one call: the requests a scheduler step ended.

        Each request is finished or refused on its own, in order, exactly as ``finish`` would
        be at that point (same checks, same typed error: ``UnknownRequest``, ``DoubleRelease``,
        ``IllegalTransition``, ``InvalidField``); a refused one changes nothing and is logged
        (``finish_refused``). Not all or nothing: one request's end does not depend on
        another's. Returns the transitions fired and the refusals as data, never raising for
        one bad item; a ``requests`` that is not a sequence raises ``InvalidField``. One lock
        for all.
        """
        return self._end_many(requests, "finished", "finish")

    def _end_many(self, requests: Sequence[RequestKey], event: str, cause: str) -> BatchOutcome:
        items = batch.items(requests, "requests", "request keys")
        fired: list[Transition] = []
        refused: list[Refusal] = []
        table = self._table
        try:
            with self._lock:
                for i, request in enumerate(items):
                    try:
                        fired += table.end(inputs.request_key(request), event, cause)
                    except UsageError as e:
                        refused.append(Refusal(i, request, e))
                        table.refused_item(cause, e, request)
            return BatchOutcome(tuple(fired), tuple(refused))
        finally:
            if self._pending:
                self._flush()

    # =================================================================== evidence

    def apply(self, evidence: Evidence) -> list[Transition]:
        """Add one piece of evidence; return the transitions it fired (in order).

        Stale, mismatched or contradictory evidence raises its typed error, is logged and
        counted, and changes nothing. Duplicates and late, weaker reports are no-ops.
        """
        try:
            with self._lock:
                try:
                    return proofs.apply(self._table, self._blocks, evidence)
                except EvidenceError as e:
                    proofs.refuse(self._table, e, evidence)
                    raise
        finally:
            if self._pending:
                self._flush()

    def apply_many(self, evidence: Sequence[Evidence]) -> BatchOutcome:
        """Add many pieces of evidence in one call: what a scheduler step learned (the
        transfers of many requests that completed).

        Each piece is about its own grant (or peer) and is applied or refused on its own, in
        order, exactly as ``apply`` would at that point (the same checks, the same typed
        ``EvidenceError``, logged as ``evidence_refused`` and counted in
        ``stats().refused_evidence``); a refused piece changes nothing. Not all or nothing: a
        forged or stale report must not stop the honest ones beside it. Returns the
        transitions fired and the refusals as data, never raising for one bad piece; an
        ``evidence`` that is not a sequence raises ``InvalidField``. One lock for all.
        """
        items = batch.items(evidence, "evidence", "evidence objects")
        fired: list[Transition] = []
        refused: list[Refusal] = []
        table, blocks = self._table, self._blocks
        try:
            with self._lock:
                # Closing a grant takes it off the per-block open-grant counters: the batch
                # takes every closed grant off in one write at its end instead of one per grant.
                blocks.defer_uncount()
                try:
                    for i, ev in enumerate(items):
                        try:
                            fired += proofs.apply(table, blocks, ev)
                        except EvidenceError as e:
                            proofs.refuse(table, e, ev)
                            refused.append(Refusal(i, ev, e))
                finally:
                    blocks.settle_uncount()
            return BatchOutcome(tuple(fired), tuple(refused))
        finally:
            if self._pending:
                self._flush()

    # =================================================================== deadlines

    def set_deadline(self, request: RequestKey, deadline: float | None) -> None:
        """Set (or clear) the request-wide deadline, on the caller's clock: a finite number,
        refused (``InvalidField``) when set, never later inside ``expire``."""
        request = inputs.request_key(request)
        deadline = inputs.optional_time(deadline, "deadline")
        with self._lock:
            table = self._table
            table.set_deadline(table.get(request), deadline)

    def expire(self, now: float) -> list[RequestKey]:
        """Quarantine ended requests with an open grant whose deadline is ``<= now``.

        The core never reads a clock: the caller passes it. A deadline that passes while the
        owner still runs marks the grant; the request is quarantined when the owner ends it.
        Returns the requests quarantined by this call.
        """
        now = inputs.finite_time(now, "now")
        try:
            with self._lock:
                return self._table.expire(now)
        finally:
            if self._pending:
                self._flush()

    # =================================================================== release

    def release(self, request: RequestKey) -> BlockIds:
        """Let go of the request's blocks; return those that went back to the pool (with
        ``counts="engine"``: every block it held, which the engine may now drop its own
        references to; a block no request holds any more has its generation bumped).

        Raises ``InsufficientEvidence`` (listing what is unproven, per grant) while any grant
        is open, ``IllegalTransition`` if the owner has not ended the request.
        """
        request = inputs.request_key(request)
        try:
            with self._lock:
                table = self._table
                req = table.get(request, ending=True)
                if req.state in _ENDED and req.open:
                    raise InsufficientEvidence(request, table.unproven(req))
                out: list[Transition] = []
                fire(table, req, "released", "release", out)
                return table.let_go([req], self._blocks, out)[0]
        finally:
            if self._pending:
                self._flush()

    def collect_releasable(self) -> dict[RequestKey, BlockIds]:
        """Release every request whose grants are all closed; return, per request, the block
        ids that went back to the pool. A scheduler calls this once per step: the per-block
        work of all of them is done in one batch."""
        try:
            with self._lock:
                return self._table.collect_releasable(self._blocks)
        finally:
            if self._pending:
                self._flush()

    def force_release(self, request: RequestKey, reason: str) -> BlockIds:
        """UNSAFE: release a request whose grants are not all closed. A peer may still write
        into the blocks returned. Logged at warning and counted in ``stats().unsafe_releases``.
        For a request whose grants are all closed it is an ordinary release."""
        request = inputs.request_key(request)
        inputs.text(reason, "reason")
        try:
            with self._lock:
                return self._table.force_release(self._blocks, request, reason)
        finally:
            if self._pending:
                self._flush()
