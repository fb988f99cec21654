"""``kvlifetime report``: a self-contained HTML page for a design review.

``write_report(out)`` reads the harness results ``make demo`` wrote (``out/report.json``) and
writes ``out/index.html``: the request and block lifecycles laid out for a slide, the evidence
and provenance tables, each engine's evidence profile, the harness runs with plots (blocks by
state over time, naive vs proof, quarantine and reclaim), and each refuted release policy's
counterexample as a sequence diagram. Every picture is inline SVG; nothing is fetched.

Modules, named after what they draw: ``lifecycles`` (Graphviz, or the SVGs ``shipped`` in the
package), ``harness_plots`` (matplotlib), ``counterexamples`` (sequence diagrams from the
verifier's result, drawn here without Graphviz), ``tables`` and ``page`` (the HTML). ``browser``
opens a page in headless Chromium and reads back the page's own verdict on its figures.

Needs the ``report`` extra (matplotlib); without it, nothing is written and the error names
what to install. Graphviz's ``dot`` is optional: where it is installed the lifecycles are drawn
now, where it is not the page uses the pictures shipped in the package (drawn from the same DOT
source, checked before use), and says which.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from kvlifetime.errors import KVLifetimeError, UsageError

if TYPE_CHECKING:
    from kvlifetime.harness.result import RunResult
    from kvlifetime.report.lifecycles import Drawing
    from kvlifetime.report.page import HarnessSection

__all__ = [
    "INDEX",
    "STEPS",
    "ReportInputError",
    "ReportWritten",
    "build_page",
    "load_results",
    "require_report_extra",
    "write_report",
]

INDEX = "index.html"
RESULTS = "report.json"
MAX_RESULTS_BYTES = 64 * 2**20  # a results file is a few hundred kB; refuse what is not one

_log = structlog.get_logger("kvlifetime")


class ReportInputError(UsageError):
    """The harness results file is not one.
    Unreadable JSON, not a list of runs, a run with a missing or mistyped field. Whose fault: the
    input file (or whoever wrote it). State left: nothing written."""

    kind = "report_input"


def require_report_extra(what: str = "kvlifetime report") -> None:
    """Raise ``MissingExtra`` (``pip install 'kvlifetime[report]'``) without matplotlib."""
    from kvlifetime.extras import EXTRAS, Extra, MissingExtra, missing

    if "report" in EXTRAS:
        if missing("report"):
            raise MissingExtra(EXTRAS["report"], missing("report")[0], what)
        return
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtra(Extra("report", ("matplotlib",), ("matplotlib",)), "matplotlib", what)


def load_results(path: Path) -> list[RunResult]:
    """The runs in a harness results file (``kvlifetime demo``'s ``report.json``)."""
    from kvlifetime.harness.result import RunResult

    try:
        size = path.stat().st_size
        if size > MAX_RESULTS_BYTES:
            raise ReportInputError(
                f"{path} is {size} bytes: not a harness results file (at most "
                f"{MAX_RESULTS_BYTES} bytes)"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportInputError(f"{path} is not JSON: {e}") from e
    except RecursionError:
        raise ReportInputError(f"{path}: nested too deep to be a harness results file") from None
    if not isinstance(data, list) or not data:
        raise ReportInputError(f"{path} is not a list of harness runs (kvlifetime demo writes one)")
    runs = []
    for i, d in enumerate(data):
        try:
            runs.append(RunResult.from_dict(d))
        except UsageError as e:
            raise ReportInputError(f"{path}: run {i + 1}: {e}") from e
    return runs


def _harness_section(runs: Sequence[RunResult], source: str) -> HarnessSection:
    from kvlifetime.harness.result import compare_markdown
    from kvlifetime.report import harness_plots as hp
    from kvlifetime.report.page import Figure, HarnessSection
    from kvlifetime.report.summary import TICK, harness_tables, parameters

    dicts: list[Mapping[str, Any]] = [r.to_dict() for r in runs]
    given = f" {parameters(runs)}; x: ticks; y: blocks."
    summary = compare_markdown(runs).split("\n\n", 1)
    figures = []
    with_series = [d for d in dicts if hp.has_series(d)]
    note = ""
    if len(with_series) < len(dicts):
        note = (
            f"{len(dicts) - len(with_series)} of {len(dicts)} runs carry no time series (a "
            "results file from before kvlifetime 0.2): rerun make demo for their plots."
        )
    plots = (
        (
            "fig-naive-vs-proof",
            hp.naive_vs_proof,
            "Naive, timeout and proof side by side (push, no topology knob): blocks out of the "
            "pool by state over the run, and in red the writes the oracle saw land late, so far "
            "(right axis; one scale for every panel)." + given,
        ),
        (
            "fig-quarantine",
            hp.quarantine_and_reclaim,
            "Quarantine and reclaim: blocks waiting for proof that may never come, and the "
            "blocks fences gave back to the pool so far." + given,
        ),
        (
            "fig-every-run",
            hp.every_run,
            "Every run: blocks out of the pool by state over time (held, draining, quarantined; "
            "free is the rest of the pool, its low mark in each panel). Each panel has its own "
            "scale." + given + " " + TICK,
        ),
    )
    for fid, draw, caption in plots if with_series else ():
        svg, n = draw(dicts, fid)
        if n:  # a figure with no run to show is left out, not drawn empty
            figures.append(Figure(fid, "plot", svg, caption, n))
    return HarnessSection(
        harness_tables(runs),
        tuple(figures),
        summary[1].strip() if len(summary) > 1 else "",
        source,
        note,
    )


STEPS: tuple[str, ...] = ("lifecycles", "tables", "harness plots", "counterexamples")
"""What ``build_page`` does, in order (``on_step`` is called with each before it starts)."""


def build_page(
    runs: Sequence[RunResult] | None,
    *,
    source: str = RESULTS,
    on_step: Callable[[str], None] | None = None,
    drawing: str | None = None,
) -> str:
    """The page for ``runs`` (``None``: no harness results, the page says how to make them).
    ``on_step``: told each of ``STEPS`` as it starts (a progress bar, a log line);
    ``drawing``: where the lifecycle pictures come from (``lifecycles.choose_drawing``: by
    default drawn now where ``dot`` is installed, else the shipped ones)."""
    return _build(runs, source=source, on_step=on_step, drawing=drawing)[0]


def _build(
    runs: Sequence[RunResult] | None,
    *,
    source: str,
    on_step: Callable[[str], None] | None,
    drawing: str | None,
) -> tuple[str, Drawing]:
    require_report_extra()
    from kvlifetime import __version__
    from kvlifetime.diagrams import MACHINES
    from kvlifetime.report.counterexamples import explore_policies
    from kvlifetime.report.lifecycles import choose_drawing, lifecycle
    from kvlifetime.report.page import render_page
    from kvlifetime.report.summary import summary_html
    from kvlifetime.report.tables import engine_profiles, evidence_table, provenance_table

    def step(name: str) -> None:
        if on_step is not None:
            on_step(name)

    step("lifecycles")
    chosen = choose_drawing(drawing).source  # once: every picture from the same place
    lifecycles = [pic for m in MACHINES for pic in lifecycle(m, chosen)]
    step("tables")
    evidence, provenance, engines = evidence_table(), provenance_table(), engine_profiles()
    step("harness plots")
    harness = None if runs is None else _harness_section(runs, source)
    step("counterexamples")
    verdicts = explore_policies()
    page = render_page(
        version=__version__,
        summary=summary_html(runs, verdicts),
        lifecycles=lifecycles,
        evidence=evidence,
        provenance=provenance,
        engines=engines,
        harness=harness,
        verdicts=verdicts,
    )
    return page, lifecycles[0].drawing


@attrs.frozen(slots=True)
class ReportWritten:
    path: Path
    runs: int  # harness runs shown (0: no results file)
    bytes: int
    drawing: Drawing  # where the lifecycle pictures came from (drawn now, or shipped)


def write_report(
    out: Path,
    results: Path | None = None,
    log: Any = None,
    on_step: Callable[[str], None] | None = None,
    drawing: str | None = None,
) -> ReportWritten:
    """Write ``out/index.html`` from ``results`` (default ``out/report.json``; if that file
    does not exist the page is written without the harness section, and says so). Nothing is
    written when anything is refused. ``log``: a structlog logger (default ``kvlifetime``);
    ``on_step``, ``drawing``: see ``build_page``."""
    log = _log if log is None else log
    results = out / RESULTS if results is None else results
    try:
        runs = load_results(results) if results.exists() else None
        text, drawn = _build(runs, source=str(results), on_step=on_step, drawing=drawing)
    except KVLifetimeError as e:
        log.warning("report_refused", error=e.kind, message=str(e), results=str(results))
        raise
    path = out / INDEX
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(text, encoding="utf-8", newline="\n")
    tmp.replace(path)  # a reader never sees half a page
    n = len(text.encode("utf-8"))
    log.info(
        "report_written",
        path=str(path),
        runs=0 if runs is None else len(runs),
        bytes=n,
        lifecycles=drawn.source,
        graphviz=drawn.graphviz,
    )
    return ReportWritten(path, 0 if runs is None else len(runs), n, drawn)
