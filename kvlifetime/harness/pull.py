"""The pull direction (vLLM's NIXL path): decode READs each request's KV out of prefill's blocks.

Here the memory owner is **prefill** (``SourceOwner``, in this process). It holds its *source*
blocks in a ``BlockLedger``, computes each request's KV into them itself
(``pattern.words(request, blocks, generations)``), opens a READ grant to the decode peer *before*
the addresses leave the process, sends them (``ReadAssign``) and ends its own part of the
request (``finish``): from there the blocks wait for decode's reads. The reader is **decode**
(``ReaderWorker``, in another process, the initiator): it posts READ batches from prefill's arena
into its own staging memory over the transfer engine, checks every block it read against the
words of its grant (``ReadsChecked``: the exact read oracle, a read whose bytes are not the
grant's is *stale*: prefill gave the block to another request), and reports evidence about its
own grant over ZeroMQ: ``TransferCompleted`` once every read completed (its own claim, on its
word: provenance lets only the grant's peer say it), ``SchedulingStopped`` / ``TransferQuiesced``
when its client aborts mid-way (reads in flight still complete). Prefill stamps that evidence
with the connection's identity, never with the name inside.

What prefill does with its source blocks is the policy:

- ``naive``: free them at once when the request ends on prefill's side (``force_release``);
- ``lease``: what vLLM does today: free them on decode's notification, or when the send lease
  expires, whatever the reads (``_reap_expired_send_leases``);
- ``proof``: release only through ``collect_releasable`` once the evidence closed the grant;
  quarantine at a deadline; fence after a crash of the reader (reaping the reader process on the
  in-process engine, whose copies run on the reader's thread; re-creating the serving engine on
  Mooncake, the serving agent on NIXL) and on quarantine pressure.

Lock-step ticks as in the push harness (``harness.decode``): one seed decides every fault and
every read order, so two runs with one seed give the same figures on the in-process engine.
The reader checks its reads inside its tick while prefill waits, so prefill's own view of its
arena at that moment gives a second, independent count (``owner_view_*`` in the report's
``oracle``); the two must agree.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime.adapters.mooncake import GrantTransfers
from kvlifetime.errors import (
    EvidenceError,
    KVLifetimeError,
    StaleEvidence,
    UnauthorizedEvidence,
    UsageError,
)
from kvlifetime.evidence import (
    Evidence,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.harness import pattern
from kvlifetime.harness.faults import (
    BLOCKS_PER_CHUNK,
    FaultConfig,
    FaultyLink,
    RequestPlan,
    plan,
)
from kvlifetime.harness.initiator import InitiatorWorker
from kvlifetime.harness.oracle import TransportOracle
from kvlifetime.harness.owner import FencingOwner
from kvlifetime.harness.peer import PeerFailed, PeerProcess, fence_peer, peer_config, serve
from kvlifetime.harness.report import Report
from kvlifetime.harness.simulate import BACKENDS, PULL_POLICIES
from kvlifetime.harness.transfer import InprocTarget, ReadEngine, Slice, Status, TargetMemory
from kvlifetime.harness.wire import (
    EvidenceMsg,
    MalformedMessage,
    Message,
    Query,
    ReadAssign,
    ReaderPending,
    ReadsChecked,
    Tick,
    TickDone,
    TransferFailed,
    UnauthorizedMessage,
    decode,
    encode,
)
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import BlockState, RequestState

log = structlog.get_logger("kvlifetime")

_STATUS_TIMEOUT = 60.0  # seconds; Mooncake's own transfer timeout is 30 s
PLANTED = 1 << 40  # request number of the "other request" a planted stale read belongs to


class ReaderFailed(PeerFailed):
    """The pull run's reader process failed to start or to answer.
    The reader is the decode side. Whose fault: the environment. The run stopped; every process
    was reaped."""

    kind = "reader_failed"


@attrs.frozen(slots=True)
class PullConfig:
    backend: str = "inproc"
    policy: str = "proof"
    requests: int = 1000
    seed: int = 0
    block_bytes: int = 4096
    num_blocks: int = 2048  # prefill's source pool
    staging_blocks: int = 1024  # decode's staging memory (where reads land), in blocks
    arrivals_per_tick: int = 8
    lease_ticks: int = 8  # lease policy: ticks after prefill's end before the blocks are freed
    proof_lease: int = 64  # ticks after prefill's end before the proof policy quarantines
    query_every: int = 12  # ticks between evidence queries for a grant still unconcluded
    max_queries: int = 8
    drain_ticks: int = 400  # at most this many ticks after the last admission
    tick_timeout_s: float = 30.0
    max_restarts: int = 3  # reader crashes tolerated before the run gives up
    fence_quarantined_blocks: int = 256  # proof: fence the reader once this many are quarantined
    fence: bool = True  # proof: fence after a crash and on quarantine pressure
    # a test's knob: right after the grant of this request went out, prefill gives its first
    # block to another request (computes other KV into it): one stale read, planted
    plant_stale_read: int | None = None
    faults: FaultConfig = attrs.field(factory=FaultConfig)

    def __attrs_post_init__(self) -> None:
        if self.policy not in PULL_POLICIES:
            raise UsageError(f"unknown pull policy {self.policy!r} ({', '.join(PULL_POLICIES)})")
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r} ({', '.join(BACKENDS)})")
        if self.backend not in PULL_BACKENDS:
            raise UsageError(
                f"backend {self.backend!r} has no asynchronous batch READ in the harness "
                f"(pull runs on {', '.join(PULL_BACKENDS)})"
            )
        if self.block_bytes % 8 or self.block_bytes <= 0 or self.requests < 0:
            raise UsageError("block_bytes must be a positive multiple of 8, requests >= 0")


PULL_BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")
"""Backends with an asynchronous batch READ: the in-process engine's ``submit_read``,
Mooncake's ``batch_transfer_async_read`` (``MooncakeEngine.submit_read``) and NIXL's READ
transfer (``NixlEngine.submit_read``: ``initialize_xfer("READ", ...)``, UCX over TCP)."""


# =========================================================================== the reader (decode)


@attrs.define(slots=True)
class _Job:
    assign: ReadAssign
    plan: RequestPlan
    transfers: GrantTransfers
    next_chunk: int = 0
    next_tick: int = 0
    abort_at: int | None = None  # tick at which decode's client aborts
    finals: list[bytes] = attrs.field(factory=list)
    failed_reported: bool = False


@attrs.define(slots=True)
class _Batch:
    job: _Job
    seq: int
    lo: int  # the grant's blocks lo..hi-1
    hi: int
    slices: list[Slice]
    slots: list[int]


class ReaderWorker(InitiatorWorker[_Job]):
    """The decode worker of the pull direction, free of sockets: feed it messages and ticks, it
    returns frames. It owns no KV blocks of prefill's: it reads them under prefill's grant."""

    def __init__(
        self,
        engine: ReadEngine,
        *,
        peer: str,
        seed: int,
        faults: FaultConfig,
        block_bytes: int,
        source: Mapping[str, Any],
        link_salt: int = 1,
    ) -> None:
        super().__init__(
            len(engine.staging),
            peer=peer,
            seed=seed,
            faults=faults,
            block_bytes=block_bytes,
            arena=source,
            link_salt=link_salt,
        )
        self.engine = engine
        self._line: dict[int, list[_Batch]] = {}
        self._straggling: list[int] = []  # ticks until which a FAILED batch may still read
        self._checked: list[bytes] = []  # this tick's ReadsChecked frames

    # ----------------------------------------------------------------- messages

    def _dispatch(self, msg: Message) -> bool:
        if isinstance(msg, ReadAssign):
            self._assign(msg)
            return True
        return False

    def _assign(self, a: ReadAssign) -> None:
        why = self._unfit(a)
        p: RequestPlan | None = None
        if why is None:
            assert isinstance(a.request, int)  # checked by _unfit
            p = plan(self.seed, a.request, self.faults)
            if p.nblocks != len(a.blocks):
                why = f"{len(a.blocks)} blocks, the request's plan has {p.nblocks}"
        if why is not None or p is None:
            self.counters["assign_refused"] += 1
            if structlog.is_configured():
                log.error("assign_refused", worker=self.peer, grant=str(a.grant), error=why)
            return
        # Frames of tick n come before Tick(n): the first read is posted at tick n.
        start = self.now + 1
        abort = None if p.abort_after is None else start + p.abort_after
        transfers = GrantTransfers(a.grant, a.request, self.peer)
        job = _Job(a, p, transfers, next_tick=start, abort_at=abort)
        self._jobs[a.grant] = job
        self.counters["assigned"] += 1

    def _unfit(self, a: ReadAssign) -> str | None:
        """Why this worker cannot take ``a`` (None: it can), checked before anything changes:
        a refused ReadAssign posts nothing, so nothing of it is ever read."""
        return self._unfit_grant(a, "source's", distinct=True)

    # ----------------------------------------------------------------- time

    def tick(self, n: int) -> list[bytes]:
        """Do tick ``n``'s work; return the frames due now (``ReaderPending`` and ``TickDone``
        last). Time never goes back (a stale tick does nothing but its ``TickDone``)."""
        if not self._advance_clock(n):
            return [encode(TickDone(n))]
        for job in list(self._jobs.values()):
            if job.transfers.last_seq is not None:
                continue
            if job.abort_at is not None and job.abort_at <= n:
                self._abort(job)
            elif job.next_tick <= n:
                self._step(job)
        self.engine.advance(n)  # a failed batch's straggling reads happen at the tick's start
        for t in sorted(t for t in self._line if t <= n):
            for b in self._line.pop(t):
                self._land(b)
        self._straggling = [t for t in self._straggling if t > n]
        checked, self._checked = self._checked, []
        pending = ReaderPending(n, self.pending())
        return [*checked, *self.link.due(n), encode(pending), encode(TickDone(n))]

    def pending(self) -> int:
        """Grants with reads still to post or in flight (FAILED batches' stragglers included),
        plus control frames still on the wire: 0 means this worker will read nothing more."""
        posting = sum(1 for j in self._jobs.values() if j.transfers.last_seq is None)
        flying = sum(len(v) for v in self._line.values())
        return posting + flying + len(self._straggling) + self.link.pending()

    def _abort(self, job: _Job) -> None:
        # The client went away: decode stops reading. Reads in flight still complete.
        self.counters["aborts"] += 1
        if job.transfers.posted >= 1:
            self.counters["aborted_mid_read"] += 1
        self._send_evidence(job, job.transfers.stop())
        self._maybe_conclude(job)

    def _step(self, job: _Job) -> None:
        c = job.next_chunk
        a = job.assign
        lo, hi = c * BLOCKS_PER_CHUNK, min((c + 1) * BLOCKS_PER_CHUNK, len(a.blocks))
        if len(self._free_slots) < hi - lo:
            self.counters["staging_waits"] += 1
            job.next_tick = self.now + 1
            return
        slots = [self._free_slots.pop() for _ in range(hi - lo)]
        bb = self.block_bytes
        slices: list[Slice] = [(slot * bb, a.addresses[lo + i], bb) for i, slot in enumerate(slots)]
        seq = job.transfers.post()
        if job.plan.fails[seq - 1]:
            slices.append((slots[0] * bb, self._bad_address, bb))
        due = self.now + job.plan.latencies[seq - 1]
        self._line.setdefault(due, []).append(_Batch(job, seq, lo, hi, slices, slots))
        self.counters["batches"] += 1
        job.next_chunk += 1
        job.next_tick = self.now + 1
        if job.next_chunk == job.plan.nchunks:
            self._send_evidence(job, job.transfers.finish())

    def _land(self, b: _Batch) -> None:
        # Submit and wait one batch at a time: the read order is the seed's.
        handle = self.engine.submit_read(b.slices)
        status = self.engine.wait(handle, _STATUS_TIMEOUT)
        job = b.job
        a = job.assign
        if status is Status.COMPLETED:
            self._check(b)
            self._free_slots.extend(b.slots)
        else:
            # The batch's other slices may still be writing these slots: never reuse them.
            self.counters["batches_failed"] += 1
            self.counters["staging_quarantined"] += len(b.slots)
            self._straggling.append(self.now + self.faults.straggle_ticks + 1)
        if a.grant not in self._jobs:
            return
        evs = job.transfers.on_status(b.seq, int(status))
        if status is not Status.COMPLETED and not job.failed_reported:
            job.failed_reported = True
            self._send(job, TransferFailed(a.request, a.grant, b.seq))
            evs += job.transfers.stop()
        self._send_evidence(job, evs)
        self._maybe_conclude(job)

    def _check(self, b: _Batch) -> None:
        """The read oracle: every block this batch read, against its grant's words."""
        a = b.job.assign
        blocks = a.blocks[b.lo : b.hi]
        w = pattern.words(int(a.request), blocks, a.generations[b.lo : b.hi])
        bad = pattern.mismatched(self.engine.staging, b.slots, w, self.block_bytes)
        self.counters["reads"] += len(blocks)
        self.counters["stale_reads"] += int(bad.sum())
        self.counters["bytes_read"] += len(blocks) * self.block_bytes
        stale = tuple(int(x) for x in bad)
        self._checked.append(encode(ReadsChecked(a.request, a.grant, b.seq, blocks, stale)))

    def _maybe_conclude(self, job: _Job) -> None:
        t = job.transfers
        if t.last_seq is None:
            return
        if t.concluded and (
            not t.failed or not any(b.job is job for v in self._line.values() for b in v)
        ):
            self._concluded(job.assign.grant, job)


# =========================================================================== read engines


def make_read_engine(
    source: Mapping[str, Any], staging_bytes: int, faults: FaultConfig
) -> ReadEngine:
    kind = source.get("kind")
    if kind == "inproc":
        from kvlifetime.harness.transfer import InprocEngine

        return InprocEngine(source, staging_bytes, straggle_ticks=faults.straggle_ticks)
    if kind == "mooncake":
        from kvlifetime.adapters.mooncake import MooncakeEngine

        return MooncakeEngine(source, staging_bytes)  # its submit_read posts the READs
    if kind == "nixl":
        from kvlifetime.adapters.nixl import NixlEngine

        return NixlEngine(source, staging_bytes)  # its submit_read posts READ transfers
    raise ValueError(f"unknown transfer engine {kind!r}")


def reader_main(cfg: dict[str, Any]) -> None:
    """Entry point of the decode (reader) process (``multiprocessing`` spawn target).

    ``cfg``: endpoint, peer, seed, faults (dict), block_bytes, staging_bytes, source
    (descriptor), crash_tick (or None), parent_pid, link_salt, idle_exit_s."""
    faults = FaultConfig.from_dict(cfg["faults"])

    def start() -> tuple[ReaderWorker, ReadEngine]:
        engine = make_read_engine(cfg["source"], int(cfg["staging_bytes"]), faults)
        worker = ReaderWorker(
            engine,
            peer=cfg["peer"],
            seed=int(cfg["seed"]),
            faults=faults,
            block_bytes=int(cfg["block_bytes"]),
            source=cfg["source"],
            link_salt=int(cfg.get("link_salt", 1)),
        )
        return worker, engine

    serve(cfg, start)


# =========================================================================== the reader process


class ReaderPeer(PeerProcess):
    """One decode (reader) process and the socket dedicated to it."""

    def __init__(
        self,
        ctx: Any,
        cfg: PullConfig,
        source: TargetMemory,
        incarnation: int,
        expected: int,
        *,
        crashed: int = 0,
        start: int = 0,
    ) -> None:
        config = peer_config(cfg, incarnation, expected, crashed=crashed, start=start)
        config["source"] = source.descriptor()
        try:
            super().__init__(ctx, f"decode-{incarnation}", incarnation, reader_main, config)
        except ReaderFailed:
            raise
        except PeerFailed as e:
            raise ReaderFailed(str(e)) from e


def fence_reader(peer: ReaderPeer, source: TargetMemory) -> str:
    """End ``peer``'s access to prefill's source arena for real (``peer.fence_peer``: the
    reads are the reader's copies; on Mooncake the source's serving engine is re-created, on NIXL
    its serving agent)."""
    try:
        return fence_peer(peer, source)
    except ReaderFailed:
        raise
    except PeerFailed as e:
        raise ReaderFailed(str(e)) from e


# =========================================================================== the owner (prefill)


@attrs.define(slots=True)
class _Src:
    plan: RequestPlan
    grant: Grant
    words: npt.NDArray[np.uint64]  # the grant's words, one per block
    admitted: int
    last_news: int
    queries: int = 0
    released: bool = False
    concluded: bool = False  # the reader's reads of it ended (its final evidence, or it was reaped)
    stopped_at: int | None = None  # SchedulingStopped's last_seq, once seen
    outcome: str | None = None  # completed / aborted / transfer_failed / lost_to_crash / ...
    quarantined: bool = False
    stale: bool = False  # one of its reads was stale (counted once per request)


def make_source(backend: str, nbytes: int) -> TargetMemory:
    """Prefill's source arena, registered with the engine decode reads it over. On NIXL it is
    a ``NixlTarget`` (as decode's arena is in the push direction): the memory owner's agent
    serves the READs (over TCP its UCX progress thread sends the bytes) and ``fence()``
    replaces that agent."""
    if backend == "inproc":
        return InprocTarget(nbytes)
    if backend == "nixl":
        from kvlifetime.adapters.nixl import NixlTarget

        return NixlTarget(nbytes, name="kvlifetime-prefill-source")
    from kvlifetime.adapters.mooncake import MooncakeTarget

    return MooncakeTarget(nbytes)


class SourceOwner(FencingOwner):
    """Prefill in the pull direction: the memory owner. It computes KV into its own source
    blocks, grants them READ to the decode peer, and decides when they go back to its pool."""

    cfg: PullConfig

    def __init__(self, cfg: PullConfig, source: TargetMemory, ledger: BlockLedger) -> None:
        self.cfg = cfg
        self.source = source
        self.ledger = ledger
        self.table = source.array.view(np.uint64).reshape(cfg.num_blocks, cfg.block_bytes // 8)
        self.link = FaultyLink(cfg.seed, 2, cfg.faults)
        self.reqs: dict[int, _Src] = {}  # not yet both released and concluded
        self.grants: dict[GrantId, _Src] = {}  # every grant of the run (ReadsChecked lookups)
        self.now = 0
        self.next_request = 0
        self.last_admitted = 0
        self.reader_pending = 0  # the reader's last ReaderPending
        self.reader = ""  # the current reader's connection (the peer ticked last)
        self._fenced: set[str] = set()  # readers whose access a fence ended: heard no more
        self._reaper: list[tuple[int, int]] = []  # (deadline, request): lease policy
        self._ending: list[int] = []  # admitted this tick: prefill ends them at the next
        self._init_fencing()
        # Prefill's own view of its arena: the word each block holds (it is the only writer).
        self.oracle = TransportOracle(cfg.num_blocks, cfg.block_bytes, "owner view")
        self.stale_blocks: set[int] = set()
        self.count: dict[str, int] = dict.fromkeys(
            (
                "completed",
                "aborted",
                "transfer_failed",
                "lost_to_crash",
                "lost_to_fence",
                "ended_mid_transfer",
                "reads",
                "stale_reads",
                "stale_requests",
                "malformed_refused",
                "reads_refused",
                "unexpected_refused",
                "unauthorized_refused",
                "queries",
                "kv_bytes",
                "hold_ticks",
                "released_requests",
                "peak_blocks_out",
                "admission_stalls",
                "peak_quarantined_blocks",
                "released_by_late_proof",
                "contradictory_after_release",
                "unknown_refused",
            ),
            0,
        )

    # ----------------------------------------------------------------- inbound

    def receive(self, frames: list[bytes], sender: str) -> None:
        """Frames from the reader's connection ``sender`` (evidence is stamped with it)."""
        for frame in frames:
            try:
                msg = decode(frame, sender=sender)
            except MalformedMessage as e:
                self.count["malformed_refused"] += 1
                if structlog.is_configured():
                    log.error("message_refused", worker="prefill", error=str(e), size=len(frame))
                continue
            self.handle(msg, sender)

    def handle(self, msg: Message, sender: str) -> None:
        if isinstance(msg, ReadsChecked):
            self._reads(msg, sender)
        elif isinstance(msg, EvidenceMsg):
            self._evidence(msg.evidence, sender)
        elif isinstance(msg, TransferFailed):
            r = self._about(msg.request, msg.grant, sender, msg.TYPE)
            if r is not None:
                r.last_news = self.now
                self._outcome(r, "transfer_failed")
        elif isinstance(msg, ReaderPending):
            if sender != self.reader:
                # Only the current reader's count says whether reads are still to come.
                self.count["unauthorized_refused"] += 1
                if structlog.is_configured():
                    e = UnauthorizedMessage(f"reader_pending from {sender!r}, not the reader")
                    log.error("message_refused", worker="prefill", kind=e.kind, error=str(e))
                return
            self.reader_pending = msg.grants
        else:
            self.count["unexpected_refused"] += 1
            if structlog.is_configured():
                log.error("message_refused", worker="prefill", error=f"unexpected {msg.TYPE}")

    def _about(
        self, request: int | str, grant: GrantId, sender: str, what: str = ""
    ) -> _Src | None:
        """The request ``grant`` is of, when a message about it from connection ``sender``
        may be acted on: exact match on grant and request, sent by the grant's peer on its own
        connection, not fenced. A message from another connection is refused as unauthorized
        (logged and counted); one about a grant this owner never issued, as unknown."""
        r = self.grants.get(grant)
        if r is None or r.grant.request != request:
            self.count["unknown_refused"] += 1
            return None
        if r.grant.peer != sender or sender in self._fenced:
            why = "its connection was fenced" if sender in self._fenced else "not the grant's peer"
            e = UnauthorizedMessage(f"{what or 'message'} about {grant} from {sender!r}: {why}")
            self.count["unauthorized_refused"] += 1
            if structlog.is_configured():
                log.error("message_refused", worker="prefill", kind=e.kind, error=str(e))
            return None
        return r

    def _reads(self, m: ReadsChecked, sender: str) -> None:
        r = self._about(m.request, m.grant, sender, m.TYPE)
        pos = {int(b): i for i, b in enumerate(r.grant.blocks.tolist())} if r is not None else {}
        if r is None or not all(b in pos for b in m.blocks):
            self.count["reads_refused"] += 1
            return
        idx = [pos[b] for b in m.blocks]
        stale = np.asarray(m.stale, dtype=bool)
        self.count["reads"] += len(idx)
        self.count["kv_bytes"] += len(idx) * self.cfg.block_bytes
        nstale = int(stale.sum())
        if nstale:
            self.count["stale_reads"] += nstale
            self.stale_blocks.update(b for b, s in zip(m.blocks, m.stale, strict=True) if s)
            if not r.stale:
                r.stale = True
                self.count["stale_requests"] += 1
        # The second count: what prefill's arena held for these blocks while they were read.
        self.oracle.read(np.asarray(m.blocks, dtype=np.int64), r.words[idx])

    def _evidence(self, ev: Evidence, sender: str) -> None:
        gid = getattr(ev, "grant_id", None)
        req = getattr(ev, "request", None)
        try:
            self.ledger.apply(ev)
        except UnauthorizedEvidence:
            self.count["unauthorized_refused"] += 1
            return
        except StaleEvidence:
            # The ledger forgot the grant because this owner released the request itself
            # (naive, lease, or a late proof after release): it has no verdict left to give.
            # What the grant's own peer says then only tells when its reads ended - never a
            # second, different stop (the first one stands).
            r = None if gid is None or req is None else self._about(req, gid, sender)
            if r is None or not r.released:
                return
            if isinstance(ev, SchedulingStopped | TransferCompleted) and r.stopped_at not in (
                None,
                ev.last_seq,
            ):
                self.count["contradictory_after_release"] += 1
                return
        except KVLifetimeError:
            # Refused, logged and counted by the ledger (contradictory, mismatched, ...): the
            # owner's bookkeeping follows the ledger's verdict, never the message.
            return
        if gid is None or req is None:
            return
        r = self._about(req, gid, sender)
        if r is None:
            return
        r.last_news = self.now
        if isinstance(ev, TransferCompleted):
            r.stopped_at = ev.last_seq
            self._outcome(r, "completed")
            self._concluded(r)
        elif isinstance(ev, SchedulingStopped):
            r.stopped_at = ev.last_seq
            failed = any(r.plan.fails[: ev.last_seq])
            if ev.last_seq >= 1 and not r.concluded and r.outcome is None:
                self.count["ended_mid_transfer"] += 1
            self._outcome(r, "transfer_failed" if failed else "aborted")
        elif (
            isinstance(ev, TransferQuiesced)
            and r.stopped_at is not None
            and ev.through_seq >= r.stopped_at
        ):
            self._concluded(r)

    def _outcome(self, r: _Src, what: str) -> None:
        if r.outcome is None:
            r.outcome = what
            self.count[what] += 1

    def _concluded(self, r: _Src) -> None:
        r.concluded = True
        if r.released:
            self.reqs.pop(int(r.grant.request), None)

    # ----------------------------------------------------------------- releases

    def _release(self, key: int | str, ids: npt.NDArray[np.int64]) -> None:
        # Back in the pool. The blocks keep their bytes until a new owner computes into them:
        # the owner's view (the oracle) changes only then.
        r = self.reqs.get(key) if isinstance(key, int) else None
        if r is None:
            return
        r.released = True
        if r.quarantined and not self._fencing:
            self.count["released_by_late_proof"] += 1
        self.count["hold_ticks"] += self.now - r.admitted
        self.count["released_requests"] += 1
        if r.concluded:
            self.reqs.pop(int(key), None)

    # ----------------------------------------------------------------- one tick

    def _end_prefill(self, n: int) -> None:
        """The prefill step that computed last tick's admissions is over: those requests end on
        prefill's side (vLLM: ``request_finished``, the blocks wait for decode's reads)."""
        cfg = self.cfg
        ending, self._ending = self._ending, []
        for key in ending:
            self.ledger.finish(key)
            if cfg.policy == "naive":
                self._release(key, self.ledger.force_release(key, "prefill finished"))
            elif cfg.policy == "lease":
                heapq.heappush(self._reaper, (n + cfg.lease_ticks, key))
            else:
                self.ledger.set_deadline(key, n + cfg.proof_lease)

    def tick(self, n: int, peer: str, admit_more: bool) -> list[bytes]:
        self.now = n
        self.reader = peer
        out: list[bytes] = []
        self._end_prefill(n)
        if self.cfg.policy == "proof":
            for qkey in self.ledger.expire(float(n)):
                q = self.reqs.get(qkey) if isinstance(qkey, int) else None
                if q is not None:
                    q.quarantined = True
        while self._reaper and self._reaper[0][0] <= n:
            _, key = heapq.heappop(self._reaper)
            r = self.reqs.get(key)
            if (
                r is not None
                and not r.released
                and self.ledger.state(key) is not RequestState.TRANSFER_QUIESCED
            ):
                # vLLM's lease reaper: the lease expired, free the source blocks anyway.
                self._release(key, self.ledger.force_release(key, "send lease expired"))
        for rkey, ids in self.ledger.collect_releasable().items():
            self._release(rkey, ids)
        self._queries(n)
        if admit_more:
            out.extend(self._admit(n, peer))
        held = self.cfg.num_blocks - self.ledger.free_count()
        self.count["peak_blocks_out"] = max(self.count["peak_blocks_out"], held)
        out.extend(self.link.due(n))
        out.append(encode(Tick(n)))
        return out

    def _queries(self, n: int) -> None:
        # Lost evidence is asked for again; evidence is idempotent, so asking is always safe.
        for key, r in self.reqs.items():
            if r.concluded or r.queries >= self.cfg.max_queries:
                continue
            if n - r.last_news >= self.cfg.query_every:
                r.queries += 1
                r.last_news = n
                self.count["queries"] += 1
                self.link.offer(encode(Query(key, r.grant.id)), n)

    def _admit(self, n: int, peer: str) -> list[bytes]:
        cfg = self.cfg
        out: list[bytes] = []
        for _ in range(cfg.arrivals_per_tick):
            key = self.next_request
            if key >= cfg.requests:
                break
            p = plan(cfg.seed, key, cfg.faults)
            if self.ledger.free_count() < p.nblocks:
                self.count["admission_stalls"] += 1
                break
            ids = self.ledger.allocate(key, p.nblocks)
            self.last_admitted = n
            # The READ grant exists before the addresses leave the process.
            g = self.ledger.grant(key, peer, ids, Access.READ)
            w = pattern.words(key, ids, g.generations)
            self.table[ids] = w[:, None]  # prefill computes the request's KV into its blocks
            self.oracle.granted(key, ids, w)
            r = _Src(p, g, w, n, n)
            self.reqs[key] = r
            self.grants[g.id] = r
            self.next_request += 1
            addrs = tuple(self.source.address(int(b) * cfg.block_bytes) for b in ids)
            blocks = tuple(int(b) for b in ids)
            gens = tuple(int(x) for x in g.generations)
            out.append(encode(ReadAssign(key, g.id, peer, blocks, gens, addrs)))
            self._ending.append(key)
            if key == cfg.plant_stale_read:
                self._plant(ids[:1], g.generations[:1])
        return out

    def _plant(self, blocks: npt.NDArray[np.int64], gens: npt.ArrayLike) -> None:
        """Give ``blocks`` to another request behind the ledger's back (a test's knob): prefill
        computes that request's KV into them while the grant's read is still to come."""
        w = pattern.words(PLANTED, blocks, gens)
        self.table[blocks] = w[:, None]
        self.oracle.granted(PLANTED, blocks, w)

    # ----------------------------------------------------------------- crashes and fences

    def reader_lost(self, peer: str, outcome: str) -> None:
        """``peer``'s process is gone and reaped: it reads and reports nothing more."""
        for r in list(self.reqs.values()):
            if r.grant.peer == peer and not r.concluded:
                self._outcome(r, outcome)
                self._concluded(r)
        self.reader_pending = 0

    def reader_crashed(self, peer: str) -> None:
        with contextlib.suppress(EvidenceError):
            self.ledger.apply(PeerLost(peer))
        self.reader_lost(peer, "lost_to_crash")

    def fenced(self, peer: str, fence: str) -> None:
        self._fenced.add(peer)
        self.reader_lost(peer, "lost_to_fence")
        self._revoked(peer, fence)

    def idle(self) -> bool:
        """The reader will read nothing more, and every request left is released (its final
        evidence lost) or quarantined (waiting for proof that may never come)."""
        return (
            not self._ending
            and self.reader_pending == 0
            and all(r.released or r.quarantined for r in self.reqs.values())
        )


def run_pull(
    cfg: PullConfig,
    progress: Callable[[str], None] | None = None,
    *,
    on_tick: Callable[[int], None] | None = None,
) -> Report:
    """One pull-direction simulation; every process and socket it started is gone when it
    returns."""
    import zmq

    if cfg.backend == "mooncake":
        from kvlifetime.adapters.mooncake import mooncake_available

        if not mooncake_available():
            raise UsageError("backend mooncake needs mooncake-transfer-engine-non-cuda")
    if cfg.backend == "nixl":
        from kvlifetime.adapters.nixl import nixl_available, require_tcp

        if not nixl_available():
            raise UsageError("backend nixl needs nixl (pip install --no-deps nixl==1.5.1 ...)")
        require_tcp()  # with CMA the reader would copy out of prefill's memory itself
    t0 = time.perf_counter()
    source = make_source(cfg.backend, cfg.num_blocks * cfg.block_bytes)
    owner = SourceOwner(cfg, source, BlockLedger(cfg.num_blocks))
    expected = max(1, cfg.requests // max(1, cfg.arrivals_per_tick))
    ctx = zmq.Context()
    peers: list[ReaderPeer] = []
    reader_stats: dict[str, int] = {}
    crashes = 0
    n = 0
    exhausted = False

    def say(line: str) -> None:
        if progress is not None:
            progress(line)

    def add_stats(p: ReaderPeer) -> None:
        for k, v in p.stats.items():
            reader_stats[k] = reader_stats.get(k, 0) + v

    def fence_and_replace(old: ReaderPeer, why: str) -> ReaderPeer:
        owner.quarantined_blocks()
        fence = fence_reader(old, source)
        owner.fenced(old.peer, fence)
        say(f"tick {n}: fenced {old.peer} ({why}; {fence}); starting another")
        new = ReaderPeer(ctx, cfg, source, old.incarnation + 1, expected, crashed=crashes, start=n)
        peers.append(new)
        return new

    try:
        peer = ReaderPeer(ctx, cfg, source, 0, expected)
        peers.append(peer)
        t0 = time.perf_counter()
        last_admit = 0
        while True:
            admitting = owner.next_request < cfg.requests
            if on_tick is not None:  # requests admitted so far: a progress bar's count
                on_tick(owner.next_request)
            if admitting:
                last_admit = n
            quiet = not admitting and owner.idle()
            if owner.wants_fence(n, quiet=quiet):
                peer = fence_and_replace(peer, "quarantine")
                continue
            if quiet or n - last_admit > cfg.drain_ticks:
                break
            if admitting and n - owner.last_admitted > cfg.drain_ticks:
                say(f"tick {n}: the pool is exhausted, no admission since {owner.last_admitted}")
                exhausted = True
                break
            for frame in owner.tick(n, peer.peer, admitting):
                peer.send(frame)
            frames = peer.until_tick_done(n, cfg.tick_timeout_s)
            if frames is None:
                crashes += 1
                peer.close()  # reaped: nothing of it reads any more
                owner.reader_crashed(peer.peer)
                if crashes > cfg.max_restarts:
                    raise ReaderFailed(f"decode crashed {crashes} times; giving up")
                if cfg.policy == "proof" and cfg.fence:
                    peer = fence_and_replace(peer, "crashed")
                else:
                    say(f"tick {n}: {peer.peer} crashed; starting another")
                    peer = ReaderPeer(
                        ctx, cfg, source, peer.incarnation + 1, expected, crashed=crashes, start=n
                    )
                    peers.append(peer)
            else:
                owner.receive(frames, peer.peer)
            n += 1
        peer.stop()
        add_stats(peer)
    finally:
        for p in peers:
            p.close()
        # destroy, not term: a socket whose peer never got into ``peers`` (a Ctrl-C while
        # it started) is closed too, where term() would wait for it for ever.
        ctx.destroy(linger=0)
        wall = time.perf_counter() - t0
        source.close()
    return _report(cfg, owner, crashes, n, wall, exhausted, reader_stats)


def _report(
    cfg: PullConfig,
    owner: SourceOwner,
    crashes: int,
    ticks: int,
    wall: float,
    exhausted: bool,
    reader_stats: Mapping[str, int],
) -> Report:
    st = owner.ledger.stats()
    quarantined = st.blocks_by_state.get(BlockState.QUARANTINED.label, 0)
    free = st.blocks_by_state.get(BlockState.FREE.label, 0)
    c = owner.count
    seen = owner.oracle.counts()
    oracle: dict[str, int | str] = dict(attrs.asdict(seen))
    oracle.update(
        method="reader check",
        reads=c["reads"],
        stale_reads=c["stale_reads"],
        stale_read_blocks=len(owner.stale_blocks),
        owner_view_reads=seen.reads,
        owner_view_stale_reads=seen.stale_reads,
        owner_view_stale_read_blocks=seen.stale_read_blocks,
    )
    return Report(
        backend=cfg.backend,
        policy=cfg.policy,
        seed=cfg.seed,
        requests=owner.next_request,
        completed=c["completed"],
        aborted=c["aborted"],
        rejected=0,
        transfer_failed=c["transfer_failed"],
        lost_to_crash=c["lost_to_crash"],
        ended_mid_transfer=c["ended_mid_transfer"],
        contaminated_blocks=c["stale_reads"],  # a stale read is KV decode computes from
        contaminated_requests=c["stale_requests"],
        leaked_blocks=cfg.num_blocks - free - quarantined,
        quarantined_blocks=quarantined,
        quarantined_requests=len(st.quarantined),
        unsafe_releases=st.unsafe_releases,
        refused_evidence=dict(st.refused_evidence),
        malformed_refused=c["malformed_refused"] + reader_stats.get("malformed_refused", 0),
        prefill_crashes=crashes,  # here: crashes of the decode (reader) process
        queries=c["queries"],
        ticks=ticks,
        wall_s=round(wall, 3),
        requests_per_s=round(owner.next_request / wall, 1) if wall > 0 else 0.0,
        kv_bytes=c["kv_bytes"],
        gb_per_s=round(c["kv_bytes"] / wall / 1e9, 4) if wall > 0 else 0.0,
        mean_hold_ticks=round(c["hold_ticks"] / max(1, c["released_requests"]), 3),
        peak_blocks_out=c["peak_blocks_out"],
        num_blocks=cfg.num_blocks,
        block_bytes=cfg.block_bytes,
        prefill=dict(reader_stats),  # here: the reader incarnations' counters
        fences=dict(owner.fences),
        reclaimed_blocks=dict(st.reclaimed_blocks),
        peak_quarantined_blocks=c["peak_quarantined_blocks"],
        admission_stalls=c["admission_stalls"],
        pool_exhausted=exhausted,
        unauthorized_refused=c["unauthorized_refused"],
        lost_to_fence=c["lost_to_fence"],
        released_by_late_proof=c["released_by_late_proof"],
        oracle=oracle,
        direction="pull",
        stale_reads=c["stale_reads"],
        stale_read_blocks=len(owner.stale_blocks),
        series=owner.series.columns(),
    )
