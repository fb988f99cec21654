"""``kvlifetime replay LOG.jsonl``: check a recorded event log against the tables and evidence.

Two kinds of log are accepted (docs/ledger-api.md names the fields):

- **full** logs (kvlifetime's own structlog JSON: ``request_admitted``, ``grant_opened``,
  ``evidence_applied``, ``evidence_refused``, ``request_transition``, ``request_released``):
  the recorded calls and evidence drive a fresh *checked* ledger (recorded grant ids are mapped
  to the new ones), and every transition it fires must be the one recorded, in order; refused
  evidence must be refused again, for the same reason; released blocks must match;
- **transition-only** logs (an engine's own log mapped to ``request_transition`` lines): each
  transition must be a row of the request table from the state the request is in, and its cause
  must be able to prove what the row's guard needs (a ``LeaseExpired`` never proves a transfer
  ended; only a release call releases).

A full log may hold several ledgers' lives, one after another: a ``ledger_started`` line begins
one (a process that restarts its ledger over the same arena logs a second). The replay then
checks that the life before it logged every transition it fired, and starts a fresh ledger;
after a ``ledger_restarted`` line (``BlockLedger.after_restart``) it makes the same call and
expects the holds, grants and transitions that call logs to be the next ones in the log.

The first illegal step is reported with the steps before it.

Every field of a full log's events is checked (``CHECKED_FIELDS``; only the host's own fields
such as ``timestamp`` and ``level``, and the prose ``message`` that renders the checked
``error`` and ``evidence``, are not). A log with no kvlifetime event at all is refused
(``NothingToCheck``), never reported as "0 steps, every one legal". What one line can make the
replay allocate is bounded: a line is at most ``MAX_LINE_CHARS`` characters nested at most
``MAX_LOG_NESTING`` levels, and recorded block
ids are mapped to a dense range, so a block id of 2,000,000,000 costs one slot, not 2e9.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

import attrs

from kvlifetime.errors import InvalidField, UsageError
from kvlifetime.grant import GrantId
from kvlifetime.inputs import json_value
from kvlifetime.spec.table import request_table
from kvlifetime.spec.vocabulary import RequestState
from kvlifetime.verify.full_log import (
    CHECKED_FIELDS,
    KNOWN_EVENTS,
    LIFE_EVENTS,
    NOT_CHECKED,
    FullLog,
)

# Causes that prove nothing about memory: they may quarantine, never prove an end.
_SUSPICION_ONLY = frozenset({"LeaseExpired", "PeerLost", "expire"})
_MEMORY_GUARDS = frozenset({"all_cancel_received", "all_scheduling_stopped", "all_grants_closed"})
_RELEASE_CAUSES = frozenset({"release", "collect_releasable", "force_release"})


@attrs.frozen(slots=True)
class Illegal:
    """The first step of a log that the tables or the evidence rules do not allow."""

    line: int  # 1-based line number in the log
    record: dict[str, Any]
    reason: str
    before: tuple[tuple[int, dict[str, Any]], ...]  # the steps before it (line, record)


@attrs.frozen(slots=True)
class ReplayReport:
    mode: str  # "full" or "transitions"
    steps: int  # lines checked
    illegal: Illegal | None

    @property
    def ok(self) -> bool:
        return self.illegal is None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "steps": self.steps, "ok": self.ok}
        if self.illegal is not None:
            out["illegal"] = {
                "line": self.illegal.line,
                "record": self.illegal.record,
                "reason": self.illegal.reason,
                "before": [{"line": n, "record": r} for n, r in self.illegal.before],
            }
        return out

    def to_text(self) -> str:
        if self.illegal is None:
            return f"replay ({self.mode}): {self.steps} steps, every one legal\n"
        il = self.illegal
        lines = [f"replay ({self.mode}): ILLEGAL step at line {il.line}: {il.reason}"]
        lines.append("steps before it:")
        for n, rec in il.before:
            lines.append(f"  {n:>4}. {_short(rec)}")
        lines.append(f"  {il.line:>4}. {_short(il.record)}   <-- illegal")
        return "\n".join(lines) + "\n"


def _short(rec: Mapping[str, Any]) -> str:
    ev = rec.get("event", "?")
    if ev == "request_transition":
        return (
            f"request_transition {rec.get('request')!r}: {rec.get('from_state')} "
            f"--{rec.get('transition')}--> {rec.get('to_state')} (cause {rec.get('cause')})"
        )
    rest = {k: v for k, v in rec.items() if k not in ("event", "timestamp", "level", "logger")}
    return f"{ev} {json.dumps(rest, sort_keys=True, default=str)}"


MAX_LINE_CHARS = 1 << 20
"""The longest line read (1 MiB): one line can make the replay allocate only so much."""


class NothingToCheck(UsageError):
    """The log holds no kvlifetime event: there is nothing to replay.

    Whose fault: the input (an empty file, another program's log, a log recorded with
    kvlifetime's events filtered out). A vacuous "every step legal" would be a false pass.
    """

    kind = "nothing_to_check"

    def __init__(self, lines: int) -> None:
        self.lines = lines
        super().__init__(
            f"no kvlifetime event in the log ({lines} JSON lines read; expected events such "
            f"as {', '.join(sorted(KNOWN_EVENTS))}): nothing to check"
        )


MAX_LOG_NESTING = 64
"""The deepest a log line's JSON may nest (kvlifetime's own events are a few levels deep)."""


def _parse(n: int, raw: str) -> dict[str, Any] | None:
    """One line as a JSON object; anything else is ``InvalidField`` (a ``ValueError`` too)
    naming the line: over ``MAX_LINE_CHARS``, not JSON, nested deeper than
    ``MAX_LOG_NESTING`` (the replay formats and compares what it reads: Python recurses on
    both), not an object, an event that is not a string."""
    if len(raw) > MAX_LINE_CHARS:
        raise InvalidField(f"line {n}: longer than {MAX_LINE_CHARS} characters")
    raw = raw.strip()
    if not raw:
        return None
    rec = json_value(raw, f"line {n}", limit=MAX_LOG_NESTING)
    if not isinstance(rec, dict):
        raise InvalidField(f"line {n}: not a JSON object")
    if not isinstance(rec.get("event", ""), str):
        raise InvalidField(f"line {n}: its event is not a string")
    return rec


def read_log(lines: Iterable[str]) -> list[tuple[int, dict[str, Any]]]:
    """Parse JSON lines; blank lines are skipped; anything else that is not an object, a line
    longer than ``MAX_LINE_CHARS`` or nested deeper than ``MAX_LOG_NESTING``, is an error
    (``InvalidField``, a ``ValueError``, naming the line)."""
    out: list[tuple[int, dict[str, Any]]] = []
    for n, raw in enumerate(lines, 1):
        rec = _parse(n, raw)
        if rec is not None:
            out.append((n, rec))
    return out


def read_log_file(f: IO[str]) -> list[tuple[int, dict[str, Any]]]:
    """``read_log`` of an open file, never holding more than ``MAX_LINE_CHARS`` + 1 characters
    of one line in memory (a file of one 10 GB line is refused at the limit)."""
    out: list[tuple[int, dict[str, Any]]] = []
    n = 0
    while True:
        raw = f.readline(MAX_LINE_CHARS + 1)
        if not raw:
            return out
        n += 1
        rec = _parse(n, raw)
        if rec is not None:
            out.append((n, rec))


_FULL_EVENTS = frozenset({"grant_opened", "evidence_applied", "evidence_refused"})


def replay(
    records: list[tuple[int, dict[str, Any]]],
    *,
    context: int = 10,
    log: Any = None,
    on_step: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Check ``records`` (from ``read_log``); see the module docstring.

    ``log``: a structlog logger that gets one ``replay_step`` (debug) per step checked;
    ``on_step(line)``: told the log line of each step checked (a progress bar's count).
    Raises ``NothingToCheck`` when no record is a kvlifetime event."""
    if not any(r.get("event") in KNOWN_EVENTS - LIFE_EVENTS for _, r in records):
        raise NothingToCheck(len(records))
    full = any(r.get("event") in _FULL_EVENTS for _, r in records)
    checker: FullLog | _TableOnly = FullLog(records) if full else _TableOnly()
    relevant = [(n, r) for n, r in records if r.get("event") in checker.EVENTS]
    for i, (n, rec) in enumerate(relevant):
        reason = checker.check(i, rec, relevant)
        if log is not None:
            log.debug("replay_step", line=n, step=rec.get("event"), legal=reason is None)
        if on_step is not None:
            on_step(n)
        if reason is not None:
            before = tuple(relevant[max(0, i - context) : i])
            return ReplayReport(checker.MODE, i + 1, Illegal(n, rec, reason, before))
    reason = checker.finish()
    if reason is not None and relevant:
        n, rec = relevant[-1]
        before = tuple(relevant[max(0, len(relevant) - 1 - context) : -1])
        return ReplayReport(checker.MODE, len(relevant), Illegal(n, rec, reason, before))
    return ReplayReport(checker.MODE, len(relevant), None)


