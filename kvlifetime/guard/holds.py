"""Holds: every request a guard holds, each at its state of the engine-side lifecycle.

The one place a guard's view of a request changes: ``Holds.fire(request, event)`` steps the
compiled ``engine`` table of ``kvlifetime.spec`` (docs/engine.md). A row fires, or the signal is
refused (``Refusal``: counted, logged, nothing changed). No guard keeps a phase of its own.

A hold also carries the request's exposures as the ledger issued them (``Hold[E]``: the guard
core's are grant handles of its ``StepLedger``, the other tables' ``Grant`` objects of a
``BlockLedger``; the library's own values, not checked again; the table reads only whether
each is there) and the scheduler step in which its READ
grant was made: the guards of the table read those (``EngineFacts``). ``handed_back`` is final:
the hold is deleted and its key remembered a while, so a late or repeated id is told
(``duplicate_id``) from one never held (``unknown_id``).

::

    step n:   finished(r) ──► read_granted(r)        the ids leave with step n's output
              reads_done(r)  refused: before_exposure  no peer had them yet
    step n+1: reads_done(r) ──► (ledger) released ──► releasable ──► handed_back
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import attrs

from kvlifetime.guard.refusals import Refusal, RefusalKind, Refusals
from kvlifetime.spec.table import TransitionTable, engine_table

# How many handed-back keys are remembered to tell a duplicate from an unknown id.
REMEMBERED = 65536

E = TypeVar("E")
"""What a hold's exposures are: a grant handle (``int``) or a ``Grant``."""

Observer = Callable[[str, str, str, str], None]
"""Called with (request, from state, event, to state) for every row that fires."""


@attrs.define(slots=True, eq=False)
class Hold(Generic[E]):
    """One request the guard holds. ``state`` changes only through ``Holds.fire``."""

    state: str = "running"  # an EngineState value
    read: E | None = None  # the READ grant (a peer has the block ids)
    write: E | None = None  # the WRITE grant (a load may land)
    read_step: int = -1  # the scheduler step whose output carries the READ grant's ids
    write_step: int = -1  # the scheduler step whose metadata carries the WRITE grant's ids
    write_failed: bool = False  # the load was reported failed: no receive proves it landed
    read_reaped: bool = False  # the READ lease was reaped: no report proves the reads over


@attrs.define(slots=True)
class _Facts:
    """``EngineFacts`` of one hold at the current step (what the table's guards read)."""

    write_open: bool
    write_failed: bool
    read_open: bool
    read_this_step: bool
    read_reaped: bool


# A signal with no row (or whose guard does not hold) in a state, refused as: the kind a reader
# of the counters expects. Anything not listed is ``out_of_order``.
_NO_ROW: dict[tuple[str, str], RefusalKind] = {
    **{
        (s, "load_landed"): RefusalKind.DUPLICATE_ID
        for s in ("load_received", "receive_held", "fenced")
    },
    **{(s, "reads_done"): RefusalKind.NOT_FINISHED for s in ("running", "load_received")},
    **{
        (s, e): RefusalKind.WRONG_CHANNEL
        for s in ("withheld", "quarantined", "releasable", "loading", "load_failed", "reading")
        for e in ("load_landed", "reads_done")
    },
}


_ENDED_HOLDS = frozenset({"withheld", "quarantined"})


