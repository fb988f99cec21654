"""The specification's python-statemachine classes: ``RequestLifecycle`` and ``BlockLifecycle``.

They are the one source of truth (docs/contract.md#request-lifecycle,
docs/contract.md#block-lifecycle): ``kvlifetime.spec.table`` compiles them into the data the
ledger's fast path runs (and checks its committed copy against them), ``kvlifetime.diagrams``
draws them, and ``BlockLedger(checked=True)`` mirrors every request transition into a
``RequestLifecycle``. The states, events and guard functions they use are plain Python in
``kvlifetime.spec.vocabulary``, which does not import this module, so that a ledger that is not
checked never imports python-statemachine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from statemachine import Event, State, StateMachine

from kvlifetime.spec.vocabulary import (
    BLOCK_GUARDS,
    REQUEST_GUARDS,
    BlockFacts,
    BlockState,
    RequestFacts,
    RequestState,
)

__all__ = ["SPECS", "BlockLifecycle", "RequestLifecycle"]


def _condition(name: str, guard: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def condition(self: Any) -> bool:
        return guard(self.facts)

    condition.__name__ = condition.__qualname__ = name
    condition.__doc__ = guard.__doc__
    return condition


_SM = TypeVar("_SM", bound=type[StateMachine])


def _conditions_from(guards: Mapping[str, Callable[[Any], bool]]) -> Callable[[_SM], _SM]:
    """Give the class one condition method per guard, reading ``self.facts``: the name its
    ``cond=`` uses calls the very function the compiled table calls (python-statemachine
    resolves the names when a machine is made, so methods added after the class body count)."""

    def add(cls: _SM) -> _SM:
        for name, guard in guards.items():
            if hasattr(cls, name):  # a guard must not shadow a state, an event or a method
                raise TypeError(f"{cls.__name__}: guard {name!r} clashes with an attribute")
            setattr(cls, name, _condition(name, guard))
        return cls

    return add


@_conditions_from(REQUEST_GUARDS)
class RequestLifecycle(StateMachine):
    """The lifetime of one request (docs/request.md).

    ``facts`` is read by the guards; the machine never changes it.
    """

    admitted = State(initial=True)
    rejected = State()
    finished = State()
    cancel_received = State()
    scheduling_stopped = State()
    transfer_quiesced = State()
    quarantined = State()
    released = State(final=True)

    # The owner ended the request early (admission refusal, client abort, failure). The error
    # response may go out now; nothing about the blocks changes.
    ev_rejected = Event(admitted.to(rejected), id="rejected")
    # The normal end of the request on the owner's side.
    ev_finished = Event(admitted.to(finished), id="finished")
    ev_cancel_received = Event(
        rejected.to(cancel_received, cond="all_cancel_received"), id="cancel_received"
    )
    ev_scheduling_stopped = Event(
        cancel_received.to(scheduling_stopped, cond="all_scheduling_stopped"),
        id="scheduling_stopped",
    )
    ev_transfer_quiesced = Event(
        scheduling_stopped.to(transfer_quiesced, cond="all_grants_closed")
        | finished.to(transfer_quiesced, cond="all_grants_closed")
        | quarantined.to(transfer_quiesced, cond="all_grants_closed"),
        id="transfer_quiesced",
    )
    # A deadline passed, a lease expired or a peer was lost without proof: the blocks stay out
    # of circulation, counted, with the reason. Never silently freed.
    ev_quarantined = Event(
        rejected.to(quarantined, cond="quarantine_due")
        | cancel_received.to(quarantined, cond="quarantine_due")
        | scheduling_stopped.to(quarantined, cond="quarantine_due")
        | finished.to(quarantined, cond="quarantine_due"),
        id="quarantined",
    )
    ev_released = Event(transfer_quiesced.to(released, cond="all_grants_closed"), id="released")
    # UNSAFE: explicit, logged at warning, counted. Never the normal path.
    ev_force_released = Event(
        rejected.to(released, cond="has_open_grant")
        | finished.to(released, cond="has_open_grant")
        | cancel_received.to(released, cond="has_open_grant")
        | scheduling_stopped.to(released, cond="has_open_grant")
        | quarantined.to(released, cond="has_open_grant"),
        id="force_released",
    )

    def __init__(self, facts: RequestFacts, start_value: str | None = None) -> None:
        self.facts = facts
        super().__init__(start_value=start_value)

    @property
    def state(self) -> RequestState:
        return RequestState(self.current_state_value)


@_conditions_from(BLOCK_GUARDS)
class BlockLifecycle(StateMachine):
    """The lifetime of one KV block (docs/block.md).

    A block that is not ``free`` is never handed out as a fresh block; it is handed out shared
    only while no open write grant covers it (a reader does not change the content).
    """

    free = State(initial=True)
    owned = State()
    exposed = State()
    draining = State()
    quiesced = State()
    quarantined = State()

    ev_acquired = Event(free.to(owned), id="acquired")
    # A prefix-cache hit: another request takes the block read-only. A quiesced block's content
    # is settled (its holders ended, no grant is open), so it may be shared too, and has a
    # running holder again. So may a draining or quarantined block whose open grants are all
    # READ grants: a reader does not change the content. It has a running holder and an open
    # grant again (exposed); it returns to the pool only once every grant is proven over.
    ev_shared = Event(
        owned.to(owned, cond="no_open_write_grant", internal=True)
        | exposed.to(exposed, cond="no_open_write_grant", internal=True)
        | quiesced.to(owned, cond="no_open_write_grant")
        | draining.to(exposed, cond="no_open_write_grant")
        | quarantined.to(exposed, cond="no_open_write_grant"),
        id="shared",
    )
    ev_exposed = Event(
        owned.to(exposed, cond="write_needs_single_holder")
        | exposed.to(exposed, cond="write_needs_single_holder", internal=True),
        id="exposed",
    )
    ev_grant_closed = Event(
        exposed.to(owned, cond="no_open_grant")
        | exposed.to(exposed, cond="has_open_grant", internal=True)
        | draining.to(quiesced, cond="no_open_grant")
        | draining.to(draining, cond="has_open_grant", internal=True)
        | quarantined.to(quiesced, cond="no_open_grant")
        | quarantined.to(quarantined, cond="has_open_grant", internal=True),
        id="grant_closed",
    )
    ev_holder_ended = Event(
        owned.to(quiesced, cond="no_live_holder")
        | owned.to(owned, cond="has_live_holder", internal=True)
        | exposed.to(draining, cond="no_live_holder")
        | exposed.to(exposed, cond="has_live_holder", internal=True),
        id="holder_ended",
    )
    # A holder let go of the block. It returns to the pool (generation + 1) with the last one.
    ev_holder_released = Event(
        quiesced.to(free, cond="no_holder")
        | quiesced.to(quiesced, cond="has_holder", internal=True)
        | owned.to(owned, cond="has_live_holder", internal=True)
        | exposed.to(exposed, cond="has_live_holder", internal=True),
        id="holder_released",
    )
    ev_quarantined = Event(draining.to(quarantined), id="quarantined")
    # UNSAFE: the holder forced its release while a grant was open.
    ev_force_released = Event(
        draining.to(free, cond="no_holder")
        | draining.to(draining, cond="has_holder", internal=True)
        | quarantined.to(free, cond="no_holder")
        | quarantined.to(quarantined, cond="has_holder", internal=True),
        id="force_released",
    )

    def __init__(self, facts: BlockFacts) -> None:
        self.facts = facts
        super().__init__()

    @property
    def state(self) -> BlockState:
        return BlockState[str(self.current_state_value).upper()]


SPECS: Mapping[str, type[StateMachine]] = {"request": RequestLifecycle, "block": BlockLifecycle}
