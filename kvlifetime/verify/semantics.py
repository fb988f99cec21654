"""Taking a step: the owner's calls, the peers, the wire (the release policies and the checks
are ``policies``; a step's scratch is ``scratch``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from kvlifetime.evidence import (
    AccessRevoked,
    Evidence,
    LeaseExpired,
    PeerLost,
    about,
)
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.owner import owner_step
from kvlifetime.verify.events import (
    PEER_EVENTS,
    enabled,
    is_fault,
)
from kvlifetime.verify.lies import (
    lie_events,
    lie_evidence,
    lie_table,
    lie_text,
    lies,
    wire_source,
)
from kvlifetime.verify.policies import (
    check_exclusive,
    check_progress,
    check_quiet,
    count_completion,
    end_order,
    free_on_failure,
    reuse_id,
    settle,
    sglang_frees_at_failed,
)
from kvlifetime.verify.scratch import Scratch, msg_text
from kvlifetime.verify.state import (
    FAILED,
    IN_FLIGHT,
    INCARNATION,
    LANDED,
    LANDED_UNSEEN,
    LIVE,
    PREVIOUS,
    RELEASED,
    TO_LEDGER,
    TO_PEER,
    Broken,
    Config,
    Event,
    GrantSide,
    Msg,
    Policy,
    ReqSide,
    Snap,
    State,
    Violation,
    evolve,
    initial,
    peer_name,
)

__all__ = ["check_quiet", "describe_event", "msg_text", "run_events", "step"]


def _evidence(kind: str, g: Grant, value: int) -> Evidence:
    if kind not in ("CancelReceived", "SchedulingStopped", "TransferQuiesced", "TransferCompleted"):
        raise ValueError(f"not an acknowledgement: {kind}")
    return about(g, kind, value)


def _strongest_ack(g: GrantSide) -> tuple[str, int]:
    """What a peer truthfully answers to a cancel, given what it knows now."""
    n = len(g.transfers)
    if g.quiesced_sent:
        return "TransferCompleted", n
    if g.stopped:
        return "SchedulingStopped", n
    return "CancelReceived", 0


def step(state: State, event: Event, config: Config, policy: Policy) -> tuple[State, list[str]]:
    """Take ``event`` from ``state``. Raises ``Broken`` when an invariant breaks in the step."""
    s = Scratch(state, config, policy)
    if s.env.faults_left > 0:
        cost = is_fault(s.env, event)
        if cost:
            s.env = evolve(s.env, faults_left=s.env.faults_left - cost)
    try:
        if _do(s, event):
            settle(s)
            check_progress(s)
    except Broken as b:
        b.notes = s.notes
        raise
    made = s.copy_made
    snap = state.snap if made is None else Snap(made)
    return State(snap, s.env), s.notes


# A peer's own acknowledgements: event -> (evidence it sends, grant flags it sets, what it did).
# Each carries the number of transfers the peer posted for the grant.
_PEER_ACKS: dict[str, tuple[str, dict[str, bool], str]] = {
    "stop": ("SchedulingStopped", {"stopped": True}, "stops scheduling"),
    "quiesce": ("TransferQuiesced", {"quiesced_sent": True}, "saw every transfer end"),
    "complete": (
        "TransferCompleted",
        {"stopped": True, "quiesced_sent": True},
        "is done with the grant",
    ),
}


def _do(s: Scratch, ev: Event) -> bool:
    """Perform the event; return whether the ledger may have changed."""
    env = s.env
    k = ev.kind
    if k == "admit":
        key = f"r{env.admitted + 1}"
        n = s.config.blocks_per_request
        ids = s.call(f"allocate({key!r}, {n})", s.ledger.allocate, key, n)
        blocks = tuple(int(b) for b in ids)
        s.env = evolve(
            env, reqs=(*env.reqs, ReqSide(key, LIVE, blocks, ())), admitted=env.admitted + 1
        )
        gens = s.ledger.generation(ids).tolist()
        s.notes.append(f"{key} admitted: allocates blocks {list(blocks)} (generations {gens})")
        check_exclusive(s, len(s.env.reqs) - 1)
        return True
    if k == "grant":
        req, p = env.reqs[ev.a], ev.b
        g = s.call(
            f"grant({req.key!r}, {peer_name(p)!r})",
            s.ledger.grant,
            req.key,
            peer_name(p),
            np.array(req.blocks, dtype=np.int64),
            s.config.access,
        )
        gi = len(env.grants)
        s.env = evolve(env, grants=(*env.grants, GrantSide(g, ev.a, p)))
        s.set_req(ev.a, grants=(*req.grants, gi))
        s.notes.append(
            f"{req.key} grants blocks {g.blocks.tolist()} (generations "
            f"{g.generations.tolist()}) to {peer_name(p)} for "
            f"{'reading' if s.config.access is Access.READ else 'writing'}: grant #{g.id.serial}"
        )
        return True
    if k == "finish":
        req = env.reqs[ev.a]
        s.call(f"finish({req.key!r})", s.ledger.finish, req.key)
        s.set_req(ev.a, phase=owner_step(req.phase, "finished"), ended=end_order(s))
        s.notes.append(f"{req.key} finished on the owner's side")
        return True
    if k == "reject":
        req = env.reqs[ev.a]
        s.call(f"reject({req.key!r})", s.ledger.reject, req.key, "abort")
        s.set_req(ev.a, phase=owner_step(req.phase, "aborted"), ended=end_order(s))
        s.notes.append(f"{req.key} rejected / aborted: error response sent")
        for gi in req.grants:
            g = env.grants[gi]
            s.send(Msg(TO_PEER, g.peer, "Cancel", gi, 0))
            s.notes.append(f"owner sends Cancel(grant #{g.grant.id.serial}) to {peer_name(g.peer)}")
        if s.policy is Policy.NAIVE:
            ids = s.call(
                f"force_release({req.key!r})", s.ledger.force_release, req.key, "naive: rejected"
            )
            s.release_as(ev.a, ids, "naive policy releases")
        elif sglang_frees_at_failed(s):
            ids = s.call(
                f"force_release({req.key!r})",
                s.ledger.force_release,
                req.key,
                "sglang-0.5.23: prefill KVPoll.Failed",
            )
            s.release_as(ev.a, ids, "sglang-0.5.23's prefill (KVPoll.Failed: release_kv_cache)")
        return True
    if k == "retry":
        g = env.grants[ev.a]
        s.set_grant(ev.a, retries=g.retries + 1)
        s.send(Msg(TO_PEER, g.peer, "Cancel", ev.a, 0))
        s.notes.append(
            f"owner re-sends Cancel(grant #{g.grant.id.serial}) to {peer_name(g.peer)} (retry)"
        )
        return False
    if k == "post":
        g = env.grants[ev.a]
        s.set_grant(ev.a, transfers=(*g.transfers, IN_FLIGHT))
        s.notes.append(
            f"{peer_name(g.peer)} posts transfer {len(g.transfers) + 1} of grant "
            f"#{g.grant.id.serial} ({_verb(s.config)}s blocks {g.grant.blocks.tolist()} at "
            "generations "
            f"{g.grant.generations.tolist()})"
        )
        return False
    if k == "fail":
        g = env.grants[ev.a]
        tr = list(g.transfers)
        tr[ev.b] = FAILED
        s.set_grant(ev.a, transfers=tuple(tr))
        s.notes.append(
            f"transfer {ev.b + 1} of grant #{g.grant.id.serial} reports FAILED "
            "(its bytes may still land)"
        )
        return free_on_failure(s, g.req)
    if k == "land":
        g = env.grants[ev.a]
        tr = list(g.transfers)
        tr[ev.b] = LANDED if tr[ev.b] == IN_FLIGHT else LANDED_UNSEEN
        s.set_grant(ev.a, transfers=tuple(tr))
        if env.peers[g.peer].fenced:
            # The same end for the transfer as had it landed before the fencing (so the two
            # commute); the peer's later reports only reach grants the fencing closed.
            s.notes.append(
                f"transfer {ev.b + 1} of grant #{g.grant.id.serial} arrives after the fencing "
                "of its peer: refused, it touches nothing"
            )
            return False
        verb = _verb(s.config)
        if g.old:
            # A transfer of the previous incarnation: only the restart's quarantine (the blocks
            # held for the previous incarnation) stands between it and the new owners.
            s.notes.append(
                f"transfer {ev.b + 1} of grant #{g.grant.id.serial} of the previous incarnation "
                f"{verb}s blocks {g.grant.blocks.tolist()}"
            )
            if s.snap_view().stale_old(g.grant):
                raise Broken(
                    "isolation",
                    f"a {verb} for {g.grant.request} of the previous incarnation (grant "
                    f"#{g.grant.id.serial}) touched blocks {g.grant.blocks.tolist()} after the "
                    "restarted ledger put them back in circulation",
                )
            return False
        now = s.view.generation(g.grant.blocks)
        s.notes.append(
            f"transfer {ev.b + 1} of grant #{g.grant.id.serial} {verb}s blocks "
            f"{g.grant.blocks.tolist()} (issued for generations {g.grant.generations.tolist()}, "
            f"blocks now at {now.tolist()})"
        )
        if not np.array_equal(now, g.grant.generations):
            holders = [
                r.key
                for r in s.env.reqs
                if r.phase != RELEASED and set(r.blocks) & set(g.grant.blocks.tolist())
            ]
            raise Broken(
                "isolation",
                f"a {verb} for {g.grant.request} (grant #{g.grant.id.serial}, generations "
                f"{g.grant.generations.tolist()}) touched blocks {g.grant.blocks.tolist()} at "
                f"generations {now.tolist()}, after the old generation was released"
                + (f"; they now belong to {', '.join(holders)}" if holders else ""),
            )
        return False
    if k in _PEER_ACKS:
        kind, flags, what = _PEER_ACKS[k]
        g = env.grants[ev.a]
        s.set_grant(ev.a, **flags)
        m = Msg(TO_LEDGER, g.peer, kind, ev.a, len(g.transfers))
        s.send(m)
        s.notes.append(f"{peer_name(g.peer)} {what}; sends {msg_text(s.env, m)}")
        return False
    if k in ("deliver", "lose", "duplicate", "delay"):
        m = env.msgs[ev.a]
        text = msg_text(env, m)
        if k == "lose":
            s.take_msg(ev.a)
            s.env = evolve(s.env, losses_left=s.env.losses_left - 1)
            s.notes.append(f"lost: {text}")
            return False
        if k == "delay":
            msgs = list(env.msgs)
            msgs[ev.a] = evolve(m, delayed=True)
            s.env = evolve(env, msgs=tuple(msgs), delays_left=env.delays_left - 1)
            s.notes.append(f"delayed: {text} (it may now arrive after anything else)")
            return False
        if k == "duplicate":
            # Delivered now, and a copy (never duplicated again) stays on the wire for later.
            msgs = list(env.msgs)
            msgs[ev.a] = evolve(m, dupable=False, delayed=True)
            s.env = evolve(env, msgs=tuple(msgs), dups_left=env.dups_left - 1)
            s.notes.append(f"duplicated on the wire: {text}; the copy arrives later")
        else:
            s.take_msg(ev.a)
        g = env.grants[m.grant]
        if m.dest == TO_PEER:
            if g.silent:
                s.notes.append(f"{text} reaches a peer silent on the grant: no answer")
                return False
            s.set_grant(m.grant, cancelled=True)
            kind, value = _strongest_ack(s.env.grants[m.grant])
            ack = Msg(TO_LEDGER, m.peer, kind, m.grant, value)
            s.send(ack)
            s.notes.append(
                f"{peer_name(m.peer)} receives the cancel; answers {msg_text(s.env, ack)}"
            )
            return False
        s.notes.append(f"ledger receives {text}")
        count_completion(s, m, g)
        evd = _evidence(m.kind, g.grant, m.value)
        s.apply(attrs.evolve(evd, source=wire_source(s.policy, m.peer)), text, old=g.old)
        return True
    if k == "lie":
        lie = lie_table(env, s.config)[ev.a]
        text = lie_text(env, s.config, lie)
        evd = lie_evidence(env, s.config, lie, s.policy)
        s.notes.append(f"a lie: {text} over its own connection; stamped {evd.source}")
        return s.apply_lie(evd, text)
    if k == "lease":
        g = env.grants[ev.a]
        s.set_grant(ev.a, lease_fired=True)
        s.notes.append(f"the lease of grant #{g.grant.id.serial} expires: LeaseExpired")
        s.apply(LeaseExpired.of(g.grant), f"LeaseExpired(grant #{g.grant.id.serial})")
        return True
    if k == "silent":
        g = env.grants[ev.a]
        s.crash(g.peer)
        s.set_grant(ev.a, silent=True)
        s.notes.append(
            f"{peer_name(g.peer)} goes silent on grant #{g.grant.id.serial}: it never posts, "
            "answers or reports for it again (its transfers in flight may still land)"
        )
        return False
    if k == "peer_lost":
        s.crash(ev.a)
        s.set_peer(ev.a, lost_reported=True)
        s.notes.append(f"heartbeats to {peer_name(ev.a)} fail: PeerLost({peer_name(ev.a)})")
        s.apply(PeerLost(peer_name(ev.a)), f"PeerLost({peer_name(ev.a)})")
        return True
    if k == "fence":
        s.crash(ev.a)
        s.set_peer(ev.a, fenced=True)
        s.notes.append(
            f"{peer_name(ev.a)} is fenced (no write of it touches memory from now on): "
            "AccessRevoked"
        )
        s.apply(AccessRevoked(peer_name(ev.a)), f"AccessRevoked({peer_name(ev.a)})")
        return True
    if k == "reuse":
        return reuse_id(s, ev.a)
    if k == "share":
        src = env.reqs[ev.a]
        key = f"r{env.admitted + 1}"
        if s.policy is Policy.UNTRACKED_SHARE:
            s.call(f"admit({key!r})", s.ledger.admit, key)
            how = "kept in the engine's prefix cache only (the ledger is not told)"
        else:
            ids = np.array(src.blocks, dtype=np.int64)
            s.call(f"acquire({key!r}, shared=True)", s.ledger.acquire, key, ids, shared=True)
            how = "acquire(shared=True)"
        s.env = evolve(
            env,
            reqs=(*env.reqs, ReqSide(key, LIVE, src.blocks, (), shared=True)),
            admitted=env.admitted + 1,
        )
        s.notes.append(
            f"{key} admitted on a prefix hit: shares {src.key}'s blocks {list(src.blocks)}, {how}"
        )
        return True
    if k == "reclaim":
        s.set_peer(ev.a, fenced=True)
        s.notes.append(
            f"the restarted owner fences {peer_name(ev.a)} (no transfer of it touches memory "
            "from now on): AccessRevoked"
        )
        s.apply(AccessRevoked(peer_name(ev.a)), f"AccessRevoked({peer_name(ev.a)})")
        return True
    if k == "restart":
        _restart(s)
        return True
    raise ValueError(f"unknown event kind {k!r}")


def _verb(config: Config) -> str:
    return "read" if config.access is Access.READ else "write"


def _restart(s: Scratch) -> None:
    """The owner's process restarts over the same arena: a new ledger (a new incarnation),
    every request of the old one gone on the owner's side; the peers know nothing of it."""
    env = s.env
    n = env.incarnation + 1
    inc = f"{INCARNATION}-{n}"
    checked = s.parent.snap.ledger.checked
    if s.policy is Policy.FRESH_RESTART:
        s.replace_ledger(BlockLedger(s.config.blocks, checked=checked, incarnation=inc))
        how = "a fresh ledger: every block free"
    else:
        names = [peer_name(p) for p in range(s.config.peers)]
        restarted = s.call(
            "after_restart",
            BlockLedger.after_restart,
            s.config.blocks,
            peers=names,
            request=PREVIOUS,
            checked=checked,
            incarnation=inc,
        )
        s.replace_ledger(restarted)
        how = (
            "BlockLedger.after_restart: every block quarantined (previous incarnation) until "
            f"each of {', '.join(names)} is fenced"
        )
    # A restart is no engine-side event: the new process holds nothing of the old one's.
    s.env = evolve(
        env,
        reqs=tuple(evolve(r, phase=RELEASED) for r in env.reqs),
        grants=tuple(evolve(g, old=True) for g in env.grants),
        peers=tuple(evolve(p, lost_reported=False) for p in env.peers),
        restarts_left=env.restarts_left - 1,
        incarnation=n,
    )
    s.notes.append(
        f"the owner restarts (incarnation {inc}) over the same arena: {how}; the old "
        "requests are gone on its side, their grants live on at the peers"
    )


