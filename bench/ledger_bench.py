"""BlockLedger benchmarks: every figure is a ratio against a baseline measured in the same run.

Run: ``make bench`` (or ``python -m bench``). Targets (issue "BlockLedger"):
1. the full guarded lifecycle (acquire -> grant -> reject -> SchedulingStopped + TransferQuiesced
   -> release) for 1000 requests of 64 blocks, layered on a vLLM-style free-list allocator,
   <= 1.5x that allocator's own alloc+free of the same blocks; the same with ``allocate``;
2. batches of 1024 blocks: <= 15 ns per block per ledger operation;
3. one piece of evidence that fires a request transition: <= 2 us median, and the ratio to
   python-statemachine's ``send()`` on the same transition; per piece in one ``apply_many`` of a
   step's evidence, and per request in one ``finish_many`` (1000 a call);
3b. one block at a time, as decode grows a request: ``acquire`` of one block (median, each
   counts mode), and a decode step of 1000 running requests in one ``acquire_many`` (us per
   request); the few-calls variant of 1. (``acquire_and_grant``) and the per-step batches
   (``reject_many``, ``apply_many``) run beside the others there;
4. ledger memory <= 16 bytes per block, for 1M blocks;
5. (issue 10) a shared acquire costs O(batch), whatever the number of live sharers: a 16-block
   batch with 10, 1,000 and 10,000 live sharers, as ratios against the 10-sharer case.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from examples.vllm_style_allocator import BlockPool
from kvlifetime.evidence import (
    CancelReceived,
    Evidence,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.lifecycles import RequestLifecycle
from kvlifetime.spec.proof import GrantProof

REQUESTS = 1000
BLOCKS = 64
REPEATS = 7


def best_of(fn: Callable[[], float], repeats: int = REPEATS) -> float:
    """Median of ``repeats`` runs (each returns seconds); GC off during a run."""
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            times.append(fn())
        finally:
            gc.enable()
    return statistics.median(times)


def baseline_allocator() -> float:
    """The vLLM-style pool alone: alloc + free of 1000 x 64 blocks, scheduler-step style."""
    pool = BlockPool(REQUESTS * BLOCKS)
    t0 = time.perf_counter()
    held = [pool.get_new_blocks(r, BLOCKS)[1] for r in range(REQUESTS)]
    for ids in held:
        pool.free_blocks(ids)
    return time.perf_counter() - t0


def _reject_and_prove(
    ledger: BlockLedger, grants: list[Any], release: Callable[[int], Any] | None = None
) -> None:
    """The early end of every request, then the peer's proof; optionally release each."""
    for r, g in enumerate(grants):
        ledger.reject(r, "abort")
        ledger.apply(SchedulingStopped.of(g, 3))
        ledger.apply(TransferQuiesced.of(g, 3))
        if release is not None:
            release(r)


def _layered(per_request_release: bool) -> float:
    """The vLLM-style pool with the ledger layered on it (acquire), every request through the
    full guarded lifecycle; released once per step, or per request."""
    ledger = BlockLedger(REQUESTS * BLOCKS)
    pool = BlockPool(REQUESTS * BLOCKS, ledger)
    t0 = time.perf_counter()
    grants = []
    for r in range(REQUESTS):
        _, ids = pool.get_new_blocks(r, BLOCKS)
        grants.append(ledger.grant(r, "prefill-0", ids, Access.WRITE))
    _reject_and_prove(ledger, grants, pool.release if per_request_release else None)
    if not per_request_release:
        pool.step()  # one collect_releasable per scheduler step
    dt = time.perf_counter() - t0
    assert pool.free_queue.num_free == REQUESTS * BLOCKS
    return dt


def guarded_acquire() -> float:
    """Same allocator, every request through the full guarded lifecycle (acquire path)."""
    return _layered(per_request_release=False)


def guarded_allocate() -> float:
    """The ledger owns the free list: allocate -> grant -> reject -> evidence -> collect."""
    ledger = BlockLedger(REQUESTS * BLOCKS)
    t0 = time.perf_counter()
    grants = [
        ledger.grant(r, "prefill-0", ledger.allocate(r, BLOCKS), Access.WRITE)
        for r in range(REQUESTS)
    ]
    _reject_and_prove(ledger, grants)
    ledger.collect_releasable()
    dt = time.perf_counter() - t0
    assert ledger.free_count() == REQUESTS * BLOCKS
    return dt


