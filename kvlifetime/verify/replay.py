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

Every field of a full log's events is checked (``CHECKED_FIELDS``; only the host's own fields
such as ``timestamp`` and ``level``, and the prose ``message`` that renders the checked
``error`` and ``evidence``, are not). A log with no kvlifetime event at all is refused
(``NothingToCheck``), never reported as "0 steps, every one legal". What one line can make the
replay allocate is bounded: a line is at most ``MAX_LINE_CHARS`` characters, and recorded block
ids are mapped to a dense range, so a block id of 2,000,000,000 costs one slot, not 2e9.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

import attrs

from kvlifetime.errors import EvidenceError, KVLifetimeError, UsageError
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence, from_record, to_dict
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.ledger import BlockLedger, Transition
from kvlifetime.spec.table import request_table
from kvlifetime.spec.vocabulary import RequestState

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


def _parse(n: int, raw: str) -> dict[str, Any] | None:
    if len(raw) > MAX_LINE_CHARS:
        raise ValueError(f"line {n}: longer than {MAX_LINE_CHARS} characters")
    raw = raw.strip()
    if not raw:
        return None
    try:
        rec = json.loads(raw)
    except RecursionError:
        raise ValueError(f"line {n}: JSON nested too deep") from None
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        raise ValueError(f"line {n}: not JSON: {e}") from e
    if not isinstance(rec, dict):
        raise ValueError(f"line {n}: not a JSON object")
    return rec


def read_log(lines: Iterable[str]) -> list[tuple[int, dict[str, Any]]]:
    """Parse JSON lines; blank lines are skipped; anything else that is not an object, or a
    line longer than ``MAX_LINE_CHARS``, is an error (``ValueError`` naming the line)."""
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
    if not any(r.get("event") in KNOWN_EVENTS for _, r in records):
        raise NothingToCheck(len(records))
    full = any(r.get("event") in _FULL_EVENTS for _, r in records)
    checker: _Full | _TableOnly = _Full(records) if full else _TableOnly()
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


# ------------------------------------------------------------------ full logs


CHECKED_FIELDS: Mapping[str, frozenset[str]] = {
    "request_admitted": frozenset({"request"}),
    "blocks_held": frozenset({"request", "blocks", "shared"}),
    "grant_opened": frozenset({"grant", "request", "peer", "access", "blocks", "generations"}),
    "evidence_applied": frozenset({"evidence", "changed"}),
    "evidence_refused": frozenset({"error", "evidence"}),
    "request_transition": frozenset(
        {"request", "transition", "from_state", "to_state", "cause", "grant", "peer", "unsafe"}
    ),
    "request_released": frozenset({"request", "blocks"}),
    "force_released": frozenset({"request", "open_grants"}),
}
"""Per event of a full log, the fields the replay checks against the fresh ledger."""

NOT_CHECKED: frozenset[str] = frozenset(
    {"event", "timestamp", "level", "log_level", "logger", "logger_name", "message", "reason"}
)
"""Fields no replay checks: the event name (dispatched on), what a host's processors add,
``message`` (an ``evidence_refused``'s prose rendering of its checked ``error`` and
``evidence``) and ``reason`` (a ``force_released``'s words of the caller, replayed as given)."""

KNOWN_EVENTS: frozenset[str] = frozenset(CHECKED_FIELDS)
_MAX_BLOCK_ID = (1 << 63) - 1


def _block_ids(rec: Mapping[str, Any], line: int) -> list[int]:
    blocks = rec.get("blocks")
    if blocks is None:
        return []
    if not isinstance(blocks, list) or not all(
        type(b) is int and 0 <= b <= _MAX_BLOCK_ID for b in blocks
    ):
        raise _Malformed(line, "blocks must be a list of non-negative integers")
    return blocks


class _Malformed(Exception):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.reason = reason


