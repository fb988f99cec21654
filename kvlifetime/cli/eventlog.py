"""``--log-json FILE``: the ledger's events as JSON lines, the log ``kvlifetime replay`` checks.

kvlifetime logs only once structlog is configured (its hot path builds nothing otherwise), and
a library never configures structlog. A command asked for ``--log-json`` is the application:
for the duration of the run it configures structlog to render every event as one JSON object
per line into the file, then puts back whatever configuration it found (the unconfigured
default included). Harness peers run in processes of their own (spawned): their events are
not in the file, only the decode or source owner's ledger's are, which is what replay checks.

While the file is written, the command line's own ``-v`` lines on stderr are JSON too (they
share structlog's processors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

__all__ = ["RunLogs", "event_log", "per_run_logs", "run_log_path"]


def _processors() -> list[Any]:
    return [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.JSONRenderer(default=str, sort_keys=True),
    ]


@contextlib.contextmanager
def event_log(path: Path) -> Iterator[Path]:
    """Every structlog event of this process, as JSON lines into ``path``, inside the block.

    ``path`` is opened (and its folder made) before the block runs, so an unwritable path
    refuses the command before any work: an ``OSError``, exit 1 on the command line.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    was_configured = structlog.is_configured()
    before = structlog.get_config()
    with path.open("w", encoding="utf-8", newline="\n") as f:
        structlog.configure(
            processors=_processors(),
            logger_factory=structlog.WriteLoggerFactory(file=f),
            wrapper_class=structlog.BoundLogger,
            cache_logger_on_first_use=False,
        )
        try:
            yield path
        finally:
            if was_configured:
                structlog.configure(**before)
            else:
                structlog.reset_defaults()


def run_log_path(path: Path, run: int) -> Path:
    """Run ``run``'s file: ``events.jsonl`` -> ``events-01.jsonl``."""
    return path.with_name(f"{path.stem}-{run:02d}{path.suffix or '.jsonl'}")


class RunLogs:
    """One event log per harness run (a log holds one ledger's life: replay checks one)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._open: contextlib.ExitStack | None = None

    @property
    def pattern(self) -> str:
        if self.path is None:
            return ""
        return str(self.path.with_name(f"{self.path.stem}-NN{self.path.suffix or '.jsonl'}"))

    def start(self, run: int) -> None:
        if self.path is None:
            return
        self.stop()
        stack = contextlib.ExitStack()
        stack.enter_context(event_log(run_log_path(self.path, run)))
        self._open = stack

    def stop(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None


@contextlib.contextmanager
def per_run_logs(path: Path | None) -> Iterator[RunLogs]:
    """``RunLogs`` for ``path`` (``None``: nothing is written); the last one closed on exit."""
    logs = RunLogs(path)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield logs
    finally:
        logs.stop()
