"""Full logs: kvlifetime's own structlog events, driving a fresh checked ledger.

The recorded calls and evidence drive a fresh *checked* ledger (recorded grant ids are mapped
to the new ones); every transition it fires must be the one recorded, in order; refused evidence
must be refused again, for the same reason; released blocks must match. A log may hold several
ledgers' lives one after another (``ledger_started``; ``ledger_restarted`` for
``BlockLedger.after_restart``). ``kvlifetime.verify.replay`` reads the log and reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import attrs
import structlog
import structlog.testing

from kvlifetime.errors import EvidenceError, KVLifetimeError
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence, from_record, to_dict
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger, Transition
from kvlifetime.spec.vocabulary import RequestState

# Calls whose first transition is the one named here (the rest follow from evidence held).
_CALL_EVENTS: Mapping[str, frozenset[str]] = {
    "reject": frozenset({"rejected"}),
    "finish": frozenset({"finished"}),
    "release": frozenset({"released"}),
    "collect_releasable": frozenset({"released"}),
    "force_release": frozenset({"released", "force_released"}),
}
_STARTED = "ledger_started"
_RESTARTED = "ledger_restarted"
# What after_restart logs besides transitions, matched one by one after its ledger_restarted.
_SETUP_EVENTS = frozenset({"request_admitted", "blocks_held", "grant_opened"})
LIFE_EVENTS = frozenset({_STARTED, _RESTARTED})  # alone, they leave nothing to check


@contextlib.contextmanager
def _captured() -> Iterator[list[MutableMapping[str, Any]]]:
    """The replay's own ledger's events (structlog's capture, left as it was found)."""
    was_configured = structlog.is_configured()
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        if not was_configured:
            structlog.reset_defaults()


def _transition(e: Mapping[str, Any]) -> Transition:
    return Transition(
        e["request"],
        e["transition"],
        e["from_state"],
        e["to_state"],
        e["cause"],
        e.get("grant"),
        e.get("peer"),
        bool(e.get("unsafe", False)),
    )


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
    "ledger_started": frozenset({"num_blocks", "incarnation", "counts"}),
    "ledger_restarted": frozenset({"request", "peers", "blocks"}),
}
"""Per event of a full log, the fields the replay checks against the fresh ledger.
``ledger_started``'s ``num_blocks`` is checked as a bound (every block its life names is below
it): the fresh ledger is sized by the blocks the log names, not by a number a line claims."""

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


