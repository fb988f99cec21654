"""The environment around a real ``BlockLedger``: requests, peers, a faulty control channel.

The explorer (``explore.py``) never models the ledger: every owner call and every piece of
evidence goes to a real ``BlockLedger``, copied before it changes (``BlockLedger.copy``). What is
modelled here is only what the ledger cannot see — the peers, their transfers, the messages on
the wire — and the *release policy* of the engine around it:

- ``naive``: the engine frees the blocks when it rejects / aborts the request (the error response
  is read as the end of the blocks' life);
- ``timeout``: the engine frees the blocks when a deadline passes (a lease reaper:
  ``force_release`` of every quarantined request);
- ``proof``: the engine frees only what ``collect_releasable()`` returns;
- ``trusting``: as ``proof``, but its receiver has no provenance: it stamps the evidence it
  decodes from the wire as local (it believes whatever a peer says, about anyone).

Evidence a peer sends carries the transport's identity of its connection
(``Source.peer("p1")``) under every policy but ``trusting``; what the process makes itself (a
fencing's ``AccessRevoked``, the clock's ``LeaseExpired``, the failure detector's ``PeerLost``)
stays ``LOCAL``. With the ``lie`` fault any peer may, at any point, send what it may not claim
(``lie_table``); the ledger's provenance rules must refuse it, and a refused lie changes nothing
(see "lies" in ``explore.py``).

Every policy also calls ``collect_releasable()`` after each step (the scheduler loop): they
differ only in the extra, unsafe releases.

Why the peers behave as they do (the table in ``kvlifetime.adapters.mooncake``): a transfer that
reported FAILED may still land later; a crashed peer's transfers already in flight still land unless
it was fenced; only fencing (``AccessRevoked``) stops them, atomically with the evidence: a write
that arrives after the fencing touches nothing. A crash is seen grant by grant: the peer goes silent
on each of its grants at that grant's own moment (the crash that silences them all at once is one of
those runs), and its heartbeat fails (``PeerLost``).

A state is immutable: ``step`` returns a new one. Steps that do not touch the ledger (a peer
posts, a transfer lands, a message is duplicated) share the parent's ledger object, so most
successors cost no ledger copy at all.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvlifetime.errors import (
    ContradictoryEvidence,
    EvidenceError,
    KVLifetimeError,
    StaleEvidence,
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
    about,
)
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger
from kvlifetime.machines import BlockState, RequestState
from kvlifetime.source import LOCAL, Source

INCARNATION = "verify"  # fixed, so that a replayed trace issues the same grant ids


class Policy(enum.Enum):
    """When the engine around the ledger lets blocks go back to the pool."""

    NAIVE = "naive"  # release on rejection / abort
    TIMEOUT = "timeout"  # release when a deadline passes (lease reaper)
    PROOF = "proof"  # release only what the evidence proves (collect_releasable)
    # As proof, with a receiver that has no provenance: wire evidence is stamped local, so the
    # ledger believes every claim a peer sends (a lie included). Refuted with the lie fault.
    TRUSTING = "trusting"

    @property
    def believes_the_wire(self) -> bool:
        """Whether the receiver stamps wire evidence as local (no provenance)."""
        return self is Policy.TRUSTING


class Fault(enum.Enum):
    """What the environment may do wrong. Each one adds events; none removes any."""

    REORDER = "reorder"  # messages overtake each other (else FIFO per channel)
    DUPLICATE = "duplicate"  # a message is delivered twice
    DELAY = "delay"  # a message waits while its request moves on (else delivered first)
    LOSS = "loss"  # a message is dropped
    # A peer crashes: it goes silent on each of its grants (never posts, answers or reports for
    # it again; its transfers in flight still land), and its heartbeat fails (PeerLost).
    CRASH = "crash"
    FENCE = "fence"  # a crashed peer is fenced: AccessRevoked; later writes touch nothing
    TIMEOUT = "timeout"  # a lease expires while the peer may still be working
    RETRY = "retry"  # the owner re-sends a cancel; the peer answers with what it knows now
    FAIL = "fail"  # a transfer reports FAILED and may still land later
    # A peer lies: at any point it sends evidence it may not make (``lie_table``): AccessRevoked
    # about itself, PeerLost / LeaseExpired, a claim about another peer's grant or in its name.
    LIE = "lie"


ALL_FAULTS: frozenset[Fault] = frozenset(Fault)


def parse_faults(text: str) -> frozenset[Fault]:
    """``"reorder,loss"``, ``"all"`` or ``"none"`` / ``""``. Unknown names raise ``ValueError``."""
    text = text.strip()
    if text in ("", "none"):
        return frozenset()
    if text == "all":
        return ALL_FAULTS
    out: set[Fault] = set()
    for name in text.split(","):
        name = name.strip()
        try:
            out.add(Fault(name))
        except ValueError:
            known = ", ".join(f.value for f in Fault)
            raise ValueError(f"unknown fault {name!r} (known: {known}, all, none)") from None
    if Fault.FENCE in out:
        out.add(Fault.CRASH)  # only a crashed peer is fenced
    return frozenset(out)


@attrs.frozen(slots=True)
class Config:
    """The bounds of one exploration. Every bound keeps the state space finite."""

    requests: int = 2  # requests ever admitted (a later one reuses an earlier one's blocks)
    peers: int = 2
    blocks: int = 2
    faults: frozenset[Fault] = ALL_FAULTS
    blocks_per_request: int = 1
    transfers_per_grant: int = 1  # numbered transfers a peer may post per grant
    max_duplicates: int = 1  # duplicated messages, in the whole run
    max_delays: int = 1  # messages held back while anything else happens, in the whole run
    max_losses: int = 1  # lost messages, in the whole run
    max_crashes: int = 1  # crashed peers, in the whole run
    max_retries: int = 1  # re-sent cancels per grant
    # At most this many fault events of any kind in one run (None: only the per-kind bounds).
    # Counted: lose, duplicate, delay, a reordered delivery (a message overtaking an earlier one
    # on its channel), crash, fail, retry, a lease that expires while anything else could
    # still happen (an early deadline), and a lie that a trusting receiver believes. Not counted:
    # what follows a crash (PeerLost, fencing), a lease that expires when nothing else can
    # happen (every policy's generous deadline), and a lie the ledger refuses (a no-op).
    max_faults: int | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("requests", "peers", "blocks", "blocks_per_request"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in (
            "transfers_per_grant",
            "max_duplicates",
            "max_delays",
            "max_losses",
            "max_crashes",
            "max_retries",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.max_faults is not None and (
            not isinstance(self.max_faults, int) or self.max_faults < 0
        ):
            raise ValueError(f"max_faults must be None or an int >= 0, got {self.max_faults!r}")
        if self.blocks_per_request > self.blocks:
            raise ValueError("blocks_per_request must be <= blocks")

    def describe(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "peers": self.peers,
            "blocks": self.blocks,
            "faults": sorted(f.value for f in self.faults),
            "blocks_per_request": self.blocks_per_request,
            "transfers_per_grant": self.transfers_per_grant,
            "max_duplicates": self.max_duplicates,
            "max_delays": self.max_delays,
            "max_losses": self.max_losses,
            "max_crashes": self.max_crashes,
            "max_retries": self.max_retries,
            "max_faults": self.max_faults,
        }


# ------------------------------------------------------------------ environment state

# Request phases on the owner's side (the ledger has its own, finer states).
LIVE, FINISHED, REJECTED, RELEASED = "live", "finished", "rejected", "released"

# Transfer status codes, per numbered transfer of a grant.
IN_FLIGHT = 0  # posted; will touch the blocks when it lands
FAILED = 1  # reported FAILED, yet may still land (Mooncake: a FAILED batch keeps writing)
LANDED = 2  # wrote and ended; the peer saw it complete
LANDED_UNSEEN = 3  # a FAILED transfer that landed: the peer never learns that it ended

TO_PEER, TO_LEDGER = 0, 1


@attrs.frozen(slots=True)
class ReqSide:
    key: str
    phase: str  # LIVE / FINISHED / REJECTED / RELEASED
    blocks: tuple[int, ...]  # what allocate returned
    grants: tuple[int, ...]  # env grant indices, one per peer granted


@attrs.frozen(slots=True)
class GrantSide:
    """One grant as the peer and the wire see it (the ledger keeps its own record)."""

    grant: Grant = attrs.field(eq=False)
    req: int  # index in Env.reqs
    peer: int
    transfers: tuple[int, ...] = ()  # status per sequence number (seq = index + 1)
    cancelled: bool = False  # the peer received a cancel
    stopped: bool = False  # the peer stopped scheduling (and said so)
    quiesced_sent: bool = False  # TransferQuiesced / TransferCompleted sent
    lease_fired: bool = False
    retries: int = 0
    silent: bool = False  # the peer crashed, as this grant sees it: it never acts on it again


@attrs.frozen(slots=True)
class PeerSide:
    crashable: bool = False  # may crash (see ``initial``)
    # Crashed: the crash budget is spent on it. From then on each of its grants may go silent,
    # and its heartbeat may fail (PeerLost) and it may be fenced, at no further cost.
    crashed: bool = False
    fenced: bool = False
    lost_reported: bool = False


@attrs.frozen(slots=True)
class Msg:
    dest: int  # TO_PEER (a cancel) or TO_LEDGER (evidence)
    peer: int
    kind: str  # "Cancel" or an evidence class name
    grant: int  # env grant index
    value: int  # last_seq / through_seq; 0 otherwise
    dupable: bool = True  # a message is duplicated at most once
    delayed: bool = False  # held back: its request may move on before it arrives


@attrs.frozen(slots=True)
class Env:
    reqs: tuple[ReqSide, ...] = ()
    grants: tuple[GrantSide, ...] = ()
    msgs: tuple[Msg, ...] = ()
    peers: tuple[PeerSide, ...] = ()
    admitted: int = 0
    dups_left: int = 0
    delays_left: int = 0
    losses_left: int = 0
    crashes_left: int = 0
    faults_left: int = -1  # Config.max_faults still unspent; -1: no total bound


class Snap:
    """A ledger that no one mutates any more, with the queries the explorer keeps asking."""

    __slots__ = ("_fp", "_gens", "_proofs", "_stale", "_states", "ledger", "lies")

    def __init__(self, ledger: BlockLedger) -> None:
        self.ledger = ledger
        self.lies: dict[Any, tuple[int, ...]] = {}  # lie signature -> the lies not no-ops
        self._fp: tuple[Any, ...] | None = None
        self._gens: list[int] | None = None
        self._states: dict[str, str] = {}
        self._proofs: dict[int, tuple[Any, ...]] = {}
        self._stale: dict[int, bool] = {}

    def fingerprint(self) -> tuple[Any, ...]:
        if self._fp is None:
            self._fp = self.ledger.fingerprint()
        return self._fp

    def state(self, key: str) -> str:
        s = self._states.get(key)
        if s is None:
            s = self.ledger.state(key).value
            self._states[key] = s
        return s

    def proof(self, g: Grant) -> tuple[Any, ...]:
        """The grant's proof as a hashable value with one type per position."""
        p = self._proofs.get(g.id.serial)
        if p is None:
            pr = self.ledger.proof_of(g)
            cr, last, through, revoked, suspect = pr.key()
            p = (cr, -1 if last is None else last, through, revoked, suspect or "", pr.closed)
            self._proofs[g.id.serial] = p
        return p

    def stale(self, g: Grant) -> bool:
        """Whether a write for ``g`` would now touch a later generation of its blocks."""
        s = self._stale.get(g.id.serial)
        if s is None:
            if self._gens is None:
                self._gens = self.ledger.generation(np.arange(self.ledger.num_blocks)).tolist()
            now = self._gens
            pairs = zip(g.blocks.tolist(), g.generations.tolist(), strict=True)
            s = any(now[b] != x for b, x in pairs)
            self._stale[g.id.serial] = s
        return s


