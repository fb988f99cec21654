"""The compiled checker beside SPIN on the same model (issue 34).

``python -m bench.compiled_spin [--out FILE] [--memory-mb 2048]``

SPIN's verifier built from the Promela model (``bench.spin_anchor.run_spin``, ``-O2``,
exhaustive) and the compiled checker (``kvlifetime.verify.cenv``, exact) search the model
generated from the specification, SPIN without reductions (it has no symmetry reduction for
this model), the compiled checker both without (the same search as SPIN's) and reduced (its
default: ``kvlifetime verify``'s canonical states and partial-order reduction).
``tests/test_cenv.py`` and ``tests/test_promela.py`` show all reach the Python model's states
(projected, or as canonical keys), so the unreduced counts differ only by what each keeps per
state (SPIN's vector also holds the scratch variables and the derived counters). Prints one
markdown table: states, seconds, states/s and memory for each. Compiling is not timed. A
benchmark: it measures, it asserts only that all give the same verdict.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import spin_anchor
from kvlifetime.verify import Config, Policy, cbuild, cenv, csearch, parse_faults
from kvlifetime.verify.csearch import Verdict

ALL = "reorder,duplicate,delay,loss,crash,fence,timeout,retry,fail,lie"
_ALL_ONE = Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1)
SHAPES: list[tuple[str, Config]] = [
    ("1 x 1 x 1, every fault kind, per-kind bounds", Config(1, 1, 1, faults=parse_faults(ALL))),
    ("1 x 2 x 1, every fault kind, 1 per run", _ALL_ONE),
    ("2 x 1 x 2, loss, crash, fence", Config(2, 1, 2, faults=parse_faults("loss,crash,fence"))),
    ("2 x 2 x 1, loss, crash", Config(2, 2, 1, faults=parse_faults("loss,crash"))),
]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compiled_spin")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--memory-mb", type=int, default=2048)
    args = p.parse_args()
    rows = []
    print("| shape | SPIN states | SPIN s | SPIN states/s | SPIN MB | compiled states | "
          "compiled s | compiled states/s | compiled MB | reduced states | reduced s | "
          "reduced states/s | reduced B a state |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")  # fmt: skip
    for name, config in SHAPES:
        with tempfile.TemporaryDirectory() as tmp:
            spin = spin_anchor.run_spin(
                config, Policy.PROOF, Path(tmp), memlim_mb=args.memory_mb, optimize="-O2"
            ).run
        ours, seconds = _compiled(config, args.memory_mb, reduce=False)
        canon, cseconds = _compiled(config, args.memory_mb, reduce=True)
        if spin.complete and ours.verdict is not Verdict.MEMORY:
            assert (spin.errors == 0) == (ours.verdict is Verdict.PASS), name
        if canon.verdict is not Verdict.MEMORY and ours.verdict is not Verdict.MEMORY:
            assert canon.verdict is ours.verdict, name
        row = {
            "shape": name,
            "spin": {"states": spin.states, "seconds": spin.seconds,
                     "memory_mb": spin.memory_mb, "complete": spin.complete},
            "compiled": {"states": ours.states, "seconds": seconds,
                         "memory_mb": ours.bytes / 2**20, "verdict": ours.verdict.name},
            "reduced": {"states": canon.states, "seconds": cseconds,
                          "bytes_per_state": canon.bytes / canon.states,
                          "verdict": canon.verdict.name},
        }  # fmt: skip
        rows.append(row)
        print(
            f"| {name} | {spin.states:,} | {spin.seconds:.2f} | "
            f"{spin.states / max(spin.seconds, 1e-3):,.0f} | {spin.memory_mb or 0:,.0f} | "
            f"{ours.states:,} | {seconds:.2f} | {ours.states / max(seconds, 1e-3):,.0f} | "
            f"{ours.bytes / 2**20:,.0f} | {canon.states:,} | {cseconds:.2f} | "
            f"{canon.states / max(cseconds, 1e-3):,.0f} | {canon.bytes / canon.states:.0f} |",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _compiled(config: Config, memory_mb: int, *, reduce: bool) -> tuple[Any, float]:
    checker = cenv.checker(config, Policy.PROOF, reduce=reduce, por=reduce)
    lib = cbuild.build(checker, name="cenv").library
    t0 = time.perf_counter()
    result = csearch.run(lib, memory_budget=memory_mb * 2**20)
    return result, time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
