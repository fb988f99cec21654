"""What the ledger hands back: the transitions a call fired, a batch call's outcome and the
``stats()`` snapshot.

Plain immutable values, kept apart from ``BlockLedger`` itself: they carry no rule, and a reader
(a log processor, the Prometheus collector, a test) needs them without the ledger's internals.
``from kvlifetime.ledger import LedgerStats, QuarantineInfo, Transition`` is the public path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.errors import KVLifetimeError
from kvlifetime.grant import BlockIds, Grant, PeerId, RequestKey


class Transition(NamedTuple):
    """One named request transition that fired.

    A NamedTuple rather than an attrs class: several are built per request on the hot path,
    and a tuple is built in a third of the time. It is just as immutable.
    """

    request: RequestKey
    event: str  # the named transition: rejected, cancel_received, ..., force_released
    source: str  # RequestState value before
    target: str  # RequestState value after
    cause: str  # the evidence class name, or the call: reject, finish, release, expire, ...
    grant: str | None = None  # the grant the evidence was about, as "incarnation#serial"
    peer: PeerId | None = None
    unsafe: bool = False  # force_released: never the normal path


class Refusal(NamedTuple):
    """One item of a per-step batch call (``apply_many``, ``finish_many``, ``reject_many``,
    ``acquire_and_grant_many``) that was refused: the single call (``apply``, ``finish``, ...)
    would have raised ``error`` for it, and it changed nothing."""

    position: int  # where it was in the batch (0-based)
    item: object  # the evidence, or the request key, as given
    error: KVLifetimeError  # the typed error the single call raises: whose fault, and why


@attrs.frozen(slots=True)
class BatchOutcome:
    """What a per-step batch call did, item by item, as data.

    Every item was applied or refused on its own, exactly as the single call would have done
    it at that point of the batch: ``transitions`` lists what the applied ones fired (batch
    order, then firing order; the same ``Transition`` values the single calls return, joined),
    ``refused`` lists the others with the typed error each single call raises. A refused item
    changed nothing. The call never raises for one bad item, so a scheduler's step goes on.
    """

    transitions: tuple[Transition, ...]
    refused: tuple[Refusal, ...]  # in batch order; empty: every item was applied
    # acquire_and_grant_many: the grant of each item applied, in batch order (else empty)
    grants: tuple[Grant, ...] = ()

    @property
    def ok(self) -> bool:
        """True when no item was refused."""
        return not self.refused


@attrs.frozen(slots=True)
class QuarantineInfo:
    request: RequestKey
    blocks: int  # blocks the request still holds
    reason: str  # deadline / lease_expired / peer_lost
    since: float | None  # caller's clock when quarantined (None: evidence-driven, no clock seen)
    age: float | None  # now - since, when stats() was given ``now``


@attrs.frozen(slots=True)
class LedgerStats:
    num_blocks: int
    blocks_by_state: dict[str, int]  # BlockState label -> count; sums to num_blocks
    requests_by_state: dict[str, int]  # RequestState value -> live requests
    quarantined: tuple[QuarantineInfo, ...]
    unsafe_releases: int  # force_release calls that released a request with an open grant
    refused_evidence: dict[str, int]  # error kind -> count
    open_grants: int
    # fence name -> blocks put back in the pool by releases a fence made possible (a grant of
    # the request was closed by AccessRevoked); only grows
    reclaimed_blocks: dict[str, int] = attrs.field(factory=dict)


@attrs.frozen(slots=True, eq=False)
class RequestInternals:
    """One live request as the ledger keeps it (``LedgerInternals.requests``)."""

    state: str  # RequestState value
    deadline: float | None  # the request-wide deadline, on the caller's clock
    excl: tuple[BlockIds, ...]  # the batches held exclusively (read-only arrays, as kept)
    shared: tuple[BlockIds, ...]  # the batches held shared (every hold, with engine counts)


@attrs.frozen(slots=True, eq=False)
class LedgerInternals:
    """A copy of what a ledger keeps inside, as data (``BlockLedger.inspect``): for tests,
    debugging and memory figures. Not part of the contract: the fields follow the
    implementation (``kvlifetime/ledger/blocks.py`` says what each per-block array holds)."""

    counts: str  # "ledger" or "engine"
    owner: npt.NDArray[np.int32] | None  # the exclusive holder's slot per block (ledger counts)
    sharers: npt.NDArray[np.uint16]  # shared holders per block (every holder: engine counts)
    generation: npt.NDArray[np.uint32]
    unsettled: npt.NDArray[Any]  # open write grants per block (kept only while ``tracking``)
    readers: npt.NDArray[Any]  # open read grants per block (kept only while ``tracking``)
    tracking: bool  # the two counters above are kept up to date
    open_writes: int  # open write grants counted in ``unsettled``
    open_reads: int  # open read grants counted in ``readers``
    free_stack: npt.NDArray[np.int32] | None  # the ledger's own free list (None: not built)
    free_top: int  # how many blocks the free list holds
    requests: dict[RequestKey, RequestInternals]
    releasable: tuple[RequestKey, ...]  # ready to release, in the order they became so
    timed: tuple[RequestKey, ...]  # with a deadline somewhere
    recently_released: tuple[RequestKey, ...]  # oldest first (a bounded memory)
    next_slot: int
    next_serial: int
    clock: float | None  # the last ``now`` passed to expire
    pending_events: int  # log events noted and not yet emitted (0 between calls)
    sizes: dict[str, int]  # entries of each internal map and cache (none grows with history)

    @property
    def nbytes(self) -> int:
        """Bytes of the per-block arrays, the free list included."""
        arrays = (self.owner, self.sharers, self.generation, self.unsettled, self.readers)
        total = sum(a.nbytes for a in arrays if a is not None)
        return total + (0 if self.free_stack is None else self.free_stack.nbytes)
