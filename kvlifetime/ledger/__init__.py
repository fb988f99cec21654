"""BlockLedger: the fast path a serving engine's allocator embeds.

``BlockLedger`` is a thin facade: every public call validates its arguments there, once, takes
the one lock and delegates, with validated values, to the parts (lowest first; a part imports
only the ones above it in this list, and no two import each other):

- ``values``: what the ledger hands back (``Transition``, ``BatchOutcome``, ``Refusal``,
  ``LedgerStats``, ``QuarantineInfo``, ``LedgerInternals``);
- ``snapshot``: how each part copies itself, field by field (``BlockLedger.copy``);
- ``records``: the per-request and per-grant records;
- ``events``: the log events a call notes under the lock and emits after it;
- ``counters``: the per-block open-grant counters that widen instead of wrapping;
- ``batch``: the batch calls' helpers (a batch read once; a step's holds as one array);
- ``blocks``: the per-block state behind one interface (``BlockCounts``), with its two
  implementations: ``ledger_counts`` (the ledger's own counts) and ``engine_counts`` (the
  engine's, ``counts="engine"``);
- ``transitions``: the request tables compiled from the specification, stepped per record;
- ``requests``: the request table (live requests, grants, deadlines, release);
- ``proofs``: evidence applied to the table; ``restart``: a ledger started over an arena a
  previous incarnation may still reach;
- ``queries`` (the read side: queries, statistics, introspection, snapshots) and ``facade``
  (the calls that change the ledger): ``BlockLedger``;
- the step-columnar ledger (issue 32): ``request_rows``, ``grant_rows``, ``block_rows`` (the
  columns), ``exposure_rows`` and ``step_rows`` (the rules over them, a step's calls at a
  time), ``step_queries`` (the read side) and ``step_ledger`` (the step calls, and
  ``BlockLedger``'s single calls as batches of one): ``StepLedger``, what a guard steps once
  per scheduler step.

``from kvlifetime.ledger import BlockLedger`` (and every name below) is the public path.
"""

from kvlifetime.ledger.blocks import COUNTS, FREE, ORPHANED, Counts
from kvlifetime.ledger.facade import BlockLedger
from kvlifetime.ledger.step_ledger import StepLedger
from kvlifetime.ledger.values import (
    BatchOutcome,
    LedgerInternals,
    LedgerStats,
    QuarantineInfo,
    Refusal,
    RequestInternals,
    Transition,
)

__all__ = [
    "COUNTS",
    "FREE",
    "ORPHANED",
    "BatchOutcome",
    "BlockLedger",
    "Counts",
    "LedgerInternals",
    "LedgerStats",
    "QuarantineInfo",
    "Refusal",
    "RequestInternals",
    "StepLedger",
    "Transition",
]
