"""The design-review page: one self-contained HTML file (every picture inline SVG, no file or
network fetched, one small inline script that checks the figures and records a verdict).

The verdict (``<pre id="verdict">``, and ``data-verdict`` on ``<body>``) is what a browser test
reads back: per figure its kind, its drawn size and how many of its parts the browser found
(Graphviz nodes, sequence steps, plot axes), and every script error the page raised.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import attrs

from kvlifetime.report.counterexamples import WHY, Verdict, same_shape, sequence_svg
from kvlifetime.report.lifecycles import Lifecycle
from kvlifetime.report.tables import inline


@attrs.frozen(slots=True)
class Figure:
    """One figure of the page and what the browser must find in it."""

    id: str
    kind: str  # "graphviz" (g.node), "sequence" (g.step), "plot" (matplotlib axes)
    svg: str
    caption: str
    expect: int  # parts the browser must find at least (nodes, steps, panels)
    cls: str = ""


@attrs.frozen(slots=True)
class HarnessSection:
    table: str  # HTML
    figures: tuple[Figure, ...]
    summary: str  # plain text (compare_markdown's closing lines)
    source: str  # where the results came from
    note: str = ""  # why something is missing, if it is


_CHECK = r"""
(function () {
  var out = {figures: [], errors: window.__kvErrors || [], tables: []};
  var SLACK = 1.5;  // px: anti-aliased edges of neighbouring text may touch
  function box(el) { var r = el.getBoundingClientRect();
    return {l: r.left, t: r.top, r: r.right, b: r.bottom, w: r.width, h: r.height}; }
  function cut(a, b) {
    return Math.min(a.r, b.r) - Math.max(a.l, b.l) > SLACK &&
      Math.min(a.b, b.b) - Math.max(a.t, b.t) > SLACK; }
  function name(el) { return (el.textContent || '').trim().slice(0, 60); }
  // A label's ink: its glyphs without the blank padding around them (Graphviz pads a label
  // with no-break spaces to keep it off its edge) and without the font's ascent and descent.
  function ink(t) {
    var s = t.textContent || '', a = 0, z = s.length - 1, m = t.getScreenCTM();
    while (a <= z && /\s/.test(s.charAt(a))) a++;
    while (z >= a && /\s/.test(s.charAt(z))) z--;
    var b = box(t);
    if (!m || a > z || typeof t.getExtentOfChar !== 'function') return b;
    try {
      var p = t.ownerSVGElement.createSVGPoint(), e1 = t.getExtentOfChar(a),
        e2 = t.getExtentOfChar(z);
      p.x = e1.x; p.y = e1.y; var q1 = p.matrixTransform(m);
      p.x = e2.x + e2.width; p.y = e2.y + e2.height; var q2 = p.matrixTransform(m);
      var pad = (q2.y - q1.y) * 0.2;
      return {l: Math.min(q1.x, q2.x), r: Math.max(q1.x, q2.x), t: q1.y + pad, b: q2.y - pad,
              w: Math.abs(q2.x - q1.x), h: q2.y - q1.y - 2 * pad};
    } catch (err) { return b; }
  }
  function texts(svg) {
    return Array.prototype.filter.call(svg.querySelectorAll('text'), function (t) {
      return name(t) !== '' && box(t).w > 0; }); }
  // Every pair of labels that overlap, and every label not wholly inside its picture.
  function layout(svg, r) {
    var ts = texts(svg), bs = ts.map(ink), frame = box(svg);
    r.texts = ts.length; r.overlaps = []; r.outside = [];
    for (var i = 0; i < ts.length; i++) {
      var b = bs[i];
      if (b.l < frame.l - SLACK || b.r > frame.r + SLACK || b.t < frame.t - SLACK ||
          b.b > frame.b + SLACK) r.outside.push(name(ts[i]));
      for (var j = i + 1; j < ts.length; j++)
        if (cut(b, bs[j])) r.overlaps.push([name(ts[i]), name(ts[j])]);
    }
    return bs;
  }
  // Lines drawn through a label: each path sampled every 2 px on screen.
  function struck(svg, paths, ts, bs) {
    var hits = [];
    for (var p = 0; p < paths.length; p++) {
      var path = paths[p], m = path.getScreenCTM(), n = path.getTotalLength();
      if (!m || !n) continue;
      var pt = path.ownerSVGElement.createSVGPoint();
      for (var k = 0; k <= n; k += 2) {
        var q = path.getPointAtLength(k); pt.x = q.x; pt.y = q.y;
        var s = pt.matrixTransform(m);
        for (var i = 0; i < bs.length; i++) {
          var b = bs[i];
          if (s.x > b.l && s.x < b.r && s.y > b.t && s.y < b.b) {
            var g = path.closest('g.edge'), t = g && g.querySelector('title');
            var what = name(ts[i]) + (t ? ' (by ' + t.textContent + ')' : '');
            if (hits.indexOf(what) < 0) hits.push(what);
          }
        }
      }
    }
    return hits;
  }
  // Each edge's label must sit by its own line: within `limit` px of it, and no other edge may
  // pass clearly nearer (by more than 6 px: Graphviz may park a label where another edge
  // runs by, and the reader takes it for that edge's).
  function strays(svg, limit) {
    var far = [], edges = svg.querySelectorAll('g.edge'), lines = [];
    function points(path) {
      var m = path.getScreenCTM(), n = path.getTotalLength(), out = [];
      var pt = path.ownerSVGElement.createSVGPoint();
      for (var k = 0; k <= n; k += 2) {
        var q = path.getPointAtLength(k); pt.x = q.x; pt.y = q.y; out.push(pt.matrixTransform(m));
      }
      return out;
    }
    function dist(pts, b) {
      var best = Infinity;
      pts.forEach(function (s) {
        var dx = Math.max(b.l - s.x, 0, s.x - b.r), dy = Math.max(b.t - s.y, 0, s.y - b.b);
        best = Math.min(best, Math.sqrt(dx * dx + dy * dy));
      });
      return best;
    }
    for (var e = 0; e < edges.length; e++) {
      var path = edges[e].querySelector('path');
      lines.push(path ? points(path) : []);
    }
    for (var e = 0; e < edges.length; e++) {
      var labels = edges[e].querySelectorAll('text');
      if (!labels.length || !lines[e].length) continue;
      var b = ink(labels[0]);
      for (var l = 1; l < labels.length; l++) {
        var o = ink(labels[l]);
        b = {l: Math.min(b.l, o.l), t: Math.min(b.t, o.t), r: Math.max(b.r, o.r),
             b: Math.max(b.b, o.b)};
      }
      var own = dist(lines[e], b), other = Infinity;
      for (var f = 0; f < edges.length; f++)
        if (f !== e) other = Math.min(other, dist(lines[f], b));
      if (own > limit || other + 6 < own)
        far.push([name(labels[0]), Math.round(own), Math.round(other)]);
    }
    return far;
  }
  // Closed <details> are opened while the page is measured, so their tables count too.
  var closed = Array.prototype.filter.call(document.querySelectorAll('details'),
    function (d) { return !d.open; });
  closed.forEach(function (d) { d.open = true; });
  var figs = document.querySelectorAll('figure[data-kind]');
  for (var i = 0; i < figs.length; i++) {
    var f = figs[i], svg = f.querySelector('svg'), kind = f.getAttribute('data-kind');
    var r = {id: f.id, kind: kind, expect: +f.getAttribute('data-expect'), ok: false};
    if (svg) {
      var frame = box(svg);
      r.width = Math.round(frame.w); r.height = Math.round(frame.h);
      r.room = Math.round(box(f).w);
      var bs = layout(svg, r), ts = texts(svg);
      r.struck = [];
      if (kind === 'graphviz') {
        var nodes = svg.querySelectorAll('g.node');
        r.parts = nodes.length;
        r.names = Array.prototype.map.call(nodes, function (n) {
          var t = n.querySelector('title'); return t ? t.textContent : '';
        });
        r.edges = svg.querySelectorAll('g.edge').length;
        r.struck = struck(svg, svg.querySelectorAll('g.edge path'), ts, bs);
        r.strays = strays(svg, 36);
      } else if (kind === 'sequence') {
        r.parts = svg.querySelectorAll('g.step').length;
        r.lanes = svg.querySelectorAll('g.lane').length;
        r.arrows = svg.querySelectorAll('g.step line').length;
        r.struck = struck(svg, svg.querySelectorAll('line.lifeline'), ts, bs);
      } else {
        r.parts = svg.querySelectorAll('g[id^="axes_"]').length;
        r.paths = svg.querySelectorAll('path').length;
        // the data lines (not the axes' ticks): g#axes_N > g#line2d_M > path
        r.struck = struck(svg, svg.querySelectorAll('g[id^="axes_"] > g[id^="line2d_"] path'),
          ts, bs);
      }
      r.drawn = r.width > 0 && r.height > 0 && r.parts > 0 && r.parts >= r.expect;
      r.fits = r.width <= r.room;
      r.strays = r.strays || [];
      r.ok = r.drawn && r.fits && r.overlaps.length === 0 && r.outside.length === 0 &&
        r.struck.length === 0 && r.strays.length === 0;
    }
    out.figures.push(r);
  }
  // Every table fits its column: no horizontal scrolling.
  var tables = document.querySelectorAll('main table');
  for (var t = 0; t < tables.length; t++) {
    var tb = tables[t], room = tb.parentElement.clientWidth, w = tb.scrollWidth;
    var row = tb.querySelector('tr');
    out.tables.push({head: row ? name(row) : '', width: w, room: room, ok: w <= room + 1});
  }
  closed.forEach(function (d) { d.open = false; });
  out.height = document.documentElement.scrollHeight;
  out.ok = out.errors.length === 0 && out.figures.length > 0 &&
    out.figures.every(function (f) { return f.ok; }) &&
    out.tables.every(function (t) { return t.ok; });
  document.getElementById('verdict').textContent = JSON.stringify(out);
  document.body.setAttribute('data-verdict', out.ok ? 'ok' : 'failed');
})();
"""

_CSS = """
:root { --ink: #1d2733; --muted: #5b6b7b; --line: #d5dde5; --accent: #1f4e79; --bad: #b03a2e; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial,
  sans-serif; color: var(--ink); background: #f4f6f8; }
header { background: var(--accent); color: #fff; padding: 22px 32px 16px; }
header h1 { margin: 0 0 4px; font-size: 24px; }
header p { margin: 0; opacity: .9; }
header code { background: rgba(255,255,255,.18); color: #fff; }
nav { margin-top: 12px; display: flex; gap: 18px; flex-wrap: wrap; }
nav a { color: #fff; text-decoration: none; border-bottom: 1px solid rgba(255,255,255,.5); }
main { max-width: 1320px; margin: 0 auto; padding: 8px 24px 48px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px;
  padding: 8px 24px 20px; margin: 20px 0; }
h2 { font-size: 20px; border-bottom: 2px solid var(--accent); padding-bottom: 4px; }
h3 { font-size: 16px; margin: 22px 0 6px; }
.lead { color: var(--muted); max-width: 920px; }
figure.lifecycle svg { width: 100%; }
#fig-request svg { max-width: 900px; }
#fig-block svg { max-width: 1240px; }
.scroll { overflow-x: auto; }
figure { margin: 12px 0; padding: 10px; border: 1px solid var(--line); border-radius: 6px;
  background: #fff; overflow-x: auto; }
figure svg { display: block; max-width: 100%; height: auto; margin: 0 auto; }
figure.sequence svg { max-width: none; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 6px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 12px; width: 100%; }
th, td { border: 1px solid var(--line); padding: 4px 7px; vertical-align: top; text-align: left; }
th { background: #eef3f8; font-weight: 600; }
td.c, th.c { text-align: center; }
table.numbers { font-size: 12px; }
table.numbers td { font-variant-numeric: tabular-nums; }
table.profile td, table.matrix td { overflow-wrap: anywhere; }
ul.verdicts { columns: 2; margin: 4px 0 8px; }
table.matrix th.c { writing-mode: vertical-rl; transform: rotate(180deg); white-space: nowrap;
  padding: 6px 2px; }
.tick { color: #117a65; font-weight: bold; }
code { font: 12px ui-monospace, "DejaVu Sans Mono", Menlo, monospace; background: #f1f3f5;
  padding: 0 3px; border-radius: 3px; }
details { border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; margin: 8px 0; }
summary { cursor: pointer; font-weight: 600; }
.verdict-refuted { color: var(--bad); font-weight: 600; }
.verdict-pass { color: #117a65; font-weight: 600; }
.note { background: #fff8e1; border-left: 4px solid #e6a23c; padding: 6px 10px; }
pre.summary { white-space: pre-wrap; background: #f7f9fb; border: 1px solid var(--line);
  padding: 8px 10px; font-size: 13px; }
"""


def _figure(f: Figure) -> str:
    cls = f' class="{f.cls}"' if f.cls else ""
    return (
        f'<figure id="{f.id}" data-kind="{f.kind}" data-expect="{f.expect}"{cls}>{f.svg}'
        f"<figcaption>{html.escape(f.caption)}</figcaption></figure>"
    )


def lifecycle_figure(lc: Lifecycle) -> Figure:
    start = 1 if lc.name == lc.machine else 0  # the start point is a Graphviz node too
    return Figure(
        f"fig-{lc.name}", "graphviz", lc.svg, lc.caption, lc.states + start, cls="lifecycle"
    )


def _on(v: Verdict) -> str:
    """What tells this policy's entry apart from the same policy's other one."""
    return "" if v.slug == v.policy else f" ({v.slug.removeprefix(v.policy + '-')} grants)"


def counterexample_figure(v: Verdict) -> Figure:
    trace = v.result.get("trace", [])
    fid = f"fig-cx-{v.slug}"
    return Figure(
        fid,
        "sequence",
        sequence_svg(fid, trace, reading=dict(v.options).get("access") == "read"),
        f"kvlifetime verify --policy {v.policy} --requests {v.requests} --peers {v.peers} "
        f"--blocks {v.blocks} --faults {v.faults} --max-faults 1{v.flags}: the shortest "
        "counterexample, "
        f"{len(trace)} steps ({v.result.get('states')} states explored).",
        len(trace),
        cls="sequence",
    )


def render_page(
    *,
    version: str,
    summary: str,
    lifecycles: Sequence[Lifecycle],
    evidence: str,
    provenance: str,
    engines: Sequence[tuple[str, str, str]],
    harness: HarnessSection | None,
    verdicts: Sequence[Verdict],
) -> str:
    """The whole page as one string."""
    e = html.escape
    nav = [
        ("summary", "Summary"),
        ("lifecycles", "Lifecycles"),
        ("evidence", "Evidence"),
        ("engines", "Engines"),
        ("harness", "Harness"),
        ("counterexamples", "Counterexamples"),
    ]
    out = [
        '<!doctype html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>kvlifetime design review</title>",
        # First thing on the page: every later script error is recorded for the verdict.
        "<script>window.__kvErrors=[];window.addEventListener('error',function(ev){"
        "window.__kvErrors.push(String(ev.message||ev.type));});</script>",
        f"<style>{_CSS}</style></head><body>",
        "<header><h1>kvlifetime: KV-cache block lifetimes, design review</h1>",
        f"<p>Generated by kvlifetime {e(version)} from its specification, its verifier and "
        + (
            f"the harness results in <code>{e(harness.source)}</code>"
            if harness
            else "no harness results"
        )
        + ". Self-contained: works offline.</p>",
        "<nav>" + "".join(f'<a href="#{a}">{e(t)}</a>' for a, t in nav) + "</nav></header><main>",
    ]
    out.append(summary)
    # 1. lifecycles
    out.append('<section id="lifecycles"><h2>Lifecycles</h2>')
    out.append(
        '<p class="lead">Drawn from the compiled transition tables, so the picture cannot '
        "drift from the code. Rejection, cancel receipt, scheduling stop, transfer quiescence "
        "and release are separate transitions; each needs its own evidence. An edge that "
        "leaves a box's border leaves from every state in the box. Red dashed: "
        "<code>force_released</code>, explicit, unsafe, logged and counted, never the normal "
        "path.</p>"
    )
    if lifecycles:
        drawn = lifecycles[0].drawing
        out.append(
            f'<p id="lifecycles-drawn" data-drawing="{e(drawn.source)}">'
            f"{inline(drawn.describe())}</p>"
        )
    out += [_figure(lifecycle_figure(lc)) for lc in lifecycles]
    out.append("</section>")
    # 2. evidence
    out.append('<section id="evidence"><h2>Evidence and what it proves</h2>')
    out.append(
        '<p class="lead">Each acknowledgement proves exactly the claims ticked and nothing '
        "more. A grant is closed only by <code>access_revoked</code>, or by "
        "<code>scheduling_stopped</code> at <code>last_seq = N</code> together with "
        "<code>transfers_ended</code> through <code>N</code>.</p>"
    )
    out.append(evidence)
    out.append("<h3>Who may prove what (provenance)</h3>")
    out.append(
        '<p class="lead">Evidence from the wire is stamped with the identity of the connection '
        "it came in on. A claim from a source that may not make it is refused, logged, counted, "
        "and changes nothing.</p>"
    )
    out.append(provenance + "</section>")
    # 3. engines
    out.append('<section id="engines"><h2>Evidence profile of each engine</h2>')
    out.append(
        '<p class="lead">What every raw status and operation of a transfer engine proves, '
        "established from its source and by experiment here, and its fence (the only way out "
        "of quarantine).</p>"
    )
    for i, (name, title, body) in enumerate(engines):
        opened = " open" if i == 0 else ""
        out.append(
            f'<details id="engine-{e(name)}"{opened}><summary>{e(title)} '
            f"(<code>{e(name)}</code>)</summary>{body}</details>"
        )
    out.append("</section>")
    # 4. harness
    out.append('<section id="harness"><h2>Harness: prefill/decode disaggregation with faults</h2>')
    if harness is None:
        out.append(
            '<p class="note">No harness results: run <code>make demo</code> (or '
            "<code>kvlifetime demo --out out</code>), then <code>kvlifetime report</code>.</p>"
        )
    else:
        out.append(
            '<p class="lead">Each run drives real workers over a transfer engine with injected '
            "aborts, rejections, failures and crashes. The oracle at the transport counts every "
            "write that lands after the generation it was meant for, and every read of a block "
            "another request already owns.</p>"
        )
        if harness.note:
            out.append(f'<p class="note">{e(harness.note)}</p>')
        out.append(harness.table)
        if harness.summary:
            out.append(f'<pre class="summary">{e(harness.summary)}</pre>')
        out += [_figure(f) for f in harness.figures]
    out.append("</section>")
    # 5. counterexamples
    out.append('<section id="counterexamples"><h2>Counterexamples</h2>')
    out.append(
        '<p class="lead">The bounded verifier drives the real ledger through every '
        "interleaving of a tiny configuration. Each policy that frees on something weaker "
        "than proof is refuted with a shortest trace, drawn here as lanes.</p>"
    )
    refuted = [v for v in verdicts if v.refuted]
    for v in refuted:
        viol = v.result["violation"]
        out.append(
            f'<h3 id="cx-{e(v.slug)}">Policy <code>{e(v.policy)}</code>{e(_on(v))}: '
            f'<span class="verdict-refuted">refuted</span></h3>'
            f"<p>It {e(WHY.get(v.slug, WHY.get(v.policy, '')))}. Broken: "
            f"<strong>{e(viol['invariant'])}"
            f"</strong> ({e(viol['statement'])}).</p>"
        )
        out.append(_figure(counterexample_figure(v)))
        proof = same_shape(v, verdicts)
        if proof is not None:
            verdict = str(proof.result.get("verdict"))
            passed = verdict == "pass"
            mark = '<span class="verdict-pass">PASS</span>' if passed else e(verdict)
            out.append(
                f'<p class="beside" id="beside-{e(v.slug)}">Beside it, on the same shape '
                f"({e(proof.title)}): the proof policy, {mark}, {proof.result.get('states')} "
                + ("states, every reachable one explored.</p>" if passed else "states.</p>")
            )
    passing = [v for v in verdicts if not v.refuted]
    if passing:
        out.append("<h3>Policies that hold</h3><ul>")
        for v in passing:
            mark = (
                '<span class="verdict-pass">PASS</span>'
                if v.result.get("verdict") == "pass"
                else f"<span>{e(str(v.result.get('verdict')))}</span>"
            )
            states = f"{v.result.get('states')} states"
            if v.result.get("verdict") == "pass":
                states += ", every reachable one explored"
            out.append(f"<li><code>{e(v.policy)}</code> ({e(v.title)}): {mark}, {states}.</li>")
        out.append("</ul>")
    out.append("</section></main>")
    out.append('<pre id="verdict" hidden></pre>')
    out.append(f"<script>{_CHECK}</script></body></html>\n")
    return "\n".join(out)