@attrs.frozen(slots=True)
class State:
    snap: Snap = attrs.field(eq=False)
    env: Env


@attrs.frozen(slots=True)
class Event:
    """One step of the environment. ``a``/``b`` index into the state it is taken from."""

    kind: str
    a: int = -1
    b: int = -1

    def to_list(self) -> list[Any]:
        return [self.kind, self.a, self.b]


@attrs.frozen(slots=True)
class Violation:
    invariant: str  # isolation / exclusivity / no_leak / progress / ledger_error
    message: str


class Broken(Exception):
    """Raised inside a step when an invariant breaks; the explorer turns it into a Violation."""

    def __init__(self, invariant: str, message: str) -> None:
        self.violation = Violation(invariant, message)
        self.notes: list[str] = []  # what the breaking step did, up to the break
        super().__init__(message)


INVARIANTS: dict[str, str] = {
    "isolation": "no transfer for generation g touches a block after g was released",
    "exclusivity": "no block is owned by two requests",
    "no_leak": "in a quiet state every block is free, or quarantined with a reason",
    "progress": "a request whose grants are all closed can be released",
    "provenance": "no evidence from a source that may not make it changes the ledger (a lying "
    "peer's claims are refused as unauthorized)",
    "ledger_error": "the ledger refuses a call the contract allows (a kvlifetime bug)",
}


