"""BlockRows: the per-block state of the step-columnar ledger, by the engine's counts, read and
written through block-id arrays only (no request or grant record).

The same per-block arrays and rules as ``EngineCounts`` (``counts="engine"``; its docstring has
why each is kept): ``sharers`` (how many requests hold the block), ``unsettled`` / ``readers``
(open write / read grants covering it), ``generation`` (bumped when its last holder lets go).
A request's holds are the arrays it was given (its hold batches); a grant is its blocks and its
access. Each rule is one or two numpy calls over a whole array of ids.

Part of the step-columnar ledger being built (issue 32): held to ``EngineCounts`` under
``BlockLedger(counts="engine")`` by ``tests/test_step_rows.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import BlockUnavailable, HolderLimit
from kvlifetime.grant import BlockIds
from kvlifetime.ledger.blocks import MAX_SHARERS
from kvlifetime.ledger.counters import Counts, counted

READ, WRITE = 0, 1
"""Access codes of a grant."""


class BlockRows:
    """Per-block holders, open grants and generations of one pool (the engine's counts)."""

    __slots__ = (
        "generation",
        "holds",
        "max_sharers",
        "open_reads",
        "open_writes",
        "readers",
        "scratch",
        "sharers",
        "unsettled",
    )

    def __init__(self, num_blocks: int, max_sharers: int = MAX_SHARERS) -> None:
        # 12 bytes a block: uint16 holders, uint8 open write and read grants (widened before a
        # count could wrap: ``counters.counted``), uint32 generations, and an int32 scratch.
        self.sharers = np.zeros(num_blocks, dtype=np.uint16)
        self.unsettled: Counts = np.zeros(num_blocks, dtype=np.uint8)
        self.readers: Counts = np.zeros(num_blocks, dtype=np.uint8)
        self.generation = np.zeros(num_blocks, dtype=np.uint32)
        self.scratch = np.zeros(num_blocks, dtype=np.int32)  # for ``distinct``
        self.max_sharers = max_sharers  # at most MAX_SHARERS (the sharers dtype's limit)
        self.holds = 0  # live hold batches: below max_sharers no block can be at the limit
        self.open_writes = 0  # open write / read grants counted (bound every block's count)
        self.open_reads = 0

    def distinct(self, ids: BlockIds) -> bool:
        """No id repeats in ``ids`` (each position stamps its block; a repeat overwrites an
        earlier stamp): three passes, no sort."""
        at = np.arange(len(ids), dtype=np.int32)
        self.scratch[ids] = at
        return not np.count_nonzero(self.scratch.take(ids) != at)

    def check_hold(self, arr: BlockIds, held: Sequence[BlockIds]) -> None:
        """A hold of ``arr`` by a request holding ``held``: refused where an open write grant
        covers a block (its content is unsettled) or the request holds one already."""
        writes = self.unsettled.take(arr)
        if np.count_nonzero(writes):
            raise BlockUnavailable(
                f"blocks {arr[writes > 0][:16].tolist()} are not settled: an open write grant "
                "may still change them: not held by another request"
            )
        top = self.max_sharers
        if self.holds >= top and int(self.sharers.take(arr).max(initial=0)) >= top:
            raise HolderLimit(f"some of blocks {arr[:16].tolist()} already have {top} holders")
        if (
            held
            and np.count_nonzero(self.sharers.take(arr))
            and any(np.isin(arr, h, assume_unique=True).any() for h in held)
        ):
            raise BlockUnavailable("the request already holds some of these blocks")

    def check_write_on_hold(self, arr: BlockIds) -> None:
        """A write grant with the hold (``acquire_and_grant``): no other holder, no open grant."""
        if np.count_nonzero(self.sharers.take(arr)):
            raise BlockUnavailable("a write grant on blocks another request holds")
        if np.count_nonzero(self.readers.take(arr)):
            raise BlockUnavailable("a write grant on blocks an open grant covers")

    def check_grant(self, arr: BlockIds, access: int, own_writes: Sequence[BlockIds]) -> None:
        """A grant on blocks the request holds: a write grant only where it alone holds them
        and no open grant covers them; a read grant not where another request's open write
        grant covers them (``own_writes``: the blocks of the request's own open write
        grants)."""
        writes = self.unsettled.take(arr)
        if access == WRITE:
            others = self.sharers.take(arr) > 1
            if np.count_nonzero(others):
                raise BlockUnavailable(
                    f"a write grant on blocks another request holds: {arr[others][:16].tolist()}"
                )
            covered = (writes != 0) | (self.readers.take(arr) != 0)
            if np.count_nonzero(covered):
                raise BlockUnavailable(
                    f"a write grant on blocks an open grant covers: {arr[covered][:16].tolist()}"
                )
        elif np.count_nonzero(writes):
            own = np.zeros(len(arr), dtype=np.int64)
            for blocks in own_writes:
                own += np.isin(arr, blocks, assume_unique=True)
            foreign = writes > own
            if foreign.any():
                raise BlockUnavailable(
                    "a read grant on blocks another request's open write grant covers: "
                    f"{arr[foreign][:16].tolist()}"
                )

    def fresh_allowed(self, allids: BlockIds, access: int) -> bool:
        """New requests may each hold and be granted their part of ``allids`` (distinct): no
        open write grant on any block; for write grants, no holder and no open grant at all."""
        if np.count_nonzero(self.unsettled.take(allids)):
            return False
        top = self.max_sharers
        if self.holds >= top and int(self.sharers.take(allids).max(initial=0)) >= top:
            return False  # (each item then says which block is at the limit)
        return access != WRITE or not (
            np.count_nonzero(self.sharers.take(allids))
            or np.count_nonzero(self.readers.take(allids))
        )

    def hold(self, arr: BlockIds, batches: int = 1) -> None:
        """``batches`` requests hold their (distinct) parts of ``arr``."""
        self.sharers[arr] += 1
        self.holds += batches

    def count_open(self, arr: BlockIds, access: int, grants: int = 1) -> None:
        """``grants`` more open grants of ``access`` over ``arr`` (distinct ids)."""
        if access == WRITE:
            self.unsettled = counted(self.unsettled, arr, self.open_writes)
            self.open_writes += grants
        else:
            self.readers = counted(self.readers, arr, self.open_reads)
            self.open_reads += grants

    def uncount_open(self, arr: BlockIds, access: int) -> None:
        self.uncount_many([(arr, access)])

    def uncount_many(self, closed: Sequence[tuple[BlockIds, int]]) -> None:
        """``uncount_open`` of many grants (blocks, access), one write per access: a block in
        several of them is taken off as many times."""
        for access in (READ, WRITE):
            arrs = [b for b, a in closed if a == access and len(b)]
            if not arrs:
                continue
            counts = self.unsettled if access == WRITE else self.readers
            if len(arrs) == 1:
                counts[arrs[0]] -= 1  # a grant's blocks are distinct
            else:
                # Repeats taken off each time; a one of the array's own dtype keeps ufunc.at on
                # its fast path (a Python int: 15 us for 256 ids against 1.7).
                np.subtract.at(counts, np.concatenate(arrs), counts.dtype.type(1))
            if access == WRITE:
                self.open_writes -= len(arrs)
            else:
                self.open_reads -= len(arrs)

    def let_go_many(self, helds: Sequence[Sequence[BlockIds]]) -> list[BlockIds]:
        """``let_go`` of many released requests, in one pass where no block of theirs has a
        second holder (the common case: one gather tells)."""
        results = [
            h[0] if len(h) == 1 else (np.concatenate(h) if h else np.empty(0, np.int64))
            for h in helds
        ]
        if len(results) > 1:
            allh = np.concatenate(results)
            if not len(allh) or int(self.sharers.take(allh).max()) == 1:
                self.sharers[allh] = 0
                self.generation[allh] += 1
                self.holds -= sum(len(h) for h in helds)
                return results
        return [self.let_go(h) for h in helds]

    def let_go(self, held: Sequence[BlockIds]) -> BlockIds:
        """A released request's holds dropped; every block it held is returned (the engine
        may drop its own references). A block no request holds any more: generation bumped."""
        if not held:
            return np.empty(0, dtype=np.int64)
        ids = held[0] if len(held) == 1 else np.concatenate(held)
        self.holds -= len(held)
        self.sharers[ids] -= 1  # a request holds a block once
        gone = ids[self.sharers.take(ids) == 0]
        self.generation[gone] += 1
        return ids

    def open_access(self, arr: BlockIds) -> npt.NDArray[np.uint8]:
        """Per block: 0 no open grant, 1 only read grants, 2 an open write grant."""
        out: npt.NDArray[np.uint8] = (self.readers.take(arr) != 0).astype(np.uint8)
        out[self.unsettled.take(arr) != 0] = 2
        return out


__all__ = ["READ", "WRITE", "BlockRows"]
