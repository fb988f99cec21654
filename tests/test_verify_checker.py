"""``kvlifetime verify`` as a program: bounded memory, progress, Ctrl-C, exit statuses, refusals.

The search reports progress through a callback and writes nothing itself; a ``KeyboardInterrupt``
inside it ends it with the partial result; the command line maps each verdict to its own exit
status (0 pass, 1 violation, 2 usage, 3 incomplete, 130 interrupted).
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import time
from typing import Any

import attrs
import pytest

from kvlifetime.cli import main
from kvlifetime.verify import Config, Policy, explore, parse_faults
from kvlifetime.verify.explore import Progress, Result, canonical_key, renamings
from kvlifetime.verify.model import LIMITS, enabled, initial, step

SMALL = Config(2, 2, 1, faults=parse_faults("loss,crash"))


def test_progress_is_reported_through_the_callback_with_states_depth_rate_and_queue() -> None:
    seen: list[Progress] = []
    r = explore(SMALL, Policy.PROOF, progress=seen.append, progress_every=0.0)
    assert r.verdict == "pass" and len(seen) >= 2
    # Monotone, and the last report is the end of the search (nothing left in the queue).
    assert [p.states for p in seen] == sorted(p.states for p in seen)
    assert seen[-1].states == r.states and seen[-1].queue == 0
    assert all(p.depth <= r.max_depth and p.states_per_second > 0 for p in seen)


def test_ctrl_c_returns_the_partial_result_marked_interrupted() -> None:
    calls = 0

    def interrupt(p: Progress) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt

    full = explore(SMALL, Policy.PROOF)
    r = explore(SMALL, Policy.PROOF, progress=interrupt, progress_every=0.0)
    assert r.interrupted and not r.complete and r.verdict == "interrupted"
    assert 0 < r.states < full.states and r.queue > 0
    assert "INTERRUPTED" in r.to_text() and "not a pass" in r.to_text()
    assert json.loads(json.dumps(r.to_dict()))["interrupted"] is True


def test_cli_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--requests", "2", "--peers", "2", "--blocks", "1", "--faults", "loss"]
    assert main(["verify", *shape]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert main(["verify", *shape, "--policy", "naive"]) == 1
    assert "VIOLATION" in capsys.readouterr().out
    assert main(["verify", *shape, "--max-states", "50"]) == 3
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "PASS" not in out
    assert main(["verify", "--requests", "0"]) == 2
    assert main(["verify", "--blocks", "100000"]) == 2
    assert "at most 4096" in capsys.readouterr().err


def test_cli_ctrl_c_prints_the_partial_result_and_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = importlib.import_module("kvlifetime.verify.search")  # the search loop's namespace
    real = ex.check_quiet

    def ctrl_c(state: object) -> None:
        raise KeyboardInterrupt  # at the first quiet state, in the middle of the search

    monkeypatch.setattr(ex, "check_quiet", ctrl_c)
    status = main(
        ["verify", "--requests", "2", "--peers", "1", "--blocks", "1", "--faults", "none"]
    )
    monkeypatch.setattr(ex, "check_quiet", real)
    assert status == 130
    assert "verdict: INTERRUPTED" in capsys.readouterr().out


def test_cli_help_documents_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--help"]) == 0
    text = capsys.readouterr().out
    for code in ("0", "1", "2", "3", "130"):
        assert any(line.split()[:1] == [code] for line in text.splitlines()), code


def test_shapes_past_the_limits_are_refused_before_the_search() -> None:
    for name, (most, _why) in LIMITS.items():
        with pytest.raises(ValueError, match=f"{name}={most + 1} is more than"):
            kw: dict[str, Any] = {name: most + 1}
            attrs.evolve(Config(), **kw)


def test_many_peers_never_build_every_permutation() -> None:
    # 12 peers: 479,001,600 permutations. The search stores 100 states quickly, within the
    # renaming cap per key, in a test that would not finish (or not fit) if it built them all.
    t0 = time.perf_counter()
    r = explore(Config(2, 12, 2, faults=frozenset()), Policy.PROOF, max_states=100)
    assert r.verdict == "incomplete" and r.states == 100
    assert time.perf_counter() - t0 < 30  # a bound on a hang, not a speed target
    # The generator itself is lazy: asking for the first renamings of 20 alike, used peers
    # costs only those (20! would never fit).
    first = list(itertools.islice(renamings([0] * 20, [True] * 20, cap=10**18), 3))
    assert len(first) == 3 and sorted(first[0]) == list(range(20))
    assert len(list(renamings([0] * 20, [True] * 20, cap=50))) == 50
    # Alike peers that no grant or message names keep one order: one renaming.
    assert len(list(renamings([0] * 20, [False] * 20))) == 1


def test_renamings_give_the_same_key_as_every_permutation_on_small_states() -> None:
    # The lazy renamings (peers sorted by signature, alike ones permuted) give the least key
    # over all permutations: compare with the brute-force minimum on states of 3 peers.
    cfg = Config(2, 3, 2, faults=parse_faults("loss,crash"))
    frontier = [initial(cfg, crash_first=False)]
    checked = 0
    for _ in range(5):
        nxt = []
        for s in frontier:
            for ev in enabled(s, cfg):
                nxt.append(step(s, ev, cfg, Policy.PROOF)[0])
        frontier = nxt[:60]
        for s in frontier:
            assert canonical_key(s, cfg) == _brute_force_key(s, cfg)
            checked += 1
    assert checked > 100


def _brute_force_key(state: object, cfg: Config) -> object:
    from kvlifetime.verify.model import State

    assert isinstance(state, State)
    best = None
    for perm in itertools.permutations(range(cfg.peers)):
        env = state.env
        grants = tuple(attrs.evolve(g, peer=perm[g.peer]) for g in env.grants)
        msgs = tuple(attrs.evolve(m, peer=perm[m.peer]) for m in env.msgs)
        inv = [0] * cfg.peers
        for old, new in enumerate(perm):
            inv[new] = old
        peers = tuple(env.peers[o] for o in inv)
        renamed = State(state.snap, attrs.evolve(env, grants=grants, msgs=msgs, peers=peers))
        k = canonical_key(renamed, cfg)
        best = k if best is None or k < best else best
    return best


def test_hash_compaction_is_never_a_pass_and_finds_what_the_exact_search_finds() -> None:
    exact = explore(SMALL, Policy.PROOF)
    approx = explore(SMALL, Policy.PROOF, compact=True)
    assert exact.verdict == "pass"
    assert approx.verdict == "incomplete" and not approx.complete
    assert approx.states == exact.states  # no collision at this size
    assert 0 < approx.omission_bound < 1e-9 and math.isfinite(approx.omission_bound)
    text = approx.to_text()
    assert "PASS" not in text and "approximate" in text
    refuted = explore(SMALL, Policy.NAIVE, compact=True)
    assert refuted.verdict == "violation"
    assert len(refuted.trace) == len(explore(SMALL, Policy.NAIVE).trace)


def test_result_defaults_keep_old_positional_construction() -> None:
    r = Result(SMALL, Policy.PROOF, True, 1, 0, 0.0, 0, True, None, ())
    assert r.verdict == "pass" and not r.interrupted and r.omission_bound == 0.0


def test_the_default_command_answers_with_progress_and_a_memory_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``kvlifetime verify`` with no arguments: a verdict on 2 x 2 x 2 with every fault kind at
    one fault per run, a start line and progress lines on stderr, and the memory it held under
    its budget. How long it takes is a bench figure (``bench/verify_depth.py --only
    cli-default``), not asserted here."""
    assert main(["verify"]) == 0
    out, err = capsys.readouterr()
    assert "2 requests x 2 peers x 2 blocks" in out and "(at most 1 per run)" in out
    assert "verdict: PASS" in out
    assert "memory:" in out and "budget" in out
    lines = err.splitlines()
    assert lines[0].startswith("verify: policy proof, 2 requests x 2 peers x 2 blocks")
    assert "memory budget" in lines[0]
    progress = [ln for ln in lines[1:] if ln.startswith("verify: ") and " states, depth " in ln]
    assert progress and progress[-1].startswith("verify: 15,985 states")  # the final count