class FullLog:
    MODE = "full"
    EVENTS = KNOWN_EVENTS

    def __init__(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        # Recorded block ids -> a dense range, in order of first appearance: the fresh ledger
        # has as many blocks as the log names (bounded by its size), whatever their values.
        self.to_new: dict[int, int] = {}
        for n, r in records:
            if r.get("event") in ("blocks_held", "grant_opened", "request_released", _RESTARTED):
                try:
                    ids = _block_ids(r, n)
                except _Malformed:
                    continue  # reported when the replay reaches that line
                for b in ids:
                    self.to_new.setdefault(b, len(self.to_new))
        self.to_old = {v: k for k, v in self.to_new.items()}
        self.consumed: set[int] = set()  # evidence lines already applied (ahead of time)
        self.lives = 0  # ledger_started lines seen: each begins a ledger's life
        self._new_life(self._fresh(), None)

    def _fresh(self) -> BlockLedger:
        return BlockLedger(max(1, len(self.to_new)), checked=True, incarnation="replay")

    def _new_life(self, ledger: BlockLedger, incarnation: str | None) -> None:
        """Everything known of one ledger's life, from its start (the log's first line, or a
        ``ledger_started`` line: a restart begins another life over the same arena)."""
        self.ledger = ledger
        self.incarnation = incarnation  # the recorded ledger's, when its start was logged
        self.grants: dict[str, Grant] = {}  # recorded "incarnation#serial" -> new grant
        self.recorded_gid: dict[str, str] = {}  # new grant id (as text) -> the recorded one
        self.expected: list[Transition] = []  # fired by the fresh ledger, not yet seen logged
        self.released: dict[str, list[int]] = {}  # recorded block ids
        self.clock = 0.0  # the fresh ledger's clock: one tick per deadline the log saw pass
        # after_restart's own holds and grants, in the order it logs them, still to be seen
        self.setup: list[tuple[str, dict[str, Any]]] = []
        self.num_blocks: int | None = None  # the recorded ledger's, when its start was logged

    def _ids(self, rec: Mapping[str, Any], line: int) -> list[int]:
        """The record's block ids, each a block of the recorded ledger (when its size is known)."""
        ids = _block_ids(rec, line)
        if self.num_blocks is not None and any(b >= self.num_blocks for b in ids):
            raise _Malformed(line, f"block {max(ids)} named; the ledger has {self.num_blocks}")
        return ids

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
            if kind == _STARTED:
                return self._started(rec)
            if kind == _RESTARTED:
                return self._restarted(rec)
            if self.setup and kind in _SETUP_EVENTS:
                return self._setup_step(rec)
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

    def _started(self, rec: Mapping[str, Any]) -> str | None:
        n, incarnation, counts = rec["num_blocks"], rec["incarnation"], rec["counts"]
        if type(n) is not int or n < 1 or not isinstance(incarnation, str) or not incarnation:
            return "ledger_started needs num_blocks (a positive integer) and an incarnation"
        if counts not in ("ledger", "engine"):
            return f"ledger_started: counts must be 'ledger' or 'engine', got {counts!r}"
        self.lives += 1
        if self.lives > 1 or self.ledger.live_requests() or self.grants:
            reason = self._life_over()
            if reason is not None:
                return reason
        self._new_life(self._fresh(), incarnation)
        self.num_blocks = n
        return None

    def _life_over(self) -> str | None:
        """The life before a restart ends with every transition it fired logged and every
        release it made seen; its requests are lost with it (that is what a restart is)."""
        if self.setup:
            return f"the restart's own {self.setup[0][0]} was never logged"
        if self.released:
            return f"request {next(iter(self.released))} released, never logged"
        return self.finish()

    def _restarted(self, rec: Mapping[str, Any]) -> str | None:
        """``BlockLedger.after_restart``: the same call on a fresh ledger, whose own holds,
        grants and transitions must be the next ones logged (``setup``)."""
        if self.ledger.live_requests() or self.grants:
            return "ledger_restarted in the middle of a ledger's life (no ledger_started before)"
        peers = rec["peers"]
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            return "ledger_restarted: peers must be a list of peer ids"
        blocks = [self.to_new[b] for b in self._ids(rec, 0)]
        with _captured() as seen:
            led = BlockLedger.after_restart(
                max(1, len(self.to_new)),
                peers=peers,
                exposed=blocks,
                request=rec["request"],
                checked=True,
                incarnation="replay",
            )
        size = self.num_blocks
        self._new_life(led, self.incarnation)
        self.num_blocks = size
        for event in seen:
            name = str(event.pop("event"))
            event.pop("log_level", None)
            if name == "request_transition":
                self.expected.append(_transition(event))
            elif name in _SETUP_EVENTS:
                self.setup.append((name, dict(event)))
        return None

    def _setup_step(self, rec: Mapping[str, Any]) -> str | None:
        name, want = self.setup.pop(0)
        if rec.get("event") != name:
            return f"after ledger_restarted the fresh ledger logs {name} next, not this"
        got = dict(want)
        if "blocks" in got:
            got["blocks"] = [self.to_old[b] for b in got["blocks"]]
        if name == "grant_opened":
            recorded = rec.get("grant")
            mine = [g for g in self.ledger.open_grants(got["request"]) if str(g.id) == got["grant"]]
            if not mine:
                return f"the fresh ledger's grant {got['grant']} is no longer open"
            new = mine[0]
            if not isinstance(recorded, str) or recorded in self.grants:
                return f"grant {recorded!r} opened twice (or not a grant id)"
            self.grants[recorded] = new
            self.recorded_gid[got["grant"]] = recorded
            got["grant"] = recorded
        differ = sorted(k for k in CHECKED_FIELDS[name] if rec.get(k) != got.get(k))
        if differ:
            return f"after_restart on a fresh ledger logs {name} with " + ", ".join(
                f"{k}={got.get(k)!r}" for k in differ
            )
        return None

    def _released(self, rec: Mapping[str, Any], line: int) -> str | None:
        want = sorted(self._ids(rec, line))
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
        ids = [self.to_new[b] for b in self._ids(rec, line)]
        if rec["request"] not in self.ledger.live_requests():  # the log admits it first
            return f"blocks held by request {rec['request']!r}, never admitted"
        self.ledger.acquire(rec["request"], ids, shared=shared)
        return None

    def _grant(self, rec: Mapping[str, Any]) -> str | None:
        req = rec["request"]
        recorded = rec["grant"]
        if not isinstance(recorded, str) or recorded in self.grants:
            return f"grant {recorded!r} opened twice (or not a grant id)"
        if self.incarnation is not None and not recorded.startswith(self.incarnation + "#"):
            return f"grant {recorded} is not of this ledger's incarnation ({self.incarnation})"
        blocks = [self.to_new[b] for b in self._ids(rec, 0)]
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


__all__ = ["CHECKED_FIELDS", "KNOWN_EVENTS", "LIFE_EVENTS", "NOT_CHECKED", "FullLog"]
