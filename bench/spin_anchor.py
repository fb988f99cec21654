"""The anchor: the same protocol checked by SPIN and by ``kvlifetime verify``, side by side.

    .venv/bin/python -m bench.spin_anchor [--configs 1x1x1,2x1x2,2x2x2,3x2x3/k1,3x2x3/k2]
        [--policies naive,timeout,proof,trusting] [--explorer-timeout S] [--out out]

For each configuration and policy it generates the Promela model from the specification
(``kvlifetime.verify.promela``, what ``kvlifetime promela`` writes), builds SPIN's verifier
from it (``spin -a``, then ``gcc -DSAFETY -DREACH``: safety properties only; no hash
compaction, no bitstate: SPIN's search is exhaustive; built at ``-O0`` first and again at
``-O2`` only if that one gives no verdict in 20 s), runs it depth first with ``-i`` (a
refutation ends at a shortest counterexample, as our breadth-first explorer's); and it runs
``kvlifetime verify --format json`` on the same configuration in a subprocess. It
prints one markdown table (configuration, faults, policy, checker, verdict, states, seconds,
states/s, counterexample steps), writes the rows as JSON to ``out/spin-anchor.json``, and checks
that both checkers give the same verdict on every row where both finished: exit status 1 if
they disagree, 0 otherwise (a row one of them did not finish is reported as unconfirmed).

The two state counts are not the same measure: SPIN stores every concrete state of the Promela
model (no symmetry, and its partial-order reduction has nothing to reduce in a one-process
model), our explorer stores canonical states up to renaming requests, blocks and peers, with
its own partial-order reduction. See ``docs/verification-anchor.md`` for what each model
leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlifetime.verify import Config, Policy, parse_faults
from kvlifetime.verify.promela import PromelaError, check_expressible, defines, generate
from kvlifetime.verify.swarm import SwarmError, build_pan

MODEL_NAME = "kvlifetime.pml"  # the generated model, written into each run's directory

# The fault kinds the Promela model has (every one of the explorer's, in these configurations).
ANCHOR_FAULTS = "reorder,duplicate,delay,loss,crash,fence,timeout,retry,fail,lie"
# What each policy must give (the explorer's own tests pin the same).
EXPECTED: dict[Policy, str] = {
    Policy.NAIVE: "refuted",
    Policy.TIMEOUT: "refuted",
    Policy.PROOF: "pass",
    Policy.TRUSTING: "refuted",
}


def _config(r: int, p: int, b: int, max_faults: int | None) -> Config:
    return Config(r, p, b, faults=parse_faults(ANCHOR_FAULTS), max_faults=max_faults)


# The configurations of the issue: 2x2x2 with the per-kind bounds only, 3x2x3 at one and at two
# faults per run. Smaller ones, where SPIN's exact search of every concrete state fits in a
# few GB: 1x1x1 (the test's), 2x1x2 and 1x2x1; and 2x2x2 at one and two faults per run.
CONFIGS: dict[str, Config] = {
    "1x1x1": _config(1, 1, 1, None),
    "2x1x2": _config(2, 1, 2, None),
    "1x2x1": _config(1, 2, 1, None),
    "2x2x2/k1": _config(2, 2, 2, 1),
    "2x2x2/k2": _config(2, 2, 2, 2),
    "2x2x2": _config(2, 2, 2, None),
    "3x2x3/k1": _config(3, 2, 3, 1),
    "3x2x3/k2": _config(3, 2, 3, 2),
}


class AnchorError(Exception):
    """The anchor could not run: a tool is missing, the model does not compile, or a
    configuration asks for what the Promela model does not have (the anchor's fault)."""


# ------------------------------------------------------------------ SPIN


def spin_defines(config: Config, policy: Policy) -> list[str]:
    """The configuration as the generated model's ``#define`` lines say it (for the record:
    the model is generated for the configuration, nothing is passed to ``spin -a``).

    Raises ``AnchorError`` for what the model cannot express (``PromelaError``).
    """
    try:
        check_expressible(config, policy)
    except PromelaError as e:
        raise AnchorError(str(e)) from e
    return [f"-D{k}={v}" for k, v in defines(config, policy).items()]


def model_text(config: Config, policy: Policy) -> str:
    """The Promela model of ``config`` / ``policy``, generated from the specification."""
    try:
        return generate(config, policy)
    except PromelaError as e:
        raise AnchorError(str(e)) from e


@attrs.frozen(slots=True)
class PanRun:
    """What one run of SPIN's verifier reported (parsed from its output)."""

    complete: bool  # the search ended by itself (no error, no memory bound)
    errors: int
    states: int  # states stored
    transitions: int
    seconds: float  # pan's own elapsed time (the search; compiling is not in it)
    vector_bytes: int
    assertion: str | None  # the text of the violated assertion, if any
    memory_mb: float | None
    # Hash compaction (-DHC4): a state is stored as a hash, so one whose hash matches a stored
    # state's is missed: "complete" then means only that the search ended, not exhaustive.
    approximate: bool = False
    exact_states: int | None = None  # where the exact search ran out of memory, if it did


_RE = {
    "vector": re.compile(r"State-vector (\d+) byte, depth reached (\d+), errors: (\d+)"),
    # pan prints large counts in e-notation ("2.3532038e+08 transitions").
    "stored": re.compile(r"^\s*([0-9.e+]+) states, stored", re.M),
    "transitions": re.compile(r"^\s*([0-9.e+]+) transitions \(= stored\+matched\)", re.M),
    "elapsed": re.compile(r"pan: elapsed time ([0-9.e+-]+) seconds"),
    "assertion": re.compile(r"assertion violated (.*?) \(at depth \d+\)"),
    "memory": re.compile(r"^\s*([0-9.]+)\s+total actual memory usage", re.M),
    "trail": re.compile(r"trail ends after (\d+) steps"),
}


def parse_pan(text: str) -> PanRun:
    """Parse the report ``pan`` prints. Raises ``AnchorError`` if it is not one."""
    vec = _RE["vector"].search(text)
    stored = _RE["stored"].search(text)
    trans = _RE["transitions"].search(text)
    if vec is None or stored is None or trans is None:
        raise AnchorError("not a report of SPIN's verifier:\n" + text[-2000:])
    elapsed = _RE["elapsed"].search(text)
    assertion = _RE["assertion"].search(text)
    memory = _RE["memory"].search(text)
    errors = int(vec.group(3))
    bounded = "-DMEMLIM bound" in text or "out of memory" in text
    return PanRun(
        complete=errors == 0 and not bounded and "Search not completed" not in text,
        errors=errors,
        states=round(float(stored.group(1))),
        transitions=round(float(trans.group(1))),
        seconds=float(elapsed.group(1)) if elapsed else 0.0,
        vector_bytes=int(vec.group(1)),
        assertion=assertion.group(1) if assertion else None,
        memory_mb=float(memory.group(1)) if memory else None,
        approximate="Hash-Compact" in text,
    )


def parse_trail_steps(text: str) -> int:
    """The length of the counterexample ``spin -t`` replayed."""
    m = _RE["trail"].search(text)
    if m is None:
        raise AnchorError("not a replay of a SPIN trail:\n" + text[-2000:])
    return int(m.group(1))


def invariant_of(assertion: str) -> str:
    """Which of the explorer's invariants a failed assertion of the Promela model states."""
    if "ggen" in assertion:
        return "isolation"
    if "blk[admitted]" in assertion:
        return "exclusivity"
    if "rs[" in assertion:
        return "no_leak"
    if "ledger_error" in assertion:
        return "ledger_error"
    if "lqn" in assertion or "cqn" in assertion:
        raise AnchorError(f"a channel bound of the Promela model is too small: {assertion}")
    raise AnchorError(f"unknown assertion of the Promela model: {assertion}")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AnchorError(f"{name} is not installed (Debian: apt-get install {name})")
    return path


@attrs.frozen(slots=True)
class PanBuild:
    """One build of SPIN's verifier: ``spin -a`` and ``gcc`` with these flags."""

    name: str  # the binary, in the run's directory
    cflags: tuple[str, ...]
    seconds: float  # spin -a and gcc, wall clock


@attrs.frozen(slots=True)
class SpinResult:
    run: PanRun  # the search that gave the verdict (or that stopped first)
    trail_steps: int | None  # a refutation's shortest counterexample
    compile_seconds: float  # every build of the row, together
    flags: tuple[str, ...]  # the model's defines, then the cflags of the search above
    builds: tuple[PanBuild, ...] = ()
    # The staged build: the quick search at -O0 that did not reach a verdict in its time
    # bound (None when it did, or when there was no staged build).
    quick_seconds: float | None = None


def _build(spin: str, gcc: str, cflags: list[str], workdir: Path, name: str) -> PanBuild:
    t0 = time.perf_counter()
    try:
        build_pan(spin, gcc, cflags, workdir, name)
    except SwarmError as e:
        raise AnchorError(str(e)) from e
    return PanBuild(name, tuple(cflags), time.perf_counter() - t0)


def _pan(workdir: Path, name: str, args: list[str], timeout_s: float) -> PanRun:
    out = subprocess.run(
        [f"./{name}", *args], cwd=workdir, capture_output=True, text=True, timeout=timeout_s
    )
    text = out.stdout + out.stderr
    (workdir / f"{name}.out").write_text(text)
    return parse_pan(text)


# The generated model's first step fills its constant tables (``hidden``): one step and one
# state more than the events of ``kvlifetime verify``; a trail's length is given without it.
TABLE_STEPS = 1

# gcc's optimisation for the verifier. The generated model is one process whose every event is
# a d_step with the ledger's code inlined (settle / advance after each message): pan.c puts
# every transition in one C function (2 MB at 2x2x2), and gcc -O2 spends minutes on it
# (measured, docs/verification-anchor.md). "staged": build at -O0 (seconds), run it for
# QUICK_S; if that gives no verdict, build at -O2 and run the search that counts. A refutation
# (a few hundred states) or a small pass never waits for -O2; a long search runs at -O2's speed.
OPTIMIZE = ("staged", "-O0", "-O1", "-O2")
QUICK_S = 20.0


def run_spin(
    config: Config,
    policy: Policy,
    workdir: Path,
    *,
    memlim_mb: int = 8192,
    hash_log2: int = 24,
    timeout_s: float = 3600.0,
    approximate: bool = False,
    optimize: str = "staged",
    quick_s: float = QUICK_S,
) -> SpinResult:
    """Generate the model of ``config`` / ``policy`` into ``workdir``, build SPIN's verifier
    and run it.

    Depth first with ``-DREACH -i``: an exhaustive search that, on a violation, goes on
    looking for a shorter one until it has the shortest (its length is compared with the
    explorer's breadth-first counterexample). Not breadth first: SPIN refuses ``-DBFS`` on a
    model with ``hidden`` variables (the generated model keeps the specification's tables
    there, outside the state vector). ``-DSAFETY`` (assertions and end states; no cycle
    checks: there are no liveness properties). With ``approximate``, a search that runs out of
    ``memlim_mb`` is redone with hash compaction (``-DHC4``), and its result is marked
    approximate (a pass is then "no violation found", never an exhaustive pass).

    ``optimize``: gcc's level (``OPTIMIZE``); it changes how fast the verifier runs and how
    long it takes to build, never what it checks. ``staged`` (the default) runs an ``-O0``
    build for ``quick_s`` seconds first and builds at ``-O2`` only if that gave no verdict.
    """
    if optimize not in OPTIMIZE:
        raise AnchorError(f"optimize: one of {', '.join(OPTIMIZE)}, not {optimize!r}")
    spin, gcc = _tool("spin"), _tool("gcc")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MODEL_NAME).write_text(model_text(config, policy))
    flags_d = spin_defines(config, policy)
    trail = workdir / f"{MODEL_NAME}.trail"
    search = [f"-w{hash_log2}", "-m100000", "-i"]  # -m: far above the model's longest run
    opt = "-O2" if optimize == "staged" else optimize
    builds: list[PanBuild] = []
    quick = None
    if optimize == "staged":
        builds.append(
            _build(
                spin,
                gcc,
                ["-O0", "-DSAFETY", "-DREACH", f"-DMEMLIM={memlim_mb}"],
                workdir,
                "pan_quick",
            )
        )
        trail.unlink(missing_ok=True)
        try:
            run = _pan(workdir, "pan_quick", search, quick_s)
        except subprocess.TimeoutExpired:
            quick = quick_s  # no verdict yet: the search that counts is built at -O2
        else:
            if run.errors or run.complete:
                return _result(spin, workdir, run, flags_d, builds, None)
    base = [opt, "-DSAFETY", "-DREACH"]
    builds.append(_build(spin, gcc, [*base, f"-DMEMLIM={memlim_mb}"], workdir, "pan_dfs"))
    trail.unlink(missing_ok=True)
    run = _pan(workdir, "pan_dfs", search, timeout_s)
    if not run.errors and not run.complete and approximate:
        # Out of memory: hash compaction, stated as approximate in every output.
        builds.append(
            _build(spin, gcc, [*base, "-DHC4", f"-DMEMLIM={memlim_mb}"], workdir, "pan_hc")
        )
        exact = run
        run = _pan(workdir, "pan_hc", [f"-w{hash_log2}", "-m100000"], timeout_s)
        run = attrs.evolve(run, approximate=True, exact_states=exact.states)
    return _result(spin, workdir, run, flags_d, builds, quick)


