"""Issue 32's compiled kernel, measured: the step path in C (``bench/step_kernel.pyx``, Cython)
beside ``StepRows`` (the rows, compiled by mypyc with ``make accel``) on the same steps.

``python -m bench.step_kernel [--requests 1024 --per-step 16 --rounds 9 --out FILE]``

The workload is ``bench.step_rows``' (the prefill engine's shape as the guard drives the
ledger: each step, ``per-step`` new requests hold 16 blocks with one READ grant each, finish,
their transfers complete, the released ones are collected). Both sides get the same checked
ids and the same keys; µs per request of the ledger's work, interleaved rounds, alternating
order, the collector off: the median per-round ratio with its range. A benchmark: it measures,
and asserts only that both released every request.

The kernel is built at first use into ``out/step-kernel/`` (Cython and the system's C
compiler: the ``dev`` extra); ``load()`` returns the module.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench import common
from kvlifetime.ledger.block_rows import READ
from kvlifetime.ledger.request_rows import CALLS, CHAIN, CODE, EVENT_CODE
from kvlifetime.ledger.requests import RECENTLY_RELEASED
from kvlifetime.ledger.step_rows import StepRows
from kvlifetime.spec.proof import COMPLETED

SOURCE = Path(__file__).with_name("step_kernel.pyx")
CACHE = Path(__file__).resolve().parent.parent / "out" / "step-kernel"
BLOCKS = 16


def load() -> ModuleType:
    """The kernel's extension module, built from ``step_kernel.pyx`` if its cache (keyed by
    the source's hash) has none."""
    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text).hexdigest()[:16]
    name = f"step_kernel_{tag}"
    so = CACHE / (name + str(sysconfig.get_config_var("EXT_SUFFIX")))
    if not so.exists():
        _build(name, text, so)
    spec = importlib.util.spec_from_file_location(name, so)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(name: str, text: bytes, so: Path) -> None:
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension  # type: ignore[import-untyped]

    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pyx = Path(tmp) / f"{name}.pyx"
        pyx.write_bytes(text)
        ext = Extension(name, [str(pyx)], extra_compile_args=["-O3"])
        (built,) = cythonize([ext], quiet=True, build_dir=tmp)  # type: ignore[no-untyped-call]
        dist = Distribution({"ext_modules": [built]})
        cmd = dist.get_command_obj("build_ext")
        cmd.build_lib = tmp
        cmd.build_temp = tmp
        cmd.ensure_finalized()
        cmd.run()
        out = Path(cmd.get_ext_fullpath(name))
        os.replace(out, so)


def new_kernel(mod: ModuleType, num_blocks: int) -> Any:
    """A kernel over fresh per-block arrays of ``num_blocks``, with the request table of
    ``ledger.request_rows`` (compiled from the specification)."""
    return mod.StepKernel(
        list(CHAIN),
        dict(CALLS),
        CODE["admitted"],
        CODE["transfer_quiesced"],
        CODE["quarantined"],
        EVENT_CODE["released"],
        np.zeros(num_blocks, dtype=np.uint16),
        np.zeros(num_blocks, dtype=np.uint8),
        np.zeros(num_blocks, dtype=np.uint8),
        np.zeros(num_blocks, dtype=np.uint32),
        RECENTLY_RELEASED,
    )


def _steps(n: int, per_step: int) -> list[tuple[list[str], Any]]:
    steps = []
    for start in range(0, n, per_step):
        keys = [f"r{i}" for i in range(start, min(n, start + per_step))]
        allids = np.arange(start * BLOCKS, (start + len(keys)) * BLOCKS, dtype=np.int64)
        allids.flags.writeable = False
        steps.append((keys, allids))
    return steps


def run_rows(n: int, per_step: int) -> float:
    rows_ = StepRows(n * BLOCKS)
    steps = _steps(n, per_step)
    released = 0
    t0 = time.perf_counter()
    for keys, allids in steps:
        rows = rows_.acquire_and_grant_many(keys, allids, [BLOCKS] * len(keys), READ, None, True)
        moves: list[tuple[int, int, int]] = []
        rows_.end(keys, "finished", moves)
        rows_.prove(rows, COMPLETED, [0] * len(rows), moves)  # type: ignore[arg-type]
        released += len(rows_.collect(moves))
    dt = time.perf_counter() - t0
    assert released == n
    return dt


