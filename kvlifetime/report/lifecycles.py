"""The request and block lifecycles as pictures for the page: Graphviz SVG of the folded
layout (``kvlifetime.diagrams.layout``), inlined, with a caption saying what was folded. The
block lifecycle is two pictures (``kvlifetime.diagrams.pictures``): its life under holders and
grants, and its sharing apart.

Proves: the pictures are drawn from the compiled transition tables, every row once (an edge,
part of one edge from a box, or a line on its node) in exactly one picture. Does not prove:
anything about a run.
"""

from __future__ import annotations

import re

import attrs

from kvlifetime.diagrams import LOOP_MARK, Picture, layout, pictures, svg
from kvlifetime.spec.table import TransitionTable, table_for

_ID = re.compile(r'\bid="([^"]*)"')


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


def _size(svg_text: str) -> tuple[float, float]:
    m = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg_text)
    if m is None:
        return 0.0, 0.0
    return float(m.group(1)), float(m.group(2))


def _picture(table: TransitionTable, pic: Picture, apart: int) -> Lifecycle:
    text = svg(table, pic)
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
        table.machine, pic.name, text, len(states), len(pic.rows), " ".join(parts), w, h
    )


def lifecycle(machine: str) -> list[Lifecycle]:
    """``machine``'s pictures (one, or the block's two). Raises ``GraphvizNotFound`` /
    ``GraphvizFailed`` without a working ``dot``."""
    table = table_for(machine)
    pics = pictures(table)
    return [_picture(table, p, len(pics) - 1 - i) for i, p in enumerate(pics)]