def test_the_memory_budget_stops_the_search_with_what_it_covered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    full = explore(SMALL, Policy.PROOF)
    r = explore(SMALL, Policy.PROOF, memory_budget=1)  # less than any process holds
    assert r.out_of_memory and not r.complete and r.verdict == "incomplete"
    assert 0 < r.states < full.states and r.queue > 0 and r.memory_peak > 1
    text = r.to_text()
    assert "INCOMPLETE: stopped at the memory budget" in text and "not a pass" in text
    assert json.loads(json.dumps(r.to_dict()))["out_of_memory"] is True
    assert full.memory_peak > 0 and not full.out_of_memory and full.memory_budget is None
    shape = ["--requests", "2", "--peers", "2", "--blocks", "1", "--faults", "loss,crash"]
    assert main(["verify", *shape, "--memory-budget", "1"]) == 3  # 1 MB: stops at once
    out, err = capsys.readouterr()
    assert "stopped at the memory budget (1 MB)" in out and "memory budget 1 MB" in err
    assert main(["verify", *shape, "--memory-budget", "none", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "verdict: PASS" in out and "budget" not in out and err == ""
    assert main(["verify", *shape, "--memory-budget", "0"]) == 2  # refused: not a budget


def test_max_faults_none_means_only_the_per_kind_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--requests", "1", "--peers", "1", "--blocks", "1", "--format", "json"]
    assert main(["verify", *shape, "--max-faults", "none", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["max_faults"] is None
    assert main(["verify", *shape, "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["max_faults"] == 1
    assert main(["verify", *shape, "--max-faults", "many"]) == 2
