"""The SGLang guard's structlog events (under ``kvlifetime.sglang``) and its refusals' log line.

A library never configures structlog: every event here is silent, and cheap on SGLang's hot
path, until the application has. Events are collected under the guard's lock and emitted after
it (``emit``): a log processor may call the guard.
"""

from __future__ import annotations

from typing import Any

import structlog

from kvlifetime import inputs
from kvlifetime.guard.refusals import log_refused

log = structlog.get_logger("kvlifetime.sglang")

Events = list[tuple[str, dict[str, Any]]]
"""Events a call collected under the lock: (event name, fields), emitted in order after it."""

_WARNINGS = frozenset({"sglang_quarantined", "sglang_exposed_slot_reused"})
# Every request of a healthy run makes these: debug, so a tick stays cheap at info.
_PER_REQUEST = frozenset({"sglang_published", "sglang_sending", "sglang_released"})


listening = structlog.is_configured
"""Whether an event would be logged at all: the per-request events' fields are not even built
while it is false (structlog unconfigured: the library stays silent and cheap)."""


def emit(events: Events) -> None:
    """Log ``events`` (outside the guard's lock), at the level each name has."""
    if not events or not structlog.is_configured():
        return
    for name, fields in events:
        if name in _WARNINGS:
            log.warning(name, **fields)
        elif name in _PER_REQUEST:
            log.debug(name, **fields)
        else:
            log.info(name, **fields)


def log_refusal(kind: str, e: BaseException, ctx: dict[str, Any]) -> None:
    """A refused call, on the one path every guard logs refusals on (``guard_refused``, logger
    ``kvlifetime.guard``, ``engine="sglang"``); its counter is the guard's."""
    if not structlog.is_configured():
        return
    fields = {k: _plain(v) for k, v in ctx.items()}
    request = str(fields.pop("key", "-"))
    log_refused("sglang", kind, request, e, error_kind=getattr(e, "kind", ""), **fields)


def _plain(v: object) -> object:
    # What a refused call was given may be anything: only plain values go into the event as
    # they are, anything else as its defensive repr.
    return v if isinstance(v, int | str | float | type(None)) else inputs._show(v)
