"""``LedgerCounts``: the ledger's own counts decide when a block is free (``counts="ledger"``).

A block is acquired exclusively while it is free (its ``owner`` is the holder's slot), or
shared while it is held and settled (``sharers`` counts the shared holders). It returns to the
pool when its last holder lets go and no grant that touches it is open. From the first
``allocate`` on, the ledger owns the free list (``free_stack``): fresh blocks come from it.

``owner`` (int32) holds the slot of the request that acquired the block exclusively, ``FREE``
(-1) when it is in the pool, ``ORPHANED`` (-2) when its exclusive holder released it while
shared holders remain. ``FREE`` is the only state in which a block may be handed out fresh.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import BlockUnavailable, DuplicateBlockIds, HolderLimit, show
from kvlifetime.grant import Access, BlockIds, RequestKey
from kvlifetime.ledger.batch import STEP_VIEWS, Holds, merge, views
from kvlifetime.ledger.blocks import (
    FREE,
    MAX_SHARERS,
    ORPHANED,
    BlockCounts,
    Counts,
)
from kvlifetime.ledger.records import RequestRecord

_OWNS_FREE_LIST = (
    "this ledger owns the free list (allocate was called): take fresh blocks with allocate; "
    "acquire(shared=True) shares held ones"
)


def _empty() -> BlockIds:
    return np.empty(0, dtype=np.int64)


class LedgerCounts(BlockCounts):
    """Per-block state by the ledger's own counts: exclusive owners, shared holders, the free
    list once ``allocate`` is used."""

    __slots__ = ("free_stack", "free_top", "marks", "owner", "patterns")

    counts: ClassVar[Counts] = "ledger"
    all_shared: ClassVar[bool] = False
    allocates: ClassVar[bool] = True

    def __init__(self, num_blocks: int, max_sharers: int = MAX_SHARERS) -> None:
        super().__init__(num_blocks, max_sharers, tracking=False)
        self.owner = np.full(num_blocks, FREE, dtype=np.int32)
        self.free_stack: npt.NDArray[np.int32] | None = None  # built by the first allocate
        self.free_top = 0
        self.patterns: dict[int, bytes] = {}  # n -> n FREE owners as bytes (a cache)
        self.marks = np.empty(0, dtype=np.int32)  # distinct markers below ORPHANED

    # ------------------------------------------------------------------ holds

    def check_hold(
        self,
        arr: BlockIds,
        req: RequestRecord | None,
        shared: bool,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        if shared:
            self._check_shareable(arr, req, live)
            return
        if self.free_stack is not None:
            raise BlockUnavailable(_OWNS_FREE_LIST)
        self._mark_free_unique(arr)

    def record_hold(self, req: RequestRecord, arr: BlockIds, shared: bool) -> None:
        if shared:
            self.sharers[arr] += 1
            self.shared_holds += 1
            req.shared.append(arr)
        else:
            self.owner[arr] = req.slot
            req.excl.append(arr)

    def unmark(self, arr: BlockIds, shared: bool) -> None:
        if not shared:
            self.owner[arr] = FREE

    def check_write_on_hold(self, arr: BlockIds, shared: bool) -> None:
        if shared:
            raise BlockUnavailable("a write grant on a block this request shares")

    def check_hold_many(
        self,
        batch: Holds,
        reqs: Sequence[RequestRecord | None],
        shared: bool,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        allids, repeats = batch.allids, batch.repeats
        if shared:
            self._check_shareable(allids, None, live)
            self._check_not_held_yet(allids, batch.keys, reqs, batch.starts, batch.lens)
            if repeats is not None:
                self.check_repeat_limit(repeats[1], repeats[3])
            return
        if self.free_stack is not None:
            raise BlockUnavailable(_OWNS_FREE_LIST)
        if repeats is not None:
            raise BlockUnavailable(
                f"blocks {repeats[1][:16].tolist()} acquired exclusively by two requests in "
                "one call"
            )
        self._mark_free_unique(allids)

    def record_hold_many(self, batch: Holds, recs: Sequence[RequestRecord], shared: bool) -> None:
        allids, repeats, starts, lens = batch.allids, batch.repeats, batch.starts, batch.lens
        if shared:
            if repeats is None:
                self.sharers[allids] += 1
            else:
                np.add.at(self.sharers, allids, 1)
            self.shared_holds += len(recs)
            for req, view in zip(recs, views(allids, starts, lens), strict=True):
                req.shared.append(view)
                if len(req.shared) > STEP_VIEWS:
                    self.shared_holds -= merge(req.shared)
        else:
            self.owner[allids] = np.repeat(
                np.fromiter((r.slot for r in recs), np.int32, len(recs)), lens
            )
            for req, view in zip(recs, views(allids, starts, lens), strict=True):
                req.excl.append(view)
                if len(req.excl) > STEP_VIEWS:
                    merge(req.excl)

    def fresh_holds_allowed(self, allids: BlockIds, shared: bool, write: bool) -> bool:
        # Exclusive holds of free blocks, the ledger not owning the free list.
        if shared or self.free_stack is not None:
            return False
        return bool(self.owner.take(allids).tobytes() == self._free_pattern(len(allids)))

    def record_fresh_holds(
        self, recs: Sequence[RequestRecord], allids: BlockIds, parts: list[BlockIds]
    ) -> None:
        lens = [len(p) for p in parts]
        self.owner[allids] = np.repeat(
            np.fromiter((r.slot for r in recs), np.int32, len(recs)), lens
        )
        for req, part in zip(recs, parts, strict=True):
            req.excl.append(part)

    def hold_batches(self, req: RequestRecord) -> list[BlockIds]:
        return req.excl

    def check_grant(self, req: RequestRecord, arr: BlockIds, access: Access) -> None:
        if access is Access.WRITE and self.shared_holds:
            if req.shared and any(np.isin(arr, s, assume_unique=True).any() for s in req.shared):
                raise BlockUnavailable("a write grant on a block this request shares")
            if np.count_nonzero(self.sharers.take(arr)):
                raise BlockUnavailable("a write grant on a block with more than one holder")

    def _check_shareable(
        self,
        arr: BlockIds,
        req: RequestRecord | None,
        live: Mapping[RequestKey, RequestRecord],
    ) -> None:
        """Refuse a shared acquire of ``arr`` unless every block is held, settled and below the
        holder limit, and ``req`` holds none of them yet. O(len(arr)) whatever the number of
        live sharers: the per-block counters say it all (``unsettled``, ``sharers``)."""
        if not self.tracking:
            self.start_tracking(live.values())
        owner = self.owner.take(arr)
        sharers = self.sharers.take(arr)
        held = (owner >= 0) | (sharers > 0)
        if np.count_nonzero(held) != len(held):
            raise BlockUnavailable(
                f"shared acquire of blocks nobody holds: {arr[~held][:16].tolist()}"
            )
        if req is not None and (
            (owner == req.slot).any()
            or any(np.isin(arr, s, assume_unique=True).any() for s in req.shared)
        ):
            raise BlockUnavailable(f"request {show(req.key)} already holds some of these blocks")
        # Settled content only: no open write grant. Open read grants do not unsettle a block,
        # whether their request runs or has ended (draining, quarantined): a reader does not
        # change the content.
        unsettled = self.unsettled.take(arr)
        if np.count_nonzero(unsettled):
            raise BlockUnavailable(
                f"blocks {arr[unsettled > 0][:16].tolist()} are not settled: an open write "
                "grant may still change them: not shareable"
            )
        # A block has at most as many holders as there are live holds: below the limit, no
        # block needs looking at.
        if (
            self.shared_holds >= self.max_sharers
            and int(sharers.max(initial=0)) >= self.max_sharers
        ):
            raise HolderLimit(
                f"blocks {arr[sharers >= self.max_sharers][:16].tolist()} already have "
                f"{self.max_sharers} shared holders (the counter's limit): not shared again"
            )

    def _check_not_held_yet(
        self,
        allids: BlockIds,
        keys: Sequence[RequestKey],
        reqs: Sequence[RequestRecord | None],
        starts: Sequence[int],
        lens: Sequence[int],
    ) -> None:
        """``acquire_many`` (shared): refuse where a request already holds one of the blocks it
        asks for. Only blocks someone holds can be, and only requests that already hold
        something are looked at."""
        held = (self.sharers.take(allids) > 0) | (self.owner.take(allids) >= 0)
        if not np.count_nonzero(held):
            return
        for key, req, a, n in zip(keys, reqs, starts, lens, strict=True):
            if req is None or not n or not np.count_nonzero(held[a : a + n]):
                continue
            mine = allids[a : a + n]
            if (self.owner.take(mine) == req.slot).any() or any(
                np.isin(mine, s, assume_unique=True).any() for s in req.shared
            ):
                raise BlockUnavailable(f"request {show(key)} already holds some of these blocks")

    def _free_pattern(self, n: int) -> bytes:
        p = self.patterns.get(n)
        if p is None:
            p = np.full(n, FREE, dtype=np.int32).tobytes()
            self.patterns[n] = p
        return p

    def _mark_free_unique(self, arr: BlockIds) -> None:
        """Refuse unless every block is free and no id repeats; on success the blocks carry
        distinct markers (not FREE) until the caller writes the owner or ``unmark``s them."""
        owner = self.owner
        k = len(arr)
        if owner.take(arr).tobytes() != self._free_pattern(k):
            bad = arr[owner.take(arr) != FREE]
            raise BlockUnavailable(f"blocks not free: {bad[:16].tolist()}")
        # A distinct marker per position, read back: a repeated id keeps only its last marker.
        # Two scatters and a gather, no sort and no ufunc; the caller's owner write follows.
        marks = self._markers(k)
        owner[arr] = marks
        if owner.take(arr).tobytes() != marks.tobytes():
            owner[arr] = FREE
            raise DuplicateBlockIds(f"duplicate block ids in one batch: {arr.tolist()[:32]}")

    def _markers(self, k: int) -> npt.NDArray[np.int32]:
        m = self.marks
        if len(m) < k:
            m = self.marks = (ORPHANED - 1 - np.arange(max(k, 2 * len(m)))).astype(np.int32)
        return m[:k]

    # ------------------------------------------------------------------ the free list

    def free_for_allocate(self) -> int:
        """How many blocks ``allocate`` may hand out now (the free list is not built yet)."""
        return self.free_top if self.free_stack is not None else self.count_free()

    def allocate(self, req: RequestRecord, n: int) -> BlockIds:
        """Take ``n`` blocks off the free list for ``req`` (``n`` is at most what
        ``free_for_allocate`` said); the free list is built by the first call."""
        stack = self.free_stack
        if stack is None:
            stack = self._build_free_stack()
        top = self.free_top - n
        # The stack's top holds the lowest ids: hand them out in ascending order.
        ids = stack[top : self.free_top][::-1].astype(np.int64)
        self.free_top = top
        self.owner[ids] = req.slot
        ids.flags.writeable = False
        req.excl.append(ids)
        return ids

    def _build_free_stack(self) -> npt.NDArray[np.int32]:
        free = np.flatnonzero(self.owner == FREE).astype(np.int32)[::-1]
        stack = np.empty(self.num_blocks, dtype=np.int32)
        stack[: len(free)] = free
        self.free_stack = stack
        self.free_top = len(free)
        return stack

    # ------------------------------------------------------------------ release

    def let_go(
        self, reqs: Sequence[RequestRecord], reclaimed: collections.Counter[str]
    ) -> list[BlockIds]:
        """Put the blocks no one else holds back in the pool; return them, per request."""
        owner = self.owner
        results: list[BlockIds] = []
        for req in reqs:
            excl = (
                req.excl[0]
                if len(req.excl) == 1
                else (np.concatenate(req.excl) if req.excl else _empty())
            )
            if req.shared:
                # A shared holder lets go: the block returns only if it was the last holder.
                sh = np.concatenate(req.shared)
                self.sharers[sh] -= 1
                self.shared_holds -= len(req.shared)
                back = sh[(self.sharers.take(sh) == 0) & (owner.take(sh) == ORPHANED)]
            else:
                back = _empty()
            if self.shared_holds and len(excl):
                still = self.sharers.take(excl) > 0
                if np.count_nonzero(still):
                    owner[excl[still]] = ORPHANED
                    excl = excl[~still]
            if len(back):
                excl = np.concatenate([excl, back])
            results.append(excl)
            if req.fenced_by is not None and len(excl):
                reclaimed[req.fenced_by] += len(excl)
        if results:
            ids = results[0] if len(results) == 1 else np.concatenate(results)
            if len(ids):
                owner[ids] = FREE
                self.generation[ids] += 1
                if self.free_stack is not None:
                    top = self.free_top
                    self.free_stack[top : top + len(ids)] = ids[::-1]
                    self.free_top = top + len(ids)
        return results

    # ------------------------------------------------------------------ queries

    def holders(self, arr: BlockIds) -> npt.NDArray[np.int64]:
        return (self.owner.take(arr) >= 0).astype(np.int64) + self.sharers.take(arr)

    def held(self) -> npt.NDArray[np.bool_]:
        held: npt.NDArray[np.bool_] = (self.sharers > 0) | (self.owner != FREE)
        return held

    def count_free(self) -> int:
        return int(np.count_nonzero(self.owner == FREE))

    def owner_bytes(self) -> bytes:
        return self.owner.tobytes()

    def sizes(self) -> dict[str, int]:
        return {"free_patterns": len(self.patterns)}

    def arrays(self) -> dict[str, Any]:
        out = super().arrays()
        out["owner"] = self.owner.copy()
        out["free_stack"] = None if self.free_stack is None else self.free_stack.copy()
        out["free_top"] = self.free_top
        return out
