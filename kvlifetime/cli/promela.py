"""``promela``: the Promela model for SPIN, generated from the specification; its swarm.

``kvlifetime promela --shape 2x2x2 --policy proof --out model.pml`` writes the model of one
configuration (``kvlifetime.verify.promela``); ``--swarm N`` instead runs N diversified
bitstate searches of it on SPIN (``kvlifetime.verify.swarm``) for a shape past exact search,
and prints each run with its coverage estimate and an approximate verdict: a violation
(exit 1) or "no violation found" (exit 3, incomplete), never a pass.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvlifetime.cli.output import bounded_int, write_text
from kvlifetime.verify.state import Policy

EXIT_VIOLATION = 1
EXIT_INCOMPLETE = 3
EXIT_STATUS: tuple[tuple[int, str], ...] = (
    (EXIT_VIOLATION, "--swarm: a run found a violation (its trail replays in spin -t)"),
    (EXIT_INCOMPLETE, "--swarm: no violation found; a bitstate search misses states: no pass"),
)
_MODEL_POLICIES = ("naive", "timeout", "proof", "trusting")


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a shape is RxPxB (e.g. 2x2x2), got {text!r}")
    r, p, b = (bounded_int(1)(x) for x in parts)
    return r, p, b


def _fault_cap(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    return bounded_int(0)(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        type=_shape,
        default=(2, 2, 2),
        metavar="RxPxB",
        help="requests x peers x blocks (default: 2x2x2; at most 4 requests and 3 peers)",
    )
    p.add_argument(
        "--policy",
        choices=_MODEL_POLICIES,
        default="proof",
        help="when the engine frees blocks (the policies the model has)",
    )
    p.add_argument(
        "--faults",
        default="all",
        help="comma list of reorder,duplicate,delay,loss,crash,fence,timeout,retry,fail,lie; "
        "or all / none",
    )
    p.add_argument(
        "--max-faults",
        type=_fault_cap,
        default=None,
        metavar="K",
        help="at most K fault events per run; 'none': only the per-kind bounds (default: none)",
    )
    p.add_argument("--transfers", type=bounded_int(1), default=1, help="per grant (1 or 2)")
    p.add_argument("--out", type=Path, default=None, help="write the model here (default: stdout)")
    p.add_argument(
        "--swarm",
        type=bounded_int(1),
        default=None,
        metavar="N",
        help="run N diversified bitstate searches on SPIN instead (needs spin and gcc)",
    )
    p.add_argument(
        "--seconds-per-run", type=float, default=60.0, help="--swarm: each run's time bound"
    )
    p.add_argument(
        "--bits", type=bounded_int(16), default=30, help="--swarm: 2^N bits per run's array"
    )
    p.add_argument("--seed", type=bounded_int(0), default=1, help="--swarm: the first seed")
    p.add_argument(
        "--opt-level",
        choices=("0", "1", "2"),
        default="2",
        help="--swarm: gcc -O level of pan. It changes how long pan takes to build and how "
        "fast it runs, never what it checks (at 2x2x2: -O0 builds about 7 times faster, "
        "-O2 runs about 1.8 times faster; docs/verification-anchor.md)",
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="--swarm: where pan is built (default: temp)"
    )


def run(args: argparse.Namespace) -> int:
    from kvlifetime.verify import Config, parse_faults
    from kvlifetime.verify.promela import PromelaError, generate

    r, p, b = args.shape
    try:
        config = Config(
            r,
            p,
            b,
            faults=parse_faults(args.faults),
            max_faults=args.max_faults,
            transfers_per_grant=args.transfers,
        )
        policy = Policy(args.policy)
        if args.swarm is None:
            text = generate(config, policy)
            if args.out is None:
                sys.stdout.write(text)
                args.log.info("stdout_written", command=args.command, bytes=len(text))
            else:
                write_text(args.out, text, args.log)
                print(f"wrote {args.out}", file=sys.stderr)
            return 0
        return _swarm(args, config, policy)
    except (ValueError, PromelaError) as e:
        print(f"kvlifetime promela: error: {e}", file=sys.stderr)
        return 2


def _swarm(args: argparse.Namespace, config: object, policy: Policy) -> int:
    from kvlifetime.verify.state import Config
    from kvlifetime.verify.swarm import SwarmError, SwarmRun, report, run_swarm

    assert isinstance(config, Config)

    def progress(r: SwarmRun) -> None:
        print(
            f"run {r.index}: {r.states:,} states, {r.seconds:.1f} s, errors {r.errors}",
            file=sys.stderr,
            flush=True,
        )

    with tempfile.TemporaryDirectory(prefix="kvlifetime-swarm-") as tmp:
        workdir = args.workdir or Path(tmp)
        try:
            result = run_swarm(
                config,
                policy,
                workdir,
                runs=args.swarm,
                seconds_per_run=args.seconds_per_run,
                bits_log2=args.bits,
                seed=args.seed,
                optimize=f"-O{args.opt_level}",
                progress=progress,
            )
        except SwarmError as e:
            print(f"kvlifetime promela: error: {e}", file=sys.stderr)
            return 2
    print(report(result))
    return EXIT_VIOLATION if result.invariant is not None else EXIT_INCOMPLETE
