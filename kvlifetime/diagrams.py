"""Diagrams of the two lifecycles, drawn from the compiled transition tables.

Nothing here is drawn by hand: every edge comes from a ``Row`` of
``kvlifetime.spec.table.request_table()`` / ``block_table()``, which are compiled from the
python-statemachine classes in ``kvlifetime.spec.lifecycles``. A review picture therefore cannot
drift from the code, and ``tests`` pin the generated ``docs/`` byte for byte. The other
generated pages (the evidence table, the engines' profiles, the set ``kvlifetime docs`` writes)
are ``kvlifetime.pages``.

Formats:

- ``mermaid``: ``stateDiagram-v2`` text (renders on GitHub); edges labelled ``event [guard]``,
  unsafe edges labelled with ``⚠`` and explained in a note, final states lead to ``[*]``;
- ``dot``: Graphviz source laid out for a slide (``layout``): top to bottom, self-loops listed
  on their node, edges that leave several states on the same event drawn once from a box
  around them; unsafe edges dashed and red;
- ``svg``: ``dot -Tsvg`` run on the ``dot`` source (needs the Graphviz binary);
- ``md``: a markdown page with the mermaid block and the transition table.

Every output is deterministic: rows are in specification order, nothing iterates over a set or a
hash-ordered mapping, and line endings are always ``\\n``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

import attrs

from kvlifetime.errors import EnvironmentFault
from kvlifetime.spec.table import Row, TransitionTable, table_for

MACHINES: tuple[str, ...] = ("request", "block", "engine")
DIAGRAM_FORMATS: tuple[str, ...] = ("mermaid", "dot", "svg", "md")
UNSAFE_MARK = "⚠"

GRAPHVIZ_HINT = (
    "install the Debian package `graphviz` (apt-get install graphviz), "
    "or use --format mermaid / dot, which need nothing"
)


class DiagramError(EnvironmentFault):
    """A diagram could not be produced.
    Whose fault: the environment (a missing or failing Graphviz), never the specification.
    Nothing was written."""

    kind = "diagram"


class GraphvizNotFound(DiagramError):
    """Graphviz's ``dot`` is not on ``PATH`` (SVG output needs it)."""

    kind = "graphviz_not_found"

    def __init__(self) -> None:
        super().__init__(f"Graphviz `dot` was not found on PATH: {GRAPHVIZ_HINT}")


class GraphvizFailed(DiagramError):
    """``dot`` ran but failed (a broken install, or a bug in the source)."""

    kind = "graphviz_failed"


# --------------------------------------------------------------------------- labels


def edge_label(row: Row) -> str:
    """``event [guard]``; unsafe transitions carry a warning sign and the word."""
    text = row.event + (f" [{row.guard}]" if row.guard else "")
    return f"{UNSAFE_MARK} {text} UNSAFE" if row.unsafe else text


LABEL_PAD = "  "  # Graphviz keeps this much of the label's room between its text and its edge


def dot_label(row: Row, *more: str) -> str:
    """An edge's Graphviz label (quoted): ``edge_label`` padded so the edge never touches its
    text, then each of ``more`` on a line of its own."""
    lines = [_q(f"{LABEL_PAD}{line}{LABEL_PAD}")[1:-1] for line in (edge_label(row), *more)]
    return '"' + "\\n".join(lines) + '"'


def _header(machine: str, fmt: str) -> str:
    return (
        "Generated from kvlifetime.spec.lifecycles by "
        f"`kvlifetime diagram {machine} --format {fmt}`. Do not edit."
    )


def _unsafe_note(table: TransitionTable) -> tuple[str, str] | None:
    """Where to pin the legend for unsafe edges, and what it says (``None``: no unsafe edge)."""
    unsafe = [r for r in table.rows if r.unsafe]
    if not unsafe:
        return None
    events = sorted({r.event for r in unsafe})  # sorted: a set has no stable order
    text = (
        f"{UNSAFE_MARK} {', '.join(events)}: unsafe, explicit, logged and counted. "
        "Releases while a grant may still be open; never the normal path."
    )
    return unsafe[0].target, text


# --------------------------------------------------------------------------- mermaid


