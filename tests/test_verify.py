"""``kvlifetime verify``: pinned verdicts at small bounds, and counterexamples that replay.

Each counterexample is replayed on a fresh *checked* ledger (every transition mirrored into the
specification) and the broken invariant is checked again by hand, from the ledger's own state.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from kvlifetime.cli import main
from kvlifetime.verify import (
    ALL_FAULTS,
    Config,
    Event,
    Fault,
    Policy,
    Result,
    explore,
    parse_faults,
    run_events,
)
from kvlifetime.verify.explore import canonical_key, concrete_key
from kvlifetime.verify.model import FAILED, IN_FLIGHT, RELEASED, enabled, initial, step

SMALL = Config(requests=2, peers=2, blocks=2, faults=ALL_FAULTS)
# first-rank and fresh-restart are the proof policy unless ranks > 1 / restarts > 0: they are
# checked with those options in test_verify_behaviours.py. sglang-0.5.23 frees at a deadline
# (a lease) as timeout does, so the reduction takes it in the strict form: checked here.
_BASE_POLICIES = [Policy.NAIVE, Policy.TIMEOUT, Policy.PROOF, Policy.TRUSTING, Policy.SGLANG_0_5_23]


def _refuted(policy: Policy, config: Config = SMALL) -> Result:
    r = explore(config, policy)
    assert r.verdict == "violation"
    assert r.violation is not None and r.violation.invariant == "isolation"
    return r


@pytest.mark.parametrize("policy", [Policy.NAIVE, Policy.TIMEOUT])
def test_unsafe_policies_are_refuted_at_2x2x2_full_faults(policy: Policy) -> None:
    r = _refuted(policy)
    # The trace is numbered, readable, and ends on the breaking step.
    assert [s.number for s in r.trace] == list(range(1, len(r.trace) + 1))
    assert r.trace[-1].event.kind == "land"
    assert any("VIOLATION" in n for n in r.trace[-1].notes)
    text = r.to_text()
    assert "VIOLATION of isolation" in text and " 1. admit" in text


def test_shortest_counterexamples_have_pinned_lengths() -> None:
    # naive: admit, grant, reject (+ release), the cancel is lost, post, land.
    assert len(_refuted(Policy.NAIVE).trace) == 6
    # timeout: admit, grant, finish, post, the lease expires (+ reaper), land.
    assert len(_refuted(Policy.TIMEOUT).trace) == 6


@pytest.mark.parametrize("policy", [Policy.NAIVE, Policy.TIMEOUT])
def test_counterexample_replays_on_a_fresh_ledger_and_really_breaks_isolation(
    policy: Policy,
) -> None:
    r = _refuted(policy)
    events = [s.event for s in r.trace]
    # Up to the last step: the state before the landing write, on a fresh checked ledger.
    before, _notes, v = run_events(SMALL, policy, events[:-1], checked=True)
    assert v is None
    last = events[-1]
    g = before.env.grants[last.a]
    assert g.transfers[last.b] in (IN_FLIGHT, FAILED)
    ledger = before.snap.ledger
    # By hand: the write was issued for generations the ledger has already moved past, and
    # the request that held them is gone: the blocks went back to the pool under it.
    assert before.env.reqs[g.req].phase == RELEASED
    assert (ledger.generation(g.grant.blocks) > g.grant.generations).all()
    assert ledger.stats().unsafe_releases >= 1
    # And the explorer's own replay reports the same violation.
    _s, _n, again = run_events(SMALL, policy, events, checked=True)
    assert again == r.violation


def test_proof_policy_passes_full_faults_1x1x1() -> None:
    r = explore(Config(1, 1, 1, faults=ALL_FAULTS), Policy.PROOF)
    assert r.verdict == "pass" and r.complete
    assert r.states > 1000


def test_proof_policy_passes_2x2x2_full_fault_set_one_fault_per_run() -> None:
    # Every fault kind enabled, at most one fault in a run (Config.max_faults); measured and
    # pinned (README): a change in the count is a change in the model or the reduction.
    r = explore(Config(2, 2, 2, faults=ALL_FAULTS, max_faults=1), Policy.PROOF)
    assert r.verdict == "pass" and r.complete
    assert r.states == 15_985


def test_proof_policy_passes_3x2x3_full_fault_set_one_fault_per_run() -> None:
    # The benchmark's configuration (3 requests x 2 peers x 3 blocks, every fault kind), at
    # most one fault per run: about 16 s on 2 cores (README).
    r = explore(Config(3, 2, 3, faults=ALL_FAULTS, max_faults=1), Policy.PROOF)
    assert r.verdict == "pass" and r.complete
    assert r.states == 86_351


def test_proof_policy_passes_2x1x1_message_and_peer_faults() -> None:
    # Several fault kinds with no bound on how many per run (only the per-kind bounds).
    r = explore(Config(2, 1, 1, faults=parse_faults("loss,crash,fence")), Policy.PROOF)
    assert r.verdict == "pass" and r.complete


@pytest.mark.parametrize(
    "faults",
    [
        "none",
        "reorder",
        "duplicate",
        "delay",
        "loss",
        "crash",
        "fence",
        "timeout",
        "retry",
        "fail",
        "lie",
    ],
)
def test_proof_policy_passes_2x1x2_each_fault(faults: str) -> None:
    r = explore(Config(2, 1, 2, faults=parse_faults(faults)), Policy.PROOF)
    assert r.verdict == "pass", r.to_text()


def test_naive_needs_no_fault_timeout_needs_a_deadline_or_a_crash() -> None:
    assert explore(Config(1, 1, 1, faults=frozenset()), Policy.NAIVE).verdict == "violation"
    # Without early deadlines or crashes a lease fires only when nothing else can happen, so
    # the reaper never frees a block a transfer is still heading for.
    assert explore(Config(1, 1, 1, faults=frozenset()), Policy.TIMEOUT).verdict == "pass"
    r = explore(Config(1, 1, 1, faults=parse_faults("crash")), Policy.TIMEOUT)
    assert r.verdict == "violation"
    assert any(s.event.kind == "peer_lost" for s in r.trace)


def test_reduction_is_sound_and_smaller() -> None:
    cfg = Config(2, 1, 1, faults=parse_faults("loss,crash,fence"))
    reduced = explore(cfg, Policy.PROOF)
    plain = explore(cfg, Policy.PROOF, reduce=False)
    assert reduced.verdict == plain.verdict == "pass"
    assert plain.states > reduced.states
    for policy in (Policy.NAIVE, Policy.TIMEOUT):
        a = explore(cfg, policy)
        b = explore(cfg, policy, reduce=False)
        assert a.verdict == b.verdict and len(a.trace) == len(b.trace)


def test_a_write_arriving_after_the_fencing_touches_nothing() -> None:
    cfg = Config(1, 1, 1, faults=parse_faults("fence"))
    s = initial(cfg)
    for ev in [Event("admit"), Event("grant", 0, 0), Event("post", 0), Event("reject", 0)]:
        assert ev in enabled(s, cfg)
        s, _ = step(s, ev, cfg, Policy.PROOF)
    s, notes = step(s, Event("fence", 0), cfg, Policy.PROOF)
    assert any("AccessRevoked" in n for n in notes)
    # The fencing closed the only grant: the block went back to the pool, generation bumped.
    assert s.env.reqs[0].phase == RELEASED
    while s.env.msgs:  # the cancel, its answer (stale: the request is gone)
        s, _ = step(s, Event("deliver", 0), cfg, Policy.PROOF)
    assert Event("land", 0, 0) in enabled(s, cfg)
    s, notes = step(s, Event("land", 0, 0), cfg, Policy.PROOF)  # no Broken: nothing written
    assert any("touches nothing" in n for n in notes)


def test_a_crashed_peer_goes_silent_grant_by_grant() -> None:
    cfg = Config(2, 1, 2, faults=parse_faults("crash"))
    s = initial(cfg)
    for ev in [Event("admit"), Event("admit"), Event("grant", 0, 0), Event("grant", 1, 0)]:
        s, _ = step(s, ev, cfg, Policy.PROOF)
    assert s.env.crashes_left == 1
    s, notes = step(s, Event("silent", 0), cfg, Policy.PROOF)
    assert s.env.peers[0].crashed and s.env.crashes_left == 0  # the first one spends the crash
    assert any("crashes" in n for n in notes)
    evs = enabled(s, cfg)
    assert not any(e.a == 0 and e.kind in ("post", "complete", "silent") for e in evs)
    assert Event("post", 1) in evs and Event("silent", 1) in evs  # free now: already crashed
    assert Event("peer_lost", 0) in evs
    # A cancel reaching the grant it went silent on gets no answer.
    s, _ = step(s, Event("reject", 0), cfg, Policy.PROOF)
    (i,) = [i for i, m in enumerate(s.env.msgs) if m.grant == 0]
    s, notes = step(s, Event("deliver", i), cfg, Policy.PROOF)
    assert not s.env.msgs and any("no answer" in n for n in notes)


def test_only_the_first_peers_crash_in_the_reduced_search() -> None:
    cfg = Config(2, 3, 2, faults=parse_faults("crash"), max_crashes=2)
    assert [p.crashable for p in initial(cfg).env.peers] == [True, True, True]
    assert [p.crashable for p in initial(cfg, crash_first=True).env.peers] == [True, True, False]


def test_parse_faults() -> None:
    assert parse_faults("all") == ALL_FAULTS
    assert parse_faults("none") == frozenset()
    assert parse_faults("fence") == {Fault.FENCE, Fault.CRASH}
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("gremlins")


def test_cli_verify_exit_codes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--policy", "naive", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "violation" and doc["violation"]["invariant"] == "isolation"
    assert doc["trace"][0]["step"] == 1 and doc["states"] > 0
    args = ["verify", "--policy", "proof", "--requests", "1", "--peers", "1", "--blocks", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "states/s" in out
    assert main(["verify", "--faults", "nope"]) == 2


def test_result_json_round_trips() -> None:
    r = _refuted(Policy.NAIVE)
    doc = json.loads(json.dumps(r.to_dict()))
    assert doc["trace"][-1]["event"][0] == "land"
    assert np.isfinite(doc["states_per_second"])


# ------------------------------------------------------------------ the reduction, differentially

_DIFF_FAULTS = [
    "none",
    "loss",
    "duplicate",
    "delay",
    "reorder,retry",
    "crash,fence",
    "lie",
    "lie,crash,fence",
    "all",
]


@pytest.mark.parametrize("faults", _DIFF_FAULTS)
@pytest.mark.parametrize("policy", _BASE_POLICIES)
@pytest.mark.parametrize("shape", [(1, 2, 1), (2, 1, 1), (2, 1, 2)])
def test_partial_order_reduction_keeps_every_verdict(
    shape: tuple[int, int, int], policy: Policy, faults: str
) -> None:
    # Same verdict, same broken invariant, and (measured here, pinned) the same shortest
    # counterexample length with and without the stubborn-set reduction; never more states.
    r, p, b = shape
    budget = 1 if faults == "all" else None
    cfg = Config(r, p, b, faults=parse_faults(faults), max_faults=budget)
    red, full = _reduced_and_full(cfg, policy)
    assert (red.violation is None) == (full.violation is None)
    if full.violation is None:
        assert red.states <= full.states


def _reduced_and_full(cfg: Config, policy: Policy) -> tuple[Result, Result]:
    """Both searches, with the same verdict, and when refuted the same broken invariant and
    counterexample length, the reduced one's trace replaying to the same violation."""
    red = explore(cfg, policy)
    full = explore(cfg, policy, por=False)
    assert red.verdict == full.verdict
    if full.violation is not None:
        assert red.violation is not None
        assert red.violation.invariant == full.violation.invariant
        assert len(red.trace) == len(full.trace)
        _s, _n, again = run_events(cfg, policy, [s.event for s in red.trace], checked=True)
        assert again == red.violation
    return red, full


