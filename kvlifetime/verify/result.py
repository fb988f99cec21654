"""A search's outcome: its verdict, figures and shortest counterexample, as text and JSON."""

from __future__ import annotations

from typing import Any

import attrs

from kvlifetime.grant import Access
from kvlifetime.verify.state import (
    INVARIANTS,
    POLICY_RULES,
    Config,
    Event,
    Fault,
    Policy,
    Violation,
)


@attrs.frozen(slots=True)
class Step:
    """One numbered step of a counterexample."""

    number: int
    event: Event
    label: str  # what happened, in a few words
    notes: tuple[str, ...]  # what it did, line by line


@attrs.frozen(slots=True)
class Result:
    config: Config
    policy: Policy
    reduced: bool
    states: int  # distinct states explored (after deduplication)
    transitions: int  # successor states computed
    seconds: float
    max_depth: int
    complete: bool  # every reachable state explored: False at a violation, at max_states,
    # at an interrupt, and always for a hash-compacted search (it may have merged two states)
    violation: Violation | None
    trace: tuple[Step, ...]
    interrupted: bool = False  # ended by Ctrl-C (KeyboardInterrupt): a partial result
    compact: bool = False  # hash compaction: 64-bit hashes of the keys were stored
    queue: int = 0  # states stored and not expanded when the search ended
    memory_peak: int = 0  # the most resident memory the process held during the search, bytes
    memory_budget: int | None = None  # the budget it ran under, bytes (None: no budget)
    out_of_memory: bool = False  # stopped at the memory budget: a partial result
    covered_depth: int = 0  # every state this many steps deep or less was expanded
    engine: str = "ledger"  # the ledger the model drove: "ledger" (real) or "packed"
    processes: int = 1  # processes that expanded the frontier
    # The invariants the engine checks (None: every one of INVARIANTS; the compiled engine
    # checks fewer, and a pass names only those).
    checks: tuple[str, ...] | None = None

    @property
    def verdict(self) -> str:
        """``violation``, ``pass``, ``interrupted`` or ``incomplete`` (a hash-compacted search
        that found nothing is incomplete: it may have missed states)."""
        if self.violation is not None:
            return "violation"
        if self.interrupted:
            return "interrupted"
        return "pass" if self.complete else "incomplete"

    @property
    def omission_bound(self) -> float:
        """For a hash-compacted search, a bound on the probability that a hash collision made
        it skip a state: ``n(n-1)/2`` pairs of stored states, each colliding with probability
        ``2**-64`` (if the hash were uniform; Python's tuple hash is not proven to be). 0 for an
        exact search."""
        n = self.states
        return n * (n - 1) / 2 / 2.0**64 if self.compact else 0.0

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float(self.states)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "policy": self.policy.value,
            "config": self.config.describe(),
            "reduction": self.reduced,
            "states": self.states,
            "transitions": self.transitions,
            "seconds": round(self.seconds, 3),
            "states_per_second": round(self.states_per_second, 1),
            "max_depth": self.max_depth,
            "complete": self.complete,
            "interrupted": self.interrupted,
            "queue": self.queue,
            "hash_compaction": self.compact,
            "omission_bound": self.omission_bound,
            "memory_peak_bytes": self.memory_peak,
            "memory_budget_bytes": self.memory_budget,
            "out_of_memory": self.out_of_memory,
            "covered_depth": self.covered_depth,
            "engine": self.engine,
            "checks": None if self.checks is None else list(self.checks),
            "processes": self.processes,
            "violation": None
            if self.violation is None
            else {
                "invariant": self.violation.invariant,
                "statement": INVARIANTS[self.violation.invariant],
                "message": self.violation.message,
            },
            "trace": [
                {
                    "step": s.number,
                    "event": s.event.to_list(),
                    "label": s.label,
                    "notes": list(s.notes),
                }
                for s in self.trace
            ],
        }

    def to_text(self) -> str:
        c = self.config
        lines = [
            f"kvlifetime verify: policy {self.policy.value}, {c.requests} requests x {c.peers} "
            f"peers x {c.blocks} blocks, faults: "
            + (",".join(sorted(f.value for f in c.faults)) or "none")
            + ("" if c.max_faults is None else f" (at most {c.max_faults} per run)")
            + (f", {c.access.value} grants" if c.access is not Access.WRITE else "")
            + (f", {c.ranks} ranks" if c.ranks > 1 else "")
            + (f", {c.restarts} restart" if c.restarts else "")
            + (", prefix sharing" if c.share else "")
            + (", reused request ids" if c.reuse_ids else ""),
            f"rule: {POLICY_RULES[self.policy]}",
            f"states explored: {self.states} ({self.transitions} transitions, depth "
            f"{self.max_depth}, reduction {'on' if self.reduced else 'off'})",
            f"time: {self.seconds:.2f} s, {self.states_per_second:,.0f} states/s (engine "
            f"{self.engine}, {self.processes} process{'es' if self.processes > 1 else ''})",
            f"memory: {_mb(self.memory_peak)} resident at most"
            + ("" if self.memory_budget is None else f", budget {_mb(self.memory_budget)}"),
        ]
        if self.violation is None:
            if self.complete:
                kept = [k for k in INVARIANTS if k != "ledger_error"]
                if Fault.LIE not in c.faults:
                    kept.remove("provenance")  # no lie was sent
                if self.checks is not None:
                    kept = [k for k in kept if k in self.checks]
                lines.append("verdict: PASS: every reachable state keeps " + ", ".join(kept))
            elif self.interrupted:
                lines.append(
                    f"verdict: INTERRUPTED: no violation among the {self.states} states stored "
                    f"({self.queue} of them not yet expanded); a partial result, not a pass"
                )
            elif self.out_of_memory:
                lines.append(
                    f"verdict: INCOMPLETE: stopped at the memory budget "
                    f"({_mb(self.memory_budget or 0)}) with no violation among the "
                    f"{self.states:,} states stored; every state up to {self.covered_depth} steps "
                    f"deep was expanded, {self.queue:,} not yet; not a pass "
                    "(raise --memory-budget, or bound the faults: --max-faults)"
                )
            elif self.compact:
                lines.append(
                    "verdict: INCOMPLETE (approximate): no violation in the states a "
                    "hash-compacted search reached; a collision may have hidden a state "
                    f"(probability at most {self.omission_bound:.1e} for a uniform 64-bit "
                    "hash)"
                    + (" and it stopped at --max-states" if self.queue else "")
                    + "; not a pass"
                )
            else:
                lines.append(
                    f"verdict: INCOMPLETE: stopped at --max-states before the end "
                    f"({self.queue} states not yet expanded); not a pass"
                )
            return "\n".join(lines) + "\n"
        v = self.violation
        lines.append(
            f"verdict: VIOLATION of {v.invariant} ({INVARIANTS[v.invariant]}): policy "
            f"{self.policy.value} is refuted in {len(self.trace)} steps"
        )
        lines.append(f"  {v.message}")
        lines.append(f"shortest counterexample ({len(self.trace)} steps):")
        for s in self.trace:
            lines.append(f"  {s.number:>2}. {s.label}")
            for n in s.notes:
                lines.append(f"        {n}")
        return "\n".join(lines) + "\n"


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"
