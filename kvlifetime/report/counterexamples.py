"""Each refuted policy's counterexample as a sequence diagram: lanes and arrows, in SVG.

The verifier (``kvlifetime.verify.explore``) refutes the naive, timeout, trusting and
sglang-0.5.23 release policies and the field's bug classes (first-failure, counted-completions,
id-overwrite, ordered-reaper, naive on read grants) with a shortest trace of numbered steps.
A reviewer reads who did what to whom more easily as lanes: the decode side (the owner, whose
ledger decides what goes back to the pool), each prefill peer, and the transfer engine whose
writes land in decode's memory. Only the verifier's public result is read
(``Result.to_dict()``: each step's event, label and notes), so the picture shows exactly what
``kvlifetime verify`` prints.

Proves: the drawn steps are the verifier's trace, in order, one row per step, each arrow
between the lanes its event names. Does not prove: anything the trace does not contain (a
step whose peer cannot be read from its label is drawn on the owner's lane).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any
from xml.sax.saxutils import escape

import attrs

OWNER = "owner"
ENGINE = "engine"

# The configurations the report refutes: tiny, so the whole report stays quick (each explores
# a few hundred states at most).
# Options beyond the shape, as (Config field, value) pairs: ("ranks", 2), ("reuse_ids", True).
Options = tuple[tuple[str, Any], ...]
Shape = tuple[str, str, int, int] | tuple[str, str, int, int, Options]
REFUTED: tuple[Shape, ...] = (
    # policy, faults, requests, peers[, options]
    ("naive", "none", 1, 1),
    ("timeout", "timeout", 1, 1),
    ("trusting", "lie", 1, 2),
    # SGLang 0.5.23's decode rule: the deadline passing early is the incident (a prefill
    # stalled past the 30 s deferred-release timeout).
    ("sglang-0.5.23", "timeout", 1, 1),
    # The field's bug classes (docs/verification.md): vLLM #56104, #51786, #49796.
    ("first-failure", "fail", 1, 1),
    ("counted-completions", "duplicate", 1, 1, (("ranks", 2),)),
    ("id-overwrite", "none", 2, 1, (("reuse_ids", True),)),
    # vLLM #58222 / #50789: a head-of-line reaper (a progress violation: nothing is written,
    # a request whose grants are all closed is stranded); two blocks, one per request.
    ("ordered-reaper", "none", 2, 1, (("blocks", 2),)),
    # vLLM #52360 (an asynchronous save still reading at preemption) and pre-admission
    # rejection after a read grant: naive freeing of source blocks a reader still reads.
    ("naive", "none", 1, 1, (("access", "read"),)),
)
PASSING: tuple[Shape, ...] = (
    ("proof", "none", 1, 1),
    ("proof", "timeout", 1, 1),
    ("proof", "lie", 1, 2),
    ("proof", "fail", 1, 1),
    ("proof", "duplicate", 1, 1, (("ranks", 2),)),
    ("proof", "none", 2, 1, (("reuse_ids", True),)),
    ("proof", "none", 2, 1, (("blocks", 2),)),
    ("proof", "none", 1, 1, (("access", "read"),)),
)
WHY = {
    "naive": "frees the blocks when it rejects or aborts the request (the error response read "
    "as the end of the blocks' life)",
    "timeout": "frees the blocks when a lease expires (a lease reaper force-releasing what a "
    "deadline quarantined)",
    "trusting": "waits for proof, but its receiver stamps what arrives on the wire as local: "
    "it believes a peer about anything, even that its own access was revoked",
    "proof": "frees only what the evidence proves (collect_releasable)",
    "first-failure": "frees a request's blocks as soon as one of its transfers reports "
    "FAILED (vLLM's NIXL receiver before #56104: the first handle in ERR invalidates the "
    "blocks while its sibling handles, one per remote rank, may still write)",
    "counted-completions": "counts completion notices per request and frees an ended "
    "request once it has as many as grants, whichever grant each was about (vLLM #51786: "
    "one notice twice, or on both channels)",
    "id-overwrite": "keys its transfer table by the client's request id: a new request "
    "with the id of one still held takes its entry, and the old request's blocks are freed "
    "(vLLM #49796)",
    "ordered-reaper": "releases ended requests in the order they ended and stops at the "
    "first one not yet provably over (vLLM #58222 / #50789, a head-of-line lease reaper): a "
    "request whose every grant is closed is stranded behind it, its blocks never returned",
    "naive-read": "frees a request's source blocks when it ends it, while a reader granted "
    "them may still read (vLLM #52360: an asynchronous save still reading at preemption; "
    "a decode peer that rejects after its read was granted): the read returns another "
    "request's data",
    "sglang-0.5.23": "is SGLang 0.5.23's decode: on an abort it holds the pages until every "
    "prefill rank has acknowledged the abort (a drain ACK of the request's generation) or the "
    "deferred-release deadline passes, whichever comes first (ready = drained or now >= "
    "deadline), then releases them anyway",
}

_OWNER_ACTS = frozenset({"admit", "finish", "reject", "lease", "peer_lost"})
_PEER_ACTS = frozenset({"stop", "quiesce", "complete", "silent"})
_MESSAGES = frozenset({"deliver", "duplicate", "delay", "lose"})
_TO_PEER = re.compile(r"\bto (p\d+)\b")
_FROM_PEER = re.compile(r"\bfrom (p\d+)\b")
_PEER = re.compile(r"\b(p\d+)\b")


@attrs.frozen(slots=True)
class Arrow:
    """One step as drawn: from lane to lane (equal: an action on that lane)."""

    number: int
    source: str  # lane name: "owner", "engine" or a peer ("p1")
    target: str
    label: str
    notes: tuple[str, ...]
    style: str  # "call", "message", "lost", "duplicate", "delayed", "lie", "write", "action"
    violation: bool


def _peer_lane(index: object) -> str | None:
    return f"p{index + 1}" if isinstance(index, int) and index >= 0 else None


def arrows(trace: Sequence[Mapping[str, Any]]) -> list[Arrow]:
    """The steps of ``Result.to_dict()["trace"]`` as arrows between lanes."""
    grant_peer: list[str] = []  # grant index -> its peer's lane, in the order grants were made
    out: list[Arrow] = []
    for st in trace:
        event = list(st.get("event", []))
        kind = str(event[0]) if event else "?"
        a = event[1] if len(event) > 1 else -1
        b = event[2] if len(event) > 2 else -1
        label = str(st.get("label", kind))
        notes = tuple(str(n) for n in st.get("notes", ()))
        violation = any(n.startswith("VIOLATION") for n in notes)
        number = int(st.get("step", len(out) + 1))
        grant_lane = grant_peer[a] if isinstance(a, int) and 0 <= a < len(grant_peer) else None
        mentioned = _PEER.search(label)
        fallback = mentioned.group(1) if mentioned else OWNER
        src, dst, style = OWNER, OWNER, "action"
        if kind == "grant":
            peer = _peer_lane(b) or fallback
            grant_peer.append(peer)
            src, dst, style = OWNER, peer, "call"
        elif kind in _MESSAGES:
            to, frm = _TO_PEER.search(label), _FROM_PEER.search(label)
            if to:
                src, dst = OWNER, to.group(1)
            elif frm:
                src, dst = frm.group(1), OWNER
            style = {"deliver": "message", "lose": "lost", "duplicate": "duplicate"}.get(
                kind, "delayed"
            )
        elif kind in ("post", "retry"):
            src, dst, style = grant_lane or fallback, ENGINE, "call"
        elif kind == "land":
            src, dst, style = ENGINE, OWNER, "write"  # the bytes land in decode's memory
        elif kind == "fail":
            src, dst, style = ENGINE, grant_lane or fallback, "message"
        elif kind in _PEER_ACTS:
            src = dst = grant_lane or fallback
        elif kind == "fence":
            src, dst, style = OWNER, _peer_lane(a) or fallback, "call"
        elif kind == "lie":
            src, dst, style = fallback, OWNER, "lie"
        elif kind not in _OWNER_ACTS:
            src = dst = OWNER
        out.append(Arrow(number, src, dst, label, notes, style, violation))
    return out


def lanes(steps: Sequence[Arrow]) -> list[str]:
    """Owner first, then the peers in number order, then the engine (when it appears)."""
    peers = sorted(
        {x for s in steps for x in (s.source, s.target) if x not in (OWNER, ENGINE)},
        key=lambda p: int(p[1:]) if p[1:].isdigit() else 0,
    )
    used_engine = any(ENGINE in (s.source, s.target) for s in steps)
    return [OWNER, *peers, *([ENGINE] if used_engine else [])]


LANE_TITLES = {OWNER: ("decode", "owner + ledger"), ENGINE: ("transfer engine", "writes KV")}
# Read grants (pull, an asynchronous save): the owner's blocks are the source, the peer reads.
READ_LANE_TITLES = {OWNER: ("source", "owner + ledger"), ENGINE: ("transfer engine", "reads KV")}


def _lane_title(lane: str, reading: bool = False) -> tuple[str, str]:
    if reading:
        return READ_LANE_TITLES.get(lane, (f"reader {lane}", "peer"))
    return LANE_TITLES.get(lane, (f"prefill {lane}", "peer"))


def _wrap(text: str, width: int) -> list[str]:
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return [*lines, cur] if cur else lines


_STROKE = {
    "call": ("#1f4e79", ""),
    "message": ("#1f4e79", "6 3"),
    "duplicate": ("#7a4ea3", "6 3"),
    "delayed": ("#7a4ea3", "2 3"),
    "lost": ("#b03a2e", "6 3"),
    "lie": ("#d35400", "4 2"),
    "write": ("#117a65", ""),
}


CHAR_PX = 6.0  # the width of one character of an 11 px label (Helvetica averages ~5.8)
LINE_PX = 13  # a label's line height


def _label_room(s: Arrow, x: Mapping[str, int], lane_w: int) -> tuple[int, int]:
    """Where a message's label is centred, and how many characters fit on a line: the gap
    between its source's lane and the next lane toward the target (an arrow that crosses a
    lane keeps its label clear of that lane's line)."""
    x1, x2 = x[s.source], x[s.target]
    sign = 1 if x2 > x1 else -1
    span = min(abs(x2 - x1), lane_w) // (2 if s.style == "lost" else 1)
    return x1 + sign * span // 2, max(8, int((span - 16) / CHAR_PX))