_QUIET_CASES = [
    ((2, 2, 1), "none", None),
    ((2, 2, 1), "loss", None),
    ((2, 2, 1), "crash", None),  # two peers: only the first crashes in the reduced search
    ((2, 1, 2), "all", 1),
    ((2, 1, 2), "crash,fence", None),
    ((2, 1, 2), "reorder,retry", None),
    ((2, 1, 2), "timeout,fail", None),
    # Found a state key without the remaining max_faults budget (the quiet states differed).
    ((2, 1, 2), "timeout,crash,fence", 2),
    ((1, 2, 1), "all", 1),
    # Lies refused and left out (explore.py, "lies"): two peers, so claims about another's grant.
    ((2, 2, 1), "lie", None),
    ((1, 2, 1), "lie,crash,fence", None),
]


@pytest.mark.parametrize(("shape", "faults", "budget"), _QUIET_CASES)
def test_partial_order_reduction_reaches_every_quiet_state(
    shape: tuple[int, int, int], faults: str, budget: int | None
) -> None:
    # Stubborn sets preserve every reachable deadlock (explore.py): the reduced search must
    # reach exactly the quiet states, up to symmetry, that the full search reaches.
    cfg = Config(*shape, faults=parse_faults(faults), max_faults=budget)
    red_quiet: set[object] = set()
    full_quiet: set[object] = set()
    red = explore(cfg, Policy.PROOF, quiet=red_quiet)
    full = explore(cfg, Policy.PROOF, por=False, quiet=full_quiet)
    assert red.verdict == full.verdict == "pass"
    assert red_quiet == full_quiet and red_quiet
    assert red.states < full.states


