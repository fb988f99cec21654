"""What ``import kvlifetime`` costs, against ``import json`` in the same run.

Each sample is a fresh interpreter: the figure is the time of the import statement alone
(``perf_counter`` around it), so process start-up is not counted. The variants run
interleaved, round after round, so a busy machine slows them alike; the medians and the ratio
to ``import json`` are printed, and written as JSON with ``--out``. Each row also names the
heavy modules the statement loaded.

    python -m bench.import_time [--rounds 15] [--out out/bench-import.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS: tuple[str, ...] = (
    "import json",
    "import kvlifetime",
    "from kvlifetime import KVLifetimeError",
    "from kvlifetime import BlockLedger",
    "from kvlifetime import RequestLifecycle",
)
# Modules `import kvlifetime` must not load (nothing the caller did not ask for).
HEAVY = ("numpy", "structlog", "statemachine", "asyncio", "attrs", "tqdm")

_CODE = """\
import time
t0 = time.perf_counter()
{statement}
t1 = time.perf_counter()
import sys
print(t1 - t0)
print(' '.join(sorted(sys.modules)))
"""


def sample(statement: str) -> tuple[float, set[str]]:
    """The statement's own time (ms) in a fresh interpreter, and the modules loaded after it."""
    proc = subprocess.run(
        [sys.executable, "-c", _CODE.format(statement=statement)],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, modules = proc.stdout.splitlines()
    return float(seconds) * 1000, set(modules.split())


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="python -m bench.import_time")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    loaded: dict[str, set[str]] = {}
    for _ in range(args.rounds):
        for name in VARIANTS:
            ms, modules = sample(name)
            times[name].append(ms)
            loaded[name] = modules
    base = statistics.median(times["import json"])
    result: dict[str, object] = {"rounds": args.rounds, "python": sys.version.split()[0]}
    rows: dict[str, dict[str, object]] = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {
            "median_ms": round(med, 2),
            "min_ms": round(min(ts), 2),
            "vs_import_json": round(med / base, 2) if base else None,
            "loads": [h for h in HEAVY if h in loaded[name]],
        }
    result["variants"] = rows
    width = max(map(len, rows))
    print(f"import time, median of {args.rounds} fresh interpreters (interleaved)")
    for name, r in rows.items():
        heavy = r["loads"]
        assert isinstance(heavy, list)
        loads = ", ".join(heavy) or "none of " + "/".join(HEAVY)
        print(
            f"  {name:<{width}}  {r['median_ms']:>7.2f} ms  (x{r['vs_import_json']} import json)"
            f"  loads: {loads}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
