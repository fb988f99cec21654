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
(``tests/test_step_rows.py``); the facade moves onto it once it carries every call (the
ledger's own counts, fences, restart, snapshots are not here yet).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from kvlifetime.errors import (
    BlockUnavailable,
    DoubleRelease,
    IllegalTransition,
    InsufficientEvidence,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnknownRequest,
)
from kvlifetime.grant import BlockIds
from kvlifetime.ledger.block_rows import READ, WRITE, BlockRows
from kvlifetime.ledger.blocks import MAX_SHARERS
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
from kvlifetime.ledger.requests import RECENTLY_RELEASED
from kvlifetime.spec.proof import REVOKED, SUSPECTS, ProofColumns

_ADMITTED = CODE["admitted"]
_QUIESCED = CODE["transfer_quiesced"]
_QUARANTINED = CODE["quarantined"]
_RELEASED = EVENT_CODE["released"]
_FORCE = EVENT_CODE["force_released"]
_DEADLINE = SUSPECTS.index("deadline")
_NO_BLOCKS = np.empty(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False


class StepRows:
    """The requests, grants and blocks of one ledger, as columns (the engine's counts)."""

    def __init__(
        self, num_blocks: int = 0, max_sharers: int = MAX_SHARERS, incarnation: str = "rows"
    ) -> None:
        self.requests = RequestRows()
        self.blocks = BlockRows(num_blocks, max_sharers)
        self.held: dict[int, list[BlockIds]] = {}  # slot -> its hold batches
        self.grant_blocks: list[BlockIds] = []  # per grant row
        self.grant_access: list[int] = []
        self.grant_peer: list[Hashable] = []
        self.grant_deadline: list[float] = []  # inf: only the request's deadline applies
        self.by_peer: dict[Hashable, dict[int, None]] = {}  # open grants per peer, in order
        self.proofs = ProofColumns()
        self.slot_of: dict[Hashable, int] = {}
        self.key_of: list[Hashable] = []
        self.free_slots: list[int] = []
        self.deadline: list[float] = []  # per request slot (inf: none)
        self.timed: dict[int, None] = {}  # slots with a deadline somewhere, in that order
        self.fenced_by: dict[int, str] = {}  # slot -> the fence whose revocation closed a grant
        self.unsafe_releases = 0
        self.incarnation = incarnation  # in every grant's label, as in a GrantId
        self.next_serial = 1  # grant serials: counted up, never reused (handles are)
        self.grant_serial: list[int] = []  # per grant row
        self.row_of_serial: dict[int, int] = {}  # serial -> row, for the grants of live requests
        # Keys released lately: an ending call naming one is DoubleRelease, not UnknownRequest.
        self.recently_released: dict[Hashable, None] = {}
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
            else:
                slot = req.add()
                self.key_of.append(key)
                self.deadline.append(dl)
            if deadline is not None:
                self.timed[slot] = None
            self.recently_released.pop(key, None)
            self.slot_of[key] = slot
            self.grants_of[slot] = []
            self.held[slot] = []
            out.append(slot)
        return out

    def _ending(self, key: Hashable) -> int:
        """The slot of ``key`` for a call that ends or lets go of it: ``DoubleRelease`` for a
        key released lately, ``UnknownRequest`` for one never seen."""
        slot = self.slot_of.get(key)
        if slot is None:
            if key in self.recently_released:
                raise DoubleRelease(f"request {key!r} was already released")
            raise UnknownRequest(key)
        return slot

    def _running_or_new(self, key: Hashable, event: str) -> int | None:
        slot = self.slot_of.get(key)
        if slot is not None and self.requests.state[slot] != _ADMITTED:
            raise IllegalTransition("request", key, STATES[self.requests.state[slot]], event)
        return slot

    def acquire(self, key: Hashable, arr: BlockIds, deadline: float | None = None) -> None:
        """``key`` holds ``arr`` (admitted here if new): refused (nothing changed) where a
        block is unsettled or already held by it, or where it has ended."""
        slot = self._running_or_new(key, "acquire")
        self.blocks.check_hold(arr, self.held[slot] if slot is not None else ())
        if slot is None:
            (slot,) = self.admit([key], deadline)
        elif deadline is not None:
            self.deadline[slot] = deadline
            self.timed[slot] = None
        self.blocks.hold(arr)
        self.held[slot].append(arr)

    def acquire_and_grant(
        self,
        key: Hashable,
        arr: BlockIds,
        access: int,
        deadline: float | None = None,
        peer: Hashable = None,
    ) -> int:
        """``acquire`` then a grant over ``arr``, all or nothing; the grant's handle. A write
        grant also refused where another request holds a block or an open grant covers it."""
        slot = self._running_or_new(key, "acquire")
        if access == WRITE and len(arr):
            self.blocks.check_write_on_hold(arr)
        self.blocks.check_hold(arr, self.held[slot] if slot is not None else ())
        self.acquire(key, arr, deadline)
        return self._open(self.slot_of[key], arr, access, peer, None)

    def acquire_and_grant_many(
        self,
        keys: Sequence[Hashable],
        allids: BlockIds,
        lens: Sequence[int],
        access: int,
        peer: Hashable = None,
    ) -> list[int | KVLifetimeError]:
        """``acquire_and_grant`` of each request of ``keys`` over its part of ``allids``
        (``lens[i]`` ids each, in order), each granted or refused on its own, in order: the
        handles, or the typed refusals. Where every request is new and no block repeats, the
        step's blocks are checked, held and counted in one call each."""
        blocks = self.blocks
        fresh = (
            not any(k in self.slot_of for k in keys)
            and len(set(keys)) == len(keys)
            and blocks.distinct(allids)
            and blocks.fresh_allowed(allids, access)
        )
        if not fresh:
            out: list[int | KVLifetimeError] = []
            start = 0
            for key, n in zip(keys, lens, strict=True):
                part = allids[start : start + n]
                start += n
                try:
                    out.append(self.acquire_and_grant(key, part, access, None, peer))
                except KVLifetimeError as e:
                    out.append(e)
            return out
        blocks.hold(allids, len(keys))
        blocks.count_open(allids, access, len(keys))
        slots = self.admit(keys)
        rows = self.grant(slots)
        peer_open = self.by_peer.setdefault(peer, {})
        start = 0
        for slot, row, n in zip(slots, rows, lens, strict=True):
            part = allids[start : start + n]
            start += n
            self.held[slot].append(part)
            self.grant_blocks[row] = part
            self.grant_access[row] = access
            self.grant_peer[row] = peer
            peer_open[row] = None
        return list(rows)

    def grant_on(
        self,
        key: Hashable,
        arr: BlockIds,
        access: int,
        peer: Hashable = None,
        deadline: float | None = None,
    ) -> int:
        """A grant over blocks ``key`` holds; its handle. Refused (nothing changed): an
        unknown or ended request, a block it does not hold, the engine's per-block rules."""
        slot = self.slot_of.get(key)
        if slot is None:
            raise UnknownRequest(key)
        if self.requests.state[slot] != _ADMITTED:
            raise IllegalTransition("request", key, STATES[self.requests.state[slot]], "grant")
        held = self.held[slot]
        allheld = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
        if not np.isin(arr, allheld, assume_unique=True).all():
            raise BlockUnavailable(f"request {key!r} does not hold some of these blocks")
        own = [
            self.grant_blocks[r]
            for r in self.grants_of[slot]
            if self.grant_open[r] and self.grant_access[r] == WRITE
        ]
        self.blocks.check_grant(arr, access, own)
        return self._open(slot, arr, access, peer, deadline)

    def _open(
        self, slot: int, arr: BlockIds, access: int, peer: Hashable, deadline: float | None
    ) -> int:
        (row,) = self.grant([slot])
        self.grant_blocks[row] = arr
        self.grant_access[row] = access
        self.grant_peer[row] = peer
        self.by_peer.setdefault(peer, {})[row] = None
        if deadline is not None:
            self.grant_deadline[row] = deadline
            self.timed[slot] = None
        self.blocks.count_open(arr, access)
        return row

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
                self.grant_blocks[row] = _NO_BLOCKS
                self.grant_access[row] = READ
                self.grant_peer[row] = None
                self.grant_deadline[row] = math.inf
                self.grant_serial[row] = self.next_serial
            else:
                row = proofs.add()
                self.grant_req.append(slot)
                self.grant_open.append(True)
                self.grant_blocks.append(_NO_BLOCKS)
                self.grant_access.append(READ)
                self.grant_peer.append(None)
                self.grant_deadline.append(math.inf)
                self.grant_serial.append(self.next_serial)
            self.row_of_serial[self.next_serial] = row
            self.next_serial += 1
            self.grants_of[slot].append(row)
            counters[OPEN][slot] += 1
            counters[UNCANCELLED][slot] += 1
            counters[RUNNING][slot] += 1
            out.append(row)
        return out

    def open_rows(self, key: Hashable) -> list[int]:
        return [r for r in self.grants_of[self.slot_of[key]] if self.grant_open[r]]

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
        """The handle of each grant a piece of evidence names (its serial, request and peer),
        or the typed refusal: ``StaleEvidence`` for a grant whose request was released,
        ``MismatchedEvidence`` for one never issued or one of another request or peer."""
        out: list[int | KVLifetimeError] = []
        for serial, request, peer in zip(serials, requests, peers, strict=True):
            row = self.row_of_serial.get(serial)
            if row is None:
                if serial < self.next_serial:
                    out.append(StaleEvidence(f"grant {serial}: its request was already released"))
                else:
                    out.append(MismatchedEvidence(f"grant {serial} was never issued"))
            elif self.key_of[self.grant_req[row]] != request or self.grant_peer[row] != peer:
                out.append(MismatchedEvidence(f"grant {serial} is of another request or peer"))
            else:
                out.append(row)
        return out

    def prove_peer(self, peer: Hashable, code: int, fence: str | None, out: Moves) -> None:
        """A claim about every open grant of ``peer`` (``PeerLost``, an ``AccessRevoked`` of
        the peer's fence), in grant order."""
        open_rows = self.by_peer.get(peer)
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
        if not self.grant_open[row]:
            return  # a closed grant of a live request: checked, never changed
        proofs = self.proofs
        acked = proofs.cancel_acknowledged(row)
        stopped = proofs.scheduling_stopped(row)
        suspect = proofs.suspect[row] != 0
        if not proofs.record(row, code, seq):
            return
        slot = self.grant_req[row]
        counters = self.requests.counters
        if not acked and proofs.cancel_acknowledged(row):
            counters[UNCANCELLED][slot] -= 1
        if not stopped and proofs.scheduling_stopped(row):
            counters[RUNNING][slot] -= 1
        now_suspect = proofs.suspect[row] != 0
        if now_suspect and not suspect:
            counters[SUSPECT][slot] += 1
        if proofs.closed(row):
            # Closed: acknowledged and stopped already; it counts no more.
            self._close(row)
            counters[OPEN][slot] -= 1
            closed.append((self.grant_blocks[row], self.grant_access[row]))
            if now_suspect:
                counters[SUSPECT][slot] -= 1
            if code == REVOKED and fence is not None:
                self.fenced_by[slot] = fence
        if self.requests.state[slot] != _ADMITTED:
            self._advance(slot, out)

    def _close(self, row: int) -> None:
        self.grant_open[row] = False
        peer_open = self.by_peer.get(self.grant_peer[row])
        if peer_open is not None:
            peer_open.pop(row, None)
            if not peer_open:
                del self.by_peer[self.grant_peer[row]]

    def set_deadline(self, key: Hashable, deadline: float | None) -> None:
        """The request-wide deadline (None: none); ``UnknownRequest`` for a key not live."""
        slot = self.slot_of.get(key)
        if slot is None:
            raise UnknownRequest(key)
        self.deadline[slot] = math.inf if deadline is None else deadline
        if deadline is not None:
            self.timed[slot] = None

    def expire(self, now: float, out: Moves) -> list[Hashable]:
        """Every open grant whose deadline (its own, else its request's) is ``<= now`` becomes
        suspect ("deadline"); the ended requests this quarantined are returned, in the order
        they got a deadline. A request with nothing left to time out stops being looked at."""
        proofs = self.proofs
        counters = self.requests.counters
        state = self.requests.state
        newly = []
        for slot in list(self.timed):
            marked = False
            for row in self.grants_of[slot]:
                if not self.grant_open[row] or proofs.suspect[row]:
                    continue
                dl = self.grant_deadline[row]
                if (dl if dl != math.inf else self.deadline[slot]) <= now:
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
                del self.timed[slot]
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
                slot = self._ending(key)
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
        slot = self._ending(key)
        if self.requests.state[slot] != _ADMITTED and self.requests.counters[OPEN][slot]:
            raise InsufficientEvidence(key, self.unproven(key))
        if self.requests.fire(slot, _RELEASED, out) != 1:
            raise IllegalTransition("request", key, self.state(key), "released")
        self.releasable.pop(slot, None)
        blocks = self.blocks.let_go(self.held.pop(slot))
        self._forget(slot)
        return blocks

    def unproven(self, key: Hashable) -> dict[str, tuple[str, ...]]:
        """Each open grant of ``key`` (``"incarnation#serial (peer)"``) and the claims it
        still misses."""
        return {
            f"{self.incarnation}#{self.grant_serial[r]} ({self.grant_peer[r]})": tuple(
                self.proofs.proof(r).unproven()
            )
            for r in self.open_rows(key)
        }

    def blocks_of(self, key: Hashable) -> BlockIds:
        held = self.held[self.slot_of[key]]
        return np.concatenate(held) if held else np.empty(0, dtype=np.int64)

    def collect(self, out: Moves) -> dict[Hashable, BlockIds]:
        """Release every request in transfer_quiesced, in the order they reached it: the
        blocks each held; it and its grants are forgotten."""
        if not self.releasable:
            return {}
        slots = list(self.releasable)
        self.releasable.clear()
        released: dict[Hashable, BlockIds] = {}
        freed = self.blocks.let_go_many([self.held.pop(slot) for slot in slots])
        for slot, blocks in zip(slots, freed, strict=True):
            self.requests.fire(slot, _RELEASED, out)
            released[self.key_of[slot]] = blocks
            self._forget(slot)
        return released

    def force_release(self, key: Hashable, out: Moves) -> BlockIds:
        """UNSAFE unless every grant is closed: release ``key`` with its grants as they are
        (counted in ``unsafe_releases`` when one is open). ``UnknownRequest`` for a key not
        live, ``IllegalTransition`` where the table has no such release (a running request)."""
        slot = self._ending(key)
        if self.requests.state[slot] == _QUIESCED:
            self.requests.fire(slot, _RELEASED, out)
        else:
            if self.requests.fire(slot, _FORCE, out) != 1:
                state = STATES[self.requests.state[slot]]
                raise IllegalTransition("request", key, state, "force_released")
            self.unsafe_releases += 1
        self.releasable.pop(slot, None)
        still_open = [r for r in self.grants_of[slot] if self.grant_open[r]]
        if still_open:
            self.blocks.uncount_many(
                [(self.grant_blocks[r], self.grant_access[r]) for r in still_open]
            )
            for row in still_open:
                self._close(row)
        blocks = self.blocks.let_go(self.held.pop(slot))
        self._forget(slot)
        return blocks

    def _forget(self, slot: int) -> None:
        """A released request and its grants are gone; its slot and rows are reused."""
        key = self.key_of[slot]
        del self.slot_of[key]
        self.recently_released[key] = None
        if len(self.recently_released) > RECENTLY_RELEASED:
            del self.recently_released[next(iter(self.recently_released))]
        rows = self.grants_of.pop(slot)
        for row in rows:
            del self.row_of_serial[self.grant_serial[row]]
        self.free_rows += rows
        self.quarantine_reason.pop(slot, None)
        self.timed.pop(slot, None)
        self.fenced_by.pop(slot, None)
        self.free_slots.append(slot)

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
