"""The SGLang guard's CPU per request, sans-IO: its calls made as the hooks make them on a
healthy run, beside the ledger's own calls alone (the floor the guard cannot go below).

- decode: ``published`` (32 pages, one prefill rank) for ``--inflight`` requests, then
  ``transferred`` for each (``KVPoll.Success``);
- prefill: ``sending`` (one chunk) for ``--inflight`` requests, then per request what
  ``release_kv_cache`` does: ``tracks`` + ``room_shared_with``, ``drained``, ``ended``, ``freed``;
- floor: the same ledger calls on a bare ``BlockLedger`` (``acquire_and_grant``; ``apply_many``
  of the prefill's ``TransferCompleted``, ``finish``, ``collect_releasable``).

CPU time of the calling thread (``thread_time_ns``) around each call. Each run is ``--batches``
x ``--inflight`` requests; every side runs once per run, in turn; the figure per call is the
minimum over ``--runs`` runs (another process's load only ever adds to it), with the median
beside it, and per run the guard's total over its floor's (median).

    python -m bench.sglang_guard_cpu [--runs 9] [--inflight 256] [--pages 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access, Grant
from kvlifetime.guard import accepted
from kvlifetime.integrations.sglang import SGLangGuard
from kvlifetime.ledger import BlockLedger
from kvlifetime.source import Source

Spent = collections.Counter[str]
ADDR = "127.0.0.1:8998"
_cpu = time.thread_time_ns


def _pages(i: int, n: int) -> npt.NDArray[np.int64]:
    return np.arange(i * n, (i + 1) * n, dtype=np.int64)


def decode(spent: Spent, inflight: int, batches: int, n: int) -> None:
    g = SGLangGuard(role="decode", ledger_blocks=inflight * n + 2)
    room = 0
    for _ in range(batches):
        keys = []
        for i in range(inflight):
            room += 1
            pages = _pages(i, n)
            t0 = _cpu()
            keys.append(accepted(g.published(room, pages, slot=i, ranks=[0], prefill=ADDR)))
            spent["published"] += _cpu() - t0
        for k in keys:
            t0 = _cpu()
            g.transferred(k)
            spent["transferred"] += _cpu() - t0
    st = g.stats()
    assert st.completed == inflight * batches and not st.live and not st.refused, st


def prefill(spent: Spent, inflight: int, batches: int, n: int) -> None:
    g = SGLangGuard(role="prefill", ledger_blocks=inflight * n + 2)
    room = 0
    for _ in range(batches):
        keys = []
        for i in range(inflight):
            room += 1
            pages = _pages(i, n)
            t0 = _cpu()
            keys.append(accepted(g.sending(None, room, pages)))
            spent["sending"] += _cpu() - t0
        for k in keys:
            t0 = _cpu()
            ok = g.tracks(k) and g.room_shared_with(k) is None
            t1 = _cpu()
            g.drained(k)
            t2 = _cpu()
            ended = g.ended(k, now=time.monotonic())
            t3 = _cpu()
            g.freed(k)
            t4 = _cpu()
            assert ok and ended is True  # (a Refusal is data, and truthy)
            spent["tracks+room_shared_with"] += t1 - t0
            spent["drained"] += t2 - t1
            spent["ended"] += t3 - t2
            spent["freed"] += t4 - t3
    st = g.stats()
    assert st.freed == inflight * batches and not st.live and not st.held and not st.refused, st


def _floor(prefill_side: bool) -> Callable[[Spent, int, int, int], None]:
    def run(spent: Spent, inflight: int, batches: int, n: int) -> None:
        led = BlockLedger(inflight * n + 2, counts="engine" if prefill_side else "ledger")
        peer = "sglang-local-transfer-engine" if prefill_side else f"sglang-prefill:{ADDR}:rank0"
        src = Source.peer(peer)
        access = Access.READ if prefill_side else Access.WRITE
        room = 0
        for _ in range(batches):
            grants: list[Grant] = []
            for i in range(inflight):
                room += 1
                pages = _pages(i, n)
                t0 = _cpu()
                grants.append(led.acquire_and_grant(f"sglang:{room}#{room}", pages, peer, access))
                spent["acquire_and_grant"] += _cpu() - t0
            for gr in grants:
                t0 = _cpu()
                if prefill_side:
                    ev = TransferCompleted.of(gr, 0)
                else:
                    ev = TransferCompleted(gr.id, gr.request, gr.peer, 0, source=src)
                led.apply_many([ev])
                t1 = _cpu()
                led.finish(gr.request)
                t2 = _cpu()
                led.collect_releasable()
                t3 = _cpu()
                spent["apply_many"] += t1 - t0
                spent["finish"] += t2 - t1
                spent["collect_releasable"] += t3 - t2

    return run


SIDES: dict[str, Callable[[Spent, int, int, int], None]] = {
    "decode": decode,
    "prefill": prefill,
    "ledger_only_decode": _floor(False),
    "ledger_only_prefill": _floor(True),
}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every side once per run, in turn (a busy spell slows the guard and its floor alike):
    per call the min and median over runs, and per run the guard's total over its floor's."""
    requests = args.inflight * args.batches
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for fn in SIDES.values():
        fn(Spent(), args.inflight, args.batches, args.pages)  # warm-up
    for _ in range(args.runs):
        for side, fn in SIDES.items():
            spent = Spent()
            gc.collect()
            fn(spent, args.inflight, args.batches, args.pages)
            per = {k: v / requests / 1e3 for k, v in spent.items()}
            per["total"] = sum(per.values())
            runs[side].append(per)
    out: dict[str, Any] = {
        side: {
            k: {"min_us": min(r[k] for r in rs), "median_us": statistics.median(r[k] for r in rs)}
            for k in rs[0]
        }
        for side, rs in runs.items()
    }
    for side in ("decode", "prefill"):
        pairs = list(zip(runs[side], runs[f"ledger_only_{side}"], strict=True))
        out[f"{side}_over_ledger_only"] = {
            "ratio_median": statistics.median(g["total"] / f["total"] for g, f in pairs),
            "extra_us_median": statistics.median(g["total"] - f["total"] for g, f in pairs),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sglang_guard_cpu")
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--inflight", type=int, default=256, help="requests published before Success")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--pages", type=int, default=32, help="pages per request")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "config": vars(args) | {"out": None},
        "loadavg": list(os.getloadavg()),
    }
    report["us_cpu_per_request"] = measure(args)
    print(
        f"{args.inflight * args.batches} requests x {args.pages} pages, {args.runs} runs; "
        f"us CPU per request: min [median]; load average {os.getloadavg()[0]:.2f}"
    )
    figures = report["us_cpu_per_request"]
    for side in SIDES:
        print(side)
        for k, v in figures[side].items():
            print(f"  {k:28s} {v['min_us']:8.1f}  [{v['median_us']:.1f}]")
    for side in ("decode", "prefill"):
        o = figures[f"{side}_over_ledger_only"]
        print(
            f"{side}: guard / its ledger calls alone, per run: {o['ratio_median']:.2f}x "
            f"(+{o['extra_us_median']:.1f} us per request, medians)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
