"""``ledger.counters.counted``: a count at its dtype's limit widens the counter first (never
wraps), whatever the byte search that rules the limit out says; past uint32, ``HolderLimit``
with nothing changed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvlifetime.errors import HolderLimit
from kvlifetime.ledger.counters import counted


@pytest.mark.parametrize(("dtype", "wider"), [(np.uint8, np.uint16), (np.uint16, np.uint32)])
def test_a_count_at_the_limit_widens_first(dtype: type, wider: type) -> None:
    top = int(np.iinfo(dtype).max)
    counts: Any = np.zeros(8, dtype=dtype)
    counts[3] = top
    out = counted(counts, np.array([1, 3], dtype=np.int64), so_far=top)
    assert out.dtype == wider
    assert out.tolist() == [0, 1, 0, top + 1, 0, 0, 0, 0]


def test_limit_bytes_across_two_counts_do_not_widen() -> None:
    # 0xff00 then 0x00ff: their bytes (either byte order) hold ff ff, neither is at the limit.
    counts = np.array([0xFF00, 0x00FF, 0], dtype=np.uint16)
    limit = np.array([0xFFFF], dtype=np.uint16).tobytes()
    assert limit in counts.take([0, 1]).tobytes() or limit in counts.take([1, 0]).tobytes()
    for order in ([0, 1], [1, 0]):
        counts = np.array([0xFF00, 0x00FF, 0], dtype=np.uint16)
        out = counted(counts, np.array(order, dtype=np.int64), so_far=1 << 20)
        assert out.dtype == np.uint16
        assert out.tolist() == [0xFF01, 0x0100, 0]


def test_below_the_bound_nothing_is_looked_at_and_counts_grow() -> None:
    counts = np.zeros(4, dtype=np.uint8)
    out = counted(counts, np.array([0, 2], dtype=np.int64), so_far=10)
    assert out is counts and out.tolist() == [1, 0, 1, 0]


def test_past_uint32_the_grant_is_refused_and_nothing_changes() -> None:
    top = int(np.iinfo(np.uint32).max)
    counts = np.array([top, 5], dtype=np.uint32)
    with pytest.raises(HolderLimit):
        counted(counts, np.array([1, 0], dtype=np.int64), so_far=top)
    assert counts.tolist() == [top, 5]
