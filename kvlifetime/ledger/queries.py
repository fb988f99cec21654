"""``BlockLedger``'s read side: queries, statistics, introspection and snapshots.

The base of ``BlockLedger`` (``facade``): every call here validates its arguments, takes the
ledger's lock and reads the parts (the per-block state, the request table); none changes
anything but ``open_access``, which may start keeping the per-block open-grant counters. Kept
apart from the calls that change the ledger so that each file reads as one concern; the API
reference lists these as ``BlockLedger``'s own.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvlifetime import errors, inputs
from kvlifetime.grant import BlockIds, Grant, GrantId, RequestKey
from kvlifetime.ledger.blocks import MAX_SHARERS, BlockCounts, Counts
from kvlifetime.ledger.events import Event
from kvlifetime.ledger.requests import RequestTable
from kvlifetime.ledger.values import (
    LedgerInternals,
    LedgerStats,
    QuarantineInfo,
    RequestInternals,
)
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.vocabulary import BlockState, RequestState

if TYPE_CHECKING:
    from kvlifetime.ledger.facade import BlockLedger

_QUARANTINED = RequestState.QUARANTINED.value
_RELEASED = RequestState.RELEASED.value


class MaxSharers:
    """``BlockLedger.MAX_SHARERS``: the uint16 counter's limit on the class; on a ledger, the
    limit its per-block state enforces (a test may lower it, on a subclass or an instance).

    Here, not beside the counts in ``blocks``: a data descriptor must stay interpreted (mypyc,
    the optional accelerator, compiles ``__get__`` but not ``__set__``)."""

    def __get__(self, obj: Any, owner: type | None = None) -> int:
        return MAX_SHARERS if obj is None else int(obj._blocks.max_sharers)

    def __set__(self, obj: Any, value: int) -> None:
        obj._blocks.max_sharers = value

    def __int__(self) -> int:
        return MAX_SHARERS


class _Queries:
    """What a ledger is made of, and every call that reads it (``BlockLedger``'s base)."""

    num_blocks: int
    checked: bool
    incarnation: str
    _lock: threading.Lock
    _blocks: BlockCounts
    _table: RequestTable
    _pending: list[Event]

    def _take(self, blocks: BlockCounts, table: RequestTable) -> None:
        self.num_blocks = blocks.num_blocks
        self.checked = table.checked
        self.counts: Counts = blocks.counts
        """``"ledger"``: a block is free when no request holds it in the ledger (the ledger
        owns the free list, or records exclusive acquires of free blocks). ``"engine"``: the
        engine's own reference counts decide when a block is free; the ledger guards exposure
        only (any number of requests may hold a block; ``allocate`` is refused)."""
        self.incarnation = table.incarnation
        self._lock = threading.Lock()
        self._blocks = blocks
        self._table = table
        # Log events noted under the lock (the table's list), emitted by ``_flush`` once it is
        # released: a log processor may call back into the ledger (``stats()``, from any
        # thread) without a deadlock.
        self._pending = table.pending

    # =================================================================== queries

    def state(self, request: RequestKey) -> RequestState:
        """The request's state; ``UnknownRequest`` if it was never admitted or was released
        (a query is not a release: never ``DoubleRelease``)."""
        request = inputs.request_key(request)
        with self._lock:
            return RequestState(self._table.get(request).state)

    def live_requests(self) -> list[RequestKey]:
        with self._lock:
            return list(self._table.requests)

    def blocks_of(self, request: RequestKey) -> BlockIds:
        """Every block the request holds (exclusive first, then shared)."""
        request = inputs.request_key(request)
        with self._lock:
            return self._table.get(request).all_blocks()

    def grants_of(self, request: RequestKey) -> list[Grant]:
        request = inputs.request_key(request)
        with self._lock:
            return [r.grant for r in self._table.get(request).grants.values()]

    def open_grants(self, request: RequestKey) -> list[Grant]:
        request = inputs.request_key(request)
        with self._lock:
            return [r.grant for r in self._table.get(request).open.values()]

    def proof_of(self, grant: Grant | GrantId) -> GrantProof:
        """A copy of what has been proven about a live grant."""
        gid = grant.id if isinstance(grant, Grant) else grant
        inputs.instance(gid, GrantId, "grant")
        with self._lock:
            table = self._table
            rec = (
                table.grants.records.get(gid.serial)
                if gid.incarnation == self.incarnation
                else None
            )
            if rec is None:
                raise errors.UnknownGrant(f"no live grant {gid}")
            return rec.copy()

    def unproven(self, request: RequestKey) -> dict[str, tuple[str, ...]]:
        """What is still unproven before ``request`` may be released: each open grant (as
        ``"incarnation#serial (peer)"``) and the claims it still misses, the same mapping as
        ``InsufficientEvidence.unproven`` (tuples in both). Empty: every grant is closed."""
        request = inputs.request_key(request)
        with self._lock:
            table = self._table
            return table.unproven(table.get(request))

    def generation(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint32]:
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self._blocks.generation.take(arr)

    def holders(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self._blocks.holders(arr)

    OPEN_NONE = 0
    """``open_access``: no open grant covers the block."""
    OPEN_READ = 1
    """``open_access``: open grants cover the block, read grants only."""
    OPEN_WRITE = 2
    """``open_access``: an open write grant covers the block."""

    def open_access(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """Per block of ``ids``: ``OPEN_NONE`` (0) no open grant covers it, ``OPEN_READ`` (1)
        only read grants, ``OPEN_WRITE`` (2) an open write grant (of any request, running or
        ended). An engine calls it on blocks it is about to hand out, to detect the reuse of an
        exposed block. O(len(ids)): read from the per-block grant counters (built from the open
        grants at the first call, or the first shared acquire, then kept up to date)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self._blocks.open_access(arr, self._table.requests)

    def free_count(self) -> int:
        """Blocks no request holds (with ``counts="engine"``: that the ledger does not guard)."""
        with self._lock:
            return self._blocks.count_free()

    def block_state(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """The state of each block of ``ids``, derived from holders and open grants, as an
        array of ``BlockState`` codes (``uint8``, one per id: a batch stays an array).
        ``BlockState`` is an ``IntEnum``, so the codes compare with its members directly
        (``ledger.block_state(ids) == BlockState.QUARANTINED``) and ``BlockState(code)`` names
        one. A block no request holds is ``FREE`` (with ``counts="engine"``: not guarded, the
        engine may do with it what it likes)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self._blocks.derive_states(self._table.requests).take(arr)

    def stats(self, now: float | None = None) -> LedgerStats:
        now = inputs.optional_time(now, "now")
        with self._lock:
            table = self._table
            live = table.requests
            counts = np.bincount(self._blocks.derive_states(live), minlength=len(BlockState))
            by_req: collections.Counter[str] = collections.Counter(r.state for r in live.values())
            quarantined = tuple(
                QuarantineInfo(
                    r.key,
                    r.nblocks(),
                    r.quarantine_reason or "deadline",
                    r.quarantined_at,
                    None if now is None or r.quarantined_at is None else now - r.quarantined_at,
                )
                for r in live.values()
                if r.state == _QUARANTINED
            )
            return LedgerStats(
                num_blocks=self.num_blocks,
                blocks_by_state={s.label: int(counts[s]) for s in BlockState},
                requests_by_state={
                    s.value: by_req.get(s.value, 0) for s in RequestState if s.value != _RELEASED
                },
                quarantined=quarantined,
                unsafe_releases=table.unsafe_releases,
                refused_evidence=dict(table.refused),
                open_grants=sum(len(r.open) for r in live.values()),
                reclaimed_blocks=dict(table.reclaimed),
            )

    def inspect(self) -> LedgerInternals:
        """A copy of what the ledger keeps inside, as data: the per-block arrays and counters,
        the live requests and the table's bookkeeping (for tests, debugging and memory
        figures; not part of the contract: the fields follow the implementation)."""
        with self._lock:
            table = self._table
            return LedgerInternals(
                counts=self.counts,
                **self._blocks.arrays(),
                requests={
                    k: RequestInternals(r.state, r.deadline, tuple(r.excl), tuple(r.shared))
                    for k, r in table.requests.items()
                },
                releasable=tuple(table.releasable),
                timed=tuple(table.timed),
                recently_released=tuple(table.recently_released),
                next_slot=table.next_slot,
                next_serial=table.grants.next_serial,
                clock=table.clock,
                pending_events=len(table.pending),
                sizes=table.sizes() | self._blocks.sizes(),
            )

    # =================================================================== exploration support

    def copy(self) -> BlockLedger:
        """An independent deep copy (same incarnation): for exploration and what-if checks."""
        with self._lock:
            new = cast("BlockLedger", object.__new__(type(self)))
            new._take(self._blocks.copy(), self._table.copy())
            return new

    def fingerprint(self) -> tuple[Any, ...]:
        """The whole observable state as a hashable value (grant serials included)."""
        with self._lock:
            table = self._table
            owner, sharers, generation = self._blocks.fingerprint()
            return (
                self.counts,
                owner,
                sharers,
                generation,
                table.fingerprint(),
                table.grants.next_serial,
                table.unsafe_releases,
            )
