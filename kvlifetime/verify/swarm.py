"""A swarm of diversified bitstate searches on SPIN, for shapes past exact search.

``run_swarm(config, policy, workdir)`` generates the Promela model (``verify.promela``), builds
one bitstate verifier (``-DBITSTATE -DT_RAND -DP_RAND``: each state is a few bits of a large
bit array, and the order in which transitions are tried is shuffled by a seed), and runs it
several times, one run after the other (the machine's other core is someone else's), each
run differently: its own random seed (``-RS``: the search order), its own hash seed (``-h``:
which states collide), every other run (the first included) in reverse transition order
(``-t_reverse``), its own number of bits per state (``-k``) and its own depth bound (``-m``).
Diversified runs reach different parts of a space none of them can store (Holzmann, Joshi,
Groce: "Swarm verification", ASE 2008); SPIN's own ``swarm`` script does the same and is not
in Debian's package.

A bitstate search **misses states**: a state whose bits are all already set is taken as
visited. So the result is never a pass. Each run reports SPIN's *hash factor* (bits in the
array / states stored; SPIN: best if > 100) and the estimate, at the run's end, of the chance
that a new state is wrongly taken as visited: ``(1 - exp(-k n / m)) ** k`` for ``n`` states,
``m`` bits and ``k`` bits per state (a Bloom filter's false-positive rate; earlier in the run
it was lower). A violation is real: SPIN's trail is replayed by ``spin -t``, and its length
(without the model's table step) is reported.
"""

from __future__ import annotations

import math
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from kvlifetime.verify.promela import generate
from kvlifetime.verify.state import Config, Policy

MODEL_NAME = "kvlifetime.pml"
TABLE_STEPS = 1  # the generated model's first step fills its tables: no event


class SwarmError(Exception):
    """The swarm could not run: SPIN or gcc is missing, or the model does not build (the
    caller's environment, or a bug of the generator). Nothing was searched."""


@attrs.frozen(slots=True)
class SwarmRun:
    """One bitstate run of the swarm, as ``pan`` reported it."""

    index: int
    options: tuple[str, ...]  # pan's arguments: what made this run different
    states: int  # states stored (each as k bits)
    transitions: int
    depth: int  # the deepest the search went
    seconds: float
    hash_factor: float | None  # bits / states stored; SPIN: best if > 100
    bits_per_state: int
    bits_log2: int
    errors: int
    assertion: str | None
    stopped: bool  # ended by its time bound, not by itself

    @property
    def omission_estimate(self) -> float:
        """At the run's end, the chance that a new state is wrongly taken as visited."""
        m = float(2**self.bits_log2)
        k = self.bits_per_state
        return (1.0 - math.exp(-k * self.states / m)) ** k


@attrs.frozen(slots=True)
class SwarmResult:
    config: Config
    policy: Policy
    runs: tuple[SwarmRun, ...]
    compile_seconds: float
    invariant: str | None  # the invariant a run broke, if one did
    trail_steps: int | None  # its counterexample's events (spin -t)

    @property
    def verdict(self) -> str:
        """``refuted``, or ``no violation found (approximate)``: never a pass."""
        return "refuted" if self.invariant is not None else "no violation found (approximate)"

    @property
    def max_states(self) -> int:
        return max((r.states for r in self.runs), default=0)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.runs)


_RE = {
    "vector": re.compile(r"State-vector \d+ byte, depth reached (\d+), errors: (\d+)"),
    "stored": re.compile(r"^\s*([0-9.e+]+) states, stored", re.M),
    "transitions": re.compile(r"^\s*([0-9.e+]+) transitions \(= stored\+matched\)", re.M),
    "elapsed": re.compile(r"pan: elapsed time ([0-9.e+-]+) seconds"),
    "assertion": re.compile(r"assertion violated (.*?) \(at depth \d+\)"),
    "hash_factor": re.compile(r"hash factor: ([0-9.e+]+)"),
    "trail": re.compile(r"trail ends after (\d+) steps"),
}


def parse_bitstate(
    text: str, index: int, options: tuple[str, ...], k: int, w: int, stopped: bool
) -> SwarmRun:
    """Parse what a bitstate ``pan`` printed. Raises ``SwarmError`` if it is no report."""
    vec, stored = _RE["vector"].search(text), _RE["stored"].search(text)
    trans = _RE["transitions"].search(text)
    if vec is None or stored is None or trans is None:
        raise SwarmError("not a report of SPIN's verifier:\n" + text[-2000:])
    hf = _RE["hash_factor"].search(text)
    el = _RE["elapsed"].search(text)
    a = _RE["assertion"].search(text)
    return SwarmRun(
        index,
        options,
        round(float(stored.group(1))),
        round(float(trans.group(1))),
        int(vec.group(1)),
        float(el.group(1)) if el else 0.0,
        float(hf.group(1)) if hf else None,
        k,
        w,
        int(vec.group(2)),
        a.group(1) if a else None,
        stopped,
    )


def invariant_of(assertion: str) -> str:
    """Which invariant of ``kvlifetime verify`` a failed assertion of the model states."""
    for needle, name in (
        ("ggen", "isolation"),
        ("blk[admitted]", "exclusivity"),
        ("rs[", "no_leak"),
        ("ledger_error", "ledger_error"),
    ):
        if needle in assertion:
            return name
    return f"model bound ({assertion})"  # a channel bound of the model: its own fault


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SwarmError(f"{name} is not installed (Debian: apt-get install {name})")
    return path


