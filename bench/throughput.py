"""Throughput with realistic KV block sizes: proof vs naive in the same run.

``python -m bench.throughput --backend mooncake|nixl --block-kib 64 --requests 1500``

Two modes, naive and proof interleaved ``--rounds`` times, printing requests/s and GB/s of each
and the ratio proof / naive per round (a benchmark, never a test: it measures, it does not
assert):

- ``--mode free`` (the default): **free-running**. Decode (this process) owns the arena
  (``MooncakeTarget`` / ``NixlTarget``) and a ``BlockLedger``; a prefill process writes each
  request's blocks over the engine as fast as it goes - every batch of a request posted at
  once, up to ``--window`` requests in flight, no ticks - and reports each request's outcome
  over a pipe. A tenth of the requests are aborted by decode right after their addresses left
  (writes still in flight), and ``--p-fail`` of them have one batch with a slice outside the
  arena (FAILED: on Mooncake the batch's other slices still land). ``naive`` frees at abort and
  at failure (``force_release``); ``proof`` frees only what ``collect_releasable`` returns:
  an abort waits for the prefill's ``SchedulingStopped`` + ``TransferQuiesced``, a failed
  request is quarantined, and quarantine is reclaimed by a fence (prefill reaped, the target's
  serving engine / agent re-created, a new prefill started) once ``--fence-blocks`` are
  quarantined, or when the pool runs dry, and once at the end. Decode checks every completed
  request's blocks against its pattern: ``contaminated`` counts blocks a late write of another
  request had overwritten. The proof runs are done at each threshold of ``--fence-blocks``.
  Not reproducible (real time decides every landing).
- ``--mode lockstep``: the harness (``harness.loop.run``), lock-step ticks, every fault of
  the seed reproducible.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvlifetime.adapters.transfer import Slice, Status
from kvlifetime.evidence import (
    AccessRevoked,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, GrantId
from kvlifetime.harness import pattern
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import BlockState

BATCH_BLOCKS = 16  # blocks per transfer batch (one Mooncake batch / one NIXL transfer)


# =========================================================================== prefill (a process)


def _engine(backend: str, desc: dict[str, Any], staging_bytes: int) -> Any:
    if backend == "mooncake":
        from kvlifetime.adapters.mooncake import MooncakeEngine

        return MooncakeEngine(desc, staging_bytes)
    from kvlifetime.adapters.nixl_engine import NixlEngine

    return NixlEngine(desc, staging_bytes)


def prefill_main(conn: Any, backend: str, desc: dict[str, Any], slots: int, bb: int) -> None:
    """Write every request's blocks as fast as the engine goes; report each one's outcome.

    In: ("req", rid, blocks, generations, addresses, fail_batch), ("cancel", rid), ("stop",).
    Out: ("ready",), ("done", rid, posted, ok), ("stopped", rid, posted, ok): ``ok`` means
    every posted batch was COMPLETED (a FAILED one proves nothing)."""
    engine = _engine(backend, desc, slots * bb)
    table = engine.staging.view(np.uint64).reshape(slots, bb // 8)
    bad = int(desc["base"]) + int(desc["nbytes"]) + bb  # outside the arena
    free = list(range(slots))
    waiting: deque[tuple[Any, ...]] = deque()
    flying: deque[tuple[int, list[int], list[int]]] = deque()  # rid, handles, slots
    cancelled: set[int] = set()
    conn.send(("ready",))

    def take(m: tuple[Any, ...]) -> bool:
        if m[0] == "stop":
            return False
        if m[0] == "cancel":
            cancelled.add(int(m[1]))
        else:
            waiting.append(m)
        return True

    try:
        while True:
            while conn.poll(0) or (not waiting and not flying):
                if not take(conn.recv()):
                    return
            if waiting and len(free) >= len(waiting[0][2]):
                _, rid, blocks, gens, addrs, fail = waiting.popleft()
                if rid in cancelled:
                    cancelled.discard(rid)
                    conn.send(("stopped", rid, 0, True))
                    continue
                mine = [free.pop() for _ in blocks]
                table[mine] = pattern.words(rid, blocks, gens)[:, None]
                handles = []
                for seq, lo in enumerate(range(0, len(blocks), BATCH_BLOCKS)):
                    if rid in cancelled:
                        break  # the cancel arrived: no more posts for it
                    part = range(lo, min(lo + BATCH_BLOCKS, len(blocks)))
                    sl: list[Slice] = [(mine[i] * bb, addrs[i], bb) for i in part]
                    if seq == fail:
                        sl.append((mine[lo] * bb, bad, bb))
                    handles.append(engine.submit(sl))
                    while conn.poll(0):
                        if not take(conn.recv()):
                            return
                flying.append((rid, handles, mine))
            elif flying:
                rid, handles, mine = flying.popleft()
                ok = all([engine.wait(h, 60.0) is Status.COMPLETED for h in handles])
                kind = "stopped" if rid in cancelled else "done"
                cancelled.discard(rid)
                free.extend(mine)
                conn.send((kind, rid, len(handles), ok))
            else:
                if not take(conn.recv()):
                    return
    finally:
        engine.close()


# =========================================================================== decode (this process)


@attrs.define
class Figures:
    policy: str
    fence_blocks: int
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    lost_to_fence: int = 0
    contaminated: int = 0
    unsafe_releases: int = 0
    fences: int = 0
    fence_s: float = 0.0
    kv_bytes: int = 0
    wall_s: float = 0.0
    peak_quarantined: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    @property
    def requests_per_s_without_fences(self) -> float:
        busy = self.wall_s - self.fence_s
        return self.requests / busy if busy > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.kv_bytes / self.wall_s / 1e9 if self.wall_s else 0.0


class _Prefill:
    def __init__(self, backend: str, desc: dict[str, Any], slots: int, bb: int, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.peer = f"prefill-{n}"
        self.proc = ctx.Process(target=prefill_main, args=(child, backend, desc, slots, bb))
        self.proc.start()
        child.close()
        if not self.conn.poll(60) or self.conn.recv() != ("ready",):
            raise RuntimeError("the prefill process did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)
        self.conn.close()

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


def free_run(
    backend: str,
    policy: str,
    *,
    requests: int,
    seed: int,
    block_bytes: int,
    num_blocks: int = 1024,
    window: int = 8,
    p_abort: float = 0.1,
    p_fail: float = 0.02,
    fence_blocks: int = 256,
) -> Figures:
    """One free-running run (see the module's docstring)."""
    if backend == "mooncake":
        from kvlifetime.adapters.mooncake import MooncakeTarget

        target: Any = MooncakeTarget(num_blocks * block_bytes)
    else:
        from kvlifetime.adapters.nixl_engine import NixlTarget

        target = NixlTarget(num_blocks * block_bytes)
    rng = random.Random(seed)
    ledger = BlockLedger(num_blocks)
    arena = target.array
    fig = Figures(policy, fence_blocks if policy == "proof" else 0)
    slots = 4 * num_blocks // 8  # prefill's staging: room for the window's requests
    incarnation = 0
    pre = _Prefill(backend, target.descriptor(), slots, block_bytes, incarnation)
    live: dict[int, tuple[GrantId, Any, bool]] = {}  # rid -> (grant, generations, aborted)
    gone: set[int] = set()  # naive: released at abort or failure, the report is still to come
    quarantined: set[int] = set()
    next_rid = 0
    done = 0

    def release(rid: int, ids: Any) -> None:
        live.pop(rid, None)
        quarantined.discard(rid)

    def collect() -> None:
        for rkey, ids in ledger.collect_releasable().items():
            release(int(rkey), ids)

    clock = 0.0

    def quarantine(rid: int) -> None:
        nonlocal clock
        clock += 1.0
        quarantined.add(rid)
        ledger.set_deadline(rid, clock)
        ledger.expire(clock)

    def qblocks() -> int:
        q = ledger.stats().blocks_by_state.get(BlockState.QUARANTINED.label, 0)
        fig.peak_quarantined = max(fig.peak_quarantined, q)
        return q

    def fence(restart: bool = True) -> None:
        nonlocal pre, incarnation, done
        t = time.perf_counter()
        pre.kill()  # reaped: it posts nothing more; the target's side may still apply bytes
        name = target.fence()
        ledger.apply(AccessRevoked(pre.peer, fence=name))
        lost = [r for r in live if r not in quarantined]
        for r in lost:
            if not live[r][2]:  # an aborted one was rejected already
                ledger.reject(r, "lost to fence")
        fig.lost_to_fence += len(lost)
        done += len(lost)
        collect()
        if restart:
            incarnation += 1
            pre = _Prefill(backend, target.descriptor(), slots, block_bytes, incarnation)
        fig.fences += 1
        fig.fence_s += time.perf_counter() - t

    t0 = time.perf_counter()
    try:
        while done < requests:
            while next_rid < requests and len(live) - len(quarantined) < window:
                nblocks = rng.randint(8, 64)
                if ledger.free_count() < nblocks:
                    break
                rid = next_rid
                next_rid += 1
                ids = ledger.allocate(rid, nblocks)
                g = ledger.grant(rid, pre.peer, ids, Access.WRITE)
                addrs = [target.address(int(b) * block_bytes) for b in ids]
                nb = (nblocks + BATCH_BLOCKS - 1) // BATCH_BLOCKS
                fail = rng.randrange(nb) if rng.random() < p_fail else -1
                blocks = [int(b) for b in ids]
                gens = [int(x) for x in g.generations]
                pre.conn.send(("req", rid, blocks, gens, addrs, fail))
                abort = rng.random() < p_abort
                live[rid] = (g.id, g.generations, abort)
                if abort:  # the client went away: its writes are in flight
                    pre.conn.send(("cancel", rid))
                    ledger.reject(rid, "aborted")
                    if policy == "naive":
                        gone.add(rid)
                        release(rid, ledger.force_release(rid, "aborted"))
            if len(live) == len(quarantined):
                # Nothing in flight: only quarantine holds the pool.
                if (
                    policy == "proof"
                    and quarantined
                    and (next_rid >= requests or ledger.free_count() < 64)
                ):
                    fence()
                    continue
                if next_rid >= requests and not gone:
                    break
            if policy == "proof" and fence_blocks and qblocks() >= fence_blocks:
                fence()
                continue
            kind, rid, posted, ok = pre.conn.recv()
            done += 1
            was_gone = rid in gone
            gone.discard(rid)
            if was_gone:
                fig.aborted += kind == "stopped"
                fig.failed += not ok
                continue
            gid, gens, aborted = live[rid]
            if aborted or kind == "stopped":
                fig.aborted += 1
                if not ok:
                    fig.failed += 1
                if policy == "proof":
                    ledger.apply(SchedulingStopped(gid, rid, pre.peer, posted))
                    if ok:
                        ledger.apply(TransferQuiesced(gid, rid, pre.peer, posted))
                    else:
                        quarantine(rid)
                collect()
                continue
            ids = ledger.blocks_of(rid)
            if ok:
                w = pattern.words(rid, ids, gens)
                fig.contaminated += int(pattern.mismatched(arena, ids, w, block_bytes).sum())
                fig.completed += 1
                fig.kv_bytes += len(ids) * block_bytes
                if policy == "proof":
                    ledger.apply(TransferCompleted(gid, rid, pre.peer, posted))
                ledger.finish(rid)
                if policy == "naive":
                    release(rid, ledger.force_release(rid, "consumed"))
            else:
                fig.failed += 1
                ledger.reject(rid, "transfer failed")
                if policy == "naive":
                    release(rid, ledger.force_release(rid, "transfer failed"))
                else:  # FAILED proves nothing: the batch's other slices may still land
                    quarantine(rid)
            collect()
        if policy == "proof" and qblocks():
            fence(restart=False)  # end with nothing lost, as the harness does
        else:
            pre.stop()
        fig.wall_s = time.perf_counter() - t0
        fig.requests = done
        fig.unsafe_releases = ledger.stats().unsafe_releases
    finally:
        if pre.proc.is_alive():
            pre.kill()
        target.close()
    return fig


# =========================================================================== the bench


def _free(args: argparse.Namespace) -> int:
    bb = args.block_kib * 1024
    thresholds: Sequence[int] = args.fence_blocks
    ratios: dict[int, list[float]] = {t: [] for t in thresholds}
    for rnd in range(args.rounds):
        runs = [("naive", 0), *(("proof", t) for t in thresholds)]
        if rnd % 2:
            runs.reverse()  # neither policy always runs first
        got: dict[tuple[str, int], Figures] = {}
        for policy, t in runs:
            f = free_run(
                args.backend,
                policy,
                requests=args.requests,
                seed=args.seed + rnd,
                block_bytes=bb,
                window=args.window,
                p_fail=args.p_fail,
                fence_blocks=t,
            )
            got[(policy, t)] = f
            what = policy if policy == "naive" else f"proof@{t}"
            print(
                f"round {rnd} {what:10}: {f.requests_per_s:7.1f} req/s "
                f"({f.requests_per_s_without_fences:7.1f} without fences)  {f.gb_per_s:.3f} GB/s  "
                f"wall {f.wall_s:5.2f} s  completed {f.completed}  aborted {f.aborted}  "
                f"failed {f.failed}  lost to fence {f.lost_to_fence}  contaminated "
                f"{f.contaminated}  unsafe releases {f.unsafe_releases}  fences {f.fences} "
                f"({f.fence_s:.2f} s)  peak quarantined {f.peak_quarantined}",
                flush=True,
            )
        naive = got[("naive", 0)]
        for t in thresholds:
            pf = got[("proof", t)]
            ratio = pf.requests_per_s / max(naive.requests_per_s, 1e-9)
            busy = pf.requests_per_s_without_fences / max(naive.requests_per_s, 1e-9)
            ratios[t].append(ratio)
            print(
                f"round {rnd} proof@{t} / naive requests/s: {ratio:.3f} "
                f"({busy:.3f} leaving out the fences' time)",
                flush=True,
            )
    for t in thresholds:
        xs = ratios[t]
        print(
            f"{args.backend}, free-running, {args.block_kib} KiB blocks, fence at {t} "
            f"quarantined blocks: proof / naive median {statistics.median(xs):.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in xs)})"
        )
    return 0


def _lockstep(args: argparse.Namespace) -> int:
    from kvlifetime.harness.loop import run
    from kvlifetime.harness.settings import PushSettings

    bb = args.block_kib * 1024
    ratios: list[float] = []
    for rnd in range(args.rounds):
        figures = {}
        for policy in ("naive", "proof"):
            cfg = PushSettings(
                backend=args.backend,
                policy=policy,
                requests=args.requests,
                seed=args.seed + rnd,
                block_bytes=bb,
                num_blocks=1024,
                staging_blocks=512,
            )
            r = run(cfg)
            figures[policy] = r
            print(
                f"round {rnd} {policy:5}: {r.requests_per_s:8.1f} req/s  {r.gb_per_s:.3f} GB/s  "
                f"late writes {r.seen('late_writes')}  wall {r.wall_s:.1f} s",
                flush=True,
            )
        ratio = figures["proof"].requests_per_s / max(figures["naive"].requests_per_s, 1e-9)
        ratios.append(ratio)
        print(f"round {rnd} proof / naive requests/s: {ratio:.3f}", flush=True)
    print(
        f"{args.backend}, {args.block_kib} KiB blocks: proof / naive median "
        f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.throughput")
    p.add_argument("--backend", default="mooncake", choices=("inproc", "mooncake", "nixl"))
    p.add_argument("--mode", default="free", choices=("free", "lockstep"))
    p.add_argument("--block-kib", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--window", type=int, default=8, help="free: requests in flight")
    p.add_argument("--p-fail", type=float, default=0.02, help="free: requests with a FAILED batch")
    p.add_argument(
        "--fence-blocks",
        type=int,
        nargs="+",
        default=[256],
        help="free: proof fences once this many blocks are quarantined (0: only when the pool "
        "runs dry and at the end); one proof run per value",
    )
    args = p.parse_args(argv)
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")  # a reaped prefill's peers log refusals
    if args.mode == "free":
        if args.backend == "inproc":
            p.error("--mode free runs on a real engine (mooncake, nixl)")
        return _free(args)
    return _lockstep(args)


if __name__ == "__main__":
    sys.exit(main())
