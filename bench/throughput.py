"""Throughput with realistic KV block sizes: proof vs naive in the same run.

``python -m bench.throughput --backend mooncake|nixl|inproc --block-kib 64 --requests 2000``
runs the harness (lock-step ticks, as everywhere in the harness: the seed decides every
landing) with blocks of ``--block-kib`` KiB, interleaving naive and proof runs ``--rounds``
times, and prints requests/s and GB/s of each and the ratio proof / naive per round. A
benchmark, never a test: it measures, it does not assert.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvlifetime.harness.decode import SimConfig, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.throughput")
    p.add_argument("--backend", default="mooncake", choices=("inproc", "mooncake", "nixl"))
    p.add_argument("--block-kib", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=2026)
    args = p.parse_args(argv)
    bb = args.block_kib * 1024
    ratios: list[float] = []
    for rnd in range(args.rounds):
        figures = {}
        for policy in ("naive", "proof"):
            cfg = SimConfig(
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


if __name__ == "__main__":
    sys.exit(main())
