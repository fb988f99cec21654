"""What the harness runs showed, in a few words: each run's outcome (for the demo's one line per
run and the page's summary), the page's summary at the top, and the runs as two tables narrow
enough to read without scrolling (isolation; cost and recovery).

Proves: every figure is the run's own ``RunResult`` field (the oracle's counts, the ledger's
stats). Does not prove: anything a run did not exercise (its seed decides its faults).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvlifetime.report.tables import table

if TYPE_CHECKING:
    from kvlifetime.harness.result import RunResult
    from kvlifetime.report.counterexamples import Verdict

TICK = (
    "A tick is one step of the harness's logical clock: decode admits requests and sends its "
    "messages, each prefill rank posts its transfers and the transport lands what is due, in "
    "lock step. Delays, leases and deadlines are counted in ticks, not seconds, so one seed "
    "gives the same run on every machine."
)


def run_title(r: RunResult) -> str:
    """A run in a few words: direction, policy, and what was special about it."""
    what = f"{r.direction} {r.policy}"
    if r.restart != "none":
        what += f", decode restart {r.restart}"
    if r.topology_label != "-":
        what += ", every topology knob"
    return what


def isolation_held(r: RunResult) -> bool:
    """No write landed late, no read was stale, no request consumed another's bytes."""
    return r.seen("late_writes") == 0 and r.stale_reads == 0 and r.contaminated_blocks == 0


def outcome(r: RunResult) -> str:
    """What the oracle saw in one run, in a few words."""
    if r.direction == "pull":
        parts = [f"{r.stale_reads:,} stale reads"]
    else:
        parts = [f"{r.seen('late_writes'):,} late writes"]
    parts.append(f"{r.contaminated_requests:,} requests contaminated")
    if r.unsafe_releases:
        parts.append(f"{r.unsafe_releases:,} unsafe releases")
    if r.peak_quarantined_blocks:
        parts.append(
            f"peak {r.peak_quarantined_blocks:,} blocks quarantined, "
            f"{r.reclaimed_total:,} reclaimed by fences"
        )
    return ", ".join(parts)


def _one(values: Sequence[object]) -> str:
    """One value, or the values (a results file may mix sizes)."""
    seen = list(dict.fromkeys(f"{v:,}" if isinstance(v, int) else str(v) for v in values))
    return seen[0] if len(seen) == 1 else " / ".join(seen)


