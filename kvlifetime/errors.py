"""The one exception hierarchy of kvlifetime (what bad input gets: docs/contract.md#bad-input).

Every error says whose fault it is, by the branch it sits under: the caller's (its code, its
configuration, its input), the evidence's (a peer, a transfer engine, the wire), the
environment's (a program, package or process kvlifetime needs), or kvlifetime's own. And it says
what state it leaves: none leaves a ledger other than it was before the call (a refused call
changes nothing and loses nothing).

Every class below is in this tree, including those defined beside the code that raises them
(listed under the tree: this module, the lowest layer, cannot import them). The drawing is
generated from the classes, with each one's first docstring line, by
``python -m kvlifetime.architecture``; a test fails when it differs from the code.

```
KVLifetimeError
├── UsageError                    The caller's fault: its code, its configuration or its input
│   ├── IllegalTransition         A named transition the tables do not allow from this state
│   ├── InsufficientEvidence      ``release`` asked for before every grant is closed
│   ├── RequestError              Base of errors about request keys
│   │   ├── UnknownRequest        A request key never admitted, or already released
│   │   ├── DuplicateRequest      A request key admitted again while it is still live
│   │   └── DoubleRelease         A request let go of a second time
│   ├── WrongCountsMode           ``allocate`` asked of a ledger that keeps the engine's counts
│   ├── UnknownGrant              A grant id this ledger never issued
│   ├── BlockError                Base of errors about block ids
│   │   ├── OutOfBlocks           Fewer free blocks than ``allocate`` asked for
│   │   ├── InvalidBlockIds       A batch of block ids that is not a 1-d batch of integers
│   │   ├── BlockOutOfRange       A block id outside ``[0, num_blocks)``
│   │   ├── DuplicateBlockIds     The same block id twice in one batch
│   │   ├── BlockUnavailable      A block whose state forbids the acquire or grant asked for
│   │   └── HolderLimit           One more holder or open grant than a block's counter can count
│   ├── FenceUnavailable          No fence exists on this engine: the blocks stay quarantined
│   ├── InvalidField              An argument or a value object's field of a wrong type or value
│   │   └── MalformedEngineValue  A value read from SGLang breaks SGLang's own contract
│   ├── UnsafeTransport           An engine set up so its statuses prove nothing (Mooncake TCP v1)
│   ├── UnsafeUcxTransport        UCX set to transports no target-side fence can stop (shm, CMA)
│   ├── MissingInput              An input file named on the command line is missing (or not a file)
│   ├── UnsupportedEngineVersion  The installed SGLang is not the version the hooks were built for
│   ├── UnsupportedEngineSetting  An SGLang setting the guard cannot work with
│   ├── GuardNotBound             The guard's ledger was used before its size was known
│   ├── AlreadyInstalled          ``install`` called while the hooks are installed
│   ├── UnsupportedEngineVersion  The installed vLLM is not one whose engine facts kvlifetime holds
│   ├── ProfileUnavailable        No evidence profile can be loaded for this engine
│   ├── ReportInputError          The harness results file is not one
│   ├── CompilerUnavailable       No C compiler here could build the generated checker
│   └── NothingToCheck            The log holds no kvlifetime event: there is nothing to replay
├── EvidenceError                 The evidence's fault: a peer, a transfer engine or the wire
│   ├── StaleEvidence             About a grant that is over and forgotten (an older generation)
│   ├── MismatchedEvidence        About another ledger, incarnation, request or peer
│   ├── ContradictoryEvidence     Disagrees with what was proven: two different ``last_seq``
│   ├── UnauthorizedEvidence      A claim from a source that may not make it
│   │   └── UnauthorizedMessage   A control message about a grant from a connection not its peer's
│   └── MalformedEvidence         Could not be built into evidence at all
│       └── MalformedMessage      A control frame that is not a message of this schema
├── EnvironmentFault              The environment's fault: a program, package or process failed
│   ├── DiagramError              A diagram could not be produced
│   │   ├── GraphvizNotFound      Graphviz's ``dot`` is not on ``PATH`` (SVG output needs it)
│   │   └── GraphvizFailed        ``dot`` ran but failed (a broken install, or a bug in the source)
│   ├── MissingExtra              An optional dependency is not installed
│   ├── PeerFailed                A peer process could not be started or answered nothing
│   │   └── ReaderFailed          The pull run's reader process failed to start or to answer
│   └── BrowserError              The page could not be checked in a browser
│       └── ChromiumNotFound      No Chromium on ``PATH`` (the page's browser check needs it)
└── SpecDisagreement              kvlifetime's own fault: its tables and specification disagree

Defined beside the code that raises them (kvlifetime.*, each imports this one):
  adapters.mooncake           UnsafeTransport
  adapters.nixl               UnsafeUcxTransport
  cli.output                  MissingInput
  diagrams                    DiagramError, GraphvizNotFound, GraphvizFailed
  extras                      MissingExtra
  harness.peer                PeerFailed
  harness.pull_initiator      ReaderFailed
  harness.wire                UnauthorizedMessage, MalformedMessage
  integrations.sglang.errors  MalformedEngineValue, UnsupportedEngineVersion,
                              UnsupportedEngineSetting, GuardNotBound, AlreadyInstalled
  integrations.vllm.errors    UnsupportedEngineVersion
  profiles                    ProfileUnavailable
  report                      ReportInputError
  report.browser              BrowserError, ChromiumNotFound
  verify.cbuild               CompilerUnavailable
  verify.replay               NothingToCheck
```
"""

