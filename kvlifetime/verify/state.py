"""The model's values: configuration, policies, fault kinds, and the state of the environment.

See ``kvlifetime.verify.model`` for what the model is, and ``docs/verification.md``.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.errors import KVLifetimeError
from kvlifetime.evidence import Evidence
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec import owner as _owner
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.vocabulary import RequestState
from kvlifetime.verify.rebuild import evolve as evolve
from kvlifetime.verify.rebuild import pickle_by_fields

INCARNATION = "verify"  # fixed, so that a replayed trace issues the same grant ids
# The request that holds the arena for the previous incarnation after a restart.
PREVIOUS = "previous-incarnation"


class Policy(enum.Enum):
    """When the engine around the ledger lets blocks go back to the pool."""

    NAIVE = "naive"  # release on rejection / abort
    TIMEOUT = "timeout"  # release when a deadline passes (lease reaper)
    PROOF = "proof"  # release only what the evidence proves (collect_releasable)
    # As proof, with a receiver that has no provenance: wire evidence is stamped local, so the
    # ledger believes every claim a peer sends (a lie included). Refuted with the lie fault.
    TRUSTING = "trusting"
    # As proof, with an engine that tracks one transfer per request and peer, not per rank: it
    # frees a request once one grant (rank) of each of its peers is closed. Refuted with
    # Config.ranks >= 2.
    FIRST_RANK = "first-rank"
    # As proof, but a restart (Config.restarts) starts a fresh ledger with every block free,
    # as if no peer of the old process could still reach the arena. Refuted with restarts=1.
    FRESH_RESTART = "fresh-restart"
    # As proof, but a prefix-cache hit is kept in the engine's own cache only: the ledger is
    # never told that the new request holds the shared blocks, so it frees them when their
    # first holder lets go. Refuted with Config.share.
    UNTRACKED_SHARE = "untracked-share"
    # SGLang 0.5.23's own rules (disaggregation/decode.py, prefill.py), as far as the model can
    # state them. Push (WRITE grants: the prefill ranks write the decode's pages): an aborted
    # request (every non-success end is a KVPoll.Failed there: a user abort, a prefill failure,
    # the waiting timeout, a lost heartbeat) is held until each of its grants is closed (each
    # rank's generation-matched ABORT_ACK: collect_releasable) or its deferred-release deadline
    # passes (the first lease of its grants), whichever comes first: ``ready = drained or now
    # >= deadline``; then released anyway. Pull (READ grants: the transfer worker reads the
    # source pages): the in-flight queue frees them at KVPoll.Failed, at once (naive). A
    # finish waits for proof (decode runs a request only after KVPoll.Success, every rank
    # done). Refuted with the timeout fault (an early deadline), and with --access read.
    SGLANG_0_5_23 = "sglang-0.5.23"
    # The field's bug classes (docs/verification.md, "The field's bug classes"). vLLM's NIXL
    # receiver before #56104: the first transfer of a request to report FAILED ends it and
    # frees its blocks while its other transfers (sibling handles, one per remote rank) may
    # still write. Refuted with the fail fault (ranks 2: the sibling).
    FIRST_FAILURE = "first-failure"
    # Completion notices counted per request, not per grant (vLLM #51786 MultiConnector,
    # vllm-ascend #14407): once as many notices as the request has grants have arrived, the
    # engine takes its transfers as over; a notice delivered twice, or one channel's counted
    # for another's, frees the blocks a grant still writes. Refuted with the duplicate fault
    # and two grants.
    COUNTED_COMPLETIONS = "counted-completions"
    # A head-of-line reaper (vLLM #58222, #50789: ``_reqs_to_send`` scanned from its head,
    # stopping at the first entry not yet over): ended requests are released in the order
    # they ended, and the walk stops at the first one not provably over, stranding every
    # releasable request behind it. Refuted (progress) with two requests, no fault needed.
    ORDERED_REAPER = "ordered-reaper"
    # A transfer table keyed by the client's request id (vLLM #49796): a new request with the
    # id of an ended one still held takes its entry, and the old request's blocks are freed
    # to make room (the worker-side defence of #49796) while its transfer may still land.
    # Refuted with Config.reuse_ids; under every other policy the ledger refuses the
    # duplicate id (DuplicateRequest) and the new request is turned away before admission.
    ID_OVERWRITE = "id-overwrite"

    @property
    def believes_the_wire(self) -> bool:
        """Whether the receiver stamps wire evidence as local (no provenance)."""
        return self is Policy.TRUSTING


# What each policy frees, in one line: the command line's help and the verdict's header.
POLICY_RULES: dict[Policy, str] = {
    Policy.NAIVE: "frees a request's blocks when it rejects / aborts it",
    Policy.TIMEOUT: "frees a quarantined request at once (a lease reaper)",
    Policy.PROOF: "frees only what the evidence proves (collect_releasable)",
    Policy.TRUSTING: "as proof, with a receiver that stamps wire evidence as local (no "
    "provenance); refuted with --faults lie",
    Policy.FIRST_RANK: "as proof, but one closed grant per peer frees the request; refuted "
    "with --ranks 2",
    Policy.FRESH_RESTART: "as proof, but a restart starts with every block free; refuted with "
    "--restarts 1",
    Policy.UNTRACKED_SHARE: "as proof, but a prefix hit is kept in the engine's cache only, "
    "not told to the ledger; refuted with --share",
    Policy.FIRST_FAILURE: "as proof, but the first transfer of a request to report FAILED "
    "ends the request and frees its blocks (vLLM's NIXL receiver before #56104: sibling "
    "handles may still write); refuted with --faults fail",
    Policy.COUNTED_COMPLETIONS: "as proof, but completion notices are counted per request, "
    "and an ended request with as many notices as grants is freed (vLLM #51786 "
    "MultiConnector); refuted with --faults duplicate and two grants",
    Policy.ORDERED_REAPER: "as proof, but ended requests are released in the order they "
    "ended, stopping at the first not provably over (vLLM #58222 / #50789: a head-of-line "
    "lease reaper); refuted with two requests (progress)",
    Policy.ID_OVERWRITE: "as proof, but a new request with the id of an ended one still held "
    "takes its entry and the old one's blocks are freed (vLLM #49796, client-chosen ids); "
    "refuted with --reuse-ids",
    Policy.SGLANG_0_5_23: "SGLang 0.5.23's decode: an aborted request's pages are held until "
    "every prefill rank's drain ACK (every grant closed) or the deferred-release deadline (a "
    "lease), whichever comes first, then released (ready = drained or now >= deadline); with "
    "--access read, its prefill: source pages freed at KVPoll.Failed; refuted with --faults "
    "timeout (an early deadline)",
}


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


# The largest shapes the explorer takes, and why; a larger one is refused before the search
# starts (``Config`` raises ``ValueError``; the command line exits 2).
LIMITS: dict[str, tuple[int, str]] = {
    "blocks": (
        4096,
        "every state waiting in the queue holds its own ledger, whose arrays grow with the "
        "blocks (measured: about 70 KB at 4,096 blocks, 1.6 MB at 100,000)",
    ),
    "peers": (
        64,
        "every state names each peer (its flags, and a grant event per live request and peer), "
        "and the symmetry search recurses once per group of alike peers",
    ),
    "requests": (
        4096,
        "every request is a step of every run (admit), so a run is at least this deep",
    ),
    "transfers_per_grant": (64, "each transfer's status is part of every state"),
    "ranks": (8, "every rank is one more grant per request and peer in every state"),
    "restarts": (1, "the model has one previous incarnation (the restart's quarantine)"),
}


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
    # What a grant lets its peer do: WRITE (push: prefill writes decode's blocks) or READ (pull:
    # decode reads prefill's source blocks, as vLLM's NIXL connector does). A read that comes
    # after its blocks were released reads another owner's data: an isolation violation too.
    access: Access = Access.WRITE
    # Grants per request and peer (tensor-parallel ranks: one connection and one grant each;
    # a crash or a fence of the peer reaches all of them).
    ranks: int = 1
    # Times the owner's process restarts over the same arena (0 or 1): its ledger is replaced,
    # the old process's grants live on at the peers (see "restart" in docs/verification.md).
    restarts: int = 0
    # Prefix sharing: a new request may take a live request's blocks shared (a prefix-cache
    # hit) instead of allocating, once their content is settled (every grant on them closed).
    share: bool = False
    # Client-chosen request ids (vLLM #49796): a new request may arrive with the id of an
    # ended request the engine still holds (its transfers may still be in flight).
    reuse_ids: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("requests", "peers", "blocks", "blocks_per_request", "ranks"):
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
            "restarts",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name, (most, why) in LIMITS.items():
            v = getattr(self, name)
            if v > most:
                raise ValueError(
                    f"{name}={v} is more than the explorer can take (at most {most}): {why}"
                )
        if self.max_faults is not None and (
            not isinstance(self.max_faults, int) or self.max_faults < 0
        ):
            raise ValueError(f"max_faults must be None or an int >= 0, got {self.max_faults!r}")
        if not isinstance(self.access, Access):
            raise ValueError(f"access must be an Access, got {self.access!r}")
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
            "access": self.access.value,
            "ranks": self.ranks,
            "restarts": self.restarts,
            "share": self.share,
            "reuse_ids": self.reuse_ids,
        }


# ------------------------------------------------------------------ environment state

# Request phases on the owner's side (the ledger has its own, finer states): the engine-side
# lifecycle's owner view (``kvlifetime.spec.owner``), stepped only by ``owner_step``.
LIVE, FINISHED, REJECTED, RELEASED = _owner.LIVE, _owner.FINISHED, _owner.REJECTED, _owner.RELEASED

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
    shared: bool = False  # its blocks were taken shared (a prefix hit): it grants nothing
    completions: int = 0  # completion notices the engine counted (counted-completions only)
    ended: int = 0  # the n-th request to end, from 1 (ordered-reaper only; else 0)


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
    old: bool = False  # a grant of the owner's previous incarnation (before a restart)


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
    restarts_left: int = 0
    incarnation: int = 0  # restarts so far: the ledger's incarnation is INCARNATION + "-<n>"


class ModelLedger(Protocol):
    """What the model asks of a ledger: the calls ``semantics`` / ``policies`` / ``lies`` make
    and the queries the keys read. ``BlockLedger`` (the real one, ``engine="ledger"``) and
    ``packed.PackedLedger`` (``engine="packed"``) both answer them."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def checked(self) -> bool: ...
    def copy(self) -> ModelLedger: ...
    def fingerprint(self) -> tuple[Any, ...]: ...
    def state(self, request: str, /) -> RequestState: ...
    def proof_of(self, grant: Grant, /) -> GrantProof: ...
    def open_grants(self, request: str, /) -> list[Grant]: ...
    def generation(self, ids: npt.ArrayLike, /) -> npt.NDArray[np.uint32]: ...
    def free_count(self) -> int: ...
    def blocks_of(self, request: str, /) -> npt.NDArray[np.int64]: ...
    def block_state(self, ids: npt.ArrayLike, /) -> npt.NDArray[np.uint8]: ...
    def stats(self) -> Any: ...
    def allocate(self, request: str, n: int, /) -> npt.NDArray[np.int64]: ...
    def admit(self, request: str, /) -> None: ...
    def acquire(self, request: str, blocks: npt.ArrayLike, /, *, shared: bool) -> None: ...
    # Defaults as values, not ``...``: compiled (the accelerator), a default is evaluated and
    # checked against its type when the module loads.
    def grant(
        self, request: str, peer: str, blocks: npt.ArrayLike, access: Access = Access.WRITE, /
    ) -> Grant: ...
    def finish(self, request: str, /) -> object: ...
    def reject(self, request: str, reason: str = "rejected", /) -> object: ...
    def release(self, request: str, /) -> npt.NDArray[np.int64]: ...
    def force_release(self, request: str, reason: str, /) -> npt.NDArray[np.int64]: ...
    def collect_releasable(self) -> dict[Any, npt.NDArray[np.int64]]: ...
    def apply(self, evidence: Evidence, /) -> object: ...


