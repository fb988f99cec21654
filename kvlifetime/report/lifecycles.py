"""The lifecycles as pictures for the page: Graphviz SVG of the folded layout
(``kvlifetime.diagrams.layout``), inlined, with a caption saying what was folded. The block
lifecycle is two pictures (``kvlifetime.diagrams.pictures``): its life under holders and grants,
and its sharing apart.

Where they come from (``Drawing``): drawn now by the ``dot`` on ``PATH``, or, without one, the
SVGs shipped in the package (``kvlifetime.report.shipped``), each checked to have been drawn
from the DOT source the specification generates now. Every picture of a page comes from one of
the two, and the page says which.

Proves: the pictures are drawn from the compiled transition tables, every row once (an edge,
part of one edge from a box, or a line on its node) in exactly one picture. Does not prove:
anything about a run.
"""

from __future__ import annotations

import re

import attrs

from kvlifetime.diagrams import LOOP_MARK, Picture, graphviz_available, layout, pictures, svg
from kvlifetime.report.shipped import graphviz_version, load
from kvlifetime.spec.table import TransitionTable, table_for

_ID = re.compile(r'\bid="([^"]*)"')

GRAPHVIZ = "graphviz"  # drawn now by the `dot` on PATH
SHIPPED = "shipped"  # the SVGs shipped in the package (kvlifetime.report.shipped)
DRAWINGS: tuple[str, ...] = (GRAPHVIZ, SHIPPED)


@attrs.frozen(slots=True)
class Drawing:
    """Where a page's lifecycle pictures come from, and the Graphviz version that drew them."""

    source: str  # GRAPHVIZ or SHIPPED
    graphviz: str = ""  # e.g. "2.43.0 (0)"; "" until a picture is drawn

    def describe(self) -> str:
        """One sentence for the page and the command's note."""
        version = f"Graphviz {self.graphviz.split()[0]}" if self.graphviz else "Graphviz"
        if self.source == GRAPHVIZ:
            return f"Drawn for this page by {version} (`dot` on this machine)."
        return (
            "Graphviz's `dot` is not installed here: these are the pictures shipped with "
            f"kvlifetime, drawn by {version} from the same DOT source this specification "
            "generates (checked identical before use)."
        )


def choose_drawing(source: str | None = None) -> Drawing:
    """``source`` (``GRAPHVIZ`` or ``SHIPPED``), or by default ``GRAPHVIZ`` where ``dot`` is on
    ``PATH`` and ``SHIPPED`` where it is not."""
    if source is None:
        source = GRAPHVIZ if graphviz_available() else SHIPPED
    if source not in DRAWINGS:
        raise ValueError(f"unknown drawing {source!r} ({', '.join(DRAWINGS)})")
    return Drawing(source)


@attrs.frozen(slots=True)
class Lifecycle:
    machine: str
    name: str  # the picture's: the machine's, or e.g. "block-sharing"
    svg: str  # inline <svg> element, ids prefixed with the picture's name
    states: int  # drawn in this picture
    rows: int  # drawn in this picture
    caption: str
    width_pt: float
    height_pt: float
    drawing: Drawing  # where the SVG came from


def _svg(table: TransitionTable, pic: Picture, source: str) -> str:
    return svg(table, pic) if source == GRAPHVIZ else load(table, pic).svg


def _size(svg_text: str) -> tuple[float, float]:
    m = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg_text)
    if m is None:
        return 0.0, 0.0
    return float(m.group(1)), float(m.group(2))


def _picture(table: TransitionTable, pic: Picture, apart: int, source: str) -> Lifecycle:
    text = _svg(table, pic, source)
    drawing = Drawing(source, graphviz_version(text))
    text = text[text.index("<svg") :]
    text = _ID.sub(lambda m: f'id="{pic.name}-{m.group(1)}"', text)
    lay = layout(table, pic.rows)
    loops = sum(len(v) for v in lay.loops.values())
    states = pic.states(table)
    whole = len(pic.rows) == len(table.rows)
    parts = [
        f"{len(states)} states, {len(pic.rows)} transitions"
        + (
            ", each drawn once."
            if whole
            else f" of {len(table.rows)}, each drawn once; the other "
            f"{len(table.rows) - len(pic.rows)} are in the "
            + ("next picture." if apart else "picture before.")
        )
    ]
    if loops:
        parts.append(
            f"{loops} that keep the state are listed under it ({LOOP_MARK}) instead of drawn "
            "as loops."
        )
    for f in lay.folds:
        kind = "unsafe, " if f.row.unsafe else ""
        parts.append(
            f"{f.row.event} ({kind}{len(f.rows)} transitions, one from each state in its box) "
            f"is drawn once, from the box."
        )
    if any(r.unsafe for r in pic.rows):
        parts.append(
            "Red dashed: force_released, explicit, unsafe, logged and counted, never the "
            "normal path."
        )
    w, h = _size(text)
    return Lifecycle(
        table.machine, pic.name, text, len(states), len(pic.rows), " ".join(parts), w, h, drawing
    )


def lifecycle(machine: str, source: str | None = None) -> list[Lifecycle]:
    """``machine``'s pictures (one, or the block's two), from ``source`` (``choose_drawing``).
    Drawn now: raises ``GraphvizNotFound`` / ``GraphvizFailed`` without a working ``dot``;
    shipped: ``DiagramError`` if one is missing or does not match the specification."""
    drawing = choose_drawing(source)
    table = table_for(machine)
    pics = pictures(table)
    return [_picture(table, p, len(pics) - 1 - i, drawing.source) for i, p in enumerate(pics)]