def peer_name(i: int) -> str:
    return f"p{i + 1}"


def initial(config: Config, *, checked: bool = False, crash_first: bool = False) -> State:
    """The state before anything happened. ``crash_first``: only the first
    ``config.max_crashes`` peers may crash (a reduction: see "which peers crash" in
    ``explore.py``); else any peer may."""
    ledger = BlockLedger(config.blocks, checked=checked, incarnation=INCARNATION)
    env = Env(
        peers=tuple(
            PeerSide(
                crashable=Fault.CRASH in config.faults
                and (not crash_first or i < config.max_crashes)
            )
            for i in range(config.peers)
        ),
        dups_left=config.max_duplicates if Fault.DUPLICATE in config.faults else 0,
        delays_left=config.max_delays if Fault.DELAY in config.faults else 0,
        losses_left=config.max_losses if Fault.LOSS in config.faults else 0,
        crashes_left=config.max_crashes if Fault.CRASH in config.faults else 0,
        faults_left=-1 if config.max_faults is None else config.max_faults,
    )
    return State(Snap(ledger), env)


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
    held = sum(len(r.blocks) for r in env.reqs if r.phase != RELEASED)
    if env.admitted < config.requests and config.blocks - held >= config.blocks_per_request:
        out.append(Event("admit"))
    for ri, r in enumerate(env.reqs):
        if r.phase == LIVE and ri not in blocked:
            granted = {env.grants[gi].peer for gi in r.grants}
            for p in range(config.peers):
                if p not in granted and not (env.peers[p].lost_reported or env.peers[p].fenced):
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
_BUDGETED = frozenset({"fail", "retry", "lose", "duplicate", "delay", "lease", "silent"})


