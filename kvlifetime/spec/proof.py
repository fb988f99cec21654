"""What has been proven about one grant: evidence accumulated, independent of arrival order.

This is the one place where the evidence rules live (README, "What each piece of evidence
proves"; docs/evidence.md):

- a grant is **closed** when access was revoked, or when scheduling stopped at ``last_seq = N``
  and every transfer through ``N`` ended (in either order), or when the transfer completed;
- duplicates are idempotent; a ``TransferQuiesced`` weaker than an earlier one is a late, true
  report and a no-op;
- two different ``last_seq`` for one grant contradict each other and are refused;
- ``LeaseExpired`` / ``PeerLost`` / a passed deadline only make the grant *suspect*: they never
  close it.

Sequence numbers start at 1, so ``through_seq`` starts at 0: "every transfer numbered <= 0
ended" holds vacuously, and ``SchedulingStopped(last_seq=0)`` alone closes a grant on which
nothing was ever posted.
"""

from __future__ import annotations

from typing import Any

from kvlifetime.errors import ContradictoryEvidence
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Claim,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)


class GrantProof:
    """The accumulated evidence of one grant (mutable; owned by a ledger, under its lock)."""

    __slots__ = ("cancel_received", "last_seq", "revoked", "suspect", "through_seq")

    def __new__(cls, *args: Any, **kwargs: Any) -> GrantProof:
        # A blank instance for ``snapshot.copy_slots``: compiled by mypyc (the optional
        # accelerator), the class is created blank only by a ``__new__`` of its own.
        return object.__new__(cls)

    def __init__(self) -> None:
        self.cancel_received = False  # a CancelReceived (or anything stronger) arrived
        self.last_seq: int | None = None  # set once by SchedulingStopped / TransferCompleted
        self.through_seq = 0  # max through_seq seen; only grows
        self.revoked = False  # AccessRevoked: closed whatever else is unproven
        self.suspect: str | None = None  # why it may be stuck; never closes it

    # ----------------------------------------------------------------- derived facts

    @property
    def scheduling_stopped(self) -> bool:
        return self.revoked or self.last_seq is not None

    @property
    def cancel_acknowledged(self) -> bool:
        # Spelled out rather than via scheduling_stopped: the guards call this on the hot path.
        return self.cancel_received or self.revoked or self.last_seq is not None

    @property
    def closed(self) -> bool:
        if self.revoked:
            return True
        last = self.last_seq
        return last is not None and self.through_seq >= last

    def unproven(self) -> list[str]:
        """The claims still missing before this grant is closed (empty when closed)."""
        if self.closed:
            return []
        missing: list[str] = []
        if not self.cancel_acknowledged:
            missing.append(Claim.CANCEL_RECEIVED.value)
        if self.last_seq is None:
            missing.append(Claim.SCHEDULING_STOPPED.value)
            missing.append(f"{Claim.TRANSFERS_ENDED.value} through the last posted transfer")
        else:
            missing.append(f"{Claim.TRANSFERS_ENDED.value} through seq {self.last_seq}")
        return missing

    # ----------------------------------------------------------------- accumulation

    def check(self, ev: Evidence) -> None:
        """Raise ``ContradictoryEvidence`` if ``ev`` contradicts what is proven. Mutates nothing."""
        if (
            isinstance(ev, SchedulingStopped | TransferCompleted)
            and self.last_seq is not None
            and ev.last_seq != self.last_seq
        ):
            raise ContradictoryEvidence(
                f"{ev.kind} says last_seq={ev.last_seq}, "
                f"but last_seq={self.last_seq} was already proven",
                evidence=ev,
            )

    def record(self, ev: Evidence) -> bool:
        """Add ``ev`` (already checked). Returns whether anything new was proven."""
        if isinstance(ev, SchedulingStopped | TransferCompleted):
            changed = self.last_seq is None or not self.cancel_received
            self.cancel_received = True
            self.last_seq = ev.last_seq
            if isinstance(ev, TransferCompleted) and ev.last_seq > self.through_seq:
                self.through_seq = ev.last_seq
                changed = True
            return changed
        if isinstance(ev, TransferQuiesced):
            if ev.through_seq > self.through_seq:
                self.through_seq = ev.through_seq
                return True
            return False
        if isinstance(ev, CancelReceived):
            changed = not self.cancel_received
            self.cancel_received = True
            return changed
        if isinstance(ev, AccessRevoked):
            changed = not self.revoked
            self.revoked = True
            return changed
        if isinstance(ev, LeaseExpired | PeerLost):
            before = self.suspect
            self.mark_suspect("lease_expired" if isinstance(ev, LeaseExpired) else "peer_lost")
            return self.suspect != before
        return False

    def mark_suspect(self, reason: str) -> None:
        if self.suspect is None and not self.closed:
            self.suspect = reason

    def key(self) -> tuple[bool, int | None, int, bool, str | None]:
        """Everything proven, as a hashable value (for state hashing and comparisons)."""
        return (self.cancel_received, self.last_seq, self.through_seq, self.revoked, self.suspect)

    def copy(self) -> GrantProof:
        """A plain ``GrantProof`` with the same facts."""
        p = GrantProof.__new__(GrantProof)
        p.assign(self)
        return p

    def assign(self, other: GrantProof) -> None:
        """Take over every fact of ``other``."""
        self.cancel_received = other.cancel_received
        self.last_seq = other.last_seq
        self.through_seq = other.through_seq
        self.revoked = other.revoked
        self.suspect = other.suspect

    def __repr__(self) -> str:
        return (
            f"GrantProof(cancel_received={self.cancel_received}, last_seq={self.last_seq}, "
            f"through_seq={self.through_seq}, revoked={self.revoked}, suspect={self.suspect!r})"
        )


