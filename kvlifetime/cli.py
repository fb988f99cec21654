"""``kvlifetime``: the command line.

Subcommands are data: ``COMMANDS`` lists ``Command(name, help, add_arguments, run)`` entries, and
``build_parser`` turns them into argparse subparsers. To add one (``verify``, ``replay``,
``simulate``), write an ``add_arguments(parser)`` and a ``run(args) -> int`` and append a
``Command`` to ``COMMANDS``; import your module *inside* ``run`` so that ``kvlifetime table``
never pays for the harness, the verifier or a transfer engine it does not use.

``run`` receives the parsed arguments plus ``args.log``, a structlog logger that writes to stderr
(stdout carries the tables), quiet below warning unless ``-v``. The command line never calls
``structlog.configure``: the processors stay whatever the host set (``capture_logs`` works).

Exit status: 0 success; 2 a typed kvlifetime error (one line on stderr) or a usage error from
argparse; 1 an operating-system error (e.g. an output file that cannot be written).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import structlog

from kvlifetime.diagrams import (
    DIAGRAM_FORMATS,
    MACHINES,
    docs_files,
    engine_markdown,
    evidence_markdown,
    graphviz_available,
    render,
)
from kvlifetime.errors import KVLifetimeError
from kvlifetime.evidence import claims_matrix
from kvlifetime.table import table_for

Logger = Any  # a structlog bound logger (wrap_logger / get_logger return a lazy proxy)

TABLE_FORMATS: tuple[str, ...] = ("md", "csv", "json")
EVIDENCE_FORMATS: tuple[str, ...] = ("md", "json")
DEMO_BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")


@attrs.frozen(slots=True)
class Command:
    """One subcommand: how to declare its arguments, and what runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the exit status


# --------------------------------------------------------------------------- output helpers


def library_logger() -> Logger:
    return structlog.get_logger("kvlifetime")


def write_text(path: Path, text: str, log: Logger) -> None:
    """Write ``text`` as UTF-8 with ``\\n`` line endings on every platform (byte-stable docs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    log.info("file_written", path=str(path), bytes=len(text.encode("utf-8")))


def _emit(text: str, args: argparse.Namespace) -> None:
    if args.output is None or args.output == "-":
        sys.stdout.write(text)
    else:
        write_text(Path(args.output), text, args.log)


# --------------------------------------------------------------------------- table


def _add_table(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", choices=MACHINES)
    p.add_argument("--format", choices=TABLE_FORMATS, default="md")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")


def _run_table(args: argparse.Namespace) -> int:
    _emit(table_for(args.machine).render(args.format), args)
    return 0


# --------------------------------------------------------------------------- diagram


def _add_diagram(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", choices=MACHINES)
    p.add_argument("--format", choices=DIAGRAM_FORMATS, default="mermaid")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")


def _run_diagram(args: argparse.Namespace) -> int:
    _emit(render(args.machine, args.format), args)
    return 0


# --------------------------------------------------------------------------- evidence


def _add_evidence(p: argparse.ArgumentParser) -> None:
    from kvlifetime.profiles import ENGINES

    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="print what every status and operation of this transfer engine proves (its "
        "evidence profile) instead of the claims matrix",
    )
    p.add_argument("--format", choices=EVIDENCE_FORMATS, default="md")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")


def evidence_json() -> str:
    from kvlifetime.provenance import rules_matrix

    return json.dumps({"evidence": claims_matrix(), "provenance": rules_matrix()}, indent=2) + "\n"


def engine_json(name: str) -> str:
    """Engine ``name``'s evidence profile as JSON (``ProfileUnavailable`` if it has none)."""
    from kvlifetime.profiles import profile

    return json.dumps(profile(name).to_dict(), indent=2) + "\n"


def _run_evidence(args: argparse.Namespace) -> int:
    if args.engine is not None:
        from kvlifetime.profiles import profile

        if args.format == "md":
            text = engine_markdown(profile(args.engine))
        else:
            text = engine_json(args.engine)
        _emit(text, args)
        return 0
    text = evidence_markdown() if args.format == "md" else evidence_json()
    _emit(text, args)
    return 0


# --------------------------------------------------------------------------- docs


def _add_docs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, metavar="DIR")


def write_docs(out: Path, log: Logger) -> list[Path]:
    """Write every generated document into ``out``; SVGs only where Graphviz is installed.

    Only the generated files are written: anything else in ``out`` (hand-written pages such as
    ``ledger-api.md``) is left alone.
    """
    with_svg = graphviz_available()
    if not with_svg:
        print(
            "kvlifetime: note: Graphviz `dot` not found, skipping .svg (apt-get install graphviz)",
            file=sys.stderr,
        )
    written = []
    for name, text in docs_files(include_svg=with_svg).items():
        path = out / name
        write_text(path, text, log)
        written.append(path)
    return written