def _result(
    spin: str,
    workdir: Path,
    run: PanRun,
    flags_d: list[str],
    builds: list[PanBuild],
    quick: float | None,
) -> SpinResult:
    steps = None
    trail = workdir / f"{MODEL_NAME}.trail"
    if run.errors and trail.exists():
        replay = subprocess.run(
            [spin, "-t", MODEL_NAME], cwd=workdir, capture_output=True, text=True
        )
        steps = parse_trail_steps(replay.stdout + replay.stderr) - TABLE_STEPS
    return SpinResult(
        run,
        steps,
        sum(b.seconds for b in builds),
        (*flags_d, *builds[-1].cflags),
        tuple(builds),
        quick,
    )


# ------------------------------------------------------------------ kvlifetime verify


@attrs.frozen(slots=True)
class ExplorerRun:
    complete: bool
    violation: str | None  # the invariant broken, if any
    states: int | None  # None: it was stopped before it said
    transitions: int | None
    seconds: float
    trace_steps: int | None


def explorer_argv(config: Config, policy: Policy, memory_mb: int | None = None) -> list[str]:
    """``kvlifetime verify`` arguments for ``config`` / ``policy`` (JSON out); ``memory_mb``:
    its ``--memory-budget`` (None: the command's default)."""
    argv = [
        "verify",
        "--requests",
        str(config.requests),
        "--peers",
        str(config.peers),
        "--blocks",
        str(config.blocks),
        "--faults",
        ",".join(sorted(f.value for f in config.faults)),
        "--policy",
        policy.value,
        "--transfers",
        str(config.transfers_per_grant),
        "--format",
        "json",
    ]
    # The command's default is one fault per run: say "none" for the per-kind bounds only.
    argv += ["--max-faults", "none" if config.max_faults is None else str(config.max_faults)]
    if memory_mb is not None:
        argv += ["--memory-budget", str(memory_mb)]
    return argv


