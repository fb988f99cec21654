"""StepRows: a scheduler step's ledger work on columns: requests and grants as rows.

Requests are rows of ``RequestRows`` (by slot), grants rows of the columns here (by an integer
handle, the row): the request's slot, open or not, what has been proven about it
(``spec.proof.ProofColumns``). A step's work is one call per kind, over every request or grant
of the step: ``grant``, ``prove`` (one claim per grant: the rules, the request's counters moved
by the difference, the proof chain advanced), ``end``, ``expire``, ``collect``. No ``Grant``,
evidence or ``Transition`` object is made: transitions come back as (slot, event, target)
codes; objects are built only when someone asks.

Values are trusted (the library's own handles and codes); validation stays at the facade.
Part of the step-columnar ledger being built (issue 32): the object-per-request ledger
(``requests.py``, ``records.py``) is what it is held to, step by step
(``tests/test_step_rows.py``); the facade moves onto it once it carries every call (blocks,
shared holds, fences, restart, snapshots are not here yet).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from kvlifetime.ledger.request_rows import (
    CODE,
    EVENT_CODE,
    OPEN,
    RUNNING,
    STATES,
    SUSPECT,
    UNCANCELLED,
    Moves,
    RequestRows,
)
from kvlifetime.spec.proof import SUSPECTS, ProofColumns

_ADMITTED = CODE["admitted"]
_QUIESCED = CODE["transfer_quiesced"]
_QUARANTINED = CODE["quarantined"]
_RELEASED = EVENT_CODE["released"]
_DEADLINE = SUSPECTS.index("deadline")


class StepRows:
    """The requests and grants of one ledger, as columns (the engine's counts: holds are the
    engine's business; blocks are not tracked here yet)."""

    def __init__(self) -> None:
        self.requests = RequestRows()
        self.proofs = ProofColumns()
        self.slot_of: dict[Hashable, int] = {}
        self.key_of: list[Hashable] = []
        self.free_slots: list[int] = []
        self.deadline: list[float] = []  # per request slot (inf: none)
        self.admission: list[int] = []  # per slot: its request's admission number
        self.admitted = 0
        self.grant_req: list[int] = []  # per grant row: its request's slot
        self.grant_open: list[bool] = []
        self.grants_of: dict[int, list[int]] = {}  # slot -> its rows, in grant order
        self.free_rows: list[int] = []
        self.releasable: dict[int, None] = {}  # slots in transfer_quiesced, in arrival order
        self.quarantine_reason: dict[int, str] = {}

    # ------------------------------------------------------------------ requests

    def admit(self, keys: Sequence[Hashable], deadline: float | None = None) -> list[int]:
        """New requests (keys not live); their slots."""
        dl = math.inf if deadline is None else deadline
        req = self.requests
        out = []
        for key in keys:
            if self.free_slots:
                slot = self.free_slots.pop()
                req.reset(slot)
                self.key_of[slot] = key
                self.deadline[slot] = dl
                self.admission[slot] = self.admitted
            else:
                slot = req.add()
                self.key_of.append(key)
                self.deadline.append(dl)
                self.admission.append(self.admitted)
            self.admitted += 1
            self.slot_of[key] = slot
            self.grants_of[slot] = []
            out.append(slot)
        return out

    def state(self, key: Hashable) -> str:
        return STATES[self.requests.state[self.slot_of[key]]]

    # ------------------------------------------------------------------ grants

    def grant(self, slots: Sequence[int]) -> list[int]:
        """One new open grant for each of ``slots`` (repeats: one each); their rows."""
        counters = self.requests.counters
        proofs = self.proofs
        out = []
        for slot in slots:
            if self.free_rows:
                row = self.free_rows.pop()
                proofs.reset(row)
                self.grant_req[row] = slot
                self.grant_open[row] = True
            else:
                row = proofs.add()
                self.grant_req.append(slot)
                self.grant_open.append(True)
            self.grants_of[slot].append(row)
            counters[OPEN][slot] += 1
            counters[UNCANCELLED][slot] += 1
            counters[RUNNING][slot] += 1
            out.append(row)
        return out

    def open_rows(self, key: Hashable) -> list[int]:
        return [r for r in self.grants_of[self.slot_of[key]] if self.grant_open[r]]

    # ------------------------------------------------------------------ evidence

    def prove(self, rows: Sequence[int], code: int, seqs: Sequence[int], out: Moves) -> list[int]:
        """Claim ``code`` (with ``seqs[i]``) about each of ``rows`` (grants of live requests),
        in order, as one piece of evidence each: the request transitions it fired go into
        ``out``. Returns the positions refused (a claim contradicting what is proven: nothing
        changed). A closed grant is checked, never changed."""
        proofs = self.proofs
        req = self.requests
        counters = req.counters
        refused = []
        for i, row in enumerate(rows):
            seq = seqs[i]
            if proofs.contradicts(row, code, seq):
                refused.append(i)
                continue
            if not self.grant_open[row]:
                continue
            acked = proofs.cancel_acknowledged(row)
            stopped = proofs.scheduling_stopped(row)
            suspect = proofs.suspect[row] != 0
            if not proofs.record(row, code, seq):
                continue
            slot = self.grant_req[row]
            if not acked and proofs.cancel_acknowledged(row):
                counters[UNCANCELLED][slot] -= 1
            if not stopped and proofs.scheduling_stopped(row):
                counters[RUNNING][slot] -= 1
            now_suspect = proofs.suspect[row] != 0
            if now_suspect and not suspect:
                counters[SUSPECT][slot] += 1
            if proofs.closed(row):
                # Closed: acknowledged and stopped already; it counts no more.
                self.grant_open[row] = False
                counters[OPEN][slot] -= 1
                if now_suspect:
                    counters[SUSPECT][slot] -= 1
            if req.state[slot] != _ADMITTED:
                self._advance(slot, out)
        return refused

    def expire(self, now: float, out: Moves) -> list[Hashable]:
        """Every open grant of a request whose deadline is ``<= now`` becomes suspect
        ("deadline"); the ended requests this quarantined are returned, in admission order."""
        proofs = self.proofs
        counters = self.requests.counters
        state = self.requests.state
        newly = []
        for slot in sorted(self.slot_of.values(), key=self.admission.__getitem__):
            if self.deadline[slot] > now:
                continue
            marked = False
            for row in self.grants_of[slot]:
                if self.grant_open[row] and proofs.mark_suspect(row, _DEADLINE):
                    counters[SUSPECT][slot] += 1
                    marked = True
            if marked and state[slot] != _ADMITTED:
                before = len(out)
                self._advance(slot, out)
                if any(t[2] == _QUARANTINED for t in out[before:]):
                    newly.append(self.key_of[slot])
        return newly

    # ------------------------------------------------------------------ ends and releases

    def end(self, keys: Sequence[Hashable], event: str, out: Moves) -> list[int]:
        """``event`` (rejected / finished) for each request of ``keys`` (live), then its proof
        chain (into ``out``). Returns the positions the table refused (nothing changed)."""
        code = EVENT_CODE[event]
        req = self.requests
        refused = []
        for i, key in enumerate(keys):
            slot = self.slot_of[key]
            if req.fire(slot, code, out) != 1:
                refused.append(i)
                continue
            self._advance(slot, out)
        return refused

    def collect(self, out: Moves) -> list[Hashable]:
        """Release every request in transfer_quiesced, in the order they reached it; forget
        it and its grants."""
        if not self.releasable:
            return []
        slots = list(self.releasable)
        self.releasable.clear()
        released = []
        for slot in slots:
            self.requests.fire(slot, _RELEASED, out)
            key = self.key_of[slot]
            released.append(key)
            del self.slot_of[key]
            self.free_rows += self.grants_of.pop(slot)
            self.quarantine_reason.pop(slot, None)
            self.free_slots.append(slot)
        return released

    def _advance(self, slot: int, out: Moves) -> None:
        before = len(out)
        self.requests.advance(slot, out)
        for _, _, target in out[before:]:
            if target == _QUIESCED:
                self.releasable[slot] = None
            elif target == _QUARANTINED:
                self.quarantine_reason[slot] = next(
                    (SUSPECTS[self.proofs.suspect[r]] or "deadline"
                     for r in self.grants_of[slot]
                     if self.grant_open[r] and self.proofs.suspect[r]),
                    "deadline",
                )  # fmt: skip


__all__ = ["StepRows"]
