"""The compiled checker's model (``cenv``: the specification and the environment as C, searched
by ``csearch.c``) against ``kvlifetime verify``'s own model, state by state.

Both are searched without reductions (every interleaving, one concrete state each) and
projected the way ``tests/test_promela.py`` projects SPIN's states: the same set, exactly; the
same verdicts, with counterexamples as long as the Python search's shortest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_promela import ALL, SMALLEST, _our_states

from kvlifetime.cli import main
from kvlifetime.verify import (
    Config,
    Policy,
    cbuild,
    cenv,
    compiled,
    csearch,
    explore,
    parse_faults,
)
from kvlifetime.verify.csearch import Verdict
from kvlifetime.verify.projection import of_vector


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLIFETIME_CACHE", str(tmp_path / "cache"))


def _search(config: Config, policy: Policy) -> tuple[Any, csearch.CSearchResult]:
    lib = cbuild.build(cenv.checker(config, policy), name="cenv").library
    return lib, csearch.run(lib)


def _c_states(config: Config, policy: Policy) -> set[Any]:
    lib, res = _search(config, policy)
    assert res.verdict is Verdict.PASS, res
    return {of_vector(cenv.decode(s, config), config) for s in csearch.states(lib, res)}


@pytest.mark.parametrize(
    ("config", "policy"),
    [
        (SMALLEST, Policy.PROOF),
        (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.PROOF),
        (Config(2, 1, 2, faults=parse_faults("loss,crash,fence")), Policy.PROOF),
        (Config(1, 1, 1, faults=parse_faults("duplicate,delay,reorder,retry,fail")), Policy.PROOF),
    ],
    ids=["1x1x1-all", "1x2x1-all-k1", "2x1x2-crash", "1x1x1-wire"],
)
def test_the_compiled_model_reaches_exactly_the_python_models_states(
    config: Config, policy: Policy
) -> None:
    ours = _our_states(config, policy)
    theirs = _c_states(config, policy)
    assert len(ours) > 50
    assert theirs - ours == set()
    assert ours - theirs == set()


@pytest.mark.parametrize(
    ("config", "policy"),
    [
        (Config(1, 1, 1, faults=parse_faults("loss")), Policy.NAIVE),
        (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.TIMEOUT),
        (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.TRUSTING),
    ],
    ids=["naive", "timeout", "trusting"],
)
def test_the_compiled_model_refutes_as_the_python_model_does(
    config: Config, policy: Policy
) -> None:
    ours = explore(config, policy)
    assert ours.violation is not None
    lib, res = _search(config, policy)
    assert res.verdict is Verdict.VIOLATION
    assert cenv.INVARIANTS[res.code] == ours.violation.invariant
    assert len(csearch.counterexample(lib, res)) == len(ours.trace)
    # Mapped back onto the Python model's events and replayed on the real BlockLedger: the
    # same invariant breaks, in as many steps.
    events, got = cenv.python_events(config, policy, lib, res)
    assert got.invariant == ours.violation.invariant and len(events) == len(ours.trace)


def test_the_command_answers_with_the_compiled_engine_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--requests", "1", "--peers", "2", "--blocks", "1", "--max-faults", "1"]
    assert main(["verify", *shape, "--engine", "compiled", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "engine compiled" in out and "reduction off" in out
    # A pass names only what the compiled model checks.
    assert "keeps isolation, exclusivity, no_leak\n" in out
    assert "engine: compiled C checker" in out
    assert main(["verify", *shape, "--engine", "compiled", "--policy", "timeout"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION of isolation" in out and "lease reaper (timeout policy) releases" in out
    doc = json.loads(_json(capsys, ["verify", *shape, "--engine", "compiled", "--format", "json"]))
    assert doc["engine"] == "compiled" and doc["checks"] == list(compiled.CHECKS)
    assert doc["states"] == 20970 and "engine_note" in doc


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_where_it_cannot_answer_another_engine_does_and_the_output_says_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = ["--requests", "1", "--peers", "1", "--blocks", "1", "--faults", "fail"]
    # A policy it does not model: the packed engine answers, with the reason.
    assert main(["verify", *shape, "--engine", "compiled", "--policy", "first-failure"]) == 1
    out = capsys.readouterr().out
    assert "engine packed" in out
    assert "compiled engine not used: the compiled checker does not model this" in out
    # No C compiler here: the same.
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert main(["verify", *shape, "--engine", "compiled", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "engine packed" in out and "compiled engine not used: $CC=" in out
    # Options it does not take are refused.
    monkeypatch.delenv("CC")
    assert main(["verify", *shape, "--engine", "compiled", "--processes", "2"]) == 2


def test_a_hash_compacted_compiled_search_is_approximate_and_its_trace_replays(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1)
    r = compiled.run(config, Policy.PROOF, compact=True)
    assert r.compact and not r.complete and r.verdict != "pass"
    assert r.states == 20970 and 0 < r.omission_bound < 1e-9  # no collision at this size
    # 16 bytes a state and the frontier, against 42 + 16 for a whole state.
    lib = cbuild.build(cenv.checker(config, Policy.PROOF), name="cenv").library
    exact, hashed = csearch.run(lib), csearch.run(lib, compact=True)
    assert hashed.states == exact.states and hashed.bytes < exact.bytes
    refuted = compiled.run(config, Policy.TIMEOUT, compact=True)
    assert refuted.violation is not None and refuted.violation.invariant == "isolation"
    assert len(refuted.trace) == len(explore(config, Policy.TIMEOUT).trace)
    shape = ["--requests", "1", "--peers", "2", "--blocks", "1", "--max-faults", "1"]
    argv = ["verify", *shape, "--engine", "compiled", "--hash-compaction", "--no-progress"]
    assert main(argv) == 3  # incomplete: never a pass
    assert "INCOMPLETE (approximate)" in capsys.readouterr().out
