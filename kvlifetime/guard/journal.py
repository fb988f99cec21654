"""StepJournal: the READ exposures a scheduler step made, turned into ledger work once.

The hooks an engine calls per request do no ledger work in the common case: an ended request
whose block ids go to a remote reader is appended here (request, ids, how it ended), and once
per step ``flush`` makes the step's READ grants in one ``StepLedger.grant_many`` and ends the
requests in one ``end_many`` per way of ending (grant handles and codes: no object per
request). Each item is granted or refused on its own; a refused one's ids must not leave the
process (``take_refused``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlifetime.errors import KVLifetimeError
from kvlifetime.grant import Access
from kvlifetime.guard.holds import Holds
from kvlifetime.guard.refusals import RefusalKind, Refusals
from kvlifetime.ledger.step_ledger import StepLedger


class StepJournal:
    """One guard's journal of the step in progress (the engine's scheduler thread only)."""

    def __init__(
        self, ledger: StepLedger, peer: str, holds: Holds[int], refusals: Refusals
    ) -> None:
        self.ledger = ledger
        self.peer = peer
        self.holds = holds
        self.refusals = refusals
        self._due: list[tuple[str, Sequence[int], bool]] = []  # (request, block ids, aborted)
        self._refused: list[str] = []  # requests whose READ grant ``flush`` refused

    def __len__(self) -> int:
        return len(self._due)

    def append(self, request: str, block_ids: Sequence[int], aborted: bool) -> None:
        """``request`` ended; its ``block_ids`` go to a remote reader with this step's output."""
        self._due.append((request, block_ids, aborted))

    def flush(self) -> None:
        """The journal into the ledger: the READ grants in one batch call, then the ends. A
        refused grant is a refusal (``exposed_block_reused``), its hold stays ``ended`` with
        nothing exposed, and its id is kept for ``take_refused``."""
        due = self._due
        if not due:
            return
        self._due = []
        grants = self.grant_many([(r, ids) for r, ids, _ in due], Access.READ)
        ends: tuple[list[str], list[str]] = ([], [])  # finished, aborted
        holds = self.holds
        step = holds.step
        for (request, _, aborted), grant in zip(due, grants, strict=True):
            if isinstance(grant, KVLifetimeError):
                self.refusals.refuse(RefusalKind.EXPOSED_BLOCK_REUSED, request, grant)
                holds.fire(request, "grant_refused")
                self._refused.append(request)
                continue
            hold = holds.get(request) or holds.admit(request)
            hold.read, hold.read_step, hold.read_reaped = grant, step, False
            holds.fire(request, "read_granted", hold)
            ends[aborted].append(request)
        finished, aborted_ = ends
        for keys, aborted in ((finished, False), (aborted_, True)):
            if keys:
                for i, error in self.ledger.end_many(keys, aborted=aborted):
                    self.refusals.refuse(RefusalKind.FINISH_REFUSED, keys[i], error)

    def take_refused(self) -> list[str]:
        """The requests whose READ grant ``flush`` refused since the last call (each once)."""
        out, self._refused = self._refused, []
        return out

    def grant_many(
        self, items: Sequence[tuple[str, Sequence[int]]], access: Access
    ) -> list[int | KVLifetimeError]:
        """A step's grants in one ledger call: for each item its grant's handle, or the typed
        refusal (each request's holds and grant are all or nothing)."""
        if not items:
            return []
        return self.ledger.grant_many(items, self.peer, access)
