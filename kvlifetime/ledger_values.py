"""Moved: ``kvlifetime.ledger`` (``kvlifetime/ledger/values.py``). Kept so that
``from kvlifetime.ledger_values import LedgerStats`` still works until its last importers (the
harness) import ``kvlifetime.ledger``."""

from kvlifetime.ledger.values import (
    BatchOutcome,
    LedgerStats,
    QuarantineInfo,
    Refusal,
    Transition,
)

__all__ = ["BatchOutcome", "LedgerStats", "QuarantineInfo", "Refusal", "Transition"]
