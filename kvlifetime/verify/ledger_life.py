"""One ledger's life in a full log, replayed on a fresh checked ledger.

A full log may hold several ledgers' lives one after another: ``full_log.FullLog`` reads the
log, begins each life (``ledger_started``; ``ledger_restarted`` for
``BlockLedger.after_restart``, whose own lines it matches) and hands every other line to the
life it belongs to, a ``LedgerLife``. Within one life the recorded owner calls and evidence
drive a fresh *checked* ledger; every transition it fires must be the one recorded, in order;
refused evidence must be refused again, for the same reason; released blocks must match.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

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
_MAX_BLOCK_ID = (1 << 63) - 1


class MalformedRecord(Exception):
    """A line of the log whose fields are not what its event needs (at ``line``)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.reason = reason


def block_ids(rec: Mapping[str, Any], line: int) -> list[int]:
    """The record's ``blocks``: a list of recorded block ids (none when it has no such field)."""
    blocks = rec.get("blocks")
    if blocks is None:
        return []
    if not isinstance(blocks, list) or not all(
        type(b) is int and 0 <= b <= _MAX_BLOCK_ID for b in blocks
    ):
        raise MalformedRecord(line, "blocks must be a list of non-negative integers")
    return blocks


class LedgerLife:
    """One recorded ledger's life, replayed: a fresh checked ledger, driven by the recorded
    calls and evidence of that life, and what it did that the log has still to show.

    It promises that each line it is handed is made on its fresh ledger as it was on the
    recorded one, under the fresh ledger's names (recorded grant ids mapped to the grants it
    opened, recorded block ids to the dense range ``to_new``); what the fresh ledger fires
    (``expected``) and releases (``released``) waits until the log shows it, in order, and
    must be what the log shows. Each method named after an event of the log checks one line of
    it: None when the line is what the fresh ledger does, else why not. A block list that is no
    list of block ids raises ``MalformedRecord``; the fresh ledger's refusals of a call and a
    record's missing fields propagate (the log's reader reports them).
    """

    def __init__(
        self,
        ledger: BlockLedger,
        incarnation: str | None,
        to_new: Mapping[int, int],
        to_old: Mapping[int, int],
        num_blocks: int | None = None,
    ) -> None:
        self.ledger = ledger
        self.incarnation = incarnation  # the recorded ledger's, when its start was logged
        self.num_blocks = num_blocks  # the recorded ledger's, when its start was logged
        self.to_new = to_new  # recorded block id -> the fresh ledger's (the whole log's)
        self.to_old = to_old
        self.grants: dict[str, Grant] = {}  # recorded "incarnation#serial" -> new grant
        self.recorded_gid: dict[str, str] = {}  # new grant id (as text) -> the recorded one
        self.expected: list[Transition] = []  # fired by the fresh ledger, not yet seen logged
        self.released: dict[str, list[int]] = {}  # recorded block ids
        self.clock = 0.0  # the fresh ledger's clock: one tick per deadline the log saw pass

    def ids(self, rec: Mapping[str, Any], line: int) -> list[int]:
        """The record's block ids, each a block of the recorded ledger (when its size is known)."""
        ids = block_ids(rec, line)
        if self.num_blocks is not None and any(b >= self.num_blocks for b in ids):
            raise MalformedRecord(line, f"block {max(ids)} named; the ledger has {self.num_blocks}")
        return ids

    def adopt(self, recorded: str, grant: Grant) -> None:
        """The fresh ledger's ``grant`` is the one the log calls ``recorded``."""
        self.grants[recorded] = grant
        self.recorded_gid[str(grant.id)] = recorded

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

    # ----------------------------------------------------------------- one line each

    def request_admitted(self, rec: Mapping[str, Any]) -> str | None:
        self.ledger.admit(rec["request"])
        return None

    def blocks_held(self, rec: Mapping[str, Any], line: int) -> str | None:
        """The recorded request holds these blocks: the fresh ledger takes them the same way
        (a shared hold needs them held already, an exclusive one free)."""
        shared = rec.get("shared")
        if type(shared) is not bool:
            raise MalformedRecord(line, "shared must be true or false")
        ids = [self.to_new[b] for b in self.ids(rec, line)]
        if rec["request"] not in self.ledger.live_requests():  # the log admits it first
            return f"blocks held by request {rec['request']!r}, never admitted"
        self.ledger.acquire(rec["request"], ids, shared=shared)
        return None

    def grant_opened(self, rec: Mapping[str, Any]) -> str | None:
        req = rec["request"]
        recorded = rec["grant"]
        if not isinstance(recorded, str) or recorded in self.grants:
            return f"grant {recorded!r} opened twice (or not a grant id)"
        if self.incarnation is not None and not recorded.startswith(self.incarnation + "#"):
            return f"grant {recorded} is not of this ledger's incarnation ({self.incarnation})"
        blocks = [self.to_new[b] for b in self.ids(rec, 0)]
        held = set(self.ledger.blocks_of(req).tolist())
        missing = [b for b in blocks if b not in held]
        if missing:
            holders = self.ledger.holders(missing)
            self.ledger.acquire(req, missing, shared=bool(holders.any()))
        g = self.ledger.grant(req, rec["peer"], blocks, Access(rec["access"]))
        self.adopt(recorded, g)
        generations = g.generations.tolist()
        if "generations" in rec and rec["generations"] != generations:
            return (
                f"grant {recorded}: the log says generations {rec['generations']}, the fresh "
                f"ledger's blocks are at {generations}"
            )
        return None

    def evidence_applied(self, rec: Mapping[str, Any]) -> str | None:
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

    def evidence_refused(self, rec: Mapping[str, Any]) -> str | None:
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

    def request_released(self, rec: Mapping[str, Any], line: int) -> str | None:
        want = sorted(self.ids(rec, line))
        got = self.released.pop(repr(rec.get("request")), None)
        if got is None:
            return f"request {rec.get('request')!r} released, but the fresh ledger released nothing"
        if sorted(got) != want:
            return f"the fresh ledger released blocks {sorted(got)}, the log says {want}"
        return None

    def force_released(self, rec: Mapping[str, Any]) -> str | None:
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

    def request_transition(
        self, rec: Mapping[str, Any], ahead: Callable[[], Mapping[str, Any] | None]
    ) -> str | None:
        """The next transition the fresh ledger fired must be this one. When it fired none,
        the line's cause makes it fire: the owner's call it names, a deadline passed
        (``expire``), or else evidence, the next ``evidence_applied`` line not yet applied
        (``ahead()``: None when no such line follows), applied ahead of its turn."""
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
                evidence = ahead()
                if evidence is None:
                    return "a transition caused by evidence, but no evidence_applied line follows"
                reason = self.evidence_applied(evidence)
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

    # ----------------------------------------------------------------- its end

    def over(self) -> str | None:
        """Why this life cannot end here (a restart follows): a release it made, or a
        transition it fired, that the log never showed. Its requests are lost with it."""
        if self.released:
            return f"request {next(iter(self.released))} released, never logged"
        return self.finish()

    def finish(self) -> str | None:
        """Why the log cannot end here: a transition the fresh ledger fired, never logged."""
        if self.expected:
            t = self.expected[0]
            return f"the fresh ledger also fires {t.event} for {t.request!r}, never logged"
        return None
