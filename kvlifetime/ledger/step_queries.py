"""``StepLedger``'s read side: queries and statistics over the rows, as ``BlockLedger``'s read.

The base of ``StepLedger`` (``step_ledger``), as ``queries`` is of ``BlockLedger``: every call
here may come from any thread (a Prometheus scrape, a test), validates its arguments and takes
the ledger's lock; none changes anything. Objects (a ``Grant``, ``LedgerStats``) are built here,
when asked, from the rows: never on a step's path. Two trusted readers serve the guard core on
its own handles of live grants, unchecked and without the lock: ``is_open`` and
``blocks_under``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvlifetime import inputs
from kvlifetime.errors import UnknownGrant, UnknownRequest, show
from kvlifetime.grant import Access, BlockIds, Grant, RequestKey, make_grant, make_grant_id
from kvlifetime.ledger.block_rows import READ, WRITE
from kvlifetime.ledger.blocks import block_states
from kvlifetime.ledger.events import Event
from kvlifetime.ledger.request_rows import CODE, STATES
from kvlifetime.ledger.step_rows import StepRows
from kvlifetime.ledger.values import LedgerStats, QuarantineInfo
from kvlifetime.spec.vocabulary import BlockState, RequestState

_ADMITTED = CODE["admitted"]
_QUARANTINED = CODE["quarantined"]
_ACCESS_OF = {READ: Access.READ, WRITE: Access.WRITE}


class StepQueries:
    """What a step ledger is made of, and every call that reads it (``StepLedger``'s base)."""

    counts = "engine"
    """Whose counts decide when a block is free: the engine's (as ``BlockLedger``'s
    ``counts="engine"``: any number of requests may hold a block; the ledger guards exposure)."""
    OPEN_NONE = 0
    """``open_access``: no open grant covers the block."""
    OPEN_READ = 1
    """``open_access``: open grants cover the block, read grants only."""
    OPEN_WRITE = 2
    """``open_access``: an open write grant covers the block."""

    num_blocks: int
    incarnation: str
    rows: StepRows
    _lock: threading.Lock
    _pending: list[Event]
    refused_evidence: collections.Counter[str]
    quarantined_since: dict[Hashable, float | None]

    # =================================================================== the guard's readers

    def is_open(self, handle: int) -> bool:
        """Whether the grant ``handle`` is open. For the guard, on its own handles of live
        grants (trusted, not checked, no lock: one list entry read)."""
        return self.rows.grants.open[handle]

    def blocks_under(self, handle: int) -> BlockIds:
        """The block ids (read-only) of the grant ``handle``. For the guard, on its own
        handles of live grants (trusted, not checked, no lock: one list entry read)."""
        return self.rows.grants.blocks[handle]

    def grant(self, handle: int) -> Grant:
        """The grant of ``handle`` as a ``Grant``, built now for a reader. ``UnknownGrant`` for
        anything that is not the handle of a live grant (its request released: the handle is
        someone else's, or no one's, now)."""
        with self._lock:
            g = self.rows.grants
            if (
                type(handle) is not int
                or not 0 <= handle < len(g.serial)
                or g.row_of_serial.get(g.serial[handle]) != handle
            ):
                raise UnknownGrant(f"no live grant has the handle {show(handle)}")
            return self._grant(handle)

    def _grant(self, handle: int) -> Grant:
        g = self.rows.grants
        blocks = g.blocks[handle]
        generations = self.rows.blocks.generation.take(blocks)
        generations.flags.writeable = False
        return make_grant(  # from the ledger's own values, checked when they entered
            make_grant_id(self.incarnation, g.serial[handle]),
            cast(RequestKey, self.rows.key_of[g.req[handle]]),
            cast(str, g.peer[handle]),
            blocks,
            generations,
            _ACCESS_OF[g.access[handle]],
        )

    # =================================================================== queries

    def _slot(self, request: object) -> int:
        key = inputs.request_key(request)
        slot = self.rows.slot_of.get(key)
        if slot is None:
            raise UnknownRequest(key)
        return slot

    def state(self, request: Hashable) -> RequestState:
        """The request's state; ``UnknownRequest`` if not live."""
        with self._lock:
            return RequestState(STATES[self.rows.requests.state[self._slot(request)]])

    def live_requests(self) -> list[Hashable]:
        with self._lock:
            return list(self.rows.slot_of)

    def open_grants(self, request: Hashable) -> list[Grant]:
        """The request's open grants, in grant order (built now)."""
        with self._lock:
            self._slot(request)
            return [self._grant(h) for h in self.rows.open_rows(inputs.request_key(request))]

    def blocks_of(self, request: Hashable) -> BlockIds:
        with self._lock:
            self._slot(request)
            return self.rows.blocks_of(inputs.request_key(request))

    def unproven(self, request: Hashable) -> dict[str, tuple[str, ...]]:
        """Each open grant of ``request`` and the claims it still misses (as
        ``BlockLedger.unproven``)."""
        with self._lock:
            self._slot(request)
            return self.rows.unproven(inputs.request_key(request))

    def open_access(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """Per block of ``ids``: ``OPEN_NONE``, ``OPEN_READ`` or ``OPEN_WRITE`` (as
        ``BlockLedger.open_access``)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self.rows.blocks.open_access(arr)

    def holders(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """How many requests hold each block of ``ids``."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self.rows.blocks.sharers.take(arr).astype(np.int64)

    def generation(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint32]:
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self.rows.blocks.generation.take(arr)

    def fingerprint(self) -> tuple[Any, ...]:
        """The whole observable state as a hashable value (grant serials included; the
        counters of refusals are not state): what a refused call must leave unchanged."""
        with self._lock:
            rows = self.rows
            g = rows.grants
            b = rows.blocks
            requests = tuple(
                sorted(
                    (
                        repr(key),
                        rows.requests.state[slot],
                        tuple(c[slot] for c in rows.requests.counters),
                        rows.requests.deadline[slot],
                        tuple(a.tobytes() for a in rows.held[slot]),
                        tuple(
                            (
                                g.serial[r],
                                g.open[r],
                                g.blocks[r].tobytes(),
                                g.access[r],
                                repr(g.peer[r]),
                                repr(g.proofs.proof(r)),
                            )
                            for r in rows.grants_of[slot]
                        ),
                    )
                    for key, slot in rows.slot_of.items()
                )
            )
            return (
                self.counts,
                b.sharers.tobytes(),
                b.unsettled.tobytes(),
                b.readers.tobytes(),
                b.generation.tobytes(),
                requests,
                g.next_serial,
                rows.unsafe_releases,
            )

    def free_count(self) -> int:
        """Blocks the ledger does not guard (no request holds them)."""
        with self._lock:
            return int(np.count_nonzero(self.rows.blocks.sharers == 0))

    def block_state(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """The ``BlockState`` code of each block of ``ids`` (as ``BlockLedger.block_state``)."""
        arr = inputs.block_ids(ids, self.num_blocks)
        with self._lock:
            return self._block_states().take(arr)

    def _block_states(self) -> npt.NDArray[np.uint8]:
        rows = self.rows
        n = self.num_blocks
        running = np.zeros(n, dtype=bool)
        opened = np.zeros(n, dtype=bool)
        quarantined = np.zeros(n, dtype=bool)
        state = rows.requests.state
        g = rows.grants
        for slot in rows.slot_of.values():
            if state[slot] == _ADMITTED:
                for arr in rows.held[slot]:
                    running[arr] = True
            for r in rows.grants_of[slot]:
                if g.open[r]:
                    opened[g.blocks[r]] = True
                    if state[slot] == _QUARANTINED:
                        quarantined[g.blocks[r]] = True
        return block_states(rows.blocks.sharers > 0, running, opened, quarantined)

    def stats(self, now: float | None = None) -> LedgerStats:
        """The ledger's figures, as ``BlockLedger.stats`` gives them (a quarantine's ``since``
        is the last ``now`` given to ``expire`` before it, None without one)."""
        now = inputs.optional_time(now, "now")
        with self._lock:
            rows = self.rows
            counts = np.bincount(self._block_states(), minlength=len(BlockState))
            state = rows.requests.state
            by_req = collections.Counter(STATES[state[s]] for s in rows.slot_of.values())
            g = rows.grants
            quarantined = []
            for key, slot in rows.slot_of.items():
                if state[slot] != _QUARANTINED:
                    continue
                since = self.quarantined_since.get(key)
                quarantined.append(
                    QuarantineInfo(
                        cast(RequestKey, key),  # as it entered: checked then
                        sum(len(a) for a in rows.held[slot]),
                        rows.quarantine_reason.get(slot, "deadline"),
                        since,
                        None if now is None or since is None else now - since,
                    )
                )
            return LedgerStats(
                num_blocks=self.num_blocks,
                blocks_by_state={s.label: int(counts[s]) for s in BlockState},
                requests_by_state={
                    s.value: by_req.get(s.value, 0)
                    for s in RequestState
                    if s is not RequestState.RELEASED
                },
                quarantined=tuple(quarantined),
                unsafe_releases=rows.unsafe_releases,
                refused_evidence=dict(self.refused_evidence),
                open_grants=sum(
                    g.open[r] for s in rows.slot_of.values() for r in rows.grants_of[s]
                ),
                reclaimed_blocks=dict(rows.reclaimed),
            )


__all__ = ["StepQueries"]
