"""``verify``: the bounded exhaustive explorer over the real ledger.

The search runs in ``kvlifetime.verify.explore``, which writes nothing: this module turns its
progress callback into progress on stderr (a bar when stderr is a terminal, else a line about
every second, then every ten; from the first second; ``--no-progress`` silences it) and a
``verify_progress`` log event (``-v``), and its result into the text or JSON on stdout and the
exit status. Ctrl-C ends the search, not the command: the partial result is printed and the
status is 130.

The defaults answer: 2 requests x 2 peers x 2 blocks, every fault kind, at most one fault per run
(``--max-faults 1``), under a memory budget (``--memory-budget``; 2 GB, or half the available
memory if less). Past the budget the search stops with what it covered (INCOMPLETE, exit 3),
instead of being killed by the operating system.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from kvlifetime.cli.output import bounded_int
from kvlifetime.verify.state import POLICY_RULES, Policy

if TYPE_CHECKING:
    from kvlifetime.verify.explore import Progress, Result
    from kvlifetime.verify.state import Config

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
        "the memory budget, or --hash-compaction, which may miss states)",
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
        "--reuse-ids",
        action="store_true",
        help="client-chosen request ids: a new request may arrive with the id of an ended one "
        "the engine still holds (vLLM #49796)",
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
        type=_fault_cap,
        default=DEFAULT_MAX_FAULTS,
        metavar="K",
        help="at most K fault events per run, over every kind; 'none': only the per-kind "
        "bounds (at the default shape, minutes and gigabytes) (default: "
        f"{DEFAULT_MAX_FAULTS}: a verdict in seconds)",
    )
    p.add_argument(
        "--memory-budget",
        type=_megabytes,
        default=None,
        metavar="MB",
        help="stop the search once the process holds this much resident memory; the verdict "
        "is then INCOMPLETE (exit 3), with the states and depth covered; 'none': no budget "
        "(default: 2048, or half the available memory if less)",
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
        "--engine",
        choices=("auto", "ledger", "packed", "compiled"),
        default="auto",
        help="the ledger the model drives: ledger (the real BlockLedger), packed (the same "
        "model over plain values, proven equal to it on a grid of shapes; its counterexamples "
        "are replayed on the real ledger); auto (default): packed where it models the shape "
        "(no --restarts, --share or --checked), else ledger; compiled: the model generated as C "
        "and compiled with the system's compiler, over the same canonical states with every "
        "interleaving (no partial-order reduction), "
        "its counterexamples replayed on the real ledger; where it cannot answer (no compiler, "
        "a shape or policy it does not model) auto answers and the output says why",
    )
    p.add_argument(
        "--processes",
        type=bounded_int(1),
        default=1,
        metavar="N",
        help="expand the frontier in N worker processes (level by level, the same states and "
        "shortest counterexample as one; needs the packed engine; default 1)",
    )
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
            reuse_ids=args.reuse_ids,
        )
    except ValueError as e:
        args.log.info("verify_refused", error=str(e))
        print(f"kvlifetime verify: error: {e}", file=sys.stderr)
        return 2
    from kvlifetime.verify.memory import default_budget

    budget: int | None = default_budget() if args.memory_budget is None else args.memory_budget
    if budget == 0:
        budget = None  # --memory-budget none

    fallback: str | None = None
    if args.engine == "compiled":
        from kvlifetime.verify import compiled

        fallback = compiled.unavailable(config, Policy(args.policy))
        if fallback is None:
            return _run_compiled(args, config, budget)
        args.engine = "auto"
    engine, refused = _engine(args, config)
    if refused is not None:
        args.log.info("verify_refused", error=refused)
        print(f"kvlifetime verify: error: {refused}", file=sys.stderr)
        return 2
    with _ProgressBar(args, _start_line(config, args.policy, budget)) as bar:
        result = explore(
            config,
            Policy(args.policy),
            reduce=not args.no_reduction,
            max_states=args.max_states,
            checked=args.checked,
            progress=bar.update,
            progress_every=0.5,
            compact=args.hash_compaction,
            memory_budget=budget,
            engine=engine,
            processes=args.processes,
        )
    _print(args, result, None if fallback is None else f"compiled engine not used: {fallback}")
    return exit_status(result)


def _run_compiled(args: argparse.Namespace, config: Config, budget: int | None) -> int:
    from kvlifetime.verify import compiled

    if args.processes > 1 or args.checked:
        print(
            "kvlifetime verify: error: --engine compiled takes neither --processes nor --checked",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "progress", None) is not False:
        print(_start_line(config, args.policy, budget), file=sys.stderr, flush=True)
    result = compiled.run(
        config,
        Policy(args.policy),
        max_states=args.max_states,
        memory_budget=budget,
        compact=args.hash_compaction,
        reduce=not args.no_reduction,
    )
    _print(args, result, compiled.NOTE_UNREDUCED if args.no_reduction else compiled.NOTE)
    return exit_status(result)


def _print(args: argparse.Namespace, result: Result, note: str | None) -> None:
    """The result on stdout (text or JSON), with a note on which engine answered and why."""
    if args.format == "json":
        doc = result.to_dict()
        if note is not None:
            doc["engine_note"] = note
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    sys.stdout.write(result.to_text())
    if note is not None:
        sys.stdout.write(f"engine: {note}\n")


def _engine(args: argparse.Namespace, config: Config) -> tuple[str, str | None]:
    """The engine ``--engine`` asks for (``auto``: packed where it models the shape), and why
    the options cannot run together (``None``: they can)."""
    from kvlifetime.verify.packed import supports

    unmodelled = supports(config) or (
        "--checked (it mirrors the real ledger's transitions)" if args.checked else None
    )
    engine = args.engine
    if engine == "auto":
        engine = "ledger" if unmodelled is not None else "packed"
    if engine == "packed" and unmodelled is not None:
        return engine, f"the packed engine does not model {unmodelled}"
    if args.processes > 1 and engine != "packed":
        return engine, "--processes needs the packed engine (a real ledger stays in one process)"
    if args.processes > 1 and args.hash_compaction:
        return engine, "--processes does not take --hash-compaction"
    return engine, None


def exit_status(result: Result) -> int:
    """The command's exit status for ``result`` (``EXIT_STATUS``)."""
    if result.violation is not None:
        return EXIT_VIOLATION
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 0 if result.complete else EXIT_INCOMPLETE


