"""``kvlifetime``: the command line.

Subcommands are data: ``COMMANDS`` lists ``Command(name, help, add_arguments, run)`` entries, and
``build_parser`` turns them into argparse subparsers. Each command lives in its own module here
(``verify.py``, ``replay.py``, ``simulate.py``, ``demo.py``; ``contract.py`` holds ``table``,
``diagram``, ``evidence`` and ``docs``), with an ``add_arguments(parser)`` and a
``run(args) -> int``. A command imports what it drives *inside* ``run`` so that
``kvlifetime table`` never pays for the harness, the verifier or a transfer engine it does not
use.

``run`` receives the parsed arguments plus ``args.log``, a structlog logger that writes to stderr
(stdout carries the tables), silent unless ``-v``: every failure is said once, as the one
``kvlifetime COMMAND: error: ...`` line ``main`` prints, never also as a log line. The command
line never calls ``structlog.configure`` (the processors stay whatever the host set, and
``capture_logs`` works), except for the run of a command given ``--log-json FILE``
(``eventlog``).

Options every command takes, before or after its name: ``-v`` (log every step to stderr),
``--progress`` / ``--no-progress`` (the bar of a long command on stderr; default: when stderr is
a terminal). A command's help ends with its exit statuses (``EXIT_STATUS``, plus the command's
own, e.g. replay's 3). Ctrl-C is handled here, once: exit 130 and one line saying what was done.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog

from kvlifetime.cli import contract, demo, promela, replay, report, simulate, verify
from kvlifetime.cli.demo import run_demo
from kvlifetime.cli.output import Interrupted, Logger, write_text
from kvlifetime.errors import KVLifetimeError

__all__ = [
    "COMMANDS",
    "EXIT_INTERRUPTED",
    "EXIT_STATUS",
    "Command",
    "build_parser",
    "main",
    "run_demo",
    "write_text",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C
EXIT_STATUS: tuple[tuple[int, str], ...] = (
    (0, "success"),
    (1, "an operating-system error (a file that cannot be read or written)"),
    (2, "a usage error, or a typed kvlifetime error (one line on stderr)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C); what was done is said on stderr"),
)
"""The exit statuses every command shares; a command adds its own in its ``exit_status``."""


@attrs.frozen(slots=True)
class Command:
    """One subcommand: how to declare its arguments, and what runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the exit status
    # Statuses of this command beyond EXIT_STATUS (e.g. replay's "no kvlifetime events").
    exit_status: tuple[tuple[int, str], ...] = ()
    # Its own --help's first paragraph: what it does and how long it takes (default: help).
    description: str = ""


