"""Blocks by state over a harness run, sampled on the owner's side, in bounded memory.

The report's plots (``kvlifetime report``) show what the end-of-run figures cannot: blocks
moving between free, held, draining and quarantined, quarantine building up and fences
reclaiming it, late writes piling up under the naive policy. The owner reads
``ledger.stats()`` every 8 ticks anyway (to decide on fences); the series keeps those readings,
plus one per tick while its stride is shorter than that.

Bounded whatever the run's length: at most ``capacity`` samples are kept (plus one per fence,
and the newest reading as the last point). The stride starts at one tick; when the series is
full, every other sample is dropped and the stride doubles, so a run of any length is covered
end to end at an even spacing, and the extra ledger readings stop once the stride passes 8.
Deterministic: which ticks are kept depends only on the ticks seen.
"""

from __future__ import annotations

import attrs

from kvlifetime.ledger.values import LedgerStats
from kvlifetime.spec.vocabulary import BlockState

BLOCK_COLUMNS: tuple[str, ...] = tuple(s.label for s in BlockState)
"""One column per block state, in the state machine's order."""

COLUMNS: tuple[str, ...] = (
    "tick",
    *BLOCK_COLUMNS,
    "reclaimed",  # blocks put back in the pool by fences so far (every ledger of the run)
    "unsafe_releases",  # force_release of a request with an open grant, so far
    "late_writes",  # landings the transport oracle counted late, so far
    "stale_reads",  # pull: reads of a source block another request already held, so far
)

DEFAULT_CAPACITY = 160
DEFAULT_STRIDE = 1  # every tick at first: a short run is drawn in full


@attrs.define(slots=True)
class StateSeries:
    """Samples of blocks by state (and a few running totals), at most ``capacity`` of them."""

    capacity: int = DEFAULT_CAPACITY  # >= 2: halving must leave room for the next sample
    stride: int = DEFAULT_STRIDE  # ticks between kept samples; doubles when full
    _rows: list[tuple[int, ...]] = attrs.field(init=False, factory=list)  # ticks % stride == 0
    _last: tuple[int, ...] | None = attrs.field(init=False, default=None)  # newest reading

    def __attrs_post_init__(self) -> None:
        if self.capacity < 2 or self.stride < 1:
            raise ValueError("capacity must be >= 2 and stride >= 1")

    def sample(
        self,
        tick: int,
        stats: LedgerStats,
        *,
        reclaimed: int,
        late_writes: int,
        stale_reads: int,
        unsafe_releases: int,
    ) -> None:
        """Record one reading at ``tick``. Two readings at one tick are both kept (a fence
        between them: the plot drops straight down there), a third replaces the second."""
        by = stats.blocks_by_state
        row = (
            tick,
            *(by.get(c, 0) for c in BLOCK_COLUMNS),
            reclaimed,
            unsafe_releases,
            late_writes,
            stale_reads,
        )
        self._last = row
        if tick % self.stride:
            return
        if len(self._rows) >= 2 and self._rows[-1][0] == self._rows[-2][0] == tick:
            self._rows[-1] = row
            return
        if len(self._rows) >= self.capacity:
            self.stride *= 2
            self._rows = [r for r in self._rows if r[0] % self.stride == 0]
            if tick % self.stride:
                return
        self._rows.append(row)

    def due(self, tick: int) -> bool:
        """Whether a reading at ``tick`` would be kept (the caller may skip the others)."""
        return tick % self.stride == 0

    def __len__(self) -> int:
        return len(self.rows())

    def rows(self) -> list[tuple[int, ...]]:
        """The kept samples in tick order, the newest reading last."""
        rows = list(self._rows)
        if self._last is not None and (not rows or self._last[0] > rows[-1][0]):
            rows.append(self._last)
        return rows

    def columns(self) -> dict[str, list[int]]:
        """Column name -> values, one per sample (``COLUMNS`` order): what the report keeps."""
        rows = self.rows()
        return {c: [r[i] for r in rows] for i, c in enumerate(COLUMNS)}
