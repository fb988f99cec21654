"""Who may prove what: each claim, and the sources that may make it
(docs/contract.md#provenance-who-may-prove-what; the table: docs/evidence.md). The rules are
data, in ``RULES``; ``kvlifetime evidence`` prints them, the ledger checks every piece of
evidence against them before it looks at anything else, and the verifier's lying peer sends
every claim they forbid.

Provenance cannot stop a peer from lying about its *own* transfers; it stops it from speaking
for others and from claiming what only the memory owner can know. ``RESTS_ON_PEER`` names the
claims whose only source, in a disaggregated deployment, may be the peer's word - where the
memory owner can observe landing itself (a NIXL notification, a target-side check of the
arena), prefer that local observation.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvlifetime.errors import UnauthorizedEvidence
from kvlifetime.evidence import Claim, Evidence
from kvlifetime.grant import PeerId
from kvlifetime.source import SourceKind


@attrs.frozen(slots=True)
class Rule:
    """Who may make one claim."""

    claim: Claim
    local: bool  # this process's own adapters, clock, failure detector or fences may make it
    own_peer: bool  # the peer a grant is to may make it about that grant (never about others)
    who: str  # who can know it
    never: str  # who must never be believed about it


RULES: Mapping[Claim, Rule] = {
    r.claim: r
    for r in (
        Rule(
            Claim.CANCEL_RECEIVED,
            local=True,
            own_peer=True,
            who="the peer itself, over its own connection; or a local adapter driving the "
            "engine that posts the transfers",
            never="anyone speaking for another peer",
        ),
        Rule(
            Claim.SCHEDULING_STOPPED,
            local=True,
            own_peer=True,
            who="the peer itself (only it knows what it will post); or a local adapter that "
            "does the posting",
            never="anyone speaking for another peer",
        ),
        Rule(
            Claim.TRANSFERS_ENDED,
            local=True,
            own_peer=True,
            who="the side whose engine observes completion with proof: the initiator's engine "
            "status (Mooncake TCP v2 COMPLETED, NIXL DONE) relayed by the peer that owns that "
            "engine, or observed locally (a target-side notification, an arena check)",
            never="a peer speaking about a grant that is not its own",
        ),
        Rule(
            Claim.ACCESS_REVOKED,
            local=True,
            own_peer=False,
            who="only the memory owner's own side: the local adapter that performed a fence "
            "and observed it complete",
            never="the wire: a peer cannot revoke itself by saying so",
        ),
        Rule(
            Claim.DEADLINE_PASSED,
            local=True,
            own_peer=False,
            who="the local clock",
            never="a peer: time is the local side's to tell (and it proves nothing about memory)",
        ),
        Rule(
            Claim.HEARTBEAT_FAILED,
            local=True,
            own_peer=False,
            who="the local failure detector",
            never="a peer: a heartbeat is the local side's to judge (and proves nothing about "
            "memory)",
        ),
    )
}

RESTS_ON_PEER: frozenset[Claim] = frozenset(
    c for c, r in RULES.items() if r.own_peer and c is not Claim.ACCESS_REVOKED
)
"""Claims a peer may make about its own grants: believed on its word when no local
observation exists."""

# Evidence classes whose every claim a peer may make about its own grant (precomputed: the
# ledger checks this on the hot path with one set lookup).
_PEER_MAY: dict[type[Evidence], bool] = {}


def peer_may_assert(cls: type[Evidence]) -> bool:
    """Whether a peer may send evidence of class ``cls`` about its own grant."""
    ok = _PEER_MAY.get(cls)
    if ok is None:
        ok = _PEER_MAY[cls] = bool(cls.PROVES) and all(RULES[c].own_peer for c in cls.PROVES)
    return ok


def check_source(ev: Evidence) -> None:
    """Refuse (``UnauthorizedEvidence``) evidence its source may not assert, before the grant
    is even looked up: a claim a peer may never make, or a peer naming another peer."""
    src = ev.source
    if src.kind is SourceKind.LOCAL:
        return
    if not peer_may_assert(type(ev)):
        denied = sorted(c.value for c in ev.PROVES if not RULES[c].own_peer)
        raise UnauthorizedEvidence(
            f"{ev.kind} from {src}: a peer may not claim {', '.join(denied)} "
            f"({'; '.join(RULES[Claim(c)].never for c in denied)})",
            evidence=ev,
        )
    named: PeerId | None = getattr(ev, "peer", None)
    if named != src.identity:
        raise UnauthorizedEvidence(
            f"{ev.kind} from {src} speaks for peer {named!r}: a peer may only speak for itself",
            evidence=ev,
        )


def check_grant_peer(ev: Evidence, grant_peer: PeerId) -> None:
    """Refuse evidence from a peer about a grant that is not its own."""
    src = ev.source
    if src.kind is not SourceKind.LOCAL and src.identity != grant_peer:
        raise UnauthorizedEvidence(
            f"{ev.kind} from {src} is about a grant to {grant_peer!r}: a peer may only speak "
            "about its own grants",
            evidence=ev,
        )


def rules_matrix() -> list[dict[str, object]]:
    """The rules as rows of plain data (``kvlifetime evidence``)."""
    return [
        {
            "claim": r.claim.value,
            "local": r.local,
            "own_peer": r.own_peer,
            "who": r.who,
            "never": r.never,
            "rests_on_peer_word": r.claim in RESTS_ON_PEER,
        }
        for r in RULES.values()
    ]
