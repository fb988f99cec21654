"""``report``: the design-review page (``out/index.html``) from what ``make demo`` wrote."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out"),
        metavar="DIR",
        help="folder to write index.html into",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="FILE",
        help="harness results to show; a FILE that does not exist is an error (default: "
        "DIR/report.json, as kvlifetime demo writes it; without that file the page has no "
        "harness section and says how to make one)",
    )
    p.add_argument(
        "--screenshot",
        action="store_true",
        help="also open the page in headless Chromium, check every figure rendered, and write "
        "DIR/index.png (needs Debian's chromium)",
    )


def run(args: argparse.Namespace) -> int:
    from kvlifetime.cli.output import input_file
    from kvlifetime.report import require_report_extra, write_report
    from kvlifetime.report.lifecycles import SHIPPED

    require_report_extra()  # before anything runs: the missing extra, named
    if args.results is not None:
        input_file(args.results, "--results")  # named: its absence is the caller's mistake
    log = args.log
    done = write_report(
        args.out, args.results, log=log, on_step=lambda step: log.info("report_step", step=step)
    )
    print(done.path)
    if done.drawing.source == SHIPPED:
        print(f"kvlifetime report: note: {done.drawing.describe()}", file=sys.stderr)
    if done.runs == 0:
        results = args.results or args.out / "report.json"
        print(
            f"kvlifetime report: note: no harness results at {results}: the page has no harness "
            "section (make demo writes them)",
            file=sys.stderr,
        )
    if not args.screenshot:
        return 0
    from kvlifetime.report.browser import BrowserError, check_page

    check = check_page(done.path, screenshot=done.path.with_suffix(".png"))
    if not check.ok:
        raise BrowserError(f"{done.path} did not render in Chromium: {check.problems()}")
    print(check.screenshot)
    return 0
