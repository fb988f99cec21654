"""The specification's python-statemachine classes: ``RequestLifecycle``, ``BlockLifecycle`` and
``EngineSideLifecycle`` (a request as the guard in an engine sees it).

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
    ENGINE_GUARDS,
    REQUEST_GUARDS,
    BlockFacts,
    BlockState,
    EngineFacts,
    EngineState,
    RequestFacts,
    RequestState,
)

__all__ = ["SPECS", "BlockLifecycle", "EngineSideLifecycle", "RequestLifecycle"]


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


@_conditions_from(ENGINE_GUARDS)
class EngineSideLifecycle(StateMachine):
    """A request as the guard inside an engine sees it (docs/engine.md): what the engine may do
    with its blocks and its id. Every guard (vLLM's, SGLang's decode and prefill, the harness
    owners, the verifier's model) steps this one table through ``kvlifetime.guard``.

    The ledger's request lifecycle says what has been *proven*; this one says what the engine is
    *told*: an ended request's id goes back (``handed_back``) only from ``releasable``, which
    only the ledger's ``released`` verdict reaches. An engine signal with no row here proves
    nothing and is refused.
    """

    running = State(initial=True)
    loading = State()
    load_received = State()
    load_failed = State()
    receive_held = State()
    fenced = State()
    reading = State()
    ended = State()
    withheld = State()
    quarantined = State()
    releasable = State()
    handed_back = State(final=True)

    # The engine holds the request (again: a repeat is harmless, it changes nothing).
    ev_admitted = Event(running.to(running, internal=True), id="admitted")
    # An asynchronous load's blocks were granted to the peer that writes them.
    ev_load_granted = Event(
        running.to(loading) | load_received.to(loading),
        id="load_granted",
    )
    # The block ids left (or leave with this step) for a peer that reads them: a running
    # request's (SGLang's prefill sends while it runs), or an ended one's (vLLM delays the free).
    ev_read_granted = Event(
        running.to(reading)
        | reading.to(reading, internal=True)
        | ended.to(withheld)
        | withheld.to(withheld, internal=True)
        | quarantined.to(quarantined, internal=True),
        id="read_granted",
    )
    # The ledger refused the exposure (a block another transfer may still touch): nothing was
    # exposed, and the block ids must not leave the process.
    ev_grant_refused = Event(
        running.to(running, internal=True)
        | load_received.to(load_received, internal=True)
        | ended.to(ended, internal=True),
        id="grant_refused",
    )
    # A receive: the load landed (a proof of its WRITE grant); or, with nothing exposed, the
    # engine's own business (passed on); a failed load's receive is held.
    ev_load_landed = Event(
        loading.to(load_received)
        | running.to(load_received)
        | load_failed.to(receive_held)
        | ended.to(handed_back)
        | withheld.to(withheld, cond="load_provable", internal=True)
        | quarantined.to(quarantined, cond="load_provable", internal=True),
        id="load_landed",
    )
    # A peer's reads are over (a proof of its READ grant), never before the ids left.
    ev_reads_done = Event(
        reading.to(running, cond="reads_provable")
        | ended.to(handed_back)
        | withheld.to(withheld, cond="reads_provable", internal=True)
        | quarantined.to(quarantined, cond="reads_provable", internal=True),
        id="reads_done",
    )
    # The load was reported failed: what still lands is unknown.
    ev_load_failed = Event(
        loading.to(load_failed) | withheld.to(quarantined, cond="has_open_write"),
        id="load_failed",
    )
    # Only time passed (a lease reaped, a peer lost): proves nothing about memory access.
    ev_lease_expired = Event(
        reading.to(reading, internal=True)
        | loading.to(load_failed)
        | withheld.to(quarantined, cond="has_open_read")
        | withheld.to(quarantined, cond="has_open_write")
        | quarantined.to(quarantined, internal=True),
        id="lease_expired",
    )
    ev_deadline = Event(
        withheld.to(quarantined) | quarantined.to(quarantined, internal=True), id="deadline"
    )
    # The engine ended the request normally, or early (an abort, a failure): the error response
    # may go out now; what was exposed stays withheld until proven over.
    ev_finished = Event(
        running.to(ended)
        | load_received.to(ended)
        | fenced.to(ended)
        | loading.to(withheld)
        | reading.to(withheld)
        | load_failed.to(quarantined)
        | receive_held.to(quarantined),
        id="finished",
    )
    ev_aborted = Event(
        running.to(ended)
        | load_received.to(ended)
        | fenced.to(ended)
        | loading.to(withheld)
        | reading.to(withheld)
        | load_failed.to(quarantined)
        | receive_held.to(quarantined),
        id="aborted",
    )
    # A fence on the memory owner's side ended every access of the peer: a running request's
    # exposure is over; a held receive becomes due. (Ended requests leave through ``released``.)
    ev_fenced = Event(
        loading.to(running)
        | reading.to(running)
        | load_failed.to(running)
        | receive_held.to(fenced),
        id="fenced",
    )
    # The ledger's verdict: every grant of the ended request is closed and its blocks released.
    ev_released = Event(
        withheld.to(releasable) | quarantined.to(releasable),
        id="released",
    )
    # The engine was handed the id (once): it frees the blocks, or goes on with a fenced load.
    ev_handed_back = Event(
        releasable.to(handed_back) | ended.to(handed_back) | fenced.to(load_received),
        id="handed_back",
    )

    def __init__(self, facts: EngineFacts, start_value: str | None = None) -> None:
        self.facts = facts
        super().__init__(start_value=start_value)

    @property
    def state(self) -> EngineState:
        return EngineState(self.current_state_value)


SPECS: Mapping[str, type[StateMachine]] = {
    "request": RequestLifecycle,
    "block": BlockLifecycle,
    "engine": EngineSideLifecycle,
}