def build_pan(spin: str, gcc: str, cflags: list[str], workdir: Path, name: str) -> None:
    """SPIN's verifier for the model in ``workdir`` (``spin -a``, then ``gcc``), as ``name``.
    Raises ``SwarmError`` with SPIN's or gcc's own words."""
    gen = subprocess.run([spin, "-a", MODEL_NAME], cwd=workdir, capture_output=True, text=True)
    if gen.returncode != 0 or not (workdir / "pan.c").exists():
        raise SwarmError(f"spin -a failed:\n{gen.stdout}{gen.stderr}")
    cc = subprocess.run(
        [gcc, *cflags, "-w", "-o", name, "pan.c"], cwd=workdir, capture_output=True, text=True
    )
    if cc.returncode != 0:
        raise SwarmError(f"gcc failed on pan.c:\n{cc.stderr[-2000:]}")


def diversify(i: int, seed: int, bits_log2: int) -> tuple[list[str], int]:
    """Run ``i``'s pan arguments (and its bits per state): seeds, order, k, depth."""
    k = (3, 2, 4)[i % 3]
    depth = (100000, 400, 200, 1000)[i % 4]  # deep runs, and bounded ones that go wide
    opts = [f"-RS{seed + 7919 * i}", f"-h{(seed + i) % 500}", f"-k{k}", f"-m{depth}"]
    opts.append(f"-w{bits_log2}")
    if i % 2 == 0:
        opts.append("-t_reverse")
    return opts, k


def run_swarm(
    config: Config,
    policy: Policy,
    workdir: Path,
    *,
    runs: int = 8,
    seconds_per_run: float = 30.0,
    bits_log2: int = 30,
    memlim_mb: int = 1024,
    seed: int = 1,
    optimize: str = "-O2",
    progress: Callable[[SwarmRun], None] | None = None,
) -> SwarmResult:
    """Run the swarm: ``runs`` bitstate searches of ``config`` / ``policy``, one at a time,
    each stopped at ``seconds_per_run`` (SIGINT: pan reports what it covered); the first
    violation ends the swarm. ``bits_log2``: the bit array of one run is ``2**bits_log2``
    bits (30: 128 MB), under ``memlim_mb``. Raises ``SwarmError`` / ``PromelaError``."""
    spin, gcc = _tool("spin"), _tool("gcc")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MODEL_NAME).write_text(generate(config, policy))
    t0 = time.perf_counter()
    cflags = [optimize, "-DSAFETY", "-DBITSTATE", "-DT_RAND", "-DP_RAND", f"-DMEMLIM={memlim_mb}"]
    build_pan(spin, gcc, cflags, workdir, "pan_swarm")
    compile_s = time.perf_counter() - t0
    trail = workdir / f"{MODEL_NAME}.trail"
    done: list[SwarmRun] = []
    invariant = steps = None
    for i in range(runs):
        opts, k = diversify(i, seed, bits_log2)
        trail.unlink(missing_ok=True)
        proc = subprocess.Popen(
            ["./pan_swarm", *opts],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        stopped = False
        try:
            out, _ = proc.communicate(timeout=seconds_per_run)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)  # pan prints its statistics, then exits
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
        (workdir / f"run{i}.out").write_text(out)
        run = parse_bitstate(out, i, tuple(opts), k, bits_log2, stopped)
        done.append(run)
        if progress is not None:
            progress(run)
        if run.errors and run.assertion is not None:
            invariant = invariant_of(run.assertion)
            if trail.exists():
                rep = subprocess.run(
                    [spin, "-t", MODEL_NAME], cwd=workdir, capture_output=True, text=True
                )
                m = _RE["trail"].search(rep.stdout + rep.stderr)
                steps = int(m.group(1)) - TABLE_STEPS if m else None
            break
    return SwarmResult(config, policy, tuple(done), compile_s, invariant, steps)


def report(result: SwarmResult) -> str:
    """The swarm's result as text: one line per run, then the verdict (never a pass)."""
    c = result.config
    faults = "per-kind bounds" if c.max_faults is None else f"at most {c.max_faults} per run"
    lines = [
        f"swarm: {c.requests}x{c.peers}x{c.blocks}, policy {result.policy.value}, {faults}; "
        f"{len(result.runs)} bitstate run(s), compiled in {result.compile_seconds:.1f} s",
    ]
    for r in result.runs:
        hf = "-" if r.hash_factor is None else f"{r.hash_factor:,.0f}"
        lines.append(
            f"  run {r.index}: {r.states:,} states, depth {r.depth}, {r.seconds:.1f} s"
            f"{' (time bound)' if r.stopped else ''}, hash factor {hf}, "
            f"omission estimate {r.omission_estimate:.1e}  [{' '.join(r.options)}]"
        )
    if result.invariant is not None:
        steps = "?" if result.trail_steps is None else str(result.trail_steps)
        lines.append(
            f"REFUTED: {result.invariant} broken; the trail replays in {steps} events (spin -t)"
        )
    else:
        lines.append(
            f"NO VIOLATION FOUND (approximate, not a pass): at most {result.max_states:,} "
            "states stored by one run; bitstate search misses states (omission estimate above)"
        )
    return "\n".join(lines)