DEFAULT_MAX_FAULTS = 1  # the default run's total fault bound: 2x2x2 answers in seconds


def _fault_cap(text: str) -> int | None:
    """``--max-faults``: an integer >= 0, or ``none`` (only the per-kind bounds)."""
    if text.strip().lower() == "none":
        return None
    return bounded_int(0)(text)


def _megabytes(text: str) -> int:
    """``--memory-budget``: megabytes >= 1, as bytes; ``none``: 0 (no budget)."""
    if text.strip().lower() == "none":
        return 0
    return bounded_int(1)(text) * 2**20


def _start_line(config: Config, policy: str, budget: int | None) -> str:
    faults = ",".join(sorted(f.value for f in config.faults)) or "none"
    cap = (
        "per-kind bounds only"
        if config.max_faults is None
        else (f"at most {config.max_faults} per run")
    )
    mem = "no memory budget" if budget is None else f"memory budget {budget / 2**20:,.0f} MB"
    return (
        f"verify: policy {policy}, {config.requests} requests x {config.peers} peers x "
        f"{config.blocks} blocks, faults {faults} ({cap}); {mem}"
    )


class _ProgressBar:
    """The search's progress on stderr and as a ``verify_progress`` log event.

    On a terminal a tqdm bar (states, depth, queue, memory); otherwise one line about every
    second for the first ten, then about every ten, so a log or a CI job sees the search move
    from its first second. ``--progress`` forces the bar, ``--no-progress`` silences both."""

    def __init__(self, args: argparse.Namespace, start: str) -> None:
        self._show: bool | None = getattr(args, "progress", None)
        self._log: Any = args.log
        self._start = start
        self._bar: Any = None
        self._lines = self._show is None and not sys.stderr.isatty()
        self._next_line = 1.0

    def __enter__(self) -> _ProgressBar:
        from tqdm import tqdm

        if self._show is not False:
            print(self._start, file=sys.stderr, flush=True)
        self._bar = tqdm(
            total=None,
            desc="verify",
            unit=" states",
            file=sys.stderr,
            disable=self._lines or (None if self._show is None else not self._show),
            leave=False,
            dynamic_ncols=True,
        )
        self._t0 = time.perf_counter()
        return self

    def update(self, p: Progress) -> None:
        self._log.info(
            "verify_progress",
            states=p.states,
            depth=p.depth,
            queue=p.queue,
            states_per_second=round(p.states_per_second),
            seconds=round(p.seconds, 1),
            memory_mb=round(p.memory / 2**20),
        )
        if self._lines:
            if p.seconds >= self._next_line or p.queue == 0:
                self._next_line = p.seconds + (1.0 if p.seconds < 10 else 10.0)
                print(
                    f"verify: {p.states:,} states, depth {p.depth}, queue {p.queue:,}, "
                    f"{p.states_per_second:,.0f} states/s, {p.memory / 2**20:,.0f} MB, "
                    f"{p.seconds:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            return
        bar = self._bar
        if bar is not None and not bar.disable:
            bar.update(p.states - bar.n)
            bar.set_postfix(
                depth=p.depth, queue=p.queue, mem=f"{p.memory / 2**20:,.0f}MB", refresh=True
            )

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
