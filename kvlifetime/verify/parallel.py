"""The search on several cores: a level-synchronous breadth-first frontier, hash-partitioned.

``explore(..., processes=N)`` (N >= 2, the packed engine) forks N worker processes. Each *owns*
the states whose key hashes to it (``hash(key) % N``; forked workers share the hash seed): it
stores their parent links and expands them. A level goes in three rounds, run by the parent
process:

1. **expand**: every worker expands its frontier (``successors.expansion``: the same events,
   stubborn sets and steps as the serial search) and sorts the successors by owner; those of
   another worker travel as pickled bytes through the parent, which forwards them unread;
2. **deliver**: every worker drops the successors whose key it has stored and keeps, per new
   key, the one the serial search would have met first: the least *tag* (the parent's place in
   the level, the event's place in the parent's expansion);
3. **rank**: the parent merges every worker's tags into the level's order, as the serial
   queue would hold it, and hands each worker the places of its new states: they become the
   next frontier, and the tags of the next level.

So each level holds exactly the states the serial search's level holds, with the same
representative for each key (the first the serial search would store; the stubborn set is
computed on that concrete state, so this is what keeps the two reached sets identical, not
only equal up to symmetry), and the first violation is a shortest one, as in the serial search:
a quiet state breaking no-leak at this depth (the first in the level's order) is shorter than
any step that breaks (the first such step in that order). The counterexample is rebuilt by
asking each link's owner, then replayed on the real ledger (``packed.confirm_on_ledger``).

Only the packed engine: a ``BlockLedger`` holds a lock and is no value to send between processes.

Why pickle here, when every control message between engines is msgpack with a versioned schema
(``kvlifetime.harness.wire``): these bytes are not a protocol. They go from a worker this search
forked, over a pipe it made, to another such worker, and live as long as one level; nothing
outside the process tree writes them, and no other version of the code reads them. The states
are the verifier's own values (nested attrs classes, frozensets, enums); a schema for them would
be a second copy of the model to keep in step.
The state count of a passing search equals the serial one (the tests check); at a violation the
parallel search has finished its level, so it may have stored more states than the serial one,
which stops at the violating step.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvlifetime.verify.keys import canonical_key, concrete_key
from kvlifetime.verify.memory import resident_bytes
from kvlifetime.verify.semantics import check_quiet
from kvlifetime.verify.state import Config, Event, Policy, State, Violation
from kvlifetime.verify.successors import expansion

# A place in the serial order: (the parent's place in its level, the event's place in the
# parent's expansion). The root's is (0, 0).
Tag = tuple[int, int]


class _Worker:
    """One worker's share of the search (runs in the forked process)."""

    def __init__(self, me: int, n: int, config: Config, policy: Policy, reduce: bool) -> None:
        self.me, self.n = me, n
        self.config, self.policy = config, policy
        self.keyf: Callable[[State, Config], Any] = canonical_key if reduce else concrete_key
        self.parents: dict[Any, tuple[Any, Event] | None] = {}
        self.frontier: list[tuple[int, State, Any]] = []  # (place in level, state, key)
        self.candidates: dict[Any, tuple[Tag, Any, Event, State]] = {}
        self.answers: dict[Any, tuple[int, ...]] = {}
        self.sent: set[Any] = set()  # keys sent to their owners in earlier levels

    def seed(self, state: State, key: Any) -> None:
        self.parents[key] = None
        self.frontier = [(0, state, key)]

    def expand(self, por: bool) -> tuple[list[bytes], dict[str, Any]]:
        """Expand the frontier; return the successors bound for each other worker (pickled)
        and what this level found: transitions, the first quiet violation, the first
        breaking step. The frontier is in serial order, so the first successor met with a key
        has its least tag here; a key sent in an earlier level is stored by its owner (seen
        before, or stored then) and is not sent again."""
        out: list[dict[Any, Any]] = [{} for _ in range(self.n)]
        mine, parents, sent = out[self.me], self.parents, self.sent
        transitions = 0
        quiet_bad: tuple[int, Any, Violation] | None = None
        broken: tuple[Tag, Any, Event, Violation] | None = None
        for place, state, key in self.frontier:
            events, succ = expansion(state, self.config, self.policy, por, self.answers)
            if not events:
                v = check_quiet(state)
                if v is not None and quiet_bad is None:
                    quiet_bad = (place, key, v)
                continue
            if quiet_bad is not None:
                continue  # only a quiet violation of this level can still come first
            for i, ev in enumerate(events):
                transitions += 1
                nxt = succ.after(ev)
                if nxt is None:
                    if broken is None or (place, i) < broken[0]:
                        broken = ((place, i), key, ev, succ.broken(ev).violation)
                    break
                nkey = self.keyf(nxt, self.config)
                owner = hash(nkey) % self.n
                if owner == self.me:
                    if nkey not in parents and nkey not in mine:
                        mine[nkey] = ((place, i), key, ev, nxt)
                elif nkey not in sent and nkey not in out[owner]:
                    # The Snap travels whole: its ledger and its caches, pickled once for
                    # every state of the parcel that shares it (as successors do).
                    out[owner][nkey] = ((place, i), key, ev, nxt.snap, nxt.env)
        self.frontier = []
        self.candidates = mine
        parcels = []
        for j, d in enumerate(out):
            if j != self.me:
                sent.update(d)
            parcels.append(b"" if j == self.me else pickle.dumps(d, pickle.HIGHEST_PROTOCOL))
        found = {"transitions": transitions, "quiet": quiet_bad, "broken": broken}
        return parcels, found

    def deliver(self, parcels: list[bytes]) -> list[Tag]:
        """Take the successors other workers found for this one; return the tags of the new
        ones, sorted."""
        cands = self.candidates
        parents = self.parents
        for parcel in parcels:
            if not parcel:
                continue
            got: dict[Any, Any] = pickle.loads(parcel)
            for nkey, (tag, pkey, ev, snap, env) in got.items():
                if nkey in parents:
                    continue
                have = cands.get(nkey)
                if have is None or tag < have[0]:
                    cands[nkey] = (tag, pkey, ev, State(snap, env))
        return sorted(c[0] for c in cands.values())

    def rank(self, places: list[int]) -> int:
        """Store the new states at their places in the next level; return how many."""
        ordered = sorted(self.candidates.items(), key=lambda kv: kv[1][0])
        frontier = []
        for place, (nkey, (_tag, pkey, ev, state)) in zip(places, ordered, strict=True):
            self.parents[nkey] = (pkey, ev)
            frontier.append((place, state, nkey))
        self.frontier = frontier
        self.candidates = {}
        return len(frontier)


