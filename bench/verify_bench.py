"""Benchmark of ``kvlifetime verify`` (run by hand, not part of the test suite).

    .venv/bin/python bench/verify_bench.py [--requests 3 --peers 2 --blocks 3 --faults all]
        [--max-faults K] [--max-states N] [--no-plain] [--access read] [--ranks N] [--restarts 1]

Explores the configuration with the proof policy: with both reductions, without the
partial-order reduction, and without any reduction (each capped at ``--max-states``), and
prints states, states/s and the reductions' factors. Refutations of naive and timeout are timed
too, and with ``--ranks`` / ``--restarts`` the refutation of first-rank / fresh-restart. The
machine's core count is printed: the explorer is single-threaded. The depth targets are timed by
``bench/verify_depth.py``.
"""

from __future__ import annotations

import argparse
import os
import time

from kvlifetime.grant import Access
from kvlifetime.verify import Config, Policy, explore, parse_faults


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--faults", default="all")
    ap.add_argument("--max-states", type=int, default=None)
    ap.add_argument("--max-faults", type=int, default=None, help="total fault budget")
    ap.add_argument("--no-plain", action="store_true", help="skip the unreduced run")
    ap.add_argument("--access", choices=("write", "read"), default="write")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--restarts", type=int, default=0)
    args = ap.parse_args()
    cfg = Config(
        args.requests,
        args.peers,
        args.blocks,
        faults=parse_faults(args.faults),
        max_faults=args.max_faults,
        access=Access(args.access),
        ranks=args.ranks,
        restarts=args.restarts,
    )
    print(f"cores: {os.cpu_count()}  config: {cfg.describe()}")
    unsafe = [Policy.NAIVE, Policy.TIMEOUT]
    unsafe += [Policy.FIRST_RANK] if args.ranks > 1 else []
    unsafe += [Policy.FRESH_RESTART] if args.restarts else []
    for policy in unsafe:
        r = explore(cfg, policy)
        print(
            f"{policy.value:>8}: {r.verdict} ({r.violation.invariant if r.violation else '-'}), "
            f"{len(r.trace)} steps, {r.states} states in {r.seconds:.2f} s"
        )
    t0 = time.perf_counter()
    red = explore(cfg, Policy.PROOF, max_states=args.max_states)
    print(
        f"   proof: {red.verdict}, {red.states} states, {red.transitions} transitions, "
        f"{red.seconds:.1f} s, {red.states_per_second:,.0f} states/s (reduced)"
    )
    if not args.no_plain:
        nopor = explore(cfg, Policy.PROOF, por=False, max_states=args.max_states)
        print(
            f"   proof: {nopor.verdict}, {nopor.states} states, {nopor.seconds:.1f} s, "
            f"{nopor.states_per_second:,.0f} states/s (symmetry only, no partial-order reduction)"
        )
        if red.complete and nopor.complete:
            print(f"partial-order reduction factor: {nopor.states / red.states:.2f}x")
        plain = explore(cfg, Policy.PROOF, reduce=False, por=False, max_states=args.max_states)
        print(
            f"   proof: {plain.verdict}, {plain.states} states, {plain.seconds:.1f} s, "
            f"{plain.states_per_second:,.0f} states/s (no reduction)"
        )
        if red.complete and plain.complete:
            print(f"total reduction factor: {plain.states / red.states:.2f}x")
    print(f"total: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
