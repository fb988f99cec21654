"""``demo``: the contract, then the harness policy by policy, written to a folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from kvlifetime.cli.output import Logger, library_logger, write_text
from kvlifetime.diagrams import MACHINES, evidence_markdown, render
from kvlifetime.spec.table import table_for

DEMO_BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvlifetime.cli.output import bounded_int
    from kvlifetime.harness.simulate import DEMO_REQUESTS

    p.add_argument(
        "--out", type=Path, default=Path("out"), metavar="DIR", help="where the files go"
    )
    p.add_argument(
        "--backend",
        choices=DEMO_BACKENDS,
        default="inproc",
        help="the transfer engine of the harness runs",
    )
    p.add_argument(
        "--requests",
        type=bounded_int(1),
        default=None,
        metavar="N",
        help=f"requests per harness run (default: {DEMO_REQUESTS:,}, the acceptance size)",
    )


def _section(title: str, body: str, stream: TextIO) -> None:
    stream.write(f"\n==== {title} ====\n\n{body}")


def run_demo(
    out: Path,
    backend: str,
    stream: TextIO | None = None,
    log: Logger | None = None,
    harness_requests: int | None = None,
    show_progress: bool | None = False,
) -> int:
    """The demo: the contract as tables and pictures, then the harness, policy by policy.

    Step 1 prints what the specification allows and what each piece of evidence proves, and
    writes the diagrams to ``out``. Step 2 runs the disaggregation harness on ``backend`` with
    the naive, timeout and proof policies side by side and writes the report to ``out``.
    """
    stream = sys.stdout if stream is None else stream
    log = library_logger() if log is None else log
    if backend not in DEMO_BACKENDS:
        raise ValueError(f"unknown backend {backend!r} ({', '.join(DEMO_BACKENDS)})")
    from kvlifetime.harness.simulate import require_backend

    # Before anything is printed: a missing extra is one line naming the install, not a
    # traceback after the contract's hundred lines.
    require_backend(backend, "kvlifetime demo")
    stream.write(f"kvlifetime demo (backend: {backend}), writing to {out}\n")
    _section("request lifecycle", table_for("request").to_markdown(), stream)
    _section("block lifecycle", table_for("block").to_markdown(), stream)
    _section("evidence and claims", evidence_markdown(), stream)
    written = []
    for m in MACHINES:
        for suffix, fmt in (("mmd", "mermaid"), ("md", "md")):
            path = out / f"{m}.{suffix}"
            write_text(path, render(m, fmt), log)
            written.append(path)
    from kvlifetime.harness.simulate import DEMO_REQUESTS, Narration, demo_harness

    n = DEMO_REQUESTS if harness_requests is None else harness_requests
    narration = Narration(log=log, show_progress=show_progress, what="kvlifetime demo")
    written += demo_harness(out, backend, stream, requests=n, narration=narration)
    from kvlifetime.report import write_demo_page

    # Last: the design-review page of everything above (out/index.html).
    written += write_demo_page(out, stream, log)
    stream.write("\n" + "".join(f"wrote {p}\n" for p in written))
    return 0


def run(args: argparse.Namespace) -> int:
    return run_demo(
        args.out,
        args.backend,
        log=args.log,
        harness_requests=args.requests,
        show_progress=args.progress,
    )