# --------------------------------------------------------------------------- many grants at once

# The same rules over columns: one flat list per fact, one entry per grant row, for the
# step-columnar ledger (``ledger.step_rows``), where a step's work is a loop of a few list
# operations per grant and no object is made. ``ProofColumns`` must agree with ``GrantProof``
# row by row (``tests/test_proof_columns.py`` holds them to it).

CANCEL, STOPPED, QUIESCED, COMPLETED, REVOKED, LEASE, LOST = range(1, 8)
"""Claim codes: CancelReceived, SchedulingStopped, TransferQuiesced, TransferCompleted,
AccessRevoked, LeaseExpired, PeerLost."""
CODE_OF: dict[type[Evidence], int] = {
    CancelReceived: CANCEL,
    SchedulingStopped: STOPPED,
    TransferQuiesced: QUIESCED,
    TransferCompleted: COMPLETED,
    AccessRevoked: REVOKED,
    LeaseExpired: LEASE,
    PeerLost: LOST,
}
SUSPECTS: tuple[str | None, ...] = (None, "deadline", "lease_expired", "peer_lost")
"""A grant's ``suspect``, by code (0: none)."""
NO_SEQ = -1
"""``last_seq`` not proven."""


class ProofColumns:
    """``GrantProof`` of many grants: ``cancel``, ``last_seq`` (``NO_SEQ``: not proven),
    ``through``, ``revoked``, ``suspect`` (a code of ``SUSPECTS``), one entry per row."""

    __slots__ = ("cancel", "last_seq", "revoked", "suspect", "through")

    def __init__(self) -> None:
        self.cancel: list[bool] = []
        self.last_seq: list[int] = []
        self.through: list[int] = []
        self.revoked: list[bool] = []
        self.suspect: list[int] = []

    def add(self) -> int:
        """A new row, nothing proven; returns it."""
        self.cancel.append(False)
        self.last_seq.append(NO_SEQ)
        self.through.append(0)
        self.revoked.append(False)
        self.suspect.append(0)
        return len(self.cancel) - 1

    def reset(self, row: int) -> None:
        """Nothing proven about ``row`` (reused for a new grant)."""
        self.cancel[row] = False
        self.last_seq[row] = NO_SEQ
        self.through[row] = 0
        self.revoked[row] = False
        self.suspect[row] = 0

    # ----------------------------------------------------------------- derived facts

    def closed(self, row: int) -> bool:
        if self.revoked[row]:
            return True
        last = self.last_seq[row]
        return last != NO_SEQ and self.through[row] >= last

    def scheduling_stopped(self, row: int) -> bool:
        return self.revoked[row] or self.last_seq[row] != NO_SEQ

    def cancel_acknowledged(self, row: int) -> bool:
        return self.cancel[row] or self.revoked[row] or self.last_seq[row] != NO_SEQ

    def proof(self, row: int) -> GrantProof:
        """Row ``row`` as a ``GrantProof`` (built when asked: logs, queries, replay)."""
        p = GrantProof.__new__(GrantProof)
        p.cancel_received = self.cancel[row]
        last = self.last_seq[row]
        p.last_seq = None if last == NO_SEQ else last
        p.through_seq = self.through[row]
        p.revoked = self.revoked[row]
        p.suspect = SUSPECTS[self.suspect[row]]
        return p

    # ----------------------------------------------------------------- accumulation

    def contradicts(self, row: int, code: int, seq: int) -> bool:
        """``GrantProof.check``: a claim of ``code`` with ``seq`` contradicts what is proven
        (a different ``last_seq``). Mutates nothing."""
        if code not in (STOPPED, COMPLETED):
            return False
        last = self.last_seq[row]
        return last != NO_SEQ and last != seq

    def record(self, row: int, code: int, seq: int) -> bool:
        """``GrantProof.record`` of one claim ``code`` (with ``seq``: ``last_seq`` or
        ``through_seq``) on ``row`` (checked): whether anything new was proven."""
        if code in (STOPPED, COMPLETED):
            changed = self.last_seq[row] == NO_SEQ or not self.cancel[row]
            self.cancel[row] = True
            self.last_seq[row] = seq
            if code == COMPLETED and seq > self.through[row]:
                self.through[row] = seq
                changed = True
            return changed
        if code == QUIESCED:
            if seq > self.through[row]:
                self.through[row] = seq
                return True
            return False
        if code == CANCEL:
            changed = not self.cancel[row]
            self.cancel[row] = True
            return changed
        if code == REVOKED:
            changed = not self.revoked[row]
            self.revoked[row] = True
            return changed
        if code in (LEASE, LOST):
            return self.mark_suspect(row, 2 if code == LEASE else 3)
        return False

    def mark_suspect(self, row: int, reason: int) -> bool:
        """``GrantProof.mark_suspect``: the first reason sticks; never once closed. Returns
        whether the suspect changed."""
        if self.suspect[row] == 0 and not self.closed(row):
            self.suspect[row] = reason
            return True
        return False
