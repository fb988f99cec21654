"""The ``kvlifetime`` command line, driven through ``main([...])``."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import structlog
from mooncake_helpers import need_mooncake
from nixl_helpers import need_nixl
from structlog.testing import capture_logs

from kvlifetime import cli
from kvlifetime.cli import Command, main, run_demo
from kvlifetime.diagrams import render
from kvlifetime.errors import InsufficientEvidence
from kvlifetime.evidence import Claim, claims_matrix
from kvlifetime.pages import evidence_markdown
from kvlifetime.profiles import PROFILES
from kvlifetime.spec.table import table_for

HAS_DOT = shutil.which("dot") is not None
# CI sets KVLIFETIME_REQUIRE_GRAPHVIZ=1: there a missing `dot` fails these tests, never skips.
SKIP_NO_DOT = not HAS_DOT and os.environ.get("KVLIFETIME_REQUIRE_GRAPHVIZ") != "1"
Capsys = pytest.CaptureFixture[str]


def run(capsys: Capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# --------------------------------------------------------------------------- table


@pytest.mark.parametrize("machine", ["request", "block"])
@pytest.mark.parametrize("fmt", ["md", "csv", "json"])
def test_table(capsys: Capsys, machine: str, fmt: str) -> None:
    status, out, err = run(capsys, "table", machine, "--format", fmt)
    assert (status, err) == (0, "")
    assert out == table_for(machine).render(fmt)


def test_table_formats_parse(capsys: Capsys) -> None:
    _, out, _ = run(capsys, "table", "request", "--format", "json")
    assert json.loads(out)["machine"] == "request"
    _, out, _ = run(capsys, "table", "block", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == len(table_for("block").rows)


def test_table_defaults_to_markdown(capsys: Capsys) -> None:
    _, out, _ = run(capsys, "table", "request")
    assert out.startswith("# request lifecycle: transition table")


def test_table_to_file(capsys: Capsys, tmp_path: Path) -> None:
    target = tmp_path / "sub" / "t.csv"
    status, out, _ = run(capsys, "table", "block", "--format", "csv", "-o", str(target))
    assert (status, out) == (0, "")
    assert target.read_text(encoding="utf-8") == table_for("block").to_csv()


# --------------------------------------------------------------------------- diagram


@pytest.mark.parametrize("machine", ["request", "block"])
@pytest.mark.parametrize("fmt", ["mermaid", "dot", "md"])
def test_diagram(capsys: Capsys, machine: str, fmt: str) -> None:
    status, out, err = run(capsys, "diagram", machine, "--format", fmt)
    assert (status, err) == (0, "")
    assert out == render(machine, fmt)


def test_diagram_to_file_is_utf8(capsys: Capsys, tmp_path: Path) -> None:
    target = tmp_path / "request.mmd"
    assert main(["diagram", "request", "--format", "mermaid", "-o", str(target)]) == 0
    assert capsys.readouterr().out == ""
    data = target.read_bytes()
    assert "⚠".encode() in data
    assert b"\r\n" not in data


@pytest.mark.skipif(SKIP_NO_DOT, reason="Graphviz `dot` not installed")
def test_diagram_svg(capsys: Capsys, tmp_path: Path) -> None:
    target = tmp_path / "block.svg"
    assert main(["diagram", "block", "--format", "svg", "-o", str(target)]) == 0
    assert "<svg" in target.read_text(encoding="utf-8")


def test_diagram_svg_without_dot_exits_2(
    capsys: Capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with capture_logs() as logs:
        status, out, err = run(capsys, "-v", "diagram", "request", "--format", "svg")
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvlifetime diagram: error: ")
    assert "graphviz" in err and "apt-get install graphviz" in err
    # capture_logs swaps the processors: the event is captured instead of printed
    assert logs == [
        {
            "event": "command_failed",
            "log_level": "info",
            "command": "diagram",
            "error": "graphviz_not_found",
            "message": err.removeprefix("kvlifetime diagram: error: ").rstrip("\n"),
        }
    ]


def test_diagram_rejects_unknown_machine(capsys: Capsys) -> None:
    status, _, err = run(capsys, "diagram", "grant")
    assert status == 2
    assert "invalid choice: 'grant'" in err


# --------------------------------------------------------------------------- evidence


def test_evidence_md(capsys: Capsys) -> None:
    status, out, _ = run(capsys, "evidence", "--format", "md")
    assert status == 0
    assert out == evidence_markdown()
    assert "| `SchedulingStopped` |" in out


def test_evidence_json(capsys: Capsys) -> None:
    status, out, _ = run(capsys, "evidence", "--format", "json")
    assert status == 0
    doc = json.loads(out)
    assert doc["evidence"] == claims_matrix()
    assert [r["claim"] for r in doc["provenance"]] == [c.value for c in Claim]
    revoke = next(r for r in doc["provenance"] if r["claim"] == "access_revoked")
    assert revoke["local"] and not revoke["own_peer"]


# --------------------------------------------------------------------------- docs


def test_docs(capsys: Capsys, tmp_path: Path) -> None:
    keep = tmp_path / "ledger-api.md"
    keep.write_text("hand-written\n")
    with capture_logs() as logs:
        status, out, _ = run(capsys, "-v", "docs", "--out", str(tmp_path))
    assert status == 0
    names = {"request.mmd", "block.mmd", "request.md", "block.md", "request.dot", "block.dot"}
    names |= {"block-sharing.dot"}  # the block's review picture is two (sharing apart)
    # the engine side: its table page, and two pictures (its load apart)
    names |= {"engine.mmd", "engine.md", "engine.dot", "engine-reads.dot", "engine-load.dot"}
    svgs = {"request.svg", "block.svg", "block-sharing.svg"}
    svgs |= {"engine.svg", "engine-reads.svg", "engine-load.svg"}
    names |= {"evidence.md", "engine-hooks.md"} | (svgs if HAS_DOT else set())
    names |= {f"engine-{e}.md" for e in PROFILES}  # inproc, mooncake-tcp (nixl-ucx once there)
    assert {"engine-inproc.md", "engine-mooncake-tcp.md"} <= names
    assert {p.name for p in tmp_path.iterdir()} == names | {"ledger-api.md"}
    assert keep.read_text() == "hand-written\n"  # someone else's page is left alone
    assert sorted(out.split()) == sorted(str(tmp_path / n) for n in names)
    written = [e for e in logs if e["event"] == "file_written"]
    assert sorted(Path(str(e["path"])).name for e in written) == sorted(names)
    assert (tmp_path / "block.md").read_text(encoding="utf-8") == render("block", "md")


def test_docs_without_dot_skips_svg(
    capsys: Capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    status, _, err = run(capsys, "docs", "--out", str(tmp_path / "d"))
    assert status == 0
    assert "apt-get install graphviz" in err
    assert not list((tmp_path / "d").glob("*.svg"))
    assert (tmp_path / "d" / "evidence.md").is_file()


@pytest.mark.skipif(SKIP_NO_DOT, reason="Graphviz `dot` not installed")
def test_docs_figures_writes_the_shipped_pictures(capsys: Capsys, tmp_path: Path) -> None:
    """`kvlifetime docs --figures DIR` also writes each picture's .dot and .svg into DIR, as
    the package ships them, and removes any other .dot or .svg there."""
    from kvlifetime.report.shipped import SHIPPED_DIR, drift, expected_files

    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "renamed-picture.svg").write_text("<svg/>", encoding="utf-8")
    (figures / "notes.txt").write_text("kept\n", encoding="utf-8")
    status, out, _ = run(capsys, "docs", "--out", str(tmp_path / "d"), "--figures", str(figures))
    assert status == 0
    assert [line for line in out.splitlines() if line.startswith(str(figures))] == [
        str(figures / n) for n in expected_files()
    ]
    assert sorted(p.name for p in figures.iterdir()) == sorted([*expected_files(), "notes.txt"])
    assert drift(figures) == ["notes.txt: not a shipped picture's file"]
    for name in expected_files():
        assert (figures / name).read_bytes() == (tmp_path / "d" / name).read_bytes()
        if name.endswith(".dot"):  # the SVGs: tests/test_diagrams.py, per Graphviz version
            assert (figures / name).read_bytes() == (SHIPPED_DIR / name).read_bytes()


def test_docs_figures_without_dot_writes_nothing(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    status, out, err = run(
        capsys, "docs", "--out", str(tmp_path / "d"), "--figures", str(tmp_path / "f")
    )
    assert (status, out) == (2, "")
    assert "apt-get install graphviz" in err and err.count("\n") == 1
    assert not (tmp_path / "d").exists() and not (tmp_path / "f").exists()


def test_docs_needs_out(capsys: Capsys) -> None:
    status, _, err = run(capsys, "docs")
    assert status == 2
    assert "--out" in err


# --------------------------------------------------------------------------- demo


@pytest.mark.parametrize("backend", ["inproc", "mooncake", "nixl"])
def test_demo(capsys: Capsys, tmp_path: Path, backend: str) -> None:
    """What `make demo`, `make demo-mooncake` and `make demo-nixl` run, at a small size: a
    line per run and a short summary on stdout, everything else in files."""
    if backend == "mooncake":
        need_mooncake()
    elif backend == "nixl":
        need_nixl()
    out_dir = tmp_path / "out"
    n = "200" if backend == "inproc" else "40"  # ten runs, each starting engine processes
    logs = tmp_path / "logs" / "events.jsonl"
    status, out, err = run(
        capsys,
        *("demo", "--out", str(out_dir), "--backend", backend, "--requests", n),
        *("--log-json", str(logs)),
    )
    assert (status, err) == (0, "")
    assert sorted(p.name for p in logs.parent.iterdir()) == [
        f"events-{i:02d}.jsonl" for i in range(1, 11)
    ]
    # run 9 (pull, timeout) replays clean: its log is what replay checks
    assert main(["replay", str(logs.parent / "events-09.jsonl")]) == 0
    assert "every one legal" in capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(
        f"kvlifetime demo: 10 harness runs of {n} requests (backend {backend}"
    )
    runs = [line for line in lines if line.startswith("[")]
    assert [r[:8] for r in runs] == [f"[{i:>2}/10] " for i in range(1, 11)]
    assert all(" s  isolation " in r for r in runs)
    # the proof policy's runs hold isolation; the naive push run breaks it
    assert "push, proof " in runs[2] and "isolation held" in runs[2]
    assert "pull, proof " in runs[9] and "isolation held" in runs[9]
    assert "proof vs naive:" in out and f"open {out_dir / 'index.html'} in a browser" in out
    assert len(lines) < 30  # a summary, not pages of tables
    assert "|" not in out
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "block.md",
        "block.mmd",
        "engine.md",
        "engine.mmd",
        "harness-table.md",
        "index.html",
        "report.json",
        "report.txt",
        "request.md",
        "request.mmd",
    ]
    assert (out_dir / "request.mmd").read_text(encoding="utf-8") == render("request", "mermaid")


def test_demo_rejects_unknown_backend(capsys: Capsys, tmp_path: Path) -> None:
    status, _, err = run(capsys, "demo", "--out", str(tmp_path), "--backend", "rdma")
    assert status == 2
    assert "invalid choice: 'rdma'" in err
    with pytest.raises(ValueError, match="unknown backend"):
        run_demo(tmp_path, "rdma", io.StringIO())


def test_demo_without_graphviz_writes_the_page_with_the_shipped_pictures(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `dot` (a pip-only machine) the demo runs and writes the page, its lifecycles the
    pictures shipped in the package, and says so in one line (it used to refuse, exit 2)."""
    from kvlifetime.report.shipped import every_picture

    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    out_dir = tmp_path / "out"
    status, out, err = run(capsys, "demo", "--out", str(out_dir), "--requests", "5")
    assert (status, err) == (0, "")
    (note,) = [line for line in out.splitlines() if line.startswith("note: ")]
    assert "`dot` is not installed here" in note and "pictures shipped with kvlifetime" in note
    page = (out_dir / "index.html").read_text(encoding="utf-8")
    assert 'data-drawing="shipped"' in page
    for _, pic in every_picture():
        assert f'<figure id="fig-{pic.name}" data-kind="graphviz"' in page


