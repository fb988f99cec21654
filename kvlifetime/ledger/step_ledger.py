"""StepLedger: the step-columnar ledger a guard steps once per scheduler step (the engine's
counts), with ``BlockLedger``'s single calls as batches of one.

A guard's ledger work is a few batches per scheduler step: the step's grants, its ends, the
proofs of an output, a fence, what was released. Here each is one call over every request or
grant of the step, on ``StepRows``: grants are integer handles (rows), transitions are codes,
and no ``Grant``, evidence or ``Transition`` object is made on the way. Objects are built only
when someone asks (the read side, ``step_queries``: ``grant``, ``open_grants``, ``stats``) and
for the log events (noted only when structlog is configured, emitted after the lock is let go,
as ``BlockLedger``'s are).

Two kinds of calls, two kinds of values:

- the step calls (``grant_many``, ``grant_read``, ``end_many``, ``prove``, ``collect``) take the
  library's own values as they are (request keys the guard holds, grant handles it was given);
  the block ids come from the engine and are checked where they enter (``grant_many``: one
  check of the whole step's ids; each request's on its own only when that fails);
- the single calls (``acquire_and_grant``, ``finish``, ``reject``, ``set_deadline``,
  ``expire``, ``apply``, ``collect_releasable``) are ``BlockLedger``'s, with its arguments,
  its validation and its typed errors, each a batch of one through the same rows; they return
  a grant handle where ``BlockLedger`` returns a ``Grant``, and nothing where it returns the
  transitions fired (its log events are fewer: transitions, releases, refused evidence).

The rules are ``StepRows``', held to ``BlockLedger(counts="engine")`` step by step
(``tests/test_step_rows.py``), and this ledger to it call by call
(``tests/test_step_ledger.py``). What ``BlockLedger`` has and this one does not yet (the
ledger's own counts and its free list, ``after_restart``, snapshots and copies, the checked
mirror, ``force_release``) is the rest of the facade's move onto rows.
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlifetime import errors, inputs
from kvlifetime.errors import (
    ContradictoryEvidence,
    EvidenceError,
    KVLifetimeError,
    show,
)
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence, PeerLost
from kvlifetime.grant import Access, BlockIds, PeerId, RequestKey
from kvlifetime.ledger.block_rows import READ, WRITE
from kvlifetime.ledger.events import describe, emit, enabled, log, started
from kvlifetime.ledger.proofs import check_names, not_live
from kvlifetime.ledger.request_rows import CODE, EVENTS, STATES
from kvlifetime.ledger.step_queries import StepQueries
from kvlifetime.ledger.step_rows import StepRows
from kvlifetime.provenance import check_source
from kvlifetime.source import SourceKind
from kvlifetime.spec.proof import CODE_OF

__all__ = ["StepLedger"]

_QUARANTINED = CODE["quarantined"]
_ACCESS = {Access.READ: READ, Access.WRITE: WRITE}
_NO_IDS = np.empty(0, np.int64)
_NO_IDS.flags.writeable = False


class StepLedger(StepQueries):
    """The exposures of one engine's KV pool, stepped a scheduler step at a time (the engine's
    own reference counts decide when a block is free; the ledger guards exposure only).

    Thread safety: every call holds the one lock (but the guard's two readers of its own
    handles, ``is_open`` and ``blocks_under``, which read one list entry); evidence may arrive
    on another thread while the scheduler steps. Logging never runs under it."""

    def __init__(self, num_blocks: int, *, incarnation: str | None = None) -> None:
        num_blocks = inputs.count(num_blocks, "num_blocks", 1)
        if num_blocks >= 2**31:
            raise errors.InvalidField("num_blocks must be < 2**31")
        if incarnation is not None:
            incarnation = inputs.peer_id(incarnation, "incarnation")
        self.num_blocks = num_blocks
        # Random per instance: a grant id from another ledger or an earlier process never matches.
        self.incarnation = incarnation or uuid.uuid4().hex[:16]
        self.rows = StepRows(num_blocks, incarnation=self.incarnation)
        self._lock = threading.Lock()
        self._moves: list[tuple[int, int, int]] = []  # the call's transitions (under the lock)
        self._pending = []
        self.refused_evidence = collections.Counter()  # error kind -> count; only grows
        self.clock: float | None = None  # the last ``now`` given to ``expire``
        self.quarantined_since = {}  # key -> the clock when it was quarantined
        started(num_blocks, self.incarnation, "engine")

    # =================================================================== the step calls

    def grant_many(
        self,
        items: Sequence[tuple[Hashable, Sequence[int]]],
        peer: PeerId,
        access: Access,
    ) -> list[int | KVLifetimeError]:
        """Each request of ``items`` (new, or running) holds its block ids and gets one grant
        of ``access`` to ``peer`` over them, all or nothing per request, in order: the grant's
        handle, or the typed refusal (nothing changed for that request). Block ids that are
        not distinct integers in ``[0, num_blocks)`` are refused per request
        (``InvalidBlockIds``, ``BlockOutOfRange``, ``DuplicateBlockIds``)."""
        code = _ACCESS[access]
        peer = inputs.peer_id(peer)
        keys = [k for k, _ in items]
        lens = [len(ids) for _, ids in items]
        flat = list(itertools.chain.from_iterable(ids for _, ids in items))
        with self._lock:  # (the distinctness check writes the per-block scratch)
            allids, distinct = self._checked(flat, lens) if flat else (_NO_IDS, True)
            if allids is not None:
                out = self.rows.acquire_and_grant_many(keys, allids, lens, code, peer, distinct)
            else:
                out = self._grant_each(items, code, peer)
        if self._pending:
            self._emit()
        return out

    def _checked(
        self, flat: list[Any], lens: list[int]
    ) -> tuple[npt.NDArray[np.int64] | None, bool]:
        """The step's block ids as one read-only array when every one is a plain int in
        range, none repeated within its request (None: some request's are not; each is then
        checked on its own), and whether no id repeats at all (requests may share blocks: a
        prefix both read)."""
        if set(map(type, flat)) != {int}:
            return None, False
        try:
            arr = np.array(flat, dtype=np.int64)
        except OverflowError:  # an int past int64: the request's own check says which
            return None, False
        # Seen as unsigned, a negative id is huge: one reduction checks both ends.
        if int(np.maximum.reduce(arr.view(np.uint64))) >= self.num_blocks:
            return None, False
        distinct = self.rows.blocks.distinct(arr)
        if not distinct:
            seg = np.repeat(np.arange(len(lens)), lens)
            order = np.lexsort((arr, seg))
            a, s = arr[order], seg[order]
            if np.count_nonzero((a[1:] == a[:-1]) & (s[1:] == s[:-1])):
                return None, False
        arr.flags.writeable = False
        return arr, distinct

    def _grant_each(
        self, items: Sequence[tuple[Hashable, Sequence[int]]], code: int, peer: Hashable
    ) -> list[int | KVLifetimeError]:
        out: list[int | KVLifetimeError] = []
        rows = self.rows
        for key, ids in items:
            try:
                arr = inputs.block_ids(ids, self.num_blocks)
                out.append(rows.acquire_and_grant(key, arr, code, None, peer))
            except KVLifetimeError as e:
                out.append(e)
        return out

    def grant_read(self, key: Hashable, ids: npt.ArrayLike, peer: PeerId) -> int:
        """A READ grant over ``ids`` for a running request (admitted if new, as by
        ``BlockLedger.acquire``) that may hold some of them already (it holds the rest from now
        on), all or nothing: its handle, or the typed error (an ended request's is
        ``IllegalTransition``)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        peer = inputs.peer_id(peer)
        with self._lock:
            rows = self.rows
            slot = rows.slot_of.get(key)
            held = rows.blocks_of(key) if slot is not None else np.empty(0, np.int64)
            new = np.setdiff1d(arr, held, assume_unique=True)
            if len(new):
                rows.acquire(key, new)
            return rows.grant_on(key, arr, READ, peer)

    def end_many(
        self, keys: Sequence[Hashable], *, aborted: bool, reason: str = "rejected"
    ) -> list[tuple[int, KVLifetimeError]]:
        """Each request of ``keys`` ended (``rejected`` when ``aborted``, for ``reason``;
        else ``finished``), then its proof chain: the refused ones by position, with their
        typed error."""
        event = "rejected" if aborted else "finished"
        with self._lock:
            try:
                refused = self.rows.end(keys, event, self._moves)
            finally:
                self._note(reason if aborted else event)
        if self._pending:
            self._emit()
        return refused

    def prove(self, handles: Sequence[int], claim: type, fence: str | None = None) -> list[int]:
        """The evidence ``claim`` (an evidence class: ``TransferCompleted``, ``LeaseExpired``,
        ``AccessRevoked`` with ``fence``) about each grant of ``handles`` (open grants of live
        requests; seq 0), in order. Returns the positions refused (counted and logged)."""
        code = CODE_OF[claim]
        with self._lock:
            rows = self.rows
            refused = rows.prove(handles, code, [0] * len(handles), self._moves, fence)
            for i in refused:
                e = ContradictoryEvidence(
                    f"{claim.__name__} contradicts what is proven about grant "
                    f"{rows.grants.label(handles[i])}"
                )
                self._refuse(e, f"{claim.__name__} of {rows.grants.label(handles[i])}")
            self._note(claim.__name__)
        if self._pending:
            self._emit()
        return refused

    def collect(self) -> dict[Hashable, BlockIds]:
        """Release every request in ``transfer_quiesced``, in the order they reached it: the
        blocks each held (the engine drops its own references to them)."""
        rows = self.rows
        if not rows.releasable:
            return {}
        with self._lock:
            released = rows.collect(self._moves)
            self._note("collect_releasable")
            for key, ids in released.items():
                self.quarantined_since.pop(key, None)
                if enabled():
                    self._pending.append(
                        ("info", "request_released", {"request": key, "blocks": ids.tolist()})
                    )
        if self._pending:
            self._emit()
        return released

    # =================================================================== single calls

    def acquire_and_grant(
        self, request: RequestKey, ids: npt.ArrayLike, peer: PeerId, access: Access = Access.WRITE
    ) -> int:
        """``BlockLedger.acquire_and_grant``: ``request`` (new, or running) holds ``ids`` and
        gets one grant of ``access`` to ``peer`` over them, all or nothing: the handle."""
        key = inputs.request_key(request)
        peer = inputs.peer_id(peer)
        code = _ACCESS[inputs.instance(access, Access, "access")]
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self.rows.acquire_and_grant(key, arr, code, None, peer)

    def finish(self, request: RequestKey) -> None:
        """``BlockLedger.finish``: the request completed normally (its typed error raised,
        nothing changed, where it cannot)."""
        self._end_one(request, aborted=False, reason="finished")

    def reject(self, request: RequestKey, reason: str = "rejected") -> None:
        """``BlockLedger.reject``: the request is over, for ``reason``."""
        self._end_one(request, aborted=True, reason=inputs.text(reason, "reason"))

    def _end_one(self, request: RequestKey, *, aborted: bool, reason: str) -> None:
        key = inputs.request_key(request)
        refused = self.end_many([key], aborted=aborted, reason=reason)
        if refused:
            raise refused[0][1]

    def set_deadline(self, request: RequestKey, deadline: float | None) -> None:
        """``BlockLedger.set_deadline``: the request-wide deadline on the caller's clock (None:
        none); ``UnknownRequest`` for a key not live."""
        key = inputs.request_key(request)
        deadline = inputs.optional_time(deadline, "deadline")
        with self._lock:
            self.rows.set_deadline(key, deadline)

    def expire(self, now: float) -> list[RequestKey]:
        """``BlockLedger.expire``: every open grant past its deadline becomes suspect; the ended
        requests this quarantined, in the order they got a deadline."""
        now = inputs.finite_time(now, "now")
        with self._lock:
            self.clock = now
            out = self.rows.expire(now, self._moves)
            self._note("deadline")
        if self._pending:
            self._emit()
        return out  # type: ignore[return-value]  # the keys as they entered

    def collect_releasable(self) -> dict[Hashable, BlockIds]:
        """``BlockLedger.collect_releasable``: ``collect``."""
        return self.collect()

    def apply(self, evidence: Evidence) -> None:
        """``BlockLedger.apply``: one piece of evidence, checked whole before anything changes
        (who may say it, the grant it names in this incarnation, contradictions). Refused:
        its typed ``EvidenceError`` raised, counted in ``stats().refused_evidence`` and logged,
        nothing changed."""
        try:
            with self._lock:
                try:
                    self._apply(evidence)
                except EvidenceError as e:
                    self._refuse(e, describe(evidence))
                    raise
        finally:
            if self._pending:
                self._emit()

    def _apply(self, ev: Evidence) -> None:
        # On the type itself: a ``__class__`` property cannot pass a stranger off as evidence.
        if not issubclass(type(ev), Evidence):
            raise errors.MalformedEvidence(f"not evidence: {show(ev)}", evidence=ev)
        if ev.source.kind is not SourceKind.LOCAL:
            check_source(ev)
        code = next((CODE_OF[c] for c in type(ev).__mro__ if c in CODE_OF), None)
        if code is None:  # an abstract kind (``Evidence``, ``GrantEvidence``) proves nothing
            raise errors.MalformedEvidence(f"not a kind of evidence: {show(ev)}", evidence=ev)
        fence = ev.fence if isinstance(ev, AccessRevoked) else None
        rows = self.rows
        if isinstance(ev, GrantEvidence) or (
            isinstance(ev, AccessRevoked) and ev.grant_id is not None
        ):
            row = self._row_of(ev)
            seq = int(getattr(ev, "last_seq", 0) or getattr(ev, "through_seq", 0))
            if rows.prove([row], code, [seq], self._moves, fence):
                raise ContradictoryEvidence(
                    f"{ev.kind} contradicts what is proven about grant {rows.grants.label(row)}",
                    evidence=ev,
                )
        elif isinstance(ev, AccessRevoked | PeerLost):
            rows.prove_peer(ev.peer, code, fence, self._moves)
        else:  # pragma: no cover - every Evidence is one of the above
            raise errors.MalformedEvidence(f"not evidence: {show(ev)}", evidence=ev)
        self._note(type(ev).__name__)

    def _row_of(self, ev: GrantEvidence | AccessRevoked) -> int:
        """The row of the live grant ``ev`` names, or its typed refusal (as the object
        ledger's: ``proofs.not_live``, ``proofs.check_names``)."""
        gid = ev.grant_id
        assert gid is not None
        g = self.rows.grants
        row = g.row_of_serial.get(gid.serial) if gid.incarnation == self.incarnation else None
        if row is None:
            raise not_live(ev, self.incarnation, g.next_serial)
        check_names(ev, self.rows.key_of[g.req[row]], g.peer[row])  # type: ignore[arg-type]
        return row

    # =================================================================== log events

    def _note(self, cause: str) -> None:
        """The call's transitions: quarantines stamped with the clock, log events (when
        structlog is configured); the scratch list emptied."""
        moves = self._moves
        if not moves:
            return
        key_of = self.rows.key_of
        for slot, _, target in moves:
            if target == _QUARANTINED:
                self.quarantined_since[key_of[slot]] = self.clock
        if enabled():
            for slot, event, target in moves:
                self._pending.append(
                    (
                        "info",
                        "request_transition",
                        {
                            "request": key_of[slot],
                            "transition": EVENTS[event],
                            "to_state": STATES[target],
                            "cause": cause,
                        },
                    )
                )
        moves.clear()

    def _refuse(self, e: EvidenceError, evidence: object) -> None:
        self.refused_evidence[e.kind] += 1
        if enabled():
            self._pending.append(
                (
                    "warning",
                    "evidence_refused",
                    {"error": e.kind, "message": str(e), "evidence": evidence},
                )
            )

    def _emit(self) -> None:
        with self._lock:
            events = self._pending.copy()
            self._pending.clear()
        emit(log, events)