def _label_lines(s: Arrow, x: Mapping[str, int], lane_w: int) -> list[str]:
    """A message's label wrapped to its room (``_label_room``); an action's on its pill."""
    if s.source == s.target:
        return [s.label[:30]]
    return _wrap(s.label, _label_room(s, x, lane_w)[1])


def sequence_svg(
    figure_id: str, trace: Sequence[Mapping[str, Any]], *, reading: bool = False
) -> str:
    """The trace as an SVG sequence diagram (ids prefixed with ``figure_id``).

    A message's label is wrapped to fit between the two lanes it joins and sits above its
    arrow; an action's pill interrupts its lane's line: no label lies on a lifeline.
    """
    steps = arrows(trace)
    names = lanes(steps)
    lane_w, left, top, notes_w = 180, 46, 64, 430
    x = {n: left + lane_w * i + lane_w // 2 for i, n in enumerate(names)}
    notes_x = left + lane_w * len(names) + 16
    width = notes_x + notes_w
    # step, its notes' lines, its label's lines, y, height, the arrow's y
    rows: list[tuple[Arrow, list[tuple[str, str]], list[str], int, int, int]] = []
    y = top + 20
    for s in steps:
        # each wrapped line keeps the colour of its note (a violation is red to its end)
        lines = [(ln, n) for n in s.notes for ln in _wrap(n, 66)] or [("", "")]
        label = _label_lines(s, x, lane_w)
        above = 0 if s.source == s.target else LINE_PX * (len(label) - 1)
        h = max(40 + above, 15 * len(lines) + 12)
        rows.append((s, lines, label, y, h, y + 22 + above))
        y += h
    height = y + 12
    mk = f"{figure_id}-arrow"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" class="sequence" role="img" '
        f'font-family="Helvetica, Arial, sans-serif">',
        "<defs>",
    ]
    for style, (colour, _) in _STROKE.items():
        parts.append(
            f'<marker id="{mk}-{style}" viewBox="0 0 10 10" refX="9" refY="5" '
            f'markerWidth="8" markerHeight="8" orient="auto-start-reverse">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
        )
    parts.append("</defs>")
    # the bands first: the lanes' lines run over them, the arrows over both
    for s, _, _, y0, h, _ in rows:
        band = "#fdecea" if s.violation else ("#f7f9fb" if s.number % 2 else "#ffffff")
        parts.append(
            f'<rect class="band" x="4" y="{y0 - 4}" width="{width - 8}" height="{h - 2}" '
            f'fill="{band}"/>'
        )
    for n in names:
        title, sub = _lane_title(n, reading)
        # the lane's line, broken where an action's pill sits on it
        pills = sorted(
            (mid - 13, mid + 13) for s, _, _, _, _, mid in rows if s.source == n == s.target
        )
        segments, start = [], 48
        for lo, hi in pills:
            segments.append((start, lo))
            start = hi
        segments.append((start, height - 6))
        line = "".join(
            f'<line class="lifeline" x1="{x[n]}" y1="{a}" x2="{x[n]}" y2="{b}" '
            f'stroke="#9aa9b8" stroke-dasharray="4 4"/>'
            for a, b in segments
            if b > a
        )
        parts.append(
            f'<g class="lane" data-lane="{escape(n)}">'
            f'<rect x="{x[n] - 72}" y="8" width="144" height="40" rx="6" fill="#eef3f8" '
            f'stroke="#1f4e79"/>'
            f'<text x="{x[n]}" y="25" text-anchor="middle" font-size="13" '
            f'font-weight="bold">{escape(title)}</text>'
            f'<text x="{x[n]}" y="41" text-anchor="middle" font-size="11" '
            f'fill="#555">{escape(sub)}</text>{line}</g>'
        )
    parts.append(
        f'<text x="{notes_x}" y="{top - 4}" font-size="12" font-weight="bold" '
        f'fill="#333">what the step did</text>'
    )
    for s, lines, label, y0, _, mid in rows:
        parts.append(
            f'<g class="step" data-step="{s.number}" data-from="{escape(s.source)}" '
            f'data-to="{escape(s.target)}" data-style="{s.style}">'
        )
        parts.append(
            f'<text x="20" y="{y0 + 16}" font-size="12" font-weight="bold" '
            f'fill="#333" text-anchor="middle">{s.number}</text>'
        )
        if s.source == s.target:
            colour = "#b03a2e" if s.violation else "#1f4e79"
            cx = x[s.source]
            parts.append(
                f'<rect x="{cx - 78}" y="{mid - 11}" width="156" height="22" rx="11" '
                f'fill="#ffffff" stroke="{colour}"/>'
                f'<text x="{cx}" y="{mid + 4}" text-anchor="middle" font-size="11" '
                f'fill="{colour}">{escape(label[0])}</text>'
            )
        else:
            colour, dash = _STROKE[s.style]
            x1, x2 = x[s.source], x[s.target]
            if s.style == "lost":  # a lost message stops half way, crossed out
                x2 = (x1 + x2) // 2
            sign = 1 if x2 > x1 else -1
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            end = "" if s.style == "lost" else f' marker-end="url(#{mk}-{s.style})"'
            parts.append(
                f'<line x1="{x1 + 4 * sign}" y1="{mid + 6}" x2="{x2 - 4 * sign}" '
                f'y2="{mid + 6}" stroke="{colour}" stroke-width="{2.2 if s.violation else 1.6}"'
                f"{dash_attr}{end}/>"
            )
            if s.style == "lost":
                parts.append(
                    f'<path d="M{x2 - 6},{mid} l12,12 m0,-12 l-12,12" stroke="{colour}" '
                    f'stroke-width="2"/>'
                )
            tx = _label_room(s, x, lane_w)[0]
            fill = "#b03a2e" if s.violation else colour
            for i, ln in enumerate(label):
                parts.append(
                    f'<text x="{tx}" y="{mid - LINE_PX * (len(label) - 1 - i)}" '
                    f'text-anchor="middle" font-size="11" fill="{fill}">{escape(ln)}</text>'
                )
        for i, (ln, note) in enumerate(lines):
            bad = note.startswith("VIOLATION")
            pooled = "to the pool" in note
            fill = "#b03a2e" if bad else ("#a04000" if pooled else "#333")
            weight = ' font-weight="bold"' if bad or pooled else ""
            parts.append(
                f'<text x="{notes_x}" y="{y0 + 12 + 15 * i}" font-size="11" '
                f'fill="{fill}"{weight}>{escape(ln)}</text>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def same_shape(refuted: Verdict, verdicts: Sequence[Verdict]) -> Verdict | None:
    """The proof policy's verdict on ``refuted``'s configuration, if it was explored."""
    for v in verdicts:
        if v.policy == "proof" and (v.faults, v.requests, v.peers, v.options) == (
            refuted.faults,
            refuted.requests,
            refuted.peers,
            refuted.options,
        ):
            return v
    return None


@attrs.frozen(slots=True)
class Verdict:
    """One policy explored on one configuration, as the report shows it."""

    policy: str
    faults: str
    requests: int
    peers: int
    result: Mapping[str, Any]  # Result.to_dict()
    options: Options = ()  # beyond the shape: ("ranks", 2), ("reuse_ids", True)

    @property
    def refuted(self) -> bool:
        return self.result.get("violation") is not None

    @property
    def slug(self) -> str:
        """The policy, told apart from the same policy on another access (``naive-read``):
        the figure's id and what the page calls it."""
        access = dict(self.options).get("access")
        return self.policy if access in (None, "write") else f"{self.policy}-{access}"

    @property
    def blocks(self) -> int:
        return int(dict(self.options).get("blocks", 1))

    @property
    def title(self) -> str:
        """The configuration, in words."""
        extra = "".join(f", {_OPTION_WORDS[k](v)}" for k, v in self.options if k in _OPTION_WORDS)
        plural = "block" if self.blocks == 1 else "blocks"
        return (
            f"{self.requests} request x {self.peers} peer(s) x {self.blocks} {plural}, "
            f"faults: {self.faults}" + extra
        )

    @property
    def flags(self) -> str:
        """The options as ``kvlifetime verify`` takes them (beyond --blocks)."""
        return "".join(f" {_OPTION_FLAGS[k](v)}" for k, v in self.options if k in _OPTION_FLAGS)


_OPTION_WORDS: dict[str, Any] = {
    "ranks": lambda v: f"{v} ranks",
    "reuse_ids": lambda v: "reused request ids",
    "access": lambda v: f"{v} grants",
}
_OPTION_FLAGS: dict[str, Any] = {
    "ranks": lambda v: f"--ranks {v}",
    "reuse_ids": lambda v: "--reuse-ids",
    "access": lambda v: f"--access {v}",
}


def explore_policies(configs: Sequence[Shape] = REFUTED + PASSING) -> list[Verdict]:
    """Run the verifier on each (policy, faults, requests, peers[, options]), one block, at
    most one fault event per run (a few hundred states each: about a second in all)."""
    from kvlifetime.grant import Access
    from kvlifetime.verify import Config, Policy, explore, parse_faults

    out = []
    for policy, faults, requests, peers, *more in configs:
        options: Options = more[0] if more else ()
        fields = dict(options)
        if "access" in fields:
            fields["access"] = Access(fields["access"])
        cfg = Config(
            requests=requests,
            peers=peers,
            blocks=fields.pop("blocks", 1),
            faults=parse_faults(faults),
            max_faults=1,
            **fields,
        )
        result = explore(cfg, Policy(policy))
        out.append(Verdict(policy, faults, requests, peers, result.to_dict(), options))
    return out