# --------------------------------------------------------------------------- plumbing


def test_no_command_is_a_usage_error(capsys: Capsys) -> None:
    status, _, err = run(capsys)
    assert status == 2
    assert "usage: kvlifetime" in err


def test_verify_max_faults_bounds_the_search(capsys: Capsys) -> None:
    common = ("verify", "--requests", "2", "--peers", "2", "--blocks", "2", "--faults", "all")
    status, out, _ = run(
        capsys, *common, "--max-faults", "0", "--policy", "timeout", "--format", "json"
    )
    assert status == 0, out
    unbudgeted = json.loads(out)
    assert unbudgeted["verdict"] == "pass"  # no fault may happen: the lease never fires early
    status, out, _ = run(
        capsys, *common, "--max-faults", "1", "--policy", "timeout", "--format", "json"
    )
    assert status == 1
    refuted = json.loads(out)
    assert refuted["violation"]["invariant"] == "isolation"
    assert len(refuted["trace"]) == 6


def test_help_lists_every_command(capsys: Capsys) -> None:
    status, out, _ = run(capsys, "--help")
    assert status == 0
    for cmd in cli.COMMANDS:
        assert cmd.name in out


def test_os_error_exits_1(capsys: Capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, _, err = run(capsys, "table", "request", "-o", str(blocker / "t.md"))
    assert status == 1
    assert err == f"kvlifetime table: error: {blocker}: file exists\n"  # mkdir of its folder


def _add_hello(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fail", action="store_true")


def _run_hello(args: argparse.Namespace) -> int:
    if args.fail:
        raise InsufficientEvidence("r1", {"inc#1": ["cancel_received", "scheduling_stopped"]})
    print("hello")
    return 0


def test_a_new_subcommand_is_one_entry(capsys: Capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    # How verify / replay / simulate plug in: append one Command.
    hello = Command("hello", "say hello", _add_hello, _run_hello)
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, hello])
    assert run(capsys, "hello") == (0, "hello\n", "")
    status, out, err = run(capsys, "hello", "--fail")
    assert (status, out) == (2, "")
    assert err == (
        "kvlifetime hello: error: request 'r1' cannot be released; "
        "still unproven: inc#1: cancel_received, scheduling_stopped\n"
    )


def test_verbose_logs_to_stderr_and_changes_no_global_config(
    capsys: Capsys, tmp_path: Path
) -> None:
    before = structlog.get_config()
    status, out, err = run(capsys, "-v", "table", "request", "-o", str(tmp_path / "t.md"))
    assert (status, out) == (0, "")
    assert "file_written" in err and str(tmp_path / "t.md") in err
    assert structlog.get_config() == before
    # without -v, info events stay quiet: stdout and stderr carry only what was asked for
    status, out, err = run(capsys, "table", "request", "-o", str(tmp_path / "t2.md"))
    assert (status, out, err) == (0, "", "")


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["replay", "nosuch.jsonl"], "log nosuch.jsonl"),
        (["report", "--results", "nosuch.json"], "--results nosuch.json"),
    ],
)
def test_a_missing_input_file_is_exit_2_in_one_line_naming_the_command(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], what: str
) -> None:
    monkeypatch.chdir(tmp_path)
    status, out, err = run(capsys, *argv)
    assert (status, out) == (2, "")
    assert err == f"kvlifetime {argv[0]}: error: {what}: no such file\n"
    assert list(tmp_path.iterdir()) == []  # nothing written (report: no index.html)


def test_a_refusal_is_one_line_not_a_log_line_as_well(capsys: Capsys, tmp_path: Path) -> None:
    """A library warning about the refusal (report_refused) stays out of the command line's
    stderr: the error line says it once."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    status, out, err = run(capsys, "report", "--results", str(bad), "--out", str(tmp_path))
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kvlifetime report: error: ")
    assert "is not JSON" in err


def test_quiet_without_verbose_even_under_capture(capsys: Capsys, tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert run(capsys, "docs", "--out", str(tmp_path))[0] == 0
    assert logs == []
