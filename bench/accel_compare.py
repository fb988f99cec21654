"""The ledger pure and compiled (the optional accelerator), side by side.

``python -m bench.accel_compare [--pairs 4] [--bench step,floor,prefill,decode,live,blockpool]
[--out FILE]`` (``make accel`` first; the vLLM benches need ``.venv-vllm``).

A module is pure or compiled for a whole process, so the two variants run in alternating
processes (pure first in even pairs, compiled first in odd ones), each process told which by
``KVLIFETIME_PURE`` and checked to be running that one (``kvlifetime.accel.variant``):

- **step**: the ledger alone, sans-IO, a prefill engine's step (16 requests of 8 blocks):
  ``acquire_and_grant_many`` (READ grants), ``finish_many``, two steps later ``apply_many`` of
  their ``TransferCompleted`` and ``collect_releasable``; us per request, median of the steps;
- **prefill**, **decode**, **live**: ``bench.vllm_scheduler`` (its guarded / unguarded ratio,
  and the guard's and the ledger's time per request as a share of vLLM's own, all from within
  one process); **live** is prefill with 10,000 requests held live;
- **blockpool**: ``bench.vllm_blockpool``, each variant's ratio to the pool alone;
- **floor**: what a guarded request costs at the least whatever the ledger's code: the values
  the contract hands out per request and the records and map entries a per-request ledger
  keeps, built with nothing checked (``floor_bench``).

Each figure is the median over the processes of a variant; ``compiled / pure`` is the median of
the per-pair quotients. A benchmark: it measures and prints, it asserts only that each process
ran the variant it was meant to.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
VARIANTS = ("pure", "compiled")
STEP_REQUESTS = 16
STEP_BLOCKS = 8
LAG = 2


def step_bench(steps: int) -> dict[str, Any]:
    """The ledger's work for a prefill engine's steps, in this process (whichever variant it
    imported): us per request in each call, median over the steps; and the same over the time
    of an interpreted reference in the same steps (``TransferCompleted.of`` of the step's
    grants, which no variant compiles), a figure the machine's load moves much less."""
    import gc

    from kvlifetime import accel
    from kvlifetime.evidence import TransferCompleted
    from kvlifetime.grant import Access
    from kvlifetime.ledger import BlockLedger

    per_step = STEP_REQUESTS * STEP_BLOCKS
    window = LAG + 1
    L = BlockLedger(per_step * (window + 1), counts="engine")
    pending: list[Any] = []
    parts: dict[str, list[float]] = {
        k: [] for k in ("acquire_and_grant_many", "finish_many", "apply_many", "collect", "of")
    }
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for s in range(steps + 20):
            base = (s % (window + 1)) * per_step
            items = [
                (
                    f"r{s}-{i}",
                    list(range(base + i * STEP_BLOCKS, base + (i + 1) * STEP_BLOCKS)),
                    "decode-0",
                    Access.READ,
                )
                for i in range(STEP_REQUESTS)
            ]
            t0 = clock()
            out = L.acquire_and_grant_many(items)
            t1 = clock()
            L.finish_many([it[0] for it in items])
            t2 = clock()
            assert out.ok
            pending.append(out.grants)
            if len(pending) <= LAG:
                continue
            done = pending.pop(0)
            t3 = clock()
            evidence = [TransferCompleted.of(g, 1) for g in done]
            t4 = clock()
            L.apply_many(evidence)
            t5 = clock()
            freed = L.collect_releasable()
            t6 = clock()
            assert len(freed) == STEP_REQUESTS
            if s >= 20:  # warm-up
                for k, dt in zip(parts, (t1 - t0, t2 - t1, t5 - t4, t6 - t5, t4 - t3), strict=True):
                    parts[k].append(dt / STEP_REQUESTS / 1e3)
    finally:
        gc.enable()
    med = {k: statistics.median(v) for k, v in parts.items()}
    ledger = sum(v for k, v in med.items() if k != "of")
    return {
        "variant": accel.variant(),
        "loadavg": os.getloadavg()[0],
        "ledger_us_per_request": ledger,
        "ledger_per_reference": ledger / med["of"],
        **{f"{k}_us": v for k, v in med.items()},
    }


