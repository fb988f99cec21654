"""Diagrams are generated from the tables, deterministic, and committed docs/ never drift."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kvlifetime import diagrams
from kvlifetime.cli import main
from kvlifetime.diagrams import (
    DiagramError,
    GraphvizFailed,
    GraphvizNotFound,
    dot,
    dot_label,
    edge_label,
    pictures,
    render,
)
from kvlifetime.errors import KVLifetimeError
from kvlifetime.evidence import EVIDENCE_CLASSES
from kvlifetime.pages import docs_files, evidence_markdown
from kvlifetime.report.shipped import (
    REGENERATE,
    SHIPPED_DIR,
    drift,
    every_picture,
    expected_files,
    graphviz_version,
    load,
    outline,
)
from kvlifetime.spec.table import Row, table_for

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
DOCS = ROOT / "docs"
MACHINES = ["request", "block"]  # the drawings checked case by case; the engine table below
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
_NODE = re.compile(r'^\s+"([^"]+)" \[label=(.*?)(, peripheries=2)?\];$')
_LTAIL = re.compile(r"ltail=(cluster_\d+)")


def _drawn(machine: str) -> tuple[list[tuple[str, str, str]], dict[str, str], str]:
    text = render(machine, "dot")
    edges = [m.groups() for ln in text.split("\n") if (m := _EDGE.match(ln))]
    nodes = {m.group(1): m.group(2) for ln in text.split("\n") if (m := _NODE.match(ln))}
    return [(a, b, c) for a, b, c in edges], nodes, text


@pytest.mark.parametrize("machine", MACHINES)
def test_dot_draws_every_row_once(machine: str) -> None:
    """Each row is an edge, part of one edge from a box, or a line on its node; none twice."""
    table = table_for(machine)
    edges, nodes, text = _drawn(machine)
    assert text.startswith("// ")
    assert f'digraph "{machine}" {{' in text
    assert text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    assert set(nodes) == set(table.states)
    assert f'    "__start__" -> "{table.initial}";' in text
    lay = diagrams.layout(table)
    drawn: list[Row] = [*lay.edges, *(r for f in lay.folds for r in f.rows)]
    drawn += [r for loops in lay.loops.values() for r in loops]
    assert sorted(drawn, key=table.rows.index) == list(table.rows)
    plain = [e for e in edges if e[0] != "__start__" and "ltail=" not in e[2]]
    assert [(a, b) for a, b, _ in plain] == [(r.source, r.target) for r in lay.edges]
    for (_, _, attrs_), r in zip(plain, lay.edges, strict=True):
        assert f"label={dot_label(r)}" in attrs_ and edge_label(r) in dot_label(r)
        assert ("style=dashed" in attrs_ and "color=red" in attrs_) == r.unsafe
    folded = [e for e in edges if "ltail=" in e[2]]
    assert len(folded) == len(lay.folds)
    for (src, dst, attrs_), f in zip(folded, lay.folds, strict=True):
        assert src in f.sources and dst == f.row.target
        assert f"label={dot_label(f.row)}" in attrs_
        # the box is a cluster holding exactly the fold's sources
        name = _LTAIL.search(attrs_).group(1)  # type: ignore[union-attr]
        body = text.split(f"subgraph {name} {{", 1)[1]
        depth, inside = 1, []
        for ln in body.split("\n"):
            depth += ln.count("{") - ln.count("}")
            if depth <= 0:
                break
            if m := _NODE.match(ln):
                inside.append(m.group(1))
        assert set(inside) == f.sources
    for s, loops in lay.loops.items():
        for r in loops:
            assert html.escape(edge_label(r), quote=False) in nodes[s]
    for s in table.finals:
        assert f'"{s}" [label="{s}", peripheries=2];' in text


def test_request_picture_folds_force_release_and_quarantine() -> None:
    lay = diagrams.layout(table_for("request"))
    assert [(f.row.event, len(f.rows)) for f in lay.folds] == [
        ("force_released", 5),
        ("quarantined", 4),
    ]
    assert lay.parent == {0: None, 1: 0}  # the quarantine box sits inside the unsafe one
    assert not lay.loops


def test_block_picture_lists_self_loops_on_nodes() -> None:
    table = table_for("block")
    lay = diagrams.layout(table)
    loops = sum(len(v) for v in lay.loops.values())
    assert loops == sum(r.source == r.target for r in table.rows) == 13
    assert [(f.row.event, sorted(f.sources)) for f in lay.folds] == [
        ("force_released", ["draining", "quarantined"])
    ]
    _, _, text = _drawn("block")
    assert text.count("->") == 1 + len(lay.edges) + len(lay.folds)


def test_block_pictures_draw_every_row_once_sharing_apart() -> None:
    table = table_for("block")
    main_, sharing = diagrams.pictures(table)
    assert (main_.name, sharing.name) == ("block", "block-sharing")
    assert sorted([*main_.rows, *sharing.rows], key=table.rows.index) == list(table.rows)
    assert {r.event for r in sharing.rows} == {"shared"}
    assert main_.states(table) == table.states  # every state is in the main picture
    text = diagrams.dot(table, sharing)
    assert '"__start__"' not in text  # free is not in it: no start point
    assert text.count("->") == sum(r.source != r.target for r in sharing.rows)
    (request,) = diagrams.pictures(table_for("request"))
    assert request.rows == table_for("request").rows


def test_layout_never_draws_crossing_boxes() -> None:
    # Two groups of four that share two states cannot both be boxes: the larger one (first in
    # spec order on a tie) is kept, the other's edges stay single.
    rows = tuple(
        [Row(s, "x", "t", None, False) for s in ("a", "b", "c", "d")]
        + [Row(s, "y", "u", None, False) for s in ("c", "d", "e", "f")]
    )
    table = table_for("request")
    fake = attrs.evolve(
        table,
        states=("a", "b", "c", "d", "e", "f", "t", "u"),
        initial="a",
        finals=(),
        rows=rows,
    )
    lay = diagrams.layout(fake)
    assert [f.row.event for f in lay.folds] == ["x"]
    assert [r.event for r in lay.edges] == ["y"] * 4


@pytest.mark.parametrize("machine", MACHINES)
def test_back_edges_are_the_cycle_closers(machine: str) -> None:
    back = diagrams.back_edges(table_for(machine))
    if machine == "request":
        assert back == frozenset()  # a request never goes back
    else:
        assert ("quiesced", "free") in back and ("exposed", "owned") in back
        assert ("free", "owned") not in back


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
            "import sys; from kvlifetime.pages import docs_files; "
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
            assert "<svg" in committed
            pic = {p.name: p for m in diagrams.MACHINES for p in pictures(table_for(m))}[name[:-4]]
            assert all(r.event in committed for r in pic.rows), name
            continue
        assert (DOCS / name).read_bytes() == (tmp_path / name).read_bytes(), (
            f"docs/{name} is stale: run `kvlifetime docs --out docs` and commit"
        )
    for m in MACHINES:
        assert (DOCS / f"{m}.svg").is_file()
    # One page per engine with an evidence profile (kvlifetime.profiles), drift-checked above.
    assert {"engine-inproc.md", "engine-mooncake-tcp.md"} <= set(generated)


# --------------------------------------------------------------------------- shipped pictures


def test_shipped_pictures_were_drawn_from_the_spec_as_it_is() -> None:
    """The SVGs the package ships (for `kvlifetime report` without Graphviz) come from the
    DOT source the specification generates now; no picture missing, none left over.
    Fix: `kvlifetime docs --out docs --figures kvlifetime/report/lifecycle-svg` and commit."""
    assert drift() == [], f"run `{REGENERATE}` and commit"
    pics = [(t.machine, p.name) for t, p in every_picture()]
    assert [m for m, _ in pics] == [m for m in diagrams.MACHINES for _ in pictures(table_for(m))]
    assert sorted(p.name for p in SHIPPED_DIR.iterdir()) == sorted(expected_files())
    for table, pic in every_picture():
        shipped = load(table, pic)
        assert shipped.dot == dot(table, pic)
        assert shipped.graphviz  # drawn by Graphviz, which says its version in the SVG


@needs_dot
def test_shipped_pictures_are_what_dot_draws_now() -> None:
    """Re-rendered by the `dot` here: byte for byte when it is the Graphviz version that drew
    the shipped SVG; else (another version lays out differently) the same nodes, edges and
    texts."""
    for table, pic in every_picture():
        shipped = load(table, pic).svg
        fresh = diagrams.svg(table, pic)
        if graphviz_version(fresh) == graphviz_version(shipped):
            assert fresh == shipped, f"{pic.name}.svg: run `{REGENERATE}` and commit"
        else:
            assert outline(fresh) == outline(shipped), f"{pic.name}.svg is stale: {REGENERATE}"


def test_drift_sees_each_kind_of_stale_picture(tmp_path: Path) -> None:
    folder = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR, folder)
    assert drift(folder) == []
    request, block = (
        next(p for t, p in every_picture() if p.name == n) for n in ("request", "block")
    )
    # a source the spec no longer generates (a state renamed, say): refused on use too
    source = folder / "request.dot"
    source.write_text(source.read_text().replace("admitted", "accepted"), encoding="utf-8")
    # an SVG of another picture under this one's name, one missing, one left over
    (folder / "block.svg").write_text((folder / "request.svg").read_text(), encoding="utf-8")
    (folder / "block-sharing.dot").unlink()
    (folder / "grant.svg").write_text("<svg/>", encoding="utf-8")
    assert drift(folder) == [
        "block-sharing.dot: missing",
        "grant.svg: not a shipped picture's file",
        "request.dot: differs from the DOT source the spec generates",
        "block.svg: its nodes are not the picture's states",
    ]
    with pytest.raises(DiagramError, match="drawn from another source") as exc:
        load(table_for("request"), request, folder)
    assert REGENERATE in str(exc.value) and "apt-get install graphviz" in str(exc.value)
    (folder / "block.svg").unlink()
    with pytest.raises(DiagramError, match="ships no picture 'block'"):
        load(table_for("block"), block, folder)
    assert drift(tmp_path / "nothing") == [f"{n}: missing" for n in expected_files()]


def test_outline_reads_what_graphviz_drew() -> None:
    table = table_for("request")
    (pic,) = pictures(table)
    o = outline(load(table, pic).svg)
    assert sorted(o.nodes) == sorted([*table.states, "__start__"])
    assert "__start__->admitted" in o.edges
    assert "admitted" in o.texts and any("force_released" in t for t in o.texts)


# --------------------------------------------------------------------------- the engine side


def test_the_engine_side_is_drawn_row_for_row_in_two_pictures() -> None:
    """The engine-side lifecycle (no unsafe row): its mermaid has every row, its three pictures
    split the rows between them (the reads and the load apart), each fits a slide."""
    table = table_for("engine")
    lines = render("engine", "mermaid").split("\n")
    edges = [ln.strip() for ln in lines if "-->" in ln and "[*]" not in ln]
    assert edges == [f"{r.source} --> {r.target} : {edge_label(r)}" for r in table.rows]
    assert "    handed_back --> [*]" in lines
    main, reads, load = pictures(table)
    assert (main.name, reads.name, load.name) == ("engine", "engine-reads", "engine-load")
    assert sorted(main.rows + reads.rows + load.rows, key=table.rows.index) == list(table.rows)
    assert {r.event for r in load.rows} == {"load_granted", "load_landed", "load_failed"}
    page = render("engine", "md")
    assert all(f"]({p.name}.svg)" in page for p in (main, reads, load))


@needs_dot
def test_the_engine_side_pictures_fit_a_slide() -> None:
    import re

    table = table_for("engine")
    for pic in pictures(table):
        out = diagrams.svg(table, pic)
        w, h = (float(x) for x in re.findall(r'(?:width|height)="([\d.]+)pt"', out)[:2])
        assert w <= 1400 and h <= 1000, (pic.name, w, h)