def guarded_few_calls() -> float:
    """The few-calls API on the same allocator: ``acquire_and_grant`` per request (the pool
    hands out the blocks, the ledger records them and the grant in one call), the early end
    and its proof, one ``collect_releasable`` per step."""
    ledger = BlockLedger(REQUESTS * BLOCKS)
    pool = BlockPool(REQUESTS * BLOCKS)
    t0 = time.perf_counter()
    grants = []
    for r in range(REQUESTS):
        _, ids = pool.get_new_blocks(r, BLOCKS)
        grants.append(ledger.acquire_and_grant(r, ids, "prefill-0", Access.WRITE))
    _reject_and_prove(ledger, grants)
    for ids in ledger.collect_releasable().values():
        pool.free_blocks(ids)
    dt = time.perf_counter() - t0
    assert pool.free_queue.num_free == REQUESTS * BLOCKS
    return dt


def guarded_step_batches() -> float:
    """The per-step batches on the same allocator: ``acquire_and_grant`` per request, then the
    step's ends in one ``reject_many``, the peers' proofs in one ``apply_many``, one
    ``collect_releasable``."""
    ledger = BlockLedger(REQUESTS * BLOCKS)
    pool = BlockPool(REQUESTS * BLOCKS)
    t0 = time.perf_counter()
    grants = []
    for r in range(REQUESTS):
        _, ids = pool.get_new_blocks(r, BLOCKS)
        grants.append(ledger.acquire_and_grant(r, ids, "prefill-0", Access.WRITE))
    ended = ledger.reject_many(range(REQUESTS), "abort")
    proofs: list[Evidence] = [SchedulingStopped.of(g, 3) for g in grants]
    proofs += [TransferQuiesced.of(g, 3) for g in grants]
    proven = ledger.apply_many(proofs)
    for ids in ledger.collect_releasable().values():
        pool.free_blocks(ids)
    dt = time.perf_counter() - t0
    assert ended.ok and proven.ok
    assert pool.free_queue.num_free == REQUESTS * BLOCKS
    return dt


def per_request_release() -> float:
    """Like guarded_acquire, but release() per request instead of one batch per step."""
    return _layered(per_request_release=True)


def lifecycle_profile() -> dict[str, float]:
    """Where the guarded lifecycle's time goes: us per request for each call, in order."""
    ledger = BlockLedger(REQUESTS * BLOCKS)
    batches = [np.arange(r * BLOCKS, (r + 1) * BLOCKS, dtype=np.int64) for r in range(REQUESTS)]
    out: dict[str, float] = {}
    grants: list[Any] = []
    stopped: list[Any] = []
    quiesced: list[Any] = []

    def step(label: str, fn: Callable[[], Any]) -> None:
        gc.disable()
        t0 = time.perf_counter()
        fn()
        out[label] = (time.perf_counter() - t0) / REQUESTS * 1e6
        gc.enable()

    def acquire_all() -> None:
        for r in range(REQUESTS):
            ledger.acquire(r, batches[r])

    def grant_all() -> None:
        grants.extend(ledger.grant(r, "p", batches[r]) for r in range(REQUESTS))

    def reject_all() -> None:
        for r in range(REQUESTS):
            ledger.reject(r)

    step("acquire", acquire_all)
    step("grant", grant_all)
    step("reject", reject_all)
    step(
        "build SchedulingStopped",
        lambda: stopped.extend(SchedulingStopped.of(g, 3) for g in grants),
    )
    step(
        "build TransferQuiesced", lambda: quiesced.extend(TransferQuiesced.of(g, 3) for g in grants)
    )
    step("apply SchedulingStopped", lambda: [ledger.apply(e) for e in stopped])
    step("apply TransferQuiesced", lambda: [ledger.apply(e) for e in quiesced])
    step("collect_releasable (1 call)", ledger.collect_releasable)
    return out


