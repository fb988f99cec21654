"""The compiled checker at depth, against the targets of issue 34.

``python -m bench.compiled_targets [--out FILE]``

Each row searches one configuration with ``kvlifetime verify --engine compiled``'s checker
(``kvlifetime.verify.cenv``: the canonical states with the partial-order reduction, exact),
``proof`` policy, every fault kind, under a memory budget, and prints what it measured:
states, seconds, states/s, bytes a stored state (what the search holds, the arena's and the
table's slack included) and the verdict; and the target, with whether it was met. A
benchmark: it measures and reports; it asserts nothing about time. Compiling is not timed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvlifetime.verify import Config, Policy, cbuild, cenv, csearch
from kvlifetime.verify.csearch import Verdict
from kvlifetime.verify.state import ALL_FAULTS

GB = 2**30
ROWS: list[tuple[str, Config, int, float | None]] = [
    # (name, configuration, memory budget in bytes, seconds asked; None: only the budget)
    ("3 x 2 x 3, every fault kind, at most 2 per run", Config(3, 2, 3, max_faults=2), 2 * GB, 10),
    ("2 x 2 x 2, every fault kind, per-kind bounds only", Config(2, 2, 2), 2 * GB, 60),
    ("3 x 3 x 3, every fault kind, at most 2 per run", Config(3, 3, 3, max_faults=2), 4 * GB, None),
]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compiled_targets")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []
    print("| shape | verdict | states | seconds | states/s | bytes a state | budget | target |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, config, budget, asked in ROWS:
        assert config.faults == ALL_FAULTS
        lib = cbuild.build(cenv.checker(config, Policy.PROOF, por=True), name="cenv").library
        t0 = time.perf_counter()
        res = csearch.run(lib, memory_budget=budget)
        seconds = time.perf_counter() - t0
        per_state = res.bytes / max(1, res.states)
        done = res.verdict is Verdict.PASS
        met = done and (asked is None or seconds < asked) and per_state <= 64
        within = "" if asked is None else f"< {asked:.0f} s, "
        target = f"{within}within {budget // GB} GB, <= 64 B a state: {'met' if met else 'not met'}"
        if done and asked is None and per_state > 64:
            target = f"within {budget // GB} GB: met ({per_state:.0f} B a state, over 64)"
        rows.append(
            {
                "shape": name,
                "verdict": res.verdict.name,
                "states": res.states,
                "depth": res.depth,
                "seconds": seconds,
                "bytes_per_state": per_state,
                "budget": budget,
                "target": target,
            }
        )
        print(
            f"| {name} | {res.verdict.name.lower()} (depth {res.depth}) | {res.states:,} | "
            f"{seconds:.1f} | {res.states / max(seconds, 1e-3):,.0f} | {per_state:.0f} | "
            f"{budget // GB} GB | {target} |",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
