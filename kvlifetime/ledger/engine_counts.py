"""``EngineCounts``: the engine's own reference counts decide when a block is free
(``counts="engine"``).

The engine's allocator hands blocks out and takes them back; the ledger guards exposure only.
Any number of requests may hold a block (every hold is counted in ``sharers``, as a shared one
is with the ledger's counts); there is no exclusive owner and no free list (``allocate`` is
refused). A hold is refused where an open write grant covers a block (its content is
unsettled); a write grant where another request holds a block or any open grant covers it; a
read grant where another request's open write grant covers it. A block no request holds is not
guarded: its generation is bumped when its last holder lets go.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import BlockUnavailable, HolderLimit, show
from kvlifetime.grant import Access, BlockIds, RequestKey
from kvlifetime.ledger.batch import STEP_VIEWS, Holds, merge, views
from kvlifetime.ledger.blocks import MAX_SHARERS, BlockCounts, Counts
from kvlifetime.ledger.counters import Counts as CountArray
from kvlifetime.ledger.records import RequestRecord

# --------------------------------------------------------------------------- the rules
# The engine's per-block rules, over the arrays alone: ``EngineCounts`` (under records) and the
# step-columnar ``BlockRows`` (under rows) both call these, so the rules are written once.


def refuse_hold(
    sharers: npt.NDArray[np.uint16],
    unsettled: CountArray,
    arr: BlockIds,
    held: Sequence[BlockIds],
    holds: int,
    max_sharers: int,
    who: str = "the request",
) -> None:
    """A hold of ``arr`` by a request holding ``held``: ``BlockUnavailable`` where an open
    write grant covers a block (its content is unsettled) or the request holds one already,
    ``HolderLimit`` where a block has ``max_sharers`` holders (looked at only once there are
    that many ``holds``)."""
    writes = unsettled.take(arr)
    if np.count_nonzero(writes):
        raise BlockUnavailable(
            f"blocks {arr[writes > 0][:16].tolist()} are not settled: an open write grant "
            "may still change them: not held by another request"
        )
    holders = sharers.take(arr)
    # Only blocks someone holds can be held by the request already: O(batch + its own holds).
    if (
        held
        and np.count_nonzero(holders)
        and any(np.isin(arr, h, assume_unique=True).any() for h in held)
    ):
        raise BlockUnavailable(f"{who} already holds some of these blocks")
    if holds >= max_sharers and int(holders.max(initial=0)) >= max_sharers:
        raise HolderLimit(
            f"blocks {arr[holders >= max_sharers][:16].tolist()} already have "
            f"{max_sharers} holders (the counter's limit): not held by one more"
        )


def refuse_write_on_hold(
    sharers: npt.NDArray[np.uint16], readers: CountArray, arr: BlockIds
) -> None:
    """A write grant taken with its hold: no other holder, no open grant."""
    if np.count_nonzero(sharers.take(arr)):
        raise BlockUnavailable("a write grant on blocks another request holds")
    if np.count_nonzero(readers.take(arr)):
        raise BlockUnavailable("a write grant on blocks an open grant covers")


def refuse_grant(
    sharers: npt.NDArray[np.uint16],
    unsettled: CountArray,
    readers: CountArray,
    arr: BlockIds,
    write: bool,
    own_writes: Sequence[BlockIds],
) -> None:
    """A grant over blocks the request holds: a write grant only where it alone holds them and
    no open grant covers them; a read grant not where another request's open write grant
    covers them (``own_writes``: the blocks of the request's own open write grants)."""
    writes = unsettled.take(arr)
    if write:
        others = sharers.take(arr) > 1  # the request holds each block of arr
        if np.count_nonzero(others):
            raise BlockUnavailable(
                f"a write grant on blocks another request holds: {arr[others][:16].tolist()}"
            )
        covered = (writes != 0) | (readers.take(arr) != 0)
        if np.count_nonzero(covered):
            raise BlockUnavailable(
                f"a write grant on blocks an open grant covers: {arr[covered][:16].tolist()}"
            )
    elif np.count_nonzero(writes):
        # Rare: tell the request's own open write grants from another request's.
        own = np.zeros(len(arr), dtype=np.int64)
        for blocks in own_writes:
            own += np.isin(arr, blocks, assume_unique=True)
        foreign = writes > own
        if foreign.any():
            raise BlockUnavailable(
                "a read grant on blocks another request's open write grant covers: "
                f"{arr[foreign][:16].tolist()}"
            )


def fresh_allowed(
    sharers: npt.NDArray[np.uint16],
    unsettled: CountArray,
    readers: CountArray,
    allids: BlockIds,
    write: bool,
    max_sharers: int,
) -> bool:
    """New requests may each hold and be granted their part of ``allids`` (distinct): no open
    write grant on any block, none at the holder limit; for write grants, no holder and no
    open grant at all."""
    holders = sharers.take(allids)
    if np.count_nonzero(unsettled.take(allids)):
        return False
    if int(holders.max(initial=0)) >= max_sharers:
        return False
    return not write or not (np.count_nonzero(holders) or np.count_nonzero(readers.take(allids)))


def drop_holds(
    sharers: npt.NDArray[np.uint16], generation: npt.NDArray[np.uint32], held: Sequence[BlockIds]
) -> list[BlockIds]:
    """Each request of ``held`` (its blocks, each once) lets go of them; returns, per request,
    the blocks no request holds any more, which are not guarded: their generation is bumped.
    Where no block of them has a second holder (the common case, told by one gather), each
    drops to no holder in one write for all."""
    if len(held) > 1:
        allh = np.concatenate(held)
        if not len(allh) or int(sharers.take(allh).max()) == 1:
            sharers[allh] = 0
            generation[allh] += 1
            return list(held)
    gone: list[BlockIds] = []
    for ids in held:
        if len(ids):
            sharers[ids] -= 1  # one request holds a block once
            ids = ids[sharers.take(ids) == 0]
        gone.append(ids)
    unguarded = [g for g in gone if len(g)]
    if unguarded:
        generation[unguarded[0] if len(unguarded) == 1 else np.concatenate(unguarded)] += 1
    return gone


class EngineCounts(BlockCounts):
    """Per-block state by the engine's counts: holders and open grants, no owner."""

    __slots__ = ()

    counts: ClassVar[Counts] = "engine"
    all_shared: ClassVar[bool] = True
    allocates: ClassVar[bool] = False

    def __init__(self, num_blocks: int, max_sharers: int = MAX_SHARERS) -> None:
        # The open-grant counters are read by every acquire and grant: kept from the start.
        super().__init__(num_blocks, max_sharers, tracking=True)

    # ------------------------------------------------------------------ holds

    def check_hold(
        self,
        arr: BlockIds,
        req: RequestRecord | None,
        shared: bool,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        """Refuse a hold on ``arr`` where an open write grant covers a block (its content is
        unsettled), where ``req`` already holds one, or at the holder limit. Open read grants
        do not matter, whoever holds the block and whatever its state (``refuse_hold``)."""
        held = req.shared if req is not None else ()
        who = f"request {show(req.key)}" if req is not None else "the request"
        refuse_hold(
            self.sharers, self.unsettled, arr, held, self.shared_holds, self.max_sharers, who
        )

    def record_hold(self, req: RequestRecord, arr: BlockIds, shared: bool) -> None:
        self.sharers[arr] += 1
        self.shared_holds += 1
        req.shared.append(arr)

    def unmark(self, arr: BlockIds, shared: bool) -> None:
        pass  # check_hold marks nothing

    def check_write_on_hold(self, arr: BlockIds, shared: bool) -> None:
        refuse_write_on_hold(self.sharers, self.readers, arr)

    def check_hold_many(
        self,
        batch: Holds,
        reqs: Sequence[RequestRecord | None],
        shared: bool,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        allids, repeats = batch.allids, batch.repeats
        self.check_hold(allids, None, True, live)
        self._check_not_held_yet(allids, batch.keys, reqs, batch.starts, batch.lens)
        if repeats is not None:
            self.check_repeat_limit(repeats[1], repeats[3])

    def record_hold_many(self, batch: Holds, recs: Sequence[RequestRecord], shared: bool) -> None:
        allids, repeats, starts, lens = batch.allids, batch.repeats, batch.starts, batch.lens
        if repeats is None:
            self.sharers[allids] += 1
        else:
            np.add.at(self.sharers, allids, 1)
        self.shared_holds += len(recs)
        for req, view in zip(recs, views(allids, starts, lens), strict=True):
            req.shared.append(view)
            if len(req.shared) > STEP_VIEWS:
                self.shared_holds -= merge(req.shared)

    def _check_not_held_yet(
        self,
        allids: BlockIds,
        keys: Sequence[RequestKey],
        reqs: Sequence[RequestRecord | None],
        starts: Sequence[int],
        lens: Sequence[int],
    ) -> None:
        """``acquire_many``: refuse where a request already holds one of the blocks it asks
        for. Only blocks someone holds can be, and only requests that already hold something
        are looked at."""
        held = self.sharers.take(allids) > 0
        if not np.count_nonzero(held):
            return
        for key, req, a, n in zip(keys, reqs, starts, lens, strict=True):
            if req is None or not n or not np.count_nonzero(held[a : a + n]):
                continue
            mine = allids[a : a + n]
            if any(np.isin(mine, s, assume_unique=True).any() for s in req.shared):
                raise BlockUnavailable(f"request {show(key)} already holds some of these blocks")

    def fresh_holds_allowed(self, allids: BlockIds, shared: bool, write: bool) -> bool:
        return fresh_allowed(
            self.sharers, self.unsettled, self.readers, allids, write, self.max_sharers
        )

    def record_fresh_holds(
        self, recs: Sequence[RequestRecord], allids: BlockIds, parts: list[BlockIds]
    ) -> None:
        self.sharers[allids] += 1
        self.shared_holds += len(recs)
        for req, part in zip(recs, parts, strict=True):
            req.shared.append(part)

    def hold_batches(self, req: RequestRecord) -> list[BlockIds]:
        return req.shared

    def check_grant(self, req: RequestRecord, arr: BlockIds, access: Access) -> None:
        """``refuse_grant``, the request's own open write grants told apart."""
        own = (
            [rec.grant.blocks for rec in req.open.values() if rec.grant.access is Access.WRITE]
            if np.count_nonzero(self.unsettled.take(arr))
            else []
        )
        refuse_grant(self.sharers, self.unsettled, self.readers, arr, access is Access.WRITE, own)

    # ------------------------------------------------------------------ no free list

    def free_for_allocate(self) -> int:
        self.check_allocates()
        return 0

    def allocate(self, req: RequestRecord, n: int) -> BlockIds:
        self.check_allocates()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ release

    def let_go(
        self, reqs: Sequence[RequestRecord], reclaimed: collections.Counter[str]
    ) -> list[BlockIds]:
        """Drop the holds of ``reqs``; return every block each one held (the engine may drop
        its own references to them). A block no request holds any more is not guarded: its
        generation is bumped."""
        results = [req.all_blocks() for req in reqs]
        gone = drop_holds(self.sharers, self.generation, results)
        for req, freed in zip(reqs, gone, strict=True):
            self.shared_holds -= len(req.shared)
            if req.fenced_by is not None and len(freed):
                reclaimed[req.fenced_by] += len(freed)
        return results

    # ------------------------------------------------------------------ queries

    def holders(self, arr: BlockIds) -> npt.NDArray[np.int64]:
        return self.sharers.take(arr).astype(np.int64)

    def held(self) -> npt.NDArray[np.bool_]:
        held: npt.NDArray[np.bool_] = self.sharers > 0
        return held

    def count_free(self) -> int:
        return int(np.count_nonzero(self.sharers == 0))

    def owner_bytes(self) -> bytes:
        return b""  # no exclusive owner (the ledger's counts keep one: np.int32 bytes)
