"""``verify``: the bounded exhaustive explorer over the real ledger.

The search runs in ``kvlifetime.verify.explore``, which writes nothing: this module turns its
progress callback into a bar on stderr (``--progress``; by default when stderr is a terminal)
and a ``verify_progress`` log event (``-v``), and its result into the text or JSON on stdout and
the exit status. Ctrl-C ends the search, not the command: the partial result is printed and the
status is 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvlifetime.cli.output import bounded_int
from kvlifetime.verify.state import POLICY_RULES, Policy

if TYPE_CHECKING:
    from kvlifetime.verify.explore import Progress, Result

EXIT_VIOLATION = 1
EXIT_INCOMPLETE = 3
EXIT_INTERRUPTED = 130  # as every kvlifetime command (128 + SIGINT)

EXIT_STATUS: tuple[tuple[int, str], ...] = (
    (0, "pass: every reachable state keeps every invariant"),
    (EXIT_VIOLATION, "a violation: the policy is refuted (the shortest counterexample is printed)"),
    (2, "a usage error, or a shape the explorer cannot take (one line on stderr)"),
    (
        EXIT_INCOMPLETE,
        "incomplete: no violation found, but not every state was explored (--max-states, "
        "or --hash-compaction, which may miss states)",
    ),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C): the partial result is printed"),
)
"""verify's exit statuses, shown at the end of ``kvlifetime verify --help``."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--requests", type=bounded_int(1), default=2, metavar="R", help="requests ever admitted"
    )
    p.add_argument(
        "--peers", type=bounded_int(1), default=2, metavar="P", help="peers (transfer engines)"
    )
    p.add_argument(
        "--blocks", type=bounded_int(1), default=2, metavar="B", help="blocks in the pool"
    )
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
        choices=tuple(pol.value for pol in Policy),
        default="proof",
        help="when the engine frees blocks: "
        + "; ".join(f"{pol.value} ({rule})" for pol, rule in POLICY_RULES.items())
        + " (default: proof)",
    )
    p.add_argument(
        "--access",
        choices=("write", "read"),
        default="write",
        help="what a grant lets its peer do: write (push) or read (pull: the peer reads the "
        "source blocks)",
    )
    p.add_argument(
        "--ranks", type=bounded_int(1), default=1, help="grants per request and peer (TP ranks)"
    )
    p.add_argument(
        "--restarts",
        type=bounded_int(0),
        default=0,
        help="times the owner's process restarts over the same arena (0 or 1)",
    )
    p.add_argument(
        "--share",
        action="store_true",
        help="prefix sharing: a new request may take a live request's settled blocks shared "
        "(a prefix-cache hit) instead of allocating",
    )
    p.add_argument(
        "--transfers", type=bounded_int(0), default=1, help="transfers a peer posts per grant"
    )
    p.add_argument(
        "--blocks-per-request",
        type=bounded_int(1),
        default=1,
        help="blocks each request takes",
    )
    p.add_argument(
        "--max-states",
        type=bounded_int(1),
        default=None,
        help="stop after storing this many states (the verdict is then INCOMPLETE, exit 3)",
    )
    p.add_argument(
        "--max-faults",
        type=bounded_int(0),
        default=None,
        metavar="K",
        help="at most K fault events per run, over every kind (default: no total cap, only "
        "the per-kind bounds)",
    )
    p.add_argument(
        "--no-reduction", action="store_true", help="key states concretely (measures the factor)"
    )
    p.add_argument(
        "--hash-compaction",
        action="store_true",
        help="approximate: store a 64-bit hash of each state instead of the state (far less "
        "memory); a collision may hide a state, so it never passes: no violation found is "
        "INCOMPLETE (exit 3), with the bound on the chance of a miss",
    )
    p.add_argument("--checked", action="store_true", help="mirror into the specification too")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: the verdict and any counterexample; json: one JSON document",
    )


def run(args: argparse.Namespace) -> int:
    from kvlifetime.grant import Access
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
            access=Access(args.access),
            ranks=args.ranks,
            restarts=args.restarts,
            share=args.share,
        )
    except ValueError as e:
        args.log.info("verify_refused", error=str(e))
        print(f"kvlifetime verify: error: {e}", file=sys.stderr)
        return 2
    with _ProgressBar(args) as bar:
        result = explore(
            config,
            Policy(args.policy),
            reduce=not args.no_reduction,
            max_states=args.max_states,
            checked=args.checked,
            progress=bar.update,
            compact=args.hash_compaction,
        )
    if args.format == "json":
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(result.to_text())
    return exit_status(result)


def exit_status(result: Result) -> int:
    """The command's exit status for ``result`` (``EXIT_STATUS``)."""
    if result.violation is not None:
        return EXIT_VIOLATION
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 0 if result.complete else EXIT_INCOMPLETE


class _ProgressBar:
    """The search's progress on stderr: a tqdm bar (states, depth, states/s, queue) when shown,
    and a ``verify_progress`` log event either way."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._show: bool | None = getattr(args, "progress", None)
        self._log: Any = args.log
        self._bar: Any = None

    def __enter__(self) -> _ProgressBar:
        from tqdm import tqdm

        self._bar = tqdm(
            total=None,
            desc="verify",
            unit=" states",
            file=sys.stderr,
            disable=None if self._show is None else not self._show,
            leave=False,
            dynamic_ncols=True,
        )
        return self

    def update(self, p: Progress) -> None:
        self._log.info(
            "verify_progress",
            states=p.states,
            depth=p.depth,
            queue=p.queue,
            states_per_second=round(p.states_per_second),
            seconds=round(p.seconds, 1),
        )
        bar = self._bar
        if bar is not None and not bar.disable:
            bar.update(p.states - bar.n)
            bar.set_postfix(depth=p.depth, queue=p.queue, refresh=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
