"""State keys: the canonical key up to renaming requests, blocks and peers, and the concrete one.

Why two states with one canonical key have the same futures is argued in ``explore.py``
(symmetry, dead grants, renamings).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvlifetime.verify.events import may_crash
from kvlifetime.verify.state import (
    FAILED,
    IN_FLIGHT,
    LANDED,
    LIVE,
    RELEASED,
    Config,
    Env,
    GrantSide,
    Snap,
    State,
)

# ------------------------------------------------------------------ state keys


# The most peer renamings one key tries (see "renamings" in the module docstring).
RENAMING_CAP = 720


def renamings(
    sig: Sequence[Any], used: Sequence[bool], cap: int = RENAMING_CAP
) -> Iterator[list[int]]:
    """The peer renamings (old index -> new name) that can give the least key, lazily.

    Peers are named in the order of ``sig`` (a name-free signature of what the key keeps of
    each): only peers with equal signatures are permuted among themselves, and only when the
    key mentions them (``used``: a grant or a message names them); peers the key names only
    through their flags are alike and keep one order. At most ``cap`` renamings are yielded.
    """
    order = sorted(range(len(sig)), key=lambda p: sig[p])
    n = len(sig)
    if all(sig[order[i]] != sig[order[i + 1]] or not used[order[i]] for i in range(n - 1)):
        # No two alike peers that the key names: one renaming (the common case, by far).
        perm = [0] * n
        for new, old in enumerate(order):
            perm[old] = new
        yield perm
        return
    groups: list[list[int]] = []
    for p in order:
        if groups and sig[groups[-1][0]] == sig[p]:
            groups[-1].append(p)
        else:
            groups.append([p])
    for pick in itertools.islice(_orders(groups, used, 0), cap):
        perm = [0] * len(sig)
        for new, old in enumerate(p for grp in pick for p in grp):
            perm[old] = new
        yield perm


def _orders(
    groups: list[list[int]], used: Sequence[bool], i: int
) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every order of the peers of ``groups[i:]``, one group after the other, generated lazily
    (``itertools.product`` would first build every permutation of every group)."""
    if i == len(groups):
        yield ()
        return
    g = groups[i]
    firsts: Iterable[tuple[int, ...]] = (
        itertools.permutations(g) if len(g) > 1 and used[g[0]] else (tuple(g),)
    )
    for first in firsts:
        for rest in _orders(groups, used, i + 1):
            yield (first, *rest)


_CLOSED: tuple[Any, ...] = (False, -1, 0, False, "", True)