def may_crash(env: Env, p: int) -> bool:
    """Whether peer ``p`` has crashed or may still (its crash events are then enabled): a
    crashable peer, and the budgets still cover a crash if it has not happened yet."""
    ps = env.peers[p]
    if ps.crashed:
        return True
    return ps.crashable and bool(env.crashes_left) and env.faults_left != 0


def _lost_possible(env: Env, p: int) -> bool:
    """Whether a ``PeerLost`` of peer ``p`` may still be reported (now or later)."""
    return not env.peers[p].lost_reported and may_crash(env, p)


def _fence_possible(env: Env, config: Config, p: int) -> bool:
    """Whether peer ``p`` may still be fenced (now or later)."""
    ps = env.peers[p]
    return Fault.FENCE in config.faults and not ps.fenced and may_crash(env, p)


def _peer_may_act(env: Env, config: Config, p: int) -> bool:
    """Whether a PeerLost or a fencing of peer ``p`` is enabled now or may be later."""
    return _lost_possible(env, p) or _fence_possible(env, config, p)


def _fences_may_close(env: Env, config: Config, peers: set[int]) -> bool:
    """Whether one path of crashes and fencings may fence every peer in ``peers`` (nonempty):
    every one can still be fenced, and the crash budgets cover those not yet crashed."""
    if not peers or not all(_fence_possible(env, config, p) for p in peers):
        return False
    need = sum(not env.peers[p].crashed for p in peers)
    return need <= env.crashes_left and (env.faults_left < 0 or need <= env.faults_left)


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
    scratch: BlockLedger | None = None
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


