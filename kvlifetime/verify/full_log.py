"""Full logs: kvlifetime's own structlog events, driving a fresh checked ledger.

The recorded calls and evidence drive a fresh *checked* ledger (recorded grant ids are mapped
to the new ones); every transition it fires must be the one recorded, in order; refused evidence
must be refused again, for the same reason; released blocks must match. A log may hold several
ledgers' lives one after another (``ledger_started``; ``ledger_restarted`` for
``BlockLedger.after_restart``): ``FullLog`` reads the log as a whole and begins each life, whose
lines a ``ledger_life.LedgerLife`` replays. ``kvlifetime.verify.replay`` reads the log and
reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import structlog
import structlog.testing

from kvlifetime.errors import KVLifetimeError
from kvlifetime.ledger import BlockLedger, Transition
from kvlifetime.verify.ledger_life import LedgerLife, MalformedRecord, block_ids

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


class FullLog:
    """A full log, read line by line: a sequence of ledgers' lives over one arena.

    It maps the log's block ids once for every life (to a dense range, in order of first
    appearance: the fresh ledgers have as many blocks as the log names), begins a life at the
    log's first line and at each ``ledger_started``, and replays ``ledger_restarted`` as
    ``BlockLedger.after_restart`` on a fresh ledger, whose own holds, grants and transitions
    must be the next lines logged. Every other line goes to the current life (``LedgerLife``),
    evidence ahead of its turn when a transition it caused is logged first (each
    ``evidence_applied`` line is applied once). ``check`` returns None for a line that is what
    the fresh ledger does, else why not; ``finish``, whether the log may end there.
    """

    MODE = "full"
    EVENTS = KNOWN_EVENTS

    def __init__(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        # Recorded block ids -> a dense range, in order of first appearance: the fresh ledger
        # has as many blocks as the log names (bounded by its size), whatever their values.
        self.to_new: dict[int, int] = {}
        for n, r in records:
            if r.get("event") in ("blocks_held", "grant_opened", "request_released", _RESTARTED):
                try:
                    ids = block_ids(r, n)
                except MalformedRecord:
                    continue  # reported when the replay reaches that line
                for b in ids:
                    self.to_new.setdefault(b, len(self.to_new))
        self.to_old = {v: k for k, v in self.to_new.items()}
        self.consumed: set[int] = set()  # evidence lines already applied (ahead of time)
        self.lives = 0  # ledger_started lines seen: each begins a ledger's life
        self._new_life(self._fresh(), None)

    def _fresh(self) -> BlockLedger:
        return BlockLedger(max(1, len(self.to_new)), checked=True, incarnation="replay")

    def _new_life(
        self, ledger: BlockLedger, incarnation: str | None, num_blocks: int | None = None
    ) -> None:
        """One ledger's life begins (the log's first line, or a ``ledger_started`` line: a
        restart begins another life over the same arena)."""
        self.life = LedgerLife(ledger, incarnation, self.to_new, self.to_old, num_blocks)
        # after_restart's own holds and grants, in the order it logs them, still to be seen
        self.setup: list[tuple[str, dict[str, Any]]] = []

    def _evidence_ahead(
        self, i: int, everything: list[tuple[int, dict[str, Any]]]
    ) -> Mapping[str, Any] | None:
        """The first ``evidence_applied`` line after line ``i`` not yet applied (now taken)."""
        for j in range(i + 1, len(everything)):
            rec = everything[j][1]
            if rec.get("event") == "evidence_applied" and j not in self.consumed:
                self.consumed.add(j)
                return rec
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
            life = self.life
            if kind == "request_admitted":
                return life.request_admitted(rec)
            if kind == "blocks_held":
                return life.blocks_held(rec, everything[i][0])
            if kind == "grant_opened":
                return life.grant_opened(rec)
            if kind == "evidence_applied":
                if i in self.consumed:
                    return None
                return life.evidence_applied(rec)
            if kind == "evidence_refused":
                return life.evidence_refused(rec)
            if kind == "request_released":
                return life.request_released(rec, everything[i][0])
            if kind == "request_transition":
                return life.request_transition(rec, lambda: self._evidence_ahead(i, everything))
            if kind == "force_released":
                return life.force_released(rec)
        except MalformedRecord as e:
            return f"malformed record: {e.reason}"
        except KVLifetimeError as e:
            return f"{type(e).__name__}: {' '.join(str(e).split())}"
        except (KeyError, TypeError, ValueError) as e:
            return f"malformed record: {e!r}"
        return None

    # ----------------------------------------------------------------- lives

    def _started(self, rec: Mapping[str, Any]) -> str | None:
        n, incarnation, counts = rec["num_blocks"], rec["incarnation"], rec["counts"]
        if type(n) is not int or n < 1 or not isinstance(incarnation, str) or not incarnation:
            return "ledger_started needs num_blocks (a positive integer) and an incarnation"
        if counts not in ("ledger", "engine"):
            return f"ledger_started: counts must be 'ledger' or 'engine', got {counts!r}"
        self.lives += 1
        if self.lives > 1 or self.life.ledger.live_requests() or self.life.grants:
            reason = self._life_over()
            if reason is not None:
                return reason
        self._new_life(self._fresh(), incarnation, n)
        return None

    def _life_over(self) -> str | None:
        """The life before a restart ends with every transition it fired logged and every
        release it made seen; its requests are lost with it (that is what a restart is)."""
        if self.setup:
            return f"the restart's own {self.setup[0][0]} was never logged"
        return self.life.over()

    def _restarted(self, rec: Mapping[str, Any]) -> str | None:
        """``BlockLedger.after_restart``: the same call on a fresh ledger, whose own holds,
        grants and transitions must be the next ones logged (``setup``)."""
        if self.life.ledger.live_requests() or self.life.grants:
            return "ledger_restarted in the middle of a ledger's life (no ledger_started before)"
        peers = rec["peers"]
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            return "ledger_restarted: peers must be a list of peer ids"
        blocks = [self.to_new[b] for b in self.life.ids(rec, 0)]
        with _captured() as seen:
            led = BlockLedger.after_restart(
                max(1, len(self.to_new)),
                peers=peers,
                exposed=blocks,
                request=rec["request"],
                checked=True,
                incarnation="replay",
            )
        self._new_life(led, self.life.incarnation, self.life.num_blocks)
        for event in seen:
            name = str(event.pop("event"))
            event.pop("log_level", None)
            if name == "request_transition":
                self.life.expected.append(_transition(event))
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
            open_now = self.life.ledger.open_grants(got["request"])
            mine = [g for g in open_now if str(g.id) == got["grant"]]
            if not mine:
                return f"the fresh ledger's grant {got['grant']} is no longer open"
            new = mine[0]
            if not isinstance(recorded, str) or recorded in self.life.grants:
                return f"grant {recorded!r} opened twice (or not a grant id)"
            self.life.adopt(recorded, new)
            got["grant"] = recorded
        differ = sorted(k for k in CHECKED_FIELDS[name] if rec.get(k) != got.get(k))
        if differ:
            return f"after_restart on a fresh ledger logs {name} with " + ", ".join(
                f"{k}={got.get(k)!r}" for k in differ
            )
        return None

    def finish(self) -> str | None:
        return self.life.finish()


__all__ = ["CHECKED_FIELDS", "KNOWN_EVENTS", "LIFE_EVENTS", "NOT_CHECKED", "FullLog"]
