"""Worked example 1: a vLLM-style block pool that keeps its own free list, guarded by kvlifetime.

The pool below is shaped like vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue``: slotted block
objects threaded on an intrusive doubly linked free list, ``ref_cnt`` for prefix-cache sharing.
It keeps its own allocator; the ledger only guards lifetimes (``acquire``), and the pool puts a
block back on its free list only when the ledger says so (``release`` / ``collect_releasable``).

What it shows:
- a finished request whose KV is still being read by a peer keeps its blocks until the proof
  (``TransferCompleted``) arrives; the next request cannot get them;
- a prefix-cache hit shares blocks with ``acquire(..., shared=True)``; the shared blocks return
  to the free list only when the last holder let go.

Run: ``python examples/vllm_style_allocator.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access, BlockIds, RequestKey
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import BlockState


class KVCacheBlock:
    """One KV page. ``prev_free`` / ``next_free`` thread it on the free list (intrusive)."""

    __slots__ = ("block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle (as vLLM's)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free = len(blocks)
        self.head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        out: list[KVCacheBlock] = []
        cur = self.head.next_free
        for _ in range(n):
            assert cur is not None
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        self.head.next_free = cur
        assert cur is not None
        cur.prev_free = self.head
        self.num_free -= n
        return out

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self.tail.prev_free
        assert last is not None
        k = 0
        for b in blocks:
            last.next_free = b
            b.prev_free = last
            last = b
            k += 1
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free += k


class BlockPool:
    """The engine's own allocator. ``ledger=None`` is the unguarded baseline."""

    def __init__(self, num_blocks: int, ledger: BlockLedger | None = None) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.ledger = ledger

    def get_new_blocks(self, request: RequestKey, n: int) -> tuple[list[KVCacheBlock], BlockIds]:
        blocks = self.free_queue.popleft_n(n)
        for b in blocks:
            b.ref_cnt += 1
        ids = np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=n)
        if self.ledger is not None:
            self.ledger.acquire(request, ids)
        return blocks, ids

    def touch(self, request: RequestKey, ids: BlockIds) -> None:
        """A prefix-cache hit: ``request`` reuses cached blocks read-only."""
        if self.ledger is not None:
            self.ledger.acquire(request, ids, shared=True)
        for i in ids.tolist():
            self.blocks[i].ref_cnt += 1

    def free_blocks(self, ids: BlockIds) -> None:
        """Put back what the ledger released (or, unguarded, what the engine says)."""
        freed = [self.blocks[i] for i in ids.tolist()]
        for b in freed:
            b.ref_cnt = 0
        self.free_queue.append_n(freed)

    def release(self, request: RequestKey) -> int:
        assert self.ledger is not None
        ids = self.ledger.release(request)
        self.free_blocks(ids)
        return len(ids)

    def step(self) -> int:
        """Once per scheduler step: put back every block whose proof arrived."""
        assert self.ledger is not None
        n = 0
        for ids in self.ledger.collect_releasable().values():
            self.free_blocks(ids)
            n += len(ids)
        return n


def main() -> None:
    ledger = BlockLedger(8)
    pool = BlockPool(8, ledger)

    # Request A: prefill computed 4 blocks; a decode peer reads them (a read grant).
    _, a_ids = pool.get_new_blocks("A", 4)
    read = ledger.grant("A", "decode-0", a_ids, Access.READ)
    ledger.finish("A")  # A's answer went out ...
    assert pool.step() == 0  # ... but decode-0 is still reading: nothing is freed
    assert set(ledger.block_state(a_ids).tolist()) == {BlockState.DRAINING}
    print("A finished, transfer open:", ledger.state("A").value, "free:", pool.free_queue.num_free)

    # The proof arrives; B hits the prefix cache on A's first two blocks before A is released:
    # their content is settled (no grant may write them), so sharing is allowed.
    ledger.apply(TransferCompleted.of(read, last_seq=1))  # decode-0: every read ended
    print("proof arrived:", ledger.state("A").value)
    pool.touch("B", a_ids[:2])
    freed = pool.step()  # A is released; the two blocks B shares stay out of the pool
    print("A released:", freed, "blocks back; free:", pool.free_queue.num_free)
    assert freed == 2

    # Prefix sharing proper: C computes 2 blocks, D hits the cache and shares them.
    _, c_ids = pool.get_new_blocks("C", 2)
    pool.touch("D", c_ids)
    ledger.finish("C")
    print("C done, D still shares:", pool.step(), "freed")  # C releases, blocks stay (D)
    ledger.finish("D")
    ledger.finish("B")
    print("B and D done:", pool.step(), "freed; generations", ledger.generation(c_ids).tolist())
    assert ledger.generation(a_ids).tolist() == [1, 1, 1, 1]
    assert pool.free_queue.num_free == 8
    print("all", pool.free_queue.num_free, "blocks free")


if __name__ == "__main__":
    main()