def parse_explorer(text: str) -> ExplorerRun:
    """Parse ``kvlifetime verify --format json``."""
    d = json.loads(text)
    v = d.get("violation")
    return ExplorerRun(
        complete=bool(d["complete"]),
        violation=None if v is None else str(v["invariant"]),
        states=int(d["states"]),
        transitions=int(d["transitions"]),
        seconds=float(d["seconds"]),
        trace_steps=len(d["trace"]) if v is not None else None,
    )


def run_explorer(
    config: Config, policy: Policy, *, timeout_s: float, memory_mb: int | None = None
) -> ExplorerRun:
    """Run ``kvlifetime verify`` in a subprocess; at ``timeout_s`` it is interrupted (SIGINT)
    and whatever partial result it prints is taken, else the row is marked unfinished."""
    code = "import sys; from kvlifetime.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, *explorer_argv(config, policy, memory_mb)]
    t0 = time.perf_counter()
    # SIGINT back to its default in the child: a runner started in the background by a shell
    # inherits SIGINT ignored, and the interrupt below would then never reach the explorer.
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        out, _err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            # Its partial result, after a large search on a loaded machine, takes a while.
            out, _err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _err = proc.communicate()
    wall = time.perf_counter() - t0
    try:
        return parse_explorer(out)
    except (ValueError, KeyError):
        return ExplorerRun(False, None, None, None, wall, None)


