"""``kvlifetime``: the command line.

Subcommands are data: ``COMMANDS`` lists ``Command(name, help, add_arguments, run)`` entries, and
``build_parser`` turns them into argparse subparsers. Each command lives in its own module here
(``verify.py``, ``replay.py``, ``simulate.py``, ``demo.py``; ``contract.py`` holds ``table``,
``diagram``, ``evidence`` and ``docs``), with an ``add_arguments(parser)`` and a
``run(args) -> int``. A command imports what it drives *inside* ``run`` so that
``kvlifetime table`` never pays for the harness, the verifier or a transfer engine it does not
use.

``run`` receives the parsed arguments plus ``args.log``, a structlog logger that writes to stderr
(stdout carries the tables), quiet below warning unless ``-v``. The command line never calls
``structlog.configure``: the processors stay whatever the host set (``capture_logs`` works).

Options every command takes, before or after its name: ``-v`` (log every step to stderr),
``--progress`` / ``--no-progress`` (the bar of a long command on stderr; default: when stderr is
a terminal). A command's help ends with its exit statuses (``EXIT_STATUS``, plus the command's
own, e.g. replay's 3). Ctrl-C is handled here, once: exit 130 and one line saying what was done.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog

from kvlifetime.cli import contract, demo, replay, report, simulate, verify
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


COMMANDS: list[Command] = [
    Command(
        "table", "print a transition table (md, csv, json)", contract.add_table, contract.run_table
    ),
    Command(
        "diagram",
        "draw a lifecycle (mermaid, dot, svg, md)",
        contract.add_diagram,
        contract.run_diagram,
    ),
    Command(
        "evidence",
        "print the evidence x claim matrix and who may make each claim; with --engine, what "
        "each status of a transfer engine proves",
        contract.add_evidence,
        contract.run_evidence,
    ),
    Command(
        "docs", "write the generated documents into a folder", contract.add_docs, contract.run_docs
    ),
    Command("demo", "show the contract: tables, claims, diagrams", demo.add_arguments, demo.run),
    Command(
        "verify",
        "explore every interleaving of a small configuration over the real ledger",
        verify.add_arguments,
        verify.run,
        verify.EXIT_STATUS,
    ),
    Command(
        "replay",
        "check a recorded event log against the transition tables and evidence rules",
        replay.add_arguments,
        replay.run,
        replay.EXIT_STATUS,
    ),
    Command(
        "simulate",
        "run prefill/decode disaggregation with faults under a release policy",
        simulate.add_arguments,
        simulate.run,
    ),
    Command(
        "report",
        "write the design-review page (index.html): lifecycles, evidence, engine profiles, "
        "harness plots, counterexamples as sequence diagrams",
        report.add_arguments,
        report.run,
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
            description=cmd.help,
            formatter_class=HelpFormatter,
            epilog=_epilog(cmd.exit_status),
        )
        _common(p, top=False)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def cli_logger(verbose: bool) -> Logger:
    """A logger for the command line: stderr, warnings only unless ``verbose``.

    Only the output and the level are chosen here; the processors are resolved from the
    global structlog configuration when the logger is first used, so a host's configuration
    (or ``structlog.testing.capture_logs``) still applies. Nothing global is changed.
    """
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if verbose else logging.WARNING
        ),
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


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
        print(f"kvlifetime: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        log.info("command_failed", command=args.command, error="os_error", message=_one_line(e))
        print(f"kvlifetime: error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
