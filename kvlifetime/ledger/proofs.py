"""Evidence applied to the request table: who may say it, which grant it is about, what it
proves, and the request transitions that follow.

One piece of evidence is checked whole before anything changes (its source's authority, the
grant it names in this incarnation, contradictions with what is proven), then recorded; a grant
now proven over is closed (taken off the per-block open-grant counters) and its request
advanced along the proof chain. Refused evidence raises its typed ``EvidenceError``, is counted
and logged (``refuse``) and changes nothing.
"""

from __future__ import annotations

from kvlifetime import errors
from kvlifetime.errors import EvidenceError, MismatchedEvidence, StaleEvidence, show
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence, PeerLost, to_dict
from kvlifetime.ledger.blocks import BlockCounts
from kvlifetime.ledger.events import describe, enabled, note
from kvlifetime.ledger.records import GrantRecord
from kvlifetime.ledger.requests import RequestTable
from kvlifetime.ledger.transitions import advance
from kvlifetime.ledger.values import Transition
from kvlifetime.provenance import check_grant_peer, check_source
from kvlifetime.source import SourceKind
from kvlifetime.spec.vocabulary import RequestState

_ADMITTED = RequestState.ADMITTED.value


def apply(table: RequestTable, blocks: BlockCounts, ev: Evidence) -> list[Transition]:
    """Apply ``ev``; return the transitions it fired. Raises its ``EvidenceError`` (nothing
    changed) where it is refused; the caller counts and logs it (``refuse``)."""
    out: list[Transition] = []
    # On the type itself: a ``__class__`` property cannot pass a stranger off as evidence.
    if not issubclass(type(ev), Evidence):
        raise errors.MalformedEvidence(f"not evidence: {show(ev)}", evidence=ev)
    if ev.source.kind is not SourceKind.LOCAL:
        # Who may say it comes first: a claim a peer may not make, or a peer speaking for
        # another, is refused before the grant it names is even looked up.
        check_source(ev)
    if isinstance(ev, GrantEvidence) or (isinstance(ev, AccessRevoked) and ev.grant_id is not None):
        gid = ev.grant_id
        assert gid is not None  # AccessRevoked about one grant names it
        rec = table.grants.records.get(gid.serial) if gid.incarnation == table.incarnation else None
        if rec is None or ev.request != rec.grant.request or ev.peer != rec.peer:
            rec = _grant_record(table, ev)  # raises the precise error
        if rec.fence_only:
            _check_fence(rec, ev)
        rec.check(ev)
        # A closed grant of a live request: checked for contradictions above, else a no-op.
        changed = rec.is_open and rec.record(ev)
        if changed:
            _proven(table, blocks, rec, ev, out)
    elif isinstance(ev, AccessRevoked | PeerLost):
        recs = list(table.grants.by_peer.get(ev.peer, {}).values())
        for rec in recs:
            rec.check(ev)  # every check before any change: all or nothing
        changed = False
        for rec in recs:
            if rec.record(ev):
                changed = True
                _proven(table, blocks, rec, ev, out)
    else:
        raise errors.MalformedEvidence(f"not evidence: {show(ev)}", evidence=ev)
    if enabled():
        table.pending.append(
            ("info", "evidence_applied", {"evidence": to_dict(ev), "changed": changed})
        )
        note(table.pending, out)
    return out


def refuse(table: RequestTable, e: EvidenceError, evidence: object) -> None:
    """Count and log refused evidence (it changed nothing)."""
    table.refused[e.kind] += 1
    if enabled():
        table.pending.append(
            (
                "warning",
                "evidence_refused",
                {"error": e.kind, "message": str(e), "evidence": describe(evidence)},
            )
        )


def _proven(
    table: RequestTable,
    blocks: BlockCounts,
    rec: GrantRecord,
    ev: Evidence,
    out: list[Transition],
) -> None:
    """Something new was proven about ``rec``: close it if it now is, advance its request."""
    req = rec.req
    if rec.is_open and rec.closed:
        table.close(rec)
        if blocks.tracking:
            blocks.uncount_open(rec)
        if isinstance(ev, AccessRevoked):
            req.fenced_by = ev.fence
    if req.state != _ADMITTED:
        advance(table, req, type(ev).__name__, rec, out)


def _grant_record(table: RequestTable, ev: GrantEvidence | AccessRevoked) -> GrantRecord:
    gid = ev.grant_id
    assert gid is not None
    rec = table.grants.records.get(gid.serial) if gid.incarnation == table.incarnation else None
    if rec is None:
        raise not_live(ev, table.incarnation, table.grants.next_serial)
    check_names(ev, rec.grant.request, rec.grant.peer)
    return rec


def not_live(
    ev: GrantEvidence | AccessRevoked, incarnation: str, next_serial: int
) -> EvidenceError:
    """Why ``ev``'s grant is not a live grant of this ledger (``incarnation``; serials below
    ``next_serial`` were issued): another incarnation's or never issued
    (``MismatchedEvidence``), or its request was released (``StaleEvidence``). Both ledgers
    (records and rows) refuse with it."""
    gid = ev.grant_id
    assert gid is not None
    if gid.incarnation != incarnation:
        return MismatchedEvidence(
            f"{ev.kind} is about grant {gid} of another ledger or incarnation "
            f"(this one is {incarnation})",
            evidence=ev,
        )
    if gid.serial < next_serial:
        return StaleEvidence(
            f"{ev.kind} is about grant {gid}, whose request was already released", evidence=ev
        )
    return MismatchedEvidence(f"{ev.kind}: grant {gid} was never issued", evidence=ev)


def check_names(ev: GrantEvidence | AccessRevoked, request: object, peer: str) -> None:
    """``ev`` about a live grant of ``request`` to ``peer``: refused if a peer speaks about
    another peer's grant (``UnauthorizedEvidence``: not merely mismatched), or if it names
    another request or peer (``MismatchedEvidence``). Both ledgers check with it."""
    check_grant_peer(ev, peer)
    if ev.request != request:
        raise MismatchedEvidence(
            f"{ev.kind} names request {show(ev.request)}, grant {ev.grant_id} is of "
            f"{show(request)}",
            evidence=ev,
        )
    if ev.peer != peer:
        raise MismatchedEvidence(
            f"{ev.kind} names peer {show(ev.peer)}, grant {ev.grant_id} is to {show(peer)}",
            evidence=ev,
        )


def _check_fence(rec: GrantRecord, ev: GrantEvidence | AccessRevoked) -> None:
    """A restart's quarantine grant stands for what a previous incarnation's peer may still do
    (``after_restart``): only a fence the memory owner's side completed (a local
    ``AccessRevoked``) ends it. Any claim about it - from the peer, whose new connection may
    have learnt the grant id, or from this process - is about that old access, which no word
    can prove over: refused as evidence about another incarnation."""
    if type(ev) is AccessRevoked and ev.source.kind is SourceKind.LOCAL:
        return
    raise MismatchedEvidence(
        f"{ev.kind} from {ev.source} is about grant {rec.label}, the quarantine of a previous "
        "incarnation's access to the arena: only a completed fence (a local AccessRevoked) "
        "ends it",
        evidence=ev,
    )
