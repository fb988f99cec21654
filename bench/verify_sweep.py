"""The reduced search against the unreduced one over the model's newer behaviours (by hand).

    .venv/bin/python bench/verify_sweep.py [--cap 60000]

For each small shape, fault set and option (``ranks=2``, ``access=read``, ``restarts=1``) and
each policy that option can refute, runs the search with and without the partial-order
reduction and compares: the same verdict; when refuted, the same broken invariant and
counterexample length, the reduced trace replaying on a checked ledger to the same violation;
when passing, the same quiet states up to symmetry. A case whose search stores ``--cap`` states
is skipped (said so). The tests run a few of these cases; this runs them all (minutes).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvlifetime.grant import Access
from kvlifetime.verify import Config, Policy, explore, parse_faults, run_events

FAULT_SETS: list[tuple[str, int | None]] = [
    ("loss", None),
    ("crash,fence", None),
    ("all", 1),
    ("reorder,retry", None),
    ("timeout,fail", None),
]


def cases() -> list[tuple[tuple[int, int, int], str, int | None, dict[str, Any]]]:
    out: list[tuple[tuple[int, int, int], str, int | None, dict[str, Any]]] = []
    for shape in ((1, 2, 1), (2, 1, 1)):
        for faults, budget in FAULT_SETS:
            out.append((shape, faults, budget, {"ranks": 2}))
            out.append((shape, faults, budget, {"access": Access.READ}))
    for faults, budget in [("loss", None), ("crash,fence", None), ("timeout,fail", None)]:
        out.append(((2, 1, 1), faults, budget, {"restarts": 1}))
    out.append(((2, 1, 1), "lie", None, {"restarts": 1}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=int, default=60_000, help="skip a case past this many states")
    args = ap.parse_args()
    compared = mismatched = skipped = 0
    for shape, faults, budget, kw in cases():
        r, p, b = shape
        cfg = Config(r, p, b, faults=parse_faults(faults), max_faults=budget, **kw)
        policies = [Policy.PROOF, Policy.NAIVE, Policy.TIMEOUT]
        policies += [Policy.FIRST_RANK] if cfg.ranks > 1 else []
        policies += [Policy.FRESH_RESTART] if cfg.restarts else []
        for policy in policies:
            t0 = time.perf_counter()
            red_quiet: set[object] = set()
            full_quiet: set[object] = set()
            red = explore(cfg, policy, quiet=red_quiet, max_states=args.cap)
            full = explore(cfg, policy, por=False, quiet=full_quiet, max_states=args.cap)
            opts = {k: v for k, v in cfg.describe().items() if k in ("access", "ranks", "restarts")}
            what = f"{shape} {faults} K={budget} {opts} {policy.value}"
            if red.verdict == "incomplete" or full.verdict == "incomplete":
                skipped += 1
                print(f"skip {what}: past {args.cap:,} states", flush=True)
                continue
            ok = red.verdict == full.verdict
            if red.violation is not None and full.violation is not None:
                ok = ok and len(red.trace) == len(full.trace)
                ok = ok and red.violation.invariant == full.violation.invariant
                trace = [s.event for s in red.trace]
                _s, _n, again = run_events(cfg, policy, trace, checked=True)
                ok = ok and again == red.violation
            elif red.violation is None:
                ok = ok and red_quiet == full_quiet
            compared += 1
            mismatched += not ok
            print(
                f"{'ok ' if ok else 'MISMATCH'} {what}: {red.verdict} ({len(red.trace)} steps), "
                f"{red.states:,} vs {full.states:,} states, "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
    print(f"compared {compared}, mismatches {mismatched}, skipped {skipped}")


if __name__ == "__main__":
    main()