def batch_ops(batch: int = 1024, rounds: int = 200) -> dict[str, float]:
    """ns per block for each ledger operation on batches of ``batch`` blocks.

    Each figure times only the operation: the ledger is built (and brought to the state the
    operation needs) before the clock starts.
    """
    n = batch * rounds
    batches = [np.arange(i * batch, (i + 1) * batch, dtype=np.int64) for i in range(rounds)]

    def measure(setup: Callable[[], BlockLedger], op: Callable[[BlockLedger, int], Any]) -> float:
        def run() -> float:
            ledger = setup()
            t0 = time.perf_counter()
            for i in range(rounds):
                op(ledger, i)
            return time.perf_counter() - t0

        return best_of(run, 5) / n * 1e9

    def empty() -> BlockLedger:
        return BlockLedger(n)

    def owning_free_list() -> BlockLedger:
        ledger = BlockLedger(n)
        ledger.allocate("warm-up", 0)  # builds the free list
        return ledger

    def acquired() -> BlockLedger:
        ledger = BlockLedger(n)
        for i, ids in enumerate(batches):
            ledger.acquire(i, ids)
        return ledger

    def ended() -> BlockLedger:
        ledger = acquired()
        for i in range(rounds):
            ledger.finish(i)
        return ledger

    def collect(ledger: BlockLedger, i: int) -> None:
        if i == 0:
            ledger.collect_releasable()

    steps = [[(i * batch + j, int(b)) for j, b in enumerate(batches[i])] for i in range(rounds)]

    def running() -> BlockLedger:
        ledger = BlockLedger(n)
        for step in steps:
            for key, _ in step:
                ledger.admit(key)
        return ledger

    def acquire_many_keys(led: BlockLedger, i: int) -> None:
        # A decode step: 1024 running requests taking one block each, in one call; the dict is
        # built inside the timed region, as a scheduler builds it.
        led.acquire_many({key: (b,) for key, b in steps[i]})

    return {
        "acquire": measure(empty, lambda led, i: led.acquire(i, batches[i])),
        "acquire_and_grant": measure(
            empty, lambda led, i: led.acquire_and_grant(i, batches[i], "p", Access.WRITE)
        ),
        "acquire_many (1024 running requests x 1 block)": measure(running, acquire_many_keys),
        "allocate": measure(owning_free_list, lambda led, i: led.allocate(i, batch)),
        "grant": measure(acquired, lambda led, i: led.grant(i, "p", batches[i])),
        "release (one call per batch)": measure(ended, lambda led, i: led.release(i)),
        "collect_releasable (all at once)": measure(ended, collect),
    }


def _median_apply(ledger: BlockLedger, evs: list[Any], fires: int) -> float:
    times = []
    gc.disable()
    try:
        for ev in evs:
            t0 = time.perf_counter()
            fired = ledger.apply(ev)
            times.append(time.perf_counter() - t0)
            assert len(fired) == fires, fired
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def evidence_latency(samples: int = 5000) -> dict[str, float]:
    """Median us for one apply() that fires transitions, vs python-statemachine send()."""
    ledger = BlockLedger(samples * 2)
    grants = []
    for r in range(samples):
        grants.append(ledger.grant(r, "p", ledger.allocate(r, 1)))
        ledger.reject(r)
    out = {}
    # CancelReceived on a rejected request: exactly one transition (cancel_received).
    out["apply, fires 1 transition"] = _median_apply(
        ledger, [CancelReceived.of(g) for g in grants], 1
    )
    # TransferCompleted then: scheduling_stopped and transfer_quiesced, in order.
    out["apply, fires 2 transitions"] = _median_apply(
        ledger, [TransferCompleted.of(g, 1) for g in grants], 2
    )

    class Facts:
        def __init__(self) -> None:
            self.p = GrantProof()

        def open_proofs(self) -> Any:
            return () if self.p.closed else (self.p,)

    sm_times = []
    ev = CancelReceived.of(grants[0])
    for _ in range(500):
        f = Facts()
        m = RequestLifecycle(f)
        m.send("rejected")
        f.p.record(ev)
        t0 = time.perf_counter()
        m.send("cancel_received")
        sm_times.append(time.perf_counter() - t0)
    out["python-statemachine send(), same transition"] = statistics.median(sm_times) * 1e6

    build = []
    for g in grants[:2000]:
        t0 = time.perf_counter()
        CancelReceived.of(g)
        build.append(time.perf_counter() - t0)
    out["building the evidence object"] = statistics.median(build) * 1e6
    out.update(evidence_batch_latency())
    return out


