"""``kvlifetime report``: the design-review page, built from real harness runs and the real
verifier, and opened in headless Chromium."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import attrs
import pytest
from report_helpers import HAS_DOT, chromium_or_skip, write_results
from structlog.testing import capture_logs

from kvlifetime.cli import main
from kvlifetime.diagrams import pictures
from kvlifetime.report import INDEX, STEPS, ReportInputError, load_results, write_report
from kvlifetime.report.counterexamples import (
    ENGINE,
    OWNER,
    arrows,
    explore_policies,
    lanes,
    same_shape,
)
from kvlifetime.report.shipped import every_picture
from kvlifetime.report.tables import inline
from kvlifetime.spec.table import table_for

ROOT = Path(__file__).resolve().parent.parent
REFUTED_POLICIES = (
    "naive",
    "timeout",
    "trusting",
    "sglang-0.5.23",
    "first-failure",
    "counted-completions",
    "id-overwrite",
    "ordered-reaper",
    "naive-read",
)
# Refuted by what is never written rather than by a late write: a request stranded (progress).
PROGRESS_ONLY = ("ordered-reaper",)


@pytest.fixture(scope="module")
def report_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_results(tmp_path_factory.mktemp("out") / "report.json")


@attrs.frozen
class Built:
    page: Path
    status: int
    stdout: str
    logs: list[MutableMapping[str, Any]]


@pytest.fixture(scope="module")
def built(report_results: Path) -> Built:
    """The page, made once by the command line as a user runs it: ``kvlifetime -v report``
    (its lifecycles drawn by Graphviz where it is installed, else the shipped ones)."""
    out = io.StringIO()
    with capture_logs() as logs, contextlib.redirect_stdout(out):
        status = main(["-v", "report", "--out", str(report_results.parent)])
    return Built(report_results.parent / INDEX, status, out.getvalue(), logs)


@pytest.fixture(scope="module")
def report_page(built: Built) -> Path:
    assert built.status == 0, "kvlifetime report failed: see its test"
    return built.page


def test_report_command_writes_the_page_and_says_each_step(built: Built) -> None:
    assert built.status == 0
    assert built.stdout == f"{built.page}\n"  # stdout: the path written, nothing else
    steps = [e["step"] for e in built.logs if e["event"] == "report_step"]
    assert tuple(steps) == STEPS
    (written,) = [e for e in built.logs if e["event"] == "report_written"]
    assert written["runs"] == 3 and written["bytes"] == built.page.stat().st_size


# --------------------------------------------------------------------------- counterexamples


def test_refuted_policies_are_drawn_as_lanes() -> None:
    everything = explore_policies()
    verdicts = {v.slug: v for v in everything if v.refuted}
    assert list(verdicts) == list(REFUTED_POLICIES)
    assert all(v.result["verdict"] == "pass" for v in everything if v.policy == "proof")
    for policy in REFUTED_POLICIES:
        trace = verdicts[policy].result["trace"]
        steps = arrows(trace)
        assert [s.number for s in steps] == [t["step"] for t in trace]
        if policy in PROGRESS_ONLY:
            assert verdicts[policy].result["violation"]["invariant"] == "progress"
            assert lanes(steps) == [OWNER, "p1"]  # nothing posted, nothing lands
            assert steps[-1].violation and not any(s.violation for s in steps[:-1])
            continue
        assert lanes(steps) == [OWNER, "p1", ENGINE]
        # the grant goes from decode to the peer; the peer posts to the engine; the write
        # that breaks isolation lands from the engine in decode's memory, last
        kinds = [t["event"][0] for t in trace]
        g = steps[kinds.index("grant")]
        assert (g.source, g.target) == (OWNER, "p1")
        post = steps[kinds.index("post")]
        assert (post.source, post.target) == ("p1", ENGINE)
        assert (steps[-1].source, steps[-1].target, steps[-1].style) == (ENGINE, OWNER, "write")
        assert steps[-1].violation and not any(s.violation for s in steps[:-1])


def test_sglang_counterexample_is_drawn_beside_proof_passing_on_the_same_shape() -> None:
    everything = explore_policies()
    (v,) = [x for x in everything if x.policy == "sglang-0.5.23"]
    trace = v.result["trace"]
    steps = arrows(trace)
    assert [t["event"][0] for t in trace] == [
        "admit",
        "grant",
        "reject",
        "deliver",
        "deliver",
        "post",
        "lease",
        "land",
    ]
    # the abort's cancel goes to the rank, its receipt comes back; the deadline passes on the
    # decode's own lane and sends the page back to the pool; the rank's write lands after it
    assert [(s.source, s.target) for s in steps[3:5]] == [(OWNER, "p1"), ("p1", OWNER)]
    assert (steps[6].source, steps[6].target) == (OWNER, OWNER)
    assert any("releasing anyway" in n and "to the pool" in n for n in steps[6].notes)
    assert (steps[7].source, steps[7].target, steps[7].style) == (ENGINE, OWNER, "write")
    proof = same_shape(v, everything)
    assert proof is not None and proof.policy == "proof" and proof.faults == v.faults
    assert proof.result["verdict"] == "pass"
    assert {x.slug: same_shape(x, everything) is not None for x in everything if x.refuted} == {
        p: True for p in REFUTED_POLICIES
    }


def test_message_arrows_follow_their_direction() -> None:
    trace = [
        {"step": 1, "event": ["grant", 0, 1], "label": "grant r1 -> p2", "notes": []},
        {"step": 2, "event": ["deliver", 0, -1], "label": "deliver Cancel(grant #1) to p2"},
        {"step": 3, "event": ["lose", 1, -1], "label": "lose CancelReceived(grant #1) from p2"},
        {"step": 4, "event": ["stop", 0, -1], "label": "stop grant #1", "notes": []},
        {"step": 5, "event": ["lie", 0, -1], "label": "lie: p2 sends AccessRevoked(p2)"},
        {"step": 6, "event": ["fence", 1, -1], "label": "fence p2"},
        {"step": 7, "event": ["mystery", 0, 0], "label": "something new"},
    ]
    got = [(s.source, s.target, s.style) for s in arrows(trace)]
    assert got == [
        (OWNER, "p2", "call"),
        (OWNER, "p2", "message"),
        ("p2", OWNER, "lost"),
        ("p2", "p2", "action"),  # grant #1's peer, from the grant step
        ("p2", OWNER, "lie"),
        (OWNER, "p2", "call"),
        (OWNER, OWNER, "action"),  # an event this drawing does not know: the owner's lane
    ]


def test_inline_keeps_code_and_escapes() -> None:
    assert inline("``a<b>`` and `c` **d** & e") == (
        "<code>a&lt;b&gt;</code> and <code>c</code> <strong>d</strong> &amp; e"
    )
    # the docstrings' *emphasis* (the evidence table's *not*), never inside code or a product
    assert inline("is *not* it; `a*b*c`; 2*3*4") == (
        "is <em>not</em> it; <code>a*b*c</code>; 2*3*4"
    )


# --------------------------------------------------------------------------- the page


def test_page_is_self_contained_and_complete(report_page: Path) -> None:
    text = report_page.read_text(encoding="utf-8")
    # nothing fetched: no external script, stylesheet, image, font or frame
    assert not re.search(r"<(script|img|iframe|link)[^>]+(src|href)=", text)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    assert "url(http" not in text and "@import" not in text
    for m in ("request", "block"):
        assert f'id="fig-{m}" data-kind="graphviz"' in text
        for s in table_for(m).states:
            assert f"<title>{s}</title>" in text  # every state is a Graphviz node
    for fid in ("fig-naive-vs-proof", "fig-quarantine", "fig-every-run"):
        assert f'id="{fid}" data-kind="plot"' in text
    for policy in REFUTED_POLICIES:
        assert f'id="fig-cx-{policy}" data-kind="sequence"' in text
    # a read grant's lanes say who reads: the owner's blocks are the source
    cx_read = text.split('id="fig-cx-naive-read"', 1)[1].split("</svg>", 1)[0]
    assert all(f">{t}<" in cx_read for t in ("source", "reader p1", "reads KV")), cx_read[:300]
    assert ">decode<" not in cx_read and ">writes KV<" not in cx_read
    # three lanes in each (decode, the peer, the engine); two where nothing is posted
    assert text.count('class="lane"') == 3 * len(REFUTED_POLICIES) - len(PROGRESS_ONLY)
    for engine in ("inproc", "mooncake-tcp", "nixl-ucx"):
        assert f'id="engine-{engine}"' in text
    assert "CancelReceived" in text and "access_revoked" in text
    assert "*not*" not in text and "<em>not</em>" in text
    summary = text.split('<section id="summary">', 1)[1].split("</section>", 1)[0]
    assert "3 harness runs" in summary and "seed 3," in summary and "Tick:" in summary
    ids = re.findall(r'\bid="([^"]+)"', text)
    graph_ids = [i for i in ids if i.startswith(("request-", "block-", "fig-"))]
    assert len(graph_ids) == len(set(graph_ids))  # two inline graphs never share an id


def test_lifecycle_pictures_fit_a_slide(report_page: Path) -> None:
    text = report_page.read_text(encoding="utf-8")
    for m in ("request", "block"):
        fig = text.split(f'id="fig-{m}"', 1)[1]
        w, h = map(float, re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', fig).groups())  # type: ignore[union-attr]
        assert 1 / 3 <= w / h <= 3, (m, w, h)
        assert w <= 1400  # a slide, not a scroll


def test_results_file_errors_are_typed(tmp_path: Path) -> None:
    bad = tmp_path / "report.json"
    for content, match in [
        ("{not json", "not JSON"),
        ('{"foo": 1}', "not a list of harness runs"),
        ("[]", "not a list of harness runs"),
        ('[{"backend": "inproc"}]', "run 1: a harness result has no 'policy'"),
    ]:
        bad.write_text(content)
        with pytest.raises(ReportInputError, match=match):
            load_results(bad)
    bad.write_bytes(b"\xff\xfe[")
    with pytest.raises(ReportInputError, match="not JSON"):
        load_results(bad)


def test_a_refused_results_file_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "report.json").write_text('[{"backend": "inproc", "policy": 3}]')
    with capture_logs() as logs:
        status = main(["-v", "report", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2
    assert "a harness result" in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / INDEX).exists()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["report_refused"]


def test_mistyped_fields_are_refused(report_results: Path, tmp_path: Path) -> None:
    runs = json.loads(report_results.read_text())
    series = runs[0]["series"]
    for field, value in [
        ("seed", "7"),
        ("requests", True),
        ("series", [1]),
        ("wall_s", None),
        ("series", {**series, "free": [*series["free"][:-1], "x"]}),
        ("series", {**series, "free": series["free"][:-1]}),
        ("series", {"tick": [0]}),
        ("series", {**series, "tick": list(reversed(series["tick"]))}),
    ]:
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps([{**runs[0], field: value}]))
        with pytest.raises(ReportInputError, match=field):
            load_results(bad)


def test_missing_extra_names_the_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def no_matplotlib(name: str, *a: object, **k: object) -> object:
        return None if name.partition(".")[0] == "matplotlib" else real(name, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", no_matplotlib)
    from kvlifetime.extras import MissingExtra

    with pytest.raises(MissingExtra, match=r"pip install 'kvlifetime\[report\]'"):
        write_report(tmp_path)
    assert not (tmp_path / INDEX).exists()


def test_page_without_results_says_how_to_make_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "--out", str(tmp_path)]) == 0  # no report.json there
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / INDEX}\n"
    assert "no harness results at" in err and "make demo" in err
    text = (tmp_path / INDEX).read_text(encoding="utf-8")
    assert "No harness results: run <code>make demo</code>" in text
    assert 'data-kind="plot"' not in text
    assert 'id="fig-cx-naive"' in text  # the rest of the page is all there


# --------------------------------------------------------------------------- in a browser


def test_page_renders_in_headless_chromium(report_page: Path) -> None:
    """Every figure drawn by the browser, with its nodes; no script error; a screenshot."""
    chromium_or_skip()
    from kvlifetime.report.browser import check_page

    shot = report_page.with_suffix(".png")
    check = check_page(report_page, screenshot=shot)
    v = check.verdict
    assert v["errors"] == []
    figs = {f["id"]: f for f in v["figures"]}
    assert set(figs) == {
        "fig-request",
        "fig-block",
        "fig-block-sharing",
        "fig-engine",
        "fig-engine-load",
        "fig-engine-reads",
        "fig-naive-vs-proof",
        "fig-quarantine",
        "fig-every-run",
        *(f"fig-cx-{p}" for p in REFUTED_POLICIES),
    }
    for f in figs.values():
        assert f["width"] > 100 and f["height"] > 100, f
    for m in ("request", "block"):
        f = figs[f"fig-{m}"]
        assert sorted(f["names"]) == sorted([*table_for(m).states, "__start__"])
        assert f["edges"] > 0
    for pic in pictures(table_for("engine")):  # each picture draws the states its rows touch
        drawn = {r.source for r in pic.rows} | {r.target for r in pic.rows}
        assert set(figs[f"fig-{pic.name}"]["names"]) - {"__start__"} == drawn, pic.name
    sharing = {r.source for r in table_for("block").rows if r.event == "shared"}
    assert set(figs["fig-block-sharing"]["names"]) == sharing | {"owned", "exposed"}
    # laid out for a slide at 1280 px: no two labels overlap, none leaves its picture, no line
    # runs through one, each edge's label by its own edge, every figure and table fits
    for f in figs.values():
        assert (f["overlaps"], f["outside"], f["struck"], f["strays"]) == ([], [], [], []), f
        assert f["texts"] > 0 and f["width"] <= f["room"], f
    assert len(v["tables"]) >= 6 and all(t["ok"] for t in v["tables"]), v["tables"]
    verdicts = {x.slug: x for x in explore_policies() if x.refuted}
    for policy in REFUTED_POLICIES:
        f = figs[f"fig-cx-{policy}"]
        assert f["parts"] == len(verdicts[policy].result["trace"])
        progress = policy in PROGRESS_ONLY  # one grant, the rest actions on the lanes
        assert f["lanes"] == (2 if progress else 3) and f["arrows"] >= (1 if progress else 3)
    assert figs["fig-naive-vs-proof"]["parts"] >= 3  # naive, timeout, proof panels
    assert figs["fig-every-run"]["parts"] >= 3
    assert v["ok"] is True and check.ok
    # each refuted policy is shown beside the proof policy passing on the same shape
    html = report_page.read_text(encoding="utf-8")
    for policy in REFUTED_POLICIES:
        beside = re.search(rf'<p class="beside" id="beside-{re.escape(policy)}">(.*?)</p>', html)
        assert beside is not None, policy
        assert '<span class="verdict-pass">PASS</span>' in beside.group(1)
    # a real PNG, the page's full width
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    assert width == 1280 and len(data) > 50_000


def test_page_check_fails_on_a_broken_figure(report_page: Path, tmp_path: Path) -> None:
    """The browser check can fail: a script error and a figure with no nodes are caught."""
    chromium_or_skip()
    from kvlifetime.report.browser import check_page

    text = report_page.read_text(encoding="utf-8")
    broken = text.replace('class="node"', 'class="gone"').replace(
        "</main>", "</main><script>undefinedFunction();</script>"
    )
    page = tmp_path / "broken.html"
    page.write_text(broken, encoding="utf-8")
    check = check_page(page)
    assert not check.ok
    figs = {f["id"]: f for f in check.verdict["figures"]}
    assert figs["fig-request"]["ok"] is False and figs["fig-request"]["parts"] == 0
    assert figs["fig-cx-naive"]["ok"] is True
    assert any("undefinedFunction" in e for e in check.verdict["errors"])
    assert "fig-request" in check.problems() and "script error" in check.problems()


def test_page_check_fails_on_a_crowded_layout(report_page: Path, tmp_path: Path) -> None:
    """The layout check can fail: two labels on one spot, a label past its picture's edge, a
    line through a label, a table wider than its column."""
    chromium_or_skip()
    from kvlifetime.report.browser import check_page

    text = report_page.read_text(encoding="utf-8")
    seq = text.index('id="fig-cx-naive"')
    end = text.index("</svg>", seq)
    crowded = (
        text[:end]
        + '<text x="30" y="30" font-size="12">crowded one</text>'
        + '<text x="34" y="32" font-size="12">crowded two</text>'
        + '<text x="-40" y="60" font-size="12">off the edge</text>'
        + '<text x="300" y="200" font-size="12">struck through</text>'
        + '<line class="lifeline" x1="330" y1="150" x2="330" y2="260" stroke="#000"/>'
        + text[end:]
    )
    wide = "<table><tr>" + "<td>wide_unbreakable_cell_text_</td>" * 60 + "</tr></table>"
    crowded = crowded.replace("</main>", f'<section id="wide">{wide}</section></main>')
    page = tmp_path / "crowded.html"
    page.write_text(crowded, encoding="utf-8")
    check = check_page(page)
    assert not check.ok
    (f,) = [x for x in check.figures if x["id"] == "fig-cx-naive"]
    assert ["crowded one", "crowded two"] in f["overlaps"]
    assert "off the edge" in f["outside"] and "struck through" in f["struck"]
    problems = check.problems()
    assert "'crowded one' overlaps 'crowded two'" in problems
    assert "a line runs through 'struck through'" in problems
    assert any(not t["ok"] for t in check.tables) and "px wide in" in problems


def test_engine_profiles_show_every_status() -> None:
    from kvlifetime.profiles import PROFILES
    from kvlifetime.report.tables import engine_profiles

    pages = {name: body for name, _, body in engine_profiles()}
    assert list(pages) == list(PROFILES)
    for name, profile in PROFILES.items():
        body = pages[name]
        assert body.count("<tr>") == 1 + len(profile.rows)  # the heading row and one per status
        assert "<code>nothing</code>" not in body  # no evidence is said in words, not as a name


def test_no_note_sits_inside_a_plot_where_a_curve_can_cross_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (CI, 100-request demo): the naive run's late writes reached their maximum at
    once, so the twin axis drew a flat line at the top of the panel, through the "free: at
    least" note. Every note is now in a title, above the plotting area."""
    pytest.importorskip("matplotlib")
    from kvlifetime.report import harness_plots

    n = 5
    series = {
        "tick": list(range(n)),
        "free": [2_000] * n,
        "late_writes": [15] * n,  # flat at its maximum from the first sample
        "quarantined": [0, 3, 3, 0, 0],
        "reclaimed": [0, 0, 3, 3, 3],
    }
    runs = [
        {"policy": p, "direction": "push", "num_blocks": 2_048, "series": series}
        for p in ("naive", "timeout", "proof")
    ]
    figures: list[Any] = []

    def keep(fig: Any, figure_id: str) -> str:
        figures.append(fig)
        return ""

    monkeypatch.setattr(harness_plots, "_svg", keep)
    harness_plots.naive_vs_proof(runs, "a")
    harness_plots.every_run(runs, "b")
    harness_plots.quarantine_and_reclaim(runs, "c")
    assert len(figures) == 3
    for fig in figures:
        for ax in fig.axes:
            assert not ax.texts, [t.get_text() for t in ax.texts]
    titles = [ax.get_title() for fig in figures[:2] for ax in fig.axes if ax.get_title()]
    assert titles and all("free: at least 2,000 of 2,048" in t for t in titles)