def mermaid(table: TransitionTable) -> str:
    """The lifecycle as a mermaid ``stateDiagram-v2``."""
    lines = [
        f"%% {table.machine} lifecycle. {_header(table.machine, 'mermaid')}",
        "stateDiagram-v2",
        f"    [*] --> {table.initial}",
    ]
    for r in table.rows:
        # mermaid ends a label at the first ':'; our names never contain one.
        lines.append(f"    {r.source} --> {r.target} : {edge_label(r)}")
    lines.extend(f"    {s} --> [*]" for s in table.finals)
    note = _unsafe_note(table)
    if note is not None:
        state, text = note
        lines += [f"    note right of {state}", f"        {text}", "    end note"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- graphviz


def _q(text: str) -> str:
    """A Graphviz double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# Edges that share (event, target, guard) from this many sources or more are drawn once, from a
# box around the sources; unsafe ones from two sources on (they are what a reviewer must see
# once, not five times). Self-loops are listed on their node instead of drawn: their labels
# would sit on the loop lines.
FOLD_MIN_SAFE = 4
FOLD_MIN_UNSAFE = 2
LOOP_MARK = "↺"


@attrs.frozen(slots=True)
class Fold:
    """Rows drawn as one edge from a box (a Graphviz cluster) around their sources."""

    rows: tuple[Row, ...]  # spec order; same event, target, guard and safety
    sources: frozenset[str]

    @property
    def row(self) -> Row:
        return self.rows[0]


@attrs.frozen(slots=True)
class Layout:
    """What the review picture draws, computed from the table alone.

    Invariant: every row of the table is drawn exactly once, as an edge (``edges``), as a part
    of one folded edge (``folds``), or as a line on its node (``loops``).
    """

    edges: tuple[Row, ...]
    folds: tuple[Fold, ...]  # largest first; their source sets nest or are disjoint
    loops: Mapping[str, tuple[Row, ...]]  # state -> its self-loops, spec order
    parent: Mapping[int, int | None]  # fold index -> index of the smallest fold around it


def _laminar(a: frozenset[str], b: frozenset[str]) -> bool:
    return a.isdisjoint(b) or a <= b or b <= a


def layout(table: TransitionTable, rows: Sequence[Row] | None = None) -> Layout:
    """Fold the table (or only ``rows`` of it, one picture's) for a picture: self-loops onto
    their nodes, shared edges into boxes."""
    rows = table.rows if rows is None else tuple(rows)
    loops: dict[str, list[Row]] = {}
    groups: dict[tuple[str, str, str | None, bool], list[Row]] = {}
    for r in rows:
        if r.source == r.target:
            loops.setdefault(r.source, []).append(r)
        else:
            groups.setdefault((r.event, r.target, r.guard, r.unsafe), []).append(r)
    candidates = [
        Fold(tuple(rows), frozenset(r.source for r in rows))
        for (_, target, _, unsafe), rows in groups.items()
        if len(rows) >= (FOLD_MIN_UNSAFE if unsafe else FOLD_MIN_SAFE)
        and target not in {r.source for r in rows}
    ]
    # Largest first (stable: spec order among equals); a box that would cut across another
    # cannot be drawn, so its edges stay single.
    candidates.sort(key=lambda f: -len(f.sources))
    folds: list[Fold] = []
    for f in candidates:
        if all(_laminar(f.sources, g.sources) and f.sources != g.sources for g in folds):
            folds.append(f)
    folded = {r for f in folds for r in f.rows}
    edges = tuple(r for r in rows if r.source != r.target and r not in folded)
    parent: dict[int, int | None] = {}
    for i, f in enumerate(folds):
        around = [j for j, g in enumerate(folds) if j != i and f.sources < g.sources]
        parent[i] = min(around, key=lambda j: len(folds[j].sources)) if around else None
    return Layout(edges, tuple(folds), {k: tuple(v) for k, v in loops.items()}, parent)


@attrs.frozen(slots=True)
class Picture:
    """One review picture of a lifecycle: the rows it draws, under its own title.

    Invariant: the pictures of a table (``pictures``) draw each of its rows exactly once.
    """

    name: str  # the figure's name: the machine's, or the machine's and a part's
    title: str
    rows: tuple[Row, ...]  # spec order

    def states(self, table: TransitionTable) -> tuple[str, ...]:
        """The states this picture draws, in the table's order (every state, for a picture
        of the whole table)."""
        seen = {s for r in self.rows for s in (r.source, r.target)}
        if self.rows == table.rows:
            seen |= set(table.states)
        return tuple(s for s in table.states if s in seen)


# Drawn apart from the rest of its machine: sharing (a prefix-cache hit taking a settled block)
# enters four states and crossed every other edge of the block lifecycle when drawn with them.
APART: Mapping[str, tuple[tuple[str, str, frozenset[str]], ...]] = {
    "block": (
        (
            "sharing",
            "block lifecycle: sharing (a prefix-cache hit takes a settled block)",
            frozenset({"shared"}),
        ),
    ),
    "engine": (
        (
            "reads",
            "engine side: a peer reads the blocks; proof, refusal, a lease, a fence",
            frozenset({"read_granted", "grant_refused", "reads_done", "lease_expired", "fenced"}),
        ),
        (
            "load",
            "engine side: an asynchronous load, landed or failed",
            frozenset({"load_granted", "load_landed", "load_failed"}),
        ),
    ),
}


# The title of the main picture of a lifecycle drawn in parts (``APART``).
MAIN_PART: Mapping[str, str] = {
    "block": "block lifecycle: holders and grants",
    "engine": "engine side of a request: its end, and what the engine is told",
}


def pictures(table: TransitionTable) -> tuple[Picture, ...]:
    """The review pictures of ``table``: the whole lifecycle, or (the block) its life under
    its holders and grants, and apart from it its sharing (``APART``)."""
    apart = APART.get(table.machine, ())
    if not apart:
        title = f"{table.machine} lifecycle ({LOOP_MARK}: an event that keeps the state)"
        return (Picture(table.machine, title, table.rows),)
    taken = frozenset().union(*(events for _, _, events in apart))
    main = tuple(r for r in table.rows if r.event not in taken)
    out = [
        Picture(
            table.machine,
            f"{MAIN_PART[table.machine]} ({LOOP_MARK}: an event that keeps the state)",
            main,
        )
    ]
    for part, title, events in apart:
        rows = tuple(r for r in table.rows if r.event in events)
        out.append(Picture(f"{table.machine}-{part}", title, rows))
    return tuple(out)


def back_edges(
    table: TransitionTable, rows: Sequence[Row] | None = None
) -> frozenset[tuple[str, str]]:
    """The (source, target) pairs that close a cycle, found depth first from the initial
    state (then from each state not reached yet) in specification order, over ``rows`` (one
    picture's; default every row). Drawn without pulling their target's rank, so that the
    main flow reads top to bottom and the returns (a block going back to the pool) go up."""
    out: dict[str, list[str]] = {}
    for r in table.rows if rows is None else rows:
        if r.source != r.target:
            out.setdefault(r.source, []).append(r.target)
    back: set[tuple[str, str]] = set()
    done: set[str] = set()
    on_path: list[str] = []

    def visit(s: str) -> None:
        on_path.append(s)
        for t in out.get(s, []):
            if t in on_path:
                back.add((s, t))
            elif t not in done:
                visit(t)
        on_path.pop()
        done.add(s)

    for s in (table.initial, *table.states):  # a few states: the recursion stays shallow
        if s not in done:
            visit(s)
    return frozenset(back)


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _node_label(state: str, loops: tuple[Row, ...]) -> str:
    """The state's name, then one line per self-loop (an HTML-like Graphviz label: a table,
    so that each line gets its own row and the lines never touch)."""
    if not loops:
        return _q(state)
    cells = [f'<tr><td align="left"><b>{_html(state)}</b></td></tr>']
    for r in loops:
        text = _html(f"{LOOP_MARK} {edge_label(r)}")
        colour = ' color="red"' if r.unsafe else ""
        cells.append(f'<tr><td align="left"><font point-size="10"{colour}>{text}</font></td></tr>')
    return (
        '<<table border="0" cellborder="0" cellspacing="0" cellpadding="1">'
        + "".join(cells)
        + "</table>>"
    )


def dot(table: TransitionTable, picture: Picture | None = None) -> str:
    """The lifecycle (or one ``picture`` of it) as Graphviz source, laid out for a slide (see
    ``layout``).

    Unsafe edges are dashed and red. Self-loops are lines on their node (marked ``↺``); edges
    that leave several states for the same target on the same event and guard are drawn once,
    from a box around those states (the edge's own label names the event; the box has none, so
    no edge entering it crosses a caption). Every row is still drawn once: the mermaid diagram
    and the markdown table keep one line per row.
    """
    name = table.machine
    if picture is None:
        title = f"{name} lifecycle ({LOOP_MARK}: an event that keeps the state)"
        picture = Picture(name, title, table.rows)
    lay = layout(table, picture.rows)
    states = picture.states(table)
    # Top to bottom keeps the long request chain from running off a slide's width.
    lines = [
        f"// {name} lifecycle. {_header(name, 'dot')}",
        f"digraph {_q(picture.name)} {{",
        "    rankdir=TB;",
        "    compound=true;",
        "    nodesep=0.35;",
        "    ranksep=0.45;",
        f"    label={_q(picture.title)};",
        "    labelloc=t;",
        '    fontname="Helvetica";',
        '    node [shape=box, style=rounded, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
    ]
    if table.initial in states:
        lines.append('    "__start__" [shape=point, label=""];')
    home: dict[str, int | None] = {}  # state -> the smallest fold around it
    for s in states:
        around = [i for i, f in enumerate(lay.folds) if s in f.sources]
        home[s] = min(around, key=lambda i: len(lay.folds[i].sources)) if around else None

    def node(s: str, indent: str) -> str:
        extra = ", peripheries=2" if s in table.finals else ""
        return f"{indent}{_q(s)} [label={_node_label(s, lay.loops.get(s, ()))}{extra}];"

    def cluster(i: int, indent: str) -> list[str]:
        f = lay.folds[i]
        style = (
            ['style="dashed,rounded"', "color=red", "fontcolor=red"]
            if f.row.unsafe
            else ['style="rounded"', "color=gray50", "fontcolor=gray30"]
        )
        out = [f"{indent}subgraph cluster_{i} {{"]
        out += [f"{indent}    {a};" for a in style]
        out.append(f'{indent}    label="";')  # not the graph's title again
        for j in range(len(lay.folds)):
            if lay.parent[j] == i:
                out += cluster(j, indent + "    ")
        out += [node(s, indent + "    ") for s in states if home[s] == i]
        out.append(f"{indent}}}")
        return out

    for i in range(len(lay.folds)):
        if lay.parent[i] is None:
            lines += cluster(i, "    ")
    lines += [node(s, "    ") for s in states if home[s] is None]
    if table.initial in states:
        lines.append(f'    "__start__" -> {_q(table.initial)};')

    back = back_edges(table, picture.rows)

    def edge(src: str, r: Row, extra: list[str], label: str | None = None) -> str:
        attrs_ = [f"label={dot_label(r) if label is None else label}", *extra]
        if (r.source, r.target) in back:
            attrs_.append("constraint=false")
            if not extra:  # a return leaves from the east side: its label then clears the
                attrs_.append("tailport=e")  # edges that skip a rank down that side
        if r.unsafe:
            attrs_ += ["style=dashed", "color=red", "fontcolor=red"]
        return f"    {_q(src)} -> {_q(r.target)} [{', '.join(attrs_)}];"

    for r in lay.edges:
        lines.append(edge(r.source, r, []))
    for i, f in enumerate(lay.folds):
        # Graphviz draws an edge from a box as an edge from one of its nodes, cut at the
        # box's border (ltail); the last source in spec order is as good as any.
        lines.append(edge(f.rows[-1].source, f.row, [f"ltail=cluster_{i}"]))
    lines.append("}")
    return "\n".join(lines) + "\n"


def svg(table: TransitionTable, picture: Picture | None = None) -> str:
    """The ``dot`` diagram rendered by Graphviz. Raises ``GraphvizNotFound`` without ``dot``."""
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizNotFound()
    try:
        done = subprocess.run(
            [exe, "-Tsvg"],
            input=dot(table, picture).encode("utf-8"),
            capture_output=True,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise GraphvizFailed(f"running {exe} -Tsvg failed: {e}") from e
    if done.returncode != 0:
        err = " ".join(done.stderr.decode("utf-8", "replace").split())
        raise GraphvizFailed(f"{exe} -Tsvg exited with {done.returncode}: {err}")
    return done.stdout.decode("utf-8")


def graphviz_available() -> bool:
    return shutil.which("dot") is not None


# --------------------------------------------------------------------------- markdown


def _demote(markdown: str) -> str:
    """Push every heading one level down, to nest a generated page inside another."""
    return "\n".join("#" + ln if ln.startswith("#") else ln for ln in markdown.split("\n"))


def markdown(table: TransitionTable) -> str:
    """A page: the mermaid diagram, then the whole transition table."""
    name = table.machine
    parts = [
        f"# {name} lifecycle",
        "",
        _header(name, "md"),
        "",
        "```mermaid",
        mermaid(table).rstrip("\n"),
        "```",
        "",
    ]
    note = _unsafe_note(table)
    if note is not None:
        parts += [note[1], ""]
    # The review pictures (Graphviz, written beside this page by `kvlifetime docs`).
    parts += [f"![{pic.title}]({pic.name}.svg)" for pic in pictures(table)] + [""]
    parts.append(_demote(table.to_markdown()).rstrip("\n"))
    return "\n".join(parts) + "\n"


RENDERERS: Mapping[str, Callable[[TransitionTable], str]] = {
    "mermaid": mermaid,
    "dot": dot,
    "svg": svg,
    "md": markdown,
}


def render(machine: str, fmt: str) -> str:
    """``machine`` (request, block) drawn in ``fmt`` (mermaid, dot, svg, md)."""
    renderer = RENDERERS.get(fmt)
    if renderer is None:
        raise ValueError(f"unknown diagram format {fmt!r} ({', '.join(DIAGRAM_FORMATS)})")
    return renderer(table_for(machine))
