"""The compiled checker's model (``cenv``: the specification and the environment as C, searched
by ``csearch.c``) against ``kvlifetime verify``'s own model, state by state.

- **Canonical** (the compiled checker's default): every state the Python model reaches with
  ``kvlifetime verify``'s canonical key (``keys.canonical_key``, no partial-order reduction)
  is encoded as a C state and put in the C canonical form (``kvl_canon``); the C search must
  reach exactly that set, one C state per Python key (state-set equality, not counts). Under a
  policy that breaks an invariant, the levels the C search completed before it stopped.
- **Unreduced**: both searched without reductions (every interleaving, one concrete state each)
  and projected the way ``tests/test_promela.py`` projects SPIN's states: the same set.

And the same verdicts, with counterexamples as long as the Python search's shortest.
"""

from __future__ import annotations

import collections
import ctypes
import json
from collections.abc import Iterator
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
from kvlifetime.verify.events import enabled
from kvlifetime.verify.keys import canonical_key
from kvlifetime.verify.lies import lie_events
from kvlifetime.verify.projection import of_vector
from kvlifetime.verify.semantics import step
from kvlifetime.verify.state import Broken, State, initial


@pytest.fixture(autouse=True, scope="module")
def _own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # One cache for the module (never the user's): a checker built for one test is reused by
    # the next that asks for the same source, compiler and flags, as it would be in use.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLIFETIME_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def _search(
    config: Config, policy: Policy, *, reduce: bool = True, por: bool = False
) -> tuple[Any, csearch.CSearchResult]:
    lib = cbuild.build(cenv.checker(config, policy, reduce=reduce, por=por), name="cenv").library
    return lib, csearch.run(lib)


def _quiet(lib: Any, res: csearch.CSearchResult) -> set[bytes]:
    """The stored states in which no event is enabled."""
    lib.kvl_enabled.argtypes = [ctypes.c_char_p]
    return {s for s in csearch.states(lib, res) if lib.kvl_enabled(s) == 0}


POR_SHAPES = [
    Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1),
    Config(2, 1, 2, faults=parse_faults("loss,crash,fence")),
    Config(2, 2, 1, faults=parse_faults("loss"), max_faults=1),
    Config(3, 1, 2, faults=parse_faults("loss,crash"), max_faults=1),
    Config(1, 2, 1, faults=parse_faults("crash,fence,timeout")),
]


@pytest.mark.parametrize(
    "config", POR_SHAPES, ids=["1x2x1-all-k1", "2x1x2", "2x2x1", "3x1x2", "1x2x1"]
)
@pytest.mark.parametrize(
    "policy",
    [
        Policy.PROOF,
        Policy.TIMEOUT,
        Policy.NAIVE,
        Policy.TRUSTING,
        Policy.FIRST_FAILURE,
        Policy.COUNTED_COMPLETIONS,
        Policy.SGLANG_0_5_23,
    ],
)
def test_the_partial_order_reduction_keeps_every_quiet_state_and_every_verdict(
    config: Config, policy: Policy
) -> None:
    # What stubborn sets must preserve (explore.py): every reachable deadlock. Without it and
    # with it, the canonical search reaches the same quiet states, the same verdict, a
    # counterexample as short.
    full_lib, full = _search(config, policy)
    lib, res = _search(config, policy, por=True)
    assert res.verdict is full.verdict
    if full.verdict is Verdict.VIOLATION:
        assert res.code == full.code
        assert len(csearch.counterexample(lib, res)) == len(csearch.counterexample(full_lib, full))
        _, got = cenv.python_events(config, policy, lib, res, por=True)
        assert got.invariant == cenv.INVARIANTS[full.code]
    else:
        assert _quiet(lib, res) == _quiet(full_lib, full)


