"""Reports: what an engine says about an exposure, turned into evidence for the ledger.

An engine reports that a load landed or failed, that a peer's reads are over, or that a send
lease was reaped. Each report fires the engine-side table's row first (``Holds.fire``: a report
the request's state does not allow is a refusal, data); only then does it become evidence:
``TransferCompleted`` of the grant it proves (its handle queued, proven in one batch at
``settle``), or ``LeaseExpired`` of one nothing can prove any more (a failed load, a reaped
lease). No evidence object is built: the claims are the ledger's codes over grant handles.
"""

from __future__ import annotations

import structlog

from kvlifetime.evidence import LeaseExpired, TransferCompleted
from kvlifetime.guard.holds import Holds
from kvlifetime.guard.refusals import Refusal, RefusalKind, Refusals
from kvlifetime.ledger.step_ledger import StepLedger

_log = structlog.get_logger("kvlifetime.guard")

_WITHHELD = frozenset({"withheld", "quarantined"})


class Reports:
    """One guard's intake of the engine's reports (the engine's scheduler thread)."""

    def __init__(self, ledger: StepLedger, holds: Holds[int], refusals: Refusals) -> None:
        self.ledger = ledger
        self.holds = holds
        self.refusals = refusals
        self._proofs: list[int] = []  # the grants the output proves, for ``settle``
        self._proven_of: list[str] = []  # the request of each of ``_proofs``
        self._landed: list[str] = []  # running holds whose load landed, for ``settle``
        self.lease_reaped = 0  # reaped leases turned into LeaseExpired on a READ grant
        self.load_failed_count = 0  # failed loads turned into LeaseExpired on a WRITE grant

    def load_landed(self, request: str) -> Refusal | None:
        """A receive for a hold: a proof of its load's WRITE grant, a failed load's receive
        (held), or with nothing exposed the engine's own. None when the row fired."""
        hold = self.holds.get(request) or self.holds.admit(request)
        before = hold.state
        refusal = self.holds.fire(request, "load_landed", hold)
        if refusal is None and hold.write is not None and before in ("loading", *_WITHHELD):
            self._prove(request, hold.write, ended=before != "loading")
        elif refusal is None and before == "load_failed":
            _log.warning(
                "guard_receive_held",
                engine=self.refusals.engine,
                request=request,
                why="a failed load proves nothing about what still lands; held until a fence",
            )
        return refusal

    def reads_done(self, request: str) -> Refusal | None:
        """A report that a peer's reads are over: a proof of the READ grant (never in the
        step that made it, never after a reaped lease). None when the row fired."""
        hold = self.holds.get(request) or self.holds.admit(request)
        refusal = self.holds.fire(request, "reads_done", hold)
        if refusal is None and hold.read is not None:
            self._prove(request, hold.read, ended=hold.state != "running")
        return refusal

    def load_failed(self, request: str) -> Refusal | None:
        """The load was reported failed: ``LeaseExpired`` on its WRITE grant (nothing proves
        what still lands)."""
        hold = self.holds.get(request)
        if hold is None or hold.write is None or hold.write_failed:
            return None
        refusal = self.holds.fire(request, "load_failed", hold)
        if refusal is None:
            hold.write_failed = True
            self.load_failed_count += 1
            self._expire(request, hold.write)
        return refusal

    def lease_expired(self, request: str) -> Refusal | None:
        """Only time passed for the READ grant (a reaped lease): ``LeaseExpired`` on it."""
        hold = self.holds.get(request)
        if hold is None or hold.read is None or hold.read_reaped:
            return None
        refusal = self.holds.fire(request, "lease_expired", hold)
        if refusal is None:
            hold.read_reaped = True
            self.lease_reaped += 1
            self._expire(request, hold.read)
        return refusal

    def settle(self) -> bool:
        """After a batch of reports: the proofs applied (``_prove`` queues them) and the running
        holds whose load landed ended in the ledger. True when there were proofs (the caller
        collects what the ledger released)."""
        proofs, self._proofs = self._proofs, []
        landed, self._landed = self._landed, []
        if proofs:
            for i in self.ledger.prove(proofs, TransferCompleted):
                self.refusals.refuse(RefusalKind.EVIDENCE_REFUSED, self._proven_of[i])
        if landed:
            for i, error in self.ledger.end_many(landed, aborted=False):
                self.refusals.refuse(RefusalKind.FINISH_REFUSED, landed[i], error)
        self._proven_of = []
        return bool(proofs)

    def _prove(self, request: str, handle: int, *, ended: bool) -> None:
        self._proofs.append(handle)
        self._proven_of.append(request)
        if not ended:
            self._landed.append(request)

    def _expire(self, request: str, handle: int) -> None:
        if self.ledger.prove([handle], LeaseExpired):
            self.refusals.refuse(RefusalKind.EVIDENCE_REFUSED, request)
