"""The ledger's per-request and per-grant records (mutable, owned by a ``BlockLedger`` and
touched only under its lock).

A request record holds the batches of block ids it acquired and its grants; a grant record is
the grant together with what has been proven about it. They hold no rule of their own: the
ledger applies the rules; these are what the table guards read (``spec.vocabulary.RequestFacts``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifetime.grant import BlockIds, Grant, RequestKey
from kvlifetime.ledger.snapshot import copier
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.vocabulary import RequestState

if TYPE_CHECKING:
    from kvlifetime.spec.lifecycles import RequestLifecycle


class GrantRecord(GrantProof):
    """A live grant and what has been proven about it (the record *is* its proof, so the
    guards can read a request's open records directly)."""

    __slots__ = ("deadline", "fence_only", "grant", "is_open", "label", "peer", "req")

    def __init__(self, grant: Grant, req: RequestRecord, deadline: float | None) -> None:
        super().__init__()
        self.grant = grant
        self.req = req
        self.deadline = deadline  # caller's clock; None: only the request's deadline applies
        self.label = str(grant.id)  # formatted once: every transition it causes names it
        self.peer = grant.peer
        self.is_open = True  # False once closed; then it is only in req.grants
        # True for a restart's quarantine grant (``BlockLedger.after_restart``): it stands for a
        # previous incarnation's access, so no claim about it is believed, only a local fence.
        self.fence_only = False


class RequestRecord:
    """Per-request record. Implements ``spec.vocabulary.RequestFacts`` for the guards."""

    __slots__ = (
        "deadline",
        "excl",
        "fenced_by",
        "grants",
        "key",
        "machine",
        "open",
        "quarantine_reason",
        "quarantined_at",
        "shared",
        "slot",
        "state",
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> RequestRecord:
        # A blank instance for ``snapshot.copy_slots``: compiled by mypyc (the optional
        # accelerator), the class is created blank only by a ``__new__`` of its own.
        return object.__new__(cls)

    def __init__(self, key: RequestKey, slot: int, deadline: float | None) -> None:
        self.key = key
        self.slot = slot  # int32 id written in _owner; never reused within 2**31 requests
        self.state = RequestState.ADMITTED.value
        self.excl: list[BlockIds] = []  # read-only arrays acquired exclusively
        self.shared: list[BlockIds] = []  # read-only arrays acquired shared
        self.grants: dict[int, GrantRecord] = {}  # serial -> record, open and closed
        self.open: dict[int, GrantRecord] = {}  # serial -> record, open only
        self.deadline = deadline
        self.quarantine_reason: str | None = None
        self.quarantined_at: float | None = None
        self.fenced_by: str | None = None  # the fence whose AccessRevoked closed a grant of it
        self.machine: RequestLifecycle | None = None

    def copy(self) -> RequestRecord:
        """An independent copy, with copies of its grant records (``snapshot.copy_slots``:
        every field, by its kind). The python-statemachine mirror is not copied: the table
        makes a new one for a checked ledger."""
        new: RequestRecord = copier(RequestRecord, "grants", "open", "machine")(self, {}, {}, None)
        copy_grant = copier(GrantRecord, "req")
        grants, opened, still_open = new.grants, new.open, self.open
        for serial, rec in self.grants.items():
            dup = grants[serial] = copy_grant(rec, new)
            if serial in still_open:
                opened[serial] = dup
        return new

    def open_proofs(self) -> Iterable[GrantProof]:
        return self.open.values()

    def nblocks(self) -> int:
        return sum(len(a) for a in self.excl) + sum(len(a) for a in self.shared)

    def all_blocks(self) -> BlockIds:
        arrs = self.excl + self.shared
        if not arrs:
            return np.empty(0, dtype=np.int64)
        return arrs[0] if len(arrs) == 1 else np.concatenate(arrs)