def test_a_planted_break_in_the_partial_order_reduction_is_caught() -> None:
    # Condition (a), strict (timeout policy): a request is isolated only when no peer it may
    # use can still be lost or fenced. Dropped, the reduced search misses the violation.
    config, policy = Config(2, 1, 2, faults=parse_faults("loss,crash,fence")), Policy.TIMEOUT
    _, full = _search(config, policy)
    text = cenv.checker(config, policy, por=True).replace(
        "    if ((s->phase[r] == LIVE || granted(s, r * P + p)) && peer_may_act(s, p)) return 0;",
        "",
    )
    lib = cbuild.build(text, name="cenv-planted-por").library
    assert csearch.run(lib).verdict is not full.verdict


def _python_classes(config: Config, policy: Policy) -> dict[Any, tuple[State, int]]:
    """Every canonical key the Python model reaches, breadth first with no partial-order
    reduction (any peer may crash), with a state of it and its depth; a step that breaks an
    invariant is not followed (as neither search stores it)."""
    root = initial(config, checked=False)
    seen = {canonical_key(root, config): (root, 0)}
    queue = collections.deque([(root, 0)])
    while queue:
        s, d = queue.popleft()
        for ev in [*enabled(s, config), *lie_events(s, config, policy)]:
            try:
                nxt = step(s, ev, config, policy)[0]
            except Broken:
                continue
            k = canonical_key(nxt, config)
            if k not in seen:
                seen[k] = (nxt, d + 1)
                queue.append((nxt, d + 1))
    return seen


CANONICAL = [
    (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.PROOF),
    (Config(2, 1, 2, faults=parse_faults("loss,crash,fence")), Policy.PROOF),
    (Config(2, 2, 1, faults=parse_faults("loss"), max_faults=1), Policy.PROOF),
    (Config(3, 1, 2, faults=parse_faults("loss,crash"), max_faults=1), Policy.PROOF),
    (Config(1, 3, 1, faults=parse_faults("crash")), Policy.PROOF),
    (Config(1, 1, 1, faults=parse_faults(ALL)), Policy.PROOF),
    (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.TIMEOUT),
    (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.TRUSTING),
    (Config(2, 1, 2, faults=parse_faults("loss,crash")), Policy.NAIVE),
    (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.FIRST_FAILURE),
    (Config(2, 1, 2, faults=parse_faults("fail,loss")), Policy.FIRST_FAILURE),
    (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.COUNTED_COMPLETIONS),
    (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.SGLANG_0_5_23),
    (Config(2, 1, 2, faults=parse_faults("loss,crash,fence")), Policy.SGLANG_0_5_23),
]


@pytest.mark.parametrize(
    ("config", "policy"),
    CANONICAL,
    ids=[
        "1x2x1-all-k1",
        "2x1x2-crash",
        "2x2x1-loss-k1",
        "3x1x2-loss-k1",
        "1x3x1-crash",
        "1x1x1-all",
        "timeout",
        "trusting",
        "naive-2x1x2",
        "first-failure",
        "first-failure-2x1x2",
        "counted-completions",
        "sglang",
        "sglang-2x1x2",
    ],
)
def test_the_compiled_checker_reaches_exactly_the_python_models_canonical_states(
    config: Config, policy: Policy
) -> None:
    ours = _python_classes(config, policy)
    lib, res = _search(config, policy)
    theirs = set(csearch.states(lib, res))
    depth = None
    if res.verdict is Verdict.VIOLATION:
        # It stops at the shortest violation: the levels it completed (to the violation's).
        depth = res.depth
        found = enumerate(csearch.states(lib, res))
        theirs = {s for i, s in found if len(csearch.path(lib, i)) - 1 <= depth}
    else:
        assert res.verdict is Verdict.PASS
        # Python's own engine (packed, no partial-order reduction) counts the same keys.
        assert explore(config, policy, por=False, engine="packed").states == len(ours)
    mapped: dict[bytes, Any] = {}
    for key, (s, d) in ours.items():
        if depth is not None and d > depth:
            continue
        c = cenv.canonical(lib, cenv.encode(s, config))
        assert c not in mapped, "two Python keys, one C canonical state"
        mapped[c] = key
    assert len(mapped) > 20
    assert theirs - set(mapped) == set()
    assert set(mapped) - theirs == set()