# --------------------------------------------------------------------------- without Graphviz


def _hide_dot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-dot-here"))  # a pip-only machine
    assert shutil.which("dot") is None


_LIFECYCLE_FIGURE = re.compile(r'<figure id="fig-([^"]+)" data-kind="graphviz".*?</figure>', re.S)
_DRAWN = re.compile(r'<p id="lifecycles-drawn" data-drawing="([^"]+)">[^\n]*</p>\n')


def _lifecycle_figures(text: str) -> dict[str, str]:
    """The page's lifecycle figures (``<figure>`` elements), by picture name, in page order."""
    return {m.group(1): m.group(0) for m in _LIFECYCLE_FIGURE.finditer(text)}


def test_report_without_graphviz_draws_every_lifecycle_from_the_shipped_svgs(
    built: Built,
    report_results: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pip install 'kvlifetime[report]'` and `kvlifetime report` on a machine with no `dot`:
    the page is written, every lifecycle picture in it, and the output says they are the
    shipped ones. It is the page Graphviz would have drawn: byte for byte where the same
    Graphviz version drew the shipped pictures, but for the sentence saying where they came
    from."""
    _hide_dot(monkeypatch, tmp_path)
    out = tmp_path / "out"
    with capture_logs() as logs:
        status = main(["-v", "report", "--out", str(out), "--results", str(report_results)])
    stdout, err = capsys.readouterr()
    assert (status, stdout) == (0, f"{out / INDEX}\n")
    assert err.count("\n") == 1, err
    assert "kvlifetime report: note: Graphviz's `dot` is not installed here" in err
    assert "pictures shipped with kvlifetime" in err
    (written,) = [e for e in logs if e["event"] == "report_written"]
    assert written["lifecycles"] == "shipped" and written["graphviz"]
    text = (out / INDEX).read_text(encoding="utf-8")
    assert [m.group(1) for m in _DRAWN.finditer(text)] == ["shipped"]
    figures = _lifecycle_figures(text)
    assert list(figures) == [pic.name for _, pic in every_picture()]
    for table, pic in every_picture():
        for s in pic.states(table):
            assert f"<title>{s}</title>" in figures[pic.name], (pic.name, s)
        assert f'id="{pic.name}-graph0"' in figures[pic.name]  # ids prefixed, as drawn now
    # the page drawn with Graphviz here (or, without it, the shipped pictures again)
    (fresh_written,) = [e for e in built.logs if e["event"] == "report_written"]
    fresh = built.page.read_text(encoding="utf-8")
    assert fresh_written["lifecycles"] == ("graphviz" if HAS_DOT else "shipped")
    if fresh_written["graphviz"] != written["graphviz"]:  # another Graphviz: another layout
        assert list(_lifecycle_figures(fresh)) == list(figures)
        fresh, text = (_LIFECYCLE_FIGURE.sub("", t) for t in (fresh, text))
    assert _DRAWN.sub("", fresh) == _DRAWN.sub("", text)


def test_demo_and_report_refuse_a_stale_shipped_picture_without_graphviz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shipped picture that no longer matches the specification is never shown: exit 2, one
    line naming both fixes, nothing written."""
    from kvlifetime.report import shipped

    folder = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_DIR, folder)
    (folder / "block.dot").write_text("digraph stale {}\n", encoding="utf-8")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", folder)
    _hide_dot(monkeypatch, tmp_path)
    for argv in (["report"], ["demo", "--requests", "5"]):
        status = main([*argv, "--out", str(tmp_path / "out")])
        out, err = capsys.readouterr()
        assert (status, out) == (2, ""), argv
        assert err.count("\n") == 1 and "shipped picture 'block'" in err, err
        assert "apt-get install graphviz" in err and shipped.REGENERATE in err
        assert not (tmp_path / "out").exists()


def test_a_wheel_on_a_machine_without_graphviz_writes_every_lifecycle(tmp_path: Path) -> None:
    """The wheel carries the shipped pictures: kvlifetime imported from the built wheel alone
    (not this checkout), with no `dot` on PATH, writes the page with every lifecycle."""
    wheels, site, out = tmp_path / "wheels", tmp_path / "site", tmp_path / "out"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"),
            *("-w", str(wheels), str(ROOT)),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("kvlifetime-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import kvlifetime; "
        "assert kvlifetime.__file__.startswith(sys.argv[1]), kvlifetime.__file__; "
        "from kvlifetime.cli import main; sys.exit(main(['report', '--out', sys.argv[2]]))"
    )
    env = {**os.environ, "PATH": str(tmp_path / "no-dot-here"), "KVLIFETIME_PURE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(site), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "pictures shipped with kvlifetime" in done.stderr
    text = (out / INDEX).read_text(encoding="utf-8")
    assert list(_lifecycle_figures(text)) == [pic.name for _, pic in every_picture()]
    assert 'data-drawing="shipped"' in text