def run_kernel(mod: ModuleType, n: int, per_step: int) -> float:
    k = new_kernel(mod, n * BLOCKS)
    finished = EVENT_CODE["finished"]
    steps = _steps(n, per_step)
    released = 0
    t0 = time.perf_counter()
    for keys, allids in steps:
        rows = k.grant_fresh(keys, allids, [BLOCKS] * len(keys), READ, None)
        moves: list[tuple[int, int, int]] = []
        k.end(keys, finished, moves)
        k.prove(rows, COMPLETED, [0] * len(rows), moves)
        released += len(k.collect(moves))
    dt = time.perf_counter() - t0
    assert released == n
    return dt


def memory(mod: ModuleType, live: int) -> dict[str, float]:
    """Bytes the ledger keeps for ``live`` requests each holding 16 blocks under one open READ
    grant (ended, unproven: what a guard holds for a slow reader), per open grant and per
    block, on both sides: ``tracemalloc``'s count of what granting and ending them allocated
    and kept (the kernel's C arrays are allocated where tracemalloc sees them), the keys and
    the block-id array (the engine's) made before it starts, the per-block arrays apart."""
    import tracemalloc

    n = live * BLOCKS
    keys = [f"r{i}" for i in range(live)]
    allids = np.arange(n, dtype=np.int64)
    allids.flags.writeable = False
    out: dict[str, float] = {}
    for name in ("rows", "kernel"):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        held: Any
        if name == "rows":
            held = StepRows(n)
            b = held.blocks
            arrays = [b.sharers, b.unsettled, b.readers, b.generation, b.scratch]
            held.acquire_and_grant_many(keys, allids, [BLOCKS] * live, READ, "peer", True)
            held.end(keys, "finished", [])
        else:
            held = new_kernel(mod, n)
            arrays = [held.sharers_arr, held.unsettled_arr, held.readers_arr, held.generation_arr]
            held.grant_fresh(keys, allids, [BLOCKS] * live, READ, "peer")
            held.end(keys, EVENT_CODE["finished"], [])
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        per_block = sum(a.nbytes for a in arrays)
        out[f"{name}_bytes_per_block"] = per_block / n
        out[f"{name}_bytes_per_open_grant"] = (used - per_block) / live
        del held
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_kernel")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--per-step", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--live", type=int, default=10_000, help="live requests for the memory figure")
    args = ap.parse_args(argv)
    mod = load()
    n, per = args.requests, args.per_step
    run_rows(n, per)  # warm-up
    run_kernel(mod, n, per)
    gc.disable()
    rows_us, kern_us, ratios = [], [], []
    try:
        for rnd in range(args.rounds):
            if rnd % 2:
                k = run_kernel(mod, n, per)
                r = run_rows(n, per)
            else:
                r = run_rows(n, per)
                k = run_kernel(mod, n, per)
            rows_us.append(r / n * 1e6)
            kern_us.append(k / n * 1e6)
            ratios.append(r / k)
    finally:
        gc.enable()
    mem = memory(mod, args.live)
    info = common.machine()
    report = {
        "memory_live_requests": args.live,
        **mem,
        "bench": "step_kernel",
        "machine": info,
        "config": {"requests": n, "per_step": per, "rounds": args.rounds, "blocks": BLOCKS},
        "rows_us_per_request": statistics.median(rows_us),
        "kernel_us_per_request": statistics.median(kern_us),
        "rows_over_kernel": statistics.median(ratios),
        "rows_over_kernel_range": [min(ratios), max(ratios)],
    }
    print(
        f"{n} requests, {per} a step, {BLOCKS} blocks each, {args.rounds} interleaved rounds; "
        f"{info['cores']} cores, load {info['loadavg'][0]}, the rows {info['ledger_build']}"
    )
    rows_label = f"StepRows (rows, {info['ledger_build']})"
    print(f"  {rows_label:30s} {report['rows_us_per_request']:6.2f} us/request")
    print(f"  {'StepKernel (C, Cython)':30s} {report['kernel_us_per_request']:6.2f} us/request")
    lo, hi = report["rows_over_kernel_range"]
    print(f"  rows / kernel: {report['rows_over_kernel']:.2f}x [{lo:.2f}-{hi:.2f}]")
    print(
        f"  memory, {args.live} live requests with an open grant over {BLOCKS} blocks each: "
        f"rows {mem['rows_bytes_per_open_grant']:.0f} B per open grant (with its request) and "
        f"{mem['rows_bytes_per_block']:.0f} B per block; kernel "
        f"{mem['kernel_bytes_per_open_grant']:.0f} B and {mem['kernel_bytes_per_block']:.0f} B "
        "(targets: <= 64 B per open grant, <= 16 B per block)"
    )
    common.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
