"""The exhaustive search as a program: breadth first, in one process or on several.

``explore.explore`` is the entry point, and ``explore.py`` argues why the graph walked here (its
states keyed by ``keys``, each expanded by ``successors`` to a stubborn set) is enough. This
module walks it:

- **breadth first**, so the first violation found is a shortest one (fewest events) in that
  graph: once one is found, only the quiet states of the level being expanded, which could give
  a shorter one, are still looked at;
- each state is stored once, under its key, with a link to its parent and the event taken from
  it (``parents``); a counterexample is rebuilt from the links, replayed on the real ledger
  when another engine found it (``packed.confirm_on_ledger``) and described step by step
  (``readable_steps``);
- ``serial_search`` in this process; ``parallel_search`` on worker processes (``parallel``:
  a level-synchronous frontier), with the same states, verdict and shortest length.

**The search as a program.** It reports through its ``progress`` callback about every
``progress_every`` seconds and writes nothing itself. With a ``memory_budget`` it reads the
process's resident memory every 64 expansions and stops at the budget: every state of the
levels before the one it was expanding has been expanded (breadth first), so it reports how
deep it covered, never a pass. A ``KeyboardInterrupt`` inside the search
ends it with the partial result (``Result.interrupted``): every stored state was complete when
it came (a step works on copies; a link is stored before its state is queued).

It promises a pass only when every reachable state of the graph was expanded: never when the
search was interrupted, stopped at ``max_states`` or at its memory budget, or compacted.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvlifetime.verify.events import enabled
from kvlifetime.verify.keys import canonical_key, concrete_key
from kvlifetime.verify.lies import lie_events
from kvlifetime.verify.memory import resident_bytes
from kvlifetime.verify.packed import confirm_on_ledger, engine_root
from kvlifetime.verify.parallel import Pool, run_levels
from kvlifetime.verify.result import Result, Step
from kvlifetime.verify.semantics import check_quiet, describe_event, step
from kvlifetime.verify.state import (
    Broken,
    Config,
    Event,
    Policy,
    State,
    Violation,
    initial,
)
from kvlifetime.verify.successors import expansion

__all__ = ["Progress", "parallel_search", "readable_steps", "serial_search"]


@attrs.frozen(slots=True)
class Progress:
    """Where a running search is, as it reports it to its ``progress`` callback."""

    states: int  # distinct states stored so far
    transitions: int
    depth: int  # the BFS level being expanded
    queue: int  # states stored and not yet expanded
    seconds: float
    memory: int = 0  # the process's resident memory, bytes (``memory.resident_bytes``)

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float(self.states)


def serial_search(
    config: Config,
    policy: Policy,
    *,
    reduce: bool,
    por: bool,
    max_states: int | None,
    checked: bool,
    progress: Callable[[Progress], None] | None,
    progress_every: float,
    quiet: set[Any] | None,
    compact: bool,
    memory_budget: int | None,
    engine: str,
    reached: set[Any] | None,
) -> Result:
    """The search in this process (``explore.explore`` says what each argument does)."""
    t0 = time.perf_counter()
    base_key = canonical_key if reduce else concrete_key
    keyf: Callable[[State, Config], Any] = (
        (lambda s, c: hash(base_key(s, c))) if compact else base_key
    )
    root = engine_root(config, engine, checked=checked, crash_first=por)
    rkey = keyf(root, config)
    # key -> (parent key, event taken from the parent's stored state); the root maps to None.
    parents: dict[Any, tuple[Any, Event] | None] = {rkey: None}
    queue: collections.deque[tuple[State, Any, int]] = collections.deque([(root, rkey, 0)])
    transitions = 0
    max_depth = 0
    depth = 0
    answers: dict[Any, tuple[int, ...]] = {}  # the ledger's answers to lies (model.lie_events)
    found: tuple[Violation, Any, Event | None, list[str], int] | None = None
    interrupted = False
    capped = False  # stopped at max_states
    expanded = 0
    last_report = t0
    memory = resident_bytes()
    peak = memory
    out_of_memory = False

    def report() -> None:
        if progress is not None:
            now = time.perf_counter()
            progress(Progress(len(parents), transitions, depth, len(queue), now - t0, memory))

    try:
        while queue:
            state, key, depth = queue.popleft()
            if found is not None and depth >= found[4]:
                break  # every shorter counterexample has been looked for
            max_depth = max(max_depth, depth)
            expanded += 1
            if expanded % 64 == 1:
                memory = resident_bytes()
                peak = max(peak, memory)
                if memory_budget is not None and memory >= memory_budget:
                    out_of_memory = True
                    queue.appendleft((state, key, depth))  # not expanded: still to do
                    break
                if progress is not None:
                    now = time.perf_counter()
                    if now - last_report >= progress_every:
                        last_report = now
                        report()
            if found is not None:
                # Only quiet states of this depth can still give a shorter one.
                events = enabled(state, config) + lie_events(state, config, policy, answers)
                succ = None
            else:
                events, succ = expansion(state, config, policy, por, answers)
            if not events:
                if quiet is not None:
                    quiet.add(key)
                v = check_quiet(state)
                if v is not None:
                    found = (v, key, None, [], depth)
                    break
                continue
            if succ is None:
                continue
            for ev in events:
                transitions += 1
                nxt = succ.after(ev)
                if nxt is None:
                    b = succ.broken(ev)
                    found = (b.violation, key, ev, b.notes, depth + 1)
                    break
                nkey = keyf(nxt, config)
                if nkey in parents:
                    continue
                parents[nkey] = (key, ev)
                queue.append((nxt, nkey, depth + 1))
                if max_states is not None and len(parents) >= max_states:
                    capped = True
                    break
            if capped:
                break
    except KeyboardInterrupt:
        # Every stored state and link was complete when the interrupt came (a step works on
        # copies, and a link is stored before its state is queued): the partial result holds.
        interrupted = True
    try:
        report()
    except KeyboardInterrupt:  # a second Ctrl-C (or a callback that stops the search) here
        interrupted = True
    seconds = time.perf_counter() - t0
    if reached is not None:
        reached.update(parents)
    complete = (
        found is None and not interrupted and not compact and not capped and not out_of_memory
    )
    trace: tuple[Step, ...] = ()
    violation = None
    if found is not None:
        violation = found[0]
        events = _path(parents, found[1], found[2])
        if engine != "ledger":
            confirm_on_ledger(config, policy, events, violation)
        trace = readable_steps(config, policy, events, checked=checked)
    return Result(
        config,
        policy,
        reduce,
        len(parents),
        transitions,
        seconds,
        max_depth,
        complete,
        violation,
        trace,
        interrupted=interrupted,
        compact=compact,
        queue=len(queue),
        memory_peak=max(peak, resident_bytes()),
        memory_budget=memory_budget,
        out_of_memory=out_of_memory,
        covered_depth=depth - 1 if queue else max_depth,
        engine=engine,
    )


def parallel_search(
    config: Config,
    policy: Policy,
    processes: int,
    *,
    reduce: bool,
    por: bool,
    max_states: int | None,
    progress: Callable[[Progress], None] | None,
    quiet: set[Any] | None,
    compact: bool,
    memory_budget: int | None,
    engine: str,
    reached: set[Any] | None,
) -> Result:
    """The search on ``processes`` worker processes (``parallel``), with the same states,
    verdict and shortest length as ``serial_search``."""
    if engine != "packed":
        raise ValueError("processes > 1 needs engine='packed' (a BlockLedger is no value to send)")
    if quiet is not None or compact:
        raise ValueError("processes > 1 takes neither quiet nor compact")
    t0 = time.perf_counter()
    root = engine_root(config, engine, checked=False, crash_first=por)
    rkey = (canonical_key if reduce else concrete_key)(root, config)

    def report(states: int, transitions: int, depth: int, queue: int, memory: int) -> None:
        if progress is not None:
            elapsed = time.perf_counter() - t0
            progress(Progress(states, transitions, depth, queue, elapsed, memory))

    pool = Pool(processes, config, policy, reduce)
    try:
        got = run_levels(
            pool,
            root,
            rkey,
            por=por,
            max_states=max_states,
            memory_budget=memory_budget,
            report=report,
        )
        if reached is not None:
            reached.update(pool.keys())
    finally:
        pool.close()
    seconds = got["seconds"] - t0
    report(got["states"], got["transitions"], got["depth"], got["queue"], got["memory"])
    violation = None
    trace: tuple[Step, ...] = ()
    found = got.get("found")
    if found is not None:
        violation, events, _length = found
        confirm_on_ledger(config, policy, events, violation)
        trace = readable_steps(config, policy, events)
    interrupted = got["interrupted"]
    complete = not (found is not None or interrupted or got["capped"] or got["out_of_memory"])
    depth = got["depth"]
    max_depth = depth if found is not None or got["queue"] else depth - 1
    return Result(
        config,
        policy,
        reduce,
        got["states"],
        got["transitions"],
        seconds,
        max(max_depth, 0),
        complete,
        violation,
        trace,
        interrupted=interrupted,
        queue=got["queue"],
        memory_peak=got["memory_peak"],
        memory_budget=memory_budget,
        out_of_memory=got["out_of_memory"],
        covered_depth=max(depth - 1, 0),
        engine=engine,
        processes=processes,
    )


def _path(
    parents: dict[Any, tuple[Any, Event] | None], key: Any, last: Event | None
) -> list[Event]:
    """The events from the root to ``key`` (then ``last``), from the parent links."""
    events: list[Event] = [] if last is None else [last]
    link = parents[key]
    while link is not None:
        pkey, ev = link
        events.append(ev)
        link = parents[pkey]
    events.reverse()
    return events


def readable_steps(
    config: Config, policy: Policy, events: list[Event], *, checked: bool = False
) -> tuple[Step, ...]:
    """Replay ``events`` from the initial state and describe each one."""
    state = initial(config, checked=checked)
    out: list[Step] = []
    for i, ev in enumerate(events):
        label = describe_event(state, ev, config)
        try:
            state, notes = step(state, ev, config, policy)
        except Broken as b:
            out.append(Step(i + 1, ev, label, (*b.notes, f"VIOLATION: {b.violation.message}")))
            break
        out.append(Step(i + 1, ev, label, tuple(notes)))
    return tuple(out)
