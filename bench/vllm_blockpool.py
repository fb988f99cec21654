"""The ledger on vLLM's real ``BlockPool``: ns per block, and the ratio to the pool alone.

``.venv-vllm/bin/python -m bench.vllm_blockpool [--requests 1000 --blocks 64 --rounds 15
--out FILE]``

``vllm.v1.core.block_pool.BlockPool`` (prefix caching on, as vLLM runs it), the blocks handed
out by vLLM and guarded by ``BlockLedger(num_blocks, counts="engine")`` (vLLM's reference
counts decide when a block is free; the ledger guards exposure only), a fresh ledger per run:

- **whole**: per request ``get_new_blocks(64)`` -> ``acquire`` -> ``grant`` (READ: a remote
  decode reads the blocks) -> ``finish`` -> ``apply(TransferCompleted)`` -> ``release`` (per
  request; or ``collect_releasable`` once per step) -> ``free_blocks``; against
  ``get_new_blocks(64)`` -> ``free_blocks`` alone. The block ids the ledger is given are read off
  vLLM's ``KVCacheBlock`` objects inside the timed region (a guard has to).
- **incremental**: the decode shape: 48 prompt blocks in one ``get_new_blocks`` with a WRITE
  grant (the prompt's KV loads) completed, then 16 steps in which every request gets one more
  block (``get_new_blocks(1)`` -> ``acquire`` of that one), then finish, release and
  ``free_blocks``; against the same calls on the pool alone.
- **the few-calls API** beside each: ``acquire_and_grant`` instead of ``acquire`` + ``grant``
  (whole); the prompt's blocks with ``acquire_and_grant`` and each decode step's new blocks of
  every request in one ``acquire_many``, one ``collect_releasable`` (incremental).
- **the per-step batches** on top of that: a step's ends in one ``finish_many`` and its
  evidence (the transfers that completed) in one ``apply_many`` (each item applied or refused
  on its own; the run checks none was refused).
- **the abort path** (whole): the same with the step's requests rejected (``reject_many``), their
  evidence after the rejects, then collected.
- **the step-columnar ledger** (whole): ``StepLedger`` as the guard steps it, one call per
  kind per step (``grant_many``, ``end_many``, ``prove``, ``collect``), finished or rejected.

Phases run as a scheduler runs them: every request allocates, then every request ends. The
variants run interleaved, one of each per round in alternating order, the collector off during
a run; every ratio is taken within a round, the median of the rounds is reported with the
range. A benchmark, not a test: it measures, it does not assert (beyond every block being back
in vLLM's pool after every run).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import vllm_common as common
from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger, StepLedger

PEER = "decode-0"
PROMPT = 48  # incremental shape: prompt blocks, then one block per step up to --blocks


def _ledger(n: int) -> tuple[BlockLedger, str]:
    """``BlockLedger(n, counts="engine")``; a plain ledger where that keyword does not exist
    yet (an exclusive acquire of blocks vLLM hands out is the same record for this shape)."""
    try:
        return BlockLedger(n, counts="engine"), 'BlockLedger(n, counts="engine")'
    except TypeError:
        return BlockLedger(n), "BlockLedger(n) (counts= not available)"


class Bench:
    def __init__(self, requests: int, blocks: int) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.BlockPool = BlockPool
        self.requests = requests
        self.blocks = blocks
        self.num_blocks = requests * blocks + 1  # + vLLM's null block
        self.mode = _ledger(1)[1]

    def pool(self) -> Any:
        return self.BlockPool(self.num_blocks, enable_caching=True, hash_block_size=16)

    def _done(self, pool: Any, t0: int) -> float:
        dt = time.perf_counter_ns() - t0
        if pool.get_num_free_blocks() != self.num_blocks - 1:
            raise SystemExit("not every block is back in vLLM's pool")
        return dt / (self.requests * self.blocks)

    # ------------------------------------------------------------------ whole requests

    def pool_whole(self) -> float:
        pool, n, b = self.pool(), self.requests, self.blocks
        t0 = time.perf_counter_ns()
        held = [pool.get_new_blocks(b) for _ in range(n)]
        for blocks in held:
            pool.free_blocks(blocks)
        return self._done(pool, t0)

    def _ledger_whole(
        self, per_request: bool, one_call: bool = False, batches: bool = False
    ) -> float:
        """``one_call``: the blocks and their grant in one ``acquire_and_grant``; ``batches``:
        the step's ends and evidence in one ``finish_many`` and one ``apply_many``."""
        pool, n, b = self.pool(), self.requests, self.blocks
        ledger, _ = _ledger(self.num_blocks)
        t0 = time.perf_counter_ns()
        held = []
        grants = []
        for r in range(n):
            blocks = pool.get_new_blocks(b)
            ids = np.fromiter([x.block_id for x in blocks], np.int64, b)
            if one_call:
                grants.append(ledger.acquire_and_grant(r, ids, PEER, Access.READ))
            else:
                ledger.acquire(r, ids)
                grants.append(ledger.grant(r, PEER, ids, Access.READ))
            held.append(blocks)
        if per_request:
            for r in range(n):
                ledger.finish(r)
                ledger.apply(TransferCompleted.of(grants[r], 0))
                ledger.release(r)
                pool.free_blocks(held[r])
        elif batches:
            if not ledger.finish_many(range(n)).ok:  # once per step
                raise SystemExit("finish_many refused a request")
            if not ledger.apply_many([TransferCompleted.of(g, 0) for g in grants]).ok:
                raise SystemExit("apply_many refused evidence")
            for key in ledger.collect_releasable():
                pool.free_blocks(held[key])  # type: ignore[index]
        else:
            for r in range(n):
                ledger.finish(r)
                ledger.apply(TransferCompleted.of(grants[r], 0))
            for key in ledger.collect_releasable():  # once per step
                pool.free_blocks(held[key])  # type: ignore[index]
        return self._done(pool, t0)

    def ledger_whole(self) -> float:
        return self._ledger_whole(per_request=True)

    def ledger_whole_collect(self) -> float:
        return self._ledger_whole(per_request=False)

    def ledger_whole_few_calls(self) -> float:
        """The few-calls API: ``acquire_and_grant`` per request, evidence per request, one
        ``collect_releasable`` per step."""
        return self._ledger_whole(per_request=False, one_call=True)

    def ledger_whole_step_batches(self) -> float:
        """The per-step batches: ``acquire_and_grant`` per request, then the step's ends in
        one ``finish_many``, its evidence in one ``apply_many``, one ``collect_releasable``."""
        return self._ledger_whole(per_request=False, one_call=True, batches=True)

    def ledger_whole_abort(self) -> float:
        """The abort path on the object ledger: ``acquire_and_grant`` per request, the step's
        aborts in one ``reject_many``, their evidence later in one ``apply_many``, one
        ``collect_releasable``."""
        pool, n, b = self.pool(), self.requests, self.blocks
        ledger, _ = _ledger(self.num_blocks)
        t0 = time.perf_counter_ns()
        held, grants = [], []
        for r in range(n):
            blocks = pool.get_new_blocks(b)
            ids = np.fromiter([x.block_id for x in blocks], np.int64, b)
            grants.append(ledger.acquire_and_grant(r, ids, PEER, Access.READ))
            held.append(blocks)
        if not ledger.reject_many(range(n), reason="aborted").ok:
            raise SystemExit("reject_many refused a request")
        if not ledger.apply_many([TransferCompleted.of(g, 0) for g in grants]).ok:
            raise SystemExit("apply_many refused evidence")
        for key in ledger.collect_releasable():
            pool.free_blocks(held[key])  # type: ignore[index]
        return self._done(pool, t0)

    def _step_ledger_whole(self, aborted: bool) -> float:
        """The step-columnar ledger (``StepLedger``), as the guard steps it: the step's grants
        in one ``grant_many`` (block ids as vLLM's lists of ints), its ends in one
        ``end_many`` (``aborted``: rejected, the abort path), its evidence in one ``prove``,
        one ``collect``."""
        pool, n, b = self.pool(), self.requests, self.blocks
        ledger = StepLedger(self.num_blocks)
        t0 = time.perf_counter_ns()
        held = []
        items: list[tuple[int, list[int]]] = []
        for r in range(n):
            blocks = pool.get_new_blocks(b)
            items.append((r, [x.block_id for x in blocks]))
            held.append(blocks)
        handles = [h for h in ledger.grant_many(items, PEER, Access.READ) if isinstance(h, int)]
        if len(handles) != n:
            raise SystemExit("grant_many refused a request")
        if ledger.end_many(range(n), aborted=aborted):
            raise SystemExit("end_many refused a request")
        if ledger.prove(handles, TransferCompleted):
            raise SystemExit("prove refused evidence")
        for key in ledger.collect():
            pool.free_blocks(held[int(key)])  # type: ignore[call-overload]
        return self._done(pool, t0)

    def step_ledger_whole(self) -> float:
        return self._step_ledger_whole(aborted=False)

    def step_ledger_abort(self) -> float:
        return self._step_ledger_whole(aborted=True)

    # ------------------------------------------------------------------ incremental

    def pool_incremental(self) -> float:
        pool, n = self.pool(), self.requests
        t0 = time.perf_counter_ns()
        held = [pool.get_new_blocks(PROMPT) for _ in range(n)]
        for _ in range(self.blocks - PROMPT):
            for r in range(n):
                held[r].extend(pool.get_new_blocks(1))
        for blocks in held:
            pool.free_blocks(blocks)
        return self._done(pool, t0)

    def ledger_incremental(self) -> float:
        pool, n = self.pool(), self.requests
        ledger, _ = _ledger(self.num_blocks)
        t0 = time.perf_counter_ns()
        held = []
        for r in range(n):
            blocks = pool.get_new_blocks(PROMPT)
            ids = np.fromiter([x.block_id for x in blocks], np.int64, PROMPT)
            ledger.acquire(r, ids)
            g = ledger.grant(r, PEER, ids, Access.WRITE)
            ledger.apply(TransferCompleted.of(g, 0))  # the prompt's KV has landed
            held.append(blocks)
        for _ in range(self.blocks - PROMPT):
            for r in range(n):
                (block,) = pool.get_new_blocks(1)
                ledger.acquire(r, (block.block_id,))
                held[r].append(block)
        for r in range(n):
            ledger.finish(r)
            ledger.release(r)
            pool.free_blocks(held[r])
        return self._done(pool, t0)

    def ledger_incremental_per_step(self, batches: bool = False) -> float:
        """The few-calls API: the prompt's blocks with ``acquire_and_grant``, then each decode
        step's new blocks of every request in one ``acquire_many``, one
        ``collect_releasable`` at the end. ``batches``: the prompts' evidence (their loads
        landed in one step) in one ``apply_many`` and the ends in one ``finish_many``."""
        pool, n = self.pool(), self.requests
        ledger, _ = _ledger(self.num_blocks)
        t0 = time.perf_counter_ns()
        held = []
        grants = []
        for r in range(n):
            blocks = pool.get_new_blocks(PROMPT)
            ids = np.fromiter([x.block_id for x in blocks], np.int64, PROMPT)
            g = ledger.acquire_and_grant(r, ids, PEER, Access.WRITE)
            if batches:
                grants.append(g)
            else:
                ledger.apply(TransferCompleted.of(g, 0))  # the prompt's KV has landed
            held.append(blocks)
        if batches and not ledger.apply_many([TransferCompleted.of(g, 0) for g in grants]).ok:
            raise SystemExit("apply_many refused evidence")
        for _ in range(self.blocks - PROMPT):
            step = {}
            for r in range(n):
                (block,) = pool.get_new_blocks(1)
                step[r] = [block.block_id]
                held[r].append(block)
            ledger.acquire_many(step)  # once per scheduler step
        if batches:
            if not ledger.finish_many(range(n)).ok:
                raise SystemExit("finish_many refused a request")
        else:
            for r in range(n):
                ledger.finish(r)
        for key in ledger.collect_releasable():
            pool.free_blocks(held[key])  # type: ignore[index]
        return self._done(pool, t0)

    def ledger_incremental_step_batches(self) -> float:
        return self.ledger_incremental_per_step(batches=True)


