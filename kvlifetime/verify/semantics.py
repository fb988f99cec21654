"""Taking a step: the owner's calls, the peers, the wire, the release policies, the checks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvlifetime.errors import (
    ContradictoryEvidence,
    EvidenceError,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnauthorizedEvidence,
)
from kvlifetime.evidence import (
    AccessRevoked,
    Evidence,
    LeaseExpired,
    PeerLost,
    about,
)
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import BlockState, RequestState
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
from kvlifetime.verify.state import (
    FAILED,
    FINISHED,
    IN_FLIGHT,
    INCARNATION,
    LANDED,
    LANDED_UNSEEN,
    LIVE,
    PREVIOUS,
    REJECTED,
    RELEASED,
    TO_LEDGER,
    TO_PEER,
    Broken,
    Config,
    Env,
    Event,
    GrantSide,
    Msg,
    Policy,
    ReqSide,
    Snap,
    State,
    Violation,
    initial,
    peer_name,
)

# ------------------------------------------------------------------ taking a step


class _Step:
    """The mutable scratch of one step: a ledger copy made on first need, and the notes."""

    def __init__(self, state: State, config: Config, policy: Policy) -> None:
        self.parent = state
        self.config = config
        self.policy = policy
        self.env = state.env
        self._ledger: BlockLedger | None = None
        self.notes: list[str] = []

    @property
    def ledger(self) -> BlockLedger:
        if self._ledger is None:
            self._ledger = self.parent.snap.ledger.copy()
        return self._ledger

    @property
    def view(self) -> BlockLedger:
        """The ledger for queries: the copy if one was made, else the parent's."""
        return self._ledger if self._ledger is not None else self.parent.snap.ledger

    def call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except KVLifetimeError as e:
            raise Broken(
                "ledger_error", f"{what} raised {type(e).__name__}: {' '.join(str(e).split())}"
            ) from e

    def set_req(self, ri: int, **changes: Any) -> None:
        reqs = list(self.env.reqs)
        reqs[ri] = attrs.evolve(reqs[ri], **changes)
        self.env = attrs.evolve(self.env, reqs=tuple(reqs))

    def set_grant(self, gi: int, **changes: Any) -> None:
        grants = list(self.env.grants)
        grants[gi] = attrs.evolve(grants[gi], **changes)
        self.env = attrs.evolve(self.env, grants=tuple(grants))

    def set_peer(self, pi: int, **changes: Any) -> None:
        peers = list(self.env.peers)
        peers[pi] = attrs.evolve(peers[pi], **changes)
        self.env = attrs.evolve(self.env, peers=tuple(peers))

    def crash(self, p: int) -> None:
        """The first crash event of peer ``p`` (silent, PeerLost, fencing) spends a crash."""
        if not self.env.peers[p].crashed:
            self.set_peer(p, crashed=True)
            self.env = attrs.evolve(self.env, crashes_left=self.env.crashes_left - 1)
            self.notes.append(f"{peer_name(p)} crashes")

    def send(self, msg: Msg) -> None:
        self.env = attrs.evolve(self.env, msgs=(*self.env.msgs, msg))

    def take_msg(self, i: int) -> Msg:
        msgs = self.env.msgs
        self.env = attrs.evolve(self.env, msgs=msgs[:i] + msgs[i + 1 :])
        return msgs[i]

    def apply(self, ev: Evidence, what: str, *, old: bool = False) -> None:
        try:
            self.ledger.apply(ev)
        except MismatchedEvidence as e:
            if not old:
                raise Broken(
                    "ledger_error", f"honest evidence {what} refused: {type(e).__name__}: {e}"
                ) from e
            self.notes.append(f"ledger refuses {what}: it is about the previous incarnation")
        except StaleEvidence:
            self.notes.append(f"ledger refuses {what}: stale (its request was released)")
        except ContradictoryEvidence as e:
            if not self.policy.believes_the_wire:
                raise Broken(
                    "ledger_error", f"honest evidence {what} refused: {type(e).__name__}: {e}"
                ) from e
            # Only a believed lie can contradict an honest peer.
            self.notes.append(f"ledger refuses {what}: it contradicts a lie it believed")
        except EvidenceError as e:
            raise Broken(
                "ledger_error", f"honest evidence {what} refused: {type(e).__name__}: {e}"
            ) from e
        except KVLifetimeError as e:
            raise Broken("ledger_error", f"apply({what}) raised {type(e).__name__}: {e}") from e

    def apply_lie(self, ev: Evidence, what: str) -> bool:
        """Send a lie to the ledger; return whether it changed anything."""
        assert self._ledger is None  # a lie is the step's only ledger call
        try:
            self.ledger.apply(ev)
        except EvidenceError as e:
            changed = self.ledger.fingerprint() != self.parent.snap.fingerprint()
            self._ledger = None  # a refused lie leaves the ledger as it was: keep the parent's
            if changed:
                raise Broken(
                    "provenance", f"the lie ({what}) was refused ({e.kind}) yet changed the ledger"
                ) from e
            if not (isinstance(e, UnauthorizedEvidence) or self.policy.believes_the_wire):
                raise Broken(
                    "provenance",
                    f"the lie ({what}) refused as {type(e).__name__}, not as unauthorized: {e}",
                ) from e
            self.notes.append(f"ledger refuses it: {type(e).__name__}: {' '.join(str(e).split())}")
            return False
        except KVLifetimeError as e:
            raise Broken("ledger_error", f"apply({what}) raised {type(e).__name__}: {e}") from e
        if not self.policy.believes_the_wire:
            raise Broken("provenance", f"the ledger accepted a lie: {what} (stamped {ev.source})")
        if self.env.faults_left > 0:
            self.env = attrs.evolve(self.env, faults_left=self.env.faults_left - 1)
        self.notes.append("the ledger believes it")
        return True

    def snap_view(self) -> Snap:
        """The ledger for queries, as a ``Snap`` (a fresh one for a copy made in this step)."""
        return self.parent.snap if self._ledger is None else Snap(self._ledger)

    def release_as(self, ri: int, ids: Any, how: str) -> None:
        self.set_req(ri, phase=RELEASED)
        self.notes.append(
            f"{how} {self.env.reqs[ri].key}: blocks {list(map(int, ids))} to the pool"
        )


