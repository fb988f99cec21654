"""The harness results as plots: blocks by state over a run, naive vs proof, quarantine and
reclaim. Drawn with matplotlib into SVG on this side (no script, nothing fetched: the page
works offline), from the time series each run records (``harness.series``).

Proves: each curve is the run's own samples of ``ledger.stats()`` and of the transport
oracle's running count, at the ticks they were taken. Does not prove: what happened between
two samples (a long run keeps a few hundred, evenly spaced).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Blocks out of the pool by state, drawn bottom to top. "held" is every block a request still
# holds with no doubt about it (owned, exposed to a peer, quiesced awaiting release); draining
# waits for a peer's proof; quarantined waits past a deadline. Free blocks are the rest of the
# pool: stacked too they would flatten everything else to a sliver (the pool is 2,048 blocks,
# a run has a few hundred out), so each panel says how few were ever free instead.
BANDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("held (owned, exposed, quiesced)", ("owned", "exposed", "quiesced"), "#4a7ebb"),
    ("draining", ("draining",), "#e6a23c"),
    ("quarantined", ("quarantined",), "#8e44ad"),
)
LATE = "#c0392b"
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
RECLAIM = "#117a65"
TICKS = "tick (harness steps)"


def run_title(d: Mapping[str, Any]) -> str:
    """A run in a few words: direction, policy, and what was special about it."""
    what = f"{d.get('direction', 'push')} {d.get('policy', '?')}"
    if d.get("restart", "none") != "none":
        what += f", decode restart {d['restart']}"
    topo = d.get("topology") or {}
    if (
        topo.get("tp_ranks", 1) > 1
        or topo.get("land_after_crash")
        or topo.get("redeliver_permille")
    ):
        what += ", every topology knob"
    return what


def has_series(d: Mapping[str, Any]) -> bool:
    s = d.get("series")
    return isinstance(s, Mapping) and bool(s.get("tick"))


def _col(d: Mapping[str, Any], name: str) -> list[int]:
    return list(d["series"].get(name, [0] * len(d["series"]["tick"])))


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig: Figure, figure_id: str) -> str:
    """The figure as inline SVG: text kept as text, ids salted by figure (several figures on
    one page never share an id), no date (the same data draws the same bytes)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": figure_id}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    # The RDF metadata block names matplotlib's web site and four vocabularies by URL: a
    # self-contained page should carry no address at all.
    return _METADATA.sub("", text, count=1)


def _stack(ax: Axes, d: Mapping[str, Any]) -> float:
    """Blocks out of the pool by state, stacked; returns the top of its scale."""
    ticks = _col(d, "tick")
    ys = [[sum(v) for v in zip(*(_col(d, c) for c in cols), strict=True)] for _, cols, _ in BANDS]
    ax.stackplot(
        ticks,
        ys,
        labels=[b[0] for b in BANDS],
        colors=[b[2] for b in BANDS],
        linewidth=0,
    )
    out = [sum(v) for v in zip(*ys, strict=True)]
    ax.set_xlim(ticks[0], max(ticks[-1], ticks[0] + 1))
    top = max(10, max(out, default=0)) * 1.15
    ax.set_ylim(0, top)
    ax.set_xlabel(TICKS)
    # how few blocks were ever free, under the title: above the panel, where no curve (nor the
    # late-write line of a twin axis, flat at its maximum) can run through it
    ax.set_title(f"{run_title(d)}\n{free_note(d)}", fontsize=9)
    return top


def free_note(d: Mapping[str, Any]) -> str:
    """The fewest blocks ever free in the run, out of the pool."""
    return f"free: at least {min(_col(d, 'free'), default=0):,} of {d.get('num_blocks', 0):,}"


def _legend(fig: Figure, ax: Axes, *more: Axes) -> None:
    """One legend for the figure, above the panels (never over a curve)."""
    handles, labels = ax.get_legend_handles_labels()
    for extra in more:
        h, lab = extra.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    fig.legend(handles, labels, loc="outside upper center", ncols=len(labels), fontsize=8)


def _grid(panels: int, height: float) -> tuple[Figure, list[Axes], int]:
    """A figure of ``panels`` panels, three to a row (the unused ones hidden), and its width
    in panels."""
    n = max(1, panels)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig = _figure(4.0 * cols, height * rows)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes, cols