class Holds(Generic[E]):
    """The engine-side state of every request one guard holds, stepped by the engine table."""

    def __init__(self, refusals: Refusals, *, table: TransitionTable | None = None) -> None:
        self.table = table if table is not None else engine_table()
        self.refusals = refusals
        self.step = 0  # the scheduler step in progress: how many have ended (``next_step``)
        self._holds: dict[str, Hold[E]] = {}
        self._handed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._index = self.table.index
        self._guards = self.table.guards
        # The pairs whose first row has no guard: it always fires (the common case, one dict
        # lookup); the others are evaluated row by row on the hold's facts.
        self._unguarded: dict[tuple[str, str], str] = {
            pair: rows[0].target for pair, rows in self._index.items() if rows[0].guard is None
        }
        self.observers: list[Observer] = []  # each row that fires, for tests and tracing
        self._scratch = _Facts(False, False, False, False, False)  # ``_facts`` fills it
        # The request's hold, or None: the dict's own ``get`` (the hot path: no Python frame).
        self.get: Callable[[str], Hold[E] | None] = self._holds.get

    # ------------------------------------------------------------------ reading

    def __contains__(self, request: object) -> bool:
        return request in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def __iter__(self) -> Iterator[tuple[str, Hold[E]]]:
        return iter(list(self._holds.items()))

    def state(self, request: str) -> str | None:
        hold = self._holds.get(request)
        return None if hold is None else hold.state

    def handed_back(self, request: str) -> bool:
        """Whether the id was handed back to the engine (and is remembered)."""
        return request in self._handed

    def count(self, state: str) -> int:
        return sum(h.state == state for h in self._holds.values())

    # ------------------------------------------------------------------ stepping

    def admit(self, request: str) -> Hold[E]:
        """The engine holds ``request`` (``admitted``): a new hold at ``running``, or the one it
        has. A key handed back earlier is a new use of it: it is forgotten as handed back."""
        hold = self._holds.get(request)
        if hold is None:
            hold = self._holds[request] = Hold()
            self._handed.pop(request, None)
        else:
            self.fire(request, "admitted")
        return hold

    def allows(self, request: str, event: str) -> bool:
        """Whether ``fire(request, event)`` would fire a row now (nothing counted or changed)."""
        hold = self._holds.get(request)
        if hold is None:
            return False
        facts = self._facts(hold)
        for row in self._index.get((hold.state, event), ()):
            if row.guard is None or self._guards[row.guard](facts):
                return True
        return False

    def _guarded_target(self, hold: Hold[E], state: str, event: str) -> str | None:
        """The target of the first row of (state, event) whose guard holds, or None."""
        rows = self._index.get((state, event))
        if rows is None:
            return None
        facts = self._facts(hold)
        for row in rows:
            if row.guard is None or self._guards[row.guard](facts):
                return row.target
        return None

    def _facts(self, hold: Hold[E]) -> _Facts:
        """The hold's facts now, in the one ``_Facts`` this table reuses (no allocation)."""
        f = self._scratch
        read = hold.read is not None
        f.write_open = hold.write is not None
        f.write_failed = hold.write_failed
        f.read_open = read
        f.read_this_step = read and hold.read_step == self.step
        f.read_reaped = hold.read_reaped
        return f

    def fire(self, request: str, event: str, hold: Hold[E] | None = None) -> Refusal | None:
        """Step ``request``'s hold on ``event``: None when a row fired, else the refusal (the
        hold unchanged). ``handed_back`` deletes the hold; a key the guard handed back (from
        ``releasable``) is remembered, one the engine freed on its own id (from ``ended``:
        nothing was exposed) is not. ``hold``: the request's hold, when the caller has it."""
        if hold is None:
            hold = self._holds.get(request)
        if hold is None:
            kind = RefusalKind.DUPLICATE_ID if request in self._handed else RefusalKind.UNKNOWN_ID
            return self.refusals.refuse(kind, request, event=event)
        source = hold.state
        target = self._unguarded.get((source, event))
        if target is None:
            target = self._guarded_target(hold, source, event)
        if target is None:
            kind = self._kind(source, event, hold)
            return self.refusals.refuse(kind, request, state=source, event=event)
        hold.state = target
        if self.observers:
            for observe in self.observers:
                observe(request, source, event, target)
        if target == "handed_back":
            del self._holds[request]
            if source != "releasable":
                return None
            self._handed[request] = None
            if len(self._handed) > REMEMBERED:
                self._handed.popitem(last=False)
        return None

    def _kind(self, state: str, event: str, hold: Hold[E]) -> RefusalKind:
        """Why a signal found no row (or no guard held) for the hold."""
        if event == "reads_done" and hold.read is not None:
            if hold.read_step == self.step:
                return RefusalKind.BEFORE_EXPOSURE
            if hold.read_reaped:
                return RefusalKind.UNPROVABLE
        if event == "load_landed" and hold.write_failed and state in _ENDED_HOLDS:
            return RefusalKind.UNPROVABLE
        return _NO_ROW.get((state, event), RefusalKind.OUT_OF_ORDER)

    def next_step(self) -> None:
        """The scheduler step in progress ended: what it exposed has left the process with its
        output (``step`` counts the steps ended)."""
        self.step += 1
