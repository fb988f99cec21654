"""kvlifetime: explicit, evidence-guarded lifetimes for KV-cache blocks.

Rejection, cancel receipt, scheduling stop, transfer quiescence and release are separate
transitions, and each needs its own evidence. Start with ``BlockLedger``.

Every name below is importable from ``kvlifetime`` itself, but loaded only when first used:
``import kvlifetime`` costs a millisecond and loads neither numpy, structlog nor
python-statemachine; ``kvlifetime.BlockLedger`` loads the ledger and what it needs, and
``kvlifetime.RequestLifecycle`` the specification. A program pays only for what it asks for.
"""

import sys as _sys

# Not ``typing.TYPE_CHECKING``, nor importlib or ``from __future__``: importing any of them
# costs more than the rest of this module (``import kvlifetime`` loads only kvlifetime).
TYPE_CHECKING = False

__version__ = "0.2.0"

# KVLIFETIME_PURE=1: the ledger's sources, even where its compiled modules are built beside them
# (the optional accelerator, kvlifetime/accel.py). Set before any of them can be imported.
# (``os`` is loaded at start-up unless Python runs with -S; then it is imported here.)
if __import__("os").environ.get("KVLIFETIME_PURE") == "1":
    from kvlifetime.accel import force_pure as _force_pure

    _force_pure()
    del _force_pure

# Each exported name -> the module that defines it. One table: ``__all__``, ``__getattr__``,
# ``__dir__`` and the type checker's imports below all follow it (a test checks they agree).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "BlockError",
            "BlockOutOfRange",
            "BlockUnavailable",
            "ContradictoryEvidence",
            "DoubleRelease",
            "DuplicateBlockIds",
            "DuplicateRequest",
            "EnvironmentFault",
            "EvidenceError",
            "FenceUnavailable",
            "HolderLimit",
            "IllegalTransition",
            "InsufficientEvidence",
            "InvalidBlockIds",
            "InvalidField",
            "KVLifetimeError",
            "MalformedEvidence",
            "MismatchedEvidence",
            "OutOfBlocks",
            "RequestError",
            "SpecDisagreement",
            "StaleEvidence",
            "UnauthorizedEvidence",
            "UnknownGrant",
            "UnknownRequest",
            "UsageError",
            "WrongCountsMode",
        ),
        "kvlifetime.errors",
    ),
    "MissingExtra": "kvlifetime.extras",
    **dict.fromkeys(
        (
            "AccessRevoked",
            "CancelReceived",
            "Claim",
            "Evidence",
            "LeaseExpired",
            "PeerLost",
            "SchedulingStopped",
            "TransferCompleted",
            "TransferQuiesced",
        ),
        "kvlifetime.evidence",
    ),
    **dict.fromkeys(("Access", "Grant", "GrantId"), "kvlifetime.grant"),
    **dict.fromkeys(
        (
            "BatchOutcome",
            "BlockLedger",
            "LedgerStats",
            "QuarantineInfo",
            "Refusal",
            "StepLedger",
            "Transition",
        ),
        "kvlifetime.ledger",
    ),
    **dict.fromkeys(("BlockLifecycle", "RequestLifecycle"), "kvlifetime.spec.lifecycles"),
    **dict.fromkeys(("BlockState", "RequestState"), "kvlifetime.spec.vocabulary"),
    **dict.fromkeys(("LOCAL", "Source", "SourceKind"), "kvlifetime.source"),
}

if TYPE_CHECKING:  # what the names are, for mypy and editors; at run time __getattr__ loads them
    from kvlifetime.errors import (
        BlockError,
        BlockOutOfRange,
        BlockUnavailable,
        ContradictoryEvidence,
        DoubleRelease,
        DuplicateBlockIds,
        DuplicateRequest,
        EnvironmentFault,
        EvidenceError,
        FenceUnavailable,
        HolderLimit,
        IllegalTransition,
        InsufficientEvidence,
        InvalidBlockIds,
        InvalidField,
        KVLifetimeError,
        MalformedEvidence,
        MismatchedEvidence,
        OutOfBlocks,
        RequestError,
        SpecDisagreement,
        StaleEvidence,
        UnauthorizedEvidence,
        UnknownGrant,
        UnknownRequest,
        UsageError,
        WrongCountsMode,
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
    from kvlifetime.extras import MissingExtra
    from kvlifetime.grant import Access, Grant, GrantId
    from kvlifetime.ledger import (
        BatchOutcome,
        BlockLedger,
        LedgerStats,
        QuarantineInfo,
        Refusal,
        StepLedger,
        Transition,
    )
    from kvlifetime.source import LOCAL, Source, SourceKind
    from kvlifetime.spec.lifecycles import BlockLifecycle, RequestLifecycle
    from kvlifetime.spec.vocabulary import BlockState, RequestState


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlifetime' has no attribute {name!r}")
    __import__(module)
    value = getattr(_sys.modules[module], name)
    globals()[name] = value  # the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    # What a user may use: the exports, the version and the module's own dunders; not this
    # module's helpers (``TYPE_CHECKING``, ``_sys``, ``_EXPORTS``).
    own = {n for n in globals() if n.startswith("__") and n.endswith("__")}
    return sorted({*own, *_EXPORTS})


__all__ = [
    "LOCAL",
    "Access",
    "AccessRevoked",
    "BatchOutcome",
    "BlockError",
    "BlockLedger",
    "BlockLifecycle",
    "BlockOutOfRange",
    "BlockState",
    "BlockUnavailable",
    "CancelReceived",
    "Claim",
    "ContradictoryEvidence",
    "DoubleRelease",
    "DuplicateBlockIds",
    "DuplicateRequest",
    "EnvironmentFault",
    "Evidence",
    "EvidenceError",
    "FenceUnavailable",
    "Grant",
    "GrantId",
    "HolderLimit",
    "IllegalTransition",
    "InsufficientEvidence",
    "InvalidBlockIds",
    "InvalidField",
    "KVLifetimeError",
    "LeaseExpired",
    "LedgerStats",
    "MalformedEvidence",
    "MismatchedEvidence",
    "MissingExtra",
    "OutOfBlocks",
    "PeerLost",
    "QuarantineInfo",
    "Refusal",
    "RequestError",
    "RequestLifecycle",
    "RequestState",
    "SchedulingStopped",
    "Source",
    "SourceKind",
    "SpecDisagreement",
    "StaleEvidence",
    "StepLedger",
    "TransferCompleted",
    "TransferQuiesced",
    "Transition",
    "UnauthorizedEvidence",
    "UnknownGrant",
    "UnknownRequest",
    "UsageError",
    "WrongCountsMode",
    "__version__",
]
