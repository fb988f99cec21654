"""The specification: the request and block lifecycles as python-statemachine classes.

The contract they encode, with the reasons and the precise rules where the pictures leave a
choice, is docs/contract.md (#request-lifecycle, #block-lifecycle, #precise-rules).

These classes are the one source of truth. ``table.py`` compiles them into plain data that the
ledger's fast path runs; ``diagrams.py`` draws them; ``BlockLedger(checked=True)`` mirrors every
request transition into a ``RequestLifecycle`` and fails loudly when the two disagree.

Guards are named conditions over *facts*: what has been proven about each grant (``GrantProof``)
and, for blocks, how many holders and grants touch it. The caller updates the facts first, then
sends the event; a guard reads the facts as they are after the event. Guards are plain functions
in ``REQUEST_GUARDS`` / ``BLOCK_GUARDS`` so that the tables can evaluate exactly the same code.

Both classes are strict ``StateMachine`` subclasses: an event with no transition from the current
state raises, and exceptions are never swallowed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from statemachine import Event, State, StateMachine

from kvlifetime.proof import GrantProof

# =========================================================================== request lifecycle


class RequestState(enum.Enum):
    """Where a request is in its lifetime. ``released`` is final."""

    ADMITTED = "admitted"
    REJECTED = "rejected"
    FINISHED = "finished"
    CANCEL_RECEIVED = "cancel_received"
    SCHEDULING_STOPPED = "scheduling_stopped"
    TRANSFER_QUIESCED = "transfer_quiesced"
    QUARANTINED = "quarantined"
    RELEASED = "released"


ENDED_STATES = frozenset(
    {
        RequestState.REJECTED,
        RequestState.FINISHED,
        RequestState.CANCEL_RECEIVED,
        RequestState.SCHEDULING_STOPPED,
        RequestState.TRANSFER_QUIESCED,
        RequestState.QUARANTINED,
    }
)
"""States in which the owner has ended the request but it has not been released yet."""


class RequestEvent(enum.Enum):
    """The named transitions of a request."""

    REJECTED = "rejected"
    FINISHED = "finished"
    CANCEL_RECEIVED = "cancel_received"
    SCHEDULING_STOPPED = "scheduling_stopped"
    TRANSFER_QUIESCED = "transfer_quiesced"
    QUARANTINED = "quarantined"
    RELEASED = "released"
    FORCE_RELEASED = "force_released"


UNSAFE_EVENTS = frozenset({RequestEvent.FORCE_RELEASED.value, "force_released"})
"""Transitions that are never the normal path: logged at warning and counted."""

# The order in which evidence-driven transitions are tried after every change: a stronger claim
# implies the weaker stages, so one piece of evidence may fire several of them, in this order.
PROOF_CHAIN: tuple[RequestEvent, ...] = (
    RequestEvent.CANCEL_RECEIVED,
    RequestEvent.SCHEDULING_STOPPED,
    RequestEvent.QUARANTINED,
    RequestEvent.TRANSFER_QUIESCED,
)


class RequestFacts(Protocol):
    """What the request guards may look at: the proofs of the request's open grants."""

    def open_proofs(self) -> Iterable[GrantProof]: ...


def all_cancel_received(f: RequestFacts) -> bool:
    """Every open grant's peer received the cancel (vacuously true with no open grant)."""
    # Plain loops, not all(<genexpr>): the ledger evaluates these on its hot path.
    for p in f.open_proofs():  # noqa: SIM110
        if not p.cancel_acknowledged:
            return False
    return True


def all_scheduling_stopped(f: RequestFacts) -> bool:
    """Every open grant's peer stopped scheduling transfers for it."""
    for p in f.open_proofs():  # noqa: SIM110
        if not p.scheduling_stopped:
            return False
    return True


def all_grants_closed(f: RequestFacts) -> bool:
    """No grant of the request is open: no peer can touch its blocks any more."""
    for _ in f.open_proofs():
        return False
    return True


def has_open_grant(f: RequestFacts) -> bool:
    """Some grant of the request is still open."""
    for _ in f.open_proofs():
        return True
    return False


