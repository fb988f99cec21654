"""BlockLedger under threads: evidence arrives on transfer-engine threads while the scheduler
allocates and releases (README, "Embedding the ledger"). At the end nothing is lost: every block is
accounted for, every generation bumped exactly once per release, every refusal counted."""

from __future__ import annotations

import queue
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvlifetime import errors
from kvlifetime.evidence import (
    CancelReceived,
    Evidence,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger

NUM_BLOCKS = 64
PEERS = ("p0", "p1", "p2", "p3")


@pytest.fixture(autouse=True)
def fine_grained_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as much as possible
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(targets: list[Callable[[], None]]) -> None:
    """Run every target in its own thread; re-raise the first failure in the test thread."""
    failures: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # pragma: no cover - reported below
                failures.append(e)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        assert not th.is_alive(), "a thread hung (deadlock?)"
    if failures:
        raise failures[0]


def evidence_for(g: Grant, rng: random.Random) -> list[Evidence]:
    """What a peer sends for one grant: complete, in a random order, with duplicates."""
    last = rng.randint(0, 3)
    if rng.random() < 0.3:
        evs: list[Evidence] = [TransferCompleted.of(g, last)]
    else:
        evs = [CancelReceived.of(g), SchedulingStopped.of(g, last), TransferQuiesced.of(g, last)]
        evs += [TransferQuiesced.of(g, max(0, last - 1))]  # a late, weaker report
    evs += rng.sample(evs, k=min(2, len(evs)))  # duplicates
    rng.shuffle(evs)
    return evs


def closes(evs: list[Evidence]) -> bool:
    """Whether this evidence of one grant proves it closed (docs/evidence.md), computed here."""
    last = [e.last_seq for e in evs if isinstance(e, SchedulingStopped | TransferCompleted)]
    through = [e.through_seq for e in evs if isinstance(e, TransferQuiesced)]
    through += [e.last_seq for e in evs if isinstance(e, TransferCompleted)]
    return bool(last) and max(through, default=0) >= last[0]


@pytest.mark.parametrize("checked", [False, True])
def test_evidence_threads_while_scheduler_allocates_and_releases(checked: bool) -> None:
    L = BlockLedger(NUM_BLOCKS, checked=checked)
    n_requests = 2000 if not checked else 300
    inboxes: dict[str, queue.Queue[Grant | None]] = {p: queue.Queue() for p in PEERS}
    stale_seen = Counter[str]()
    applied = Counter[str]()
    allocated_total = 0
    released: list[int] = []
    stop_observer = threading.Event()

    def scheduler() -> None:
        nonlocal allocated_total
        rng = random.Random(1)
        held: dict[int | str, set[int]] = {}

        def collect() -> None:
            for key, ids in L.collect_releasable().items():
                got = set(ids.tolist())
                assert got == held.pop(key), key  # exclusive blocks all come back
                released.extend(got)

        for i in range(n_requests):
            key: int | str = i if i % 2 else f"req-{i}"
            n = rng.randint(1, 4)
            deadline = time.monotonic() + 30
            while True:
                try:
                    ids = L.allocate(key, n)
                    break
                except errors.OutOfBlocks:
                    assert time.monotonic() < deadline, "blocks never came back"
                    collect()
            got = set(ids.tolist())
            in_use = set().union(*held.values()) if held else set()
            assert not got & in_use, "a block still held was handed out again"
            held[key] = got
            allocated_total += n
            peer = PEERS[i % len(PEERS)]
            g = L.grant(key, peer, ids, Access.WRITE if i % 3 else Access.READ)
            inboxes[peer].put(g)
            if rng.random() < 0.5:
                L.reject(key)
            else:
                L.finish(key)
            if i % 7 == 0:
                collect()
        for p in PEERS:
            inboxes[p].put(None)

    def peer(name: str, seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            done: list[Grant] = []
            while (g := inboxes[name].get()) is not None:
                proven: list[Evidence] = []
                for ev in evidence_for(g, rng):
                    try:
                        L.apply(ev)
                    except errors.StaleEvidence:
                        # Only once the grant was proven closed can its request be gone.
                        assert closes(proven), (ev, proven)
                        stale_seen[name] += 1
                    proven.append(ev)
                    applied[name] += 1
                done.append(g)
                if rng.random() < 0.2:
                    # A very late duplicate: the request may be released by now (stale), or
                    # still live (a no-op). Either way nothing changes.
                    old = rng.choice(done)
                    try:
                        L.apply(CancelReceived.of(old))
                    except errors.StaleEvidence:
                        stale_seen[name] += 1

        return run

    def observer() -> None:
        while not stop_observer.is_set():
            st = L.stats()
            assert sum(st.blocks_by_state.values()) == NUM_BLOCKS
            h = L.holders(np.arange(NUM_BLOCKS))
            assert h.max() <= 1  # nothing shared in this test: never two holders
            L.fingerprint()

    obs = threading.Thread(target=observer, daemon=True)
    obs.start()
    try:
        run_threads([scheduler, *(peer(p, k) for k, p in enumerate(PEERS))])
    finally:
        stop_observer.set()
        obs.join(timeout=30)
    # Every grant was proven closed: everything can be collected, nothing is left anywhere.
    rest = L.collect_releasable()
    for ids in rest.values():
        released.extend(ids.tolist())
    assert L.live_requests() == []
    assert L.free_count() == NUM_BLOCKS
    st = L.stats()
    assert st.blocks_by_state["free"] == NUM_BLOCKS
    assert st.open_grants == 0
    assert st.unsafe_releases == 0
    assert len(released) == allocated_total
    gens = L.generation(np.arange(NUM_BLOCKS))
    assert int(gens.sum()) == allocated_total
    assert Counter(released) == Counter({b: int(gens[b]) for b in range(NUM_BLOCKS) if gens[b]})
    assert st.refused_evidence == (
        {"stale_evidence": sum(stale_seen.values())} if stale_seen else {}
    )
    assert sum(applied.values()) > n_requests * 3


def test_concurrent_allocators_never_share_a_block() -> None:
    L = BlockLedger(NUM_BLOCKS)
    L.allocate("warm", 0)
    owned: dict[int, str] = {}
    owned_lock = threading.Lock()
    per_thread = 150
    counts = Counter[str]()

    def worker(name: str, seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            for i in range(per_thread):
                key = f"{name}-{i}"
                try:
                    ids = L.allocate(key, rng.randint(1, 6))
                except errors.OutOfBlocks:
                    continue
                with owned_lock:
                    for b in ids.tolist():
                        assert b not in owned, f"block {b} owned by {owned[b]} and {key}"
                        owned[b] = key
                g = L.grant(key, name, ids)
                L.finish(key)
                L.apply(SchedulingStopped.of(g, 1))
                with owned_lock:  # forget before the blocks can go back to the pool
                    for b in ids.tolist():
                        del owned[b]
                L.apply(TransferQuiesced.of(g, 1))
                assert set(L.release(key).tolist()) == set(ids.tolist())
                counts[name] += len(ids)

        return run

    run_threads([worker(f"t{k}", k) for k in range(4)])
    assert L.live_requests() == ["warm"]
    assert L.free_count() == NUM_BLOCKS
    assert int(L.generation(np.arange(NUM_BLOCKS)).sum()) == sum(counts.values())
    assert L.stats().refused_evidence == {}