def _evidence(kind: str, g: Grant, value: int) -> Evidence:
    if kind not in ("CancelReceived", "SchedulingStopped", "TransferQuiesced", "TransferCompleted"):
        raise ValueError(f"not an acknowledgement: {kind}")
    return about(g, kind, value)


def msg_text(env: Env, m: Msg) -> str:
    g = env.grants[m.grant]
    name = f"grant #{g.grant.id.serial}"
    if m.kind == "Cancel":
        return f"Cancel({name}) to {peer_name(m.peer)}"
    if m.kind in ("SchedulingStopped", "TransferCompleted"):
        return f"{m.kind}({name}, last_seq={m.value}) from {peer_name(m.peer)}"
    if m.kind == "TransferQuiesced":
        return f"{m.kind}({name}, through_seq={m.value}) from {peer_name(m.peer)}"
    return f"{m.kind}({name}) from {peer_name(m.peer)}"


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
    s = _Step(state, config, policy)
    if s.env.faults_left > 0:
        cost = is_fault(s.env, event)
        if cost:
            s.env = attrs.evolve(s.env, faults_left=s.env.faults_left - cost)
    try:
        if _do(s, event):
            _settle(s)
            _check_progress(s)
    except Broken as b:
        b.notes = s.notes
        raise
    snap = state.snap if s._ledger is None else Snap(s._ledger)
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