def evidence_batch_latency(requests: int = 1000, steps: int = 7) -> dict[str, float]:
    """us per piece of ``apply_many`` (each fires one transition, cancel_received) and per
    request of ``finish_many``: a step of ``requests`` requests, median of ``steps`` steps."""
    applied, finished = [], []
    gc.disable()
    try:
        for _ in range(steps):
            ledger = BlockLedger(requests * 2)
            grants = [ledger.grant(r, "p", ledger.allocate(r, 1)) for r in range(requests)]
            evs = [CancelReceived.of(g) for g in grants]
            ledger.reject_many(range(requests))
            t0 = time.perf_counter()
            out = ledger.apply_many(evs)
            applied.append(time.perf_counter() - t0)
            assert out.ok and len(out.transitions) == requests
            keys = [f"f{r}" for r in range(requests)]
            for k in keys:
                ledger.admit(k)
            t0 = time.perf_counter()
            ended = ledger.finish_many(keys)
            finished.append(time.perf_counter() - t0)
            assert ended.ok
    finally:
        gc.enable()
    return {
        f"apply_many, fires 1 transition, per piece ({requests} a call)": (
            statistics.median(applied) / requests * 1e6
        ),
        f"finish_many, per request ({requests} a call)": (
            statistics.median(finished) / requests * 1e6
        ),
    }


SHARERS = (10, 1_000, 10_000)
SHARED_BATCH = 16


def shared_acquire(sharers: int, samples: int = 2000) -> float:
    """Median us of one ``acquire(shared=True)`` of a 16-block batch while ``sharers`` other
    requests hold those blocks shared. Each timed request then ends and lets go (untimed), so
    the number of live sharers stays the same throughout."""
    ledger = BlockLedger(4 * SHARED_BATCH)
    batch = np.arange(SHARED_BATCH, dtype=np.int64)
    ledger.acquire("owner", batch)
    for i in range(sharers):
        ledger.acquire(i, batch, shared=True)
    times = []
    gc.disable()
    try:
        for k in range(samples):
            key = f"hit-{k}"
            t0 = time.perf_counter()
            ledger.acquire(key, batch, shared=True)
            times.append(time.perf_counter() - t0)
            ledger.finish(key)
            ledger.release(key)
    finally:
        gc.enable()
    assert ledger.holders(batch).tolist() == [sharers + 1] * SHARED_BATCH
    return statistics.median(times) * 1e6


def shared_acquire_scaling(rounds: int = 5) -> dict[int, tuple[float, float]]:
    """Per live-sharer count: (median us, ratio to the 10-sharer case); the counts run
    interleaved, one of each per round, and each ratio is taken within a round."""
    per_round = [{n: shared_acquire(n) for n in SHARERS} for _ in range(rounds)]
    base = SHARERS[0]
    return {
        n: (
            statistics.median(r[n] for r in per_round),
            statistics.median(r[n] / r[base] for r in per_round),
        )
        for n in SHARERS
    }


def one_block(samples: int = 5000, requests: int = 1000, steps: int = 8) -> dict[str, float]:
    """Median us of ``acquire`` of one block (a decode step growing one request), in each
    counts mode; and us per request of a decode step done with one ``acquire_many`` for
    ``requests`` requests (median of ``steps`` steps)."""
    out: dict[str, float] = {}
    for counts in ("ledger", "engine"):
        ledger = BlockLedger(samples + 1, counts=counts)
        ledger.acquire("r", [samples])
        times = []
        gc.disable()
        try:
            for b in range(samples):
                t0 = time.perf_counter()
                ledger.acquire("r", (b,))
                times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
        out[f"acquire of 1 block, counts={counts!r}"] = statistics.median(times) * 1e6
    ledger = BlockLedger(requests * (steps + 1), counts="engine")
    ledger.acquire_many({r: (r,) for r in range(requests)})
    per_step = []
    gc.disable()
    try:
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            ledger.acquire_many({r: (s * requests + r,) for r in range(requests)})
            per_step.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    out[f"acquire_many, {requests} requests x 1 block, per request"] = (
        statistics.median(per_step) / requests * 1e6
    )
    return out


