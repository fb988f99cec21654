"""StepRows: a scheduler step's ledger work on columns: requests, grants and blocks as rows.

What is exposed (holds, grants) is ``ExposureRows``'; here, what is proven, ended and
released. A step's work is one call per kind, over every request or grant of the step:
``prove`` (one claim per grant: the rules, the request's counters moved by the difference, the
proof chain advanced), ``prove_peer`` (every open grant of a peer), ``expire``, ``end``,
``release``, ``collect``, ``force_release``. No ``Grant``,
evidence or ``Transition`` object is made: transitions come back as (slot, event, target)
codes; objects are built only when someone asks.

Values are trusted (the library's own handles and codes); validation stays at the facade.
Part of the step-columnar ledger being built (issue 32): the object-per-request ledger
(``requests.py``, ``records.py``) is what it is held to, step by step
(``tests/test_step_rows.py``); the facade moves onto it once it carries every call (the
ledger's own counts, fences, restart, snapshots are not here yet).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable, Sequence

from kvlifetime.errors import (
    IllegalTransition,
    InsufficientEvidence,
    KVLifetimeError,
)
from kvlifetime.grant import BlockIds
from kvlifetime.ledger.blocks import MAX_SHARERS
from kvlifetime.ledger.exposure_rows import ExposureRows
from kvlifetime.ledger.grant_rows import ACKED, CLOSED, STOPPED, SUSPECT_AT_CLOSE, SUSPECTED
from kvlifetime.ledger.request_rows import (
    CODE,
    EVENT_CODE,
    OPEN,
    RUNNING,
    STATES,
    SUSPECT,
    UNCANCELLED,
    Moves,
)
from kvlifetime.spec.proof import REVOKED, SUSPECTS

_ADMITTED = CODE["admitted"]
_QUIESCED = CODE["transfer_quiesced"]
_QUARANTINED = CODE["quarantined"]
_RELEASED = EVENT_CODE["released"]
_FORCE = EVENT_CODE["force_released"]
_DEADLINE = SUSPECTS.index("deadline")


class StepRows(ExposureRows):
    """The requests, grants and blocks of one ledger, as columns (the engine's counts): what
    is exposed (``ExposureRows``), and here what is proven, ended and released."""

    def __init__(
        self, num_blocks: int = 0, max_sharers: int = MAX_SHARERS, incarnation: str = "rows"
    ) -> None:
        super().__init__(num_blocks, max_sharers, incarnation)
        self.proofs = self.grants.proofs
        self.fenced_by: dict[int, str] = {}  # slot -> the fence whose revocation closed a grant
        self.unsafe_releases = 0
        self.releasable: dict[int, None] = {}  # slots in transfer_quiesced, in arrival order
        self.quarantine_reason: dict[int, str] = {}
        # fence -> blocks unguarded by releases a fence made possible; only grows
        self.reclaimed: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ evidence

    def prove(
        self,
        rows: Sequence[int],
        code: int,
        seqs: Sequence[int],
        out: Moves,
        fence: str | None = None,
    ) -> list[int]:
        """Claim ``code`` (with ``seqs[i]``) about each of ``rows`` (grants of live requests),
        in order, as one piece of evidence each: the request transitions it fired go into
        ``out``. Returns the positions refused (a claim contradicting what is proven: nothing
        changed). A closed grant is checked, never changed."""
        refused = []
        closed: list[tuple[BlockIds, int]] = []  # uncounted in one write at the end
        for i, row in enumerate(rows):
            if self.proofs.contradicts(row, code, seqs[i]):
                refused.append(i)
            else:
                self._record(row, code, seqs[i], fence, out, closed)
        if closed:
            self.blocks.uncount_many(closed)
        return refused

    def rows_of(
        self, serials: Sequence[int], requests: Sequence[Hashable], peers: Sequence[Hashable]
    ) -> list[int | KVLifetimeError]:
        """The handle of each grant a piece of evidence names (``GrantRows.lookup``)."""
        return self.grants.lookup(serials, requests, peers, self.key_of.__getitem__)

    def prove_peer(self, peer: Hashable, code: int, fence: str | None, out: Moves) -> None:
        """A claim about every open grant of ``peer`` (``PeerLost``, an ``AccessRevoked`` of
        the peer's fence), in grant order."""
        open_rows = self.grants.by_peer.get(peer)
        if not open_rows:
            return
        closed: list[tuple[BlockIds, int]] = []
        for row in list(open_rows):
            self._record(row, code, 0, fence, out, closed)
        if closed:
            self.blocks.uncount_many(closed)

    def _record(
        self,
        row: int,
        code: int,
        seq: int,
        fence: str | None,
        out: Moves,
        closed: list[tuple[BlockIds, int]],
    ) -> None:
        """One checked claim about ``row``: its facts, its request's counters, a close, the
        request's proof chain."""
        grants = self.grants
        if not grants.open[row]:
            return  # a closed grant of a live request: checked, never changed
        bits = grants.record(row, code, seq)
        if not bits:
            return
        slot = grants.req[row]
        counters = self.requests.counters
        if bits & ACKED:
            counters[UNCANCELLED][slot] -= 1
        if bits & STOPPED:
            counters[RUNNING][slot] -= 1
        if bits & SUSPECTED:
            counters[SUSPECT][slot] += 1
        if bits & CLOSED:
            # Closed: acknowledged and stopped already; it counts no more.
            counters[OPEN][slot] -= 1
            closed.append((grants.blocks[row], grants.access[row]))
            if bits & SUSPECT_AT_CLOSE:
                counters[SUSPECT][slot] -= 1
            if code == REVOKED and fence is not None:
                self.fenced_by[slot] = fence
        if self.requests.state[slot] != _ADMITTED:
            self._advance(slot, out)

    def set_deadline(self, key: Hashable, deadline: float | None) -> None:
        self.requests.set_deadline(key, deadline)

    def expire(self, now: float, out: Moves) -> list[Hashable]:
        """Every open grant whose deadline (its own, else its request's) is ``<= now`` becomes
        suspect ("deadline"); the ended requests this quarantined are returned, in the order
        they got a deadline. A request with nothing left to time out stops being looked at."""
        proofs = self.proofs
        grants = self.grants
        counters = self.requests.counters
        state = self.requests.state
        newly = []
        timed = self.requests.timed
        for slot in list(timed):
            marked = False
            for row in self.grants_of[slot]:
                if not grants.open[row] or proofs.suspect[row]:
                    continue
                dl = grants.deadline[row]
                if (dl if dl != math.inf else self.requests.deadline[slot]) <= now:
                    proofs.mark_suspect(row, _DEADLINE)
                    counters[SUSPECT][slot] += 1
                    marked = True
            if marked and state[slot] != _ADMITTED:
                before = len(out)
                self._advance(slot, out)
                if any(t[2] == _QUARANTINED for t in out[before:]):
                    newly.append(self.key_of[slot])
            if state[slot] != _ADMITTED and (
                not counters[OPEN][slot] or state[slot] in (_QUARANTINED, _QUIESCED)
            ):
                del timed[slot]
        return newly

    # ------------------------------------------------------------------ ends and releases

    def end(
        self, keys: Sequence[Hashable], event: str, out: Moves
    ) -> list[tuple[int, KVLifetimeError]]:
        """``event`` (rejected / finished) for each request of ``keys``, then its proof chain
        (into ``out``). Returns the refused ones, by position, with their typed error (unknown,
        released lately, or no such row for its state): nothing changed for them."""
        code = EVENT_CODE[event]
        req = self.requests
        refused: list[tuple[int, KVLifetimeError]] = []
        for i, key in enumerate(keys):
            try:
                slot = self.requests.ending(key)
            except KVLifetimeError as e:
                refused.append((i, e))
                continue
            if req.fire(slot, code, out) != 1:
                refused.append((i, IllegalTransition("request", key, self.state(key), event)))
                continue
            self._advance(slot, out)
        return refused

    def release(self, key: Hashable, out: Moves) -> BlockIds:
        """Let go of ``key``'s blocks once every grant is closed: ``InsufficientEvidence``
        (with what is unproven) while one is open, ``IllegalTransition`` while it runs."""
        slot = self.requests.ending(key)
        if self.requests.state[slot] != _ADMITTED and self.requests.counters[OPEN][slot]:
            raise InsufficientEvidence(key, self.unproven(key))
        if self.requests.fire(slot, _RELEASED, out) != 1:
            raise IllegalTransition("request", key, self.state(key), "released")
        self.releasable.pop(slot, None)
        blocks = self._let_go([slot])[0]
        self._forget(slot)
        return blocks

    def _let_go(self, slots: Sequence[int]) -> list[BlockIds]:
        """The holds of released ``slots`` dropped; every block each held. The blocks a
        fenced one leaves unguarded are counted as the fence's (``reclaimed``)."""
        held, gone = self.blocks.let_go_many([self.held.pop(slot) for slot in slots])
        fenced_by = self.fenced_by
        if fenced_by:
            for slot, freed in zip(slots, gone, strict=True):
                fence = fenced_by.get(slot)
                if fence is not None and len(freed):
                    self.reclaimed[fence] += len(freed)
        return held

    def unproven(self, key: Hashable) -> dict[str, tuple[str, ...]]:
        """Each open grant of ``key`` (``"incarnation#serial (peer)"``) and the claims it
        still misses."""
        return {
            self.grants.label(r): tuple(self.proofs.proof(r).unproven())
            for r in self.open_rows(key)
        }

    def collect(self, out: Moves) -> dict[Hashable, BlockIds]:
        """Release every request in transfer_quiesced, in the order they reached it: the
        blocks each held; it and its grants are forgotten."""
        if not self.releasable:
            return {}
        slots = list(self.releasable)
        self.releasable.clear()
        released: dict[Hashable, BlockIds] = {}
        freed = self._let_go(slots)
        for slot, blocks in zip(slots, freed, strict=True):
            self.requests.fire(slot, _RELEASED, out)
            released[self.key_of[slot]] = blocks
            self._forget(slot)
        return released

    def force_release(self, key: Hashable, out: Moves) -> BlockIds:
        """UNSAFE unless every grant is closed: release ``key`` with its grants as they are
        (counted in ``unsafe_releases`` when one is open). ``UnknownRequest`` for a key not
        live, ``IllegalTransition`` where the table has no such release (a running request)."""
        slot = self.requests.ending(key)
        if self.requests.state[slot] == _QUIESCED:
            self.requests.fire(slot, _RELEASED, out)
        else:
            if self.requests.fire(slot, _FORCE, out) != 1:
                state = STATES[self.requests.state[slot]]
                raise IllegalTransition("request", key, state, "force_released")
            self.unsafe_releases += 1
        self.releasable.pop(slot, None)
        g = self.grants
        still_open = [r for r in self.grants_of[slot] if g.open[r]]
        if still_open:
            self.blocks.uncount_many([(g.blocks[r], g.access[r]) for r in still_open])
            for row in still_open:
                g.close(row)
        blocks = self._let_go([slot])[0]
        self._forget(slot)
        return blocks

    def _forget(self, slot: int) -> None:
        """A released request and its grants are gone; its slot and rows are reused."""
        self.requests.forget(slot)
        self.grants.forget(self.grants_of.pop(slot))
        self.quarantine_reason.pop(slot, None)
        self.fenced_by.pop(slot, None)

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
                     if self.grants.open[r] and self.proofs.suspect[r]),
                    "deadline",
                )  # fmt: skip


__all__ = ["StepRows"]