def _run_docs(args: argparse.Namespace) -> int:
    for path in write_docs(args.out, args.log):
        print(path)
    return 0


# --------------------------------------------------------------------------- demo


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("out"), metavar="DIR")
    p.add_argument("--backend", choices=DEMO_BACKENDS, default="inproc")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="requests per harness run (default: the acceptance size)",
    )


def _section(title: str, body: str, stream: TextIO) -> None:
    stream.write(f"\n==== {title} ====\n\n{body}")


def run_demo(
    out: Path,
    backend: str,
    stream: TextIO | None = None,
    log: Logger | None = None,
    harness_requests: int | None = None,
) -> int:
    """The demo: the contract as tables and pictures, then the harness, policy by policy.

    Step 1 prints what the specification allows and what each piece of evidence proves, and
    writes the diagrams to ``out``. Step 2 runs the disaggregation harness on ``backend`` with
    the naive, timeout and proof policies side by side and writes the report to ``out``.
    """
    stream = sys.stdout if stream is None else stream
    log = library_logger() if log is None else log
    if backend not in DEMO_BACKENDS:
        raise ValueError(f"unknown backend {backend!r} ({', '.join(DEMO_BACKENDS)})")
    stream.write(f"kvlifetime demo (backend: {backend}), writing to {out}\n")
    _section("request lifecycle", table_for("request").to_markdown(), stream)
    _section("block lifecycle", table_for("block").to_markdown(), stream)
    _section("evidence and claims", evidence_markdown(), stream)
    written = []
    for m in MACHINES:
        for suffix, fmt in (("mmd", "mermaid"), ("md", "md")):
            path = out / f"{m}.{suffix}"
            write_text(path, render(m, fmt), log)
            written.append(path)
    from kvlifetime.harness.simulate import DEMO_REQUESTS, demo_harness

    n = DEMO_REQUESTS if harness_requests is None else harness_requests
    written += demo_harness(out, backend, stream, requests=n)
    stream.write("\n" + "".join(f"wrote {p}\n" for p in written))
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    return run_demo(args.out, args.backend, log=args.log, harness_requests=args.requests)


# --------------------------------------------------------------------------- simulate


def _add_simulate(p: argparse.ArgumentParser) -> None:
    from kvlifetime.harness.simulate import add_arguments

    add_arguments(p)


def _run_simulate(args: argparse.Namespace) -> int:
    from kvlifetime.harness.simulate import run_command

    return run_command(args)


# --------------------------------------------------------------------------- verify


def _add_verify(p: argparse.ArgumentParser) -> None:
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


def _run_verify(args: argparse.Namespace) -> int:
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


# --------------------------------------------------------------------------- replay


def _add_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("log_path", metavar="LOG.jsonl", help="structlog JSON lines (or '-' for stdin)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--context", type=int, default=10, help="steps shown before an illegal one")


def _run_replay(args: argparse.Namespace) -> int:
    from kvlifetime.verify.replay import read_log, replay

    try:
        if args.log_path == "-":
            records = read_log(sys.stdin)
        else:
            with open(args.log_path, encoding="utf-8") as f:
                records = read_log(f)
    except ValueError as e:
        print(f"kvlifetime replay: error: {e}", file=sys.stderr)
        return 2
    report = replay(records, context=args.context)
    if args.format == "json":
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(report.to_text())
    return 0 if report.ok else 1


# --------------------------------------------------------------------------- registry

COMMANDS: list[Command] = [
    Command("table", "print a transition table (md, csv, json)", _add_table, _run_table),
    Command(
        "diagram",
        "draw a lifecycle (mermaid, dot, svg, md)",
        _add_diagram,
        _run_diagram,
    ),
    Command(
        "evidence",
        "print the evidence x claim matrix and who may make each claim; with --engine, what "
        "each status of a transfer engine proves",
        _add_evidence,
        _run_evidence,
    ),
    Command("docs", "write the generated documents into a folder", _add_docs, _run_docs),
    Command("demo", "show the contract: tables, claims, diagrams", _add_demo, _run_demo),
    Command(
        "verify",
        "explore every interleaving of a small configuration over the real ledger",
        _add_verify,
        _run_verify,
    ),
    Command(
        "replay",
        "check a recorded event log against the transition tables and evidence rules",
        _add_replay,
        _run_replay,
    ),
    Command(
        "simulate",
        "run prefill/decode disaggregation with faults under a release policy",
        _add_simulate,
        _run_simulate,
    ),
]
"""Every subcommand, in help order. Append new ones here (see the module docstring)."""


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlifetime",
        description="Evidence-guarded lifetimes for KV-cache blocks.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every step to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS if commands is None else commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
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
