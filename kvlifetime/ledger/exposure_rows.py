"""ExposureRows: what a ledger's requests hold and expose, as rows: the first half of the
step-columnar ledger (``StepRows`` adds what is proven and released).

Requests are rows of ``RequestRows`` (by key and slot), grants rows of ``GrantRows`` (by integer
handle), blocks the arrays of ``BlockRows``. Here: a request's holds (the block-id arrays it
was given), its grants (their handles, in grant order), and the calls that make them, each
refused with its typed error and nothing changed, or applied in full: ``acquire``,
``acquire_and_grant`` (and ``_many``: a step of new requests over distinct blocks checked,
held and counted in one numpy call each), ``grant_on`` blocks already held. A new grant counts
on its request's open-grant counters at once.

Values are trusted (the library's own handles and codes); validation stays at the facade.
Part of the step-columnar ledger being built (issue 32); held to the object ledger by
``tests/test_step_rows.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kvlifetime.errors import BlockUnavailable, IllegalTransition, KVLifetimeError, UnknownRequest
from kvlifetime.grant import BlockIds
from kvlifetime.ledger.block_rows import WRITE, BlockRows
from kvlifetime.ledger.blocks import MAX_SHARERS
from kvlifetime.ledger.grant_rows import GrantRows
from kvlifetime.ledger.request_rows import CODE, OPEN, RUNNING, STATES, UNCANCELLED, RequestRows

_ADMITTED = CODE["admitted"]


class ExposureRows:
    """The requests' holds and grants, and the blocks under them (the engine's counts)."""

    def __init__(
        self, num_blocks: int = 0, max_sharers: int = MAX_SHARERS, incarnation: str = "rows"
    ) -> None:
        self.requests = RequestRows()
        self.blocks = BlockRows(num_blocks, max_sharers)
        self.grants = GrantRows(incarnation)
        req = self.requests
        self.slot_of, self.key_of = req.slot_of, req.key_of  # (the requests' own: one place)
        self.held: dict[int, list[BlockIds]] = {}  # slot -> its hold batches
        self.grants_of: dict[int, list[int]] = {}  # slot -> its grants' rows, in grant order

    # ------------------------------------------------------------------ requests

    def admit(self, keys: Sequence[Hashable], deadline: float | None = None) -> list[int]:
        """New requests (keys not live); their slots."""
        out = []
        for key in keys:
            slot = self.requests.admit(key, deadline)
            self.grants_of[slot] = []
            self.held[slot] = []
            out.append(slot)
        return out

    def acquire(self, key: Hashable, arr: BlockIds, deadline: float | None = None) -> None:
        """``key`` holds ``arr`` (admitted here if new): refused (nothing changed) where a
        block is unsettled or already held by it, or where it has ended."""
        slot = self.requests.running_or_new(key, "acquire")
        self.blocks.check_hold(arr, self.held[slot] if slot is not None else ())
        self._hold(key, slot, arr, deadline)

    def _hold(self, key: Hashable, slot: int | None, arr: BlockIds, deadline: float | None) -> int:
        """``acquire`` once checked: ``key`` (at ``slot``, None: new) holds ``arr``; its slot."""
        if slot is None:
            (slot,) = self.admit([key], deadline)
        elif deadline is not None:
            self.requests.set_deadline(key, deadline)
        self.blocks.hold(arr)
        self.held[slot].append(arr)
        return slot

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
        slot = self.requests.running_or_new(key, "acquire")
        if access == WRITE and len(arr):
            self.blocks.check_write_on_hold(arr)
        self.blocks.check_hold(arr, self.held[slot] if slot is not None else ())
        slot = self._hold(key, slot, arr, deadline)
        return self._open(slot, arr, access, peer, None)

    def acquire_and_grant_many(
        self,
        keys: Sequence[Hashable],
        allids: BlockIds,
        lens: Sequence[int],
        access: int,
        peer: Hashable = None,
        distinct: bool | None = None,
    ) -> list[int | KVLifetimeError]:
        """``acquire_and_grant`` of each request of ``keys`` over its part of ``allids``
        (``lens[i]`` ids each, in order), each granted or refused on its own, in order: the
        handles, or the typed refusals. Where every request is new and no block repeats, the
        step's blocks are checked, held and counted in one call each. ``distinct``: whether
        no id of ``allids`` repeats, when the caller knows (None: looked at here)."""
        blocks = self.blocks
        fresh = (
            not any(k in self.slot_of for k in keys)
            and len(set(keys)) == len(keys)
            and (blocks.distinct(allids) if distinct is None else distinct)
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
        expose = self.grants.expose
        start = 0
        for slot, row, n in zip(slots, rows, lens, strict=True):
            part = allids[start : start + n]
            start += n
            self.held[slot].append(part)
            expose(row, part, access, peer, None)
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
        g = self.grants
        own = [g.blocks[r] for r in self.grants_of[slot] if g.open[r] and g.access[r] == WRITE]
        self.blocks.check_grant(arr, access, own)
        return self._open(slot, arr, access, peer, deadline)

    def _open(
        self, slot: int, arr: BlockIds, access: int, peer: Hashable, deadline: float | None
    ) -> int:
        (row,) = self.grant([slot])
        self.grants.expose(row, arr, access, peer, deadline)
        if deadline is not None:
            self.requests.timed[slot] = None
        self.blocks.count_open(arr, access)
        return row

    def state(self, key: Hashable) -> str:
        return self.requests.state_of(key)

    # ------------------------------------------------------------------ grants

    def grant(self, slots: Sequence[int]) -> list[int]:
        """One new open grant for each of ``slots`` (repeats: one each); their rows."""
        counters = self.requests.counters
        add = self.grants.add
        out = []
        for slot in slots:
            row = add(slot)
            self.grants_of[slot].append(row)
            counters[OPEN][slot] += 1
            counters[UNCANCELLED][slot] += 1
            counters[RUNNING][slot] += 1
            out.append(row)
        return out

    def open_rows(self, key: Hashable) -> list[int]:
        is_open = self.grants.open
        return [r for r in self.grants_of[self.slot_of[key]] if is_open[r]]

    def blocks_of(self, key: Hashable) -> BlockIds:
        held = self.held[self.slot_of[key]]
        return np.concatenate(held) if held else np.empty(0, dtype=np.int64)


__all__ = ["ExposureRows"]
