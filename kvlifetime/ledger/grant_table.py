"""The grant table: every grant of the live requests, by serial, and the open ones by peer.

A grant is named by its serial (an int, counted up from 1 and never reused in an incarnation);
its id carries the ledger's incarnation too, so evidence about another ledger's grant never
matches one here. A grant stays in the table, open or closed, as long as its request is live:
evidence about a closed grant of a live request is still checked for contradictions. When the
request is released, its grants are forgotten (the table never grows with history); a serial
below ``next_serial`` that is not here was issued and forgotten (``StaleEvidence``).

Touched only under the ledger's lock, with values the facade validated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlifetime.grant import Access, BlockIds, Generations, Grant, PeerId, make_grant, make_grant_id
from kvlifetime.ledger.records import GrantRecord, RequestRecord

if TYPE_CHECKING:
    from kvlifetime.ledger.blocks import BlockCounts


class GrantTable:
    """The grants of one ledger's live requests."""

    __slots__ = ("by_peer", "incarnation", "next_serial", "records")

    def __new__(cls, *args: Any, **kwargs: Any) -> GrantTable:
        # A blank instance for ``snapshot.copy_slots`` (see ``RequestTable.__new__``).
        return object.__new__(cls)

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation  # in every grant id: another ledger's never matches
        self.next_serial = 1
        self.records: dict[int, GrantRecord] = {}  # serial -> record, open and closed
        self.by_peer: dict[PeerId, dict[int, GrantRecord]] = {}  # open grants per peer

    def get(self, serial: int) -> GrantRecord | None:
        return self.records.get(serial)

    def __len__(self) -> int:
        return len(self.records)

    def open(
        self,
        req: RequestRecord,
        peer: PeerId,
        arr: BlockIds,
        generations: Generations,
        access: Access,
        deadline: float | None,
    ) -> Grant:
        """A new open grant of ``req`` to ``peer`` over ``arr`` (every check done)."""
        serial = self.next_serial
        self.next_serial = serial + 1
        generations.flags.writeable = False
        g = make_grant(
            make_grant_id(self.incarnation, serial), req.key, peer, arr, generations, access
        )
        rec = GrantRecord(g, req, deadline)
        req.grants[serial] = rec
        req.open[serial] = rec
        self.records[serial] = rec
        peer_open = self.by_peer.get(peer)
        if peer_open is None:
            peer_open = self.by_peer[peer] = {}
        peer_open[serial] = rec
        return g

    def close(self, rec: GrantRecord) -> None:
        """``rec`` is proven over: no longer open (it stays among its request's grants)."""
        rec.is_open = False
        serial = rec.grant.id.serial
        del rec.req.open[serial]
        self._unlist(rec.peer, serial)

    def forget(self, req: RequestRecord, blocks: BlockCounts) -> None:
        """``req`` was released: its grants are gone (an open one, only after a forced release,
        is taken off the per-block counters it was counted in)."""
        for serial, rec in req.grants.items():
            del self.records[serial]
            if serial in req.open:
                if blocks.tracking:
                    blocks.uncount_open(rec)
                self._unlist(rec.peer, serial)

    def rebuilt(self, requests: dict[Any, RequestRecord]) -> GrantTable:
        """This table over ``requests`` (copies of the live records): the same serials."""
        new = GrantTable(self.incarnation)
        new.next_serial = self.next_serial
        for req in requests.values():
            new.records.update(req.grants)
            for serial, rec in req.open.items():
                new.by_peer.setdefault(rec.peer, {})[serial] = rec
        return new

    def _unlist(self, peer: PeerId, serial: int) -> None:
        peer_open = self.by_peer[peer]
        del peer_open[serial]
        if not peer_open:
            del self.by_peer[peer]


__all__ = ["GrantTable"]
