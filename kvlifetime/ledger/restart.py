"""A ledger that starts over an arena a previous incarnation's peers may still reach
(``BlockLedger.after_restart``): its blocks start held, exposed and quarantined.

The blocks are held by one request with one open write grant per peer of the old process, each
a *fence-only* grant (``GrantRecord.fence_only``): no claim about it is believed, only a local
``AccessRevoked`` (a completed fence) ends it. The request is then rejected and its grants
marked suspect (``previous_incarnation``), so it is quarantined at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlifetime.grant import Access, BlockIds, PeerId, RequestKey
from kvlifetime.ledger.blocks import BlockCounts
from kvlifetime.ledger.events import enabled, note
from kvlifetime.ledger.requests import RequestTable
from kvlifetime.ledger.transitions import advance
from kvlifetime.ledger.values import Transition

PREVIOUS_INCARNATION = "previous_incarnation"  # the quarantine reason after a restart


def quarantine_previous(
    table: RequestTable,
    blocks: BlockCounts,
    request: RequestKey,
    arr: BlockIds,
    peers: Sequence[PeerId],
) -> None:
    """``request`` holds ``arr`` with a fence-only write grant per peer, rejected and
    quarantined (every value validated; a fresh ledger, under its lock)."""
    if enabled():
        # What replay needs to rebuild this start: the same call on its fresh ledger.
        fields = {"request": request, "peers": list(peers), "blocks": arr.tolist()}
        table.pending.append(("info", "ledger_restarted", fields))
    req = table.hold(blocks, request, None, arr, blocks.all_shared, None)
    # One write grant per peer over the same blocks: opened directly (with the engine's
    # counts a write grant is refused where any grant is open; here every peer may write).
    held = req.all_blocks()
    for peer in peers:
        if blocks.tracking:
            blocks.count_open(held, Access.WRITE)
        table.open_grant(req, peer, held, blocks.generation.take(held), Access.WRITE, None)
    for rec in req.open.values():
        rec.fence_only = True
    table.end(request, "rejected", "reject")
    for rec in req.open.values():
        rec.mark_suspect(PREVIOUS_INCARNATION)
    out: list[Transition] = []
    advance(table, req, "after_restart", None, out)
    if enabled():
        note(table.pending, out)
