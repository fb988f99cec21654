"""Diagrams are generated from the tables, deterministic, and committed docs/ never drift."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvlifetime import diagrams
from kvlifetime.cli import main
from kvlifetime.diagrams import (
    GraphvizFailed,
    GraphvizNotFound,
    docs_files,
    edge_label,
    evidence_markdown,
    render,
)
from kvlifetime.errors import KVLifetimeError
from kvlifetime.evidence import EVIDENCE_CLASSES
from kvlifetime.table import Row, table_for

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
DOCS = ROOT / "docs"
MACHINES = ["request", "block"]
HAS_DOT = shutil.which("dot") is not None
# CI sets KVLIFETIME_REQUIRE_GRAPHVIZ=1: there a missing `dot` fails these tests, never skips.
SKIP_NO_DOT = not HAS_DOT and os.environ.get("KVLIFETIME_REQUIRE_GRAPHVIZ") != "1"
needs_dot = pytest.mark.skipif(SKIP_NO_DOT, reason="Graphviz `dot` not installed")


# --------------------------------------------------------------------------- mermaid


@pytest.mark.parametrize("machine", MACHINES)
def test_mermaid_golden(machine: str) -> None:
    # To accept an intended change: kvlifetime diagram M --format mermaid -o tests/golden/M.mmd
    assert render(machine, "mermaid") == (GOLDEN / f"{machine}.mmd").read_text(encoding="utf-8")


@pytest.mark.parametrize("machine", MACHINES)
def test_mermaid_has_every_row(machine: str) -> None:
    table = table_for(machine)
    lines = render(machine, "mermaid").split("\n")
    assert lines[1] == "stateDiagram-v2"
    assert f"    [*] --> {table.initial}" in lines
    edges = [ln.strip() for ln in lines if "-->" in ln and "[*]" not in ln]
    assert edges == [f"{r.source} --> {r.target} : {edge_label(r)}" for r in table.rows]
    for s in table.finals:
        assert f"    {s} --> [*]" in lines
    unsafe = [e for e in edges if "⚠" in e]
    assert len(unsafe) == sum(r.unsafe for r in table.rows) > 0
    assert all("force_released" in e and "UNSAFE" in e for e in unsafe)
    assert sum(ln.strip() == "end note" for ln in lines) == 1


def test_request_mermaid_final_state() -> None:
    assert "    released --> [*]\n" in render("request", "mermaid")
    assert "--> [*]" not in render("block", "mermaid")  # the block cycles back to free


@pytest.mark.parametrize(
    ("row", "label"),
    [
        (Row("a", "go", "b", None, False), "go"),
        (Row("a", "go", "b", "ok", False), "go [ok]"),
        (Row("a", "force", "b", "g", True), "⚠ force [g] UNSAFE"),
    ],
)
def test_edge_label(row: Row, label: str) -> None:
    assert edge_label(row) == label


# --------------------------------------------------------------------------- dot

_EDGE = re.compile(r'^    "([^"]+)" -> "([^"]+)" \[(.*)\];$')


@pytest.mark.parametrize("machine", MACHINES)
def test_dot_sanity(machine: str) -> None:
    table = table_for(machine)
    text = render(machine, "dot")
    assert text.startswith("// ")
    assert f'digraph "{machine}" {{' in text
    assert text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    for s in table.states:
        assert f'    "{s}" [label="{s}"' in text
    edges = [m.groups() for ln in text.split("\n") if (m := _EDGE.match(ln))]
    assert f'    "__start__" -> "{table.initial}";' in text
    assert len(edges) == len(table.rows)
    for (src, dst, attrs_), r in zip(edges, table.rows, strict=True):
        assert (src, dst) == (r.source, r.target)
        assert f'label="{edge_label(r)}"' in attrs_
        dashed_red = "style=dashed" in attrs_ and "color=red" in attrs_
        assert dashed_red == r.unsafe
    for s in table.finals:
        assert f'    "{s}" [label="{s}", peripheries=2];' in text


def test_dot_quotes_are_escaped() -> None:
    assert diagrams._q('a "b" \\c') == '"a \\"b\\" \\\\c"'


# --------------------------------------------------------------------------- svg


@needs_dot
@pytest.mark.parametrize("machine", MACHINES)
def test_svg_is_rendered_by_graphviz(machine: str) -> None:
    table = table_for(machine)
    svg = render(machine, "svg")
    assert svg.lstrip().startswith("<?xml")
    assert "<svg" in svg and svg.rstrip().endswith("</svg>")
    for s in table.states:
        assert f">{s}</text>" in svg
    assert "stroke-dasharray" in svg  # unsafe edges are dashed
    assert 'stroke="red"' in svg
    assert "⚠ force_released" in svg
    assert render(machine, "svg") == svg  # deterministic for one Graphviz


def test_svg_without_dot_names_graphviz(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `dot` anywhere
    with pytest.raises(GraphvizNotFound) as exc:
        render("request", "svg")
    msg = str(exc.value)
    assert "graphviz" in msg
    assert "apt-get install graphviz" in msg
    assert isinstance(exc.value, KVLifetimeError)
    assert exc.value.kind == "graphviz_not_found"


def test_svg_with_broken_dot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'syntax error in line 1' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GraphvizFailed, match="exited with 3: syntax error in line 1"):
        render("block", "svg")


# --------------------------------------------------------------------------- md and formats


@pytest.mark.parametrize("machine", MACHINES)
def test_markdown_page(machine: str) -> None:
    table = table_for(machine)
    md = render(machine, "md")
    assert md.startswith(f"# {machine} lifecycle\n")
    block = md.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert block == render(machine, "mermaid")
    assert "## " + f"{machine} lifecycle: transition table" in md
    for r in table.rows:
        assert f"| {r.source} | {r.event} | {r.target} | {r.guard or ''} |" in md
    assert "force_released: unsafe" in md


def test_unknown_format_and_machine() -> None:
    with pytest.raises(ValueError, match="unknown diagram format"):
        render("request", "png")
    with pytest.raises(ValueError, match="unknown machine"):
        render("grant", "dot")


def test_evidence_markdown() -> None:
    md = evidence_markdown()
    rows = [ln for ln in md.split("\n") if ln.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [c.__name__ for c in EVIDENCE_CLASSES]
    for r, cls in zip(rows, EVIDENCE_CLASSES, strict=True):
        assert r.count("✓") == len(cls.PROVES)


def test_output_is_deterministic_across_processes() -> None:
    # Hash randomisation must not reorder anything: render in two fresh interpreters.
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        code = (
            "import sys; from kvlifetime.diagrams import docs_files; "
            "sys.stdout.buffer.write(''.join(docs_files(include_svg=False).values())"
            ".encode('utf-8'))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, check=True
        )
        outs.append(done.stdout)
    assert outs[0] == outs[1]
    assert outs[0] == "".join(docs_files(include_svg=False).values()).encode("utf-8")


# --------------------------------------------------------------------------- docs/ drift


def test_docs_are_up_to_date(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fails when docs/ drift from the code. Fix: `kvlifetime docs --out docs` and commit."""
    assert main(["docs", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    generated = sorted(p.name for p in tmp_path.iterdir())
    expected = sorted(docs_files(include_svg=HAS_DOT))
    assert generated == expected
    for name in generated:
        if name.endswith(".svg"):
            # Graphviz versions lay out differently: the committed SVG is checked to exist
            # and to come from the current dot source, not compared byte for byte.
            committed = (DOCS / name).read_text(encoding="utf-8")
            assert "<svg" in committed and "⚠ force_released" in committed
            continue
        assert (DOCS / name).read_bytes() == (tmp_path / name).read_bytes(), (
            f"docs/{name} is stale: run `kvlifetime docs --out docs` and commit"
        )
    for m in MACHINES:
        assert (DOCS / f"{m}.svg").is_file()
    # One page per engine with an evidence profile (kvlifetime.profiles), drift-checked above.
    assert {"engine-inproc.md", "engine-mooncake-tcp.md"} <= set(generated)
