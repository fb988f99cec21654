"""Refusals: what a guard answers an engine signal that proves nothing, as data.

A guard sits in an engine's loop, so it never raises at the engine for what the engine or a
peer reported (a duplicate id, a stale notice, a signal on the wrong channel, a grant the ledger
refused): each becomes a ``Refusal``, counted by kind, and logged once on the one path every
guard shares (``kvlifetime.guard``, event ``guard_refused``). Only a caller's misuse of the
guard's own API raises, and then only a typed kvlifetime error.

Each kind says whose fault it is (the engine's bookkeeping, a peer or transfer engine, or the
ledger's verdict on a block) and what the guard did instead: nothing reached the engine, and
nothing changed for any other request.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable, Mapping
from typing import TypeVar

import attrs
import structlog

from kvlifetime.errors import (
    BlockUnavailable,
    DoubleRelease,
    EvidenceError,
    IllegalTransition,
    InvalidField,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnauthorizedEvidence,
    UnknownRequest,
    UsageError,
)

_log = structlog.get_logger("kvlifetime.guard")

T = TypeVar("T")


class RefusalKind(enum.Enum):
    """Why a guard refused a signal or a step (the key of ``Refusals.counts``)."""

    # The engine's bookkeeping: an id it should not report now.
    DUPLICATE_ID = "duplicate_id"  # handed back already (or reported twice in one state)
    UNKNOWN_ID = "unknown_id"  # the guard never held it, and does not remember it
    NOT_FINISHED = "not_finished"  # the engine still runs it: it cannot be freed on an id
    WRONG_CHANNEL = "wrong_channel"  # a receive about reads, or a send about a load
    OUT_OF_ORDER = "out_of_order"  # the engine-side table has no row for it in this state
    # A report about an exposure in the very step that makes it: the ids have not left yet, so
    # the report is about an earlier request with the same id.
    BEFORE_EXPOSURE = "before_exposure"
    # An id given to the engine on one channel of an output, reported on the other too.
    BOTH_CHANNELS = "both_channels"
    # A report about an exposure nothing can prove over any more (a failed load, a reaped
    # lease): it stays withheld, quarantined, until a fence.
    UNPROVABLE = "unprovable"
    # The ledger's verdict on a block or a piece of evidence.
    EXPOSED_BLOCK_REUSED = "exposed_block_reused"  # a grant refused: the block may be touched
    EVIDENCE_REFUSED = "evidence_refused"  # the ledger refused the evidence a signal made
    FINISH_REFUSED = "finish_refused"  # the ledger refused the end of the request
    HANDED_OUT_REFUSED = "handed_out_refused"  # a block handed out could not be checked
    # A value the engine passed that is not one the guard can key or act on.
    MALFORMED_VALUE = "malformed_value"
    # A peer's report, judged by what it names (the guard's own records of what was sent).
    STALE = "stale"  # about an earlier use of the same id, room or generation
    MISMATCHED = "mismatched"  # names something it is not about (another room, rank, ...)
    UNAUTHORIZED = "unauthorized"  # sent in another's name (it does not carry what only that
    # sender was given)


@attrs.frozen(slots=True)
class Refusal:
    """One refused signal: what, about which request, in which engine-side state, and the typed
    error that says whose fault it was. Nothing changed for anyone because of it."""

    kind: RefusalKind
    request: str  # the request key as the guard holds it ("-" when the signal names none)
    error: KVLifetimeError
    state: str | None = None  # the engine-side state it was refused in (None: not held)
    event: str | None = None  # the engine-side event it would have fired


def error_for(
    kind: RefusalKind, request: str, state: str | None, event: str | None
) -> KVLifetimeError:
    """The typed error a refusal of ``kind`` carries (no traceback: it is data, not raised)."""
    if kind is RefusalKind.DUPLICATE_ID:
        return DoubleRelease(f"request {request!r} was already handed back to the engine")
    if kind is RefusalKind.UNKNOWN_ID:
        return UnknownRequest(request)
    if kind is RefusalKind.OUT_OF_ORDER and state is not None and event is not None:
        return IllegalTransition("engine", request, state, event)
    if kind is RefusalKind.BEFORE_EXPOSURE:
        return StaleEvidence(
            f"request {request!r}: a report of reads in the step that exposes its blocks (their "
            "ids have not left the process): about an earlier request with the same id"
        )
    why = {
        RefusalKind.NOT_FINISHED: "the engine still runs it; an id would free its blocks",
        RefusalKind.WRONG_CHANNEL: "the signal proves nothing about the exposure it holds",
        RefusalKind.UNPROVABLE: "its load failed or its lease was reaped: only a fence ends it",
        RefusalKind.BOTH_CHANNELS: "given to the engine on the other channel of this output",
    }.get(kind, kind.value)
    return UsageError(f"request {request!r} ({state or 'not held'}, {event or '-'}): {why}")


class Refusals:
    """Every refusal of one guard: counted by kind, logged on the one path. Not thread-safe by
    itself: a guard calls it under its own lock and logs after releasing it (``drain``)."""

    def __init__(self, engine: str, *, log: bool = True) -> None:
        self.engine = engine  # "vllm", "sglang-decode", ... : the log's ``engine`` field
        # False: counted only (a caller whose log holds one kind of line, e.g. the harness's
        # step log, and which reports its own refusals another way); nothing is kept to log.
        self.log = log
        self._counts: collections.Counter[str] = collections.Counter()
        self._pending: list[Refusal] = []  # to log, once the caller's lock is released

    def add(self, refusal: Refusal) -> Refusal:
        self._counts[refusal.kind.value] += 1
        if self.log:
            self._pending.append(refusal)
        return refusal

    def refuse(
        self,
        kind: RefusalKind,
        request: str,
        error: KVLifetimeError | None = None,
        *,
        state: str | None = None,
        event: str | None = None,
    ) -> Refusal:
        """Count and queue for the log one refusal (its error made from ``kind`` when the
        caller has none, e.g. the ledger's own typed error)."""
        err = error if error is not None else error_for(kind, request, state, event)
        return self.add(Refusal(kind, request, err, state, event))

    @property
    def counts(self) -> Mapping[str, int]:
        """Refusals by kind (``RefusalKind.value``) since the guard was made; only grow."""
        return dict(self._counts)

    def drain(self) -> list[Refusal]:
        """The refusals not logged yet, each logged now (``guard_refused``, warning). Call with
        no lock held: a log processor may call back into the guard."""
        out, self._pending = self._pending, []
        for r in out:
            log_refusal(self.engine, r)
        return out


def accepted(value: T | Refusal) -> T:
    """``value`` when the guard accepted the signal; the refusal's typed error raised when it
    refused it (counted and logged already): for a caller that treats a refusal as a failure
    (a test, a driver), never inside an engine's loop."""
    if isinstance(value, Refusal):
        raise value.error
    return value


def kind_of(error: KVLifetimeError) -> RefusalKind:
    """The refusal kind a typed error of a refused signal stands for (by whose fault and what
    it names; ``OUT_OF_ORDER`` for a signal the request's state does not allow)."""
    for cls, kind in _KIND_OF:
        if isinstance(error, cls):
            return kind
    return RefusalKind.OUT_OF_ORDER


_KIND_OF: tuple[tuple[type[KVLifetimeError], RefusalKind], ...] = (
    (StaleEvidence, RefusalKind.STALE),
    (MismatchedEvidence, RefusalKind.MISMATCHED),
    (UnauthorizedEvidence, RefusalKind.UNAUTHORIZED),
    (EvidenceError, RefusalKind.EVIDENCE_REFUSED),
    (InvalidField, RefusalKind.MALFORMED_VALUE),
    (BlockUnavailable, RefusalKind.EXPOSED_BLOCK_REUSED),
    (DoubleRelease, RefusalKind.DUPLICATE_ID),
    (UnknownRequest, RefusalKind.UNKNOWN_ID),
)


def log_refusal(engine: str, r: Refusal) -> None:
    """The one structured log event of a refused signal."""
    log_refused(engine, r.kind.value, r.request, r.error, state=r.state, signal=r.event)


def log_refused(
    engine: str, kind: str, request: str, error: BaseException, **context: object
) -> None:
    """``guard_refused`` (logger ``kvlifetime.guard``, warning): the one event every guard logs
    for what it refused, whatever the engine: ``engine``, ``kind``, ``request``, ``error`` (the
    message), ``error_type`` (the typed error's class), and the context the guard has."""
    _log.warning(
        "guard_refused",
        engine=engine,
        kind=kind,
        request=request,
        error=str(error),
        error_type=type(error).__name__,
        **context,
    )


def kinds(refusals: Iterable[Refusal]) -> list[str]:
    """The kinds of some refusals, in order (for tests and logs)."""
    return [r.kind.value for r in refusals]
