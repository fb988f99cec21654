"""``demo``: ten harness runs side by side, then the design-review page, written to a folder.

What it prints is short on purpose: one line before anything runs, one line per harness run
(its title, its wall time, what the oracle saw), a summary of the comparison, and the page to
open. Everything else goes to files in ``--out``: every run in full (``report.txt``), the
results the page is built from (``report.json``), the comparison table (``harness-table.md``),
the lifecycles as Mermaid and Markdown, and the page itself (``index.html``).

Everything the page needs (the harness and report extras, the backend's engine) is checked
before the first run: a missing one is one line naming the install, exit 2, nothing written.
Graphviz's ``dot`` is optional: without it the page's lifecycles are the pictures shipped in
the package (``kvlifetime.report.shipped``), and the line about the page says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvlifetime.cli.output import Logger, library_logger, write_text
from kvlifetime.diagrams import MACHINES, render

if TYPE_CHECKING:
    from kvlifetime.cli.demo_harness import DemoRun
    from kvlifetime.cli.eventlog import RunLogs
    from kvlifetime.harness.result import RunResult

DEMO_BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvlifetime.cli.demo_harness import DEMO_REQUESTS, DEMO_SEED, FULL_REQUESTS
    from kvlifetime.cli.output import bounded_int

    p.add_argument(
        "--out", type=Path, default=Path("out"), metavar="DIR", help="where the files go"
    )
    p.add_argument(
        "--backend",
        choices=DEMO_BACKENDS,
        default="inproc",
        help="the transfer engine of the harness runs (mooncake and nixl start engine "
        "processes: slower)",
    )
    p.add_argument(
        "--requests",
        type=bounded_int(1),
        default=None,
        metavar="N",
        help=f"requests per harness run (default: {DEMO_REQUESTS:,}, about a minute in all on "
        f"2 cores; {FULL_REQUESTS:,} is the size of the manual's figures, several minutes)",
    )
    p.add_argument(
        "--seed",
        type=bounded_int(0),
        default=DEMO_SEED,
        metavar="S",
        help="the faults' random seed, the same for every run",
    )
    p.add_argument(
        "--log-json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write every run's ledger events as JSON lines, one file per run "
        "(FILE's name with the run's number: events-01.jsonl, ...), each checkable by "
        "kvlifetime replay",
    )


def require_demo(backend: str, what: str = "kvlifetime demo") -> None:
    """Refuse before anything runs: the harness, the backend's engine, the report extra, and
    (without Graphviz's ``dot``) the shipped lifecycle pictures, each named with its fix."""
    from kvlifetime.harness.simulate import require_backend
    from kvlifetime.report import require_report_extra
    from kvlifetime.report.lifecycles import SHIPPED, choose_drawing
    from kvlifetime.report.shipped import every_picture, load

    require_backend(backend, what)
    require_report_extra(what)
    if choose_drawing().source == SHIPPED:
        for table, pic in every_picture():
            load(table, pic)  # a missing or stale one is refused now, not after the runs


class _Lines:
    """One line per run on ``stream``: its title when it starts, its outcome when it ends;
    and each run's event log opened and closed around it."""

    def __init__(self, stream: TextIO, logs: RunLogs) -> None:
        self.stream = stream
        self.logs = logs
        self.started = 0.0

    def start(self, i: int, n: int, run: DemoRun) -> None:
        self.logs.start(i)
        self.started = time.monotonic()
        self.stream.write(f"[{i:>2}/{n}] {run.title:<48} ")
        self.stream.flush()

    def done(self, i: int, n: int, run: DemoRun, r: RunResult) -> None:
        from kvlifetime.report.summary import isolation_held, outcome

        self.logs.stop()
        mark = "held  " if isolation_held(r) else "BROKEN"
        took = time.monotonic() - self.started
        self.stream.write(f"{took:5.1f} s  isolation {mark}  {outcome(r)}\n")
        self.stream.flush()


def _summary(reports: list[RunResult]) -> str:
    from kvlifetime.harness.result import compare_markdown

    closing = compare_markdown(reports).split("\n\n", 1)
    return closing[1].strip() if len(closing) > 1 else ""


def run_demo(
    out: Path,
    backend: str,
    stream: TextIO | None = None,
    log: Logger | None = None,
    harness_requests: int | None = None,
    show_progress: bool | None = False,
    seed: int | None = None,
    log_json: Path | None = None,
) -> int:
    """The demo: the harness, policy by policy, then the design-review page ``out/index.html``.

    ``stream`` gets a dozen lines (one per run, a summary, the page's path); the rest is in
    ``out``. ``log_json``: each run's ledger events as JSON lines beside that path.
    """
    stream = sys.stdout if stream is None else stream
    log = library_logger() if log is None else log
    if backend not in DEMO_BACKENDS:
        raise ValueError(f"unknown backend {backend!r} ({', '.join(DEMO_BACKENDS)})")
    # Before anything is printed: a missing extra is one line naming the install, not a note
    # after minutes of harness runs.
    require_demo(backend)
    from kvlifetime.cli.demo_harness import DEMO_REQUESTS, DEMO_SEED, demo_harness
    from kvlifetime.harness.simulate import Narration

    began = time.monotonic()
    n = DEMO_REQUESTS if harness_requests is None else harness_requests
    seed = DEMO_SEED if seed is None else seed
    stream.write(
        f"kvlifetime demo: 10 harness runs of {n:,} requests (backend {backend}, seed {seed}), "
        f"then the design-review page; writing to {out}/\n"
    )
    stream.flush()
    written = []
    for m in MACHINES:
        for suffix, fmt in (("mmd", "mermaid"), ("md", "md")):
            path = out / f"{m}.{suffix}"
            write_text(path, render(m, fmt), log)
            written.append(path)
    narration = Narration(log=log, what="kvlifetime demo")
    from kvlifetime.cli.eventlog import per_run_logs

    with per_run_logs(log_json) as logs:
        lines = _Lines(stream, logs)
        reports, files = demo_harness(
            out,
            backend,
            requests=n,
            seed=seed,
            narration=narration,
            show_progress=show_progress,
            on_start=lines.start,
            on_done=lines.done,
        )
    written += files
    summary = _summary(reports)
    if summary:
        stream.write("\n" + summary + "\n")
    from kvlifetime.report import write_report
    from kvlifetime.report.lifecycles import SHIPPED

    stream.write("\nbuilding the design-review page ...")
    stream.flush()
    page_began = time.monotonic()
    page = write_report(out, log=log)
    stream.write(f" {time.monotonic() - page_began:.1f} s\n")
    if page.drawing.source == SHIPPED:
        stream.write(f"note: {page.drawing.describe()}\n")
    written.append(page.path)
    log.info("demo_written", files=[str(p) for p in written])
    stream.write(
        f"\nopen {page.path} in a browser (the design-review page); every run in full: "
        f"{out / 'report.txt'}"
        + (f"; event logs: {logs.pattern}" if log_json is not None else "")
        + f"\ndone in {time.monotonic() - began:.0f} s\n"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    return run_demo(
        args.out,
        args.backend,
        log=args.log,
        harness_requests=args.requests,
        # the per-run lines are the demo's progress; a bar only when asked for
        show_progress=bool(args.progress),
        seed=args.seed,
        log_json=args.log_json,
    )
