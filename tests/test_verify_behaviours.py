"""The behaviours the model added for the library's newer promises, each with its refuted naive
variant (shortest counterexample pinned and replayed on a fresh checked ledger) and the reduced
search checked against the unreduced one:

- READ grants (the pull direction: the peer reads the source blocks) with the lease reaper
  (``timeout``) refuted: a read after the release reads the next owner's data;
- several ranks per request and peer, with ``first-rank`` (one grant per peer taken for all)
  refuted;
- a restart of the owner over the same arena: ``BlockLedger.after_restart`` (quarantine until
  every peer is fenced) passes, ``fresh-restart`` (every block free) is refuted.
"""

from __future__ import annotations

import pytest

from kvlifetime.grant import Access
from kvlifetime.verify import Config, Policy, Result, explore, parse_faults, run_events

READ = Access.READ


def _refuted_in(cfg: Config, policy: Policy, steps: int) -> Result:
    r = explore(cfg, policy)
    assert r.violation is not None and r.violation.invariant == "isolation", r.to_text()
    assert len(r.trace) == steps
    # The counterexample replays on a fresh checked ledger to the same violation.
    _s, _n, again = run_events(cfg, policy, [s.event for s in r.trace], checked=True)
    assert again == r.violation
    return r


def _same_as_unreduced(cfg: Config, policy: Policy = Policy.PROOF) -> Result:
    """The reduced search against the unreduced ones: same verdict; with the partial-order
    reduction on, the same quiet states (up to symmetry) as without it."""
    red_quiet: set[object] = set()
    full_quiet: set[object] = set()
    red = explore(cfg, policy, quiet=red_quiet)
    full = explore(cfg, policy, por=False, quiet=full_quiet)
    plain = explore(cfg, policy, reduce=False, por=False)
    assert red.verdict == full.verdict == plain.verdict
    if red.violation is None:
        assert red_quiet == full_quiet and red_quiet
        assert red.states <= full.states <= plain.states
    return red


# ------------------------------------------------------------------ READ grants (pull)


def test_reads_timeout_is_refuted_a_lease_reaper_frees_source_blocks_under_a_read() -> None:
    cfg = Config(2, 2, 2, faults=parse_faults("all"), access=READ, max_faults=1)
    r = _refuted_in(cfg, Policy.TIMEOUT, 6)
    assert [s.event.kind for s in r.trace] == [
        "admit",
        "grant",
        "finish",
        "post",
        "peer_lost",
        "land",
    ]
    assert "for reading" in r.trace[1].notes[-1]
    assert "a read for r1" in r.violation.message if r.violation else False
    _refuted_in(cfg, Policy.NAIVE, 6)


def test_reads_proof_passes_with_every_fault_kind_one_per_run() -> None:
    r = explore(
        Config(2, 1, 2, faults=parse_faults("all"), access=READ, max_faults=1), Policy.PROOF
    )
    assert r.verdict == "pass"


@pytest.mark.parametrize("faults", ["timeout,fail", "crash,fence,loss"])
def test_reads_reduction_matches_the_unreduced_search(faults: str) -> None:
    _same_as_unreduced(Config(2, 1, 1, faults=parse_faults(faults), access=READ))


# ------------------------------------------------------------------ ranks


def test_first_rank_is_refuted_an_engine_that_waits_for_one_rank_per_peer() -> None:
    r = _refuted_in(Config(2, 1, 2, faults=frozenset(), ranks=2), Policy.FIRST_RANK, 8)
    kinds = [s.event.kind for s in r.trace]
    # Two grants (ranks) of r1 to p1; one completes, the engine frees r1, the other lands.
    assert kinds.count("grant") == 2 and kinds[-1] == "land"
    # With one rank the policy is the proof policy.
    one = explore(Config(2, 1, 2, faults=frozenset()), Policy.FIRST_RANK)
    assert one.verdict == "pass"


