"""Per-block state: one interface (``BlockCounts``), two implementations.

Whose reference counts decide when a block is free (``BlockLedger(counts=...)``):

- ``LedgerCounts`` (``ledger_counts.py``, ``counts="ledger"``): the ledger's own. A block is
  free when no request holds it in the ledger; the ledger records exclusive acquires of free
  blocks, shared acquires of held ones, and may own the free list (``allocate``).
- ``EngineCounts`` (``engine_counts.py``, ``counts="engine"``): the engine's. Any number of
  requests may hold a block; the ledger guards exposure only and never hands blocks out.

The facade (``BlockLedger``) validates every argument and holds the lock; the methods here take
validated values (read-only int64 arrays of distinct ids in range, records of live requests)
and are called under that lock.

What is stored per block, and why only that (12 bytes a block with the ledger's counts, 16 once
``allocate`` is used; 8 with the engine's):

- ``sharers`` (uint16): how many requests hold it shared (prefix-cache hits); with the engine's
  counts how many requests hold it at all. It never wraps: the acquire that would make it
  65,536 is refused (``HolderLimit``, ``MAX_SHARERS``).
- ``unsettled`` / ``readers`` (uint8 each; widened to uint16, then uint32, before a block's
  count could reach the dtype's limit, ``counters``): how many open write / read grants cover
  the block. An open write grant makes its content unsettled (not shareable); open read grants
  never do, whether their request runs or has ended (draining, quarantined): a reader does not
  change the content. A shared acquire and ``open_access`` read them for their batch only, so
  their cost does not grow with the number of live sharers or grants. With the ledger's counts
  they are kept from the first shared acquire or ``open_access`` on (``tracking``; built then
  from the open grants, once): a ledger that does neither never pays for them on the grant /
  evidence hot path. With the engine's counts they are kept from the start. Each count is at
  most the number of grants of its access counted, so below the dtype's limit the widening
  check is one int compare; only past it does a grant look at its blocks' counts (and a
  block's 2**32-1st open grant of one access is refused: ``HolderLimit``).
- ``generation`` (uint32): bumped by one each time the block returns to the pool (with the
  engine's counts: each time no request holds it any more), so a grant (which records
  generations) can never be mistaken for one about the block's next use.
- ``LedgerCounts`` adds ``owner`` (int32, the slot of the exclusive holder, ``FREE`` or
  ``ORPHANED``) and, once ``allocate`` is called, ``free_stack`` (int32, the free list).

Everything else about a block (owned / exposed / draining / quiesced / quarantined) follows from
its holders' request states and open grants, so it is derived when asked (``derive_states``)
instead of being written on every transition.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from kvlifetime import inputs
from kvlifetime.errors import BlockUnavailable, HolderLimit, WrongCountsMode, show
from kvlifetime.grant import Access, BlockIds, RequestKey
from kvlifetime.ledger.batch import Holds
from kvlifetime.ledger.counters import Counts as CountArray
from kvlifetime.ledger.counters import counted, narrowest, take_off
from kvlifetime.ledger.records import GrantRecord, RequestRecord
from kvlifetime.ledger.snapshot import copy_slots
from kvlifetime.spec.vocabulary import BlockState, RequestState

FREE = -1
ORPHANED = -2

Counts = Literal["ledger", "engine"]
"""Whose reference counts decide when a block is free (``BlockLedger(counts=...)``)."""
COUNTS: tuple[Counts, ...] = ("ledger", "engine")

MAX_SHARERS = int(np.iinfo(np.uint16).max)

_ADMITTED = RequestState.ADMITTED.value
_QUARANTINED = RequestState.QUARANTINED.value


def block_states(
    held: npt.NDArray[np.bool_],
    running: npt.NDArray[np.bool_],
    opened: npt.NDArray[np.bool_],
    quarantined: npt.NDArray[np.bool_],
) -> npt.NDArray[np.uint8]:
    """The ``BlockState`` code of every block, from four masks: held by a request, held by a
    running one, under an open grant, under an open grant of a quarantined request. The one
    rule both ledgers (records and rows) derive their block states by."""
    out = np.full(len(held), BlockState.QUIESCED, dtype=np.uint8)
    out[~held] = BlockState.FREE
    out[held & running & ~opened] = BlockState.OWNED
    out[held & running & opened] = BlockState.EXPOSED
    ended_open = held & ~running & opened
    out[ended_open & ~quarantined] = BlockState.DRAINING
    out[ended_open & quarantined] = BlockState.QUARANTINED
    return out


class BlockCounts(metaclass=abc.ABCMeta):
    """The per-block state of one pool (see the module docstring): what both implementations
    keep (holders counted in ``sharers``, generations, the open-grant counters) and the
    interface the facade calls, under its lock, with validated values."""

    __slots__ = (
        "generation",
        "max_sharers",
        "num_blocks",
        "open_reads",
        "open_writes",
        "readers",
        "shared_holds",
        "sharers",
        "tracking",
        "uncounted",
        "unsettled",
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> BlockCounts:
        # A blank instance for ``snapshot.copy_slots``: compiled by mypyc (the optional
        # accelerator), the class is created blank only by a ``__new__`` of its own.
        return object.__new__(cls)

    counts: ClassVar[Counts]
    """Which implementation this is (``BlockLedger.counts``)."""
    all_shared: ClassVar[bool]
    """Every hold is counted like a shared one (``acquire``'s ``shared`` makes no difference)."""
    allocates: ClassVar[bool]
    """``allocate`` may hand out fresh blocks (the ledger may own the free list)."""

    def __init__(self, num_blocks: int, max_sharers: int, *, tracking: bool) -> None:
        self.num_blocks = num_blocks
        self.max_sharers = max_sharers  # at most MAX_SHARERS (the sharers dtype's limit)
        self.sharers = np.zeros(num_blocks, dtype=np.uint16)
        self.generation = np.zeros(num_blocks, dtype=np.uint32)
        # Open write / read grants per block (uint8, widened before a count could wrap).
        self.unsettled: CountArray = np.zeros(num_blocks, np.uint8)
        self.readers: CountArray = np.zeros(num_blocks, np.uint8)
        self.open_writes = 0  # open write grants counted in unsettled (while tracking)
        self.open_reads = 0  # open read grants counted in readers (while tracking)
        self.tracking = tracking  # the two counters above are kept up to date
        # Inside a batch of evidence (``defer_uncount``): grants closed whose counts are not
        # yet taken off. None otherwise.
        self.uncounted: list[GrantRecord] | None = None
        self.shared_holds = 0  # live shared acquisitions; 0 lets release skip sharers

    # ------------------------------------------------------------------ the interface

    @abc.abstractmethod
    def check_hold(
        self,
        arr: BlockIds,
        req: RequestRecord | None,
        shared: bool,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        """``acquire``'s refusals of ``arr`` for ``req`` (``None``: not admitted yet). An
        exclusive hold that passes leaves the blocks marked (not free) until ``record_hold``
        writes their owner or ``unmark`` clears them. ``live``: every live request (to build
        the grant counters, the first time they are needed)."""

    @abc.abstractmethod
    def record_hold(self, req: RequestRecord, arr: BlockIds, shared: bool) -> None:
        """Count the hold ``check_hold`` allowed."""

    @abc.abstractmethod
    def unmark(self, arr: BlockIds, shared: bool) -> None:
        """Undo what ``check_hold`` left (the hold was refused after it, by admission)."""

    @abc.abstractmethod
    def check_write_on_hold(self, arr: BlockIds, shared: bool) -> None:
        """``acquire_and_grant`` with a write grant: what ``check_grant`` refuses on blocks the
        request holds once its hold of ``arr`` is recorded (the hold checks have already
        refused an open write grant on any of them)."""

    @abc.abstractmethod
    def check_hold_many(
        self,
        batch: Holds,
        reqs: Sequence[RequestRecord | None],
        shared: bool,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        """``acquire_many``'s refusals, for every request of ``batch`` at once (``reqs``: each
        one's record, ``None`` when not admitted yet)."""

    @abc.abstractmethod
    def record_hold_many(self, batch: Holds, recs: Sequence[RequestRecord], shared: bool) -> None:
        """Count the holds ``check_hold_many`` allowed."""

    @abc.abstractmethod
    def fresh_holds_allowed(self, allids: BlockIds, shared: bool, write: bool) -> bool:
        """Whether requests not admitted yet may each hold their part of ``allids`` (distinct
        ids) with a grant of their own (a write grant if ``write``), where none of the single
        calls would be refused: ``acquire_and_grant_many``'s vectorized path. False when in
        doubt (each item is then taken on its own)."""

    @abc.abstractmethod
    def record_fresh_holds(
        self, recs: Sequence[RequestRecord], allids: BlockIds, parts: list[BlockIds]
    ) -> None:
        """Count the holds ``fresh_holds_allowed`` allowed: ``recs[i]`` holds ``parts[i]``."""

    @abc.abstractmethod
    def check_grant(self, req: RequestRecord, arr: BlockIds, access: Access) -> None:
        """``grant``'s refusals of ``access`` to ``arr`` (blocks ``req`` holds)."""

    @abc.abstractmethod
    def hold_batches(self, req: RequestRecord) -> list[BlockIds]:
        """The batches ``req``'s holds are recorded in (where ``grant`` finds a held batch)."""

    @abc.abstractmethod
    def let_go(
        self, reqs: Sequence[RequestRecord], reclaimed: collections.Counter[str]
    ) -> list[BlockIds]:
        """Drop the holds of ``reqs`` (forgotten); return, per request, the blocks ``release``
        returns. Blocks that go back to the pool have their generation bumped; those a fence
        made possible are counted in ``reclaimed`` under the fence's name."""

    def check_allocates(self) -> None:
        """Refuse ``allocate`` (``WrongCountsMode``) unless this ledger may hand out fresh
        blocks (own the free list)."""
        if not self.allocates:
            raise WrongCountsMode(
                f"counts={self.counts!r}: the engine's allocator hands out blocks in this mode; "
                "record what it handed out with acquire"
            )

    @abc.abstractmethod
    def free_for_allocate(self) -> int:
        """How many blocks ``allocate`` may hand out now."""

    @abc.abstractmethod
    def allocate(self, req: RequestRecord, n: int) -> BlockIds:
        """Take ``n`` fresh blocks (at most ``free_for_allocate``) for ``req``."""

    @abc.abstractmethod
    def holders(self, arr: BlockIds) -> npt.NDArray[np.int64]:
        """How many requests hold each block of ``arr``."""

    @abc.abstractmethod
    def held(self) -> npt.NDArray[np.bool_]:
        """Per block: whether any request holds it."""

    @abc.abstractmethod
    def count_free(self) -> int:
        """Blocks no request holds."""

    @abc.abstractmethod
    def owner_bytes(self) -> bytes:
        """The exclusive owners as bytes (part of ``fingerprint``; empty when not kept)."""

    def held_view(self, req: RequestRecord, blocks: object) -> BlockIds:
        """``grant``'s ``blocks`` (the caller's value) as a read-only array, refused unless
        ``req`` holds every one of them. A batch ``req`` holds (the array itself, or one of
        the same bytes and shape) is taken as it is, with no further check."""
        if isinstance(blocks, np.ndarray):
            batches = self.hold_batches(req)
            for a in batches:
                if blocks is a:
                    return a
            # Same bytes as a held batch, and the same shape: a 2-d or 0-d array is refused below.
            raw = blocks.tobytes() if blocks.dtype == np.int64 and blocks.ndim == 1 else None
            if raw is not None:
                for a in batches:
                    if len(a) == len(blocks) and a.tobytes() == raw:
                        return a
        arr = inputs.block_ids(blocks, self.num_blocks)
        held = req.all_blocks()
        if not np.isin(arr, held, assume_unique=True).all():
            missing = arr[~np.isin(arr, held)]
            raise BlockUnavailable(
                f"request {show(req.key)} does not hold blocks {missing[:16].tolist()}"
            )
        return arr

    # ------------------------------------------------------------------ grant counters

    def start_tracking(self, live: Iterable[RequestRecord]) -> None:
        """Build ``unsettled`` and ``readers`` from the open grants of ``live`` (once: at the
        first shared acquire or ``open_access``) and keep them up to date from then on."""
        writes = np.zeros(self.num_blocks, dtype=np.int64)
        reads = np.zeros(self.num_blocks, dtype=np.int64)
        nw = nr = 0
        for req in live:
            for rec in req.open.values():
                if rec.grant.access is Access.WRITE:
                    writes[rec.grant.blocks] += 1  # a grant's blocks are distinct
                    nw += 1
                else:
                    reads[rec.grant.blocks] += 1
                    nr += 1
        self.unsettled, self.open_writes = narrowest(writes), nw
        self.readers, self.open_reads = narrowest(reads), nr
        self.tracking = True

    def count_open(self, arr: BlockIds, access: Access) -> None:
        """Count one more open grant of ``access`` on ``arr`` (distinct ids). Widens the counter
        first where a block could reach its dtype's limit; ``HolderLimit``, with nothing
        changed, only where a block already has 2**32-1 open grants of that access."""
        if access is Access.WRITE:
            self.unsettled = counted(self.unsettled, arr, self.open_writes)
            self.open_writes += 1
        else:
            self.readers = counted(self.readers, arr, self.open_reads)
            self.open_reads += 1

    def count_open_many(self, allids: BlockIds, access: Access, grants: int) -> None:
        """``count_open`` of ``grants`` grants of ``access`` whose blocks together are
        ``allids`` (distinct): one write. ``HolderLimit``, with nothing changed, as there."""
        if access is Access.WRITE:
            self.unsettled = counted(self.unsettled, allids, self.open_writes)
            self.open_writes += grants
        else:
            self.readers = counted(self.readers, allids, self.open_reads)
            self.open_reads += grants

    def uncount_open(self, rec: GrantRecord) -> None:
        """A counted grant closed (or was forgotten open): take it off the counters."""
        if self.uncounted is not None:
            self.uncounted.append(rec)  # the batch takes them all off at its end
            return
        if rec.grant.access is Access.WRITE:
            self.unsettled[rec.grant.blocks] -= 1
            self.open_writes -= 1
        else:
            self.readers[rec.grant.blocks] -= 1
            self.open_reads -= 1

    def defer_uncount(self) -> None:
        """A batch of evidence starts: grants it closes are taken off the counters in one write
        at its end (``settle_uncount``). Evidence never reads the counters (only acquire, grant
        and open_access do, which cannot run while the lock is held), so the counts are the
        same when the lock is let go."""
        self.uncounted = [] if self.tracking else None

    def settle_uncount(self) -> None:
        closed, self.uncounted = self.uncounted, None
        if closed:
            self._uncount_all(closed)

    def _uncount_all(self, recs: Sequence[GrantRecord]) -> None:
        """``uncount_open`` of every record, one write per access kind. A block in several of
        the grants was counted once per grant and is taken off as many times."""
        for access in Access:
            arrs = [r.grant.blocks for r in recs if r.grant.access is access]
            if not arrs:
                continue
            take_off(self.unsettled if access is Access.WRITE else self.readers, arrs)
            if access is Access.WRITE:
                self.open_writes -= len(arrs)
            else:
                self.open_reads -= len(arrs)

    def open_access(
        self, arr: BlockIds, live: Mapping[RequestKey, RequestRecord]
    ) -> npt.NDArray[np.uint8]:
        """Per block of ``arr``: 0 no open grant covers it, 1 only read grants, 2 an open write
        grant (``BlockLedger.OPEN_*``)."""
        if not self.tracking:
            self.start_tracking(live.values())
        out: npt.NDArray[np.uint8] = (self.readers.take(arr) != 0).astype(np.uint8)
        out[self.unsettled.take(arr) != 0] = 2
        return out

    def check_repeat_limit(self, ids: BlockIds, times: npt.NDArray[np.int64]) -> None:
        """``acquire_many``: blocks ``ids`` are taken by ``times`` requests of one call; refuse
        if that would pass the holder limit (each alone was checked below it)."""
        over = self.sharers.take(ids).astype(np.int64) + times > self.max_sharers
        if over.any():
            raise HolderLimit(
                f"blocks {ids[over][:16].tolist()} would have more than {self.max_sharers} "
                "holders (the counter's limit): not held by one more"
            )

    # ------------------------------------------------------------------ derived, snapshots

    def derive_states(self, live: Mapping[RequestKey, RequestRecord]) -> npt.NDArray[np.uint8]:
        """``BlockState`` codes of every block, from its holders and the open grants."""
        n = self.num_blocks
        running = np.zeros(n, dtype=bool)
        opened = np.zeros(n, dtype=bool)
        quarantined = np.zeros(n, dtype=bool)
        for req in live.values():
            if req.state == _ADMITTED:
                for a in req.excl + req.shared:
                    running[a] = True
            for rec in req.open.values():
                opened[rec.grant.blocks] = True
                if req.state == _QUARANTINED:
                    quarantined[rec.grant.blocks] = True
        return block_states(self.held(), running, opened, quarantined)

    def copy(self) -> BlockCounts:
        """An independent copy (``snapshot.copy_slots``: every field, by its kind)."""
        assert self.uncounted is None  # only set inside a batch, which holds the lock
        return copy_slots(self)

    def fingerprint(self) -> tuple[bytes, bytes, bytes]:
        """The observable per-block state: owners, holders, generations."""
        return self.owner_bytes(), self.sharers.tobytes(), self.generation.tobytes()

    def sizes(self) -> dict[str, int]:
        """Entries of each cache (``BlockLedger.inspect``)."""
        return {}

    def arrays(self) -> dict[str, Any]:
        """Copies of the per-block arrays and counts, by name (``BlockLedger.inspect``)."""
        return {
            "owner": None,
            "sharers": self.sharers.copy(),
            "generation": self.generation.copy(),
            "unsettled": self.unsettled.copy(),
            "readers": self.readers.copy(),
            "tracking": self.tracking,
            "open_writes": self.open_writes,
            "open_reads": self.open_reads,
            "free_stack": None,
            "free_top": 0,
        }