def parameters(runs: Sequence[RunResult]) -> str:
    """What every run shares: requests, seed, pool, backend (plain text)."""
    kib = _one([r.block_bytes // 1024 for r in runs])
    seed = _one([str(r.seed) for r in runs])
    return (
        f"{_one([r.requests for r in runs])} requests per run, seed {seed}, "
        f"a pool of {_one([r.num_blocks for r in runs])} blocks of {kib} KiB, backend "
        f"{_one([r.backend for r in runs])}"
    )


def _faults(runs: Sequence[RunResult]) -> str:
    """The faults the runs met, summed (plain text)."""
    link = ("link_delayed", "link_duplicated", "link_lost", "link_garbage")
    total = {k: sum(int(r.peer_counters.get(k, 0)) for r in runs) for k in link}
    return (
        f"{sum(r.aborted for r in runs):,} client aborts, {sum(r.rejected for r in runs):,} "
        f"admission rejections, {sum(r.transfer_failed for r in runs):,} failed transfers, "
        f"{sum(r.peer_crashes for r in runs):,} peer crashes (prefill's; the reader's when "
        "decode pulls), "
        f"{sum(r.ended_mid_transfer for r in runs):,} requests ended mid-transfer; on the "
        f"control link {total['link_delayed']:,} messages delayed, "
        f"{total['link_duplicated']:,} duplicated, {total['link_lost']:,} lost and "
        f"{total['link_garbage']:,} garbage frames"
    )


def summary_html(runs: Sequence[RunResult] | None, verdicts: Sequence[Verdict]) -> str:
    """The page's first section: what ran, with which seed, pool and faults, and every
    verdict, harness and verifier."""
    e = html.escape
    out = ['<section id="summary"><h2>Summary</h2>']
    if runs:
        held = [r for r in runs if isolation_held(r)]
        out.append(
            f"<p><strong>What ran:</strong> {len(runs)} harness runs ({e(parameters(runs))}). "
            f"<strong>Faults injected</strong> (every run, one seed): {e(_faults(runs))}.</p>"
        )
        items = "".join(
            f"<li><strong>{e(run_title(r))}</strong>: "
            + (
                '<span class="verdict-pass">isolation held</span>'
                if isolation_held(r)
                else '<span class="verdict-refuted">isolation broken</span>'
            )
            + f" ({e(outcome(r))})</li>"
            for r in runs
        )
        out.append(
            f"<p><strong>Harness verdicts:</strong> isolation held in {len(held)} of "
            f"{len(runs)} runs, every one under the proof policy.</p>"
            if all(r.policy == "proof" for r in held)
            else f"<p><strong>Harness verdicts:</strong> isolation held in {len(held)} of "
            f"{len(runs)} runs.</p>"
        )
        out.append(f'<ul class="verdicts">{items}</ul>')
    else:
        out.append(
            '<p class="note">No harness results: run <code>make demo</code> (or '
            "<code>kvlifetime demo --out out</code>), then <code>kvlifetime report</code>.</p>"
        )
    refuted = [v.slug for v in verdicts if v.refuted]
    passing = sorted({v.policy for v in verdicts if not v.refuted})
    if verdicts:
        out.append(
            "<p><strong>Verifier verdicts</strong> (every interleaving of one or two blocks, one "
            "fault at most): "
            + ", ".join(f"<code>{e(p)}</code>" for p in refuted)
            + ' <span class="verdict-refuted">refuted</span>, each with its shortest '
            'counterexample below; <span class="verdict-pass">passing</span>: '
            + ", ".join(f"<code>{e(p)}</code>" for p in passing)
            + ".</p>"
        )
    out.append(f'<p class="lead"><strong>Tick:</strong> {e(TICK)}</p></section>')
    return "".join(out)


def harness_tables(runs: Sequence[RunResult]) -> str:
    """The runs as two tables: what the oracle saw, and what the guard cost."""
    isolation = [
        [
            html.escape(run_title(r)),
            f"{r.requests:,}",
            f"{r.ended_mid_transfer:,} ({100 * r.mid_transfer_ratio:.0f}%)",
            f"{r.seen('late_writes'):,} ({r.seen('late_into_owned'):,} / "
            f"{r.seen('late_into_free'):,})",
            f"{r.stale_reads:,}",
            f"{r.contaminated_blocks:,}",
            f"{r.unsafe_releases:,}",
            '<span class="verdict-pass">held</span>'
            if isolation_held(r)
            else '<span class="verdict-refuted">broken</span>',
        ]
        for r in runs
    ]
    cost = [
        [
            html.escape(run_title(r)),
            f"{r.peak_quarantined_blocks:,}",
            f"{r.quarantined_blocks:,}",
            f"{r.reclaimed_total:,} ({r.fences_total})",
            f"{r.leaked_blocks:,}",
            f"{r.requests_per_s:,.0f}",
            f"{r.mean_hold_ticks:.1f}",
            f"{r.wall_s:.1f}",
        ]
        for r in runs
    ]
    return (
        "<h3>Isolation: what the oracle at the transport saw</h3>"
        + table(
            [
                "run",
                "requests",
                "ended mid-transfer",
                "late writes (into owned / free)",
                "stale reads",
                "contaminated at consume",
                "unsafe releases",
                "isolation",
            ],
            isolation,
            cls="numbers",
        )
        + "<h3>Cost and recovery</h3>"
        + table(
            [
                "run",
                "peak quarantined",
                "quarantined at the end",
                "reclaimed by fences (fences)",
                "leaked",
                "requests/s",
                "mean hold (ticks)",
                "wall (s)",
            ],
            cost,
            cls="numbers",
        )
    )
