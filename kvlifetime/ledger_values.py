"""What the ledger hands back: the transitions a call fired and the ``stats()`` snapshot.

Plain immutable values, kept apart from ``BlockLedger`` itself: they carry no rule, and a reader
(a log processor, the Prometheus collector, a test) needs them without the ledger's internals.
``from kvlifetime.ledger import LedgerStats, QuarantineInfo, Transition`` keeps working.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

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
