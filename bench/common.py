"""What every engine benchmark (``bench.vllm_*``, ``bench.sglang_cost``) shares and that needs
no engine imported: the machine the figures were measured on, the figures' JSON, the table."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def machine(**engine: Any) -> dict[str, Any]:
    """What the figures were measured on (they are ratios; the absolute times are this box's):
    the processor, cores, Python and numpy, then ``engine`` (the caller's versions, and more)."""
    import numpy as np

    from kvlifetime import accel

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        # the ledger's modules: "compiled" (make accel) or "pure" (KVLIFETIME_PURE=1, or not built)
        "ledger_build": accel.variant(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        **engine,
    }


def write_json(path: Path | None, report: Mapping[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def own_profile(run: Any, n: int, top: int) -> list[dict[str, Any]]:
    """``run()`` under cProfile: the functions inside kvlifetime by their own time, µs per
    request over ``n`` requests (the engine's own functions and the compiled modules, which
    cProfile does not see into, are left out: a compiled module's time shows in its
    interpreted caller's)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(run)
    raw: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own: list[tuple[float, int, str]] = []
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in raw.items():
        if "/kvlifetime/" in file:
            short = file.split("/kvlifetime/", 1)[1]
            own.append((tt, nc, f"{short}:{line}({name})"))
    own.sort(reverse=True)
    return [{"fn": f, "calls": c, "us_per_request": t / n * 1e6} for t, c, f in own[:top]]