def _changes(ledger: BlockLedger, ev: Evidence) -> bool:
    """Whether applying ``ev`` to (a copy of) ``ledger`` changes it, refused or not."""
    scratch = ledger.copy()
    with contextlib.suppress(EvidenceError):
        scratch.apply(ev)
    return scratch.fingerprint() != ledger.fingerprint()


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
    condition (a) in its strict form (no peer ``r`` may use can still be lost or fenced).
    """
    env = state.env
    if not env.reqs or len(events) < 2:
        return events
    if policy is not None and policy.believes_the_wire and Fault.LIE in config.faults:
        # A believed lie is a peer-wide event that may close or quarantine any request's grant
        # at any moment: no request is isolated (explore.py, "lies").
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
    return not any(_peer_may_act(env, config, p) for p in peers)


def _isolated(
    state: State,
    config: Config,
    ri: int,
    evs: list[Event],
    after: Callable[[Event], State | None],
) -> bool:
    """Condition (a), relaxed (policies proof and naive): no peer-wide event that may still
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
    ) and _fences_may_close(env, config, open_peers):
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
        if not quarantined and _lost_possible(env, p):
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
    if e.kind in _BUDGETED or _overtakes(env, e):
        return False
    if e.kind == "grant":
        return not _peer_may_act(env, config, e.b)
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

    def apply(self, ev: Evidence, what: str) -> None:
        try:
            self.ledger.apply(ev)
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
            Access.WRITE,
        )
        gi = len(env.grants)
        s.env = attrs.evolve(env, grants=(*env.grants, GrantSide(g, ev.a, p)))
        s.set_req(ev.a, grants=(*req.grants, gi))
        s.notes.append(
            f"{req.key} grants blocks {g.blocks.tolist()} (generations "
            f"{g.generations.tolist()}) to {peer_name(p)} for writing: grant #{g.id.serial}"
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
            f"#{g.grant.id.serial} (writes blocks {g.grant.blocks.tolist()} at generations "
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
        now = s.view.generation(g.grant.blocks)
        s.notes.append(
            f"transfer {ev.b + 1} of grant #{g.grant.id.serial} lands in blocks "
            f"{g.grant.blocks.tolist()} (written for generations {g.grant.generations.tolist()}, "
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
                f"a write for {g.grant.request} (grant #{g.grant.id.serial}, generations "
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
        s.apply(attrs.evolve(evd, source=wire_source(s.policy, m.peer)), text)
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
    raise ValueError(f"unknown event kind {k!r}")


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
    freed = s.call("collect_releasable()", led.collect_releasable)
    for key, ids in freed.items():
        ri = next(i for i, r in enumerate(s.env.reqs) if r.key == key)
        s.release_as(ri, ids, "collect_releasable releases")


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
    if k in ("land", "fail"):
        g = env.grants[event.a]
        return f"{k} transfer {event.b + 1} of grant #{g.grant.id.serial}"
    if k in ("post", "stop", "quiesce", "complete", "retry", "lease", "silent"):
        return f"{k} grant #{env.grants[event.a].grant.id.serial}"
    if k in PEER_EVENTS:
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