class Snap:
    """A ledger that no one mutates any more, with the queries the explorer keeps asking."""

    __slots__ = ("_fp", "_gens", "_proofs", "_stale", "_stale_old", "_states", "ledger", "lies")

    def __init__(self, ledger: ModelLedger) -> None:
        self.ledger = ledger
        self.lies: dict[Any, tuple[int, ...]] = {}  # lie signature -> the lies not no-ops
        self._fp: tuple[Any, ...] | None = None
        self._gens: list[int] | None = None
        self._states: dict[str, str] = {}
        self._proofs: dict[int, tuple[Any, ...]] = {}
        self._stale: dict[int, bool] = {}
        self._stale_old: dict[int, bool] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (the parallel search sends it), by its fields: a class compiled by
        # mypyc (the accelerator) has no slot state for pickle's default to read.
        return (
            _snap_of,
            (
                self.ledger,
                self.lies,
                self._fp,
                self._gens,
                self._states,
                self._proofs,
                self._stale,
                self._stale_old,
            ),
        )

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

    def stale_old(self, g: Grant) -> bool:
        """Whether a transfer of ``g``, a grant of the previous incarnation, would now touch a
        block this (restarted) ledger has put back in circulation: one that is not held for the
        previous incarnation (``BlockLedger.after_restart``) any more, or never was (a ledger
        that started with every block free)."""
        s = self._stale_old.get(g.id.serial)
        if s is None:
            try:
                held = set(self.ledger.blocks_of(PREVIOUS).tolist())
            except KVLifetimeError:
                held = set()
            s = not set(g.blocks.tolist()) <= held
            self._stale_old[g.id.serial] = s
        return s

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


