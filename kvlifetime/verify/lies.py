"""The lying peer (``Fault.LIE``): the lies it may send, and the ledger's answers to them."""

from __future__ import annotations

import contextlib
from typing import Any

import attrs

from kvlifetime.errors import (
    EvidenceError,
    UnauthorizedEvidence,
)
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.source import LOCAL, Source
from kvlifetime.verify.state import (
    RELEASED,
    Config,
    Env,
    Event,
    Fault,
    ModelLedger,
    Policy,
    Snap,
    State,
    peer_name,
)

# ------------------------------------------------------------------ lies


# What a peer acknowledges about a grant (the claims it may make about its own).
ACK_KINDS = ("CancelReceived", "SchedulingStopped", "TransferQuiesced", "TransferCompleted")


@attrs.frozen(slots=True)
class Lie:
    """One piece of evidence a peer may not send (``Fault.LIE``)."""

    sender: int  # the lying peer (the connection it comes in on)
    kind: str  # the evidence class
    grant: int  # env grant index; -1: peer-wide (AccessRevoked / PeerLost about ``subject``)
    subject: int  # the peer the evidence names


def lie_table(env: Env, config: Config) -> list[Lie]:
    """Every lie a peer may send in ``env`` (``Event("lie", i)`` sends the i-th one):

    - each peer: ``AccessRevoked`` about itself (peer-wide), ``PeerLost`` about any peer;
    - about each grant of a request not released: its own peer sends ``AccessRevoked`` and
      ``LeaseExpired`` for it; every other peer sends each acknowledgement (``ACK_KINDS``, with
      the most transfers a peer may post, ``Config.transfers_per_grant``, as its sequence
      number: the strongest claim) both in the grant's peer's name and in its own.

    Lies about a released request's grants are left out: the ledger has forgotten them and
    refuses them as stale whoever sends them (and the search omits refused lies anyway).
    """
    out: list[Lie] = []
    for p in range(config.peers):
        out.append(Lie(p, "AccessRevoked", -1, p))
        out.extend(Lie(p, "PeerLost", -1, q) for q in range(config.peers))
    for gi, g in enumerate(env.grants):
        if env.reqs[g.req].phase == RELEASED:
            continue
        q = g.peer
        out.append(Lie(q, "AccessRevoked", gi, q))
        out.append(Lie(q, "LeaseExpired", gi, q))
        for p in range(config.peers):
            if p != q:
                for kind in ACK_KINDS:
                    out.append(Lie(p, kind, gi, q))  # in the grant's peer's name
                    out.append(Lie(p, kind, gi, p))  # in its own name, about another's grant
    return out


def wire_source(policy: Policy, p: int) -> Source:
    """The source a receiver stamps on evidence that came in on peer ``p``'s connection."""
    return LOCAL if policy.believes_the_wire else Source.peer(peer_name(p))


def lies(state: State, config: Config) -> list[Event]:
    """Every lie enabled in ``state`` (``Fault.LIE``), refused no-ops included."""
    if Fault.LIE not in config.faults:
        return []
    return [Event("lie", i) for i in range(len(lie_table(state.env, config)))]


def lie_evidence(env: Env, config: Config, lie: Lie, policy: Policy) -> Evidence:
    """The evidence ``lie`` puts on the wire, as the receiver stamps it."""
    src = wire_source(policy, lie.sender)
    if lie.grant < 0:
        name = peer_name(lie.subject)
        if lie.kind == "AccessRevoked":
            return AccessRevoked(name, source=src)
        return PeerLost(name, source=src)
    g = env.grants[lie.grant]
    gid, req = g.grant.id, g.grant.request
    if lie.kind == "AccessRevoked":
        return AccessRevoked(g.grant.peer, gid, req, source=src)
    if lie.kind == "LeaseExpired":
        return LeaseExpired(gid, req, g.grant.peer, source=src)
    name = peer_name(lie.subject)
    if lie.kind == "CancelReceived":
        return CancelReceived(gid, req, name, source=src)
    cls = _SEQ_ACKS[lie.kind]
    return cls(gid, req, name, config.transfers_per_grant, source=src)


_SEQ_ACKS: dict[str, type[SchedulingStopped | TransferQuiesced | TransferCompleted]] = {
    "SchedulingStopped": SchedulingStopped,
    "TransferQuiesced": TransferQuiesced,
    "TransferCompleted": TransferCompleted,
}

# The lies of an environment, built once per signature (peers, receiver, the grants they
# name): building evidence costs more than the ledger takes to refuse it.
_LIE_CACHE: dict[Any, tuple[tuple[Lie, Evidence], ...]] = {}