def memory_per_block(n: int = 1_000_000) -> tuple[float, float]:
    ledger = BlockLedger(n)
    arrays = ledger.inspect().nbytes
    ledger.allocate("x", 1)
    inside = ledger.inspect()
    assert inside.free_stack is not None
    with_stack = inside.nbytes
    return arrays / n, with_stack / n


def main() -> None:
    print(
        f"kvlifetime ledger bench — {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )
    # The variants run interleaved, one of each per round, and every ratio is taken within a
    # round: this machine's speed drifts by up to 1.6x over a minute (measured), so a ratio of
    # medians taken minutes apart would mostly measure the drift.
    variants: dict[str, Callable[[], float]] = {
        "baseline": baseline_allocator,
        "acquire": guarded_acquire,
        "per_req": per_request_release,
        "allocate": guarded_allocate,
        "few": guarded_few_calls,
        "batches": guarded_step_batches,
    }
    rounds: list[dict[str, float]] = []
    for _ in range(REPEATS):
        rounds.append({k: best_of(fn, 1) for k, fn in variants.items()})
    med = {k: statistics.median(r[k] for r in rounds) for k in variants}
    ratio = {k: statistics.median(r[k] / r["baseline"] for r in rounds) for k in variants}
    spread = {
        k: (min(r[k] / r["baseline"] for r in rounds), max(r[k] / r["baseline"] for r in rounds))
        for k in variants
    }
    base, acq = med["baseline"], med["acquire"]
    nb = REQUESTS * BLOCKS
    print(
        f"\n1. full lifecycle, {REQUESTS} requests x {BLOCKS} blocks "
        f"(median of {REPEATS} interleaved rounds; ratio range in brackets)"
    )
    for key, label, note in (
        ("baseline", "baseline vLLM-style alloc+free    ", ""),
        ("acquire", "guarded, acquire + collect         ", "   (target <= 1.5x)"),
        ("per_req", "guarded, acquire + release per req ", ""),
        ("allocate", "ledger owns free list (allocate)   ", "   (target <= 1.5x)"),
        ("few", "few calls: acquire_and_grant+collect", ""),
        ("batches", "+ reject_many, apply_many per step  ", ""),
    ):
        lo, hi = spread[key]
        print(
            f"   {label} {med[key] * 1e3:8.2f} ms  ({med[key] / nb * 1e9:6.1f} ns/block)  "
            f"{ratio[key]:.2f}x [{lo:.2f}-{hi:.2f}]{note}"
        )
    print(f"   ledger overhead per request (acquire path): {(acq - base) / REQUESTS * 1e6:.2f} us")
    prof = lifecycle_profile()
    print(
        f"   profile, us per request: baseline alloc+free {base / REQUESTS * 1e6:.2f}; ledger "
        f"{sum(prof.values()):.2f} ="
    )
    for label, us in prof.items():
        print(f"     {label:34s} {us:6.2f}")

    print("\n2. batches of 1024 blocks, ns per block (target <= 15)")
    for label, ns in batch_ops().items():
        print(f"   {label:46s} {ns:7.2f}")

    lat = evidence_latency()
    ours = lat["apply, fires 1 transition"]
    sm = lat["python-statemachine send(), same transition"]
    print("\n3. one evidence that fires a request transition (median, us; target <= 2)")
    for label, us in lat.items():
        print(f"   {label:44s} {us:6.2f}")
    print(f"   python-statemachine / ledger: {sm / ours:.0f}x")

    print("\n3b. one block at a time (median us; target <= 1.5)")
    for label, us in one_block().items():
        print(f"   {label:52s} {us:6.2f}")

    arrays, with_stack = memory_per_block()
    print("\n4. memory, 1M blocks (target <= 16 B/block)")
    print(f"   per-block arrays                   {arrays:5.1f} B/block")
    print(f"   + the ledger's own free list        {with_stack:5.1f} B/block")

    print(
        f"\n5. shared acquire of a {SHARED_BATCH}-block batch (median us; ratio to "
        f"{SHARERS[0]} live sharers, target ~1x: O(batch))"
    )
    for n, (sh_us, sh_ratio) in shared_acquire_scaling().items():
        print(f"   {n:>6,} live sharers                {sh_us:6.2f} us   {sh_ratio:.2f}x")


if __name__ == "__main__":
    main()
