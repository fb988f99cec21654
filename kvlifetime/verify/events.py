"""Which events are enabled in a state (the prompt rule, the fault budgets, crashes)."""

from __future__ import annotations

from typing import Any

from kvlifetime.grant import Access
from kvlifetime.verify.state import (
    FAILED,
    FINISHED,
    IN_FLIGHT,
    LANDED,
    LIVE,
    REJECTED,
    RELEASED,
    TO_PEER,
    Config,
    Env,
    Event,
    Fault,
    State,
)

# ------------------------------------------------------------------ which events are enabled


def _deliverable(env: Env, reorder: bool) -> list[tuple[int, bool]]:
    """Messages that may be delivered (or lost, or duplicated) now: (index, head of its channel).

    A channel is one grant's direction (``(dest, grant)``): FIFO within it, independent of the
    others. FIFO: only the head of each channel. With reordering, any message (one of each
    identical kind), and a message that is not its channel's head overtakes an earlier one.
    """
    out: list[tuple[int, bool]] = []
    seen: set[Any] = set()
    heads: set[tuple[int, int]] = set()
    for i, m in enumerate(env.msgs):
        chan = (m.dest, m.grant)
        head = chan not in heads
        heads.add(chan)
        if not reorder and not head:
            continue
        if reorder and not head:
            ident: Any = (m.dest, m.peer, m.kind, m.grant, m.value, m.dupable, m.delayed)
            if ident in seen:
                continue
            seen.add(ident)
        elif reorder:
            seen.add((m.dest, m.peer, m.kind, m.grant, m.value, m.dupable, m.delayed))
        out.append((i, head))
    return out


def is_fault(env: Env, event: Event) -> int:
    """How many units of ``Config.max_faults`` ``event`` spends (see ``Config.max_faults``)."""
    k = event.kind
    if k in ("deliver", "lose", "duplicate", "delay"):
        m = env.msgs[event.a]
        chan = (m.dest, m.grant)
        head = next(i for i, x in enumerate(env.msgs) if (x.dest, x.grant) == chan)
        return (head != event.a) + (k != "deliver")
    if k in ("fail", "retry"):
        return 1
    if k in PEER_EVENTS or k == "silent":  # the first of them crashes the peer
        p = env.grants[event.a].peer if k == "silent" else event.a
        return 0 if env.peers[p].crashed else 1
    if k == "lease":
        return 1 if event.b == 1 else 0
    return 0


MSG_EVENTS = frozenset({"deliver", "lose", "duplicate", "delay"})
GRANT_EVENTS = frozenset(
    {"post", "fail", "land", "stop", "quiesce", "complete", "retry", "lease", "silent"}
)
PEER_EVENTS = frozenset({"peer_lost", "fence"})


def grant_of(env: Env, event: Event) -> int:
    """The grant whose lifecycle ``event`` belongs to; -1 for request-level and shared events."""
    k = event.kind
    if k in MSG_EVENTS:
        return env.msgs[event.a].grant
    if k in GRANT_EVENTS:
        return event.a
    return -1


def owner(env: Env, event: Event) -> int:
    """The request whose lifecycle ``event`` belongs to; -1 for the shared events (admit and
    the peer-wide peer_lost / fence)."""
    k = event.kind
    if k in MSG_EVENTS:
        return env.grants[env.msgs[event.a].grant].req
    if k in GRANT_EVENTS:
        return env.grants[event.a].req
    if k in ("grant", "finish", "reject"):
        return event.a
    return -1


