"""RequestRows: the request lifecycle of many requests as columns, stepped without objects.

One row per live request (its slot): its state, as a code of the request table's states, and
four counters over its open grants, kept as grants open, close and learn things: how many are
open, how many have not had the cancel acknowledged, how many peers still schedule, how many
are suspect. Each guard of the table is then one comparison of one counter
(``all_grants_closed``: no open grant; ``quarantine_due``: a suspect one; ...), and a
transition is a lookup in the table compiled from the specification
(``spec.table.request_table``): ``fire`` for the calls that end a request (reject, finish,
release), ``advance`` for the proof chain, in its order, to the end.

Flat lists, not numpy: a request's step is a handful of list operations (a numpy call costs
more than the whole of it, and a scheduler step holds tens of requests, not thousands).
Part of the step-columnar ledger being built (issue 32); held to the per-request ledger by
``tests/test_step_rows.py``.
"""

from __future__ import annotations

from kvlifetime.spec.table import request_table
from kvlifetime.spec.vocabulary import PROOF_CHAIN

TABLE = request_table()
STATES: tuple[str, ...] = TABLE.states
CODE: dict[str, int] = {s: i for i, s in enumerate(STATES)}
EVENTS: tuple[str, ...] = TABLE.events
EVENT_CODE: dict[str, int] = {e: i for i, e in enumerate(EVENTS)}

# The counters, and each guard as (counter, True: "> 0" / False: "== 0"; -1: no guard).
OPEN, UNCANCELLED, RUNNING, SUSPECT = range(4)
_GUARD: dict[str | None, tuple[int, bool]] = {
    None: (-1, False),
    "all_cancel_received": (UNCANCELLED, False),
    "all_scheduling_stopped": (RUNNING, False),
    "all_grants_closed": (OPEN, False),
    "has_open_grant": (OPEN, True),
    "quarantine_due": (SUSPECT, True),
}
assert set(_GUARD) - {None} == set(TABLE.guards), "a guard of the request table has no counter"

Row = tuple[int, int, bool, int]
"""(event code, counter (-1: no guard), positive, target code)."""


def _rows(state: str, events: list[str]) -> tuple[Row, ...]:
    return tuple(
        (EVENT_CODE[row.event], *_GUARD[row.guard], CODE[row.target])
        for event in events
        for row in TABLE.rows_for(state, event)
    )


# Per state: its proof-chain rows in chain order; per (state, event): a call's rows.
CHAIN: tuple[tuple[Row, ...], ...] = tuple(_rows(s, [e.value for e in PROOF_CHAIN]) for s in STATES)
CALLS: dict[tuple[int, int], tuple[Row, ...]] = {
    (CODE[s], EVENT_CODE[e]): _rows(s, [e]) for s in STATES for e in EVENTS if TABLE.rows_for(s, e)
}

Moves = list[tuple[int, int, int]]
"""Transitions fired, in order: (slot, event code, target code)."""


class RequestRows:
    """The live requests' states and open-grant counters, by slot."""

    __slots__ = ("counters", "state")

    def __init__(self) -> None:
        self.state: list[int] = []
        self.counters: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])

    def add(self) -> int:
        """A new slot, in the table's initial state with no grant."""
        self.state.append(CODE[TABLE.initial])
        for c in self.counters:
            c.append(0)
        return len(self.state) - 1

    def reset(self, slot: int) -> None:
        """``slot`` reused for a new request."""
        self.state[slot] = CODE[TABLE.initial]
        for c in self.counters:
            c[slot] = 0

    def _holds(self, slot: int, counter: int, positive: bool) -> bool:
        if counter < 0:
            return True
        n = self.counters[counter][slot]
        return n > 0 if positive else n == 0

    def fire(self, slot: int, event: int, out: Moves) -> int:
        """A call-driven ``event`` (rejected, finished, released, force_released) for ``slot``:
        1 moved (into ``out``), 0 rows exist but no guard held (for released:
        ``InsufficientEvidence``), -1 no row for its state (``IllegalTransition``)."""
        rows = CALLS.get((self.state[slot], event))
        if rows is None:
            return -1
        for ev, counter, positive, target in rows:
            if self._holds(slot, counter, positive):
                self.state[slot] = target
                out.append((slot, ev, target))
                return 1
        return 0

    def advance(self, slot: int, out: Moves) -> None:
        """Fire every proof-chain transition whose guard now holds, in chain order, until
        none does (into ``out``)."""
        state = self.state
        moved = True
        while moved:
            moved = False
            for ev, counter, positive, target in CHAIN[state[slot]]:
                if self._holds(slot, counter, positive):
                    state[slot] = target
                    out.append((slot, ev, target))
                    moved = True
                    break


__all__ = ["CODE", "EVENTS", "EVENT_CODE", "STATES", "Moves", "RequestRows"]