def breakdown(bench: Bench) -> dict[str, float]:
    """One more run of the whole shape (release per request) with every call timed on its
    own: us per request in each (the timer adds ~0.1 us per call)."""
    pool, n, b = bench.pool(), bench.requests, bench.blocks
    ledger, _ = _ledger(bench.num_blocks)
    spent = dict.fromkeys(
        (
            "vLLM get_new_blocks",
            "block ids off the KVCacheBlocks",
            "ledger.acquire",
            "ledger.grant (READ)",
            "ledger.finish",
            "TransferCompleted.of",
            "ledger.apply",
            "ledger.release",
            "vLLM free_blocks",
        ),
        0,
    )
    keys = list(spent)
    perf = time.perf_counter_ns

    def run() -> None:
        held, grants = [], []
        for r in range(n):
            t0 = perf()
            blocks = pool.get_new_blocks(b)
            t1 = perf()
            ids = np.fromiter([x.block_id for x in blocks], np.int64, b)
            t2 = perf()
            ledger.acquire(r, ids)
            t3 = perf()
            grants.append(ledger.grant(r, PEER, ids, Access.READ))
            t4 = perf()
            held.append(blocks)
            for k, dt in zip(keys[:4], (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                spent[k] += dt
        for r in range(n):
            t0 = perf()
            ledger.finish(r)
            t1 = perf()
            ev = TransferCompleted.of(grants[r], 0)
            t2 = perf()
            ledger.apply(ev)
            t3 = perf()
            ledger.release(r)
            t4 = perf()
            pool.free_blocks(held[r])
            t5 = perf()
            deltas = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
            for k, dt in zip(keys[4:], deltas, strict=True):
                spent[k] += dt

    common.quiet_run(run)
    return {k: v / n / 1e3 for k, v in spent.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_blockpool")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=64, help="blocks per request (> 48)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.blocks <= PROMPT:
        p.error(f"--blocks must be more than the {PROMPT} prompt blocks")
    bench = Bench(args.requests, args.blocks)
    info = common.machine()
    print(
        f"vLLM {info['vllm']} BlockPool (prefix caching on) + kvlifetime ledger: "
        f"{bench.mode}, fresh per run; {info['cores']} cores, Python {info['python']}, "
        f"the ledger {info['ledger_build']}, load average {info['loadavg'][0]}"
    )
    print(
        f"{args.requests} requests x {args.blocks} blocks; {args.rounds} interleaved rounds, "
        "ratio to the pool alone per round: median [range]"
    )
    shapes: dict[str, tuple[str, dict[str, Callable[[], float]]]] = {
        "whole": (
            f"get_new_blocks({args.blocks}) .. free_blocks",
            {
                "pool": bench.pool_whole,
                "ledger, release per request": bench.ledger_whole,
                "ledger, collect_releasable per step": bench.ledger_whole_collect,
                "ledger, acquire_and_grant + collect per step": bench.ledger_whole_few_calls,
                "ledger, + finish_many, apply_many per step": bench.ledger_whole_step_batches,
                "ledger, abort path: reject_many, apply_many": bench.ledger_whole_abort,
                "StepLedger, grant_many, end_many, prove": bench.step_ledger_whole,
                "StepLedger, abort path (rejected)": bench.step_ledger_abort,
            },
        ),
        "incremental": (
            f"{PROMPT} blocks, then {args.blocks - PROMPT} x get_new_blocks(1)",
            {
                "pool": bench.pool_incremental,
                "ledger, acquire per block": bench.ledger_incremental,
                "ledger, acquire_many per step": bench.ledger_incremental_per_step,
                "ledger, + apply_many, finish_many per step": (
                    bench.ledger_incremental_step_batches
                ),
            },
        ),
    }
    report: dict[str, Any] = {
        "bench": "vllm_blockpool",
        "machine": info,
        "ledger": bench.mode,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "unit": "ns per block",
        "shapes": {},
    }
    rows = [["shape / variant", "ns/block", "ratio", "range", "ledger ns/block"]]
    for shape, (label, variants) in shapes.items():
        for fn in variants.values():  # warm-up
            common.quiet_run(fn)
        res = common.interleaved(variants, args.rounds, "pool")
        report["shapes"][shape] = {"calls": label, "variants": res}
        rows.append([f"{shape}: {label}", "", "", "", ""])
        base = res["pool"]["median"]
        for name, r in res.items():
            added = "" if name == "pool" else f"{r['median'] - base:.1f}"
            rows.append(
                [
                    f"  {name}",
                    f"{r['median']:.1f}",
                    f"{r['ratio']:.2f}x",
                    f"[{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]",
                    added,
                ]
            )
    per_call = breakdown(bench)
    report["whole_breakdown_us_per_request"] = per_call
    print()
    print(common.table(rows))
    print(f"\nwhole shape, us per request in each call ({args.blocks} blocks; 1 run, timed apart):")
    for k, us in per_call.items():
        print(f"  {k:34s} {us:6.2f}")
    vllm_us = per_call["vLLM get_new_blocks"] + per_call["vLLM free_blocks"]
    rest = sum(per_call.values()) - vllm_us
    print(f"  vLLM's calls {vllm_us:.2f} us, everything else {rest:.2f} us")
    common.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