from __future__ import annotations

# Annotations only: ``import typing`` would cost more than this whole module, and every module
# of kvlifetime imports this one (``from kvlifetime import KVLifetimeError`` stays cheap).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any


def show(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message or a log event: bounded and never raising.

    A refusal must still be the right refusal when the value it refuses is hostile: a
    ``__repr__`` that raises, a list nested 100,000 deep (the built-in ``repr`` recurses until
    ``RecursionError``), an int too long for ``repr`` (``ValueError`` past 4,300 digits), a
    string of a gigabyte. ``reprlib`` bounds depth and length; anything it still cannot format
    is named by its type. Never more than ``limit`` characters."""
    try:
        text: str = _bounded_repr().repr(value)
    except Exception:  # the message is about the value: it must not become the error
        text = _unprintable(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR: Any = None


def _bounded_repr() -> Any:
    global _REPR
    if _REPR is None:
        import reprlib  # only when an error is formatted: this module stays cheap to import

        r = reprlib.Repr()
        r.maxlevel = 3
        r.maxstring = r.maxother = r.maxlong = 120
        _REPR = r
    return _REPR


def _unprintable(value: object) -> str:
    t = type(value)
    try:
        if issubclass(t, int):
            return f"<{t.__name__} of {int.bit_length(value)} bits>"  # type: ignore[arg-type]
        return f"<unprintable {t.__name__}>"
    except Exception:
        return "<unprintable value>"


class KVLifetimeError(Exception):
    """Base of every error kvlifetime raises.

    ``kind`` is a stable snake_case name used in log events and in ``stats()`` counters.
    """

    kind = "error"


# --------------------------------------------------------------------------- the caller's fault


class UsageError(KVLifetimeError):
    """The caller's fault: its code, its configuration or its input.
    The caller asked for something the contract forbids. Nothing changed."""

    kind = "usage"


class IllegalTransition(UsageError):
    """A named transition the tables do not allow from this state.

    Whose fault: the caller (e.g. ``release`` of a request the owner never ended).
    State left: unchanged.
    """

    kind = "illegal_transition"

    def __init__(self, machine: str, subject: object, state: str, event: str) -> None:
        self.machine = machine
        self.subject = subject
        self.state = state
        self.event = event
        super().__init__(f"{machine} {show(subject)}: no transition {event!r} from state {state!r}")


class InsufficientEvidence(UsageError):
    """``release`` asked for before every grant is closed.

    ``unproven`` maps each open grant (as text) to the claims still missing for it, so the
    caller can see exactly which peer owes which acknowledgement.
    Whose fault: the caller (released too early). State left: unchanged.
    """

    kind = "insufficient_evidence"

    def __init__(self, request: object, unproven: Mapping[str, Sequence[str]]) -> None:
        self.request = request
        self.unproven = {k: tuple(v) for k, v in unproven.items()}
        detail = "; ".join(f"{g}: {', '.join(c)}" for g, c in self.unproven.items())
        super().__init__(f"request {show(request)} cannot be released; still unproven: {detail}")


class RequestError(UsageError):
    """Base of errors about request keys.
    State left: unchanged."""

    kind = "request"


class UnknownRequest(RequestError):
    """A request key never admitted, or already released.

    Whose fault: the caller. State left: unchanged.
    """

    kind = "unknown_request"

    def __init__(self, request: object) -> None:
        self.request = request
        super().__init__(f"unknown request {show(request)}")


class DuplicateRequest(RequestError):
    """A request key admitted again while it is still live.
    Keys are exact, never reused while live. Whose fault: the caller. State left: unchanged."""

    kind = "duplicate_request"

    def __init__(self, request: object) -> None:
        self.request = request
        super().__init__(f"request {show(request)} is already live")


class WrongCountsMode(UsageError):
    """``allocate`` asked of a ledger that keeps the engine's counts.
    With ``counts="engine"`` the engine's allocator hands out blocks and the ledger records
    them with ``acquire``; with the ledger's own counts it owns the free list. Asking the
    ledger for fresh blocks in engine mode is a mistake in the caller's set-up, not a block
    that happens to be busy. Whose fault: the caller. State left: unchanged."""

    kind = "wrong_counts_mode"


class UnknownGrant(UsageError):
    """A grant id this ledger never issued.

    Whose fault: the caller. State left: unchanged.
    """

    kind = "unknown_grant"


class BlockError(UsageError):
    """Base of errors about block ids.
    State left: unchanged."""

    kind = "block"


class OutOfBlocks(BlockError):
    """Fewer free blocks than ``allocate`` asked for.
    Whose fault: the caller (admission should have checked). State left: unchanged, nothing was
    taken."""

    kind = "out_of_blocks"

    def __init__(self, requested: int, free: int) -> None:
        self.requested = requested
        self.free = free
        super().__init__(f"asked for {requested} blocks, {free} free")


class InvalidBlockIds(BlockError):
    """A batch of block ids that is not a 1-d batch of integers.
    A float, bool, str, None, complex or object value (never coerced: ``[0.9]`` is not block 0,
    ``[True]`` not block 1), a 2-d array, a bare scalar. Accepted: a sequence of ``int`` (or numpy
    integer scalars) and a 1-d numpy integer array (``kvlifetime.inputs.block_ids``). Whose fault:
    the caller. State left: unchanged."""

    kind = "invalid_block_ids"


class BlockOutOfRange(BlockError):
    """A block id outside ``[0, num_blocks)``.
    Negative, too large, or beyond int64. Whose fault: the caller. State left: unchanged."""

    kind = "block_out_of_range"


class DuplicateBlockIds(BlockError):
    """The same block id twice in one batch.
    Whose fault: the caller. State left: unchanged."""

    kind = "duplicate_block_ids"


class BlockUnavailable(BlockError):
    """A block whose state forbids the acquire or grant asked for.
    The block exists but its state forbids the operation: acquiring a held, draining or
    quarantined block, sharing a block under an open write grant, a write grant on a shared
    block, or a grant over blocks the request does not hold.
    Whose fault: the caller. State left: unchanged."""

    kind = "block_unavailable"


class HolderLimit(BlockError):
    """One more holder or open grant than a block's counter can count.
    A block already has as many holders (or open grants) as its counter can count: one more
    shared acquire (or grant) is refused rather than wrapping the counter to zero, which would
    hand a still-shared block back to the pool. See ``BlockLedger.MAX_SHARERS``.
    Whose fault: the caller (or an unbounded prefix cache). State left: unchanged."""

    kind = "holder_limit"


class DoubleRelease(RequestError):
    """A request let go of a second time.
    ``release``, ``force_release``, ``reject`` or ``finish`` of a request already released (a
    query of it is an ``UnknownRequest``). About a request, not a block: not a ``BlockError``.
    Whose fault: the caller. State left: unchanged."""

    kind = "double_release"


class FenceUnavailable(UsageError):
    """No fence exists on this engine: the blocks stay quarantined.
    A fence was asked of a transfer engine that has none on this side (or none at all):
    what counts as a fence is established per engine, never assumed from an API name (see
    docs/fencing.md). Whose fault: the caller's choice of engine. State left: unchanged; the
    blocks stay quarantined."""

    kind = "fence_unavailable"


class InvalidField(UsageError, ValueError):
    """An argument or a value object's field of a wrong type or value.
    An argument of a public call, or a field of a value object (evidence, grant id): a negative
    sequence number, an empty id, a request key that is not a non-empty str or an int, a NaN or
    non-numeric deadline or clock, a non-``Grant`` passed to ``.of()``. Whose fault: the caller.
    Nothing was created or changed."""

    kind = "invalid_field"


# --------------------------------------------------------------------------- the evidence's fault


class EvidenceError(KVLifetimeError):
    """The evidence's fault: a peer, a transfer engine or the wire.
    The evidence itself is at fault. The ledger refused it, logged it, counted it under ``kind``,
    and changed nothing: the engine keeps running."""

    kind = "evidence"

    def __init__(self, message: str, *, evidence: Any = None) -> None:
        self.evidence = evidence
        super().__init__(message)


class StaleEvidence(EvidenceError):
    """About a grant that is over and forgotten (an older generation).
    A grant this ledger issued but has since forgotten (its request was released), i.e. about
    an older generation of the blocks. It must not act on the new owner."""

    kind = "stale_evidence"


class MismatchedEvidence(EvidenceError):
    """About another ledger, incarnation, request or peer.
    A grant of another ledger or incarnation, or naming another request or peer than the grant
    it cites (forged, misrouted, or a reused slot id)."""

    kind = "mismatched_evidence"


class ContradictoryEvidence(EvidenceError):
    """Disagrees with what was proven: two different ``last_seq``."""

    kind = "contradictory_evidence"


class UnauthorizedEvidence(EvidenceError):
    """A claim from a source that may not make it.
    The rules are ``kvlifetime.provenance.RULES``: a peer
    revoking its own access, reporting a lease or heartbeat, naming another peer, or speaking
    about another peer's grant. Whose fault: that peer (or a forger on its connection)."""

    kind = "unauthorized_evidence"


class MalformedEvidence(EvidenceError, ValueError):
    """Could not be built into evidence at all.
    A bad type, a missing field, an unknown schema version."""

    kind = "malformed_evidence"


# ------------------------------------------------------------------------- the environment's fault


class EnvironmentFault(KVLifetimeError):
    """The environment's fault: a program, package or process failed.
    Not the caller's code, not a peer's evidence: an optional dependency not installed, a tool
    not on ``PATH`` (Graphviz, Chromium), a process of the run that could not start or died.
    The message names what is missing. State left: nothing ran (or the run stopped with every
    process reaped); no ledger was changed."""

    kind = "environment"


# --------------------------------------------------------------------------- kvlifetime's fault


class SpecDisagreement(KVLifetimeError, AssertionError):
    """kvlifetime's own fault: its tables and specification disagree.
    The compiled tables and the python-statemachine specification disagreed
    (``BlockLedger(checked=True)``). This is a kvlifetime bug: please report it with the
    message. The ledger state is the table's result; the specification's is in the message."""

    kind = "spec_disagreement"
