"""The owner's view: the engine-side lifecycle seen at the grain of a model of it.

The verifier's model of the engine (``kvlifetime.verify``) and the harness owners do not model
an asynchronous load's sub-states or a receive held for a fence; they need only whether the
engine still runs a request, how it ended it, and whether its id went back. That view is a
projection of the ``engine`` table, computed from it (never written beside it):

- ``live``: every state reachable from ``running`` without an end or a hand-back;
- ``finished`` / ``rejected``: the states a live one reaches on ``finished`` / ``aborted``, and
  what follows them until ``handed_back``;
- ``released``: ``handed_back``.

A projected row exists only when the table has it for every state of the phase (an end from
every live state; a way to ``handed_back`` from every ended state), so a change to the engine
table that breaks the view breaks ``owner_table()`` at import, and a model stepping
``owner_step`` fires only what the engine table allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache

from kvlifetime.errors import IllegalTransition
from kvlifetime.spec.table import TransitionTable, engine_table

LIVE, FINISHED, REJECTED, RELEASED = "live", "finished", "rejected", "released"
OWNER_PHASES = (LIVE, FINISHED, REJECTED, RELEASED)

_ENDS = {"finished": FINISHED, "aborted": REJECTED}
_BACK = "handed_back"


def _closure(table: TransitionTable, start: Iterable[str], stop: frozenset[str]) -> set[str]:
    """States reachable from ``start`` by rows whose event is not in ``stop``."""
    seen = set(start)
    todo = list(seen)
    while todo:
        s = todo.pop()
        for r in table.rows:
            if r.source == s and r.event not in stop and r.target not in seen:
                seen.add(r.target)
                todo.append(r.target)
    return seen


def project(table: TransitionTable) -> dict[tuple[str, str], str]:
    """(owner phase, engine event) -> owner phase, computed from ``table``."""
    stop = frozenset({*_ENDS, _BACK})
    live = _closure(table, [table.initial], stop)
    out: dict[tuple[str, str], str] = {}
    for event, phase in _ENDS.items():
        targets = {r.target for r in table.rows if r.source in live and r.event == event}
        if {r.source for r in table.rows if r.event == event} >= live and targets:
            out[(LIVE, event)] = phase
            ended = _closure(table, targets, frozenset({_BACK}))
            # every ended state can reach the hand-back: the phase's way out
            if all(_BACK in _reachable(table, s) for s in ended):
                out[(phase, _BACK)] = RELEASED
    return out


def _reachable(table: TransitionTable, state: str) -> set[str]:
    return _closure(table, [state], frozenset())


@cache
def owner_table() -> Mapping[tuple[str, str], str]:
    """The projection of the committed engine table (``project(engine_table())``)."""
    return project(engine_table())


def owner_step(phase: str, event: str) -> str:
    """The owner phase after ``event``; ``IllegalTransition`` when the engine table has no way
    to fire it from every state of ``phase``."""
    target = owner_table().get((phase, event))
    if target is None:
        raise IllegalTransition("owner", None, phase, event)
    return target
