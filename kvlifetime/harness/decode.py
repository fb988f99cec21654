"""The decode worker: owns the KV arena and its ledger, and drives a run (``simulate``).

Decode pre-allocates each request's blocks through the ``BlockLedger``, grants them to the
prefill peer *before* their addresses leave the process, and sends them over ZeroMQ. It checks
every block it consumes (and again when it lets go) against the pattern of its current owner,
so contamination is counted, not guessed. What it does when a request ends early is the policy:

- ``naive``: release at once (``force_release``, counted unsafe) and reuse the blocks;
- ``timeout``: a lease reaper: release when a deadline passes without proof;
- ``proof``: kvlifetime's rule: release only through ``collect_releasable`` once the evidence
  closes every grant; quarantine when no proof can come (a FAILED batch, a crashed peer); and
  **fence** to get the quarantined blocks back: after a crash, and whenever quarantine grows
  past ``fence_quarantined_blocks``, the peer's access is ended for real (``fence_peer``) and
  the ledger is told so by local ``AccessRevoked`` evidence.

Evidence from the prefill peer is stamped with the identity of the socket it came in on (one
socket per prefill incarnation), never with the name inside the message: a peer that claims
what it may not (``kvlifetime.provenance``) is refused and counted.

A decode restart (``SimConfig.restart``) re-creates the ledger mid-run over the same arena,
while the prefill peer's writes are still landing: ``naive`` starts with every block free,
``guarded`` starts with every block quarantined (``BlockLedger.after_restart``) and fences
before reusing any.

The run is in lock-step ticks (see ``wire.Tick``): one seed decides every fault and every
landing order, so two runs with one seed give the same figures, on the in-process engine.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime.errors import (
    BlockUnavailable,
    EvidenceError,
    KVLifetimeError,
    UnauthorizedEvidence,
    UsageError,
)
from kvlifetime.evidence import PeerLost, SchedulingStopped, TransferCompleted
from kvlifetime.grant import Grant, GrantId
from kvlifetime.harness import pattern
from kvlifetime.harness.faults import (
    FaultConfig,
    FaultyLink,
    RequestPlan,
    chunks,
    plan,
    restart_tick,
)
from kvlifetime.harness.oracle import ArenaDiff, TransportOracle
from kvlifetime.harness.owner import FencingOwner
from kvlifetime.harness.peer import PeerFailed, PeerProcess, fence_peer, peer_config
from kvlifetime.harness.report import Report
from kvlifetime.harness.simulate import BACKENDS, POLICIES, RESTARTS
from kvlifetime.harness.transfer import (
    HANDOVER_REGIONS,
    LOG_AFTER_DEATH,
    LOG_NBYTES,
    LOG_REDELIVERED,
    InprocTarget,
    TargetMemory,
)
from kvlifetime.harness.wire import (
    Abort,
    Assign,
    EvidenceMsg,
    MalformedMessage,
    Message,
    Query,
    Rejected,
    Tick,
    TransferFailed,
    UnauthorizedMessage,
    decode,
    encode,
)
from kvlifetime.ledger import BlockLedger, LedgerStats
from kvlifetime.spec.vocabulary import BlockState, RequestState

log = structlog.get_logger("kvlifetime")


@attrs.frozen(slots=True)
class SimConfig:
    backend: str = "inproc"
    policy: str = "proof"
    requests: int = 1000
    seed: int = 0
    block_bytes: int = 4096  # small blocks: the harness is about lifetimes, not bandwidth
    num_blocks: int = 2048
    staging_blocks: int = 1024  # prefill's registered source memory, in blocks
    arrivals_per_tick: int = 8
    timeout_lease: int = 8  # ticks after the end before the timeout policy frees anyway
    proof_lease: int = 64  # ticks after the end before the proof policy quarantines
    query_every: int = 12  # ticks between evidence queries for a grant still open
    max_queries: int = 8
    overdue_ticks: int = 48  # an admitted request with no news for this long is queried
    drain_ticks: int = 400  # at most this many ticks after the last admission
    tick_timeout_s: float = 30.0  # no TickDone for this long: the peer is hung, stop it
    max_restarts: int = 3  # prefill crashes tolerated before the run gives up (PeerFailed)
    # proof policy: fence the prefill peer (and reclaim) once this many blocks are quarantined;
    # 0: never fence on pressure (a crash is still fenced unless ``fence`` is False)
    fence_quarantined_blocks: int = 256
    fence: bool = True  # proof policy: fence after a crash and on quarantine pressure
    restart: str = "none"  # decode restart mid-run: none / naive / guarded
    # how the oracle sees landings: "auto" (the in-process engine's copy log, a real engine's
    # arena diff) or "arena diff" (also on the in-process engine, to compare the two)
    oracle: str = "auto"
    faults: FaultConfig = attrs.field(factory=FaultConfig)

    def __attrs_post_init__(self) -> None:
        tp = self.faults.tp_ranks
        if tp < 1 or tp > 16 or self.block_bytes % (8 * tp):
            raise UsageError("tp_ranks must be in 1..16 and split block_bytes into 8-byte parts")
        if self.policy not in POLICIES:
            raise UsageError(f"unknown policy {self.policy!r} ({', '.join(POLICIES)})")
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r} ({', '.join(BACKENDS)})")
        if self.block_bytes % 8 or self.block_bytes <= 0 or self.requests < 0:
            raise UsageError("block_bytes must be a positive multiple of 8, requests >= 0")
        if self.restart not in RESTARTS:
            raise UsageError(f"unknown restart {self.restart!r} ({', '.join(RESTARTS)})")


@attrs.define(slots=True)
class _Req:
    plan: RequestPlan
    grant: Grant
    admitted: int  # tick
    consumed: bool = False
    ended: str | None = None  # why the owner ended it early
    finished: bool = False
    last_news: int = 0  # tick of the last message about it (or of the last query)
    queries: int = 0
    quarantined: bool = False  # its deadline passed without proof (it may come late)
    # a prefix-cache hit: blocks shared read-only with an earlier request, and their words
    shared: npt.NDArray[np.int64] | None = None
    shared_words: npt.NDArray[np.uint64] | None = None
    # tensor parallel: the grants of ranks 1.. (``grant`` is rank 0's), one per rank and peer
    more: tuple[Grant, ...] = ()
    completed: set[GrantId] = attrs.field(factory=set)  # grants whose TransferCompleted came

    @property
    def grants(self) -> tuple[Grant, ...]:
        return (self.grant, *self.more)

    def rank_of(self, grant: GrantId) -> int | None:
        for i, g in enumerate(self.grants):
            if g.id == grant:
                return i
        return None

    def to(self, peer: str) -> bool:
        """Whether one of its grants is to ``peer``."""
        return any(g.peer == peer for g in self.grants)

    @property
    def nchunks(self) -> int:
        """Batches prefill writes for it (shared blocks are not written)."""
        return chunks(len(self.grant.blocks))


# =========================================================================== the prefill peer


class PrefillPeer(PeerProcess):
    """One prefill process (the writer; one tensor-parallel rank) and the socket dedicated to
    it. With one rank it is ``prefill-<incarnation>``; with several, ``prefill-<i>/rank<r>``."""

    def __init__(
        self,
        ctx: Any,
        cfg: SimConfig,
        target: TargetMemory,
        incarnation: int,
        expected: int,
        *,
        crashed: int = 0,
        start: int = 0,
        rank: int = 0,
    ) -> None:
        from kvlifetime.harness.prefill import prefill_main

        tp = cfg.faults.tp_ranks
        config = peer_config(cfg, incarnation, expected, crashed=crashed, start=start)
        config["target"] = target.descriptor()
        config["rank"] = rank
        if rank:
            config["link_salt"] = int(config["link_salt"]) + 100_000 * rank
        # its own hand-over region in the target's table (land_after_crash); freed by
        # take_over (a crash) or cut (a fence) before a later incarnation gets it again
        self.region = (incarnation * tp + rank) % HANDOVER_REGIONS
        config["handover_region"] = self.region
        name = f"prefill-{incarnation}" if tp == 1 else f"prefill-{incarnation}/rank{rank}"
        super().__init__(ctx, name, incarnation, prefill_main, config)


class PrefillGroup:
    """One prefill incarnation: ``tp_ranks`` rank processes, each with its own socket (its
    identity: evidence from rank r is stamped with rank r's name) and its own grant per
    request. Ticks go to the ranks one after the other (each rank's copies have ended when its
    ``TickDone`` comes), so landing order stays the seed's and the landing log has one writer
    at a time. The ranks crash together (a tensor-parallel group dies with any rank)."""

    def __init__(
        self,
        ctx: Any,
        cfg: SimConfig,
        target: TargetMemory,
        incarnation: int,
        expected: int,
        *,
        crashed: int = 0,
        start: int = 0,
    ) -> None:
        self.incarnation = incarnation
        self.ranks: list[PrefillPeer] = []
        try:
            for rank in range(cfg.faults.tp_ranks):
                self.ranks.append(
                    PrefillPeer(
                        ctx,
                        cfg,
                        target,
                        incarnation,
                        expected,
                        crashed=crashed,
                        start=start,
                        rank=rank,
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def peers(self) -> list[str]:
        return [p.peer for p in self.ranks]

    def tick(
        self, n: int, frames: Sequence[list[bytes]], timeout_s: float
    ) -> list[tuple[str, list[bytes]]] | None:
        """Send each rank its frames (ending with ``Tick(n)``) and collect its answer; None
        when any rank died or hung (every rank is then reaped)."""
        out: list[tuple[str, list[bytes]]] = []
        dead = False
        for p, fs in zip(self.ranks, frames, strict=True):
            for f in fs:
                p.send(f)
            got = p.until_tick_done(n, timeout_s)
            if got is None:
                dead = True
            else:
                out.append((p.peer, got))
        if dead:
            self.close()
            return None
        return out

    def stop(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        for p in self.ranks:
            p.stop()
            for k, v in p.stats.items():
                stats[k] = stats.get(k, 0) + v
        return stats

    def close(self) -> None:
        for p in self.ranks:
            p.close()


def make_target(backend: str, nbytes: int) -> TargetMemory:
    if backend == "inproc":
        return InprocTarget(nbytes)
    if backend == "nixl":
        from kvlifetime.adapters.nixl import NixlTarget

        return NixlTarget(nbytes)
    from kvlifetime.adapters.mooncake import MooncakeTarget

    return MooncakeTarget(nbytes)


class DecodeWorker(FencingOwner):
    cfg: SimConfig

    def __init__(self, cfg: SimConfig, target: TargetMemory, ledger: BlockLedger) -> None:
        self.cfg = cfg
        self.target = target
        self.ledger = ledger
        self.link = FaultyLink(cfg.seed, 2, cfg.faults)
        # one control link per tensor-parallel rank (rank 0's is ``link``)
        self.links = [self.link] + [
            FaultyLink(cfg.seed, 2 + 7919 * r, cfg.faults) for r in range(1, cfg.faults.tp_ranks)
        ]
        self.reqs: dict[int, _Req] = {}
        self.now = 0
        self._aborts: dict[int, list[int]] = {}
        self._finishes: dict[int, list[int]] = {}
        self._reaper: list[tuple[int, int]] = []  # (deadline, request): timeout policy
        self._init_fencing()
        self._prefix_sources: collections.deque[int] = collections.deque(maxlen=64)
        # The oracle at the transport: the in-process engine's copy log, else an arena diff.
        arena_diff = cfg.oracle == "arena diff" or not isinstance(target, InprocTarget)
        self.oracle = TransportOracle(
            cfg.num_blocks, cfg.block_bytes, "arena diff" if arena_diff else "copy log"
        )
        self._diff = ArenaDiff(target.array, cfg.block_bytes) if arena_diff else None
        self.retired: list[LedgerStats] = []  # the stats of ledgers replaced by a restart
        self.count: dict[str, int] = dict.fromkeys(
            (
                "completed",
                "aborted",
                "rejected",
                "transfer_failed",
                "lost_to_crash",
                "ended_mid_transfer",
                "contaminated_blocks",
                "contaminated_requests",
                "malformed_refused",
                "queries",
                "kv_bytes",
                "hold_ticks",
                "released_requests",
                "peak_blocks_out",
                "unauthorized_refused",
                "lost_to_fence",
                "lost_to_restart",
                "admission_stalls",
                "peak_quarantined_blocks",
                "released_by_late_proof",
                "prefix_hits",
                "unknown_refused",
                "unexpected_refused",
            ),
            0,
        )
        self._fenced: set[str] = set()  # peers whose access a fence ended: heard no more

    # ----------------------------------------------------------------- inbound

    def observe(self) -> None:
        """Hand the oracle every landing since the last look (before anything changes hands)."""
        if self._diff is not None:
            self.oracle.landed(*self._diff.landings())
            return
        assert isinstance(self.target, InprocTarget)
        rows = self.target.landings()
        if not len(rows):
            return
        bb = self.cfg.block_bytes
        off, tagged, words = rows[:, 0], rows[:, 1], rows[:, 2]
        nbytes = tagged & np.uint64(LOG_NBYTES)
        kinds = {
            "after_death": (tagged & np.uint64(LOG_AFTER_DEATH)) != 0,
            "redelivered": (tagged & np.uint64(LOG_REDELIVERED)) != 0,
        }
        per = np.maximum(nbytes // bb, 1).astype(np.int64)
        first = (off // bb).astype(np.int64)
        if (per == 1).all():
            self.oracle.landed(first, words, kinds)
        else:  # a slice over several blocks: one landing per block it covers
            blocks = np.concatenate([f + np.arange(k) for f, k in zip(first, per, strict=True)])
            rep = {k: np.repeat(v, per) for k, v in kinds.items()}
            self.oracle.landed(blocks, np.repeat(words, per), rep)

    def receive(self, frames: list[bytes], sender: str) -> None:
        """Frames that came in on the connection of peer ``sender`` (the transport's identity:
        evidence in them is stamped with it, whatever they say inside)."""
        self.observe()  # the landings of the tick these frames close happened before them
        for frame in frames:
            try:
                msg = decode(frame, sender=sender)
            except MalformedMessage as e:
                self.count["malformed_refused"] += 1
                if structlog.is_configured():
                    log.error("message_refused", worker="decode", error=str(e), size=len(frame))
                continue
            self.handle(msg, sender)

    def handle(self, msg: Message, sender: str) -> None:
        """Act on one message that came in on the connection of peer ``sender`` (the
        transport's identity). A control message about a grant is acted on only when it comes
        from that grant's peer on its own connection, and never from a fenced one: anything
        else is refused (``UnauthorizedMessage``), logged, counted and changes nothing."""
        if isinstance(msg, EvidenceMsg):
            if sender in self._fenced:  # its evidence is the ledger's to judge; it is counted
                self._refuse_unauthorized(msg, sender, "its connection was fenced")
                return
            self._evidence(msg)
        elif isinstance(msg, Rejected | TransferFailed):
            r = self._live(msg.request, msg.grant)
            if r is None:
                self.count["unknown_refused"] += 1
                return
            why = self._not_from_peer(r, msg.grant, sender)
            if why is not None:
                self._refuse_unauthorized(msg, sender, why)
                return
            if r.ended is None and not r.consumed:
                r.last_news = self.now
                key = "rejected" if isinstance(msg, Rejected) else "transfer_failed"
                self.end(int(msg.request), key)
        else:
            self.count["unexpected_refused"] += 1
            if structlog.is_configured():
                log.error("message_refused", worker="decode", error=f"unexpected {msg.TYPE}")

    def _not_from_peer(self, r: _Req, grant: GrantId, sender: str) -> str | None:
        """Why ``sender`` may not speak about ``grant`` of ``r`` (None: it may)."""
        if sender in self._fenced:
            return "its connection was fenced"
        g = r.grants[r.rank_of(grant) or 0]
        if g.peer != sender:
            return f"grant {g.id} is to {g.peer!r}"
        return None

    def _refuse_unauthorized(self, msg: Message, sender: str, why: str) -> None:
        e = UnauthorizedMessage(f"{msg.TYPE} from {sender!r} refused: {why}")
        self.count["unauthorized_refused"] += 1
        if structlog.is_configured():
            log.error(
                "message_refused",
                worker="decode",
                kind=e.kind,
                message=msg.TYPE,
                sender=sender,
                error=str(e),
            )

    def _live(self, request: int | str, grant: object) -> _Req | None:
        # Exact match on both: a message about another grant of a reused key acts on nothing.
        r = self.reqs.get(request) if isinstance(request, int) else None
        if r is None or not isinstance(grant, GrantId) or r.rank_of(grant) is None:
            return None
        return r

    def _evidence(self, msg: EvidenceMsg) -> None:
        ev = msg.evidence
        try:
            self.ledger.apply(ev)
        except UnauthorizedEvidence:
            self.count["unauthorized_refused"] += 1
            return  # a claim this peer may not make: refused, logged and counted
        except KVLifetimeError:
            # Refused, logged and counted by the ledger; the worker goes on, and its own
            # bookkeeping follows the ledger's verdict: a refused message changes nothing here.
            return
        gid = getattr(ev, "grant_id", None)
        req = getattr(ev, "request", None)
        if req is None or gid is None:
            return
        r = self._live(req, gid)
        if r is None or r.ended is not None:
            return
        r.last_news = self.now
        if isinstance(ev, TransferCompleted) and not r.consumed:
            r.completed.add(gid)
            if len(r.completed) == len(r.grants):  # every rank's KV has landed
                self._consume(int(req), r)
        elif isinstance(ev, SchedulingStopped) and not r.consumed:
            # Prefill stopped without completing: its Rejected / TransferFailed may be lost.
            why = "rejected" if r.plan.tokens > self.cfg.faults.capacity_tokens else "failed"
            self.end(int(req), "rejected" if why == "rejected" else "transfer_failed")

    # ----------------------------------------------------------------- content checks

    def _check(self, key: int, r: _Req) -> np.ndarray[Any, np.dtype[np.bool_]]:
        w = pattern.words(key, r.grant.blocks, r.grant.generations)
        bad = pattern.mismatched(self.target.array, r.grant.blocks, w, self.cfg.block_bytes)
        if r.shared is not None and r.shared_words is not None:
            # The shared prefix must still hold the words its first owner's peer wrote.
            shared_bad = pattern.mismatched(
                self.target.array, r.shared, r.shared_words, self.cfg.block_bytes
            )
            bad = np.concatenate([shared_bad, bad])
        return bad

    def _consume(self, key: int, r: _Req) -> None:
        r.consumed = True
        bad = self._check(key, r)
        if bad.any():
            self.count["contaminated_blocks"] += int(bad.sum())
            self.count["contaminated_requests"] += 1
        self.count["kv_bytes"] += len(r.grant.blocks) * self.cfg.block_bytes
        self._finishes.setdefault(self.now + r.plan.decode_ticks, []).append(key)
        if r.plan.nblocks > 1:
            self._prefix_sources.append(key)  # its settled blocks may serve a prefix hit

    def _finish(self, key: int) -> None:
        r = self.reqs.get(key)
        if r is None or r.ended is not None or r.finished:
            return
        # A write landing after consumption corrupts the blocks while this request holds them.
        bad = self._check(key, r)
        if bad.any():
            self.count["contaminated_blocks"] += int(bad.sum())
            self.count["contaminated_requests"] += 1
        r.finished = True
        self.count["completed"] += 1
        self.ledger.finish(key)

    # ----------------------------------------------------------------- ending early

    def end(self, key: int, why: str) -> None:
        """The owner ends the request early: the error response may go out now; what happens
        to the blocks is the policy's decision."""
        r = self.reqs[key]
        r.ended = why
        self.count[why if why != "client_abort" else "aborted"] += 1
        open_now = bool(self.ledger.open_grants(key))
        # Prefill posts batch c at tick admitted+1+c and reads an abort before its tick's work.
        posted = min(r.nchunks, max(0, self.now - r.admitted))
        if why == "rejected":
            posted = max(posted, r.plan.stub_chunks)
        if open_now and posted >= 1:
            self.count["ended_mid_transfer"] += 1
        self.ledger.reject(key, why)
        policy = self.cfg.policy
        if policy == "naive":
            self._release(key, self.ledger.force_release(key, why))
        elif policy == "timeout":
            self.ledger.set_deadline(key, self.now + self.cfg.timeout_lease)
            heapq.heappush(self._reaper, (self.now + self.cfg.timeout_lease, key))
        else:
            self.ledger.set_deadline(key, self.now + self.cfg.proof_lease)

    def _release(self, key: int | str, ids: npt.NDArray[np.int64]) -> None:
        r = self.reqs.pop(key, None) if isinstance(key, int) else None
        if r is not None:
            # Every block it held, shared prefix included: the oracle learns each holder that
            # lets go, not only the blocks that go back to the pool (a block its writer let go
            # of while a sharer keeps it takes no write on time any more).
            held = (
                r.grant.blocks if r.shared is None else np.concatenate([r.shared, r.grant.blocks])
            )
            self.oracle.let_go(int(key), held)
        self.oracle.freed(ids)  # back in the pool: from here, any landing in them is late
        if r is None:
            return  # the previous incarnation's blocks after a guarded restart: no request
        if r.quarantined and not self._fencing:
            self.count["released_by_late_proof"] += 1  # quarantine had a way out: the proof
        self.count["hold_ticks"] += self.now - r.admitted
        self.count["released_requests"] += 1

    # ----------------------------------------------------------------- one tick

    def tick(self, n: int, peer: str, admit_more: bool) -> list[bytes]:
        """Decode's work for tick ``n`` with one prefill peer; the frames to send (Tick last)."""
        return self.tick_ranks(n, [peer], admit_more)[0]

    def tick_ranks(self, n: int, peers: Sequence[str], admit_more: bool) -> list[list[bytes]]:
        """Decode's work for tick ``n``; per prefill rank (``peers``, one per rank), the frames
        to send it (Tick last)."""
        self.now = n
        outs: list[list[bytes]] = [[] for _ in peers]
        for key in self._aborts.pop(n, []):
            r = self.reqs.get(key)
            if r is not None and r.ended is None and not r.finished:
                self.end(key, "client_abort")
                for i, g in enumerate(r.grants):
                    self.links[i].offer(encode(Abort(key, g.id)), n)
        for key in self._finishes.pop(n, []):
            self._finish(key)
        if self.cfg.policy != "naive":
            for qkey in self.ledger.expire(float(n)):
                q = self.reqs.get(qkey) if isinstance(qkey, int) else None
                if q is not None:
                    q.quarantined = True
        while self._reaper and self._reaper[0][0] <= n:
            _, key = heapq.heappop(self._reaper)
            if key in self.reqs and self.ledger.state(key) is not RequestState.TRANSFER_QUIESCED:
                # The lease reaper: the deadline passed without proof, free anyway.
                self._release(key, self.ledger.force_release(key, "lease expired"))
        for rkey, ids in self.ledger.collect_releasable().items():
            self._release(rkey, ids)
        self._queries(n)
        if admit_more:
            self._admit(n, peers, outs)
        held = self.cfg.num_blocks - self.ledger.free_count()
        self.count["peak_blocks_out"] = max(self.count["peak_blocks_out"], held)
        for link, out in zip(self.links, outs, strict=False):
            out.extend(link.due(n))
            out.append(encode(Tick(n)))
        return outs

    def _queries(self, n: int) -> None:
        # Lost evidence is asked for again; evidence is idempotent, so asking is always safe.
        for key, r in self.reqs.items():
            if r.finished or r.queries >= self.cfg.max_queries:
                continue
            waiting = r.ended is not None or not r.consumed
            quiet = n - r.last_news
            due = self.cfg.query_every if r.ended is not None else self.cfg.overdue_ticks
            open_now = self.ledger.open_grants(key) if waiting and quiet >= due else []
            if open_now:
                r.queries += 1
                r.last_news = n
                self.count["queries"] += 1
                for g in open_now:  # each rank is asked about its own grant
                    rank = r.rank_of(g.id)
                    if rank is not None:
                        self.links[rank].offer(encode(Query(key, g.id)), n)

    def _admit(self, n: int, peers: Sequence[str], outs: list[list[bytes]]) -> None:
        for _ in range(self.cfg.arrivals_per_tick):
            key = self.next_request
            if key >= self.cfg.requests:
                break
            p = plan(self.cfg.seed, key, self.cfg.faults)
            if self.ledger.free_count() < p.nblocks:
                self.count["admission_stalls"] += 1
                break  # back-pressure: the request waits for blocks
            shared, shared_words = self._prefix_hit(key, p.prefix)
            ids = self.ledger.allocate(key, p.nblocks - (0 if shared is None else len(shared)))
            self.last_admitted = n
            # The grants (one per rank) exist before the addresses leave the process.
            gs = [self.ledger.grant(key, peer, ids) for peer in peers]
            g = gs[0]
            self.oracle.granted(key, ids, pattern.words(key, ids, g.generations))
            if shared is not None:
                self.oracle.shared(key, shared)  # one more holder of the prefix's blocks
            self.reqs[key] = _Req(
                p, g, n, last_news=n, shared=shared, shared_words=shared_words, more=tuple(gs[1:])
            )
            self.next_request += 1
            if p.abort_after is not None:
                self._aborts.setdefault(n + p.abort_after, []).append(key)
            addrs = tuple(self.target.address(int(b) * self.cfg.block_bytes) for b in ids)
            for out, peer, gi in zip(outs, peers, gs, strict=True):
                assign = Assign(
                    key,
                    gi.id,
                    peer,
                    tuple(int(b) for b in ids),
                    tuple(int(x) for x in gi.generations),
                    addrs,
                    p.tokens,
                )
                out.append(encode(assign))

    def _prefix_hit(
        self, key: int, k: int
    ) -> tuple[npt.NDArray[np.int64] | None, npt.NDArray[np.uint64] | None]:
        """Share the first ``k`` blocks of the most recent request still decoding, as a prefix
        cache would; the ledger refuses what is not settled (an open write grant, a holder
        draining or quarantined), and then the request writes all its blocks itself."""
        src = self._prefix_sources
        while k and src:
            e = self.reqs.get(src[-1])
            if (
                e is None
                or not e.consumed
                or e.ended is not None
                or e.finished
                or len(e.grant.blocks) < k  # a sharer itself may have written fewer
            ):
                src.pop()
                continue
            blocks = e.grant.blocks[:k]
            try:
                self.ledger.acquire(key, blocks, shared=True)
            except BlockUnavailable:
                src.pop()
                continue
            self.count["prefix_hits"] += 1
            return blocks, pattern.words(src[-1], blocks, e.grant.generations[:k])
        return None, None

    next_request: int = 0
    last_admitted: int = 0  # tick of the last admission (the pool ran dry if it stays old)

    # ----------------------------------------------------------------- a crashed peer

    def peer_crashed(self, peer: str) -> None:
        with contextlib.suppress(EvidenceError):  # refused and counted by the ledger
            self.ledger.apply(PeerLost(peer))
        for key, r in list(self.reqs.items()):
            if not r.to(peer) or key not in self.reqs:
                continue
            if r.ended is None and not r.finished and not r.consumed:
                self.end(key, "lost_to_crash")  # counted by end()

    # ----------------------------------------------------------------- fences

    def fenced(self, peer: str, fence: str) -> None:
        """``peer``'s access to the arena was ended for real by ``fence`` (observed complete
        by this process): its live requests that still wait for KV are ended, and the local
        ``AccessRevoked`` closes every grant to it, quarantined ones included."""
        self.observe()  # what landed before the fence, while the blocks are still held
        self._fenced.add(peer)
        for key, r in list(self.reqs.items()):
            if r.to(peer) and r.ended is None and not r.finished and not r.consumed:
                self.end(key, "lost_to_fence")
        self._revoked(peer, fence)

    # ----------------------------------------------------------------- a decode restart

    def restart(self, mode: str, peers: list[str]) -> None:
        """Decode restarts over the same arena: every request it held is lost with its state,
        and a new ledger (a new incarnation) takes over. ``naive``: every block free.
        ``guarded``: every block quarantined (reason previous_incarnation) until fenced."""
        self.retired.append(self.ledger.stats())
        self.count["lost_to_restart"] += len(self.reqs)
        self.reqs.clear()
        self._aborts.clear()
        self._finishes.clear()
        self._reaper.clear()
        self.observe()
        n = self.cfg.num_blocks
        if mode == "naive":
            self.ledger = BlockLedger(n)
            self.oracle.freed(np.arange(n))
        else:
            self.ledger = BlockLedger.after_restart(n, peers=peers)
            self.oracle.held_by_previous(np.arange(n))

    def idle(self) -> bool:
        """Nothing left but quarantined requests (which wait for proof that may never come)."""
        return all(self.ledger.state(k) is RequestState.QUARANTINED for k in self.reqs)


def _leaked(ledger: BlockLedger) -> int:
    """Blocks out of the pool that no quarantine explains: neither free, nor quarantined, nor
    held by a quarantined request (a prefix it shares, settled, waits with it)."""
    n = ledger.num_blocks
    ok = ledger.block_state(np.arange(n)) == BlockState.FREE
    for st in ledger.stats().quarantined:
        ok[ledger.blocks_of(st.request)] = True
    return int(np.count_nonzero(~ok))


def run(
    cfg: SimConfig,
    progress: Callable[[str], None] | None = None,
    *,
    on_tick: Callable[[int], None] | None = None,
) -> Report:
    """One simulation; every process and socket it started is gone when it returns."""
    import zmq

    t0 = time.perf_counter()
    target = make_target(cfg.backend, cfg.num_blocks * cfg.block_bytes)
    worker = DecodeWorker(cfg, target, BlockLedger(cfg.num_blocks))
    expected = max(1, cfg.requests // max(1, cfg.arrivals_per_tick))
    restart_at = restart_tick(cfg.seed, expected) if cfg.restart != "none" else None
    ctx = zmq.Context()
    peers: list[PrefillGroup] = []
    prefill_stats: dict[str, int] = {}
    crashes = 0
    n = 0
    exhausted = False
    inproc = target if isinstance(target, InprocTarget) else None

    def say(line: str) -> None:
        if progress is not None:
            progress(line)

    def fence_and_replace(old: PrefillGroup, why: str) -> PrefillGroup:
        worker.quarantined_blocks()  # the peak includes what this fence is about to reclaim
        for rank in old.ranks:
            fence = fence_peer(rank, target)
            if inproc is not None:
                # The target's half: what the reaped rank had handed over and this side not
                # yet applied is discarded (land_after_crash), before the grants are revoked.
                inproc.cut(rank.region)
            worker.fenced(rank.peer, fence)
            say(f"tick {n}: fenced {rank.peer} ({why}; {fence})")
        say(f"tick {n}: starting prefill incarnation {old.incarnation + 1}")
        nxt = old.incarnation + 1
        new = PrefillGroup(ctx, cfg, target, nxt, expected, crashed=crashes, start=n)
        peers.append(new)
        return new

    try:
        peer = PrefillGroup(ctx, cfg, target, 0, expected)
        peers.append(peer)
        t0 = time.perf_counter()  # the run, not the process start-up
        last_admit = 0
        while True:
            admitting = worker.next_request < cfg.requests
            if on_tick is not None:  # requests admitted so far: a progress bar's count
                on_tick(worker.next_request)
            if admitting:
                last_admit = n
            quiet = not admitting and worker.idle()
            if n == restart_at:
                say(f"tick {n}: decode restarts ({cfg.restart})")
                worker.restart(cfg.restart, peer.peers)
                if cfg.restart == "guarded":
                    peer = fence_and_replace(peer, "decode restart")
            elif worker.wants_fence(n, quiet=quiet):
                peer = fence_and_replace(peer, "quarantine")
                continue
            elif quiet or n - last_admit > cfg.drain_ticks:
                break
            elif admitting and n - worker.last_admitted > cfg.drain_ticks:
                # Nothing admitted for this long: the pool is exhausted (what quarantine
                # without fences does to a long run). Stop and say so.
                say(f"tick {n}: the pool is exhausted, no admission since {worker.last_admitted}")
                exhausted = True
                break
            answers = peer.tick(n, worker.tick_ranks(n, peer.peers, admitting), cfg.tick_timeout_s)
            if inproc is not None:
                inproc.advance(n)  # a dead initiator's slices due now land with this tick's
            if answers is None:
                crashes += 1
                if inproc is not None:
                    for rank in peer.ranks:  # reaped: what they handed over is the target's
                        inproc.take_over(rank.region, n)
                for name in peer.peers:
                    worker.peer_crashed(name)
                if crashes > cfg.max_restarts:
                    raise PeerFailed(f"prefill crashed {crashes} times; giving up")
                if cfg.policy == "proof" and cfg.fence:
                    peer = fence_and_replace(peer, "crashed")
                else:
                    say(f"tick {n}: prefill {peer.incarnation} crashed; starting another")
                    peer = PrefillGroup(
                        ctx, cfg, target, peer.incarnation + 1, expected, crashed=crashes, start=n
                    )
                    peers.append(peer)
            else:
                for sender, frames in answers:
                    worker.receive(frames, sender)
            n += 1
        for k, v in peer.stop().items():
            prefill_stats[k] = prefill_stats.get(k, 0) + v
        if inproc is not None:
            # what a dead initiator handed over lands even after the run: count it too
            while inproc.pending_after_death():
                inproc.advance(n)
                n += 1
        worker.observe()  # the last landings, before the arena goes
    finally:
        for p in peers:
            p.close()
        # destroy, not term: a socket whose peer never got into ``peers`` (a Ctrl-C while
        # it started) is closed too, where term() would wait for it for ever.
        ctx.destroy(linger=0)
        wall = time.perf_counter() - t0
        target.close()
    st = worker.ledger.stats()
    quarantined = st.blocks_by_state.get(BlockState.QUARANTINED.label, 0)
    refused: collections.Counter[str] = collections.Counter(st.refused_evidence)
    reclaimed: collections.Counter[str] = collections.Counter(st.reclaimed_blocks)
    unsafe = st.unsafe_releases
    for old in worker.retired:  # ledgers replaced by a decode restart
        refused.update(old.refused_evidence)
        reclaimed.update(old.reclaimed_blocks)
        unsafe += old.unsafe_releases
    c = worker.count
    return Report(
        backend=cfg.backend,
        policy=cfg.policy,
        seed=cfg.seed,
        requests=worker.next_request,
        completed=c["completed"],
        aborted=c["aborted"],
        rejected=c["rejected"],
        transfer_failed=c["transfer_failed"],
        lost_to_crash=c["lost_to_crash"],
        ended_mid_transfer=c["ended_mid_transfer"],
        contaminated_blocks=c["contaminated_blocks"],
        contaminated_requests=c["contaminated_requests"],
        leaked_blocks=_leaked(worker.ledger),
        quarantined_blocks=quarantined,
        quarantined_requests=len(st.quarantined),
        unsafe_releases=unsafe,
        refused_evidence=dict(refused),
        malformed_refused=c["malformed_refused"] + prefill_stats.get("malformed_refused", 0),
        prefill_crashes=crashes,
        queries=c["queries"],
        ticks=n,
        wall_s=round(wall, 3),
        requests_per_s=round(worker.next_request / wall, 1) if wall > 0 else 0.0,
        kv_bytes=c["kv_bytes"],
        gb_per_s=round(c["kv_bytes"] / wall / 1e9, 4) if wall > 0 else 0.0,
        mean_hold_ticks=round(c["hold_ticks"] / max(1, c["released_requests"]), 3),
        peak_blocks_out=c["peak_blocks_out"],
        num_blocks=cfg.num_blocks,
        block_bytes=cfg.block_bytes,
        prefill=prefill_stats,
        restart=cfg.restart,
        fences=dict(worker.fences),
        reclaimed_blocks=dict(reclaimed),
        peak_quarantined_blocks=c["peak_quarantined_blocks"],
        admission_stalls=c["admission_stalls"],
        pool_exhausted=exhausted,
        unauthorized_refused=c["unauthorized_refused"],
        lost_to_fence=c["lost_to_fence"],
        lost_to_restart=c["lost_to_restart"],
        released_by_late_proof=c["released_by_late_proof"],
        prefix_hits=c["prefix_hits"],
        oracle=attrs.asdict(worker.oracle.counts()),
        series=worker.series.columns(),
        topology={
            "tp_ranks": cfg.faults.tp_ranks,
            "land_after_crash": int(cfg.faults.land_after_crash),
            "redeliver_permille": round(cfg.faults.p_redeliver * 1000),
            "landed_after_death": 0 if inproc is None else inproc.landed_after_death,
            "cut_by_fence": 0 if inproc is None else inproc.cut_by_fence,
        },
    )
