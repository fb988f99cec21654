"""The ledger's structured log events, noted while it holds its lock and emitted after.

A log processor is the application's code: it may call the ledger back (``stats()`` for a
gauge, from its own thread or another). Emitting under the ledger's lock would deadlock it, so
a ``BlockLedger`` call notes its events in a list while it holds the lock - only when structlog
is configured: otherwise nothing is built, and the hot path stays as it was - and emits them
once it has let go (the facade takes the list under the lock, then calls ``emit``).

An event is ``(level, name, fields)``: the fields are built when noted (they describe the state
at that point), the logger is called later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from kvlifetime.errors import show
from kvlifetime.evidence import Evidence, to_dict
from kvlifetime.grant import BlockIds
from kvlifetime.ledger.records import RequestRecord
from kvlifetime.ledger.values import Transition

Event = tuple[str, str, dict[str, Any]]
"""``(level, event name, fields)``: a log event noted, not yet emitted."""

log = structlog.get_logger("kvlifetime")


def enabled() -> bool:
    """Whether events are noted at all. A library never configures structlog; it stays silent
    (and cheap) until the application (or ``structlog.testing.capture_logs``) has."""
    return structlog.is_configured()


def started(num_blocks: int, incarnation: str, counts: str) -> None:
    """``ledger_started``: a ledger's life begins (its grant ids carry ``incarnation``). A log
    may hold several lives one after the other (a restart): replay starts a fresh ledger at
    each. Logged at once: nothing else can hold a ledger that is being built."""
    if enabled():
        log.info("ledger_started", num_blocks=num_blocks, incarnation=incarnation, counts=counts)


def emit(logger: Any, events: Sequence[Event]) -> None:
    """Emit ``events`` in the order they were noted (the ledger's lock is not held)."""
    for level, event, fields in events:
        getattr(logger, level)(event, **fields)


def note(pending: list[Event], transitions: list[Transition]) -> None:
    """One ``request_transition`` event per transition, in firing order."""
    for t in transitions:
        pending.append(
            (
                "info",
                "request_transition",
                {
                    "request": t.request,
                    "transition": t.event,
                    "from_state": t.source,
                    "to_state": t.target,
                    "cause": t.cause,
                    "grant": t.grant,
                    "peer": t.peer,
                    "unsafe": t.unsafe,
                },
            )
        )


def note_released(
    pending: list[Event],
    reqs: Sequence[RequestRecord],
    freed: Sequence[BlockIds],
    out: list[Transition],
) -> None:
    """The transitions of a release call, then one event per request let go, with its blocks."""
    note(pending, out)
    for req, ids in zip(reqs, freed, strict=True):
        pending.append(("info", "request_released", {"request": req.key, "blocks": ids.tolist()}))


def describe(ev: object) -> object:
    """Refused evidence as a log field: its data, or a bounded ``repr`` (a log line never
    raises, whatever the refused object is)."""
    if isinstance(ev, Evidence):
        try:
            return to_dict(ev)
        except Exception:
            return show(ev, 200)
    return show(ev, 200)
