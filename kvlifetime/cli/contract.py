"""``table``, ``diagram``, ``evidence``, ``docs``: the contract as tables, pictures and pages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlifetime.cli.output import Logger, emit, write_text
from kvlifetime.diagrams import DIAGRAM_FORMATS, MACHINES, graphviz_available, render
from kvlifetime.evidence import claims_matrix
from kvlifetime.pages import docs_files, engine_markdown, evidence_markdown
from kvlifetime.spec.table import table_for

TABLE_FORMATS: tuple[str, ...] = ("md", "csv", "json")
EVIDENCE_FORMATS: tuple[str, ...] = ("md", "json")


_OUTPUT_HELP = "write here instead of stdout ('-': stdout)"


def add_table(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", choices=MACHINES, help="which lifecycle: request or block")
    p.add_argument(
        "--format",
        choices=TABLE_FORMATS,
        default="md",
        help="md (a markdown table), csv or json (one document)",
    )
    p.add_argument("-o", "--output", metavar="FILE", help=_OUTPUT_HELP)


def run_table(args: argparse.Namespace) -> int:
    emit(table_for(args.machine).render(args.format), args)
    return 0


# --- diagram


def add_diagram(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", choices=MACHINES, help="which lifecycle: request or block")
    p.add_argument(
        "--format",
        choices=DIAGRAM_FORMATS,
        default="mermaid",
        help="mermaid, dot (Graphviz source), svg (needs Graphviz's dot), md (mermaid in a page)",
    )
    p.add_argument("-o", "--output", metavar="FILE", help=_OUTPUT_HELP)


def run_diagram(args: argparse.Namespace) -> int:
    emit(render(args.machine, args.format), args)
    return 0


# --- evidence


def add_evidence(p: argparse.ArgumentParser) -> None:
    from kvlifetime.profiles import ENGINES

    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="print what every status and operation of this transfer engine proves (its "
        "evidence profile) instead of the claims matrix",
    )
    p.add_argument("--format", choices=EVIDENCE_FORMATS, default="md", help="md (tables) or json")
    p.add_argument("-o", "--output", metavar="FILE", help=_OUTPUT_HELP)


def evidence_json() -> str:
    from kvlifetime.provenance import rules_matrix

    return json.dumps({"evidence": claims_matrix(), "provenance": rules_matrix()}, indent=2) + "\n"


def engine_json(name: str) -> str:
    """Engine ``name``'s evidence profile as JSON (``ProfileUnavailable`` if it has none)."""
    from kvlifetime.profiles import profile

    return json.dumps(profile(name).to_dict(), indent=2) + "\n"


def run_evidence(args: argparse.Namespace) -> int:
    if args.engine is not None:
        from kvlifetime.profiles import profile

        if args.format == "md":
            text = engine_markdown(profile(args.engine))
        else:
            text = engine_json(args.engine)
        emit(text, args)
        return 0
    text = evidence_markdown() if args.format == "md" else evidence_json()
    emit(text, args)
    return 0


# --- docs


def add_docs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="the folder to write into (only the generated files are replaced)",
    )
    p.add_argument(
        "--figures",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the lifecycle pictures kvlifetime ships for machines without Graphviz "
        "(each picture's .dot and .svg) into DIR, replacing every .dot and .svg there: in a "
        "checkout, kvlifetime/report/lifecycle-svg (needs Graphviz's dot)",
    )


def write_docs(out: Path, log: Logger, figures: Path | None = None) -> list[Path]:
    """Write every generated document into ``out``; SVGs only where Graphviz is installed.

    Only the generated files are written: anything else in ``out`` (hand-written pages such as
    ``ledger-api.md``) is left alone. ``figures``: also write the shipped lifecycle pictures
    there (``kvlifetime.report.shipped``; ``GraphvizNotFound`` without ``dot``, before anything
    is written), and remove any other ``.dot`` or ``.svg`` in it.
    """
    from kvlifetime.diagrams import GraphvizNotFound

    with_svg = graphviz_available()
    if figures is not None and not with_svg:
        raise GraphvizNotFound()
    if not with_svg:
        print(
            "kvlifetime docs: note: Graphviz `dot` not found, skipping .svg "
            "(apt-get install graphviz)",
            file=sys.stderr,
        )
    written = []
    files = docs_files(include_svg=with_svg)
    for name, text in files.items():
        path = out / name
        write_text(path, text, log)
        written.append(path)
    if figures is not None:
        from kvlifetime.report.shipped import expected_files

        shipped = expected_files()
        for name in shipped:
            path = figures / name
            write_text(path, files[name], log)
            written.append(path)
        for stale in sorted(figures.iterdir()):
            if stale.suffix in (".dot", ".svg") and stale.name not in shipped:
                stale.unlink()
                log.info("file_removed", path=str(stale))
    return written


def run_docs(args: argparse.Namespace) -> int:
    for path in write_docs(args.out, args.log, args.figures):
        print(path)
    return 0