def _lie_signature(env: Env, config: Config, policy: Policy) -> Any:
    return (
        config.peers,
        config.transfers_per_grant,
        policy.believes_the_wire,
        tuple(
            (gi, g.grant.id, g.grant.request, g.peer)
            for gi, g in enumerate(env.grants)
            if env.reqs[g.req].phase != RELEASED
        ),
    )


def _lies_with_evidence(
    env: Env, config: Config, policy: Policy, sig: Any
) -> tuple[tuple[Lie, Evidence], ...]:
    got = _LIE_CACHE.get(sig)
    if got is None:
        if len(_LIE_CACHE) > 65_536:
            _LIE_CACHE.clear()
        got = tuple((lie, lie_evidence(env, config, lie, policy)) for lie in lie_table(env, config))
        _LIE_CACHE[sig] = got
    return got


def lie_text(env: Env, config: Config, lie: Lie) -> str:
    """Who lies, and what it says."""
    if lie.grant < 0:
        return f"{peer_name(lie.sender)} sends {lie.kind}({peer_name(lie.subject)})"
    g = env.grants[lie.grant]
    seq = config.transfers_per_grant
    name = f"grant #{g.grant.id.serial} of {peer_name(g.peer)}"
    arg = {
        "SchedulingStopped": f", last_seq={seq}",
        "TransferCompleted": f", last_seq={seq}",
        "TransferQuiesced": f", through_seq={seq}",
    }.get(lie.kind, "")
    who = f", in the name of {peer_name(lie.subject)}" if lie.kind in ACK_KINDS else ""
    return f"{peer_name(lie.sender)} sends {lie.kind}({name}{arg}{who})"


def lie_events(
    state: State, config: Config, policy: Policy, answers: dict[Any, tuple[int, ...]] | None = None
) -> list[Event]:
    """The lies the search must take in ``state``: every lie of ``lie_table`` but those that
    are no-ops here (see "lies" in ``explore.py``).

    Every lie goes to the real ledger (``_ask_lies``: a scratch copy of it). With provenance,
    each must be refused as unauthorized and leave the ledger as it was; one that is not is
    returned, and its step breaks ``provenance``. A receiver that believes the wire
    (``trusting``) takes a lie that changes its ledger as a fault event (it spends the
    ``max_faults`` budget, so none is taken once that is spent); one it refuses (mismatched)
    or that changes nothing (a repeat) is a no-op. The answers depend only on the ledger and
    the lies: ``answers`` (one search's cache) keeps them per observable ledger (its
    ``fingerprint()``, which the unreduced search also keys states by) and lie signature.
    """
    if Fault.LIE not in config.faults:
        return []
    if policy.believes_the_wire and state.env.faults_left == 0:
        return []
    snap = state.snap
    sig = _lie_signature(state.env, config, policy)
    done = snap.lies.get(sig)
    if done is None:
        fkey = (snap.fingerprint(), sig)
        done = None if answers is None else answers.get(fkey)
        if done is None:
            table = _lies_with_evidence(state.env, config, policy, sig)
            done = _ask_lies(snap, table, policy)
            if answers is not None:
                answers[fkey] = done
        snap.lies[sig] = done
    return [Event("lie", i) for i in done]


def _ask_lies(
    snap: Snap, table: tuple[tuple[Lie, Evidence], ...], policy: Policy
) -> tuple[int, ...]:
    """Send every lie of ``table`` to a copy of ``snap``'s ledger; return the indices of those
    that are not no-ops (see ``lie_events``)."""
    believe = policy.believes_the_wire
    base = snap.ledger
    scratch: ModelLedger | None = None
    refused_any = False
    out: list[int] = []
    for i, (_lie, evidence) in enumerate(table):
        if scratch is None:
            scratch = base.copy()
        try:
            scratch.apply(evidence)
        except UnauthorizedEvidence:
            refused_any = True
            continue
        except EvidenceError:
            if believe:
                refused_any = True
                continue
            out.append(i)  # refused, but not as unauthorized: its step breaks provenance
            scratch = None
            continue
        if believe and scratch.fingerprint() == snap.fingerprint():
            continue  # believed, and changes nothing (it was already believed)
        out.append(i)
        scratch = None
    if refused_any and scratch is not None and scratch.fingerprint() != snap.fingerprint():
        # Refused evidence changes nothing (README, "Strict inputs"), else a refused lie
        # is no self-loop and leaving it out is unsound: take each one that changed the ledger
        # (its step breaks).
        out.extend(i for i, (_lie, ev) in enumerate(table) if i not in out and _changes(base, ev))
    return tuple(sorted(out))


def _changes(ledger: ModelLedger, ev: Evidence) -> bool:
    """Whether applying ``ev`` to (a copy of) ``ledger`` changes it, refused or not."""
    scratch = ledger.copy()
    with contextlib.suppress(EvidenceError):
        scratch.apply(ev)
    return scratch.fingerprint() != ledger.fingerprint()
