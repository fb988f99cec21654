"""``replay``: check a recorded event log against the tables and the evidence rules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlifetime.cli.output import bounded_int, input_file, progress

EXIT_ILLEGAL = 1
EXIT_NOTHING_TO_CHECK = 3
EXIT_STATUS: tuple[tuple[int, str], ...] = (
    (0, "every step of the log is legal"),
    (EXIT_ILLEGAL, "an illegal step (printed with the steps before it)"),
    (
        2,
        "the log cannot be read: no such file, not JSON lines, a line over 1 MiB, or a usage error",
    ),
    (EXIT_NOTHING_TO_CHECK, "the log holds no kvlifetime event: nothing was checked"),
)

HINT = (
    "kvlifetime writes such a log with simulate --log-json FILE or demo --log-json FILE; from "
    "Python, configure structlog to render JSON lines while the ledger runs"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "log_path",
        metavar="LOG.jsonl",
        help="structlog JSON lines (or '-' for stdin), e.g. as kvlifetime simulate --log-json "
        "FILE writes them",
    )
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: a verdict and the illegal step in context; json: one JSON document",
    )
    p.add_argument(
        "--context",
        type=bounded_int(0),
        default=10,
        metavar="N",
        help="steps shown before an illegal one",
    )


def run(args: argparse.Namespace) -> int:
    from kvlifetime.verify.replay import NothingToCheck, read_log_file, replay

    log = args.log
    try:
        if args.log_path == "-":
            records = read_log_file(sys.stdin)
        else:
            with input_file(Path(args.log_path), "log").open(encoding="utf-8") as f:
                records = read_log_file(f)
    except (ValueError, UnicodeDecodeError) as e:
        log.info("replay_unreadable", path=args.log_path, error=str(e))
        print(f"kvlifetime replay: error: {args.log_path}: {e}", file=sys.stderr)
        return 2
    log.info("replay_read", path=args.log_path, records=len(records))
    try:
        last_line = records[-1][0] if records else 0
        with progress(last_line, "replay", "lines", show=args.progress) as bar:
            report = replay(records, context=args.context, log=log, on_step=bar.set)
    except NothingToCheck as e:
        log.info("replay_nothing_to_check", path=args.log_path, records=len(records))
        print(f"kvlifetime replay: refused: {e} ({HINT})", file=sys.stderr)
        return EXIT_NOTHING_TO_CHECK
    log.info(
        "replay_checked",
        mode=report.mode,
        steps=report.steps,
        ok=report.ok,
        illegal_line=None if report.illegal is None else report.illegal.line,
    )
    if args.format == "json":
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(report.to_text())
    return 0 if report.ok else EXIT_ILLEGAL
