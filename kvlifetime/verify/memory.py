"""How much memory the search holds, and how much it may: the memory budget.

A breadth-first search keeps every state it stored (for the counterexample's path) and every
state it has not expanded yet; past a few million states that is gigabytes. The search reads
its own resident memory as it goes and stops at the budget with what it covered (an
incomplete result, never a pass), instead of being killed by the operating system.
"""

from __future__ import annotations

import os
import resource
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# The budget when none is given: this, or half the memory available when the search starts,
# whichever is less (the machine is shared with the engine being checked, or other searches).
DEFAULT_BUDGET_BYTES = 2048 * 2**20


def resident_bytes() -> int:
    """This process's resident memory now (Linux: ``/proc/self/statm``, about 10 us); where
    that file does not exist, the peak so far (``getrusage``), which is never less."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KB elsewhere


def available_bytes() -> int | None:
    """The memory the system says is available (``MemAvailable``), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_budget() -> int:
    """``DEFAULT_BUDGET_BYTES``, or half the available memory if that is less."""
    avail = available_bytes()
    return DEFAULT_BUDGET_BYTES if avail is None else min(DEFAULT_BUDGET_BYTES, avail // 2)
