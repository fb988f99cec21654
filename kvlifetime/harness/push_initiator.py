"""The push direction's initiator: prefill writes each request's KV into decode's blocks, in
another process.

``PrefillWorker`` is the logic (it takes decoded messages and ticks, and returns frames to send);
``prefill_main`` is the process around it: a ZeroMQ socket, a transfer engine, a clean exit on
every path (stop, decode gone, a malformed frame never being one of them); ``start_prefill``
starts one incarnation of it, seen from decode (one process per tensor-parallel rank).

Per request: batches of ``BLOCKS_PER_CHUNK`` blocks, one per tick, each a transfer numbered from 1,
landing after its seeded latency. An abort stops scheduling (``SchedulingStopped`` at the last
posted batch); batches already posted still land. A prompt over capacity is refused - after
a few stub batches were already posted, as engines that bootstrap before admission do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import structlog

from kvlifetime.adapters.inproc import HANDOVER_REGIONS
from kvlifetime.adapters.mooncake import GrantTransfers
from kvlifetime.adapters.transfer import Slice, Status, TransferEngine
from kvlifetime.evidence import CancelReceived
from kvlifetime.harness import pattern
from kvlifetime.harness.faults import (
    BLOCKS_PER_CHUNK,
    FaultConfig,
    RequestPlan,
    chunks,
    plan,
    rank_latencies,
    redeliveries,
)
from kvlifetime.harness.initiator import InitiatorWorker, is_int
from kvlifetime.harness.peer import PeerGroup, PeerProcess, peer_config, serve_initiator
from kvlifetime.harness.wire import (
    Abort,
    Assign,
    EvidenceMsg,
    Message,
    Rejected,
    TickDone,
    TransferFailed,
    encode,
)

if TYPE_CHECKING:
    from kvlifetime.adapters.transfer import TargetMemory
    from kvlifetime.harness.settings import RunSettings

log = structlog.get_logger("kvlifetime")

_STATUS_TIMEOUT = 60.0  # seconds; Mooncake's own transfer timeout is 30 s


@attrs.define(slots=True)
class _Job:
    assign: Assign
    plan: RequestPlan
    transfers: GrantTransfers
    next_chunk: int = 0  # chunks posted so far
    next_tick: int = 0  # tick of the next post
    reject_at: int | None = None  # tick at which admission is refused
    finals: list[bytes] = attrs.field(factory=list)  # every control frame sent for it
    failed_reported: bool = False
    latencies: tuple[int, ...] = ()  # per batch, this rank's (``faults.rank_latencies``)
    redeliver: tuple[int | None, ...] = ()  # per batch: ticks to a re-delivered copy, or None


@attrs.define(slots=True)
class _Batch:
    job: _Job
    seq: int
    slices: list[Slice]
    slots: list[int]
    ticket: int = 0  # its hand-over records (land_after_crash), retired when it lands
    redeliver: int | None = None  # the transport applies its first slice again this much later
    first: Status | None = None  # re-delivery before DONE: the status, held until the copy


class _HandsOver(Protocol):
    """The in-process engine with ``land_after_crash``: posted batches are handed to the
    target's side at once (``InprocEngine.hand_over``)."""

    @property
    def hands_over(self) -> bool: ...
    def hand_over(self, slices: list[Slice], due: int) -> int: ...
    def submit(self, slices: list[Slice], ticket: int = 0) -> int: ...


