"""BlockRows: the per-block state of the step-columnar ledger, by the engine's counts, read and
written through block-id arrays only (no request or grant record).

The same per-block arrays as ``EngineCounts`` (``counts="engine"``; its docstring has why
each is kept): ``sharers`` (how many requests hold the block), ``unsettled`` / ``readers``
(open write / read grants covering it), ``generation`` (bumped when its last holder lets go);
and the same rules, written once: the functions of ``engine_counts`` both call.
A request's holds are the arrays it was given (its hold batches); a grant is its blocks and its
access. Each rule is one or two numpy calls over a whole array of ids.

Part of the step-columnar ledger being built (issue 32): held to ``EngineCounts`` under
``BlockLedger(counts="engine")`` by ``tests/test_step_rows.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvlifetime.grant import BlockIds
from kvlifetime.ledger.blocks import MAX_SHARERS
from kvlifetime.ledger.counters import Counts, counted, take_off
from kvlifetime.ledger.engine_counts import (
    drop_holds,
    fresh_allowed,
    refuse_grant,
    refuse_hold,
    refuse_write_on_hold,
)

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
        """A hold of ``arr`` by a request holding ``held`` (``engine_counts.refuse_hold``)."""
        refuse_hold(self.sharers, self.unsettled, arr, held, self.holds, self.max_sharers)

    def check_write_on_hold(self, arr: BlockIds) -> None:
        """A write grant with the hold (``engine_counts.refuse_write_on_hold``)."""
        refuse_write_on_hold(self.sharers, self.readers, arr)

    def check_grant(self, arr: BlockIds, access: int, own_writes: Sequence[BlockIds]) -> None:
        """A grant over held blocks (``engine_counts.refuse_grant``)."""
        refuse_grant(self.sharers, self.unsettled, self.readers, arr, access == WRITE, own_writes)

    def fresh_allowed(self, allids: BlockIds, access: int) -> bool:
        """``engine_counts.fresh_allowed``."""
        return fresh_allowed(
            self.sharers, self.unsettled, self.readers, allids, access == WRITE, self.max_sharers
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
            take_off(self.unsettled if access == WRITE else self.readers, arrs)
            if access == WRITE:
                self.open_writes -= len(arrs)
            else:
                self.open_reads -= len(arrs)

    def let_go_many(
        self, helds: Sequence[Sequence[BlockIds]]
    ) -> tuple[list[BlockIds], list[BlockIds]]:
        """Released requests' holds dropped (``engine_counts.drop_holds``). Returns, per
        request, every block it held (the engine may drop its own references) and those no
        request holds any more (unguarded from now on)."""
        results = [
            h[0] if len(h) == 1 else (np.concatenate(h) if h else np.empty(0, np.int64))
            for h in helds
        ]
        gone = drop_holds(self.sharers, self.generation, results)
        self.holds -= sum(len(h) for h in helds)
        return results, gone

    def open_access(self, arr: BlockIds) -> npt.NDArray[np.uint8]:
        """Per block: 0 no open grant, 1 only read grants, 2 an open write grant."""
        out: npt.NDArray[np.uint8] = (self.readers.take(arr) != 0).astype(np.uint8)
        out[self.unsettled.take(arr) != 0] = 2
        return out


__all__ = ["READ", "WRITE", "BlockRows"]
