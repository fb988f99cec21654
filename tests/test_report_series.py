"""The harness's time series: bounded, evenly spaced, deterministic, and what the runs record."""

from __future__ import annotations

import itertools

import pytest

from kvlifetime.harness.series import BLOCK_COLUMNS, COLUMNS, StateSeries
from kvlifetime.ledger import BlockLedger, LedgerStats


def _stats(free: int, quarantined: int = 0) -> LedgerStats:
    by = dict.fromkeys(BLOCK_COLUMNS, 0)
    by["free"], by["quarantined"] = free, quarantined
    return LedgerStats(
        num_blocks=free + quarantined,
        blocks_by_state=by,
        requests_by_state={},
        quarantined=(),
        unsafe_releases=0,
        refused_evidence={},
        open_grants=0,
    )


def _feed(s: StateSeries, ticks: range) -> None:
    for t in ticks:
        if s.due(t) or t == ticks[-1]:  # the harness reads the ledger once more at the end
            s.sample(t, _stats(t), reclaimed=t, late_writes=0, stale_reads=0, unsafe_releases=0)


def test_short_run_is_kept_whole() -> None:
    s = StateSeries(capacity=16)
    _feed(s, range(10))
    cols = s.columns()
    assert list(cols) == list(COLUMNS)
    assert cols["tick"] == list(range(10))
    assert cols["free"] == list(range(10))
    assert cols["reclaimed"] == list(range(10))


@pytest.mark.parametrize("ticks", [100, 1000, 12_345])
def test_long_run_is_bounded_even_and_reaches_the_end(ticks: int) -> None:
    s = StateSeries(capacity=32)
    _feed(s, range(ticks))
    t = s.columns()["tick"]
    assert len(t) <= 32 + 1  # the newest reading may follow the kept ones
    assert t[0] == 0 and t[-1] == ticks - 1
    kept = t[:-1] if t[-1] % s.stride else t
    gaps = {b - a for a, b in itertools.pairwise(kept)}
    assert gaps == {s.stride}  # evenly spaced after every halving
    assert len(kept) > 32 // 2  # halving leaves the series at least half full


def test_a_fence_keeps_the_reading_before_and_after_it() -> None:
    s = StateSeries(capacity=8)
    s.sample(0, _stats(10, 0), reclaimed=0, late_writes=0, stale_reads=0, unsafe_releases=0)
    s.sample(1, _stats(4, 6), reclaimed=0, late_writes=0, stale_reads=0, unsafe_releases=0)
    s.sample(1, _stats(10, 0), reclaimed=6, late_writes=0, stale_reads=0, unsafe_releases=0)
    cols = s.columns()
    assert cols["tick"] == [0, 1, 1]
    assert cols["quarantined"] == [0, 6, 0]
    assert cols["reclaimed"] == [0, 0, 6]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        StateSeries(capacity=1)
    with pytest.raises(ValueError):
        StateSeries(stride=0)


def test_series_columns_name_every_block_state() -> None:
    ledger = BlockLedger(8)
    ledger.allocate("r", 3)
    s = StateSeries()
    s.sample(0, ledger.stats(), reclaimed=0, late_writes=0, stale_reads=0, unsafe_releases=0)
    cols = s.columns()
    assert sum(cols[c][0] for c in BLOCK_COLUMNS) == 8
    assert cols["free"] == [5] and cols["owned"] == [3]


def test_a_harness_run_records_its_series() -> None:
    from kvlifetime.harness.loop import run
    from kvlifetime.harness.settings import PushSettings

    r = run(PushSettings(policy="naive", requests=120, seed=3))
    series = r.to_dict()["series"]
    assert list(series) == list(COLUMNS)
    t = series["tick"]
    assert t[0] == 0 and t == sorted(t) and t[-1] <= r.ticks
    n = len(t)
    assert all(len(v) == n for v in series.values())
    for i in range(n):
        assert sum(series[c][i] for c in BLOCK_COLUMNS) == r.num_blocks
    # running totals only grow, and end where the report's own figures end
    late = series["late_writes"]
    assert late == sorted(late)
    assert late[-1] <= r.seen("late_writes")
    assert late[-1] > 0  # naive lets late writes land
