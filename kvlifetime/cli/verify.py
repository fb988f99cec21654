"""``verify``: the bounded exhaustive explorer over the real ledger."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2, metavar="R", help="requests ever admitted")
    p.add_argument("--peers", type=int, default=2, metavar="P")
    p.add_argument("--blocks", type=int, default=2, metavar="B")
    p.add_argument(
        "--faults",
        default="all",
        help="comma list of reorder,duplicate,delay,loss,crash,fence,timeout,retry,fail,lie; "
        "or all / none (default: all). lie: any peer may, at any moment, send what it may not "
        "claim (AccessRevoked about itself, PeerLost, LeaseExpired, a claim about another "
        "peer's grant or in its name); the ledger must refuse each one",
    )
    p.add_argument(
        "--policy",
        choices=("naive", "timeout", "proof", "trusting"),
        default="proof",
        help="when the engine frees blocks: naive (on reject), timeout (lease reaper), proof "
        "(only what the evidence proves), trusting (proof, with a receiver that stamps wire "
        "evidence as local: no provenance; refuted with --faults lie) (default: proof)",
    )
    p.add_argument("--transfers", type=int, default=1, help="transfers a peer posts per grant")
    p.add_argument("--blocks-per-request", type=int, default=1)
    p.add_argument("--max-states", type=int, default=None, help="stop after this many states")
    p.add_argument(
        "--max-faults",
        type=int,
        default=None,
        metavar="K",
        help="at most K fault events per run, over every kind (default: no total cap; with "
        "every fault kind and no cap even 2x2x2 runs for more than 10 minutes, --max-faults 1 "
        "finishes 3x2x3 in about 20 s)",
    )
    p.add_argument(
        "--no-reduction", action="store_true", help="key states concretely (measures the factor)"
    )
    p.add_argument("--checked", action="store_true", help="mirror into the specification too")
    p.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    from kvlifetime.verify import Config, Policy, explore, parse_faults

    try:
        config = Config(
            requests=args.requests,
            peers=args.peers,
            blocks=args.blocks,
            faults=parse_faults(args.faults),
            transfers_per_grant=args.transfers,
            blocks_per_request=args.blocks_per_request,
            max_faults=args.max_faults,
        )
    except ValueError as e:
        print(f"kvlifetime verify: error: {e}", file=sys.stderr)
        return 2
    result = explore(
        config,
        Policy(args.policy),
        reduce=not args.no_reduction,
        max_states=args.max_states,
        checked=args.checked,
    )
    if args.format == "json":
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(result.to_text())
    return 1 if result.violation is not None else 0