def quarantine_due(f: RequestFacts) -> bool:
    """Some open grant is suspect: its deadline passed, its lease expired or its peer was lost."""
    for p in f.open_proofs():  # noqa: SIM110
        if p.suspect is not None:
            return True
    return False


REQUEST_GUARDS: Mapping[str, Callable[[RequestFacts], bool]] = {
    g.__name__: g
    for g in (
        all_cancel_received,
        all_scheduling_stopped,
        all_grants_closed,
        has_open_grant,
        quarantine_due,
    )
}


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

    def all_cancel_received(self) -> bool:
        return all_cancel_received(self.facts)

    def all_scheduling_stopped(self) -> bool:
        return all_scheduling_stopped(self.facts)

    def all_grants_closed(self) -> bool:
        return all_grants_closed(self.facts)

    def has_open_grant(self) -> bool:
        return has_open_grant(self.facts)

    def quarantine_due(self) -> bool:
        return quarantine_due(self.facts)


# =========================================================================== block lifecycle


class BlockState(enum.IntEnum):
    """Where a block is. Integer codes, as ``BlockLedger.block_state`` returns them."""

    FREE = 0
    OWNED = 1  # held by a running request, no open grant touches it
    EXPOSED = 2  # held by a running request, >= 1 open grant touches it
    DRAINING = 3  # every holder ended, a grant is still open
    QUIESCED = 4  # every holder ended, no open grant: waits for release to the pool
    QUARANTINED = 5  # draining past a deadline without proof: out of circulation

    @property
    def label(self) -> str:
        return self.name.lower()


class BlockEvent(enum.Enum):
    ACQUIRED = "acquired"
    SHARED = "shared"
    EXPOSED = "exposed"
    GRANT_CLOSED = "grant_closed"
    HOLDER_ENDED = "holder_ended"
    HOLDER_RELEASED = "holder_released"
    QUARANTINED = "quarantined"
    FORCE_RELEASED = "force_released"


class BlockFacts(Protocol):
    """What the block guards may look at, counted after the event."""

    holders: int  # requests holding the block (not yet released)
    live_holders: int  # of those, requests their owner has not ended
    open_grants: int  # open grants touching the block
    open_write_grants: int  # of those, grants that may write


def no_open_grant(f: BlockFacts) -> bool:
    return f.open_grants == 0


def block_has_open_grant(f: BlockFacts) -> bool:
    return f.open_grants > 0


def no_live_holder(f: BlockFacts) -> bool:
    return f.live_holders == 0


def has_live_holder(f: BlockFacts) -> bool:
    return f.live_holders > 0


def no_holder(f: BlockFacts) -> bool:
    return f.holders == 0


def has_holder(f: BlockFacts) -> bool:
    return f.holders > 0


def no_open_write_grant(f: BlockFacts) -> bool:
    """Sharing is only allowed while the block's content is settled."""
    return f.open_write_grants == 0


def write_needs_single_holder(f: BlockFacts) -> bool:
    """A write grant is refused on a block with more than one holder."""
    return f.open_write_grants == 0 or f.holders == 1


BLOCK_GUARDS: Mapping[str, Callable[[BlockFacts], bool]] = {
    "no_open_grant": no_open_grant,
    "has_open_grant": block_has_open_grant,
    "no_live_holder": no_live_holder,
    "has_live_holder": has_live_holder,
    "no_holder": no_holder,
    "has_holder": has_holder,
    "no_open_write_grant": no_open_write_grant,
    "write_needs_single_holder": write_needs_single_holder,
}


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

    def no_open_grant(self) -> bool:
        return no_open_grant(self.facts)

    def has_open_grant(self) -> bool:
        return block_has_open_grant(self.facts)

    def no_live_holder(self) -> bool:
        return no_live_holder(self.facts)

    def has_live_holder(self) -> bool:
        return has_live_holder(self.facts)

    def no_holder(self) -> bool:
        return no_holder(self.facts)

    def has_holder(self) -> bool:
        return has_holder(self.facts)

    def no_open_write_grant(self) -> bool:
        return no_open_write_grant(self.facts)

    def write_needs_single_holder(self) -> bool:
        return write_needs_single_holder(self.facts)


SPECS: Mapping[str, type[StateMachine]] = {"request": RequestLifecycle, "block": BlockLifecycle}