def _serve(conn: Connection, me: int, n: int, config: Config, policy: Policy, reduce: bool) -> None:
    """A worker's loop: answer the parent's commands until it says stop (or goes away)."""
    w = _Worker(me, n, config, policy, reduce)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "seed":
                w.seed(*arg)
                conn.send(None)
            elif cmd == "expand":
                conn.send(w.expand(arg))
            elif cmd == "deliver":
                conn.send(w.deliver(arg))
            elif cmd == "rank":
                conn.send(w.rank(arg))
            elif cmd == "link":
                conn.send(w.parents[arg])
            elif cmd == "keys":
                conn.send(list(w.parents))
            elif cmd == "memory":
                conn.send(resident_bytes())
            else:
                return
    except (EOFError, KeyboardInterrupt):
        return


class Pool:
    """The worker processes of one search, driven level by level from the parent."""

    def __init__(self, n: int, config: Config, policy: Policy, reduce: bool) -> None:
        ctx = mp.get_context("fork")  # the workers must share the parent's hash seed
        self.n = n
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for me in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, me, n, config, policy, reduce), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def owner(self, key: Any) -> int:
        return hash(key) % self.n

    def ask_all(self, cmd: str, args: list[Any]) -> list[Any]:
        for c, a in zip(self.conns, args, strict=True):
            c.send((cmd, a))
        return [c.recv() for c in self.conns]

    def ask(self, worker: int, cmd: str, arg: Any) -> Any:
        self.conns[worker].send((cmd, arg))
        return self.conns[worker].recv()

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(("stop", None))
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()

    def level(self, por: bool) -> tuple[int, int, dict[str, Any] | None, dict[str, Any] | None]:
        """Expand one level; return (new states, transitions, the first quiet violation, the
        first breaking step) -- the violations as found (worker, place or tag, key, ...)."""
        got = self.ask_all("expand", [por] * self.n)
        transitions = sum(f["transitions"] for _, f in got)
        quiet = [f["quiet"] for _, f in got if f["quiet"] is not None]
        broken = [f["broken"] for _, f in got if f["broken"] is not None]
        first_quiet = min(quiet, key=lambda q: q[0]) if quiet else None
        first_broken = min(broken, key=lambda b: b[0]) if broken else None
        if first_quiet is not None or first_broken is not None:
            q = None if first_quiet is None else {"key": first_quiet[1], "v": first_quiet[2]}
            b = (
                None
                if first_broken is None
                else {"key": first_broken[1], "ev": first_broken[2], "v": first_broken[3]}
            )
            return 0, transitions, q, b
        # Each worker's parcels for worker j, forwarded unread.
        tags = self.ask_all("deliver", [[parcels[j] for parcels, _ in got] for j in range(self.n)])
        merged = sorted((t, w) for w, ts in enumerate(tags) for t in ts)
        places: list[list[int]] = [[] for _ in range(self.n)]
        for place, (_t, w) in enumerate(merged):
            places[w].append(place)
        stored = sum(self.ask_all("rank", places))
        return stored, transitions, None, None

    def path(self, key: Any) -> list[Event]:
        """The events from the root to ``key``, from the owners' links."""
        events: list[Event] = []
        link = self.ask(self.owner(key), "link", key)
        while link is not None:
            pkey, ev = link
            events.append(ev)
            link = self.ask(self.owner(pkey), "link", pkey)
        events.reverse()
        return events

    def keys(self) -> list[Any]:
        """Every key stored, by every worker."""
        return [k for ks in self.ask_all("keys", [None] * self.n) for k in ks]

    def memory(self) -> int:
        """The resident memory of every worker, summed (bytes)."""
        return int(sum(self.ask_all("memory", [None] * self.n)))


