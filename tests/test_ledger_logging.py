"""BlockLedger logging (README, "Logging"; docs/ledger-api.md, "Structured log events").

One ``request_transition`` event per transition, with its fields; refusals and unsafe releases at
warning; and silence when the application did not configure structlog.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from kvlifetime import errors
from kvlifetime.evidence import (
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
    to_dict,
)
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger, Transition

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    with capture_logs() as cap:
        yield cap
    # capture_logs leaves structlog "configured" (its previous processors put back); a fresh
    # process is not, and that is what the library must be tested against elsewhere.
    structlog.reset_defaults()


def transitions_logged(cap: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in cap if e["event"] == "request_transition"]


def as_event(t: Transition) -> dict[str, Any]:
    return {
        "event": "request_transition",
        "log_level": "info",
        "request": t.request,
        "transition": t.event,
        "from_state": t.source,
        "to_state": t.target,
        "cause": t.cause,
        "grant": t.grant,
        "peer": t.peer,
        "unsafe": t.unsafe,
    }


@pytest.mark.parametrize("checked", [False, True])
def test_one_request_transition_event_per_transition(
    logs: list[MutableMapping[str, Any]], checked: bool
) -> None:
    L = BlockLedger(8, checked=checked, incarnation="inc")
    fired: list[Transition] = []
    a = L.allocate("a", 2)
    b = L.allocate(7, 2)
    c = L.allocate("c", 1)
    L.allocate("d", 1)
    ga = L.grant("a", "p", a)
    gb = L.grant(7, "q", b, Access.READ, deadline=1.0)
    gc = L.grant("c", "lost", c)
    fired += L.reject("a")
    fired += L.finish(7)
    fired += L.finish("c")
    fired += L.reject("d")  # no grant: all the way to transfer_quiesced in the call
    fired += L.apply(SchedulingStopped.of(ga, 2))
    fired += L.apply(TransferQuiesced.of(ga, 2))
    assert L.expire(5.0) == [7]
    fired += [Transition(7, "quarantined", "finished", "quarantined", "expire")]
    fired += L.apply(PeerLost("lost"))
    fired += L.apply(TransferCompleted.of(gb, 0))  # late proof out of quarantine
    L.release("a")
    fired += [Transition("a", "released", "transfer_quiesced", "released", "release")]
    released = L.collect_releasable()
    assert list(released) == ["d", 7]
    fired += [
        Transition("d", "released", "transfer_quiesced", "released", "collect_releasable"),
        Transition(7, "released", "transfer_quiesced", "released", "collect_releasable"),
    ]
    L.force_release("c", "operator")
    fired += [
        Transition("c", "force_released", "quarantined", "released", "force_release", unsafe=True)
    ]

    events = [as_event(t) for t in fired]
    assert transitions_logged(logs) == events
    # reject/finish/finish 3, reject d 4, evidence 2+1, expire 1, PeerLost 1, late proof 1,
    # release 1, collect 2, force_release 1
    assert len(events) == 17
    # every named transition left its trace, with grant and peer where evidence caused it
    assert {e["transition"] for e in events} == {
        "rejected",
        "finished",
        "cancel_received",
        "scheduling_stopped",
        "transfer_quiesced",
        "quarantined",
        "released",
        "force_released",
    }
    by_cause = {(e["request"], e["cause"]): (e["grant"], e["peer"]) for e in events}
    assert by_cause[("a", "TransferQuiesced")] == ("inc#1", "p")
    assert by_cause[("c", "PeerLost")] == (str(gc.id), "lost")
    assert by_cause[(7, "TransferCompleted")] == ("inc#2", "q")
    assert by_cause[(7, "expire")] == (None, None)


def test_other_events_and_their_fields(logs: list[MutableMapping[str, Any]]) -> None:
    L = BlockLedger(4, incarnation="inc")
    ids = L.allocate("a", 2)
    g = L.grant("a", "p", ids)
    L.finish("a")
    L.apply(TransferCompleted.of(g, 1))
    freed = L.release("a")
    by_event: dict[str, list[MutableMapping[str, Any]]] = {}
    for e in logs:
        by_event.setdefault(e["event"], []).append(e)
    assert by_event["request_admitted"] == [
        {"event": "request_admitted", "log_level": "info", "request": "a"}
    ]
    assert by_event["grant_opened"] == [
        {
            "event": "grant_opened",
            "log_level": "info",
            "grant": "inc#1",
            "request": "a",
            "peer": "p",
            "access": "write",
            "blocks": ids.tolist(),
            "generations": [0, 0],
        }
    ]
    assert by_event["evidence_applied"] == [
        {
            "event": "evidence_applied",
            "log_level": "info",
            "evidence": to_dict(TransferCompleted.of(g, 1)),
            "changed": True,
        }
    ]
    assert by_event["request_released"] == [
        {
            "event": "request_released",
            "log_level": "info",
            "request": "a",
            "blocks": freed.tolist(),
        }
    ]
    # what a replay needs to hold the same blocks (allocate, acquire, shared or not)
    assert by_event["blocks_held"] == [
        {
            "event": "blocks_held",
            "log_level": "info",
            "request": "a",
            "blocks": ids.tolist(),
            "shared": False,
        }
    ]
    # a ledger's life begins: replay starts a fresh ledger at each (a restart is a second life)
    assert by_event["ledger_started"] == [
        {
            "event": "ledger_started",
            "log_level": "info",
            "num_blocks": 4,
            "incarnation": "inc",
            "counts": "ledger",
        }
    ]
    assert sorted(by_event) == [
        "blocks_held",
        "evidence_applied",
        "grant_opened",
        "ledger_started",
        "request_admitted",
        "request_released",
        "request_transition",
    ]


def test_a_restart_logs_what_replay_needs_to_rebuild_it(
    logs: list[MutableMapping[str, Any]],
) -> None:
    BlockLedger.after_restart(4, peers=["p0", "p1"], exposed=[1, 2], incarnation="new")
    head = [
        (e["event"], {k: v for k, v in e.items() if k not in ("event", "log_level")}) for e in logs
    ][:3]
    assert head == [
        ("ledger_started", {"num_blocks": 4, "incarnation": "new", "counts": "ledger"}),
        (
            "ledger_restarted",
            {"request": "previous-incarnation", "peers": ["p0", "p1"], "blocks": [1, 2]},
        ),
        ("request_admitted", {"request": "previous-incarnation"}),
    ]


def test_refused_evidence_is_logged_at_warning_and_counted(
    logs: list[MutableMapping[str, Any]],
) -> None:
    L = BlockLedger(4, incarnation="inc")
    ids = L.allocate("a", 1)
    g = L.grant("a", "p", ids)
    L.reject("a")
    L.apply(SchedulingStopped.of(g, 1))
    logs.clear()
    bad = [
        (SchedulingStopped.of(g, 2), errors.ContradictoryEvidence),
        (SchedulingStopped(g.id, "a", "other", 1), errors.MismatchedEvidence),
    ]
    for ev, exc in bad:
        with pytest.raises(exc):
            L.apply(ev)
    assert [(e["event"], e["log_level"], e["error"], e["evidence"]) for e in logs] == [
        ("evidence_refused", "warning", exc.kind, to_dict(ev)) for ev, exc in bad
    ]
    L.apply(TransferQuiesced.of(g, 1))
    L.release("a")
    logs.clear()
    with pytest.raises(errors.StaleEvidence):
        L.apply(TransferQuiesced.of(g, 1))
    (stale,) = logs
    assert stale["event"] == "evidence_refused"
    assert stale["log_level"] == "warning"
    assert stale["error"] == "stale_evidence"
    assert stale["evidence"] == to_dict(TransferQuiesced.of(g, 1))
    assert "released" in stale["message"]
    assert L.stats().refused_evidence == {
        "contradictory_evidence": 1,
        "mismatched_evidence": 1,
        "stale_evidence": 1,
    }


def test_refusals_log_exactly_one_warning_each(logs: list[MutableMapping[str, Any]]) -> None:
    L = BlockLedger(4, incarnation="inc")
    ids = L.allocate("a", 1)
    g = L.grant("a", "p", ids)
    L.apply(SchedulingStopped.of(g, 1))
    logs.clear()
    with pytest.raises(errors.ContradictoryEvidence):
        L.apply(SchedulingStopped.of(g, 2))
    assert [(e["event"], e["log_level"], e["error"]) for e in logs] == [
        ("evidence_refused", "warning", "contradictory_evidence")
    ]
    assert logs[0]["evidence"] == to_dict(SchedulingStopped.of(g, 2))


def test_force_released_is_a_warning(logs: list[MutableMapping[str, Any]]) -> None:
    L = BlockLedger(4, incarnation="inc")
    ids = L.allocate("a", 2)
    g1 = L.grant("a", "p", ids)
    g2 = L.grant("a", "q", ids, Access.READ)
    L.reject("a")
    L.apply(TransferCompleted.of(g2, 1))
    logs.clear()
    freed = L.force_release("a", "stuck peer")
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings == [
        {
            "event": "force_released",
            "log_level": "warning",
            "request": "a",
            "reason": "stuck peer",
            "open_grants": [str(g1.id)],
        }
    ]
    (t,) = transitions_logged(logs)
    assert (t["transition"], t["from_state"], t["to_state"], t["unsafe"]) == (
        "force_released",
        "rejected",
        "released",
        True,
    )
    assert [e["blocks"] for e in logs if e["event"] == "request_released"] == [freed.tolist()]
    assert L.stats().unsafe_releases == 1


def test_clean_force_release_is_not_a_warning(logs: list[MutableMapping[str, Any]]) -> None:
    L = BlockLedger(2)
    L.allocate("a", 1)
    L.finish("a")
    logs.clear()
    L.force_release("a", "fine")
    assert [e["log_level"] for e in logs] == ["info", "info"]
    assert [e["event"] for e in logs] == ["request_transition", "request_released"]


SCRIPT = textwrap.dedent(
    """
    import structlog
    import kvlifetime.ledger as kl
    from kvlifetime.evidence import PeerLost, SchedulingStopped, TransferCompleted
    from kvlifetime import errors
    if {force_enabled}:
        structlog.configure()  # configured, with structlog's own defaults: it prints
    L = kl.BlockLedger(8)
    ids = L.allocate("a", 3)
    g = L.grant("a", "p", ids)
    L.reject("a")
    L.apply(SchedulingStopped.of(g, 1))
    try:
        L.apply(SchedulingStopped.of(g, 2))
    except errors.ContradictoryEvidence:
        pass
    L.apply(TransferCompleted.of(g, 1))
    L.release("a")
    ids = L.allocate("b", 2)
    L.grant("b", "q", ids)
    L.finish("b")
    L.apply(PeerLost("q"))
    L.force_release("b", "test")
    """
)


def run_script(force_enabled: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(force_enabled=force_enabled)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_silent_when_structlog_is_not_configured() -> None:
    quiet = run_script(force_enabled=False)
    assert quiet.stdout == ""
    assert quiet.stderr == ""
    # Control: the same script would print with structlog's defaults if the ledger logged
    # regardless, so the silence above is the ledger's doing.
    loud = run_script(force_enabled=True)
    for event in ("request_transition", "evidence_refused", "force_released"):
        assert event in loud.stdout


# ------------------------------------------------------------------- processors may call back


def _every_logging_call(led: BlockLedger) -> None:
    """One call of each kind that logs: admission, grants, ends, evidence applied and refused,
    releases, a deadline, a forced release, the batch calls."""
    led.acquire("a", [0, 1])
    led.acquire("b", [2])
    g = led.grant("a", "p", led.blocks_of("a"))
    gb = led.acquire_and_grant("c", [3], "q", deadline=1.0)
    led.acquire_many({"d": [4], "e": [5]})
    led.reject("a")
    led.finish_many(["d", "e", "nobody"])
    led.reject_many(["b", "nobody"])
    led.apply(SchedulingStopped.of(g, 0))
    junk: list[Any] = [TransferCompleted.of(g, 0), "not evidence"]
    led.apply_many(junk)
    with pytest.raises(errors.MalformedEvidence):
        led.apply("not evidence")  # type: ignore[arg-type]
    led.collect_releasable()
    led.finish("c")
    led.expire(2.0)
    led.force_release("c", "operator")
    led.acquire("f", [6])
    led.finish("f")
    led.release("f")
    led.allocate("g", 1)
    restarted = BlockLedger.after_restart(4, peers=["p"])
    restarted.apply(PeerLost("p"))
    assert gb.peer == "q"


def test_a_processor_that_calls_back_into_the_ledger_does_not_deadlock() -> None:
    """Issue 20 item 10: events used to be emitted under the ledger's lock, so a processor
    that asked the ledger anything (here ``stats()`` on the logging thread, and
    ``free_count()`` on another thread it waits for) blocked for ever. Run in a thread with a
    timeout, so a regression fails instead of hanging the suite."""
    holder: list[BlockLedger] = []
    seen: list[str] = []
    stuck: list[str] = []

    def ask_the_ledger(
        _logger: object, _method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        for led in holder:
            led.stats()  # the lock is not held here, on this thread
            other = threading.Thread(target=led.free_count, daemon=True)
            other.start()
            other.join(5.0)  # nor by this thread for another one
            if other.is_alive():
                stuck.append(str(event["event"]))
        seen.append(str(event["event"]))
        raise structlog.DropEvent

    def run() -> None:
        led = BlockLedger(8)
        holder.append(led)
        try:
            _every_logging_call(led)
        except BaseException as e:  # shown by the assertion below
            seen.append(repr(e))
            raise
        done.set()

    done = threading.Event()
    structlog.configure(processors=[ask_the_ledger])
    try:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(60.0)
        assert done.is_set(), f"the ledger deadlocked in a log processor after {seen[-3:]}"
    finally:
        structlog.reset_defaults()
    assert stuck == []
    # Every kind of event still reached the processor, once the lock was let go.
    assert {
        "request_admitted",
        "grant_opened",
        "request_transition",
        "finish_refused",
        "reject_refused",
        "evidence_applied",
        "evidence_refused",
        "request_released",
        "force_released",
    } <= set(seen)


def test_events_are_the_same_and_in_order_when_emitted_after_the_lock(
    logs: list[MutableMapping[str, Any]],
) -> None:
    """Deferring emission changes when, not what: the events of each call, in order, as the
    calls' own results say (the transitions a call returned are its request_transition events,
    in the same order, right after that call)."""
    led = BlockLedger(8)
    led.acquire("a", [0, 1])
    g = led.grant("a", "p", [0, 1])
    start = len(logs)
    fired = led.reject("a")
    assert transitions_logged(logs[start:]) == [as_event(t) for t in fired]
    start = len(logs)
    batch: list[Any] = [SchedulingStopped.of(g, 0), "junk", TransferQuiesced.of(g, 0)]
    out = led.apply_many(batch)
    events = [e["event"] for e in logs[start:]]
    assert events == [
        "evidence_applied",
        *["request_transition"]
        * len([t for t in out.transitions if t.cause == "SchedulingStopped"]),
        "evidence_refused",
        "evidence_applied",
        *["request_transition"]
        * len([t for t in out.transitions if t.cause == "TransferQuiesced"]),
    ]
    assert transitions_logged(logs[start:]) == [as_event(t) for t in out.transitions]
    assert led.inspect().pending_events == 0  # nothing left behind for a later call to emit
