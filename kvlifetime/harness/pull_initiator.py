"""The pull direction's initiator (vLLM's NIXL path): decode READs each request's KV out of
prefill's source blocks, in another process.

``ReaderWorker`` is the logic, free of sockets: it posts READ batches from prefill's arena into
its own staging memory over the transfer engine, checks every block it read against the words
of its grant (``ReadsChecked``: the exact read oracle; a read whose bytes are not the grant's is
*stale*: prefill gave the block to another request), and reports evidence about its own grant
over ZeroMQ: ``TransferCompleted`` once every read completed (its own claim, on its word:
provenance lets only the grant's peer say it), ``SchedulingStopped`` / ``TransferQuiesced``
when its client aborts mid-way (reads in flight still complete). ``reader_main`` is the process
around it; ``start_reader`` starts one incarnation of it, seen from prefill (the owner,
``harness.pull_owner``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from kvlifetime.adapters.mooncake import GrantTransfers
from kvlifetime.adapters.transfer import ReadEngine, Slice, Status
from kvlifetime.harness import pattern
from kvlifetime.harness.faults import BLOCKS_PER_CHUNK, FaultConfig, RequestPlan, plan
from kvlifetime.harness.initiator import InitiatorWorker
from kvlifetime.harness.peer import (
    PeerFailed,
    PeerGroup,
    PeerProcess,
    peer_config,
    serve_initiator,
)
from kvlifetime.harness.wire import (
    Message,
    ReadAssign,
    ReaderPending,
    ReadsChecked,
    TickDone,
    TransferFailed,
    encode,
)

if TYPE_CHECKING:
    from kvlifetime.adapters.transfer import TargetMemory
    from kvlifetime.harness.settings import RunSettings

log = structlog.get_logger("kvlifetime")

_STATUS_TIMEOUT = 60.0  # seconds; Mooncake's own transfer timeout is 30 s


class ReaderFailed(PeerFailed):
    """The pull run's reader process failed to start or to answer.
    The reader is the decode side. Whose fault: the environment. The run stopped; every process
    was reaped."""

    kind = "reader_failed"


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


# =========================================================================== the reader process


def reader_main(cfg: dict[str, Any]) -> None:
    """Entry point of the decode (reader) process (``multiprocessing`` spawn target).

    ``cfg``: endpoint, peer, seed, faults (dict), block_bytes, staging_bytes, memory (the
    source's descriptor), crash_tick (or None), parent_pid, link_salt, idle_exit_s."""

    def worker(engine: ReadEngine, common: dict[str, Any]) -> ReaderWorker:
        return ReaderWorker(engine, **common, source=cfg["memory"])

    serve_initiator(cfg, worker)


# =========================================================================== seen from prefill


def start_reader(
    ctx: Any, cfg: RunSettings, source: TargetMemory, incarnation: int, *, crashed: int, start: int
) -> PeerGroup:
    """Start decode (reader) incarnation ``incarnation``: one process, ``decode-<i>``."""

    def process(rank: int) -> PeerProcess:
        config = peer_config(cfg, source, incarnation, crashed=crashed, start=start)
        return PeerProcess(ctx, f"decode-{incarnation}", incarnation, reader_main, config)

    return PeerGroup(incarnation, 1, process)
