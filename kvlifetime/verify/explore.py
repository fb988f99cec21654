"""Breadth-first exhaustive exploration of ``model`` over the real ledger: ``explore``, and the
argument that the reductions of the graph it walks are sound.

The search itself, as a program (breadth first, in one process or on several; its progress,
memory budget and interrupt; the counterexample rebuilt and replayed), is ``search``. This
module is its entry point and, in this docstring, the argument for the graph it walks, kept
beside the search it justifies.

Breadth first, so the first violation found is a shortest one (fewest events). States are
deduplicated by a *canonical key*; with ``reduce=True`` the key forgets what cannot change the
future, so states that differ only in names are explored once:

- **requests** are anonymous: the key lists the unreleased requests as a sorted multiset of
  descriptors (owner phase, ledger state, block count, grants), so which key (``r1``/``r2``) a
  request got does not matter;
- **blocks** are anonymous: a block appears only through the request holding it, and a grant's
  generations only as "a write would land on a later generation" (computed from the ledger's
  generation array, never assumed), so block ids, free-list order and absolute generation
  numbers drop out;
- **peers** are symmetric: the key is the least over every renaming of the peers;
- **grants** are described by what they are, their messages included (in each channel's
  order): a request's descriptor lists its grants' descriptors, so two requests alike in all but
  their names sort as equals and the key is a canonical form (one key per class of renamings,
  whichever state of the class is met first: ``tests/test_cenv.py`` holds the compiled
  checker's canonical form to it, state by state);
- **dead grants** drop out: a grant of a request that has ended (or been released) with no
  message on the wire, no write still to land, closed by the ledger (or forgotten with its
  request) and a peer that can neither post, answer nor go silent on it (silent already; or
  stopped, and it has reported quiescence or may no longer crash: a silent step crashes the
  peer, which the key would otherwise lose) can take part in no event again, and nothing
  reads its flags (a cancel to it could only come from ``reject``, which is over, or a retry,
  which needs an open grant): an ended request keeps only its peer
  (it still counts as granted), a released one nothing. The peer renamings tried are only
  those that list the peers in the order of a name-free signature of what the key keeps of
  them (one renaming when the signatures differ).

**Renamings** are generated lazily (``renamings``), never as the list of every permutation of
the peers: peers are ordered by their signature, and only peers with equal signatures that a
grant or a message names are permuted among themselves (alike peers the key names only through
their flags give the same key in any order). At most ``RENAMING_CAP`` renamings are tried for one
key. Past the cap the key may not be the least one, so two symmetric states may be stored twice;
it stays sound, as any renaming does: two states with one key are still renamings of each
other. So memory is bounded by the states stored, never by the symmetries.

Two states with one key are the same state up to renaming requests, blocks and peers, and the
ledger and the environment treat names only through equality: their futures are the same up to
that renaming, so the invariants (stated without names) hold in both or in neither.
``reduce=False`` keys states by the ledger's own ``fingerprint()`` plus the concrete
environment, which measures the reduction's factor on the same configuration.

**Partial-order reduction** (``por=True``, the default; ``model.stubborn``). The state graph is
acyclic: every event consumes a bounded budget or advances a monotone counter (admitted, grants
issued, transfers posted, transfer status IN_FLIGHT -> FAILED -> LANDED_UNSEEN / LANDED, a grant
going silent, the owner's phase, the grant and peer flags, lease_fired, retries, the fault
budgets; a delivery removes a message and sends at most one acknowledgement, which itself sends
nothing, and cancels are bounded by rejects plus retries). So no cycle proviso is needed. Every
violation is turned, for the argument, into a reachable *deadlock*: a step that breaks an
invariant sets a sticky "broken" bit and the run goes on (the explorer stops at the first one
instead; the set chosen in a state never looks at that bit), and every run of a finite acyclic
graph ends in a deadlock, so "a violation is reachable" iff "a broken or leaking deadlock is
reachable". Stubborn sets (Valmari: D0; D1, every member commutes with every path of
non-members; D2, a key member stays enabled along them) preserve every reachable deadlock, with
no visibility condition, provided "commutes" also covers "changes whether the other step
breaks". Commuting is up to renaming grants, messages and free-list order, which the ledger and
the environment treat as names. Symmetry keys compose with this: the set is computed on the
concrete state that is expanded, and symmetric states have symmetric futures (induction on the
height of the state).

The set is *the events of one request* ``r`` (``model.owner``: its finish / reject / grants, its
grants' post / fail / land / stop / quiesce / complete / retry / lease, its messages), or, once
``r`` has ended, *the events of one of its grants* ``g`` with the leases of its other grants
(below), and the model is built so that a request's lifecycle touches the others only through
named shared events: the control channel is FIFO per grant and direction (every per-peer FIFO
order is one of its interleavings), the prompt rule holds per grant (a non-delayed message of
``g`` blocks only ``g``'s other events and the owner's decisions about ``r``), and a lease is
generous or early by what ``r`` and the peers can still do, not by what other requests can.
What ``r``'s events read and write is then ``r``'s owner phase, its grants, its messages,
its ledger record and its blocks' generations, plus the budgets and the PeerLost / fence flags
of its peers.

**A crash is seen grant by grant.** A crash is no peer-wide event: its peer goes ``silent`` on
each grant, at that grant's own moment (it never posts, answers or reports for it again; its
transfers in flight still land), which covers the crash that silences every grant at once and
also a peer that hangs on one grant only. ``silent`` of ``r``'s grant is ``r``'s own event, and
the only one that disables ``r``'s peer-side steps, so those are keys. A peer's first crash
event (silent, PeerLost, fencing) spends the crash budget: a counter, like the other budgets.
PeerLost and fencing stay peer-wide, as in the ledger.

**Which peers crash.** Peers are symmetric and start alike, and the invariants name no peer: a
run in which a set ``S`` of peers crashes is, renamed, a run in which the first ``|S|`` peers
crash. The reduced search (``por=True``) lets only the first ``max_crashes`` peers crash;
``por=False`` lets any, so the tests' comparison of the two checks this step as well.

``r``'s set is used only when ``r`` is *isolated*: (a) every PeerLost / fencing that may still
happen commutes with every enabled event of ``r``. Under the timeout policy (PeerLost
quarantines, the reaper then frees) this is taken in its strict form: no peer ``r`` holds a
grant on (any peer while ``r`` is live) can still be reported lost or be fenced. Under proof and
naive, case by case (``model._isolated``; "may" means on some path of other events, within
the crash budgets); also under sglang-0.5.23, where PeerLost and fencing do what they do under
proof: what frees an aborted ``r`` at its deadline is a lease of ``r``, a member of ``r``'s
set, and a lease and a PeerLost (or a fencing that leaves the lease's grant open) end with
``r`` released in either order (the tests compare it with the full search too). The owner
grants to no peer it has seen lost or fenced, so "PeerLost (fencing), then grant" is no path
and D1 holds vacuously for a grant (it is no key while its peer may still be lost or fenced:
(c)). A fencing refuses every write that arrives after it, and such a
transfer ends as it would have had it landed first, so a landing and a fencing end in the same
state either way; the landing writes only when it comes first, from the state where it is
taken (a write that breaks there is found there). PeerLost(``p``) marks ``r``'s *open* grants on
``p`` suspect and, if ``r`` has ended, quarantines it; it never closes or frees anything (under
proof, naive and sglang-0.5.23). AccessRevoked(``p``) closes ``r``'s open grants on ``p`` (the
evidence after it is then a no-op) and may release ``r``. Neither touches a closed grant or a
released request.
So, once ``r`` has ended: (a4) ``r`` is quarantined iff an open grant of it is suspect (checked,
else full expansion); (a5) no enabled landing on a peer left unfenced while fencings alone may
release ``r`` (the write would land after the release in one order, before it in the other);
(a6) no enabled delivery that closes a grant on ``p`` (without releasing ``r``) while ``r`` is
not quarantined and PeerLost(``p``) may still come (it would quarantine ``r`` before the
delivery, not after). Every other pair commutes: a non-closing delivery and PeerLost end with
``r`` quarantined (if ended) and the same proofs either way; a delivery and AccessRevoked end
with the grant closed and ``r`` in the same state (the request guards read only *open* grants'
proofs, and the chain is monotone in them); a lease and PeerLost both mark the grant suspect
(the reason differs: a label); a lease or a retry is disabled by the fencing that closes its
grant. "The same" is up to the key: the key forgets a closed grant's facts and a suspect
grant's reason, which nothing reads again (a closed grant's facts serve only the contradiction
check, and the model's peers are honest: every last_seq a grant's peer sends is
``len(transfers)`` after it stopped, which no longer changes).

**Releases and admissions commute** up to block names: ``admit`` takes any free blocks, and
the key knows a block only through the request holding it and a grant's write only as "would
land on a later generation" (a release bumps the generation whether or not the block is handed
out again), so a release before or after an admission ends in the same key; an admission
enabled only once blocks are free is enabled by the release, never disabled by it. So a member
may release blocks while admissions remain, and a fencing may release ``r`` at any point among
them.

(c) ``r`` has an enabled *key* that nothing outside ``r`` can disable: it reads no budget, is
no early lease and no overtaking delivery, and is no grant to a peer that may still be lost or
fenced (so D2 holds). A generous lease (nothing else can happen to ``r``, and no PeerLost or
fencing can come) stays enabled whatever the others do: it is a key.

Then D1: another request's events and admissions write nothing ``r`` reads -- settling releases
only requests whose own records changed (after every ledger step nothing releasable is left),
and a release bumps only the released blocks' generations; the budgets are counters, so when a
path of others and then a budgeted event of ``r`` both fit, they fit in the other order too and
end in the same state; ``r``'s sends block no one else; a lease of ``r`` stays early-only while
the key is enabled, and ``r`` never changes whether another request's lease is early (budget
aside, which again fits). The broken checks follow the footprints: isolation is checked at
``land`` from ``r``'s grant and blocks (a release bumps the generation, so "stale" is monotone),
exclusivity at ``admit`` (never in a chosen set; the ledger hands out only free blocks in
either order), progress is a per-request predicate of ``r``'s ledger record and phase, checked
after every ledger step and changed only by ``r``'s own ledger steps (or by peer-wide ones,
which (a) orders), and no-leak at deadlocks, which are preserved. Every other state is fully
expanded.

**Grant-level sets.** Once ``r`` has ended it has no owner decision left (grant, finish,
reject); its grants then meet only in the ledger's record of ``r`` and in ``r``'s leases. Two
pieces of evidence about different grants of ``r`` commute: the request guards read only open
grants' proofs, the chain is monotone in them, and a grant's record changes only with its own
evidence, so both orders end in the same record -- except when one of them *releases* ``r``
(the last open grant closes): a write of another grant still in flight would land before the
release in one order and after it in the other. So the set ``T`` of grant ``g`` (its events,
plus every enabled lease of ``r``'s other grants) is used only when (g1) ``g`` is not a closed
grant with a write still to land (another grant's closing could release ``r`` under it), (g2)
no member releases ``r`` (``after`` is computed and compared), (a) and (c) hold for ``T`` as for
a request, and ``T`` has a non-lease key. The other grants' leases are members because a lease
is *early* (a fault) while ``r`` has another enabled event and *generous* (free) once it has
none: with them inside, every lease of ``r`` stays early along any path of non-members (``g``'s
key stays enabled, D2), so its budget does not depend on the order. A peer's steps for another
grant write only that grant's side; its landings check only its own grant's generations, which
only a release changes (excluded). The per-grant prompt rule gives each grant its own blocking.

**Lies** (``Fault.LIE``, ``model.lie_table``). A lying peer may, at any moment, send evidence
it may not make: ``AccessRevoked`` about itself (peer-wide and per grant), ``PeerLost`` /
``LeaseExpired``, and each acknowledgement about another peer's grant, in that peer's name or
in its own (claiming the most transfers a peer may post). Only when a lie arrives matters, and
it may arrive at any moment, which covers its loss (never sent), duplication (sent twice),
delay and reordering (sent later): a lie is one step, "the ledger receives it on the liar's
connection", with nothing on the wire. Under every policy but ``trusting`` the receiver stamps
it ``Source.peer(liar)``, as it does the honest evidence of that peer, and the real ledger must
refuse it as unauthorized; refused evidence changes nothing (its refusal counter aside, which
no guard, no fingerprint and no key reads), so the step returns the state it was taken from: a
self-loop. **Self-loops are left out** of the graph: they add no state and no path to one; a
state where only self-loops are enabled is quiet (the run rests there, so no-leak is checked
there); and a self-loop enables, disables and changes nothing, so D1 and D2 hold with or
without it and the stubborn sets are those of the graph without the fault. So, with provenance,
the state counts with ``lie`` are those without (the tests pin both). That needs every lie
refused in every reachable state, not only in the expanded ones: by the ledger's order of
checks it is (``provenance.check_source`` reads only the evidence and comes first: it refuses
every lie but one in the liar's own name about another's grant, which names a peer not the
grant's, and ``check_grant_peer`` refuses it as the grant is looked up, before anything
changes); and it is *checked*: in every state the search expands, ``model.lie_events`` sends
every lie to a scratch copy of the real ledger (answers cached per observable ledger, its
``fingerprint()``, and set of lies), and a lie that is accepted, refused as anything but
unauthorized, or whose refusal changed the fingerprint is taken as an event and breaks
``provenance``. The comparisons with the full search (below) include ``lie`` configurations,
which checks every lie in every state of the full search too.

A receiver that believes the wire (``trusting``) takes a lie that changes its ledger as a real
event (a fault: it spends ``max_faults``). Such a lie is peer-wide and may close or quarantine
any request's grant at any moment, so no request is isolated: ``model.stubborn`` expands every
state in full (trivially sound). Lies it refuses (in the liar's own name about another's grant:
mismatched) or that change nothing (a repeat) stay self-loops, left out as above. The graph
stays acyclic (a believed lie only adds to what the ledger has proven, which is monotone), and
the symmetry keys stay sound: every peer may lie alike, and lies name peers and grants only
through the state. The key forgets a closed grant's facts; a believed lie may make such facts
contradict what the honest peer says later, and that evidence is then refused (a no-op, noted),
so the facts the key forgets still change no future.

**Reads, ranks, restarts** (``Config.access``, ``Config.ranks``, ``Config.restarts``). A READ
grant differs from a WRITE grant only in what ``land`` does to memory (it reads instead of
writing) and in the ledger's own rules for read grants; the argument above does not look at
which, so it holds as it stands. Ranks are more grants per request and peer: every condition
above is stated per grant, and grants of one request to one peer are alike to the key (sorted
by descriptor). A restart replaces the whole ledger and marks every grant old; after it, the
restarted owner's fencings (``reclaim``) and the old grants' landings (checked against the new
ledger's hold for the previous incarnation) meet every request. ``model.stubborn`` expands every
state of a configuration with restarts in full (trivially sound); the key counts the restarts
left, the incarnation and each grant's "old" flag, and an old grant's staleness is "would land
on a block the new ledger no longer holds for the previous incarnation" (``Snap.stale_old``).

**Prefix sharing** (``Config.share``): a ``share`` event reads its source request's phase and
proofs, so it commutes with none of that request's events; ``model.stubborn`` expands every
state of such a configuration in full, and the key adds which requests hold which blocks and
which are prefix hits, concretely (block anonymity does not see sharing; a finer key is sound).

**The field's policies and reused ids** (``first-failure``, ``counted-completions``,
``ordered-reaper``; ``Config.reuse_ids``): their releases follow a transfer's failure, a count of
notices over all of a request's grants, or the order requests ended, and a reused id reads the
request whose id it takes; none of it is in the argument above. ``model.stubborn`` expands every
state of such a search in full (trivially sound). The key lists the notices counted and the
end order (both 0 under every other policy, so their keys do not change).

**Hash compaction** (``compact=True``, ``--hash-compaction``): ``parents`` stores a 64-bit hash
of each key instead of the key, and links hashes. A collision merges two distinct states, so a
state may be missed: the result is never complete (never a pass), and states the bound
``n(n-1)/2 / 2**64`` on the chance of any collision among its ``n`` states (for a uniform hash).
A violation it reports is real: the trace is rebuilt from the links and replayed.

**The search as a program** (its progress, its memory budget, an interrupt, the partial result)
is ``search``'s.

**Checked, not only argued.** ``test_verify.py`` compares the reduced search with the full one on
every configuration small enough to run both ways: the same verdict, the same counterexample
length, and *the same set of quiet states* (up to symmetry), which is what stubborn sets
preserve. That comparison found a non-canonical key (a signature that counted dead grants the
key drops) during development, and a key (reduced and concrete alike) that left out the total
fault budget still unspent; both cases are part of the suite.

Breadth first over the reduced graph may in principle give a longer counterexample than the
shortest one; on every configuration the tests compare (``test_verify.py``) the lengths are
equal, and the refutations at 2x2x2 keep their pinned lengths.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from kvlifetime.verify.keys import RENAMING_CAP, canonical_key, concrete_key, renamings
from kvlifetime.verify.packed import ENGINES
from kvlifetime.verify.result import Result, Step
from kvlifetime.verify.search import Progress, parallel_search, readable_steps, serial_search
from kvlifetime.verify.state import Config, Policy

__all__ = [
    "ENGINES",
    "RENAMING_CAP",
    "Progress",
    "Result",
    "Step",
    "canonical_key",
    "concrete_key",
    "explore",
    "readable_steps",
    "renamings",
]


# ------------------------------------------------------------------ the entry point


def explore(
    config: Config,
    policy: Policy,
    *,
    reduce: bool = True,
    por: bool = True,
    max_states: int | None = None,
    checked: bool = False,
    progress: Callable[[Progress], None] | None = None,
    progress_every: float = 1.0,
    quiet: set[Any] | None = None,
    compact: bool = False,
    memory_budget: int | None = None,
    engine: str = "ledger",
    reached: set[Any] | None = None,
    processes: int = 1,
) -> Result:
    """Explore every state reachable under ``config``; stop at the shortest violation.

    ``progress``, when given, is called with a ``Progress`` about every ``progress_every``
    seconds (and once at the end); the search itself writes nothing anywhere. A
    ``KeyboardInterrupt`` (Ctrl-C) during the search ends it: the result is the partial one,
    with ``interrupted`` set. ``quiet``, when given, receives the key of every quiet state (no
    event enabled) reached: the partial-order reduction must reach the same ones as the full
    search (the tests check). ``compact``: hash compaction, an approximate search that stores
    a 64-bit hash of each key instead of the key (see "hash compaction" in the module
    docstring); its result is never a pass. ``memory_budget`` (bytes): the search reads the
    process's resident memory as it goes and stops once it reaches the budget; the result is
    then incomplete (``out_of_memory``), with the states stored and the depth it had covered.
    ``reached``, when given, receives the key of every state stored (the equality of the two
    engines is checked on these sets). ``engine``: ``"ledger"`` drives the real
    ``BlockLedger``; ``"packed"`` the same model over ``packed.PackedLedger`` (faster;
    ``ValueError`` for a configuration it does not model), whose counterexample is replayed on
    the real ledger before it is returned. ``processes`` >= 2: the frontier is expanded by that
    many worker processes (``parallel``: the packed engine only; no ``quiet``, no ``compact``),
    with the same states, verdict and shortest length as in one.
    """
    if processes > 1:
        return parallel_search(
            config,
            policy,
            processes,
            reduce=reduce,
            por=por,
            max_states=max_states,
            progress=progress,
            quiet=quiet,
            compact=compact,
            memory_budget=memory_budget,
            engine=engine,
            reached=reached,
        )
    # The states stored are hundreds of thousands of containers that live to the end of the
    # search, and a passing search makes no cyclic garbage (measured: none left for the
    # collector after one): the cyclic collector's passes over them took a third of the
    # compiled search's CPU (perf, 3 x 2 x 3 at two faults). It is paused for the search and
    # resumed once the search's own structures are gone (a refuted search's few cycles, its
    # exceptions' tracebacks, are collected then).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return serial_search(
            config,
            policy,
            reduce=reduce,
            por=por,
            max_states=max_states,
            checked=checked,
            progress=progress,
            progress_every=progress_every,
            quiet=quiet,
            compact=compact,
            memory_budget=memory_budget,
            engine=engine,
            reached=reached,
        )
    finally:
        if collecting:
            gc.enable()
