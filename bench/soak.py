"""The long run of the proof policy with fences: does the pool ever run out?

``python -m bench.soak --backend inproc|mooncake|nixl --requests 50000 --crashes 4`` runs the
harness with prefill crashes and FAILED batches on, and prints whether the pool ran short
(admission stalls), how many blocks were quarantined at most, how many the fences reclaimed,
and the contamination count (must be 0). It writes the report as JSON to ``--out``.
Not a speed benchmark: its figures are counts, and they are the same for the same seed on the
in-process engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs

from kvlifetime.harness.faults import FaultConfig
from kvlifetime.harness.loop import run
from kvlifetime.harness.settings import PushSettings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak")
    p.add_argument("--backend", default="inproc", choices=("inproc", "mooncake", "nixl"))
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--crashes", type=int, default=4, help="prefill crashes during the run")
    p.add_argument("--no-fence", dest="fence", action="store_false")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    cfg = PushSettings(
        backend=args.backend,
        policy="proof",
        requests=args.requests,
        seed=args.seed,
        fence=args.fence,
        max_restarts=args.crashes + 1,
        faults=attrs.evolve(FaultConfig(), crashes=args.crashes),
    )
    r = run(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    sys.stdout.write(r.to_text())
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(r.to_json() + "\n", encoding="utf-8")
    ok = r.contaminated_blocks == 0 and r.leaked_blocks == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
