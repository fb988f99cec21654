"""One state's expansion, as both searches take it (``explore`` in one process, ``parallel``
in several): the events enabled (lies the ledger refuses left out), reduced to a stubborn set,
each step taken once."""

from __future__ import annotations

from typing import Any

from kvlifetime.verify.events import enabled
from kvlifetime.verify.lies import lie_events
from kvlifetime.verify.por import stubborn
from kvlifetime.verify.semantics import step
from kvlifetime.verify.state import Broken, Config, Event, Policy, State


class Successors:
    """The successors of one state, each step taken at most once (the stubborn set asks for
    some of them before the search does)."""

    __slots__ = ("config", "policy", "state", "taken")

    def __init__(self, state: State, config: Config, policy: Policy) -> None:
        self.state = state
        self.config = config
        self.policy = policy
        self.taken: dict[Event, State | Broken] = {}

    def after(self, ev: Event) -> State | None:
        """The state ``ev`` leads to; ``None`` when the step breaks an invariant."""
        got = self.taken.get(ev)
        if got is None:
            try:
                got = step(self.state, ev, self.config, self.policy)[0]
            except Broken as exc:
                got = exc
            self.taken[ev] = got
        return None if isinstance(got, Broken) else got

    def broken(self, ev: Event) -> Broken:
        """How ``ev`` broke (after ``after(ev)`` returned ``None``)."""
        b = self.taken[ev]
        assert isinstance(b, Broken)
        return b


def expansion(
    state: State, config: Config, policy: Policy, por: bool, answers: dict[Any, tuple[int, ...]]
) -> tuple[list[Event], Successors]:
    """The events to take from ``state`` (none: it is quiet) and its successors. ``answers``:
    the search's cache of the ledger's answers to lies (``lies.lie_events``)."""
    # Lies that the ledger refuses are self-loops, left out ("lies" in explore.py).
    events = enabled(state, config) + lie_events(state, config, policy, answers)
    succ = Successors(state, config, policy)
    if events and por:
        events = stubborn(state, config, events, succ.after, policy)
    return events, succ