def naive_vs_proof(runs: Sequence[Mapping[str, Any]], figure_id: str) -> tuple[str, int]:
    """The plain push runs side by side (naive, timeout, proof): blocks by state, and the late
    writes the oracle counted so far on one scale for all. Returns (svg, panels)."""
    order = {"naive": 0, "timeout": 1, "proof": 2}
    plain = [
        d
        for d in runs
        if d.get("direction", "push") == "push"
        and d.get("restart", "none") == "none"
        and run_title(d) == f"push {d.get('policy')}"
        and has_series(d)
    ]
    plain.sort(key=lambda d: order.get(str(d.get("policy")), 9))
    fig = _figure(4.0 * max(1, len(plain)), 3.2)
    axes = fig.subplots(1, max(1, len(plain)), sharey=True, squeeze=False)[0]
    late_max = max([max(_col(d, "late_writes"), default=0) for d in plain] + [1])
    tops = []
    twins: list[Axes] = []
    for i, (ax, d) in enumerate(zip(axes, plain, strict=False)):
        tops.append(_stack(ax, d))
        if i == 0:
            ax.set_ylabel("blocks out of the pool")
        twin = ax.twinx()
        twin.plot(
            _col(d, "tick"), _col(d, "late_writes"), color=LATE, linewidth=2, label="late writes"
        )
        twins.append(twin)
        twin.set_ylim(0, late_max * 1.05)
        twin.tick_params(axis="y", colors=LATE, labelsize=8)
        if i == len(plain) - 1:
            twin.set_ylabel("late writes so far", color=LATE)
        # the count in the title, above the panel: no curve can run through it
        last = _col(d, "late_writes")[-1]
        ax.set_title(f"{run_title(d)}: {last:,} late writes\n{free_note(d)}", fontsize=9)
    axes[0].set_ylim(0, max(tops, default=10))  # shared: one scale for every panel
    if twins:
        _legend(fig, axes[0], twins[0])
    return _svg(fig, figure_id), len(plain)


def quarantine_and_reclaim(runs: Sequence[Mapping[str, Any]], figure_id: str) -> tuple[str, int]:
    """Each run that quarantined anything: blocks in quarantine, and blocks fences gave back so
    far. Returns (svg, panels)."""
    picked = [
        d
        for d in runs
        if has_series(d)
        and (max(_col(d, "quarantined"), default=0) > 0 or max(_col(d, "reclaimed"), default=0))
    ]
    fig, axes, cols = _grid(len(picked), 2.8)
    for i, (ax, d) in enumerate(zip(axes, picked, strict=False)):
        ticks = _col(d, "tick")
        ax.fill_between(ticks, _col(d, "quarantined"), color="#8e44ad", alpha=0.35, linewidth=0)
        ax.plot(ticks, _col(d, "quarantined"), color="#8e44ad", label="quarantined now")
        ax.plot(ticks, _col(d, "reclaimed"), color=RECLAIM, linewidth=2, label="reclaimed so far")
        ax.set_xlabel(TICKS)
        ax.set_ylim(bottom=0)
        if i % cols == 0:
            ax.set_ylabel("blocks")
        fences = sum((d.get("fences") or {}).values())
        peak = d.get("peak_quarantined_blocks", 0)
        ax.set_title(f"{run_title(d)}\n{fences} fences, peak {peak} quarantined", fontsize=9)
    if picked:
        _legend(fig, axes[0])
    return _svg(fig, figure_id), len(picked)


def every_run(runs: Sequence[Mapping[str, Any]], figure_id: str) -> tuple[str, int]:
    """Blocks by state over time, one small panel per run. Returns (svg, panels)."""
    picked = [d for d in runs if has_series(d)]
    fig, axes, cols = _grid(len(picked), 2.6)
    for i, (ax, d) in enumerate(zip(axes, picked, strict=False)):
        _stack(ax, d)
        if i % cols == 0:
            ax.set_ylabel("blocks out of the pool")
    if picked:
        _legend(fig, axes[0])
    return _svg(fig, figure_id), len(picked)
