"""The request and block lifecycles as pictures for the page: Graphviz SVG of the folded
layout (``kvlifetime.diagrams.layout``), inlined, with a caption saying what was folded.

Proves: the picture is drawn from the compiled transition tables, every row once (an edge,
part of one edge from a box, or a line on its node). Does not prove: anything about a run.
"""

from __future__ import annotations

import re

import attrs

from kvlifetime.diagrams import LOOP_MARK, layout, svg
from kvlifetime.spec.table import table_for

_ID = re.compile(r'\bid="([^"]*)"')


@attrs.frozen(slots=True)
class Lifecycle:
    machine: str
    svg: str  # inline <svg> element, ids prefixed with the machine
    states: int
    rows: int
    caption: str
    width_pt: float
    height_pt: float


def _size(svg_text: str) -> tuple[float, float]:
    m = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg_text)
    if m is None:
        return 0.0, 0.0
    return float(m.group(1)), float(m.group(2))


def lifecycle(machine: str) -> Lifecycle:
    """``machine``'s picture. Raises ``GraphvizNotFound`` / ``GraphvizFailed`` without dot."""
    table = table_for(machine)
    text = svg(table)
    text = text[text.index("<svg") :]
    text = _ID.sub(lambda m: f'id="{machine}-{m.group(1)}"', text)
    lay = layout(table)
    loops = sum(len(v) for v in lay.loops.values())
    parts = [f"{len(table.states)} states, {len(table.rows)} transitions, each drawn once."]
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
    w, h = _size(text)
    return Lifecycle(machine, text, len(table.states), len(table.rows), " ".join(parts), w, h)
