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