def _do(s: _Step, ev: Event) -> bool:
    """Perform the event; return whether the ledger may have changed."""
    env = s.env
    k = ev.kind
    if k == "admit":
        key = f"r{env.admitted + 1}"
        n = s.config.blocks_per_request
        ids = s.call(f"allocate({key!r}, {n})", s.ledger.allocate, key, n)
        blocks = tuple(int(b) for b in ids)
        s.env = attrs.evolve(
            env, reqs=(*env.reqs, ReqSide(key, LIVE, blocks, ())), admitted=env.admitted + 1
        )
        gens = s.ledger.generation(ids).tolist()
        s.notes.append(f"{key} admitted: allocates blocks {list(blocks)} (generations {gens})")
        _check_exclusive(s, len(s.env.reqs) - 1)
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
        s.env = attrs.evolve(env, grants=(*env.grants, GrantSide(g, ev.a, p)))
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
        s.set_req(ev.a, phase=FINISHED)
        s.notes.append(f"{req.key} finished on the owner's side")
        return True
    if k == "reject":
        req = env.reqs[ev.a]
        s.call(f"reject({req.key!r})", s.ledger.reject, req.key, "abort")
        s.set_req(ev.a, phase=REJECTED)
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
        elif _sglang_frees_at_failed(s):
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
        return False
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
            s.env = attrs.evolve(s.env, losses_left=s.env.losses_left - 1)
            s.notes.append(f"lost: {text}")
            return False
        if k == "delay":
            msgs = list(env.msgs)
            msgs[ev.a] = attrs.evolve(m, delayed=True)
            s.env = attrs.evolve(env, msgs=tuple(msgs), delays_left=env.delays_left - 1)
            s.notes.append(f"delayed: {text} (it may now arrive after anything else)")
            return False
        if k == "duplicate":
            # Delivered now, and a copy (never duplicated again) stays on the wire for later.
            msgs = list(env.msgs)
            msgs[ev.a] = attrs.evolve(m, dupable=False, delayed=True)
            s.env = attrs.evolve(env, msgs=tuple(msgs), dups_left=env.dups_left - 1)
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
        s.env = attrs.evolve(
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


def _restart(s: _Step) -> None:
    """The owner's process restarts over the same arena: a new ledger (a new incarnation),
    every request of the old one gone on the owner's side; the peers know nothing of it."""
    env = s.env
    n = env.incarnation + 1
    inc = f"{INCARNATION}-{n}"
    checked = s.parent.snap.ledger.checked
    if s.policy is Policy.FRESH_RESTART:
        s._ledger = BlockLedger(s.config.blocks, checked=checked, incarnation=inc)
        how = "a fresh ledger: every block free"
    else:
        names = [peer_name(p) for p in range(s.config.peers)]
        s._ledger = s.call(
            "after_restart",
            BlockLedger.after_restart,
            s.config.blocks,
            peers=names,
            request=PREVIOUS,
            checked=checked,
            incarnation=inc,
        )
        how = (
            "BlockLedger.after_restart: every block quarantined (previous incarnation) until "
            f"each of {', '.join(names)} is fenced"
        )
    s.env = attrs.evolve(
        env,
        reqs=tuple(attrs.evolve(r, phase=RELEASED) for r in env.reqs),
        grants=tuple(attrs.evolve(g, old=True) for g in env.grants),
        peers=tuple(attrs.evolve(p, lost_reported=False) for p in env.peers),
        restarts_left=env.restarts_left - 1,
        incarnation=n,
    )
    s.notes.append(
        f"the owner restarts (incarnation {inc}) over the same arena: {how}; the old "
        "requests are gone on its side, their grants live on at the peers"
    )


def _settle(s: _Step) -> None:
    """The engine's release policy, run after every step that may have changed the ledger."""
    if s._ledger is None:
        return
    led = s._ledger
    if s.policy is Policy.TIMEOUT:
        for ri, r in enumerate(s.env.reqs):
            if r.phase in (FINISHED, REJECTED) and led.state(r.key) is RequestState.QUARANTINED:
                ids = s.call(f"force_release({r.key!r})", led.force_release, r.key, "lease reaper")
                s.release_as(ri, ids, "lease reaper (timeout policy) releases")
    if s.policy is Policy.FIRST_RANK:
        for ri, r in enumerate(s.env.reqs):
            if r.phase in (FINISHED, REJECTED) and _one_rank_closed_per_peer(s, r.grants):
                ids = s.call(
                    f"force_release({r.key!r})", led.force_release, r.key, "first rank done"
                )
                s.release_as(ri, ids, "first-rank policy (one rank closed per peer) releases")
    if s.policy is Policy.SGLANG_0_5_23 and s.config.access is Access.WRITE:
        for ri, r in enumerate(s.env.reqs):
            if r.phase == REJECTED and _sglang_deadline_passed(s, r):
                ids = s.call(
                    f"force_release({r.key!r})",
                    led.force_release,
                    r.key,
                    "sglang-0.5.23: deferred release timed out without a full drain ack",
                )
                s.release_as(
                    ri,
                    ids,
                    "sglang-0.5.23's decode (deadline passed without every rank's drain ACK: "
                    '"releasing anyway") releases',
                )
    freed = s.call("collect_releasable()", led.collect_releasable)
    for key, ids in freed.items():
        if key == PREVIOUS:
            s.notes.append(
                f"collect_releasable reclaims blocks {list(map(int, ids))} of the previous "
                "incarnation: every peer is fenced"
            )
            continue
        ri = next(i for i, r in enumerate(s.env.reqs) if r.key == key)
        s.release_as(ri, ids, "collect_releasable releases")


def _sglang_frees_at_failed(s: _Step) -> bool:
    """SGLang 0.5.23's prefill frees the source pages its transfer worker reads (READ grants)
    as soon as the sender's poll says Failed (``handle_inflight_transfer_failure``), which it
    does at the abort, with a chunk still in flight."""
    return s.policy is Policy.SGLANG_0_5_23 and s.config.access is Access.READ


def _sglang_deadline_passed(s: _Step, r: ReqSide) -> bool:
    """SGLang 0.5.23's decode, ``resolve_deferred_releases``: ``ready = drained or now >=
    deadline``. Drained (every rank's grant closed) is ``collect_releasable``'s; this is the
    other half: a grant is still open and the held entry's one deadline, started at the abort
    as every lease of ``r`` is, has passed (the first of ``r``'s leases fired)."""
    return bool(s.view.open_grants(r.key)) and any(s.env.grants[gi].lease_fired for gi in r.grants)


def _one_rank_closed_per_peer(s: _Step, grants: tuple[int, ...]) -> bool:
    """Whether a grant is still open while each peer has one closed (what an engine that
    tracks one transfer per request and peer takes for the end)."""
    led = s.view
    closed: dict[int, bool] = {}
    some_open = False
    for gi in grants:
        g = s.env.grants[gi]
        c = led.proof_of(g.grant).closed
        some_open = some_open or not c
        closed[g.peer] = closed.get(g.peer, False) or c
    return some_open and all(closed.values())


def _check_progress(s: _Step) -> None:
    led = s.view
    for r in s.env.reqs:
        if r.phase in (FINISHED, REJECTED) and not led.open_grants(r.key):
            raise Broken(
                "progress",
                f"{r.key} has every grant closed but is still held in state "
                f"{led.state(r.key).value}: collect_releasable did not release it",
            )


def _check_exclusive(s: _Step, ri: int) -> None:
    new = s.env.reqs[ri]
    for other in s.env.reqs:
        if other is new or other.phase == RELEASED:
            continue
        both = set(other.blocks) & set(new.blocks)
        if both:
            raise Broken(
                "exclusivity",
                f"blocks {sorted(both)} handed to {new.key} while {other.key} still holds them",
            )


def check_quiet(state: State) -> Violation | None:
    """No leak: in a state where nothing can happen any more, every block is free or
    quarantined with a reason."""
    led = state.snap.ledger
    bs = led.block_state(np.arange(led.num_blocks))
    bad = [
        (b, BlockState(int(c)).label)
        for b, c in enumerate(bs.tolist())
        if c not in (BlockState.FREE, BlockState.QUARANTINED)
    ]
    if bad:
        return Violation(
            "no_leak",
            "quiet state with blocks neither free nor quarantined: "
            + ", ".join(f"block {b} {lab}" for b, lab in bad),
        )
    for q in led.stats().quarantined:
        if not q.reason:
            return Violation("no_leak", f"{q.request} quarantined without a reason")
    return None


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
