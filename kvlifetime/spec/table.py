"""Transition tables compiled from the specification, as plain data.

``compile_table(RequestLifecycle, "request", REQUEST_GUARDS)`` reads a python-statemachine class
of ``kvlifetime.spec.lifecycles`` (states, events, transitions, guard names) into a
``TransitionTable``: the only thing the ledger's fast path runs. ``request_table()`` and
``block_table()`` build it from ``kvlifetime.spec.table_data``, the compiled rows committed as
data, so that a ledger imports no python-statemachine; a test checks that data against
``compile_table`` of the classes (regenerate it with ``python -m kvlifetime.spec.table``).
A (state, event) pair with no row is a typed protocol error (``IllegalTransition``), as in h11.
Exports: markdown, csv and json, all generated from the same rows.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any, cast

import attrs

from kvlifetime.errors import IllegalTransition
from kvlifetime.spec.vocabulary import GUARDS, UNSAFE_EVENTS

if TYPE_CHECKING:
    from statemachine import StateMachine


@attrs.frozen(slots=True)
class Row:
    """One transition: from ``source`` on ``event`` to ``target`` when ``guard`` holds."""

    source: str
    event: str
    target: str
    guard: str | None  # name of a guard in the machine's guard map; None: unconditional
    unsafe: bool  # never the normal path (force_released)


@attrs.frozen(slots=True)
class TransitionTable:
    """A lifecycle as data. ``rows`` are in specification order."""

    machine: str  # "request", "block" or "engine"
    states: tuple[str, ...]
    initial: str
    finals: tuple[str, ...]
    events: tuple[str, ...]
    rows: tuple[Row, ...]
    guards: Mapping[str, Callable[[Any], bool]] = attrs.field(eq=False, repr=False)
    # (state, event) -> rows, in order; the first whose guard holds wins.
    index: Mapping[tuple[str, str], tuple[Row, ...]] = attrs.field(eq=False, repr=False)

    def rows_for(self, state: str, event: str) -> tuple[Row, ...]:
        return self.index.get((state, event), ())

    def allows(self, state: str, event: str) -> bool:
        """Whether the table has any row for the pair (a guard may still refuse)."""
        return (state, event) in self.index

    def step(self, state: str, event: str, facts: Any, subject: object = None) -> str | None:
        """The target state, or ``None`` when rows exist but no guard holds.

        Raises ``IllegalTransition`` when the table has no row for (state, event).
        """
        rows = self.index.get((state, event))
        if rows is None:
            raise IllegalTransition(self.machine, subject, state, event)
        for row in rows:
            if row.guard is None or self.guards[row.guard](facts):
                return row.target
        return None

    # ----------------------------------------------------------------- exports

    def as_dicts(self) -> list[dict[str, object]]:
        return [attrs.asdict(r) for r in self.rows]

    def to_json(self) -> str:
        doc = {
            "machine": self.machine,
            "states": list(self.states),
            "initial": self.initial,
            "finals": list(self.finals),
            "events": list(self.events),
            "transitions": self.as_dicts(),
        }
        return json.dumps(doc, indent=2) + "\n"

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["source", "event", "target", "guard", "unsafe"])
        for r in self.rows:
            w.writerow([r.source, r.event, r.target, r.guard or "", "yes" if r.unsafe else ""])
        return buf.getvalue()

    def to_markdown(self) -> str:
        lines = [
            f"# {self.machine} lifecycle: transition table",
            "",
            "Generated from `kvlifetime.spec.lifecycles` by `kvlifetime table "
            f"{self.machine} --format md`. Do not edit.",
            "",
            f"Initial state: `{self.initial}`. Final: "
            + (", ".join(f"`{s}`" for s in self.finals) or "none")
            + ".",
            "",
            "| from | event | to | guard | |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            lines.append(
                f"| {r.source} | {r.event} | {r.target} | {r.guard or ''} | "
                f"{'**unsafe**' if r.unsafe else ''} |"
            )
        lines += [
            "",
            "## Every (state, event) pair",
            "",
            "A cell names the target(s); an empty cell is an illegal transition "
            "(`IllegalTransition`).",
            "",
            "| state \\ event | " + " | ".join(self.events) + " |",
            "| --- |" + " --- |" * len(self.events),
        ]
        for s in self.states:
            cells = []
            for e in self.events:
                rows = self.rows_for(s, e)
                cells.append(
                    "<br>".join(f"{r.target}" + (f" [{r.guard}]" if r.guard else "") for r in rows)
                )
            lines.append(f"| **{s}** | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def render(self, fmt: str) -> str:
        if fmt == "md":
            return self.to_markdown()
        if fmt == "csv":
            return self.to_csv()
        if fmt == "json":
            return self.to_json()
        raise ValueError(f"unknown table format {fmt!r} (md, csv, json)")


def compile_table(
    spec: type[StateMachine], name: str, guards: Mapping[str, Callable[[Any], bool]]
) -> TransitionTable:
    """Read a python-statemachine class into a ``TransitionTable``."""
    states = tuple(s.id for s in spec.states)
    initial = next(s.id for s in spec.states if s.initial)
    finals = tuple(s.id for s in spec.states if s.final)
    events = tuple(e.id for e in cast(Iterable[Any], spec.events))
    rows: list[Row] = []
    for s in spec.states:
        for t in s.transitions:
            conds = [str(c) for c in t.cond]
            if len(conds) > 1:
                raise ValueError(f"{name}: one guard per transition, got {conds}")
            guard = conds[0] if conds else None
            if guard is not None and guard not in guards:
                raise ValueError(f"{name}: guard {guard!r} has no function")
            for ev in str(t.event).split():
                rows.append(Row(s.id, ev, t.target.id, guard, ev in UNSAFE_EVENTS))
    # Order rows by event (in specification order), then state, keeping guard order.
    order = {e: i for i, e in enumerate(events)}
    sorder = {s: i for i, s in enumerate(states)}
    rows.sort(key=lambda r: (order[r.event], sorder[r.source]))
    return _build(name, states, initial, finals, events, rows, guards)


def _build(
    name: str,
    states: tuple[str, ...],
    initial: str,
    finals: tuple[str, ...],
    events: tuple[str, ...],
    rows: list[Row],
    guards: Mapping[str, Callable[[Any], bool]],
) -> TransitionTable:
    index: dict[tuple[str, str], tuple[Row, ...]] = {}
    for r in rows:
        index[(r.source, r.event)] = (*index.get((r.source, r.event), ()), r)
    return TransitionTable(name, states, initial, finals, events, tuple(rows), guards, index)


def _from_data(
    name: str, data: Mapping[str, Any], guards: Mapping[str, Callable[[Any], bool]]
) -> TransitionTable:
    rows = [Row(*r) for r in data["rows"]]
    for r in rows:
        if r.guard is not None and r.guard not in guards:
            raise ValueError(f"{name}: guard {r.guard!r} has no function")
    return _build(
        name, data["states"], data["initial"], data["finals"], data["events"], rows, guards
    )


@cache
def request_table() -> TransitionTable:
    from kvlifetime.spec.table_data import REQUEST

    return _from_data("request", REQUEST, GUARDS["request"])


@cache
def block_table() -> TransitionTable:
    from kvlifetime.spec.table_data import BLOCK

    return _from_data("block", BLOCK, GUARDS["block"])


@cache
def engine_table() -> TransitionTable:
    from kvlifetime.spec.table_data import ENGINE

    return _from_data("engine", ENGINE, GUARDS["engine"])


def compiled_from_spec(machine: str) -> TransitionTable:
    """``machine``'s table compiled from its python-statemachine class now (what
    ``kvlifetime.spec.table_data`` must hold)."""
    from kvlifetime.spec.lifecycles import SPECS

    return compile_table(SPECS[machine], machine, GUARDS[machine])


def table_data_source() -> str:
    """The text of ``kvlifetime/spec/table_data.py``, compiled from the specification."""
    out = [
        '"""The transition tables compiled from ``kvlifetime.spec.lifecycles``, as data.',
        "",
        "Generated by ``python -m kvlifetime.spec.table``. Do not edit: a test checks it against",
        "the python-statemachine classes. ``kvlifetime.spec.table`` builds the tables the ledger",
        "runs from it, so that an unchecked ledger never imports python-statemachine.",
        '"""',
        "",
        "from typing import Any",
        "",
    ]
    for var, machine in (("REQUEST", "request"), ("BLOCK", "block"), ("ENGINE", "engine")):
        t = compiled_from_spec(machine)
        out.append(f"{var}: dict[str, Any] = {{")
        out.append(f'    "states": {_tuple(t.states)},')
        out.append(f'    "initial": {t.initial!r},')
        out.append(f'    "finals": {_tuple(t.finals)},')
        out.append(f'    "events": {_tuple(t.events)},')
        out.append('    "rows": (')
        out.append("        # (source, event, target, guard, unsafe), in specification order")
        for r in t.rows:
            out.append(
                f"        ({r.source!r}, {r.event!r}, {r.target!r}, {r.guard!r}, {r.unsafe}),"
            )
        out.append("    ),")
        out.append("}")
        out.append("")
    return "\n".join(out)


def _tuple(items: tuple[str, ...]) -> str:
    return "(" + ", ".join(repr(i) for i in items) + ("," if len(items) == 1 else "") + ")"


def table_for(machine: str) -> TransitionTable:
    if machine == "request":
        return request_table()
    if machine == "block":
        return block_table()
    if machine == "engine":
        return engine_table()
    raise ValueError(f"unknown machine {machine!r} (request, block, engine)")


if __name__ == "__main__":  # python -m kvlifetime.spec.table: rewrite kvlifetime/spec/table_data.py
    from pathlib import Path

    target = Path(__file__).with_name("table_data.py")
    target.write_text(table_data_source(), encoding="utf-8", newline="\n")
    import subprocess
    import sys

    # The project's formatter, so that `ruff format --check` passes on the generated file.
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(target)], check=False)
    print(f"wrote {target}")
