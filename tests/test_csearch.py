"""The compiled checker's search engine (``csearch.c``) against a Python breadth-first search,
on a small model of its own: K counters in 0..M, kept sorted (a symmetry reduction: the
counters are interchangeable), where an event raises one counter or moves a unit from one to
another, and the invariant breaks when the counters sum to TARGET.

Exact: the same set of states, the same verdict, a shortest trace that replays to a breaking
state; a budget or a state cap stops the search as incomplete, never with a wrong verdict.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvlifetime.verify import cbuild, csearch
from kvlifetime.verify.csearch import Verdict


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLIFETIME_CACHE", str(tmp_path / "cache"))


def _model(k: int, m: int, target: int) -> str:
    return f"""
#define KVL_W {k}
#define K {k}
#define M {m}
#define TARGET {target}
static void kvl_emit(void *ctx, int event, const unsigned char *next);
static void sort_(unsigned char *s) {{
  for (int i = 1; i < K; i++) {{
    unsigned char v = s[i]; int j = i - 1;
    while (j >= 0 && s[j] > v) {{ s[j + 1] = s[j]; j--; }}
    s[j + 1] = v;
  }}
}}
static void kvl_initial(unsigned char *s) {{ for (int i = 0; i < K; i++) s[i] = 0; }}
static int kvl_check(const unsigned char *s) {{
  int sum = 0; for (int i = 0; i < K; i++) sum += s[i];
  return sum == TARGET ? 7 : 0;
}}
static void kvl_successors(const unsigned char *s, void *ctx) {{
  unsigned char n[K];
  for (int i = 0; i < K; i++) {{
    if (s[i] < M) {{
      for (int x = 0; x < K; x++) n[x] = s[x];
      n[i]++; sort_(n); kvl_emit(ctx, i, n);
    }}
    for (int j = 0; j < K; j++) {{
      if (i != j && s[i] > 0 && s[j] < M) {{
        for (int x = 0; x < K; x++) n[x] = s[x];
        n[i]--; n[j]++; sort_(n); kvl_emit(ctx, K + i * K + j, n);
      }}
    }}
  }}
}}
"""


def _apply(s: tuple[int, ...], event: int, k: int, m: int) -> tuple[int, ...] | None:
    n = list(s)
    if event < k:
        if n[event] >= m:
            return None
        n[event] += 1
    else:
        i, j = divmod(event - k, k)
        if i == j or n[i] == 0 or n[j] >= m:
            return None
        n[i] -= 1
        n[j] += 1
    return tuple(sorted(n))


def _python_bfs(k: int, m: int, target: int) -> tuple[set[tuple[int, ...]], int | None]:
    """Every state reachable (stopping at the first level with a breaking state), and that
    level's depth (None: none breaks)."""
    root = (0,) * k
    seen = {root}
    level = [root]
    depth = 0
    while level:
        if any(sum(s) == target for s in level):
            return seen, depth
        nxt = []
        for s in level:
            for e in range(k + k * k):
                n = _apply(s, e, k, m)
                if n is not None and n not in seen:
                    seen.add(n)
                    nxt.append(n)
        level = nxt
        depth += 1
    return seen, None


def _lib(k: int, m: int, target: int) -> Any:
    return cbuild.build(csearch.source(_model(k, m, target)), name="toy").library


@pytest.mark.parametrize(("k", "m"), [(1, 3), (3, 2), (4, 5), (6, 3)])
def test_a_pass_reaches_exactly_the_python_searchs_states(k: int, m: int) -> None:
    lib = _lib(k, m, k * m + 1)  # an unreachable sum: every state is reached
    res = csearch.run(lib)
    want, bad = _python_bfs(k, m, k * m + 1)
    assert bad is None and res.verdict is Verdict.PASS
    got = {tuple(s) for s in csearch.states(lib, res)}
    assert got == want and res.states == len(want)
    assert res.depth == k * m + 1  # levels 0 .. k*m, each completed
    assert res.width == k and res.bytes_per_state >= k + 16