def floor_bench(reps: int) -> dict[str, Any]:
    """What a guarded request costs at the least, whatever the ledger's code: the values the
    contract hands out per request and the records a per-request ledger keeps, built with
    nothing checked (the ledger's own fast constructors), us per request, median of ``reps``
    batches of a step's requests. In this process's variant (the records compile; the values,
    attrs classes and NamedTuples, never do)."""
    import gc

    import numpy as np

    from kvlifetime import accel
    from kvlifetime.evidence import TransferCompleted
    from kvlifetime.grant import Access, make_grant, make_grant_id
    from kvlifetime.ledger.records import GrantRecord, RequestRecord
    from kvlifetime.ledger.values import Transition

    new_tuple = tuple.__new__
    ids = np.arange(STEP_BLOCKS, dtype=np.int64)
    ids.flags.writeable = False
    gens = np.zeros(STEP_BLOCKS, dtype=np.uint32)
    gens.flags.writeable = False
    clock = time.perf_counter_ns
    values: list[float] = []
    records: list[float] = []
    tables: list[float] = []
    gc.disable()
    try:
        for r in range(reps + 20):
            keys = [f"r{r}-{i}" for i in range(STEP_REQUESTS)]
            t0 = clock()
            # The values: a Grant (and its id) per request, its evidence, three transitions.
            grants = []
            for n, key in enumerate(keys):
                g = make_grant(make_grant_id("inc", n + 1), key, "decode-0", ids, gens, Access.READ)
                grants.append(g)
                TransferCompleted.of(g, 1)
                for event in ("finished", "transfer_quiesced", "released"):
                    new_tuple(Transition, (key, event, "a", "b", "c", None, None, False))
            t1 = clock()
            # The records: a request's and a grant's.
            recs = []
            for n, key in enumerate(keys):
                req = RequestRecord(key, n, None)
                recs.append(GrantRecord(grants[n], req, None))
            t2 = clock()
            # The table's maps: the entries a request and its grant make and unmake.
            requests: dict[Any, Any] = {}
            by_slot: dict[int, Any] = {}
            grants_by_serial: dict[int, Any] = {}
            by_peer: dict[Any, Any] = {"decode-0": {}}
            releasable: dict[Any, None] = {}
            for n, rec in enumerate(recs):
                key, req = keys[n], rec.req
                requests[key] = req
                by_slot[n] = req
                req.grants[n] = rec
                req.open[n] = rec
                grants_by_serial[n] = rec
                by_peer["decode-0"][n] = rec
            for n, rec in enumerate(recs):
                key, req = keys[n], rec.req
                del req.open[n]
                del by_peer["decode-0"][n]
                releasable[key] = None
            for n in range(len(recs)):
                key = keys[n]
                del requests[key], by_slot[n], grants_by_serial[n], releasable[key]
            t3 = clock()
            if r >= 20:
                values.append((t1 - t0) / STEP_REQUESTS / 1e3)
                records.append((t2 - t1) / STEP_REQUESTS / 1e3)
                tables.append((t3 - t2) / STEP_REQUESTS / 1e3)
    finally:
        gc.enable()
    v, rc, tb = (statistics.median(x) for x in (values, records, tables))
    return {
        "variant": accel.variant(),
        "loadavg": os.getloadavg()[0],
        "values_us": v,
        "records_us": rc,
        "maps_us": tb,
        "floor_us_per_request": v + rc + tb,
    }


def _run(cmd: list[str], variant: str) -> None:
    env = dict(os.environ, KVLIFETIME_PURE="1" if variant == "pure" else "0")
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def _child_step(variant: str, out: Path, steps: int, kind: str = "step") -> dict[str, Any]:
    _run(
        [
            sys.executable,
            "-m",
            "bench.accel_compare",
            f"--child-{kind}",
            str(steps),
            "--out",
            str(out),
        ],
        variant,
    )
    res: dict[str, Any] = json.loads(out.read_text())
    return res


def _child_scheduler(variant: str, out: Path, side: str, live: int, rounds: int) -> dict[str, Any]:
    cmd = [
        str(VLLM_PY),
        "-m",
        "bench.vllm_scheduler",
        "--side",
        side,
        "--rounds",
        str(rounds),
        "--profile-top",
        "0",
        "--out",
        str(out),
    ]
    if live:
        cmd += ["--live", str(live), "--requests", "300"]
    _run(cmd, variant)
    rep = json.loads(out.read_text())
    e = rep["sides"][side]
    vllm_us = e["unguarded_us_per_request"]
    gt = e["guard_time"]
    return {
        "variant": rep["machine"]["ledger_build"],
        "loadavg": rep["machine"]["loadavg"][0],
        "ratio": e["ratio"],
        "vllm_us_per_request": vllm_us,
        # the guard's and the ledger's time per request, as a share of vLLM's own in this process
        "guard_per_vllm": gt["guard_us_per_request"] / vllm_us,
        "ledger_per_vllm": gt["ledger_us_per_request"] / vllm_us,
    }


