"""BlockLedger: the fast path a serving engine's allocator embeds.

The package's parts, each behind the one facade (``BlockLedger``, in ``facade``):

- ``values``: what the ledger hands back (``Transition``, ``BatchOutcome``, ``Refusal``,
  ``LedgerStats``, ``QuarantineInfo``);
- ``records``: the per-request and per-grant records;
- ``events``: the log events a call notes under the lock and emits after it;
- ``counters``: the per-block open-grant counters that widen instead of wrapping.

``from kvlifetime.ledger import BlockLedger`` (and every name below) is the public path.
"""

from kvlifetime.ledger.facade import COUNTS, FREE, ORPHANED, BlockLedger, Counts
from kvlifetime.ledger.values import (
    BatchOutcome,
    LedgerStats,
    QuarantineInfo,
    Refusal,
    Transition,
)

__all__ = [
    "COUNTS",
    "FREE",
    "ORPHANED",
    "BatchOutcome",
    "BlockLedger",
    "Counts",
    "LedgerStats",
    "QuarantineInfo",
    "Refusal",
    "Transition",
]