def test_partial_order_reduction_pins_state_counts() -> None:
    # Request- and grant-partitioned stubborn sets: 2x2x1 without faults, with and without
    # (measured, pinned); 2x2x2 without faults reduced only.
    cfg = Config(2, 2, 1, faults=frozenset())
    red = explore(cfg, Policy.PROOF)
    full = explore(cfg, Policy.PROOF, por=False)
    assert red.verdict == full.verdict == "pass"
    assert (red.states, full.states) == (325, 6902)
    r = explore(Config(2, 2, 2, faults=frozenset()), Policy.PROOF)
    assert r.verdict == "pass" and r.states == 325


def test_max_faults_bounds_every_kind() -> None:
    # max_faults=0 with every kind enabled is the fault-free configuration.
    a = explore(Config(1, 2, 1, faults=ALL_FAULTS, max_faults=0), Policy.PROOF)
    b = explore(Config(1, 2, 1, faults=frozenset()), Policy.PROOF)
    assert a.verdict == b.verdict == "pass" and a.states == b.states
    # One fault of any kind is enough to refute the timeout policy (an early lease).
    r = explore(Config(2, 2, 2, faults=ALL_FAULTS, max_faults=1), Policy.TIMEOUT)
    assert r.verdict == "violation" and len(r.trace) == 6
    with pytest.raises(ValueError, match="max_faults"):
        Config(max_faults=-1)


