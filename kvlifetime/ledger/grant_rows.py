"""GrantRows: the grant table of the step-columnar ledger, one column per field, by handle.

A grant is a row (an integer handle, reused once its request is released): the slot of its
request, open or not, its blocks and access, its peer, its own deadline, its serial (counted up
and never reused, as a ``GrantId``'s), and what has been proven about it
(``spec.proof.ProofColumns``). The open grants of each peer are kept in grant order (a peer's
``PeerLost`` or fence reaches them all), the live ones by serial (evidence names its grant by
serial). ``record`` applies one checked claim to a row and says, as flags, what changed for
the request's counters; the request side (``StepRows``) moves them.

Part of the step-columnar ledger being built (issue 32); held to the object ledger by
``tests/test_step_rows.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from kvlifetime.errors import KVLifetimeError, MismatchedEvidence, StaleEvidence
from kvlifetime.grant import BlockIds
from kvlifetime.ledger.block_rows import READ
from kvlifetime.spec.proof import ProofColumns

_NO_BLOCKS = np.empty(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False

# What ``record`` changed, as bits.
CHANGED, ACKED, STOPPED, SUSPECTED, CLOSED, SUSPECT_AT_CLOSE = (1, 2, 4, 8, 16, 32)


class GrantRows:
    """The grants of one ledger's live requests, as columns."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation  # in every grant's label, as in a GrantId
        self.proofs = ProofColumns()
        self.req: list[int] = []  # per row: its request's slot
        self.open: list[bool] = []
        self.blocks: list[BlockIds] = []
        self.access: list[int] = []
        self.peer: list[Hashable] = []
        self.deadline: list[float] = []  # inf: only the request's deadline applies
        self.serial: list[int] = []
        self.next_serial = 1
        self.row_of_serial: dict[int, int] = {}  # the live grants, by serial
        self.by_peer: dict[Hashable, dict[int, None]] = {}  # open rows per peer, in order
        self.free_rows: list[int] = []

    def add(self, slot: int) -> int:
        """A new open row of request ``slot``, nothing proven, no blocks yet; its handle."""
        serial = self.next_serial
        self.next_serial = serial + 1
        if self.free_rows:
            row = self.free_rows.pop()
            self.proofs.reset(row)
            self.req[row] = slot
            self.open[row] = True
            self.blocks[row] = _NO_BLOCKS
            self.access[row] = READ
            self.peer[row] = None
            self.deadline[row] = math.inf
            self.serial[row] = serial
        else:
            row = self.proofs.add()
            self.req.append(slot)
            self.open.append(True)
            self.blocks.append(_NO_BLOCKS)
            self.access.append(READ)
            self.peer.append(None)
            self.deadline.append(math.inf)
            self.serial.append(serial)
        self.row_of_serial[serial] = row
        return row

    def expose(
        self, row: int, arr: BlockIds, access: int, peer: Hashable, deadline: float | None
    ) -> None:
        """Row ``row`` is a grant of ``access`` over ``arr`` to ``peer``."""
        self.blocks[row] = arr
        self.access[row] = access
        self.peer[row] = peer
        self.by_peer.setdefault(peer, {})[row] = None
        if deadline is not None:
            self.deadline[row] = deadline

    def record(self, row: int, code: int, seq: int) -> int:
        """One checked claim about open row ``row``: what changed, as bits (``CHANGED``;
        then ``ACKED``, ``STOPPED``, ``SUSPECTED``, ``CLOSED`` (the row is closed now),
        ``SUSPECT_AT_CLOSE``)."""
        proofs = self.proofs
        acked = proofs.cancel_acknowledged(row)
        stopped = proofs.scheduling_stopped(row)
        suspect = proofs.suspect[row] != 0
        if not proofs.record(row, code, seq):
            return 0
        bits = CHANGED
        if not acked and proofs.cancel_acknowledged(row):
            bits |= ACKED
        if not stopped and proofs.scheduling_stopped(row):
            bits |= STOPPED
        now_suspect = proofs.suspect[row] != 0
        if now_suspect and not suspect:
            bits |= SUSPECTED
        if proofs.closed(row):
            self.close(row)
            bits |= CLOSED | (SUSPECT_AT_CLOSE if now_suspect else 0)
        return bits

    def close(self, row: int) -> None:
        """Row ``row`` is proven over (or let go): no longer open, nor among its peer's."""
        self.open[row] = False
        peer = self.peer[row]
        peer_open = self.by_peer.get(peer)
        if peer_open is not None:
            peer_open.pop(row, None)
            if not peer_open:
                del self.by_peer[peer]

    def forget(self, rows: Sequence[int]) -> None:
        """The rows of a released request: gone (their serials stale from now on), reused."""
        for row in rows:
            del self.row_of_serial[self.serial[row]]
        self.free_rows += rows

    def lookup(
        self,
        serials: Sequence[int],
        requests: Sequence[Hashable],
        peers: Sequence[Hashable],
        key_of: Callable[[int], Hashable],
    ) -> list[int | KVLifetimeError]:
        """The handle of each grant a piece of evidence names (serial, request, peer), or the
        typed refusal: ``StaleEvidence`` for a grant whose request was released,
        ``MismatchedEvidence`` for one never issued or one of another request or peer."""
        out: list[int | KVLifetimeError] = []
        for serial, request, peer in zip(serials, requests, peers, strict=True):
            row = self.row_of_serial.get(serial)
            if row is None:
                if serial < self.next_serial:
                    out.append(StaleEvidence(f"grant {serial}: its request was already released"))
                else:
                    out.append(MismatchedEvidence(f"grant {serial} was never issued"))
            elif key_of(self.req[row]) != request or self.peer[row] != peer:
                out.append(MismatchedEvidence(f"grant {serial} is of another request or peer"))
            else:
                out.append(row)
        return out

    def label(self, row: int) -> str:
        """``"incarnation#serial (peer)"``, as ``InsufficientEvidence`` names an open grant."""
        return f"{self.incarnation}#{self.serial[row]} ({self.peer[row]})"


__all__ = ["ACKED", "CHANGED", "CLOSED", "STOPPED", "SUSPECTED", "SUSPECT_AT_CLOSE", "GrantRows"]
