"""The specification's vocabulary: the states, events and guards of the three lifecycles.

The python-statemachine classes that arrange them into transitions are in
``kvlifetime.spec.lifecycles``; this module is what they are made of and what the ledger's fast
path needs too, in plain Python, so that a ledger that is not checked never imports
python-statemachine. The contract they encode is docs/contract.md (#request-lifecycle,
#block-lifecycle, #precise-rules).

Guards are named conditions over *facts*: what has been proven about each grant
(``kvlifetime.spec.proof.GrantProof``) and, for blocks, how many holders and grants touch it.
The caller updates the facts first, then sends the event; a guard reads the facts as they are
after the event. Each guard is written once, as a function in ``RequestGuards`` / ``BlockGuards``;
``REQUEST_GUARDS`` / ``BLOCK_GUARDS`` map the names to them (the compiled tables call these), and
the lifecycle classes get their condition methods from the same maps, so the tables and the
classes evaluate exactly the same code.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from kvlifetime.spec.proof import GrantProof

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


class RequestGuards:
    """The request guards, each written once: ``REQUEST_GUARDS`` maps each name to its function
    (what the compiled tables call), and ``RequestLifecycle`` gets a condition method of the same
    name from it (what its ``cond=`` names). A guard's name is the one its table rows show."""

    # Plain loops, not all(<genexpr>): the ledger evaluates these on its hot path.

    @staticmethod
    def all_cancel_received(f: RequestFacts) -> bool:
        """Every open grant's peer received the cancel (vacuously true with no open grant)."""
        for p in f.open_proofs():  # noqa: SIM110
            if not p.cancel_acknowledged:
                return False
        return True

    @staticmethod
    def all_scheduling_stopped(f: RequestFacts) -> bool:
        """Every open grant's peer stopped scheduling transfers for it."""
        for p in f.open_proofs():  # noqa: SIM110
            if not p.scheduling_stopped:
                return False
        return True

    @staticmethod
    def all_grants_closed(f: RequestFacts) -> bool:
        """No grant of the request is open: no peer can touch its blocks any more."""
        for _ in f.open_proofs():
            return False
        return True

    @staticmethod
    def has_open_grant(f: RequestFacts) -> bool:
        """Some grant of the request is still open."""
        for _ in f.open_proofs():
            return True
        return False

    @staticmethod
    def quarantine_due(f: RequestFacts) -> bool:
        """Some open grant is suspect: its deadline passed, its lease expired or its peer was
        lost."""
        for p in f.open_proofs():  # noqa: SIM110
            if p.suspect is not None:
                return True
        return False


def _guards_of(namespace: type) -> dict[str, Callable[[Any], bool]]:
    """Every guard a ``*Guards`` class defines, by name, in definition order."""
    return {
        name: getattr(namespace, name)
        for name, value in vars(namespace).items()
        if isinstance(value, staticmethod)
    }


REQUEST_GUARDS: Mapping[str, Callable[[RequestFacts], bool]] = _guards_of(RequestGuards)


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


class BlockGuards:
    """The block guards, each written once (as ``RequestGuards``): ``BLOCK_GUARDS`` for the
    tables, condition methods of the same names for ``BlockLifecycle``."""

    @staticmethod
    def no_open_grant(f: BlockFacts) -> bool:
        """No open grant touches the block: no peer may reach it."""
        return f.open_grants == 0

    @staticmethod
    def has_open_grant(f: BlockFacts) -> bool:
        """Some open grant touches the block."""
        return f.open_grants > 0

    @staticmethod
    def no_live_holder(f: BlockFacts) -> bool:
        """Every holder's owner has ended its request."""
        return f.live_holders == 0

    @staticmethod
    def has_live_holder(f: BlockFacts) -> bool:
        """Some holder's request is still running."""
        return f.live_holders > 0

    @staticmethod
    def no_holder(f: BlockFacts) -> bool:
        """No request holds the block any more: it may return to the pool."""
        return f.holders == 0

    @staticmethod
    def has_holder(f: BlockFacts) -> bool:
        """Some request still holds the block."""
        return f.holders > 0

    @staticmethod
    def no_open_write_grant(f: BlockFacts) -> bool:
        """Sharing is only allowed while the block's content is settled."""
        return f.open_write_grants == 0

    @staticmethod
    def write_needs_single_holder(f: BlockFacts) -> bool:
        """A write grant is refused on a block with more than one holder."""
        return f.open_write_grants == 0 or f.holders == 1