# Crashes, PeerLost and fencing with the relaxed condition (a) of the reduction (explore.py):
# each case against the unreduced search, every policy, with and without a total budget.
_CRASH_CASES = [
    ((2, 1, 2), "crash,fence", None),
    ((2, 1, 2), "crash,fence", 1),
    ((2, 1, 2), "crash,fence,loss,retry", 1),
    ((2, 1, 2), "crash,fence,timeout,fail", 1),
    ((2, 1, 2), "crash,fence,reorder,delay,duplicate", 1),
    ((2, 1, 2), "crash,fence,lie", 1),
]


@pytest.mark.parametrize("policy", _BASE_POLICIES)
@pytest.mark.parametrize(("shape", "faults", "budget"), _CRASH_CASES)
def test_reduction_with_crashes_keeps_every_verdict(
    shape: tuple[int, int, int], faults: str, budget: int | None, policy: Policy
) -> None:
    r, p, b = shape
    cfg = Config(r, p, b, faults=parse_faults(faults), max_faults=budget)
    red, full = _reduced_and_full(cfg, policy)
    if full.violation is None:
        assert red.states < full.states


def test_state_key_counts_the_fault_budget_left() -> None:
    # Two states alike but for the total fault budget left have different futures.
    cfg = Config(1, 1, 1, faults=parse_faults("loss"), max_faults=1)
    s = initial(cfg)
    spent = attrs.evolve(s, env=attrs.evolve(s.env, faults_left=0))
    for key in (canonical_key, concrete_key):
        assert key(s, cfg) != key(spent, cfg)