def enabled(state: State, config: Config) -> list[Event]:
    """The events enabled in ``state``.

    The prompt rule is per grant: while a message of grant ``g`` (of request ``r``) that was not
    delayed is on the wire, nothing else *of g* happens (its messages may still be delivered,
    lost, duplicated, delayed) and the owner takes no decision about ``r`` (grant, finish,
    reject); ``r``'s other grants, other requests, admissions and peer crashes go on. The delay
    fault is what lets such a message wait while ``g`` itself moves on.
    """
    env = state.env
    faults = config.faults
    budget = env.faults_left  # -1: unbounded
    out: list[Event] = []
    active: set[int] = set()  # requests with an enabled event other than a lease
    reorder = Fault.REORDER in faults and budget != 0
    prompt = {m.grant for m in env.msgs if not m.delayed}  # grants with a prompt message
    blocked = {env.grants[gi].req for gi in prompt}
    for i, head in _deliverable(env, reorder):
        m = env.msgs[i]
        cost = 0 if head else 1  # overtaking an earlier message is a (reorder) fault
        if budget >= 0 and cost > budget:
            continue
        active.add(env.grants[m.grant].req)
        out.append(Event("deliver", i))
        if budget >= 0 and cost + 1 > budget:
            continue
        if env.losses_left:
            out.append(Event("lose", i))
        if env.dups_left and m.dupable:
            out.append(Event("duplicate", i))
        if env.delays_left and not m.delayed:
            out.append(Event("delay", i))
    snap = state.snap
    if env.incarnation or config.share:
        # After a restart the ledger alone knows what is free (it may hold the arena for the
        # previous incarnation); with sharing, blocks have several holders.
        free = snap.ledger.free_count()
    else:
        free = config.blocks - sum(len(r.blocks) for r in env.reqs if r.phase != RELEASED)
    if env.admitted < config.requests and free >= config.blocks_per_request:
        out.append(Event("admit"))
    if config.reuse_ids and env.admitted < config.requests:
        # A new request with the id of an ended request the engine still holds.
        out.extend(
            Event("reuse", ri) for ri, r in enumerate(env.reqs) if r.phase in (FINISHED, REJECTED)
        )
    if config.share and env.admitted < config.requests:
        # A prefix hit on a live request whose blocks are settled (every grant closed).
        for ri, r in enumerate(env.reqs):
            if (
                r.phase == LIVE
                and not r.shared
                and ri not in blocked
                and all(snap.proof(env.grants[gi].grant)[-1] for gi in r.grants)
            ):
                out.append(Event("share", ri))
    for ri, r in enumerate(env.reqs):
        if r.phase == LIVE and ri not in blocked:
            granted = [0] * config.peers
            for gi in r.grants:
                granted[env.grants[gi].peer] += 1
            # A request on a prefix hit is served from the cache: it grants nothing. A write
            # grant on a block with another holder is refused (its content is settled), so
            # its source then grants only reads.
            no_grant = r.shared or (
                config.share
                and config.access is Access.WRITE
                and any(o.shared and o.phase != RELEASED and o.blocks == r.blocks for o in env.reqs)
            )
            for p in range(0 if no_grant else config.peers):
                if granted[p] < config.ranks and not (
                    env.peers[p].lost_reported or env.peers[p].fenced
                ):
                    out.append(Event("grant", ri, p))
            out.append(Event("finish", ri))
            out.append(Event("reject", ri))
            active.add(ri)
    leases: dict[int, list[int]] = {}
    for gi, g in enumerate(env.grants):
        if gi in prompt:
            continue
        n = len(out)
        req = env.reqs[g.req]
        for seq, st in enumerate(g.transfers):
            if st in (IN_FLIGHT, FAILED):
                out.append(Event("land", gi, seq))
            if st == IN_FLIGHT and Fault.FAIL in faults and not g.silent and budget:
                out.append(Event("fail", gi, seq))
        if req.phase in (FINISHED, REJECTED) and not snap.proof(g.grant)[-1]:  # still open
            if not g.lease_fired:
                leases.setdefault(g.req, []).append(gi)
            if (
                req.phase == REJECTED
                and Fault.RETRY in faults
                and g.retries < config.max_retries
                and budget
                and not any(m.dest == TO_PEER and m.grant == gi for m in env.msgs)
            ):
                out.append(Event("retry", gi))
        if not g.silent:
            if not (g.stopped and g.quiesced_sent) and may_crash(env, g.peer):
                out.append(Event("silent", gi))
            if not g.stopped and len(g.transfers) < config.transfers_per_grant:
                out.append(Event("post", gi))
            all_seen = all(st == LANDED for st in g.transfers)
            if g.cancelled and not g.stopped:
                out.append(Event("stop", gi))
            if g.stopped and not g.quiesced_sent and g.transfers and all_seen:
                out.append(Event("quiesce", gi))
            if not g.cancelled and not g.stopped and all_seen:
                out.append(Event("complete", gi))
        if len(out) > n:
            active.add(g.req)
    n = len(out)
    for pi, ps in enumerate(env.peers):
        if not may_crash(env, pi):
            continue
        if not ps.lost_reported:
            out.append(Event("peer_lost", pi))
        if not ps.fenced and Fault.FENCE in faults:
            out.append(Event("fence", pi))
    if env.incarnation:
        # The restarted owner's way out of the restart's quarantine: it fences each peer.
        out.extend(Event("reclaim", pi) for pi, ps in enumerate(env.peers) if not ps.fenced)
    if env.restarts_left and env.grants and not any(ps.fenced for ps in env.peers):
        out.append(Event("restart"))
    peer_events = len(out) > n
    early = Fault.TIMEOUT in faults and budget != 0
    for ri, gis in leases.items():
        if ri in active or peer_events:
            # An early deadline: it passes while something else could still happen to the
            # request (a step of its own, or of a peer): a fault.
            if early:
                out.extend(Event("lease", gi, 1) for gi in gis)
        else:
            # Without the timeout fault a deadline is generous: it passes only when nothing
            # else can happen to the request any more (the proof that was coming has come, or
            # never will).
            out.extend(Event("lease", gi) for gi in gis)
    return out


# Events that read or spend a shared fault budget (a deliver that overtakes spends one too).
BUDGETED = frozenset({"fail", "retry", "lose", "duplicate", "delay", "lease", "silent"})


def may_crash(env: Env, p: int) -> bool:
    """Whether peer ``p`` has crashed or may still (its crash events are then enabled): a
    crashable peer, and the budgets still cover a crash if it has not happened yet."""
    ps = env.peers[p]
    if ps.crashed:
        return True
    return ps.crashable and bool(env.crashes_left) and env.faults_left != 0


def lost_possible(env: Env, p: int) -> bool:
    """Whether a ``PeerLost`` of peer ``p`` may still be reported (now or later)."""
    return not env.peers[p].lost_reported and may_crash(env, p)


def fence_possible(env: Env, config: Config, p: int) -> bool:
    """Whether peer ``p`` may still be fenced (now or later)."""
    ps = env.peers[p]
    return Fault.FENCE in config.faults and not ps.fenced and may_crash(env, p)


def peer_may_act(env: Env, config: Config, p: int) -> bool:
    """Whether a PeerLost or a fencing of peer ``p`` is enabled now or may be later."""
    return lost_possible(env, p) or fence_possible(env, config, p)


def fences_may_close(env: Env, config: Config, peers: set[int]) -> bool:
    """Whether one path of crashes and fencings may fence every peer in ``peers`` (nonempty):
    every one can still be fenced, and the crash budgets cover those not yet crashed."""
    if not peers or not all(fence_possible(env, config, p) for p in peers):
        return False
    need = sum(not env.peers[p].crashed for p in peers)
    return need <= env.crashes_left and (env.faults_left < 0 or need <= env.faults_left)
