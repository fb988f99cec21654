"""The partial-order reduction: stubborn sets of one request or one grant (argued in
``explore.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvlifetime.spec.vocabulary import RequestState
from kvlifetime.verify.events import (
    BUDGETED,
    fences_may_close,
    grant_of,
    is_fault,
    lost_possible,
    owner,
    peer_may_act,
)
from kvlifetime.verify.state import (
    FAILED,
    FINISHED,
    IN_FLIGHT,
    LIVE,
    REJECTED,
    RELEASED,
    TO_LEDGER,
    Config,
    Env,
    Event,
    Fault,
    Policy,
    State,
)

# Policies whose states are expanded in full (see ``stubborn``).
FIELD_POLICIES = frozenset(
    {Policy.FIRST_FAILURE, Policy.COUNTED_COMPLETIONS, Policy.ORDERED_REAPER}
)


def stubborn(
    state: State,
    config: Config,
    events: list[Event],
    after: Callable[[Event], State | None],
    policy: Policy | None = None,
) -> list[Event]:
    """A persistent subset of ``events`` (those enabled in ``state``): see ``explore.py``.

    The events of one request ``r`` are expanded alone when ``r`` is *isolated* (conditions
    (a) to (c) of ``explore.py``; ``after(e)`` is the successor of ``e``, ``None`` when the step
    breaks an invariant); once ``r`` has ended, the events of one of its grants with the leases
    of the others (conditions (g1), (g2)). Candidates are tried oldest request first (a run then
    finishes one request before it turns to the next), smaller sets first within a request; when
    none qualifies, every enabled event is returned. ``policy`` ``None`` or ``TIMEOUT``:
    condition (a) in its strict form (no peer ``r`` may use can still be lost or fenced); every
    other policy (``SGLANG_0_5_23`` included: see (a) in ``explore.py``) the relaxed one.
    """
    env = state.env
    if not env.reqs or len(events) < 2:
        return events
    if policy is not None and policy.believes_the_wire and Fault.LIE in config.faults:
        # A believed lie is a peer-wide event that may close or quarantine any request's grant
        # at any moment: no request is isolated (explore.py, "lies").
        return events
    if policy in FIELD_POLICIES:
        # The field's bug classes free on a failure report, on a count of notices, or in the
        # order requests ended: none of that is in the argument of explore.py (a release
        # there follows only proofs, deadlines or the owner's own decision about one
        # request). Expanded in full: trivially sound.
        return events
    if config.restarts or config.share or config.reuse_ids:
        # A restart replaces the whole ledger, and after one the restarted owner's fencings and
        # the previous incarnation's transfers meet every request: no request is isolated
        # (expanded in full, trivially sound; see "restart" in explore.py). A prefix hit reads
        # its source request's phase and proofs: it commutes with none of that request's events.
        # A reused id reads (and, under id-overwrite, ends) the request whose id it takes.
        return events
    mine: dict[int, list[Event]] = {}
    for e in events:
        mine.setdefault(owner(env, e), []).append(e)
    strict = policy is None or policy is Policy.TIMEOUT
    # Candidates: the events of one request; for a request that has ended, also the events of
    # one of its grants with the leases of its other grants (explore.py, "grant-level sets").
    candidates: list[tuple[int, list[Event], bool]] = []
    for ri, evs in mine.items():
        if ri < 0:
            continue
        candidates.append((ri, evs, False))
        if env.reqs[ri].phase not in (FINISHED, REJECTED) or len(env.reqs[ri].grants) < 2:
            continue
        per_grant: dict[int, list[Event]] = {}
        leases: list[Event] = []
        for e in evs:
            per_grant.setdefault(grant_of(env, e), []).append(e)
            if e.kind == "lease":
                leases.append(e)
        if len(per_grant) < 2:
            continue
        for gi, gevs in per_grant.items():
            candidates.append((ri, gevs + [e for e in leases if e.a != gi], True))
    best: list[Event] | None = None
    for ri, evs, per_grant_set in sorted(candidates, key=lambda c: (c[0], len(c[1]))):
        if len(evs) == len(events):
            continue
        if strict:
            if not _isolated_strict(state, config, ri):
                continue
        elif not _isolated(state, config, ri, evs, after):
            continue
        # A grant-level set needs a key that is no lease (explore.py, "grant-level sets").
        keys = [
            e for e in evs if (e.kind != "lease" or not per_grant_set) and _is_key(env, config, e)
        ]
        if not keys:
            continue
        if per_grant_set:
            gi = grant_of(env, keys[0])
            # (g1) a closed grant with a write still to land: the last closing of another
            # grant would release r under it; (g2) a member that releases r: a write of
            # another grant may be landing after it.
            g = env.grants[gi]
            if state.snap.proof(g.grant)[-1] and any(t in (IN_FLIGHT, FAILED) for t in g.transfers):
                continue
            if any(_releases(env, e, after) for e in evs):
                continue
        best = evs
        break
    return events if best is None else best


def _isolated_strict(state: State, config: Config, ri: int) -> bool:
    """Condition (a), strict: no peer ``r`` holds a grant on (any peer while ``r`` is live)
    can still be reported lost (PeerLost) or be fenced."""
    env = state.env
    r = env.reqs[ri]
    peers: Iterable[int] = (
        range(config.peers) if r.phase == LIVE else {env.grants[gi].peer for gi in r.grants}
    )
    return not any(peer_may_act(env, config, p) for p in peers)


def _isolated(
    state: State,
    config: Config,
    ri: int,
    evs: list[Event],
    after: Callable[[Event], State | None],
) -> bool:
    """Condition (a), relaxed (every policy but timeout): no peer-wide event that may still
    happen fails to commute with an enabled event of ``r`` (the cases of ``explore.py``)."""
    env = state.env
    snap = state.snap
    r = env.reqs[ri]
    if r.phase in (RELEASED, LIVE):
        # Released: the ledger forgot r, PeerLost and AccessRevoked do not touch it. Live: the
        # owner grants to no peer seen lost or fenced (explore.py, (a)).
        return True
    open_gs = [gi for gi in r.grants if not snap.proof(env.grants[gi].grant)[-1]]
    open_peers = {env.grants[gi].peer for gi in open_gs}
    # r has ended (finished or rejected) and is not released.
    st = snap.state(r.key)
    quarantined = st == RequestState.QUARANTINED.value
    if not quarantined and any(snap.proof(env.grants[gi].grant)[4] for gi in open_gs):
        return False  # (a4) outside what the argument covers (an ended request with a
        # suspect open grant is quarantined): expand in full
    # (a5) Fencings alone may release r: a landing on a peer they leave unfenced must not be
    # moved past them (a landing on a fenced peer touches nothing, in either order).
    if any(
        e.kind == "land" and env.grants[e.a].peer not in open_peers for e in evs
    ) and fences_may_close(env, config, open_peers):
        return False
    for e in evs:
        if e.kind not in ("deliver", "duplicate") or env.msgs[e.a].dest != TO_LEDGER:
            continue
        gi = env.msgs[e.a].grant
        if gi not in open_gs:
            continue
        nxt = after(e)
        if nxt is None:
            return False
        if nxt.env.reqs[ri].phase == RELEASED:
            continue  # closes the last open grant: r is released before a PeerLost or a
            # fencing could touch it, or by that fencing first: released either way
        if not nxt.snap.proof(env.grants[gi].grant)[-1]:
            continue  # does not close its grant
        p = env.grants[gi].peer
        # (a6) It closes grant gi: PeerLost(p) before it quarantines r, after it not.
        if not quarantined and lost_possible(env, p):
            return False
    return True


def _is_key(env: Env, config: Config, e: Event) -> bool:
    """Whether ``e`` may be the key (D2): enabled whatever the other requests and the peers
    do. Not a budgeted event, an early lease or an overtaking delivery (a budget may run out),
    not a grant to a peer that may still be lost or fenced (the owner grants to no such peer).
    A peer-side step is disabled only by its grant going silent, a member of the same set."""
    if e.kind == "lease":
        # A generous deadline (nothing else can happen to the request, and no peer can crash,
        # be lost or be fenced any more) stays so: others' events never make it early again.
        return e.b != 1
    if e.kind in BUDGETED or _overtakes(env, e):
        return False
    if e.kind == "grant":
        return not peer_may_act(env, config, e.b)
    return True


def _overtakes(env: Env, e: Event) -> bool:
    return e.kind == "deliver" and is_fault(env, e) > 0


def _releases(env: Env, e: Event, after: Callable[[Event], State | None]) -> bool:
    """Whether ``e`` gives blocks back to the pool (or breaks an invariant)."""
    if e.kind not in ("finish", "reject", "deliver", "duplicate", "lease"):
        return False  # no ledger change: no release
    nxt = after(e)
    if nxt is None:
        return True
    return sum(r.phase == RELEASED for r in nxt.env.reqs) != sum(
        r.phase == RELEASED for r in env.reqs
    )
