"""kvlifetime: explicit, evidence-guarded lifetimes for KV-cache blocks.

Rejection, cancel receipt, scheduling stop, transfer quiescence and release are separate
transitions, and each needs its own evidence. Start with ``BlockLedger``.
"""

from kvlifetime.errors import (
    ContradictoryEvidence,
    EvidenceError,
    IllegalTransition,
    InsufficientEvidence,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnauthorizedEvidence,
    UsageError,
)
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Claim,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.ledger import BlockLedger, LedgerStats, Transition
from kvlifetime.machines import BlockLifecycle, BlockState, RequestLifecycle, RequestState
from kvlifetime.source import LOCAL, Source, SourceKind

__version__ = "0.1.0"

__all__ = [
    "LOCAL",
    "Access",
    "AccessRevoked",
    "BlockLedger",
    "BlockLifecycle",
    "BlockState",
    "CancelReceived",
    "Claim",
    "ContradictoryEvidence",
    "Evidence",
    "EvidenceError",
    "Grant",
    "GrantId",
    "IllegalTransition",
    "InsufficientEvidence",
    "KVLifetimeError",
    "LeaseExpired",
    "LedgerStats",
    "MismatchedEvidence",
    "PeerLost",
    "RequestLifecycle",
    "RequestState",
    "SchedulingStopped",
    "Source",
    "SourceKind",
    "StaleEvidence",
    "TransferCompleted",
    "TransferQuiesced",
    "Transition",
    "UnauthorizedEvidence",
    "UsageError",
    "__version__",
]
