"""Shared by the harness tests: a run with no fault, and what a run must leave behind
(nothing)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from kvlifetime.harness.faults import FaultConfig

QUIET = FaultConfig(
    p_abort=0.0,
    p_slow=0.0,
    p_late=0.0,
    p_fail=0.0,
    p_lose=0.0,
    p_dup=0.0,
    p_delay=0.0,
    p_malformed=0.0,
    p_prefix=0.0,
    crash=False,
)
"""No fault of any kind: every rate 0, no crash."""


def live_processes() -> Iterator[tuple[int, int, int, bytes]]:
    """Every live (not zombie) process: its pid, parent pid, process group and command line."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z":
            yield int(d.name), int(fields[1]), int(fields[2]), cmd


def child_processes() -> list[int]:
    """Processes whose parent is this one (the harness must leave none behind).
    multiprocessing's own resource tracker lives as long as this process: not the harness's."""
    me = os.getpid()
    return [
        pid
        for pid, ppid, _, cmd in live_processes()
        if ppid == me and b"resource_tracker" not in cmd
    ]


def group_processes(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    return [pid for pid, _, group, _ in live_processes() if group == pgid]
