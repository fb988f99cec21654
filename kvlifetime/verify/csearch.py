"""The compiled checker's search engine, driven from Python (issue 34: its second part).

``csearch.c`` (beside this module) is a breadth-first search over fixed-width packed states:
the visited set is the queue (one arena, in the order states are found), each state keeps its
parent and the event that reached it, and an open-addressing table of arena indices finds a
state by its bytes. A model is C text that defines the state's width and its initial state,
successors (each already in canonical form) and invariants (the contract is at the top of
``csearch.c``); ``source(model)`` appends the engine to it, ``cbuild.build`` compiles it once
into the cache, and ``run`` / ``trace`` / ``states`` read the outcome back.

A stored state costs its width plus 16 bytes (8 in the arena for its parent and event, 8 in
the table, at most half full), counted exactly in ``CSearchResult.bytes``. The search stops at
the first state that breaks an invariant (breadth first: a shortest trace), at ``max_states``,
or before a growth would pass the memory budget.

What is not here yet: the model of ``kvlifetime verify`` itself in C (the environment, the
policies, the lies, the canonical form under the symmetry reduction). ``tests/test_csearch.py``
drives the engine with a small model of its own against a Python breadth-first search.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Iterator
from importlib import resources
from typing import Any

import attrs


class Verdict(enum.IntEnum):
    """How a compiled search ended (``kvl_search``'s return value)."""

    PASS = 0  # every reachable state stored; none broke an invariant
    VIOLATION = 1  # a state broke an invariant: the first found, on a shortest trace
    MAX_STATES = 2  # stopped at max_states: incomplete
    MEMORY = 3  # stopped before passing the memory budget: incomplete


@attrs.frozen(slots=True)
class CSearchResult:
    verdict: Verdict
    states: int  # stored (each once)
    transitions: int  # successors generated
    depth: int  # levels completed (a violation: the level it was found at)
    code: int  # the invariant broken (0: none)
    bad: int  # the breaking state's index (a violation)
    bytes: int  # the arena and the table, as allocated
    width: int  # bytes of one packed state
    bad_event: int  # the event from state ``bad`` that broke the invariant (-1: ``bad`` did)
    compact: bool = False  # hash compaction: hashes stored, not states (approximate)

    @property
    def bytes_per_state(self) -> float:
        """Memory per stored state, as allocated (the arena grows by doubling)."""
        return self.bytes / max(1, self.states)


def engine_source() -> str:
    """The engine's C text (``csearch.c``)."""
    return resources.files("kvlifetime.verify").joinpath("csearch.c").read_text()


def source(model: str) -> str:
    """A whole checker: the model's C text, then the engine."""
    return model.rstrip() + "\n\n" + engine_source()


def _bind(lib: Any) -> None:
    lib.kvl_search.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]
    lib.kvl_search.restype = ctypes.c_int
    lib.kvl_search_compact.argtypes = lib.kvl_search.argtypes
    lib.kvl_search_compact.restype = ctypes.c_int
    lib.kvl_replay.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_int]
    lib.kvl_replay.restype = ctypes.c_int
    lib.kvl_trace.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int]
    lib.kvl_trace.restype = ctypes.c_int
    lib.kvl_state.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.kvl_state.restype = ctypes.c_int


def run(
    lib: Any, *, max_states: int = 0, memory_budget: int = 0, compact: bool = False
) -> CSearchResult:
    """Search the compiled checker ``lib`` (``cbuild.build(source(model)).library``).
    ``max_states`` / ``memory_budget`` (bytes): 0 for none. ``compact``: hash compaction, a
    64-bit hash of each state stored instead of the state (approximate: a collision merges
    two states; never a pass), whole states only for the frontier."""
    _bind(lib)
    out = (ctypes.c_uint64 * 7)()
    search = lib.kvl_search_compact if compact else lib.kvl_search
    verdict = Verdict(search(max_states, memory_budget, out))
    bad_event = ctypes.c_int64(out[6]).value
    return CSearchResult(
        verdict,
        out[0],
        out[1],
        out[2],
        out[3],
        out[4],
        out[5],
        int(lib.kvl_width()),
        bad_event,
        compact,
    )


def counterexample(lib: Any, result: CSearchResult) -> list[int]:
    """The events of a violation's shortest trace, from the root (the last search's)."""
    if result.verdict is not Verdict.VIOLATION:
        raise ValueError(f"no violation: {result.verdict.name}")
    events = trace(lib, result.bad)
    return [*events, result.bad_event] if result.bad_event >= 0 else events


def trace(lib: Any, index: int, *, limit: int = 100_000) -> list[int]:
    """The events from the root to stored state ``index``, in order (the last search's)."""
    buf = (ctypes.c_uint32 * limit)()
    n = lib.kvl_trace(index, buf, limit)
    return list(buf[:n])


def path(lib: Any, index: int, *, limit: int = 100_000) -> list[int]:
    """The stored states from the root to state ``index`` (their indices, root first)."""
    lib.kvl_path.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int]
    buf = (ctypes.c_uint32 * limit)()
    n = lib.kvl_path(index, buf, limit)
    if n < 0:
        raise ValueError(f"a trace longer than {limit}")
    return list(buf[:n])


def path_states(lib: Any, result: CSearchResult, index: int) -> list[bytes]:
    """The states from the root to stored state ``index``: read back (an exact search), or
    rebuilt by replaying the trace's events in the model (a hash-compacted one)."""
    width = int(lib.kvl_width())
    if not result.compact:
        return [state(lib, i) for i in path(lib, index)]
    limit = 4097
    buf = ctypes.create_string_buffer(width * limit)
    n = lib.kvl_replay(index, buf, limit)
    if n < 0:
        raise ValueError(f"the trace to state {index} does not replay in the model")
    return [buf.raw[k * width : (k + 1) * width] for k in range(n)]


def state(lib: Any, index: int) -> bytes:
    """Stored state ``index``'s bytes (the last search's)."""
    width = int(lib.kvl_width())
    buf = ctypes.create_string_buffer(width)
    if lib.kvl_state(index, buf) != width:
        raise IndexError(index)
    return buf.raw


def states(lib: Any, result: CSearchResult) -> Iterator[bytes]:
    """Every stored state's bytes, in the order found (the last search's)."""
    for i in range(result.states):
        yield state(lib, i)


__all__ = [
    "CSearchResult",
    "Verdict",
    "counterexample",
    "engine_source",
    "path",
    "path_states",
    "run",
    "source",
    "state",
    "states",
    "trace",
]
