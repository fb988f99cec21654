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

The first illegal step is reported with the steps before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvlifetime.errors import EvidenceError, KVLifetimeError
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence, from_record, to_dict
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.ledger import BlockLedger, Transition
from kvlifetime.machines import RequestState
from kvlifetime.table import request_table

# Calls whose first transition is the one named here (the rest follow from evidence held).
_CALL_EVENTS: Mapping[str, frozenset[str]] = {
    "reject": frozenset({"rejected"}),
    "finish": frozenset({"finished"}),
    "release": frozenset({"released"}),
    "collect_releasable": frozenset({"released"}),
    "force_release": frozenset({"released", "force_released"}),
}
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


def read_log(lines: Iterable[str]) -> list[tuple[int, dict[str, Any]]]:
    """Parse JSON lines; blank lines are skipped; anything else that is not an object is an
    error (``ValueError`` naming the line)."""
    out: list[tuple[int, dict[str, Any]]] = []
    for n, raw in enumerate(lines, 1):
        raw = raw.strip()
        if not raw:
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {n}: not JSON: {e}") from e
        if not isinstance(rec, dict):
            raise ValueError(f"line {n}: not a JSON object")
        out.append((n, rec))
    return out


_FULL_EVENTS = frozenset({"grant_opened", "evidence_applied", "evidence_refused"})


def replay(records: list[tuple[int, dict[str, Any]]], *, context: int = 10) -> ReplayReport:
    """Check ``records`` (from ``read_log``); see the module docstring."""
    full = any(r.get("event") in _FULL_EVENTS for _, r in records)
    checker: _Full | _TableOnly = _Full(records) if full else _TableOnly()
    relevant = [(n, r) for n, r in records if r.get("event") in checker.EVENTS]
    for i, (n, rec) in enumerate(relevant):
        reason = checker.check(i, rec, relevant)
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
        return replay(read_log(f), context=context)


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


# ------------------------------------------------------------------ full logs


