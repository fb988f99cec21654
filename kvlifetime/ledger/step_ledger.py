"""StepLedger: the step-columnar ledger a guard steps once per scheduler step (the engine's
counts), with ``BlockLedger``'s read side.

A guard's ledger work is a few batches per scheduler step: the step's grants, its ends, the
proofs of an output, a fence, what was released. Here each is one call over every request or
grant of the step, on ``StepRows``: grants are integer handles (rows), transitions are codes,
and no ``Grant``, evidence or ``Transition`` object is made on the way. Objects are built only
when someone asks: ``grant`` (a handle as a ``Grant``), ``open_grants``, ``stats``, and the log
events (noted only when structlog is configured, emitted after the lock is let go, like
``BlockLedger``'s).

Two sides, two kinds of values:

- the step calls (``grant_many``, ``grant_read``, ``end_many``, ``prove``, ``collect``) are
  the guard core's: the requests and handles are the library's own values, taken as they
  are; the block ids come from the engine and are checked where they enter (``grant_many``:
  one check of the whole step's ids, each request checked on its own only when that fails);
- the queries (``state``, ``open_grants``, ``blocks_of``, ``unproven``, ``open_access``,
  ``block_state``, ``free_count``, ``stats``) are anyone's, from any thread: every argument
  validated, as ``BlockLedger``'s are.

The rules are ``StepRows``', held to ``BlockLedger(counts="engine")`` step by step
(``tests/test_step_rows.py``), and this ledger to it call by call
(``tests/test_step_ledger.py``). What ``BlockLedger`` has and this one does not (the ledger's
own counts, shared holds, deadlines and ``expire``, restart, snapshots, the checked mirror) is
the rest of the facade's move onto rows (issue 32).
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
from kvlifetime.errors import EvidenceError, KVLifetimeError, UnknownRequest
from kvlifetime.grant import Access, BlockIds, Grant, make_grant_id
from kvlifetime.ledger.block_rows import READ, WRITE
from kvlifetime.ledger.events import Event, emit, enabled, log, started
from kvlifetime.ledger.request_rows import CODE, EVENTS, STATES, Moves
from kvlifetime.ledger.step_rows import StepRows
from kvlifetime.ledger.values import LedgerStats, QuarantineInfo
from kvlifetime.spec.proof import CODE_OF
from kvlifetime.spec.vocabulary import BlockState, RequestState

__all__ = ["StepLedger"]

_ADMITTED = CODE["admitted"]
_QUARANTINED = CODE["quarantined"]
_ACCESS = {Access.READ: READ, Access.WRITE: WRITE}
_ACCESS_OF = {READ: Access.READ, WRITE: Access.WRITE}


class StepLedger:
    """The exposures of one engine's KV pool, stepped a scheduler step at a time (the engine's
    own reference counts decide when a block is free; the ledger guards exposure only)."""

    counts = "engine"
    OPEN_NONE = 0  # ``open_access`` codes, as ``BlockLedger``'s
    OPEN_READ = 1
    OPEN_WRITE = 2

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
        self._moves: Moves = []  # the transitions of the call in progress (under the lock)
        self._pending: list[Event] = []
        self.refused_evidence: collections.Counter[str] = collections.Counter()
        started(num_blocks, self.incarnation, "engine")

    # =================================================================== the step calls

    def grant_many(
        self,
        items: Sequence[tuple[Hashable, Sequence[int]]],
        peer: Hashable,
        access: Access,
    ) -> list[int | KVLifetimeError]:
        """Each request of ``items`` (new, or running) holds its block ids and gets one grant
        of ``access`` to ``peer`` over them, all or nothing per request, in order: the grant's
        handle, or the typed refusal (nothing changed for that request). Block ids that are
        not distinct integers in ``[0, num_blocks)`` are refused per request
        (``InvalidBlockIds``, ``BlockOutOfRange``, ``DuplicateBlockIds``)."""
        code = _ACCESS[access]
        keys = [k for k, _ in items]
        lens = [len(ids) for _, ids in items]
        flat = list(itertools.chain.from_iterable(ids for _, ids in items))
        allids = self._checked(flat, lens) if flat else np.empty(0, np.int64)
        with self._lock:
            if allids is not None:
                out = self.rows.acquire_and_grant_many(keys, allids, lens, code, peer)
            else:
                out = self._grant_each(items, code, peer)
        if self._pending:
            self._emit()
        return out

    def _checked(self, flat: list[Any], lens: list[int]) -> npt.NDArray[np.int64] | None:
        """The step's block ids as one read-only array when every one is a plain int in
        range, none repeated within its request (None: some request's are not; each is then
        checked on its own). Requests may share blocks (a prefix both read)."""
        if set(map(type, flat)) != {int}:
            return None
        arr = np.array(flat, dtype=np.int64)
        if int(arr.min()) < 0 or int(arr.max()) >= self.num_blocks:
            return None
        if not self.rows.blocks.distinct(arr):
            seg = np.repeat(np.arange(len(lens)), lens)
            order = np.lexsort((arr, seg))
            a, s = arr[order], seg[order]
            if np.count_nonzero((a[1:] == a[:-1]) & (s[1:] == s[:-1])):
                return None
        arr.flags.writeable = False
        return arr

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

    def grant_read(self, key: Hashable, ids: Sequence[int], peer: Hashable) -> int:
        """A READ grant over ``ids`` for a running request (admitted if new, as by
        ``BlockLedger.acquire``) that may hold some of them already (it holds the rest from now
        on), all or nothing: its handle, or the typed error (an ended request's is
        ``IllegalTransition``)."""
        arr = inputs.block_ids(list(ids), self.num_blocks)
        with self._lock:
            rows = self.rows
            slot = rows.slot_of.get(key)
            held = rows.blocks_of(key) if slot is not None else np.empty(0, np.int64)
            new = np.setdiff1d(arr, held, assume_unique=True)
            if len(new):
                rows.acquire(key, new)
            return rows.grant_on(key, arr, READ, peer)

    def end_many(
        self, keys: Sequence[Hashable], *, aborted: bool
    ) -> list[tuple[int, KVLifetimeError]]:
        """Each request of ``keys`` ended (``rejected`` when ``aborted``, else ``finished``),
        then its proof chain: the refused ones by position, with their typed error."""
        event = "rejected" if aborted else "finished"
        with self._lock:
            refused = self.rows.end(keys, event, self._moves)
            self._note(event)
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
                e = errors.ContradictoryEvidence(
                    f"{claim.__name__} contradicts what is proven about grant "
                    f"{rows.grants.label(handles[i])}"
                )
                self._refuse(e, claim.__name__, handles[i])
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
            if enabled():
                for key, ids in released.items():
                    self._pending.append(
                        ("info", "request_released", {"request": key, "blocks": ids.tolist()})
                    )
        if self._pending:
            self._emit()
        return released

    def _note(self, cause: str) -> None:
        """The call's transitions: log events (when structlog is configured); the scratch
        list emptied."""
        moves = self._moves
        if not moves:
            return
        if enabled():
            key_of = self.rows.key_of
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

    def _refuse(self, e: EvidenceError, kind: str, handle: int) -> None:
        self.refused_evidence[e.kind] += 1
        if enabled():
            self._pending.append(
                (
                    "warning",
                    "evidence_refused",
                    {"error": e.kind, "message": str(e), "evidence": kind, "grant": handle},
                )
            )

    def _emit(self) -> None:
        with self._lock:
            events = self._pending.copy()
            self._pending.clear()
        emit(log, events)

    # =================================================================== objects, when asked

    def grant(self, handle: int) -> Grant:
        """The grant of ``handle`` (a live grant's) as a ``Grant``: built now, for a reader."""
        g = self.rows.grants
        with self._lock:
            blocks = g.blocks[handle]
            return _grant(
                make_grant_id(self.incarnation, g.serial[handle]),
                self.rows.key_of[g.req[handle]],
                g.peer[handle],
                blocks,
                _readonly(self.rows.blocks.generation.take(blocks)),
                _ACCESS_OF[g.access[handle]],
            )

    def is_open(self, handle: int) -> bool:
        return self.rows.grants.open[handle]

    def blocks_under(self, handle: int) -> BlockIds:
        """The block ids of the grant ``handle`` (read-only)."""
        return self.rows.grants.blocks[handle]

    # =================================================================== queries

    def _slot(self, request: object) -> int:
        key = inputs.request_key(request)
        slot = self.rows.slot_of.get(key)
        if slot is None:
            raise UnknownRequest(key)
        return slot

    def state(self, request: Hashable) -> RequestState:
        """The request's state; ``UnknownRequest`` if not live."""
        with self._lock:
            return RequestState(STATES[self.rows.requests.state[self._slot(request)]])

    def live_requests(self) -> list[Hashable]:
        with self._lock:
            return list(self.rows.slot_of)

    def open_grants(self, request: Hashable) -> list[Grant]:
        """The request's open grants, in grant order (built now)."""
        with self._lock:
            self._slot(request)
            handles = self.rows.open_rows(inputs.request_key(request))
        return [self.grant(h) for h in handles]

    def blocks_of(self, request: Hashable) -> BlockIds:
        with self._lock:
            self._slot(request)
            return self.rows.blocks_of(inputs.request_key(request))

    def unproven(self, request: Hashable) -> dict[str, tuple[str, ...]]:
        """Each open grant of ``request`` and the claims it still misses (as
        ``BlockLedger.unproven``)."""
        with self._lock:
            self._slot(request)
            return self.rows.unproven(inputs.request_key(request))

    def open_access(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """Per block of ``ids``: ``OPEN_NONE``, ``OPEN_READ`` or ``OPEN_WRITE`` (as
        ``BlockLedger.open_access``)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self.rows.blocks.open_access(arr)

    def free_count(self) -> int:
        """Blocks the ledger does not guard (no request holds them)."""
        with self._lock:
            return int(np.count_nonzero(self.rows.blocks.sharers == 0))

    def block_state(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """The ``BlockState`` code of each block of ``ids`` (as ``BlockLedger.block_state``)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self._block_states().take(arr)

    def _block_states(self) -> npt.NDArray[np.uint8]:
        rows = self.rows
        n = self.num_blocks
        running = np.zeros(n, dtype=bool)
        opened = np.zeros(n, dtype=bool)
        quarantined = np.zeros(n, dtype=bool)
        state = rows.requests.state
        g = rows.grants
        for slot in rows.slot_of.values():
            if state[slot] == _ADMITTED:
                for arr in rows.held[slot]:
                    running[arr] = True
            for r in rows.grants_of[slot]:
                if g.open[r]:
                    opened[g.blocks[r]] = True
                    if state[slot] == _QUARANTINED:
                        quarantined[g.blocks[r]] = True
        held = rows.blocks.sharers > 0
        out = np.full(n, BlockState.QUIESCED, dtype=np.uint8)
        out[~held] = BlockState.FREE
        out[held & running & ~opened] = BlockState.OWNED
        out[held & running & opened] = BlockState.EXPOSED
        ended_open = held & ~running & opened
        out[ended_open & ~quarantined] = BlockState.DRAINING
        out[ended_open & quarantined] = BlockState.QUARANTINED
        return out

    def stats(self, now: float | None = None) -> LedgerStats:
        """The ledger's figures, as ``BlockLedger.stats`` gives them (no deadline is kept here:
        a quarantine's ``since`` is None)."""
        inputs.optional_time(now, "now")
        with self._lock:
            rows = self.rows
            counts = np.bincount(self._block_states(), minlength=len(BlockState))
            state = rows.requests.state
            by_req = collections.Counter(STATES[state[s]] for s in rows.slot_of.values())
            g = rows.grants
            return LedgerStats(
                num_blocks=self.num_blocks,
                blocks_by_state={s.label: int(counts[s]) for s in BlockState},
                requests_by_state={
                    s.value: by_req.get(s.value, 0)
                    for s in RequestState
                    if s is not RequestState.RELEASED
                },
                quarantined=tuple(
                    QuarantineInfo(
                        key,  # type: ignore[arg-type]  # a request key, as it entered
                        sum(len(a) for a in rows.held[slot]),
                        rows.quarantine_reason.get(slot, "deadline"),
                        None,
                        None,
                    )
                    for key, slot in rows.slot_of.items()
                    if state[slot] == _QUARANTINED
                ),
                unsafe_releases=rows.unsafe_releases,
                refused_evidence=dict(self.refused_evidence),
                open_grants=sum(
                    g.open[r] for s in rows.slot_of.values() for r in rows.grants_of[s]
                ),
                reclaimed_blocks=dict(rows.reclaimed),
            )


def _readonly(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    arr.flags.writeable = False
    return arr


def _grant(*fields: Any) -> Grant:
    """A ``Grant`` from the ledger's own values (checked when they entered), not re-checked."""
    g = object.__new__(Grant)
    names = ("id", "request", "peer", "blocks", "generations", "access")
    for name, value in zip(names, fields, strict=True):
        object.__setattr__(g, name, value)
    return g
