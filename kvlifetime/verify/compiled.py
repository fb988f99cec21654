"""``kvlifetime verify --engine compiled``: the compiled checker, or why it cannot answer.

``run`` builds the checker for the configuration and policy (``cenv.checker``, compiled once
into the cache by ``cbuild``), searches it (``csearch``) and returns the same ``Result`` the
Python engines return, with ``engine="compiled"``. A violation's counterexample is mapped back
onto the Python model's events and replayed on the real ``BlockLedger``
(``cenv.python_events``) before it is reported; the steps printed are that replay's.

What it is, and the result says so: ``kvlifetime verify``'s canonical states (the symmetry
reduction over requests, peers and blocks, as ``keys.canonical_key``: ``tests/test_cenv.py``
holds the two to the same set, state by state) with the partial-order reduction
(``por.stubborn``'s sets, in C: the same quiet states as without it, the same verdicts), over
the Promela model's reach (``cenv``); ``por=False``: every interleaving of the canonical
states; ``reduce=False``: every concrete state, every interleaving. Where it
cannot answer (no C compiler, or a shape or policy it does not model) ``unavailable`` says
why, and the command runs a Python engine instead and prints that reason with the result.
"""

from __future__ import annotations

import time

from kvlifetime.verify import cbuild, cenv, csearch
from kvlifetime.verify.csearch import Verdict
from kvlifetime.verify.memory import resident_bytes
from kvlifetime.verify.promela import PromelaError
from kvlifetime.verify.result import Result, Step
from kvlifetime.verify.search import readable_steps
from kvlifetime.verify.state import Config, Policy, Violation

NOTE = (
    "compiled C checker (kvlifetime.verify.cenv): kvlifetime verify's canonical states and "
    "partial-order reduction (its sets chosen on the canonical states, so the count differs "
    "from the Python engines')"
)
NOTE_UNREDUCED = (
    "compiled C checker (kvlifetime.verify.cenv), unreduced: every concrete state, every "
    "interleaving"
)
"""What the compiled engine's states are, printed with its result."""

CHECKS: tuple[str, ...] = ("isolation", "exclusivity", "no_leak", "ledger_error")
"""The invariants the compiled model checks (``cenv``'s violation codes): not ``progress``,
and not ``provenance`` (a lie under provenance is left out as refused, not sent to a ledger to
check that it is, as the Python engines do)."""


def unavailable(config: Config, policy: Policy) -> str | None:
    """Why the compiled checker cannot answer for this configuration and policy here (None:
    it can). Compiles it (into the cache) to find out whether the compiler works."""
    try:
        cenv.check_modelled(config, policy)
    except PromelaError as e:
        return f"the compiled checker does not model this: {e}"
    try:
        cbuild.build(cenv.checker(config, policy), name="cenv")
    except cbuild.CompilerUnavailable as e:
        return str(e).splitlines()[0]
    return None


def run(
    config: Config,
    policy: Policy,
    *,
    max_states: int | None = None,
    memory_budget: int | None = None,
    compact: bool = False,
    reduce: bool = True,
    por: bool = True,
) -> Result:
    """Search ``config`` under ``policy`` with the compiled checker. Raises ``PromelaError``
    for what it does not model and ``cbuild.CompilerUnavailable`` without a compiler (see
    ``unavailable``); ``SpecDisagreement`` when its counterexample does not replay on the real
    ledger. ``compact``: hash compaction (approximate: never a pass; the bound on the chance
    that a collision hid a state is ``Result.omission_bound``)."""
    cenv.check_modelled(config, policy)
    checker = cenv.checker(config, policy, reduce=reduce, por=por and reduce)
    lib = cbuild.build(checker, name="cenv").library
    # The budget is for the process: what it already holds is not the search's to spend.
    room = 0 if memory_budget is None else max(1, memory_budget - resident_bytes())
    t0 = time.perf_counter()
    res = csearch.run(lib, max_states=max_states or 0, memory_budget=room, compact=compact)
    seconds = time.perf_counter() - t0
    peak = resident_bytes()  # (the search's arena is still held)
    violation: Violation | None = None
    trace: tuple[Step, ...] = ()
    if res.verdict is Verdict.VIOLATION:
        events, violation = cenv.python_events(
            config, policy, lib, res, reduce=reduce, por=por and reduce
        )
        trace = readable_steps(config, policy, events)
    return Result(
        config=config,
        policy=policy,
        reduced=reduce,
        states=res.states,
        transitions=res.transitions,
        seconds=seconds,
        max_depth=res.depth,
        complete=res.verdict is Verdict.PASS and not compact,
        compact=compact,
        violation=violation,
        trace=trace,
        queue=0,
        memory_peak=peak,
        memory_budget=memory_budget,
        out_of_memory=res.verdict is Verdict.MEMORY,
        covered_depth=res.depth,
        engine="compiled",
        checks=CHECKS,
    )


__all__ = ["CHECKS", "NOTE", "NOTE_UNREDUCED", "run", "unavailable"]