class _Full:
    MODE = "full"
    EVENTS = KNOWN_EVENTS

    def __init__(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        # Recorded block ids -> a dense range, in order of first appearance: the fresh ledger
        # has as many blocks as the log names (bounded by its size), whatever their values.
        self.to_new: dict[int, int] = {}
        for n, r in records:
            if r.get("event") in ("blocks_held", "grant_opened", "request_released"):
                try:
                    ids = _block_ids(r, n)
                except _Malformed:
                    continue  # reported when the replay reaches that line
                for b in ids:
                    self.to_new.setdefault(b, len(self.to_new))
        self.to_old = {v: k for k, v in self.to_new.items()}
        self.ledger = BlockLedger(max(1, len(self.to_new)), checked=True, incarnation="replay")
        self.grants: dict[str, Grant] = {}  # recorded "incarnation#serial" -> new grant
        self.recorded_gid: dict[str, str] = {}  # new grant id (as text) -> the recorded one
        self.expected: list[Transition] = []  # fired by the fresh ledger, not yet seen logged
        self.consumed: set[int] = set()  # evidence lines already applied (ahead of time)
        self.released: dict[str, list[int]] = {}  # recorded block ids
        self.clock = 0.0  # the fresh ledger's clock: one tick per deadline the log saw pass

    def _map(self, data: Mapping[str, Any]) -> Evidence:
        ev = from_record(dict(data))
        gid = getattr(ev, "grant_id", None)
        if gid is None:
            return ev
        new = self.grants.get(str(gid))
        if new is None:
            return ev  # a grant never opened in this log: the fresh ledger must refuse it
        if isinstance(ev, GrantEvidence | AccessRevoked):
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
            before = self.ledger.fingerprint()
            fired = self.ledger.apply(ev)
            changed = bool(fired) or self.ledger.fingerprint() != before
        except KVLifetimeError as e:
            return f"the evidence rules refuse it: {type(e).__name__}: {e}"
        self.expected.extend(fired)
        if "changed" in rec and rec["changed"] is not changed:
            return (
                f"the log says changed={rec['changed']!r}; for the fresh ledger this evidence "
                f"changed {'something' if changed else 'nothing'}"
            )
        return None

    def check(self, i: int, rec: dict[str, Any], everything: Any) -> str | None:
        kind = rec.get("event")
        try:
            if kind == "request_admitted":
                self.ledger.admit(rec["request"])
                return None
            if kind == "blocks_held":
                return self._held(rec, everything[i][0])
            if kind == "grant_opened":
                return self._grant(rec)
            if kind == "evidence_applied":
                if i in self.consumed:
                    return None
                return self._apply(rec)
            if kind == "evidence_refused":
                return self._refused(rec)
            if kind == "request_released":
                return self._released(rec, everything[i][0])
            if kind == "request_transition":
                return self._transition(i, rec, everything)
            if kind == "force_released":
                return self._forced(rec)
        except _Malformed as e:
            return f"malformed record: {e.reason}"
        except KVLifetimeError as e:
            return f"{type(e).__name__}: {' '.join(str(e).split())}"
        except (KeyError, TypeError, ValueError) as e:
            return f"malformed record: {e!r}"
        return None

    def _released(self, rec: Mapping[str, Any], line: int) -> str | None:
        want = sorted(_block_ids(rec, line))
        got = self.released.pop(repr(rec.get("request")), None)
        if got is None:
            return f"request {rec.get('request')!r} released, but the fresh ledger released nothing"
        if sorted(got) != want:
            return f"the fresh ledger released blocks {sorted(got)}, the log says {want}"
        return None

    def _forced(self, rec: Mapping[str, Any]) -> str | None:
        req = rec["request"]
        open_now = sorted(
            self.recorded_gid.get(str(g.id), "?") for g in self.ledger.open_grants(req)
        )
        if sorted(rec["open_grants"]) != open_now:
            return (
                f"force_released {req!r}: the log says open grants {sorted(rec['open_grants'])}, "
                f"the fresh ledger has {open_now}"
            )
        self._call(req, "force_release", {**rec, "reason": str(rec.get("reason", "replay"))})
        return None

    def _held(self, rec: Mapping[str, Any], line: int) -> str | None:
        """The recorded request holds these blocks: the fresh ledger takes them the same way
        (a shared hold needs them held already, an exclusive one free)."""
        shared = rec.get("shared")
        if type(shared) is not bool:
            raise _Malformed(line, "shared must be true or false")
        ids = [self.to_new[b] for b in _block_ids(rec, line)]
        if rec["request"] not in self.ledger.live_requests():  # the log admits it first
            return f"blocks held by request {rec['request']!r}, never admitted"
        self.ledger.acquire(rec["request"], ids, shared=shared)
        return None

    def _grant(self, rec: Mapping[str, Any]) -> str | None:
        req = rec["request"]
        recorded = rec["grant"]
        if not isinstance(recorded, str) or recorded in self.grants:
            return f"grant {recorded!r} opened twice (or not a grant id)"
        blocks = [self.to_new[b] for b in _block_ids(rec, 0)]
        held = set(self.ledger.blocks_of(req).tolist())
        missing = [b for b in blocks if b not in held]
        if missing:
            holders = self.ledger.holders(missing)
            self.ledger.acquire(req, missing, shared=bool(holders.any()))
        g = self.ledger.grant(req, rec["peer"], blocks, Access(rec["access"]))
        self.grants[recorded] = g
        self.recorded_gid[str(g.id)] = recorded
        generations = g.generations.tolist()
        if "generations" in rec and rec["generations"] != generations:
            return (
                f"grant {recorded}: the log says generations {rec['generations']}, the fresh "
                f"ledger's blocks are at {generations}"
            )
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
            elif cause == "expire" and rec.get("transition") == "quarantined":
                self._expire(req)
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
        grant = None if t.grant is None else self.recorded_gid.get(t.grant, t.grant)
        got = {
            "request": t.request,
            "transition": t.event,
            "from_state": t.source,
            "to_state": t.target,
            "cause": t.cause,
            "grant": grant,
            "peer": t.peer,
            "unsafe": t.unsafe,
        }
        differ = [
            k for k, v in got.items() if k in rec and (rec[k] != v or type(rec[k]) is not type(v))
        ]
        differ += [k for k in ("request", "transition", "from_state", "to_state") if k not in rec]
        if differ:
            self.expected.clear()
            return (
                f"the tables fire {t.event} {t.source}->{t.target} for {t.request!r} (cause "
                f"{t.cause}, grant {grant}, peer {t.peer}, unsafe {t.unsafe}); the log differs "
                "in " + ", ".join(f"{k}={rec.get(k)!r}" for k in sorted(set(differ)))
            )
        return None

    def _expire(self, req: Any) -> None:
        """The owner's clock passed ``req``'s deadline (a local fact the log cannot prove):
        the fresh ledger is given a deadline for it that has just passed, and whatever its
        ``expire`` fires is expected next. It quarantines only where the tables allow it (an
        ended request with an open grant); anything else makes the logged step illegal."""
        self.clock += 1.0
        before = self.ledger.state(req).value
        self.ledger.set_deadline(req, self.clock)
        if self.ledger.expire(self.clock) == [req]:
            self.expected.append(Transition(req, "quarantined", before, "quarantined", "expire"))
        self.ledger.set_deadline(req, None)

    def _call(self, req: Any, cause: str, rec: Mapping[str, Any]) -> None:
        led = self.ledger
        if cause == "reject":
            self.expected.extend(led.reject(req))
        elif cause == "finish":
            self.expected.extend(led.finish(req))
        elif cause in ("release", "collect_releasable"):
            ids = led.release(req)
            self.released[repr(req)] = [self.to_old[b] for b in ids.tolist()]
            self.expected.append(
                Transition(req, "released", str(rec.get("from_state")), "released", cause)
            )
        else:
            source = led.state(req).value
            ids = led.force_release(req, str(rec.get("reason", "replay")))
            self.released[repr(req)] = [self.to_old[b] for b in ids.tolist()]
            unsafe = source != RequestState.TRANSFER_QUIESCED.value
            event = "force_released" if unsafe else "released"
            self.expected.append(Transition(req, event, source, "released", cause, unsafe=unsafe))

    def finish(self) -> str | None:
        if self.expected:
            t = self.expected[0]
            return f"the fresh ledger also fires {t.event} for {t.request!r}, never logged"
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