BLOCK_GUARDS: Mapping[str, Callable[[BlockFacts], bool]] = _guards_of(BlockGuards)


# =========================================================================== engine side


class EngineState(enum.Enum):
    """Where a request is as a guard in the engine sees it: what the engine may do with its
    blocks and its id. ``handed_back`` is final (the guard forgets the request)."""

    RUNNING = "running"  # the engine runs it; the guard holds no exposure of it
    LOADING = "loading"  # running; an asynchronous load may still write its blocks
    LOAD_RECEIVED = "load_received"  # running; the engine was handed its load's receive
    LOAD_FAILED = "load_failed"  # running; its load failed: nothing proves what still lands
    RECEIVE_HELD = "receive_held"  # load_failed, and its receive came: withheld until a fence
    FENCED = "fenced"  # a fence ended its failed load: the held receive is due, once
    READING = "reading"  # running; a peer may read its blocks (the id left the process)
    ENDED = "ended"  # the engine ended it with nothing exposed: frees it on its own id
    WITHHELD = "withheld"  # ended with an exposure unproven: the engine keeps its blocks
    QUARANTINED = "quarantined"  # withheld, and no proof will come: only a fence ends it
    RELEASABLE = "releasable"  # the ledger released it: its id is due to the engine, once
    HANDED_BACK = "handed_back"  # the engine was handed its id: forgotten


class EngineEvent(enum.Enum):
    """What happens to a request on the engine's side: the engine's signals (``admitted``,
    ``finished``, ``aborted``, ``load_landed``, ``reads_done``, ``load_failed``,
    ``lease_expired``), the guard's own steps (``load_granted``, ``read_granted``,
    ``grant_refused``, ``deadline``, ``fenced``, ``handed_back``) and the ledger's verdict
    (``released``). A signal with no row for the request's state, or whose guard does not hold,
    proves nothing: the guard refuses it (``kvlifetime.guard.Refusal``), never passes it on."""

    ADMITTED = "admitted"
    LOAD_GRANTED = "load_granted"
    READ_GRANTED = "read_granted"
    GRANT_REFUSED = "grant_refused"
    LOAD_LANDED = "load_landed"
    READS_DONE = "reads_done"
    LOAD_FAILED = "load_failed"
    LEASE_EXPIRED = "lease_expired"
    DEADLINE = "deadline"
    FINISHED = "finished"
    ABORTED = "aborted"
    FENCED = "fenced"
    RELEASED = "released"
    HANDED_BACK = "handed_back"


class EngineFacts(Protocol):
    """What the engine-side guards may look at: the request's exposures as the guard holds
    them, after the event."""

    write_open: bool  # a WRITE grant of the request is open in the ledger
    write_failed: bool  # its load was reported failed: no receive proves what still lands
    read_open: bool  # a READ grant of the request is open in the ledger
    read_this_step: bool  # that READ grant was made in the scheduler step now running
    read_reaped: bool  # its lease was reaped: no report of reads done proves them over


class EngineGuards:
    """The engine-side guards, each written once (as ``RequestGuards``): ``ENGINE_GUARDS`` for
    the compiled table, condition methods of the same names for ``EngineSideLifecycle``."""

    @staticmethod
    def load_provable(f: EngineFacts) -> bool:
        """A load's WRITE grant is open and its load did not fail: a receive proves it landed."""
        return f.write_open and not f.write_failed

    @staticmethod
    def has_open_write(f: EngineFacts) -> bool:
        """A load's WRITE grant is open."""
        return f.write_open

    @staticmethod
    def has_open_read(f: EngineFacts) -> bool:
        """A READ grant is open: a peer may still be reading."""
        return f.read_open

    @staticmethod
    def reads_provable(f: EngineFacts) -> bool:
        """A READ grant is open, its block ids left the process in an earlier step, and its
        lease was not reaped: a report of reads done can prove them over. (In the step that
        grants it no peer has the ids yet, so such a report is a stale one of an earlier
        request with the same id; after a reaped lease, a report is another rank's or a
        repeat.)"""
        return f.read_open and not f.read_this_step and not f.read_reaped


ENGINE_GUARDS: Mapping[str, Callable[[EngineFacts], bool]] = _guards_of(EngineGuards)

GUARDS: Mapping[str, Mapping[str, Callable[[Any], bool]]] = {
    "request": REQUEST_GUARDS,
    "block": BLOCK_GUARDS,
    "engine": ENGINE_GUARDS,
}
"""Each machine's guards, by the machine's name (as ``lifecycles.SPECS`` names its class)."""