COMMANDS: list[Command] = [
    Command(
        "table",
        "print a lifecycle's transition table (instant)",
        contract.add_table,
        contract.run_table,
        description="Print the request or block lifecycle's transition table: every allowed "
        "transition, from and to, with its guard, compiled from the specification (md, csv, "
        "json). Instant.",
    ),
    Command(
        "diagram",
        "draw a lifecycle (instant; svg needs Graphviz)",
        contract.add_diagram,
        contract.run_diagram,
        description="Draw the request or block lifecycle from its transition table (mermaid, "
        "dot, svg, md). Instant; svg runs Graphviz's dot.",
    ),
    Command(
        "evidence",
        "print what each piece of evidence proves, and who may say it (instant)",
        contract.add_evidence,
        contract.run_evidence,
        description="Print the evidence x claim matrix and who may make each claim; with "
        "--engine, what each status of a transfer engine proves. Instant.",
    ),
    Command(
        "docs",
        "write the generated tables and diagrams into a folder (a second)",
        contract.add_docs,
        contract.run_docs,
    ),
    Command(
        "demo",
        "ten harness runs side by side, then the design-review page (about a minute)",
        demo.add_arguments,
        demo.run,
        description="Run the disaggregation harness ten times on one seed (push: naive, "
        "timeout and proof release policies, naive and proof with every topology fault, a "
        "decode restart naive and guarded; pull: naive, lease, proof), print one line per run "
        "and a summary, and write the design-review page DIR/index.html with every run in "
        "full beside it. About a minute on 2 cores at the default 1,000 requests per run; "
        "--requests 10000 (the size of the manual's figures) several minutes.",
    ),
    Command(
        "verify",
        "explore every interleaving of a small configuration (seconds to hours)",
        verify.add_arguments,
        verify.run,
        verify.EXIT_STATUS,
        description="Explore every interleaving of a small configuration (requests x peers x "
        "blocks, with faults) over the real ledger and check isolation, single ownership and "
        "no leak; a refuted policy gets its shortest counterexample. Seconds for one block "
        "and one fault, minutes or more as the configuration grows (--max-states bounds it).",
    ),
    Command(
        "promela",
        "write the Promela model for SPIN, or run a SPIN swarm on it (instant / minutes)",
        promela.add_arguments,
        promela.run,
        promela.EXIT_STATUS,
        description="Write the Promela model of one configuration for SPIN, generated from the "
        "specification (instant); with --swarm N, run N diversified bitstate searches of it "
        "on SPIN for a shape past exact search (a violation, or an approximate 'no violation "
        "found' with each run's coverage estimate: never a pass). Building pan takes from "
        "half a minute to several minutes; each run is bounded by --seconds-per-run.",
    ),
    Command(
        "replay",
        "check a recorded event log against the rules (seconds per 10,000 lines)",
        replay.add_arguments,
        replay.run,
        replay.EXIT_STATUS,
        description="Check a recorded JSON event log (simulate --log-json FILE writes one) "
        "step by step against the transition tables and the evidence rules; print the first "
        "illegal step with the steps before it. A few seconds per 10,000 lines.",
    ),
    Command(
        "simulate",
        "one harness run under one release policy (seconds per 1,000 requests)",
        simulate.add_arguments,
        simulate.run,
        description="One harness run: prefill and decode workers over a transfer engine with "
        "injected aborts, rejections, failures and crashes, under one release policy; an "
        "oracle at the transport counts every late write. A few seconds per 1,000 requests on "
        "the in-process engine, more on mooncake and nixl.",
    ),
    Command(
        "report",
        "write the design-review page from demo's results (about 15 seconds)",
        report.add_arguments,
        report.run,
        description="Write the design-review page DIR/index.html from the harness results demo "
        "wrote (DIR/report.json): a summary, the lifecycles, evidence and engine profiles, the "
        "harness plots, each refuted policy's counterexample. About 15 seconds.",
    ),
]
"""Every subcommand, in help order. Append new ones here (see the module docstring)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def _common(p: argparse.ArgumentParser, *, top: bool) -> None:
    # On the top parser with real defaults; on each subcommand SUPPRESSed, so that
    # `kvlifetime -v simulate` is not undone by the subcommand's own default.
    verbose: Any = False if top else argparse.SUPPRESS
    shown: Any = None if top else argparse.SUPPRESS
    p.add_argument(
        "-v", "--verbose", action="store_true", default=verbose, help="log every step to stderr"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=shown,
        help="show a progress bar on stderr for long commands (default: when stderr is a terminal)",
    )


def _epilog(statuses: Sequence[tuple[int, str]]) -> str:
    rows = sorted({**dict(EXIT_STATUS), **dict(statuses)}.items())
    return "exit status:\n" + "".join(f"  {code:>3}  {what}\n" for code, what in rows)


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    from kvlifetime import __version__

    parser = argparse.ArgumentParser(
        prog="kvlifetime",
        description="Evidence-guarded lifetimes for KV-cache blocks.",
        formatter_class=HelpFormatter,
        epilog=_epilog(()),
    )
    parser.add_argument("--version", action="version", version=f"kvlifetime {__version__}")
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS if commands is None else commands:
        p = sub.add_parser(
            cmd.name,
            help=cmd.help,
            description=textwrap.fill(cmd.description or cmd.help, 79),
            formatter_class=HelpFormatter,
            epilog=_epilog(cmd.exit_status),
        )
        _common(p, top=False)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def cli_logger(verbose: bool) -> Logger:
    """A logger for the command line: stderr, nothing below critical unless ``verbose`` (a
    refusal is the command's one ``error:`` line, not a log line as well; kvlifetime logs
    nothing critical).

    Only the output and the level are chosen here; the processors are resolved from the
    global structlog configuration when the logger is first used, so a host's configuration
    (or ``structlog.testing.capture_logs``) still applies. Nothing global is changed.
    """
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if verbose else logging.CRITICAL
        ),
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _os_error(e: OSError) -> str:
    """``[Errno 13] Permission denied: 'x'`` as ``x: permission denied``."""
    if e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror[:1].lower()}{e.strerror[1:]}"
    return _one_line(e)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else 2
    args.log = log = cli_logger(args.verbose)
    try:
        status: int = args.run(args)
        return status
    except KeyboardInterrupt as e:
        done = e.done if isinstance(e, Interrupted) else "nothing had finished"
        log.info("command_interrupted", command=args.command, done=done)
        print(f"kvlifetime {args.command}: interrupted: {done}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KVLifetimeError as e:
        log.info("command_failed", command=args.command, error=e.kind, message=_one_line(e))
        print(f"kvlifetime {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        log.info("command_failed", command=args.command, error="os_error", message=_os_error(e))
        print(f"kvlifetime {args.command}: error: {_os_error(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
