"""The packed engine is the real ledger's model over plain values: proven equal, shape by shape.

Every test here runs one search with each engine (``explore(engine="ledger")`` drives the real
``BlockLedger``, ``engine="packed"`` a ``PackedLedger``) and requires the same set of canonical
keys reached, the same verdict and the same shortest counterexample length. The grid: every
policy x every fault kind alone (and none) on one request, two peers, one block; then the
shapes each refutation needs (two requests, ranks, reused ids, reads, a lying peer, every fault
at one per run). About a minute and a half on 2 loaded cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvlifetime.errors import SpecDisagreement
from kvlifetime.grant import Access
from kvlifetime.spec.vocabulary import REQUEST_GUARDS, RequestState
from kvlifetime.verify import Config, Fault, Policy, explore, parse_faults
from kvlifetime.verify import packed as packed_module
from kvlifetime.verify.explore import ENGINES

FAULTS: list[frozenset[Fault]] = [frozenset({f}) for f in Fault] + [frozenset()]


def both(config: Config, policy: Policy) -> tuple[Any, Any]:
    """Run both engines; return their (reached keys, verdict, trace length, states)."""
    out = []
    for engine in ENGINES:
        reached: set[Any] = set()
        r = explore(config, policy, engine=engine, reached=reached)
        verdict = None if r.violation is None else r.violation.invariant
        out.append((reached, verdict, len(r.trace), r.states, r.complete))
    return out[0], out[1]


def assert_equal(config: Config, policy: Policy) -> None:
    ledger, packed = both(config, policy)
    what = f"{policy.value} {config.describe()}"
    assert packed[1:] == ledger[1:], what
    # Both expand in the same order (one model, the same events): even a search stopped at a
    # violation has stored the same states.
    assert packed[0] == ledger[0], what


@pytest.mark.parametrize("policy", list(Policy), ids=lambda p: p.value)
def test_every_fault_kind_alone_reaches_the_same_states(policy: Policy) -> None:
    for faults in FAULTS:
        assert_equal(Config(1, 2, 1, faults=faults), policy)


@pytest.mark.parametrize(
    ("config", "policy"),
    [
        (Config(2, 2, 1, faults=parse_faults("all"), max_faults=1), Policy.PROOF),
        (Config(2, 2, 1, faults=parse_faults("all"), max_faults=1), Policy.TIMEOUT),
        (Config(2, 2, 1, faults=parse_faults("all"), max_faults=1), Policy.SGLANG_0_5_23),
        (Config(2, 1, 2, faults=frozenset()), Policy.ORDERED_REAPER),
        (Config(2, 1, 1, faults=parse_faults("delay"), reuse_ids=True), Policy.ID_OVERWRITE),
        (Config(2, 1, 1, faults=parse_faults("delay"), reuse_ids=True), Policy.PROOF),
        (Config(1, 1, 1, faults=parse_faults("crash"), ranks=2), Policy.FIRST_RANK),
        (Config(1, 1, 1, faults=parse_faults("fail"), ranks=2), Policy.FIRST_FAILURE),
        (Config(1, 2, 1, faults=parse_faults("duplicate")), Policy.COUNTED_COMPLETIONS),
        (Config(1, 2, 1, faults=parse_faults("lie,crash")), Policy.TRUSTING),
        (Config(1, 2, 1, faults=parse_faults("lie,fence")), Policy.PROOF),
        (Config(1, 2, 1, faults=parse_faults("timeout"), access=Access.READ), Policy.PROOF),
        (Config(1, 2, 1, faults=frozenset(), access=Access.READ), Policy.SGLANG_0_5_23),
        (Config(1, 2, 2, faults=parse_faults("crash,fail"), blocks_per_request=2), Policy.PROOF),
    ],
    ids=lambda v: v.value if isinstance(v, Policy) else None,
)
def test_refutation_shapes_reach_the_same_states(config: Config, policy: Policy) -> None:
    assert_equal(config, policy)


@pytest.mark.parametrize("policy", [Policy.NAIVE, Policy.TIMEOUT, Policy.FIRST_FAILURE])
def test_a_wrong_policy_is_refuted_by_both_with_one_shortest_length(policy: Policy) -> None:
    config = Config(2, 2, 2, faults=parse_faults("fail,timeout"), max_faults=1)
    runs = [explore(config, policy, engine=e) for e in ENGINES]
    assert [r.violation is not None for r in runs] == [True, True]
    found = [(r.violation.invariant, len(r.trace)) for r in runs if r.violation is not None]
    assert len(found) == 2 and found[0] == found[1]
    # The packed engine's trace is the real ledger's replay: it ends in the violation.
    assert found[1][0] == "no_leak" or "VIOLATION" in " ".join(runs[1].trace[-1].notes)
    assert runs[1].engine == "packed"


def test_a_packed_ledger_that_releases_too_early_is_caught_on_the_real_ledger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A planted bug in the packed ledger (a request taken as transfer_quiesced once its peers
    stopped scheduling, transfers still in flight): the packed search finds an "isolation
    violation" that the real ledger does not confirm, and the search raises instead of
    reporting it. Planted in the table the packed ledger steps (``_CHAIN``, a module global it
    looks up at each step, compiled or not: a function of the accelerator's group is called
    directly, and replacing one in the module would change nothing there)."""
    quiesced = RequestState.TRANSFER_QUIESCED.value
    stopped = REQUEST_GUARDS["all_scheduling_stopped"]
    planted = {
        state: tuple((stopped if target == quiesced else guard, target) for guard, target in rows)
        for state, rows in packed_module._CHAIN.items()
    }
    assert planted != packed_module._CHAIN
    monkeypatch.setattr(packed_module, "_CHAIN", planted)
    config = Config(1, 1, 1, faults=frozenset(), transfers_per_grant=1)
    with pytest.raises(SpecDisagreement, match="replayed on the real ledger"):
        explore(config, Policy.PROOF, engine="packed")
    assert explore(config, Policy.PROOF, engine="ledger").violation is None


