"""The step-columnar rows (``StepRows``, issue 32) beside ``BlockLedger`` on the same steps: µs
per request of the ledger's work, the ratio per round.

``python -m bench.step_rows [--requests 1024 --per-step 16 --rounds 9 --out FILE]``

The prefill engine's shape, as the guard drives the ledger: each scheduler step, ``per-step``
requests end and expose their blocks to a remote reader (a READ grant each), finish, and their
transfers complete (one ``TransferCompleted`` each), then the released ones are collected. The
ledger side makes what its API makes (``acquire_and_grant_many``, ``finish_many``, the evidence
objects and ``apply_many``, ``collect_releasable``); the rows side takes the same requests as
keys and grants as handles (``acquire_and_grant_many``, ``end``, ``prove``, ``collect``), no
object per request (transitions as tuples of ints). Both keep the engine's per-block counts
(holders, open grants, generations) over 16 blocks a request. Interleaved rounds, alternating order,
collector off; the median per-round ratio with its range. A benchmark: it measures, it asserts
only that both released every request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np

from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger
from kvlifetime.ledger.block_rows import READ
from kvlifetime.ledger.step_rows import StepRows
from kvlifetime.spec.proof import COMPLETED

PEER = "decode-0"
BLOCKS = 16  # blocks per request


def run_ledger(n: int, per_step: int) -> float:
    led = BlockLedger(n * BLOCKS, counts="engine")
    released = 0
    t0 = time.perf_counter()
    for start in range(0, n, per_step):
        keys = [f"r{i}" for i in range(start, min(n, start + per_step))]
        items = [
            (k, np.arange(i * BLOCKS, (i + 1) * BLOCKS), PEER, Access.READ)
            for i, k in zip(range(start, start + len(keys)), keys, strict=True)
        ]
        grants = led.acquire_and_grant_many(items).grants
        led.finish_many(keys)
        led.apply_many([TransferCompleted.of(g, 0) for g in grants])
        released += len(led.collect_releasable())
    dt = time.perf_counter() - t0
    assert released == n
    return dt


def run_rows(n: int, per_step: int) -> float:
    rows_ = StepRows(n * BLOCKS)
    released = 0
    t0 = time.perf_counter()
    for start in range(0, n, per_step):
        keys = [f"r{i}" for i in range(start, min(n, start + per_step))]
        allids = np.arange(start * BLOCKS, (start + len(keys)) * BLOCKS, dtype=np.int64)
        rows = rows_.acquire_and_grant_many(keys, allids, [BLOCKS] * len(keys), READ)
        moves: list[tuple[int, int, int]] = []
        rows_.end(keys, "finished", moves)
        rows_.prove([r for r in rows if isinstance(r, int)], COMPLETED, [0] * len(rows), moves)
        released += len(rows_.collect(moves))
    dt = time.perf_counter() - t0
    assert released == n
    return dt


def memory(live: int) -> dict[str, float]:
    """Bytes held with ``live`` requests each holding 16 blocks under one open READ grant (the
    grants ended, unproven: what a guard holds for a slow reader), per open grant and per block:
    ``tracemalloc``'s count of what building them allocated and kept, the per-block arrays
    apart (their size over the number of blocks)."""
    import tracemalloc

    n = live * BLOCKS
    out: dict[str, float] = {}
    for name in ("ledger", "rows"):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        keys = [f"r{i}" for i in range(live)]
        allids = np.arange(n, dtype=np.int64)
        if name == "ledger":
            led = BlockLedger(n, counts="engine")
            blocks = led._blocks
            per_block = sum(
                getattr(blocks, a).nbytes for a in ("sharers", "unsettled", "readers", "generation")
            )
            items = [
                (k, allids[i * BLOCKS : (i + 1) * BLOCKS], PEER, Access.READ)
                for i, k in enumerate(keys)
            ]
            led.acquire_and_grant_many(items)
            led.finish_many(keys)
            held: object = (led, items)
        else:
            rows = StepRows(n)
            b = rows.blocks
            per_block = sum(
                getattr(b, a).nbytes
                for a in ("sharers", "unsettled", "readers", "generation", "scratch")
            )
            rows.acquire_and_grant_many(keys, allids, [BLOCKS] * live, READ, PEER)
            rows.end(keys, "finished", [])
            held = rows
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        out[f"{name}_bytes_per_block"] = per_block / n
        out[f"{name}_bytes_per_open_grant"] = (used - per_block - allids.nbytes) / live
        del held
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--per-step", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--live", type=int, default=10_000, help="live requests for the memory figure")
    args = ap.parse_args()
    n, k = args.requests, args.per_step
    run_ledger(n, k), run_rows(n, k)  # warm up
    led_t: list[float] = []
    row_t: list[float] = []
    gc.disable()
    try:
        for r in range(args.rounds):
            pair = (run_ledger, run_rows) if r % 2 == 0 else (run_rows, run_ledger)
            times = {f.__name__: f(n, k) for f in pair}
            led_t.append(times["run_ledger"])
            row_t.append(times["run_rows"])
    finally:
        gc.enable()
    ratios = [a / b for a, b in zip(led_t, row_t, strict=True)]
    led_us = float(np.median(led_t)) / n * 1e6
    row_us = float(np.median(row_t)) / n * 1e6
    print(
        f"{n} requests, {k} a step, {BLOCKS} blocks each, {args.rounds} interleaved rounds; "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    print(f"  BlockLedger (objects per request)  {led_us:7.2f} us/request")
    print(f"  StepRows (columns, handles)        {row_us:7.2f} us/request")
    print(
        f"  ledger / rows: {float(np.median(ratios)):.2f}x "
        f"[{min(ratios):.2f}-{max(ratios):.2f}]  (the guard's whole target: <= 3 us/request)"
    )
    mem = memory(args.live)
    print(
        f"  memory, {args.live} live requests with an open grant over {BLOCKS} blocks each: "
        f"BlockLedger {mem['ledger_bytes_per_open_grant']:.0f} B per open grant (with its "
        f"request) and {mem['ledger_bytes_per_block']:.0f} B per block; StepRows "
        f"{mem['rows_bytes_per_open_grant']:.0f} B and {mem['rows_bytes_per_block']:.0f} B "
        "(targets: <= 64 B per open grant, <= 16 B per block)"
    )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "requests": n,
                    "per_step": k,
                    "ledger_us_per_request": led_us,
                    "rows_us_per_request": row_us,
                    "ratio": float(np.median(ratios)),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    **mem,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
