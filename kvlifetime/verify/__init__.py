"""``kvlifetime verify``: a bounded, exhaustive interleaving explorer over the real ledger.

``explore(Config(...), Policy.PROOF)`` drives a real ``BlockLedger`` through every interleaving
of an environment of requests, peers and a faulty control channel (``model.py``), and checks
isolation, exclusivity, no leak and progress in every reachable state (``explore.py``);
``engine="packed"`` runs the same model over a packed ledger proven equal to the real one
(``packed.py``), ``processes=N`` on N worker processes (``parallel.py``).
``replay.py`` checks recorded event logs against the transition tables and evidence rules.
"""

from kvlifetime.verify.explore import Result, Step, canonical_key, explore, readable_steps
from kvlifetime.verify.model import (
    ALL_FAULTS,
    INVARIANTS,
    POLICY_RULES,
    Config,
    Event,
    Fault,
    Policy,
    Violation,
    parse_faults,
    run_events,
)

__all__ = [
    "ALL_FAULTS",
    "INVARIANTS",
    "POLICY_RULES",
    "Config",
    "Event",
    "Fault",
    "Policy",
    "Result",
    "Step",
    "Violation",
    "canonical_key",
    "explore",
    "parse_faults",
    "readable_steps",
    "run_events",
]