def run_levels(
    pool: Pool,
    root: State,
    rkey: Any,
    *,
    por: bool,
    max_states: int | None,
    memory_budget: int | None,
    report: Callable[[int, int, int, int, int], None],
) -> dict[str, Any]:
    """Drive ``pool`` level by level from ``root``; return what the search found and how far
    it got (``explore`` turns it into a ``Result``)."""
    pool.ask(pool.owner(rkey), "seed", (root, rkey))
    states, transitions, depth, frontier = 1, 0, 0, 1
    memory = peak = resident_bytes()
    out: dict[str, Any] = {"capped": False, "out_of_memory": False, "interrupted": False}
    try:
        while frontier:
            memory = resident_bytes() + pool.memory()
            peak = max(peak, memory)
            if memory_budget is not None and memory >= memory_budget:
                out["out_of_memory"] = True
                break
            report(states, transitions, depth, frontier, memory)
            new, t, quiet, broken = pool.level(por)
            transitions += t
            if quiet is not None:
                out["found"] = (quiet["v"], pool.path(quiet["key"]), depth)
                break
            if broken is not None:
                path = [*pool.path(broken["key"]), broken["ev"]]
                out["found"] = (broken["v"], path, depth + 1)
                break
            states += new
            frontier = new
            depth += 1
            if max_states is not None and states >= max_states and frontier:
                out["capped"] = True
                break
    except KeyboardInterrupt:
        out["interrupted"] = True
    out.update(
        states=states,
        transitions=transitions,
        depth=depth,
        queue=frontier,
        memory_peak=peak,
        memory=memory,
        seconds=time.perf_counter(),
    )
    return out