def replay_file(path: str, *, context: int = 10) -> ReplayReport:
    with open(path, encoding="utf-8") as f:
        return replay(read_log_file(f), context=context)


# ------------------------------------------------------------------ transition-only logs


class _TableOnly:
    MODE = "transitions"
    EVENTS = frozenset({"request_transition", "request_admitted"})

    def __init__(self) -> None:
        self.table = request_table()
        self.state: dict[str, str] = {}

    def check(self, _i: int, rec: dict[str, Any], _all: Any) -> str | None:
        key = repr(rec.get("request"))
        if rec.get("event") == "request_admitted":
            if self.state.get(key, RequestState.RELEASED.value) != RequestState.RELEASED.value:
                return f"request {rec.get('request')!r} admitted again while live"
            self.state[key] = RequestState.ADMITTED.value
            return None
        src, ev, dst = rec.get("from_state"), rec.get("transition"), rec.get("to_state")
        cause = str(rec.get("cause", ""))
        if not all(isinstance(x, str) for x in (src, ev, dst)):
            return "a request_transition needs from_state, transition and to_state"
        assert isinstance(src, str) and isinstance(ev, str) and isinstance(dst, str)
        known = self.state.get(key)
        if known is None or known == RequestState.RELEASED.value:
            known = self.table.initial if src == self.table.initial else known
        if known is not None and known != src:
            return f"request {rec.get('request')!r} is in {known!r}, the log says from {src!r}"
        rows = [r for r in self.table.rows_for(src, ev) if r.target == dst]
        if not rows:
            return f"the request table has no transition {src!r} --{ev}--> {dst!r}"
        guard = rows[0].guard
        if ev in ("released", "force_released") and cause not in _RELEASE_CAUSES:
            return f"{ev} caused by {cause!r}: only a release call releases"
        if ev == "force_released" and rec.get("unsafe") is False:
            return "force_released not marked unsafe"
        if guard in _MEMORY_GUARDS and cause in _SUSPICION_ONLY:
            return (
                f"{ev} ({guard}) caused by {cause}: it proves only that time passed or a "
                "heartbeat failed, nothing about memory"
            )
        self.state[key] = dst
        return None

    def finish(self) -> str | None:
        return None


__all__ = [
    "CHECKED_FIELDS",
    "KNOWN_EVENTS",
    "MAX_LINE_CHARS",
    "NOT_CHECKED",
    "GrantId",
    "Illegal",
    "NothingToCheck",
    "ReplayReport",
    "read_log",
    "read_log_file",
    "replay",
    "replay_file",
]
