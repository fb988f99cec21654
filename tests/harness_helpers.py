"""Shared by the harness tests: what a run must leave behind (nothing)."""

from __future__ import annotations

import os
from pathlib import Path


def child_processes() -> list[int]:
    """Processes whose parent is this one (the harness must leave none behind).
    multiprocessing's own resource tracker lives as long as this process: not the harness's."""
    me = str(os.getpid())
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[1] != me or fields[0] == "Z" or b"resource_tracker" in cmd:
            continue
        out.append(int(d.name))
    return out