def _child_blockpool(variant: str, out: Path, rounds: int) -> dict[str, Any]:
    _run(
        [str(VLLM_PY), "-m", "bench.vllm_blockpool", "--rounds", str(rounds), "--out", str(out)],
        variant,
    )
    rep = json.loads(out.read_text())
    res: dict[str, Any] = {
        "variant": rep["machine"]["ledger_build"],
        "loadavg": rep["machine"]["loadavg"][0],
    }
    for shape, s in rep["shapes"].items():
        for name, r in s["variants"].items():
            if name != "pool":
                res[f"{shape}: {name}"] = r["ratio"]
    return res


def compare(pairs: int, child: Callable[[str, Path], dict[str, Any]]) -> dict[str, Any]:
    """``pairs`` alternating runs of each variant; per figure, each variant's median and the
    median of the per-pair quotients compiled / pure."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                res = child(variant, Path(tmp) / f"{variant}-{i}.json")
                if res["variant"] != variant:
                    raise SystemExit(f"a {variant} run imported the {res['variant']} ledger")
                runs[variant].append(res)
    keys = [k for k, v in runs["pure"][0].items() if isinstance(v, float) and k != "loadavg"]
    figures: dict[str, Any] = {}
    for k in keys:
        p = [r[k] for r in runs["pure"]]
        c = [r[k] for r in runs["compiled"]]
        figures[k] = {
            "pure": statistics.median(p),
            "compiled": statistics.median(c),
            "compiled_per_pure": statistics.median(b / a for a, b in zip(p, c, strict=True)),
            "pure_runs": p,
            "compiled_runs": c,
        }
    loads: list[float] = [r["loadavg"] for v in VARIANTS for r in runs[v] if "loadavg" in r]
    return {"figures": figures, "loadavg": [min(loads), max(loads)] if loads else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.accel_compare")
    p.add_argument("--pairs", type=int, default=4, help="processes of each variant")
    p.add_argument("--bench", default="step,floor,prefill,decode,live,blockpool")
    p.add_argument("--rounds", type=int, default=3, help="rounds within each vLLM process")
    p.add_argument("--steps", type=int, default=400, help="step: timed steps per process")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-floor", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_step is not None:
        common.write_json(args.out, step_bench(args.child_step))
        return 0
    if args.child_floor is not None:
        common.write_json(args.out, floor_bench(args.child_floor))
        return 0
    benches: dict[str, Callable[[str, Path], dict[str, Any]]] = {
        "step": lambda v, o: _child_step(v, o, args.steps),
        "floor": lambda v, o: _child_step(v, o, args.steps, "floor"),
        "prefill": lambda v, o: _child_scheduler(v, o, "prefill", 0, args.rounds),
        "decode": lambda v, o: _child_scheduler(v, o, "decode", 0, args.rounds),
        "live": lambda v, o: _child_scheduler(v, o, "prefill", 10_000, args.rounds),
        "blockpool": lambda v, o: _child_blockpool(v, o, args.rounds),
    }
    report: dict[str, Any] = {
        "bench": "accel_compare",
        "machine": common.machine(),
        "pairs": args.pairs,
        "results": {},
    }
    print(
        f"the ledger pure vs compiled, {args.pairs} processes of each, alternating; "
        f"{report['machine']['cores']} cores"
    )
    for name in args.bench.split(","):
        res = compare(args.pairs, benches[name])
        report["results"][name] = res
        print(f"\n{name} (load average {res['loadavg']}):")
        rows = [["figure", "pure", "compiled", "compiled / pure"]]
        for k, f in res["figures"].items():
            rows.append(
                [k, f"{f['pure']:.3f}", f"{f['compiled']:.3f}", f"{f['compiled_per_pure']:.3f}"]
            )
        print(common.table(rows))
        sys.stdout.flush()
    common.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
