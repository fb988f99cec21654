"""What the ledger hands back: the transitions a call fired, a batch call's outcome and the
``stats()`` snapshot.

Plain immutable values, kept apart from ``BlockLedger`` itself: they carry no rule, and a reader
(a log processor, the Prometheus collector, a test) needs them without the ledger's internals.
``from kvlifetime.ledger import LedgerStats, QuarantineInfo, Transition`` is the public path.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from kvlifetime.errors import KVLifetimeError
from kvlifetime.grant import PeerId, RequestKey


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
    """One item of a per-step batch call (``apply_many``, ``finish_many``) that was refused:
    the single call (``apply``, ``finish``) would have raised ``error`` for it, and it changed
    nothing."""

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