# ------------------------------------------------------------------ the table


@attrs.frozen(slots=True)
class Row:
    config: str
    faults: str  # "per-kind bounds" or "at most K per run"
    policy: str
    checker: str  # "kvlifetime verify", or "SPIN (DFS)" / "SPIN (DFS, hash compaction)"
    verdict: str  # pass / refuted / unfinished
    invariant: str | None
    states: int | None
    transitions: int | None
    seconds: float
    trace_steps: int | None

    @property
    def states_per_second(self) -> float | None:
        if self.states is None or self.seconds <= 0:
            return None
        return self.states / self.seconds


def _verdict(complete: bool, violation: str | None) -> str:
    if violation is not None:
        return "refuted"
    return "pass" if complete else "unfinished"


def spin_row(name: str, config: Config, policy: Policy, res: SpinResult) -> Row:
    r = res.run
    inv = invariant_of(r.assertion) if r.assertion is not None else None
    verdict = _verdict(r.complete, inv)
    if r.approximate and verdict == "pass":
        verdict = "no violation (approximate)"
    return Row(
        name,
        _faults_label(config),
        policy.value,
        _search(res.flags),
        verdict,
        inv,
        r.states,
        r.transitions,
        r.seconds,
        res.trail_steps,
    )


def _search(flags: Sequence[str]) -> str:
    if "-DHC4" in flags:
        return "SPIN (DFS, hash compaction)"
    return "SPIN (DFS)"