def test_configurations_the_packed_ledger_does_not_model_are_refused() -> None:
    for config in (Config(1, 1, 1, restarts=1), Config(1, 1, 1, share=True)):
        with pytest.raises(ValueError, match="packed engine does not model"):
            explore(config, Policy.PROOF, engine="packed")
    with pytest.raises(ValueError, match="unknown engine"):
        explore(Config(1, 1, 1), Policy.PROOF, engine="spin")


@pytest.mark.parametrize(
    ("config", "policy"),
    [
        (Config(2, 2, 1, faults=parse_faults("all"), max_faults=1), Policy.PROOF),
        (Config(2, 2, 1, faults=parse_faults("all"), max_faults=1), Policy.TIMEOUT),
        (Config(2, 2, 2, faults=parse_faults("fail,timeout"), max_faults=1), Policy.NAIVE),
        (Config(1, 2, 1, faults=parse_faults("lie,crash")), Policy.TRUSTING),
        (Config(2, 1, 2, faults=frozenset()), Policy.ORDERED_REAPER),
    ],
    ids=lambda v: v.value if isinstance(v, Policy) else None,
)
def test_two_processes_reach_what_one_reaches(config: Config, policy: Policy) -> None:
    """The parallel frontier (two worker processes) against the serial search, same engine:
    the same verdict and shortest length; for a pass, the same states, key for key."""
    one: set[Any] = set()
    two: set[Any] = set()
    serial = explore(config, policy, engine="packed", reached=one)
    parallel = explore(config, policy, engine="packed", processes=2, reached=two)
    assert parallel.processes == 2
    assert (parallel.violation is None) == (serial.violation is None)
    if serial.violation is not None:
        assert parallel.violation is not None
        assert parallel.violation.invariant == serial.violation.invariant
        assert len(parallel.trace) == len(serial.trace)
    else:
        assert parallel.complete and serial.complete
        assert parallel.states == serial.states == len(two)
        assert two == one
        assert parallel.max_depth == serial.max_depth


def test_the_parallel_frontier_needs_the_packed_engine() -> None:
    with pytest.raises(ValueError, match="needs engine='packed'"):
        explore(Config(1, 1, 1), Policy.PROOF, processes=2)
