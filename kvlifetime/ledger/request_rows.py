"""RequestRows: the request lifecycle of many requests as columns, stepped without objects.

One row per live request (its slot, found by its key): its state, as a code of the request
table's states, its deadline, and four counters over its open grants, kept as grants open,
close and learn things: how many are open, how many have not had the cancel acknowledged, how
many peers still schedule, how many are suspect. Each guard of the table is then one comparison
of one counter (``all_grants_closed``: no open grant; ``quarantine_due``: a suspect one; ...), and a
transition is a lookup in the table compiled from the specification
(``spec.table.request_table``): ``fire`` for the calls that end a request (reject, finish,
release), ``advance`` for the proof chain, in its order, to the end.

Flat lists, not numpy: a request's step is a handful of list operations (a numpy call costs
more than the whole of it, and a scheduler step holds tens of requests, not thousands).
Part of the step-columnar ledger being built (issue 32); held to the per-request ledger by
``tests/test_step_rows.py``.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable

from kvlifetime.errors import DoubleRelease, IllegalTransition, UnknownRequest
from kvlifetime.ledger.requests import RECENTLY_RELEASED
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
    """The live requests by key and slot: states, open-grant counters, deadlines."""

    __slots__ = (
        "counters",
        "deadline",
        "free_slots",
        "key_of",
        "recently_released",
        "slot_of",
        "state",
        "timed",
    )

    def __init__(self) -> None:
        self.state: list[int] = []
        self.counters: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self.slot_of: dict[Hashable, int] = {}
        self.key_of: list[Hashable] = []
        self.free_slots: list[int] = []
        self.deadline: list[float] = []  # per slot (inf: none)
        self.timed: dict[int, None] = {}  # slots with a deadline somewhere, in that order
        # Keys released lately: an ending call naming one is DoubleRelease, not UnknownRequest.
        # Ordered, oldest first, dropped from the front in O(1) (a plain dict's first key is
        # found by skipping the deleted entries before it: O(n) once it is full).
        self.recently_released: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def admit(self, key: Hashable, deadline: float | None) -> int:
        """A new request (``key`` not live), in the table's initial state; its slot."""
        initial = CODE[TABLE.initial]
        if self.free_slots:
            slot = self.free_slots.pop()
            self.state[slot] = initial
            for c in self.counters:
                c[slot] = 0
            self.key_of[slot] = key
            self.deadline[slot] = math.inf if deadline is None else deadline
        else:
            slot = len(self.state)
            self.state.append(initial)
            for c in self.counters:
                c.append(0)
            self.key_of.append(key)
            self.deadline.append(math.inf if deadline is None else deadline)
        if deadline is not None:
            self.timed[slot] = None
        self.recently_released.pop(key, None)
        self.slot_of[key] = slot
        return slot

    def forget(self, slot: int) -> None:
        """A released request: its key remembered a while (``ending``), its slot reused."""
        key = self.key_of[slot]
        del self.slot_of[key]
        rr = self.recently_released
        rr[key] = None
        if len(rr) > RECENTLY_RELEASED:
            rr.popitem(last=False)
        self.timed.pop(slot, None)
        self.free_slots.append(slot)

    def ending(self, key: Hashable) -> int:
        """The slot of ``key`` for a call that ends or lets go of it: ``DoubleRelease`` for a
        key released lately, ``UnknownRequest`` for one never seen."""
        slot = self.slot_of.get(key)
        if slot is None:
            if key in self.recently_released:
                raise DoubleRelease(f"request {key!r} was already released")
            raise UnknownRequest(key)
        return slot

    def running_or_new(self, key: Hashable, event: str) -> int | None:
        """The slot of ``key`` if it runs, None if it is new; ``IllegalTransition`` if ended."""
        slot = self.slot_of.get(key)
        if slot is not None and self.state[slot] != CODE[TABLE.initial]:
            raise IllegalTransition("request", key, STATES[self.state[slot]], event)
        return slot

    def set_deadline(self, key: Hashable, deadline: float | None) -> None:
        """The request-wide deadline (None: none); ``UnknownRequest`` for a key not live."""
        slot = self.slot_of.get(key)
        if slot is None:
            raise UnknownRequest(key)
        self.deadline[slot] = math.inf if deadline is None else deadline
        if deadline is not None:
            self.timed[slot] = None

    def state_of(self, key: Hashable) -> str:
        return STATES[self.state[self.slot_of[key]]]

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