def describe_event(state: State, event: Event, config: Config) -> str:
    """A short label for ``event`` taken from ``state`` (the notes say what it did)."""
    env = state.env
    k = event.kind
    if k in ("deliver", "lose", "duplicate", "delay"):
        return f"{k} {msg_text(env, env.msgs[event.a])}"
    if k in ("grant",):
        return f"grant {env.reqs[event.a].key} -> {peer_name(event.b)}"
    if k in ("finish", "reject"):
        return f"{k} {env.reqs[event.a].key}"
    if k == "reuse":
        return f"a new request arrives with {env.reqs[event.a].key}'s id"
    if k == "share":
        return f"admit r{env.admitted + 1} sharing {env.reqs[event.a].key}'s blocks"
    if k in ("land", "fail"):
        g = env.grants[event.a]
        return f"{k} transfer {event.b + 1} of grant #{g.grant.id.serial}"
    if k in ("post", "stop", "quiesce", "complete", "retry", "lease", "silent"):
        return f"{k} grant #{env.grants[event.a].grant.id.serial}"
    if k in PEER_EVENTS or k == "reclaim":
        return f"{k} {peer_name(event.a)}"
    if k == "lie":
        return f"lie: {lie_text(env, config, lie_table(env, config)[event.a])}"
    return k


def run_events(
    config: Config, policy: Policy, events: Iterable[Event], *, checked: bool = True
) -> tuple[State, list[list[str]], Violation | None]:
    """Replay ``events`` from the initial state (on a fresh, by default checked, ledger).

    Returns the last state reached, the notes of each step, and the violation the last step
    produced (or the quiet-state violation of the final state), if any.
    """
    state = initial(config, checked=checked)
    notes: list[list[str]] = []
    evs: Sequence[Event] = list(events)
    for i, ev in enumerate(evs):
        if ev not in enabled(state, config) and ev not in lies(state, config):
            raise ValueError(f"step {i + 1}: {ev} is not enabled")
        try:
            state, n = step(state, ev, config, policy)
        except Broken as b:
            return state, [*notes, b.notes], b.violation
        notes.append(n)
    if not enabled(state, config) and not lie_events(state, config, policy):
        return state, notes, check_quiet(state)
    return state, notes, None