def explorer_row(name: str, config: Config, policy: Policy, res: ExplorerRun) -> Row:
    return Row(
        name,
        _faults_label(config),
        policy.value,
        "kvlifetime verify",
        _verdict(res.complete, res.violation),
        res.violation,
        res.states,
        res.transitions,
        res.seconds,
        res.trace_steps,
    )


def _faults_label(config: Config) -> str:
    if config.max_faults is None:
        return "per-kind bounds"
    return f"at most {config.max_faults} per run"


def agreement(ours: Row, theirs: Row) -> str:
    """``agree``, ``DISAGREE`` (both finished with different verdicts), ``unconfirmed``, or
    ``agree (approximately)`` (SPIN's hash-compacted search found no violation where ours
    passes)."""
    if "unfinished" in (ours.verdict, theirs.verdict):
        return "unconfirmed"
    if "approximate" in theirs.verdict:
        # An approximate search that finds no violation confirms a pass only approximately,
        # and contradicts a refutation only approximately too (it may have missed the path).
        return "agree (approximately)" if ours.verdict == "pass" else "unconfirmed"
    return "agree" if ours.verdict == theirs.verdict else "DISAGREE"


def _num(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def markdown(rows: Sequence[Row], checks: Sequence[str]) -> str:
    head = (
        "| config | faults | policy | checker | verdict | states | seconds | states/s "
        "| counterexample steps | same verdict |\n"
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |\n"
    )
    lines = []
    for i, row in enumerate(rows):
        sps = row.states_per_second
        verdict = row.verdict + (f" ({row.invariant})" if row.invariant else "")
        lines.append(
            f"| {row.config} | {row.faults} | {row.policy} | {row.checker} | {verdict} | "
            f"{_num(row.states)} | {row.seconds:.2f} | "
            f"{'-' if sps is None else f'{sps:,.0f}'} | {_num(row.trace_steps)} | "
            f"{checks[i // 2] if i % 2 else ''} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs", default="1x1x1,2x1x2,2x2x2,3x2x3/k1,3x2x3/k2", help=f"of {list(CONFIGS)}"
    )
    ap.add_argument("--policies", default="naive,timeout,proof,trusting")
    ap.add_argument(
        "--explorer-timeout",
        type=float,
        default=900.0,
        help="seconds before kvlifetime verify is interrupted (its row is then unfinished)",
    )
    ap.add_argument("--memlim-mb", type=int, default=8192, help="SPIN's memory bound (MB)")
    ap.add_argument(
        "--explorer-memory-mb",
        type=int,
        default=None,
        help="kvlifetime verify's --memory-budget (default: the command's own)",
    )
    ap.add_argument("--hash-log2", type=int, default=24, help="SPIN's hash table: 2^N slots")
    ap.add_argument(
        "--approximate",
        action="store_true",
        help="where SPIN's exact searches run out of memory, redo it with hash compaction "
        "(-DHC4; marked approximate)",
    )
    ap.add_argument(
        "--optimize",
        choices=OPTIMIZE,
        default="staged",
        help=f"gcc's level for pan; staged: an -O0 build runs for {QUICK_S:.0f} s, and -O2 "
        "is built only if that gave no verdict (default: %(default)s)",
    )
    ap.add_argument("--no-explorer", action="store_true", help="run SPIN only")
    ap.add_argument("--out", type=Path, default=Path("out"))
    args = ap.parse_args(argv)
    try:
        names = [c.strip() for c in args.configs.split(",") if c.strip()]
        policies = [Policy(p.strip()) for p in args.policies.split(",") if p.strip()]
        for n in names:
            if n not in CONFIGS:
                raise AnchorError(f"unknown configuration {n!r} (known: {', '.join(CONFIGS)})")
    except (ValueError, AnchorError) as e:
        print(f"spin_anchor: error: {e}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    checks: list[str] = []
    details: list[dict[str, Any]] = []
    build = args.out / "spin-anchor"
    print(f"cores: {os.cpu_count()}", file=sys.stderr)
    try:
        for name in names:
            config = CONFIGS[name]
            for policy in policies:
                workdir = build / f"{name.replace('/', '-')}-{policy.value}"
                print(f"{name} {policy.value}: SPIN ...", file=sys.stderr, flush=True)
                sres = run_spin(
                    config,
                    policy,
                    workdir,
                    memlim_mb=args.memlim_mb,
                    hash_log2=args.hash_log2,
                    approximate=args.approximate,
                    optimize=args.optimize,
                )
                srow = spin_row(name, config, policy, sres)
                if args.no_explorer:
                    erow = Row(name, srow.faults, policy.value, "kvlifetime verify",
                               "unfinished", None, None, None, 0.0, None)  # fmt: skip
                else:
                    print(f"{name} {policy.value}: kvlifetime verify ...", file=sys.stderr)
                    eres = run_explorer(
                        config,
                        policy,
                        timeout_s=args.explorer_timeout,
                        memory_mb=args.explorer_memory_mb,
                    )
                    erow = explorer_row(name, config, policy, eres)
                rows += [erow, srow]
                checks.append(agreement(erow, srow))
                details.append(
                    {
                        "config": name,
                        "policy": policy.value,
                        "explorer": attrs.asdict(erow),
                        "spin": attrs.asdict(srow)
                        | {
                            "flags": list(sres.flags),
                            "compile_seconds": round(sres.compile_seconds, 2),
                            "builds": [
                                {
                                    "name": b.name,
                                    "cflags": list(b.cflags),
                                    "seconds": round(b.seconds, 2),
                                }
                                for b in sres.builds
                            ],
                            "quick_search_without_verdict_s": sres.quick_seconds,
                            "vector_bytes": sres.run.vector_bytes,
                            "memory_mb": sres.run.memory_mb,
                            "approximate": sres.run.approximate,
                            "exact_states_at_memory_bound": sres.run.exact_states,
                        },
                        "expected": EXPECTED[policy],
                        # The machine may be shared: its load when the row was done.
                        "load_average": [round(x, 2) for x in os.getloadavg()],
                        "agreement": checks[-1],
                    }
                )
                builds = ", ".join(f"{b.cflags[0]} {b.seconds:.1f} s" for b in sres.builds)
                print(
                    f"  -> {erow.verdict} / {srow.verdict}: {checks[-1]} (pan built: {builds}; "
                    f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})",
                    file=sys.stderr,
                )
                # Each row as it comes, so that a run stopped early keeps what it did.
                build.mkdir(parents=True, exist_ok=True)
                (build / "rows.json").write_text(json.dumps(details, indent=2) + "\n")
    except AnchorError as e:
        print(f"spin_anchor: error: {e}", file=sys.stderr)
        return 2
    table = markdown(rows, checks)
    sys.stdout.write(table)
    bad = [c for c in checks if c == "DISAGREE"]
    agreed = sum(c == "agree" for c in checks)
    approx = sum(c == "agree (approximately)" for c in checks)
    fine = {"unfinished", "no violation (approximate)"}
    unexpected = [d for d in details if d["spin"]["verdict"] not in {d["expected"], *fine}]
    summary = (
        f"{agreed} of {len(checks)} rows: same verdict from both checkers; {approx} agree "
        f"approximately (SPIN's hash-compacted search); {checks.count('unconfirmed')} "
        f"unconfirmed (one did not finish); {len(bad)} disagree"
    )
    print(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spin-anchor.json").write_text(
        json.dumps(
            {"cores": os.cpu_count(), "rows": details, "summary": summary, "table": table},
            indent=2,
        )
        + "\n"
    )
    if unexpected:
        print(
            "unexpected SPIN verdicts: "
            + ", ".join(f"{d['config']} {d['policy']}" for d in unexpected),
            file=sys.stderr,
        )
    return 1 if bad or unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
