"""The verifier policy ``sglang-0.5.23``: SGLang 0.5.23's own release rules, refuted.

Decode side (WRITE grants: the prefill ranks write the decode's pages): an aborted request's
pages are held until every rank's grant is closed (each rank's generation-matched ABORT_ACK)
or the deferred-release deadline passes, whichever comes first (``ready = drained or now >=
deadline``, ``resolve_deferred_releases``), then released anyway. Prefill side (READ grants:
the transfer worker reads the source pages): freed at ``KVPoll.Failed``, at once.

Each refutation is pinned (length and shape), replayed by the explorer on a fresh checked
ledger, its ledger log replayed by ``kvlifetime replay`` (``verify/replay.py``), and set beside
the proof policy passing on the same shape. The reduction is checked against the unreduced
search for this policy in ``test_verify.py`` (it is one of the base policies there).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvlifetime.cli import main
from kvlifetime.grant import Access
from kvlifetime.spec.vocabulary import BlockState, RequestState
from kvlifetime.testing import to_jsonl
from kvlifetime.verify import (
    POLICY_RULES,
    Config,
    Event,
    Policy,
    Result,
    explore,
    parse_faults,
    run_events,
)
from kvlifetime.verify.model import RELEASED, State
from kvlifetime.verify.replay import read_log, replay

SGLANG = Policy.SGLANG_0_5_23
# The shape the docs and the review page show: one request, one prefill rank, one page, an
# early deadline allowed once (the incident: a prefill stalled past the 30 s deadline).
DECODE = Config(1, 1, 1, faults=parse_faults("timeout"), max_faults=1)
# The shortest counterexample on DECODE, event by event (the BFS's first one).
DECODE_TRACE = ["admit", "grant", "reject", "deliver", "deliver", "post", "lease", "land"]


def _refuted(cfg: Config, policy: Policy = SGLANG) -> Result:
    r = explore(cfg, policy)
    assert r.violation is not None and r.violation.invariant == "isolation", r.to_text()
    # The explorer's own replay, on a fresh checked ledger: the same violation.
    _s, _n, again = run_events(cfg, policy, [s.event for s in r.trace], checked=True)
    assert again == r.violation
    return r


def test_the_policy_is_named_as_the_command_line_names_it() -> None:
    assert Policy("sglang-0.5.23") is SGLANG
    assert "ready = drained or now >= deadline" in POLICY_RULES[SGLANG]
    assert set(POLICY_RULES) == set(Policy)  # the help and the verdict's rule line say each


# ------------------------------------------------------------------ decode: drained or deadline


def test_decode_rule_is_refuted_in_8_steps_the_deadline_frees_pages_a_rank_still_writes() -> None:
    r = _refuted(DECODE)
    assert len(r.trace) == 8
    assert [s.event.kind for s in r.trace] == DECODE_TRACE
    notes = [list(s.notes) for s in r.trace]
    # The abort sends the cancel (SGLang's ABORT) to the rank, which only says it received it:
    assert "owner sends Cancel(grant #1) to p1" in notes[2]
    assert "CancelReceived" in notes[3][0] and "CancelReceived" in notes[4][0]
    # the rank's transfer is under way; the deadline passes before its drain ACK; SGLang
    # releases anyway, and the late write lands in the pages that went back to the pool.
    assert "posts transfer 1 of grant #1" in notes[5][0]
    assert notes[6] == [
        "the lease of grant #1 expires: LeaseExpired",
        "sglang-0.5.23's decode (deadline passed without every rank's drain ACK: "
        '"releasing anyway") releases r1: blocks [0] to the pool',
    ]
    assert r.violation is not None and r.violation.message == (
        "a write for r1 (grant #1, generations [0]) touched blocks [0] at generations [1], "
        "after the old generation was released"
    )


def test_the_same_length_with_the_chunk_already_in_flight_at_the_abort() -> None:
    # What was measured: the prefill's chunk is inside send_kvcache when the ABORT arrives.
    # The transfer posted before the abort: also 8 steps, the same violation.
    evs = [
        Event("admit"),
        Event("grant", 0, 0),
        Event("post", 0),
        Event("reject", 0),
        Event("deliver", 0),
        Event("deliver", 0),
        Event("lease", 0, 1),
        Event("land", 0, 0),
    ]
    _s, notes, v = run_events(DECODE, SGLANG, evs)
    assert v is not None and v.invariant == "isolation"
    assert "releasing anyway" in notes[6][-1]


def test_proof_passes_on_the_same_shape_and_holds_the_page_through_the_same_events() -> None:
    r = explore(DECODE, Policy.PROOF)
    assert r.verdict == "pass" and r.complete
    # The counterexample's events under the proof policy: the deadline quarantines r1, nothing
    # goes back to the pool, and the late write lands on the generation it was meant for.
    evs = [s.event for s in explore(DECODE, SGLANG).trace]
    s, notes, v = run_events(DECODE, Policy.PROOF, evs)
    assert v is None
    led = s.snap.ledger
    assert led.state("r1") is RequestState.QUARANTINED
    assert led.block_state([0]).tolist() == [BlockState.QUARANTINED]
    assert led.generation([0]).tolist() == [0] and led.free_count() == 0
    assert "generations [0], blocks now at [0]" in notes[-1][0]


def test_a_drained_abort_is_released_as_drained_before_any_deadline() -> None:
    # Every rank's drain ACK (here the rank stops with nothing posted: its grant closes):
    # released by collect_releasable, the "drained" half of the rule; no deadline involved.
    evs = [
        Event("admit"),
        Event("grant", 0, 0),
        Event("reject", 0),
        Event("deliver", 0),  # the cancel; the rank answers CancelReceived
        Event("deliver", 0),
        Event("stop", 0),
        Event("deliver", 0),  # SchedulingStopped(last_seq=0): nothing was posted, closed
    ]
    s, notes, v = run_events(Config(1, 1, 1, faults=frozenset()), SGLANG, evs)
    assert v is None and s.env.reqs[0].phase == RELEASED
    assert notes[-1][-1] == "collect_releasable releases r1: blocks [0] to the pool"
    assert s.snap.ledger.stats().unsafe_releases == 0


def test_with_every_fault_kind_one_per_run_the_same_8_steps_at_2x2x2() -> None:
    r = _refuted(Config(2, 2, 2, faults=parse_faults("all"), max_faults=1))
    assert [s.event.kind for s in r.trace] == DECODE_TRACE


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2)])
def test_with_every_fault_kind_and_no_total_bound_a_lost_abort_makes_it_7_steps(
    shape: tuple[int, int, int],
) -> None:
    # Two faults: the ABORT is lost (SGLang's control messages are best effort), the deadline
    # passes early. 2x2x2 with every fault kind is the command line's default shape.
    r = _refuted(Config(*shape, faults=parse_faults("all")))
    kinds = ["admit", "grant", "reject", "lose", "post", "lease", "land"]
    assert [s.event.kind for s in r.trace] == kinds


def _deliver(state: State, kind: str, grant: int) -> Event:
    """The delivery of the message ``kind`` of env grant ``grant`` now on the wire."""
    (i,) = [i for i, m in enumerate(state.env.msgs) if (m.kind, m.grant) == (kind, grant)]
    return Event("deliver", i)


def test_two_ranks_one_drained_the_other_stalled_past_the_deadline() -> None:
    # required_acks = len(bootstrap_infos): rank 1's drain ACK alone does not release; the
    # deadline does, while rank 2's write is still on its way.
    cfg = Config(1, 1, 1, faults=parse_faults("timeout"), max_faults=1, ranks=2)
    evs = [Event("admit"), Event("grant", 0, 0), Event("grant", 0, 0), Event("post", 1)]
    evs.append(Event("reject", 0))
    for kind, g in [("Cancel", 0), ("CancelReceived", 0), ("Cancel", 1), ("CancelReceived", 1)]:
        s, _n, v = run_events(cfg, SGLANG, evs)
        evs.append(_deliver(s, kind, g))
    evs.append(Event("stop", 0))
    s, _n, v = run_events(cfg, SGLANG, evs)
    evs.append(_deliver(s, "SchedulingStopped", 0))  # last_seq=0: rank 1 drained
    s, _n, v = run_events(cfg, SGLANG, evs)
    assert v is None and s.env.reqs[0].phase != RELEASED  # one rank is not enough
    led = s.snap.ledger
    assert [led.proof_of(g.grant).closed for g in s.env.grants] == [True, False]
    _s, _n, v = run_events(cfg, SGLANG, [*evs, Event("lease", 1, 1), Event("land", 1, 0)])
    assert v is not None and v.invariant == "isolation" and "grant #2" in v.message
    # The shortest counterexample with two ranks is no longer (one grant is enough), and the
    # proof policy passes on the shape.
    assert len(_refuted(cfg).trace) == 8
    assert explore(cfg, Policy.PROOF).verdict == "pass"


@pytest.mark.parametrize("faults", ["none", "crash,fence", "loss,retry", "reorder,delay"])
def test_without_an_early_deadline_the_rule_holds(faults: str) -> None:
    # A deadline that passes only when nothing else can happen (no timeout fault) comes after
    # every write: the rule's hazard is exactly a deadline passing while a rank still writes.
    # A PeerLost quarantines and frees nothing (SGLang waits for its own deadline): the full
    # search agrees with the reduced one, which takes PeerLost as under proof (explore.py, (a)).
    cfg = Config(2, 1, 1, faults=parse_faults(faults))
    for r in (explore(cfg, SGLANG), explore(cfg, SGLANG, por=False)):
        assert r.verdict == "pass", r.to_text()


# ------------------------------------------------------------------ prefill: Failed frees


def test_prefill_rule_is_refuted_in_7_steps_failed_frees_source_pages_still_read() -> None:
    cfg = Config(1, 1, 1, faults=frozenset(), access=Access.READ)
    r = _refuted(cfg)
    assert [s.event.kind for s in r.trace] == [
        "admit",
        "grant",
        "reject",
        "deliver",
        "deliver",
        "post",
        "land",
    ]
    assert "KVPoll.Failed" in r.trace[2].notes[-1]
    assert r.violation is not None and "a read for r1" in r.violation.message
    assert explore(cfg, Policy.PROOF).verdict == "pass"


# ------------------------------------------------------------------ the ledger's log, replayed


def _logged(cfg: Config, policy: Policy, events: list[Event]) -> list[dict[str, Any]]:
    with capture_logs() as logs:
        run_events(cfg, policy, events, checked=True)
    return [dict(e) for e in logs]


def test_the_counterexample_log_replays_and_shows_the_unsafe_release() -> None:
    logs = _logged(DECODE, SGLANG, [s.event for s in explore(DECODE, SGLANG).trace])
    rep = replay(read_log(to_jsonl(logs).splitlines()))
    assert rep.ok and rep.mode == "full", rep.to_text()
    # What the real ledger recorded: quarantined by the deadline (LeaseExpired), then
    # released by force with the rank's grant still open: marked unsafe.
    moves = [
        (e["transition"], e["cause"], e["unsafe"])
        for e in logs
        if e["event"] == "request_transition"
    ]
    assert moves == [
        ("rejected", "reject", False),
        ("cancel_received", "CancelReceived", False),
        ("quarantined", "LeaseExpired", False),
        ("force_released", "force_release", True),
    ]
    (forced,) = [e for e in logs if e["event"] == "force_released"]
    assert forced["open_grants"] == ["verify#1"]
    assert "without a full drain ack" in forced["reason"]


def test_the_deadline_logged_as_a_normal_release_is_the_first_illegal_step() -> None:
    # An engine that logs SGLang's "releasing anyway" as an ordinary release (as if the
    # deadline proved the rank drained): the replay stops there, in both kinds of log.
    logs = _logged(DECODE, SGLANG, [s.event for s in explore(DECODE, SGLANG).trace])
    i = next(i for i, e in enumerate(logs) if e["event"] == "force_released")
    j = next(
        j
        for j, e in enumerate(logs)
        if e["event"] == "request_transition" and e["transition"] == "force_released"
    )
    tampered = [dict(e) for e in logs]
    tampered[j] = {**logs[j], "transition": "released", "cause": "collect_releasable"}
    del tampered[i]
    rep = replay(read_log(to_jsonl(tampered).splitlines()))
    assert not rep.ok and rep.illegal is not None
    assert rep.illegal.record["transition"] == "released"
    only = [e for e in tampered if e["event"] == "request_transition"]
    rep = replay(list(enumerate(only, 1)))
    assert rep.mode == "transitions" and rep.illegal is not None
    assert "no transition 'quarantined' --released--> 'released'" in rep.illegal.reason


# ------------------------------------------------------------------ command line


def test_cli_verify_sglang_policy(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--requests", "1", "--peers", "1", "--blocks", "1"]
    args = ["verify", "--policy", "sglang-0.5.23", *shape, "--faults", "timeout"]
    assert main([*args, "--max-faults", "1"]) == 1
    out = capsys.readouterr().out
    assert "verdict: VIOLATION of isolation" in out
    assert "policy sglang-0.5.23 is refuted in 8 steps" in out
    assert "rule: SGLang 0.5.23's decode" in out and "releasing anyway" in out
    assert main([*args, "--max-faults", "1", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy"] == "sglang-0.5.23" and len(doc["trace"]) == 8
    assert main(["verify", "--policy", "proof", *shape, "--faults", "timeout"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert main(["verify", "--help"]) == 0
    assert "sglang-0.5.23" in capsys.readouterr().out
