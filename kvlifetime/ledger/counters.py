"""Per-block counters that never wrap: the ledger's open-grant counts per block.

A counter starts in the narrowest unsigned dtype (one byte a block) and is widened, before any
block could reach the dtype's limit, to the next one (uint16, then uint32); past uint32 the
grant that would overflow is refused (``HolderLimit``) with nothing changed. The check that
decides whether to look at the blocks at all is one int compare: the number of grants counted
so far bounds every block's count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import HolderLimit
from kvlifetime.grant import BlockIds

Counts = npt.NDArray[np.uint8 | np.uint16 | np.uint32]
"""A per-block count array in one of the counter dtypes (uint8, uint16 or uint32)."""

# The limit of each counter dtype, looked up once (np.iinfo costs more than the rest of a count).
_TOP: dict[np.dtype[Any], int] = {
    np.dtype(t): int(np.iinfo(t).max) for t in (np.uint8, np.uint16, np.uint32)
}

# Each dtype's limit as the bytes of one element: a batch none of whose counts is at the limit
# cannot contain them. A match may straddle two elements (uint16 0x..ff, 0xff..): then the
# exact check runs, so the bytes only ever save work, never decide.
_TOP_BYTES: dict[np.dtype[Any], bytes] = {
    np.dtype(t): np.array([np.iinfo(t).max], dtype=t).tobytes()
    for t in (np.uint8, np.uint16, np.uint32)
}

_WIDER: dict[np.dtype[Any], type[np.unsignedinteger[Any]]] = {
    np.dtype(np.uint8): np.uint16,
    np.dtype(np.uint16): np.uint32,
}


def narrowest(counts: npt.NDArray[np.int64]) -> Counts:
    """``counts`` in the narrowest unsigned dtype none of its values reaches the limit of."""
    top = int(counts.max()) if len(counts) else 0
    for dtype in (np.uint8, np.uint16):
        if top < np.iinfo(dtype).max:
            return counts.astype(dtype)
    return counts.astype(np.uint32)


def counted(counts: Counts, arr: BlockIds, so_far: int) -> Counts:
    """``counts`` + 1 on ``arr`` (distinct ids), widened first if a block of ``arr`` is at the
    dtype's limit. ``so_far`` (the grants counted so far) bounds every block's count, so below
    the limit no block needs looking at: one int compare on the hot path. Past it (a busy
    engine keeps more than 255 grants of one access open), a byte search of the batch's counts
    rules out the limit first (0.3 us against 1.6 for a reduction, 64 blocks here)."""
    dtype = counts.dtype
    top = _TOP[dtype]
    if (
        so_far >= top
        and len(arr)
        and _TOP_BYTES[dtype] in counts.take(arr).tobytes()
        and int(counts.take(arr).max()) >= top
    ):
        wider = _WIDER.get(counts.dtype)
        if wider is None:
            raise HolderLimit(
                f"blocks {arr[counts.take(arr) >= top][:16].tolist()} already have {top} open "
                "grants of this access (the counter's limit)"
            )
        counts = counts.astype(wider)
    counts[arr] += 1
    return counts


def take_off(counts: Counts, arrs: Sequence[BlockIds]) -> None:
    """One grant fewer on the blocks of each of ``arrs`` (each a grant's distinct blocks): a
    block in several of them is taken off as many times. One write for all: ``subtract.at``
    with a one of the counter's own dtype, which keeps it on numpy's fast path (with a Python
    int it takes the generic one: 15 us for 256 ids against 1.7)."""
    if len(arrs) == 1:
        counts[arrs[0]] -= 1
    elif arrs:
        np.subtract.at(counts, np.concatenate(arrs), counts.dtype.type(1))