class PrefillWorker(InitiatorWorker[_Job]):
    """The logic of a prefill worker, free of sockets: feed it messages, it returns frames."""

    def __init__(
        self,
        engine: TransferEngine,
        *,
        peer: str,
        seed: int,
        faults: FaultConfig,
        block_bytes: int,
        target: Mapping[str, Any],
        link_salt: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(
            len(engine.staging),
            peer=peer,
            seed=seed,
            faults=faults,
            block_bytes=block_bytes,
            arena=target,
            link_salt=link_salt,
        )
        self.engine = engine
        self._line: dict[int, list[_Batch]] = {}
        # re-deliveries after DONE: (the copied slice, the staging slots it still holds)
        self._redo: dict[int, list[tuple[list[Slice], list[int]]]] = {}
        # tensor parallel: this rank writes bytes [rank * part, (rank + 1) * part) of each block
        tp = max(1, faults.tp_ranks)
        if not 0 <= rank < tp or block_bytes % (8 * tp):
            raise ValueError(f"rank {rank} of {tp}: block_bytes must split into 8-byte parts")
        self.rank = rank
        self._part = block_bytes // tp
        ho = engine if getattr(engine, "hands_over", False) else None
        self._handover: _HandsOver | None = ho  # type: ignore[assignment]

    # ----------------------------------------------------------------- messages

    def _dispatch(self, msg: Message) -> bool:
        if isinstance(msg, Assign):
            self._assign(msg)
        elif isinstance(msg, Abort):
            self._abort(msg)
        else:
            return False
        return True

    def _assign(self, a: Assign) -> None:
        why = self._unfit(a)
        if why is None:
            assert isinstance(a.request, int)  # checked by _unfit
            p = plan(self.seed, a.request, self.faults)
            # A prefix-cache hit at decode: its first ``prefix`` blocks are shared, not written.
            if len(a.blocks) not in (p.nblocks, p.nblocks - p.prefix):
                why = f"{len(a.blocks)} blocks, the request's plan has {p.nblocks}"
        if why is not None:
            self.counters["assign_refused"] += 1
            if structlog.is_configured():
                log.error("assign_refused", worker=self.peer, grant=str(a.grant), error=why)
            return
        job = _Job(
            a,
            p,
            GrantTransfers(a.grant, a.request, self.peer),
            next_tick=self.now + 1,
            latencies=rank_latencies(self.seed, p, self.rank, self.faults),
            redeliver=redeliveries(self.seed, p.request, self.rank, p.nchunks, self.faults),
        )
        if a.tokens > self.faults.capacity_tokens:
            # The decision comes before the last batch, however many this request writes.
            job.reject_at = self.now + 1 + min(p.stub_chunks, chunks(len(a.blocks)) - 1)
        self._jobs[a.grant] = job
        self.counters["assigned"] += 1

    def _unfit(self, a: Assign) -> str | None:
        """Why this worker cannot take ``a`` (None: it can). Checked before anything changes:
        a refused Assign posts nothing, so nothing of it can ever land."""
        why = self._unfit_grant(a, "target's")
        if why is None and (not is_int(a.tokens) or a.tokens < 0):
            return f"tokens must be an int >= 0, got {a.tokens!r}"
        return why

    def _abort(self, m: Abort) -> None:
        job = self._known(m.grant, m.request)
        if job is None:
            return
        self.counters["aborts_received"] += 1
        if m.grant not in self._jobs:  # concluded already: its final evidence may be lost
            self._resend(job)
            return
        if job.transfers.posted >= 1 and not job.transfers.concluded:
            self.counters["aborted_mid_transfer"] += 1
        self._send(job, EvidenceMsg(CancelReceived(m.grant, m.request, self.peer)))
        self._send_evidence(job, job.transfers.stop())
        self._maybe_conclude(job)

    # ----------------------------------------------------------------- time

    def tick(self, n: int) -> list[bytes]:
        """Do tick ``n``'s work; return the frames due now (``TickDone`` last).

        Time never goes back: a tick before the current one does nothing (counted) but its
        ``TickDone``. A tick that skips ahead lands every batch due by then."""
        if not self._advance_clock(n):
            return [encode(TickDone(n))]
        for job in list(self._jobs.values()):
            if job.next_tick <= n and job.transfers.last_seq is None:
                self._step(job)
        self.engine.advance(n)  # a failed batch's stragglers land at the start of the tick
        for t in sorted(t for t in self._line if t <= n):
            for b in self._line.pop(t):
                self._land(b)
        for t in sorted(t for t in self._redo if t <= n):
            for copied, slots in self._redo.pop(t):
                # A transport that reported DONE long ago applies an old slice again.
                self._copy_again(copied)
                self.counters["redelivered_after_done"] += 1
                self._free_slots.extend(slots)
        return [*self.link.due(n), encode(TickDone(n))]

    def _copy_again(self, slices: list[Slice]) -> None:
        # The re-delivered copy: the same bytes (its staging slots were kept), landing again
        # (tagged in the in-process engine's landing log, for the oracle).
        redeliver = getattr(self.engine, "redeliver", None)
        handle = self.engine.submit(slices) if redeliver is None else int(redeliver(slices))
        self.engine.wait(handle, _STATUS_TIMEOUT)

    def _step(self, job: _Job) -> None:
        if job.reject_at is not None and self.now >= job.reject_at:
            if job.transfers.posted >= 1:
                self.counters["rejected_mid_transfer"] += 1
            self.counters["rejected"] += 1
            a = job.assign
            self._send(job, Rejected(a.request, a.grant, "prompt exceeds prefill capacity"))
            self._send_evidence(job, job.transfers.stop())
            self._maybe_conclude(job)
            return
        c = job.next_chunk
        a = job.assign
        lo, hi = c * BLOCKS_PER_CHUNK, min((c + 1) * BLOCKS_PER_CHUNK, len(a.blocks))
        if len(self._free_slots) < hi - lo:
            self.counters["staging_waits"] += 1
            job.next_tick = self.now + 1
            return
        slots = [self._free_slots.pop() for _ in range(hi - lo)]
        w = pattern.words(int(a.request), a.blocks[lo:hi], a.generations[lo:hi])
        bb, part = self.block_bytes, self._part
        at = self.rank * part  # this rank's bytes of each block (all of it with one rank)
        slices: list[Slice] = []
        for i, slot in enumerate(slots):
            pattern.fill(self.engine.staging[slot * bb : (slot + 1) * bb], w[i : i + 1], bb)
            slices.append((slot * bb + at, a.addresses[lo + i] + at, part))
        seq = job.transfers.post()
        if job.plan.fails[seq - 1]:
            slices.append((slots[0] * bb + at, self._bad_address, part))
        due = self.now + job.latencies[seq - 1]
        # land_after_crash: the batch is the transport's from now on, even if this process dies
        ticket = 0 if self._handover is None else self._handover.hand_over(slices, due)
        batch = _Batch(job, seq, slices, slots, ticket, job.redeliver[seq - 1])
        self._line.setdefault(due, []).append(batch)
        self.counters["batches"] += 1
        job.next_chunk += 1
        job.next_tick = self.now + 1
        if job.next_chunk == chunks(len(a.blocks)):
            self._send_evidence(job, job.transfers.finish())

    def _land(self, b: _Batch) -> None:
        # Submit and wait one batch at a time: the landing order is the seed's, not the wire's.
        held = False  # its staging slots stay the transport's (a re-delivery after DONE)
        if b.first is not None:
            # Re-delivery before DONE: the old slice lands again, and only then the status.
            self._copy_again(b.slices[:1])
            self.counters["redelivered_before_done"] += 1
            status = b.first
        else:
            if b.ticket and self._handover is not None:
                handle = self._handover.submit(b.slices, ticket=b.ticket)
            else:
                handle = self.engine.submit(b.slices)
            status = self.engine.wait(handle, _STATUS_TIMEOUT)
            if status is Status.COMPLETED and b.redeliver is not None:
                due = self.now + b.redeliver
                if not self.faults.redeliver_after_done:
                    b.first = status  # DONE waits for the copy still in the transport
                    self._line.setdefault(due, []).append(b)
                    return
                self._redo.setdefault(due, []).append((b.slices[:1], b.slots))
                held = True
        job = b.job
        if status is Status.COMPLETED:
            if not held:
                self._free_slots.extend(b.slots)
            self.counters["bytes_landed"] += sum(s[2] for s in b.slices)
        else:
            # The batch's other slices may still be reading these slots: never reuse them.
            self.counters["batches_failed"] += 1
            self.counters["staging_quarantined"] += len(b.slots)
        if job.assign.grant not in self._jobs:
            return
        evs = job.transfers.on_status(b.seq, int(status))
        if status is not Status.COMPLETED and not job.failed_reported:
            job.failed_reported = True
            a = job.assign
            self._send(job, TransferFailed(a.request, a.grant, b.seq))
            evs += job.transfers.stop()
        self._send_evidence(job, evs)
        self._maybe_conclude(job)

    def _maybe_conclude(self, job: _Job) -> None:
        t = job.transfers
        if t.last_seq is None:
            return
        if t.concluded and (not t.failed or self._all_landed(job)):
            self._concluded(job.assign.grant, job)

    def _all_landed(self, job: _Job) -> bool:
        return not any(b.job is job for bs in self._line.values() for b in bs)

    def busy(self) -> bool:
        busy = bool(self._jobs) or bool(self._line) or bool(self._redo)
        return busy or self.link.pending() > 0


# =========================================================================== the process


def prefill_main(cfg: dict[str, Any]) -> None:
    """Entry point of the prefill process (``multiprocessing`` spawn target).

    ``cfg``: endpoint, peer, seed, faults (dict), block_bytes, staging_bytes, memory (the
    target's descriptor), crash_tick (or None), parent_pid, link_salt, idle_exit_s, rank (tensor
    parallel), handover_region (``land_after_crash``).
    """

    def worker(engine: TransferEngine, common: dict[str, Any]) -> PrefillWorker:
        return PrefillWorker(engine, **common, target=cfg["memory"], rank=int(cfg.get("rank", 0)))

    serve_initiator(cfg, worker)


# =========================================================================== seen from decode


def start_prefill(
    ctx: Any, cfg: RunSettings, target: TargetMemory, incarnation: int, *, crashed: int, start: int
) -> PeerGroup:
    """Start prefill incarnation ``incarnation``: ``tp_ranks`` processes, each writing its part
    of every block (``prefill-<i>``; with several ranks, ``prefill-<i>/rank<r>``), each with its
    own hand-over region in the target's table (``land_after_crash``), freed by ``take_over``
    (a crash) or ``cut`` (a fence) before a later incarnation gets it again."""
    tp = cfg.faults.tp_ranks

    def rank_process(rank: int) -> PeerProcess:
        config = peer_config(cfg, target, incarnation, crashed=crashed, start=start)
        config["rank"] = rank
        if rank:
            config["link_salt"] = int(config["link_salt"]) + 100_000 * rank
        region = (incarnation * tp + rank) % HANDOVER_REGIONS
        config["handover_region"] = region
        name = f"prefill-{incarnation}" if tp == 1 else f"prefill-{incarnation}/rank{rank}"
        p = PeerProcess(ctx, name, incarnation, prefill_main, config)
        p.region = region
        return p

    return PeerGroup(incarnation, tp, rank_process)