def test_a_planted_break_in_the_canonical_form_is_caught() -> None:
    # The canonical form that forgets a closed grant's proof forgets too much if it also
    # forgets an open one's: the two sets differ (the test above would fail).
    config, policy = CANONICAL[0]
    text = cenv.checker(config, policy).replace(
        "} else if (s->phase[REQ(g)] != RELEASED && pf_closed(s->pf[g])) {",
        "} else if (s->phase[REQ(g)] != RELEASED) {",
    )
    lib = cbuild.build(text, name="cenv-planted").library
    planted = set(csearch.states(lib, csearch.run(lib)))
    right, _ = _search(config, policy)
    assert planted != set(csearch.states(right, csearch.run(right)))


def _c_states(config: Config, policy: Policy) -> set[Any]:
    lib, res = _search(config, policy, reduce=False)
    assert res.verdict is Verdict.PASS, res
    return {
        of_vector(cenv.decode(cenv.unpack(lib, s), config), config)
        for s in csearch.states(lib, res)
    }


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
        (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.FIRST_FAILURE),
        (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.COUNTED_COMPLETIONS),
        (Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1), Policy.SGLANG_0_5_23),
    ],
    ids=["naive", "timeout", "trusting", "first-failure", "counted-completions", "sglang"],
)
@pytest.mark.parametrize(
    ("reduce", "por"),
    [(True, True), (True, False), (False, False)],
    ids=["por", "canonical", "unreduced"],
)
def test_the_compiled_model_refutes_as_the_python_model_does(
    config: Config, policy: Policy, reduce: bool, por: bool
) -> None:
    ours = explore(config, policy)
    assert ours.violation is not None
    lib, res = _search(config, policy, reduce=reduce, por=por)
    assert res.verdict is Verdict.VIOLATION
    assert cenv.INVARIANTS[res.code] == ours.violation.invariant
    assert len(csearch.counterexample(lib, res)) == len(ours.trace)
    # Mapped back onto the Python model's events and replayed on the real BlockLedger: the
    # same invariant breaks, in as many steps.
    events, got = cenv.python_events(config, policy, lib, res, reduce=reduce, por=por)
    assert got.invariant == ours.violation.invariant and len(events) == len(ours.trace)


def test_the_command_answers_with_the_compiled_engine_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--requests", "1", "--peers", "2", "--blocks", "1", "--max-faults", "1"]
    assert main(["verify", *shape, "--engine", "compiled", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "engine compiled" in out and "reduction on" in out
    # A pass names only what the compiled model checks.
    assert "keeps isolation, exclusivity, no_leak\n" in out
    assert "engine: compiled C checker" in out
    assert main(["verify", *shape, "--engine", "compiled", "--policy", "timeout"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION of isolation" in out and "lease reaper (timeout policy) releases" in out
    doc = json.loads(_json(capsys, ["verify", *shape, "--engine", "compiled", "--format", "json"]))
    assert doc["engine"] == "compiled" and doc["checks"] == list(compiled.CHECKS)
    assert doc["states"] == 2324 and "engine_note" in doc  # canonical, reduced
    argv = ["verify", *shape, "--engine", "compiled", "--no-reduction", "--format", "json"]
    doc = json.loads(_json(capsys, argv))
    assert doc["states"] == 20970 and doc["reduction"] is False  # every concrete state


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_where_it_cannot_answer_another_engine_does_and_the_output_says_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = ["--requests", "1", "--peers", "1", "--blocks", "1", "--faults", "fail"]
    # A policy it does not model: the packed engine answers, with the reason.
    assert main(["verify", *shape, "--engine", "compiled", "--policy", "ordered-reaper"]) == 0
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
    assert r.states == 2324 and 0 < r.omission_bound < 1e-9  # no collision at this size
    # 16 bytes a state and the frontier, against a whole state and its 16 bytes.
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