class _Full:
    MODE = "full"
    EVENTS = frozenset(
        {
            "request_admitted",
            "grant_opened",
            "evidence_applied",
            "evidence_refused",
            "request_transition",
            "request_released",
        }
    )

    def __init__(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        nblocks = 1
        for _, r in records:
            if r.get("event") in ("grant_opened", "request_released"):
                for b in r.get("blocks") or ():
                    if isinstance(b, int):
                        nblocks = max(nblocks, b + 1)
        self.ledger = BlockLedger(nblocks, checked=True, incarnation="replay")
        self.grants: dict[str, Grant] = {}  # recorded "incarnation#serial" -> new grant
        self.expected: list[Transition] = []  # fired by the fresh ledger, not yet seen logged
        self.consumed: set[int] = set()  # evidence lines already applied (ahead of time)
        self.released: dict[str, list[int]] = {}

    def _map(self, data: Mapping[str, Any]) -> Evidence:
        ev = from_record(dict(data))
        gid = getattr(ev, "grant_id", None)
        if gid is None:
            return ev
        new = self.grants.get(str(gid))
        if new is None:
            return ev  # a grant never opened in this log: the fresh ledger must refuse it
        if isinstance(ev, GrantEvidence):
            return attrs.evolve(ev, grant_id=new.id)
        if isinstance(ev, AccessRevoked):
            return attrs.evolve(ev, grant_id=new.id)
        return ev

    def _apply_ahead(self, i: int, everything: list[tuple[int, dict[str, Any]]]) -> str | None:
        for j in range(i + 1, len(everything)):
            rec = everything[j][1]
            if rec.get("event") == "evidence_applied" and j not in self.consumed:
                self.consumed.add(j)
                return self._apply(rec)
        return "a transition caused by evidence, but no evidence_applied line follows"

    def _apply(self, rec: Mapping[str, Any]) -> str | None:
        try:
            ev = self._map(rec.get("evidence") or {})
            self.expected.extend(self.ledger.apply(ev))
        except KVLifetimeError as e:
            return f"the evidence rules refuse it: {type(e).__name__}: {e}"
        return None

    def check(self, i: int, rec: dict[str, Any], everything: Any) -> str | None:
        kind = rec.get("event")
        try:
            if kind == "request_admitted":
                self.ledger.admit(rec["request"])
                return None
            if kind == "grant_opened":
                return self._grant(rec)
            if kind == "evidence_applied":
                if i in self.consumed:
                    return None
                return self._apply(rec)
            if kind == "evidence_refused":
                return self._refused(rec)
            if kind == "request_released":
                got = self.released.pop(repr(rec.get("request")), None)
                want = sorted(rec.get("blocks") or [])
                if got is not None and sorted(got) != want:
                    return f"the fresh ledger returned blocks {sorted(got)}, the log says {want}"
                return None
            if kind == "request_transition":
                return self._transition(i, rec, everything)
        except KVLifetimeError as e:
            return f"{type(e).__name__}: {' '.join(str(e).split())}"
        except (KeyError, TypeError, ValueError) as e:
            return f"malformed record: {e!r}"
        return None

    def _grant(self, rec: Mapping[str, Any]) -> str | None:
        req = rec["request"]
        blocks = list(rec["blocks"])
        held = set(self.ledger.blocks_of(req).tolist())
        missing = [b for b in blocks if b not in held]
        if missing:
            holders = self.ledger.holders(missing)
            self.ledger.acquire(req, missing, shared=bool(holders.any()))
        g = self.ledger.grant(req, rec["peer"], blocks, Access(rec.get("access", "write")))
        self.grants[str(rec["grant"])] = g
        return None

    def _refused(self, rec: Mapping[str, Any]) -> str | None:
        want = rec.get("error")
        try:
            ev = self._map(rec.get("evidence") or {})
        except EvidenceError as e:
            return None if e.kind == want else f"refused as {e.kind}, the log says {want}"
        try:
            fired = self.ledger.apply(ev)
        except EvidenceError as e:
            if e.kind != want:
                return f"the fresh ledger refuses it as {e.kind}, the log says {want}"
            return None
        self.expected.extend(fired)
        return f"the log says it was refused ({want}); the evidence rules accept it: {to_dict(ev)}"

    def _transition(
        self, i: int, rec: Mapping[str, Any], everything: list[tuple[int, dict[str, Any]]]
    ) -> str | None:
        req = rec["request"]
        cause = str(rec.get("cause", ""))
        if not self.expected:
            if cause in _CALL_EVENTS and rec.get("transition") in _CALL_EVENTS[cause]:
                self._call(req, cause, rec)
            elif cause in _CALL_EVENTS or cause == "expire":
                return f"{rec.get('transition')} by {cause} without the call's first transition"
            else:
                reason = self._apply_ahead(i, everything)
                if reason is not None:
                    return reason
        if not self.expected:
            return (
                f"the fresh ledger fires nothing here; the log says {rec.get('from_state')} "
                f"--{rec.get('transition')}--> {rec.get('to_state')}"
            )
        t = self.expected.pop(0)
        got = (t.request, t.event, t.source, t.target)
        want = (req, rec.get("transition"), rec.get("from_state"), rec.get("to_state"))
        if got != want:
            self.expected.clear()
            return (
                f"the tables fire {t.event} {t.source}->{t.target} for {t.request!r}; "
                f"the log says {want[1]} {want[2]}->{want[3]} for {req!r}"
            )
        return None

    def _call(self, req: Any, cause: str, rec: Mapping[str, Any]) -> None:
        led = self.ledger
        if cause == "reject":
            self.expected.extend(led.reject(req))
        elif cause == "finish":
            self.expected.extend(led.finish(req))
        elif cause in ("release", "collect_releasable"):
            ids = led.release(req)
            self.released[repr(req)] = ids.tolist()
            self.expected.append(
                Transition(req, "released", str(rec.get("from_state")), "released", cause)
            )
        else:
            source = led.state(req).value
            ids = led.force_release(req, "replay")
            self.released[repr(req)] = ids.tolist()
            event = (
                "released" if source == RequestState.TRANSFER_QUIESCED.value else "force_released"
            )
            self.expected.append(Transition(req, event, source, "released", cause))

    def finish(self) -> str | None:
        if self.expected:
            t = self.expected[0]
            return f"the fresh ledger also fires {t.event} for {t.request!r}, never logged"
        return None


__all__ = ["GrantId", "Illegal", "ReplayReport", "read_log", "replay", "replay_file"]
