"""``replay``: check a recorded event log against the tables and the evidence rules."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log_path", metavar="LOG.jsonl", help="structlog JSON lines (or '-' for stdin)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--context", type=int, default=10, help="steps shown before an illegal one")


def run(args: argparse.Namespace) -> int:
    from kvlifetime.verify.replay import read_log, replay

    try:
        if args.log_path == "-":
            records = read_log(sys.stdin)
        else:
            with open(args.log_path, encoding="utf-8") as f:
                records = read_log(f)
    except ValueError as e:
        print(f"kvlifetime replay: error: {e}", file=sys.stderr)
        return 2
    report = replay(records, context=args.context)
    if args.format == "json":
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(report.to_text())
    return 0 if report.ok else 1