def _snap_of(
    ledger: ModelLedger,
    lies: dict[Any, tuple[int, ...]],
    fp: tuple[Any, ...] | None,
    gens: list[int] | None,
    states: dict[str, str],
    proofs: dict[int, tuple[Any, ...]],
    stale: dict[int, bool],
    stale_old: dict[int, bool],
) -> Snap:
    """A ``Snap`` from its fields (``Snap.__reduce__``)."""
    s = Snap(ledger)
    s.lies, s._fp, s._gens, s._states = lies, fp, gens, states
    s._proofs, s._stale, s._stale_old = proofs, stale, stale_old
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


for _cls in (ReqSide, GrantSide, PeerSide, Msg, Env):
    pickle_by_fields(_cls)


def peer_name(i: int) -> str:
    return f"p{i + 1}"


def initial(
    config: Config,
    *,
    checked: bool = False,
    crash_first: bool = False,
    ledger: ModelLedger | None = None,
) -> State:
    """The state before anything happened. ``crash_first``: only the first
    ``config.max_crashes`` peers may crash (a reduction: see "which peers crash" in
    ``explore.py``); else any peer may. ``ledger``: the empty ledger to drive (a packed one,
    ``engine="packed"``); by default a real ``BlockLedger``."""
    if ledger is None:
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
        restarts_left=config.restarts,
    )
    return State(Snap(ledger), env)
