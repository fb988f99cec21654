"""The verifier's depth targets, timed (run by hand or by ``make verify-depth``; not a test).

    .venv/bin/python bench/verify_depth.py [--only 3x2x3-k2|2x2x2-kinds|3x2x3-k1]
        [--limit SECONDS] [--baseline DIR] [--engines ledger,packed] [--processes 1,2]
        [--profile SECONDS] [--variants pure,compiled [--pairs N]]

Each target is a proof-policy search with every fault kind:

- ``3x2x3-k1``: 3 requests x 2 peers x 3 blocks, at most one fault per run (the test's shape);
- ``3x2x3-k2``: the same at two faults per run (the target: under 60 s on 2 cores);
- ``2x2x2-kinds``: 2 x 2 x 2 with only the per-kind bounds, no total (target: to completion in
  under 5 minutes on 2 cores);
- ``cli-default``: ``kvlifetime verify`` with no arguments, as a new user runs it, in its own
  process: wall seconds to the verdict and its peak resident memory (target: under 30 s on 2
  cores; its test checks the verdict, not the time).

Every line carries the machine's load average when it started: the machine is shared.

``--engines`` and ``--processes`` run each search once per engine (``ledger``: the real
``BlockLedger``; ``packed``: ``PackedLedger``) and per number of worker processes (packed
only), one after the other in the same run, and print the rate of each against the first
(the comparison of the engines, and of one process with two). ``--profile SECONDS``: instead,
cProfile of the packed engine on ``3x2x3-k2`` for that long, top functions by own time (the
floor, where a target is not met).

``--variants pure,compiled``: the accelerator side by side (``make accel`` first), the packed
engine in one process: each target (``3x2x3-k2``, ``2x2x2-kinds``, ``cli-default`` unless
``--only`` says) once per variant in its own process (``KVLIFETIME_PURE=1`` or ``0``, and the
child checks ``kvlifetime.accel.variant()`` is the one asked for), alternating which goes first
pair by pair (``--pairs``, default 1), and the rate of each against the pure one of its pair
(states per second of the search's own CPU time: a shared machine's load moves it less than
the wall-clock rate, which is printed too).
Where the target's full size is known (``TOTAL_STATES``), an unfinished search also prints the
time it would take at its rate. With ``--baseline DIR`` each variant of ``DIR``'s kvlifetime
runs too (a change measured against the code before it, both pure and compiled).

A search still running at ``--limit`` seconds is stopped there (through its progress callback)
and reported with the states it reached and its rate, marked unfinished. ``--baseline DIR``:
the same searches with the ``kvlifetime`` package found under ``DIR`` (say, an older checkout),
each run right after the current one, and the ratio of their rates (the machine is shared:
ratios within one run, not absolute times, are what compares).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

TARGETS: dict[str, dict[str, Any]] = {
    "cli-default": {},
    "3x2x3-k1": {"shape": (3, 2, 3), "max_faults": 1},
    "3x2x3-k2": {"shape": (3, 2, 3), "max_faults": 2},
    "2x2x2-kinds": {"shape": (2, 2, 2), "max_faults": None},
}


# Canonical states of a target's full search, where one has finished (docs/verification.md):
# an unfinished search's projected time to its verdict is this over its rate.
TOTAL_STATES: dict[str, int] = {"3x2x3-k2": 1_824_117}


def run_default_command(limit: float) -> dict[str, Any]:
    """``kvlifetime verify`` with no arguments, in a process of its own (JSON out)."""
    code = "import sys; from kvlifetime.cli import main; sys.exit(main(sys.argv[1:]))"
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, "verify", "--format", "json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=limit,
    ).stdout
    wall = time.perf_counter() - t0
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    doc = json.loads(out)
    return {
        "target": "cli-default",
        "verdict": doc["verdict"],
        "finished": doc["complete"] or doc["violation"] is not None,
        "states": doc["states"],
        "seconds": round(wall, 1),
        "states_per_second": round(doc["states_per_second"]),
        "cpu_seconds": round(child.ru_utime + child.ru_stime, 1),
        "memory_mb": round(child.ru_maxrss / 1024),
    }


def run_one(name: str, limit: float, engine: str = "ledger", processes: int = 1) -> dict[str, Any]:
    """One target in this process, stopped at ``limit`` seconds."""
    cpu0 = time.process_time()
    out = _run_one(name, limit, engine, processes)
    if name != "cli-default":
        # This process's CPU time (the states' share of a shared machine's cores).
        out["cpu_seconds"] = round(time.process_time() - cpu0, 1)
    try:
        from kvlifetime import accel
    except ImportError:  # a baseline from before the accelerator
        return out
    # The child of cli-default inherits this process's KVLIFETIME_PURE: the same variant.
    out["variant"] = accel.variant()
    return out


def _run_one(name: str, limit: float, engine: str, processes: int) -> dict[str, Any]:
    from kvlifetime.verify import Config, Policy, explore, parse_faults

    if name == "cli-default":
        return run_default_command(limit)
    t = TARGETS[name]
    r_, p_, b_ = t["shape"]
    cfg = Config(r_, p_, b_, faults=parse_faults("all"), max_faults=t["max_faults"])
    t0 = time.perf_counter()

    stopped: list[bool] = []

    def stop_at_limit(*_progress: Any) -> None:
        if not stopped and time.perf_counter() - t0 > limit:
            stopped.append(True)
            raise KeyboardInterrupt  # explore returns the partial result

    try:
        if engine == "ledger" and processes == 1:
            r = explore(cfg, Policy.PROOF, progress=stop_at_limit, progress_every=1.0)
        else:
            r = explore(
                cfg,
                Policy.PROOF,
                progress=stop_at_limit,
                progress_every=1.0,
                engine=engine,
                processes=processes,
            )
    except KeyboardInterrupt:
        # An explorer from before the partial results (a baseline): it cannot say how far
        # it got.
        return {
            "target": name,
            "verdict": "stopped",
            "finished": False,
            "states": 0,
            "seconds": round(time.perf_counter() - t0, 1),
            "states_per_second": 0,
        }
    except TypeError:  # a baseline explorer without progress_every (and no partial result)
        r = explore(cfg, Policy.PROOF)
    return {
        "target": name,
        "verdict": r.verdict,
        "finished": r.complete or r.violation is not None,
        "states": r.states,
        "seconds": round(r.seconds, 1),
        "states_per_second": round(r.states_per_second),
        "memory_mb": round(r.memory_peak / 2**20),
    }


def profile_packed(seconds: float) -> None:
    """cProfile of the packed engine on 3x2x3-k2 for ``seconds``: the top functions."""
    import cProfile
    import pstats

    from kvlifetime.verify import Config, Policy, explore, parse_faults

    cfg = Config(3, 2, 3, faults=parse_faults("all"), max_faults=2)
    t0 = time.perf_counter()

    def stop(*_progress: Any) -> None:
        if time.perf_counter() - t0 > seconds:
            raise KeyboardInterrupt

    prof = cProfile.Profile()
    prof.enable()
    r = explore(cfg, Policy.PROOF, engine="packed", progress=stop, progress_every=1.0)
    prof.disable()
    print(f"packed, 3x2x3-k2, profiled: {r.states:,} states in {r.seconds:.1f} s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def _in_subprocess(
    name: str,
    limit: float,
    path: str | None,
    engine: str = "ledger",
    processes: int = 1,
    variant: str | None = None,
) -> dict[str, Any]:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path
    if variant is not None:
        env["KVLIFETIME_PURE"] = "1" if variant == "pure" else "0"
    extra = [] if engine == "ledger" and processes == 1 else ["--engine", engine]
    extra += [] if processes == 1 else ["--processes", str(processes)]
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--limit", str(limit), *extra],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if variant is not None and doc.get("variant") != variant:
        raise SystemExit(f"asked for the {variant} variant, the child ran {doc.get('variant')}")
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(TARGETS), action="append")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds per search")
    ap.add_argument("--baseline", default=None, help="a directory holding another kvlifetime")
    ap.add_argument("--engines", default=None, help="e.g. ledger,packed: one search each")
    ap.add_argument("--processes", default="1", help="e.g. 1,2: worker processes (packed)")
    ap.add_argument("--engine", default="ledger", help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=float, default=None, help="profile packed for SECONDS")
    ap.add_argument("--variants", default=None, help="pure,compiled: the accelerator compared")
    ap.add_argument("--pairs", type=int, default=1, help="with --variants: processes per variant")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        procs = int(args.processes)
        print(json.dumps(run_one(args.child, args.limit, args.engine, procs)))
        return
    if args.profile is not None:
        profile_packed(args.profile)
        return
    if args.engines is not None:
        compare(args)
        return
    if args.variants is not None:
        compare_variants(args)
        return
    print(f"cores: {os.cpu_count()}  limit: {args.limit:.0f} s per search")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in args.only or list(TARGETS):
        load = os.getloadavg()[0]
        cur = _in_subprocess(name, args.limit, here)
        line = (
            f"{name:>12}: {cur['verdict']}{'' if cur['finished'] else ' (stopped at limit)'}, "
            f"{cur['states']:,} states, {cur['seconds']} s, {cur['states_per_second']:,} "
            f"states/s, {cur.get('memory_mb', '?')} MB (load average {load:.1f})"
        )
        if args.baseline:
            base = _in_subprocess(name, args.limit, args.baseline)
            ratio = cur["states_per_second"] / max(base["states_per_second"], 1)
            line += (
                f" | baseline: {base['verdict']}, {base['states']:,} states, {base['seconds']} s,"
                f" {base['states_per_second']:,} states/s | rate ratio {ratio:.2f}x"
            )
        print(line, flush=True)


def compare(args: argparse.Namespace) -> None:
    """Each target once per engine and number of processes, in one run: rates against the
    first search of the target."""
    print(f"cores: {os.cpu_count()}  limit: {args.limit:.0f} s per search")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [
        (e, int(p))
        for e in args.engines.split(",")
        for p in args.processes.split(",")
        if e == "packed" or p == "1"
    ]
    for name in args.only or [t for t in TARGETS if t != "cli-default"]:
        first = None
        for engine, procs in runs:
            load = os.getloadavg()[0]
            cur = _in_subprocess(name, args.limit, here, engine, procs)
            rate = cur["states_per_second"]
            first = first or max(rate, 1)
            print(
                f"{name:>12} {engine:>6} x{procs}: {cur['verdict']}"
                f"{'' if cur['finished'] else ' (stopped at limit)'}, {cur['states']:,} states, "
                f"{cur['seconds']} s, {rate:,} states/s ({rate / first:.2f}x), "
                f"{cur.get('memory_mb', '?')} MB (load average {load:.1f})",
                flush=True,
            )


def compare_variants(args: argparse.Namespace) -> None:
    """Each target with the packed engine, pure and compiled in alternating processes: rates
    against the pure one of the same pair."""
    variants = args.variants.split(",")
    print(f"cores: {os.cpu_count()}  limit: {args.limit:.0f} s per search  variants: {variants}")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # With --baseline: each variant of the baseline's kvlifetime too, right after this one's.
    trees = [("", here)] + ([("baseline ", args.baseline)] if args.baseline else [])
    runs = [(f"{t}{v}", path, v) for v in variants for t, path in trees]
    for name in args.only or ["3x2x3-k2", "2x2x2-kinds", "cli-default"]:
        for pair in range(args.pairs):
            order = runs if pair % 2 == 0 else runs[::-1]
            rates: dict[str, int] = {}
            for label, path, variant in order:
                load = os.getloadavg()
                engine = "ledger" if name == "cli-default" else "packed"
                cur = _in_subprocess(name, args.limit, path, engine, 1, variant)
                rate = cur["states_per_second"]
                # States per second of the search's own CPU time: what the load moves least.
                cpu_rate = round(cur["states"] / max(cur.get("cpu_seconds", 0.0), 0.1))
                rates[label] = cpu_rate
                total = TOTAL_STATES.get(name)
                projected = (
                    f", projected {total / max(rate, 1) / 60:.1f} min to the verdict "
                    f"({total:,} states)"
                    if total and not cur["finished"]
                    else ""
                )
                print(
                    f"{name:>12} {label:>17} (pair {pair + 1}): {cur['verdict']}"
                    f"{'' if cur['finished'] else ' (stopped at limit)'}, {cur['states']:,} "
                    f"states, {cur['seconds']} s, {rate:,} states/s, {cur.get('cpu_seconds')} CPU "
                    f"s, {cpu_rate:,} states per CPU s{projected}, "
                    f"{cur.get('memory_mb', '?')} MB (load average "
                    f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f})",
                    flush=True,
                )
            first = max(rates[variants[0]], 1)
            print(
                f"{name:>12} pair {pair + 1}, states per CPU s: "
                + ", ".join(f"{r} / {variants[0]} {rates[r] / first:.2f}x" for r, _, _ in runs[1:]),
                flush=True,
            )


if __name__ == "__main__":
    main()