@pytest.mark.parametrize("faults", ["crash,fence", "loss", "timeout,fail"])
def test_ranks_proof_passes_and_the_reduction_matches(faults: str) -> None:
    r = _same_as_unreduced(Config(1, 1, 1, faults=parse_faults(faults), ranks=2))
    assert r.verdict == "pass"


# ------------------------------------------------------------------ restart


def test_fresh_restart_is_refuted_the_old_process_write_lands_in_the_new_pool() -> None:
    r = _refuted_in(Config(2, 1, 1, faults=frozenset(), restarts=1), Policy.FRESH_RESTART, 5)
    assert [s.event.kind for s in r.trace] == ["admit", "grant", "post", "restart", "land"]
    assert "previous incarnation" in (r.violation.message if r.violation else "")


@pytest.mark.parametrize(("faults", "budget"), [("lie,loss", None), ("crash,fence", None)])
def test_restart_proof_passes_quarantine_until_every_peer_is_fenced(
    faults: str, budget: int | None
) -> None:
    cfg = Config(2, 1, 1, faults=parse_faults(faults), restarts=1, max_faults=budget)
    r = _same_as_unreduced(cfg)
    assert r.verdict == "pass"


def test_restart_quarantine_holds_the_arena_and_a_fence_reclaims_it() -> None:
    # admit r1, grant it to p1, p1 posts, restart: the block is held for the previous
    # incarnation (nothing free, no admission), the late write lands harmlessly; the owner
    # fences p1 and the arena comes back; r2 is admitted on it.
    from kvlifetime.verify import Event

    cfg = Config(2, 1, 1, faults=frozenset(), restarts=1)
    evs = [Event("admit"), Event("grant", 0, 0), Event("post", 0), Event("restart")]
    s, _n, v = run_events(cfg, Policy.PROOF, evs)
    assert v is None and s.snap.ledger.free_count() == 0
    s, _n, v = run_events(cfg, Policy.PROOF, [*evs, Event("land", 0, 0), Event("reclaim", 0)])
    assert v is None and s.snap.ledger.free_count() == 1
    s, notes, v = run_events(
        cfg, Policy.PROOF, [*evs, Event("reclaim", 0), Event("admit"), Event("land", 0, 0)]
    )
    assert v is None and "touches nothing" in notes[-1][-1]


def test_cli_takes_the_new_options_and_reports_them(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvlifetime.cli import main

    shape = ["--requests", "2", "--peers", "1", "--blocks", "1", "--faults", "none"]
    assert main(["verify", *shape, "--restarts", "1", "--policy", "fresh-restart"]) == 1
    out = capsys.readouterr().out
    assert "1 restart" in out and "restart" in out.split("shortest counterexample")[1]
    args = [*shape, "--access", "read", "--ranks", "2", "--format", "json"]
    assert main(["verify", *args, "--policy", "first-rank"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["access"] == "read" and doc["config"]["ranks"] == 2
    assert main(["verify", *shape, "--ranks", "9"]) == 2
    assert "ranks=9" in capsys.readouterr().err


# ------------------------------------------------------------------ prefix sharing


def test_untracked_share_is_refuted_the_pool_hands_out_a_block_a_prefix_hit_still_holds() -> None:
    cfg = Config(3, 1, 1, faults=frozenset(), share=True)
    r = explore(cfg, Policy.UNTRACKED_SHARE)
    assert r.violation is not None and r.violation.invariant == "exclusivity"
    assert [s.event.kind for s in r.trace] == ["admit", "share", "finish", "admit"]
    _s, _n, again = run_events(cfg, Policy.UNTRACKED_SHARE, [s.event for s in r.trace])
    assert again == r.violation


@pytest.mark.parametrize("access", [Access.WRITE, READ])
def test_prefix_sharing_proof_passes_and_matches_the_unreduced_search(access: Access) -> None:
    cfg = Config(3, 1, 1, faults=frozenset(), share=True, access=access)
    red = explore(cfg, Policy.PROOF)
    plain = explore(cfg, Policy.PROOF, reduce=False, por=False)
    assert red.verdict == plain.verdict == "pass" and red.states < plain.states