@pytest.mark.parametrize(("k", "m", "target"), [(3, 2, 4), (4, 5, 9), (2, 3, 0)])
def test_a_violation_is_found_on_a_shortest_trace_that_replays(k: int, m: int, target: int) -> None:
    lib = _lib(k, m, target)
    res = csearch.run(lib)
    _, depth = _python_bfs(k, m, target)
    assert res.verdict is Verdict.VIOLATION and res.code == 7
    events = csearch.trace(lib, res.bad)
    assert len(events) == depth == target  # each step adds at most one
    s: tuple[int, ...] | None = (0,) * k
    for e in events:
        assert s is not None
        s = _apply(s, e, k, m)
    assert s is not None and sum(s) == target
    assert tuple(csearch.state(lib, res.bad)) == s


def test_a_search_past_a_megabyte_of_states_moves_its_arena_safely() -> None:
    # 8 counters in 0..15: C(23, 8) = 490,314 states, the arena reallocated (and moved) many
    # times while a state is being expanded.
    lib = _lib(8, 15, 8 * 15 + 1)
    res = csearch.run(lib)
    assert res.verdict is Verdict.PASS and res.states == math.comb(23, 8)
    seen = set()
    for s in csearch.states(lib, res):
        assert list(s) == sorted(s) and max(s) <= 15
        seen.add(s)
    assert len(seen) == res.states


def test_a_state_cap_and_a_memory_budget_stop_it_incomplete() -> None:
    lib = _lib(6, 9, 6 * 9 + 1)  # 5,005 states
    full = csearch.run(lib)
    assert full.verdict is Verdict.PASS and full.states == 5005
    capped = csearch.run(lib, max_states=1000)
    assert capped.verdict is Verdict.MAX_STATES and capped.states == 1000
    budget = 40_000
    tight = csearch.run(lib, memory_budget=budget)
    assert tight.verdict is Verdict.MEMORY and tight.bytes <= budget
    assert 0 < tight.states < full.states
    again = csearch.run(lib)  # a search after an incomplete one starts afresh
    assert again == full


def test_memory_per_stored_state_is_its_width_plus_sixteen_bytes_at_most_doubled() -> None:
    lib = _lib(8, 6, 8 * 6 + 1)  # C(14, 8) = 3,003 states of 8 bytes
    res = csearch.run(lib)
    assert res.states == 3003
    exact = res.states * (8 + 16)
    assert exact <= res.bytes <= 2 * exact + 2 * 1024 * (8 + 8)


def test_hash_compaction_reaches_the_same_states_and_stops_where_it_must() -> None:
    lib = _lib(8, 15, 8 * 15 + 1)  # 490,314 states of 8 bytes
    exact = csearch.run(lib)
    compact = csearch.run(lib, compact=True)
    # No collision among half a million 64-bit hashes here: the same count, the same depth.
    assert compact.verdict is Verdict.PASS and compact.compact
    assert (compact.states, compact.depth) == (exact.states, exact.depth)
    capped = csearch.run(lib, compact=True, max_states=1000)
    assert capped.verdict is Verdict.MAX_STATES and capped.states == 1000
    tight = csearch.run(lib, compact=True, memory_budget=200_000)
    assert tight.verdict is Verdict.MEMORY and tight.bytes <= 200_000


def test_hash_compaction_finds_the_shortest_violation_and_rebuilds_its_states() -> None:
    k, m, target = 4, 5, 9
    lib = _lib(k, m, target)
    res = csearch.run(lib, compact=True)
    assert res.verdict is Verdict.VIOLATION and res.code == 7
    events = csearch.trace(lib, res.bad)
    assert len(events) == target
    states = csearch.path_states(lib, res, res.bad)
    assert len(states) == target + 1 and states[0] == bytes(k)
    s: tuple[int, ...] | None = (0,) * k
    for e, raw in zip(events, states[1:], strict=True):
        assert s is not None
        s = _apply(s, e, k, m)
        assert tuple(raw) == s  # each rebuilt state is the model's successor by that event
    assert s is not None and sum(s) == target
