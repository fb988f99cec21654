"""The oracle at the transport: every write that lands (and every read), classified against the
block's owner at that moment. Counted, not sampled.

Decode's own check (``DecodeWorker._check``) looks at a block when it consumes it and when it
lets go: a late write into a free block, a write later overwritten by the block's next owner,
or one landing after the reader finished are invisible to it. The oracle sees each landing:

- the in-process engine logs every slice its copy thread writes, in a ring inside the shared
  mapping (``InprocTarget.landings``), so the oracle reads exactly what landed, in order;
- a real engine (Mooncake, NIXL) moves bytes decode never sees pass, so decode diffs its arena
  once per tick (``ArenaDiff``): each word that appeared in a block since the last tick is one
  landing. It cannot see a write of the word a block already holds (it changes nothing there).
  On the in-process engine both run on the same seed, and the tests require equal counts.

A landing is *late* when its word is not the word of the block's writer, the request that
acquired it exclusively and granted it, while that request still holds the block: "into another
owner's block" when the block is held by other requests (they compute from someone else's data),
"into a free block" when it is in the pool (its next owner gets it dirty unless it overwrites
every byte first). With prefix sharing a block has several holders: once its writer lets go
while sharers keep it, no landing is on time any more, its writer's word included (the writer's
grant is over; the block is the sharers'). So the oracle is told every change of a block's
holders (``granted``, ``shared``, ``let_go``, ``freed``), not only the return to the pool, and
``hit_requests`` names the requests holding the block at the landing. A block held by a
previous incarnation after a guarded restart accepts any word: nobody will read it before a
fence.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

FREE = np.uint64(0)  # the pattern never produces 0: a zero word is nobody's
ANY = np.uint64(0xFFFFFFFFFFFFFFFF)  # held by a previous incarnation: any word is its holder's
# held by sharers only, its writer gone: no word is on time. The pattern could produce this
# value (one in 2**64); ``landed`` tells it apart by the block's writer, not by the word alone.
NOBODY = np.uint64(0xFFFFFFFFFFFFFFFE)


@attrs.frozen(slots=True)
class OracleCounts:
    """What the oracle saw over a run. Every figure is a count of landings, never an estimate."""

    method: str  # "copy log" (in-process engine) or "arena diff" (a real engine)
    writes: int  # landings seen
    late_writes: int  # landings whose word is not the block's current owner's
    late_into_owned: int  # ... into a block another request holds
    late_into_free: int  # ... into a block in the pool
    late_blocks: int  # distinct blocks hit by a late write
    hit_requests: int  # distinct requests whose held block received a late write
    late_writers: int  # distinct requests whose writes landed late
    into_previous: int  # landings into blocks a previous incarnation holds (harmless)
    reads: int  # reads of source blocks seen
    stale_reads: int  # reads of a source block that a new owner already holds (or is free)
    stale_read_blocks: int
    # landings by who made them (the in-process copy log's tags; 0 on an arena diff): a dead
    # initiator's transport, after it was gone; a re-delivered old slice. And how many were late.
    after_death: int = 0
    late_after_death: int = 0
    redelivered: int = 0
    late_redelivered: int = 0


class TransportOracle:
    """Who owns each block right now, and what every landing did to it.

    Decode tells it every change of a block's holders: what it grants (``granted``: an
    exclusive acquire, and the words its peers will write), a prefix shared (``shared``), a
    request letting go of its blocks (``let_go``: they go back to the pool when nobody else
    holds them) and blocks dropped whatever holds them (``freed``: a naive restart); the
    transport tells it what landed (``landed``) and what was read (``read``).
    """

    def __init__(self, num_blocks: int, block_bytes: int, method: str) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.method = method
        self.expected = np.zeros(num_blocks, dtype=np.uint64)  # owner's word; FREE; ANY
        self.owner = np.full(num_blocks, -1, dtype=np.int64)  # writer request; -1: none
        self.holders: dict[int, set[int]] = {}  # block -> the requests holding it (none: absent)
        self._writer: dict[int, int] = {}  # word -> the request it was granted to
        self.writes = 0
        self.late_into_owned = 0
        self.late_into_free = 0
        self.into_previous = 0
        self._late_blocks: set[int] = set()
        self._hit: set[int] = set()
        self._late_writers: set[int] = set()
        self.reads = 0
        self.stale_reads = 0
        self._stale_read_blocks: set[int] = set()
        self.by_kind: dict[str, list[int]] = {"after_death": [0, 0], "redelivered": [0, 0]}

    # ----------------------------------------------------------------- what decode does

    def granted(self, request: int, blocks: npt.ArrayLike, words: npt.NDArray[np.uint64]) -> None:
        """``request`` acquired ``blocks`` exclusively and granted them: its peer writes
        ``words`` into them (the writer's word is the only one on time)."""
        b = np.asarray(blocks, dtype=np.int64)
        self.expected[b] = words
        self.owner[b] = request
        for blk in b.tolist():
            self.holders[blk] = {request}
        for w in words.tolist():
            self._writer[w] = request

    def shared(self, request: int, blocks: npt.ArrayLike) -> None:
        """``request`` acquired ``blocks`` shared (a prefix-cache hit): one more holder; the
        word on time stays the writer's while the writer holds them."""
        for blk in np.asarray(blocks, dtype=np.int64).tolist():
            self.holders.setdefault(blk, set()).add(request)

    def let_go(self, request: int, blocks: npt.ArrayLike) -> None:
        """``request`` let go of ``blocks`` (released, forced or not): those nobody else
        holds are back in the pool; those that stay shared lose their writer if it was
        ``request`` (from here every landing in them is late, into the sharers' block)."""
        b = np.asarray(blocks, dtype=np.int64)
        for blk in b.tolist():
            held = self.holders.get(blk)
            if held is not None:
                held.discard(request)
            if not held:
                self.holders.pop(blk, None)
                self.expected[blk] = FREE
                self.owner[blk] = -1
            elif self.owner[blk] == request:
                self.expected[blk] = NOBODY
                self.owner[blk] = -1

    def freed(self, blocks: npt.ArrayLike) -> None:
        """``blocks`` are back in the pool, whoever held them."""
        b = np.asarray(blocks, dtype=np.int64)
        self.expected[b] = FREE
        self.owner[b] = -1
        for blk in b.tolist():
            self.holders.pop(blk, None)

    def held_by_previous(self, blocks: npt.ArrayLike) -> None:
        b = np.asarray(blocks, dtype=np.int64)
        self.expected[b] = ANY
        self.owner[b] = -1
        for blk in b.tolist():
            self.holders.pop(blk, None)

    # ----------------------------------------------------------------- what the transport saw

    def landed(
        self,
        blocks: npt.ArrayLike,
        words: npt.ArrayLike,
        kinds: dict[str, npt.NDArray[np.bool_]] | None = None,
    ) -> None:
        """One landing per (block, word): ``words[i]`` was written into ``blocks[i]``.
        ``kinds``: per kind (``after_death``, ``redelivered``), which landings are of it."""
        b = np.asarray(blocks, dtype=np.int64)
        w = np.asarray(words, dtype=np.uint64)
        if not len(b):
            return
        self.writes += len(b)
        exp = self.expected[b]
        previous = exp == ANY
        self.into_previous += int(np.count_nonzero(previous))
        # On time: the word of the block's writer, while it holds the block. A free block or
        # one only sharers hold has no writer (NOBODY is never matched by value).
        late = ((w != exp) | (self.owner[b] < 0)) & ~previous
        for kind, mask in (kinds or {}).items():
            self.by_kind[kind][0] += int(np.count_nonzero(mask))
            self.by_kind[kind][1] += int(np.count_nonzero(mask & late))
        if not late.any():
            return
        lb, lw, le = b[late], w[late], exp[late]
        free = le == FREE
        self.late_into_free += int(np.count_nonzero(free))
        self.late_into_owned += int(np.count_nonzero(~free))
        self._late_blocks.update(lb.tolist())
        for blk in lb[~free].tolist():
            self._hit.update(self.holders.get(blk, ()))
        for word in lw.tolist():
            writer = self._writer.get(word)
            if writer is not None:
                self._late_writers.add(writer)

    def read(self, blocks: npt.ArrayLike, words: npt.ArrayLike) -> None:
        """A peer read ``blocks`` expecting them to hold ``words`` (its grant's): a read of a
        block whose owner has changed since (or that is free) is stale."""
        b = np.asarray(blocks, dtype=np.int64)
        w = np.asarray(words, dtype=np.uint64)
        self.reads += len(b)
        stale = w != self.expected[b]
        self.stale_reads += int(np.count_nonzero(stale))
        self._stale_read_blocks.update(b[stale].tolist())

    def hit_request_keys(self) -> frozenset[int]:
        """The requests ``hit_requests`` counts: each held a block when a late write landed
        in it (a request that had let go of the block before the landing is never one)."""
        return frozenset(self._hit)

    def late_writer_keys(self) -> frozenset[int]:
        """The requests ``late_writers`` counts: whose granted words landed late."""
        return frozenset(self._late_writers)

    def counts(self) -> OracleCounts:
        return OracleCounts(
            method=self.method,
            writes=self.writes,
            late_writes=self.late_into_owned + self.late_into_free,
            late_into_owned=self.late_into_owned,
            late_into_free=self.late_into_free,
            late_blocks=len(self._late_blocks),
            hit_requests=len(self._hit),
            late_writers=len(self._late_writers),
            into_previous=self.into_previous,
            reads=self.reads,
            stale_reads=self.stale_reads,
            stale_read_blocks=len(self._stale_read_blocks),
            after_death=self.by_kind["after_death"][0],
            late_after_death=self.by_kind["after_death"][1],
            redelivered=self.by_kind["redelivered"][0],
            late_redelivered=self.by_kind["redelivered"][1],
        )


class ArenaDiff:
    """What landed in an arena since the last look, for engines whose copies decode cannot
    see: each word that appeared in a block is one landing."""

    def __init__(self, arena: npt.NDArray[np.uint8], block_bytes: int) -> None:
        self._table = arena.view(np.uint64).reshape(-1, block_bytes // 8)
        self._snap = self._table.copy()

    def landings(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]]:
        table, snap = self._table, self._snap
        changed = np.flatnonzero((table != snap).any(axis=1))
        blocks: list[int] = []
        words: list[int] = []
        for blk in changed.tolist():
            now = table[blk].copy()  # the engine may still be writing: look at one copy
            before = np.unique(snap[blk])
            for w in np.setdiff1d(np.unique(now), before, assume_unique=True).tolist():
                if w != 0:
                    blocks.append(blk)
                    words.append(w)
            snap[blk] = now
        return np.asarray(blocks, dtype=np.int64), np.asarray(words, dtype=np.uint64)
