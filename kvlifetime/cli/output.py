"""What every command shares: its logger type, writing a file, emitting to stdout or ``-o``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import structlog

Logger = Any  # a structlog bound logger (wrap_logger / get_logger return a lazy proxy)


def library_logger() -> Logger:
    return structlog.get_logger("kvlifetime")


def write_text(path: Path, text: str, log: Logger) -> None:
    """Write ``text`` as UTF-8 with ``\\n`` line endings on every platform (byte-stable docs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    log.info("file_written", path=str(path), bytes=len(text.encode("utf-8")))


def emit(text: str, args: argparse.Namespace) -> None:
    if args.output is None or args.output == "-":
        sys.stdout.write(text)
    else:
        write_text(Path(args.output), text, args.log)