def canonical_key(state: State, config: Config) -> Any:
    """The state up to renaming requests, blocks and peers (see the module docstring).

    A canonical form: two states that are renamings of each other get one key, whichever
    names they carry (a grant's messages are part of its descriptor, in their channel's order,
    so two requests alike in every other respect are never told apart by their names)."""
    env = state.env
    snap = state.snap
    best: Any = None
    # What does not depend on the peer renaming, once.
    wire: list[list[tuple[Any, ...]]] = [[] for _ in env.grants]
    for m in env.msgs:
        wire[m.grant].append((m.dest, m.kind, m.value, m.dupable, m.delayed))
    base: list[tuple[Any, ...] | None] = []
    for gi, g in enumerate(env.grants):
        req = env.reqs[g.req]
        if req.phase != LIVE and _dead(env, snap, g, bool(wire[gi])):
            # Nothing of this grant can happen any more, and nothing reads it (see "dead
            # grants" in the module docstring): only its peer is kept, for an ended request.
            base.append(None)
            continue
        if req.phase == RELEASED:
            proof: tuple[Any, ...] = ()
        else:
            pr = snap.proof(g.grant)
            # A closed grant's facts are never read again (see the module docstring), and a
            # suspect grant's reason is only a label: neither is part of the state.
            proof = _CLOSED if pr[-1] else (*pr[:4], "s" if pr[4] else "", False)
        # Its messages, in order: a channel (one per grant and direction) is FIFO.
        msgs = tuple(sorted(wire[gi], key=lambda m: m[0]))
        base.append(
            (
                g.transfers,
                snap.stale_old(g.grant) if g.old else snap.stale(g.grant),
                g.old,
                *_grant_flags(g),
                proof,
                msgs,
            )
        )
    rstates = [(r.phase, "" if r.phase == RELEASED else snap.state(r.key)) for r in env.reqs]
    # A dead grant of a released request is not in the key at all.
    listed = [
        b is not None or env.reqs[g.req].phase != RELEASED
        for g, b in zip(env.grants, base, strict=True)
    ]
    # "May still crash" only while the budgets allow it: then the peers are alike again.
    pflags = [
        (may_crash(env, p) and not ps.crashed, ps.crashed, ps.fenced, ps.lost_reported)
        for p, ps in enumerate(env.peers)
    ]
    perms: Iterable[list[int]] = [list(range(len(env.peers)))]
    if len(env.peers) > 1:
        gsig: list[list[Any]] = [[] for _ in env.peers]
        for gi, g in enumerate(env.grants):
            if listed[gi]:
                gsig[g.peer].append((rstates[g.req], base[gi] or ()))
        sig = [(*fl, sorted(gs)) for fl, gs in zip(pflags, gsig, strict=True)]
        perms = renamings(sig, [bool(gs) for gs in gsig])
    for perm in perms:
        gdesc = [
            (perm[g.peer], *b) if b is not None else (perm[g.peer],)
            for g, b in zip(env.grants, base, strict=True)
        ]
        reqs: list[Any] = []
        orphans: list[Any] = []
        for ri, r in enumerate(env.reqs):
            if r.phase == RELEASED:
                orphans.extend(gdesc[gi] for gi in r.grants if listed[gi])
                continue
            desc = (*rstates[ri], len(r.blocks), r.completions, r.ended)
            reqs.append((*desc, tuple(sorted(gdesc[gi] for gi in r.grants))))
        inv = [0] * len(perm)
        for old, new in enumerate(perm):
            inv[new] = old
        key = (
            *_counters(env),
            tuple(pflags[o] for o in inv),
            tuple(sorted(reqs)),
            tuple(sorted(orphans)),
        )
        if best is None or key < best:
            best = key
    if config.share:
        # Which requests share which blocks is not in the anonymous key: add it concretely
        # (more detail in a key splits states, never merges them: sound, less reduced).
        best = (best, tuple((r.phase, r.blocks, r.shared) for r in env.reqs))
    return best


def _dead(env: Env, snap: Snap, g: GrantSide, talking: bool) -> bool:
    """Whether no event of grant ``g`` (of an ended or released request) can happen any more:
    no message of it on the wire, no write still to land, the ledger has closed it (or
    forgotten its request), and its peer can neither post nor answer (stopped, or silent on it)."""
    if talking or any(t in (IN_FLIGHT, FAILED) for t in g.transfers):
        return False
    if env.reqs[g.req].phase != RELEASED and not snap.proof(g.grant)[-1]:
        return False
    if g.silent:
        return True
    if not g.stopped:
        return False
    if g.quiesced_sent:
        return True
    # A stopped peer still reports quiescence once every transfer it saw has landed, and it
    # may still go silent on the grant (crashing, if it has not yet) while it may crash.
    return (not g.transfers or not all(t == LANDED for t in g.transfers)) and not may_crash(
        env, g.peer
    )


def concrete_key(state: State, config: Config) -> Any:
    """Without reduction: the ledger's own fingerprint and the environment as it is."""
    env = state.env
    grants = tuple(
        (
            g.grant.id.serial,
            g.req,
            g.peer,
            g.transfers,
            *_grant_flags(g),
            g.old,
        )
        for g in env.grants
    )
    return (
        state.snap.ledger.fingerprint(),
        env.reqs,
        grants,
        env.msgs,
        env.peers,
        *_counters(env),
    )


def _grant_flags(g: GrantSide) -> tuple[bool | int, ...]:
    """What the peer and the owner did with a grant, as both keys list it."""
    return (g.cancelled, g.stopped, g.quiesced_sent, g.lease_fired, g.retries, g.silent)


def _counters(env: Env) -> tuple[int, ...]:
    """The environment's counters and budgets, as both keys list them."""
    return (
        env.admitted,
        env.dups_left,
        env.delays_left,
        env.losses_left,
        env.crashes_left,
        env.faults_left,
        env.restarts_left,
        env.incarnation,
    )
