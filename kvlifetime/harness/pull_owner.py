"""The pull direction's owner (vLLM's NIXL path): prefill, whose blocks decode READs.

Here the memory owner is **prefill** (``SourceOwner``, in this process). It holds its *source*
blocks in a ``BlockLedger``, computes each request's KV into them itself
(``pattern.words(request, blocks, generations)``), opens a READ grant to the decode peer *before*
the addresses leave the process, sends them (``ReadAssign``) and ends its own part of the
request (``finish``): from there the blocks wait for decode's reads. The reader is **decode**
(``harness.pull_initiator``, in another process): it reports what it read (``ReadsChecked``)
and evidence about its own grant, which prefill stamps with the connection's identity, never
with the name inside.

What prefill does with its source blocks is the policy:

- ``naive``: free them at once when the request ends on prefill's side (``force_release``);
- ``timeout``: what vLLM does today: free them on decode's notification, or when the send
  lease expires, whatever the reads (``_reap_expired_send_leases``); no ledger deadline;
- ``proof``: release only through ``collect_releasable`` once the evidence closed the grant;
  quarantine at a deadline; fence after a crash of the reader (reaping the reader process on the
  in-process engine, whose copies run on the reader's thread; re-creating the serving engine on
  Mooncake, the serving agent on NIXL) and on quarantine pressure.

Each request's engine side is its hold (``Owner.holds``, the specification's table): admitted
``running``, its READ grant ``read_granted`` (``reading``), ended by prefill ``finished``
(``withheld`` while decode may read, ``ended`` when its reads were proven over first); a proof
the ledger accepts that the reads are over is ``reads_done`` (never in the tick that sent the
ids: ``Holds.next_step`` at each tick's end), a lost reader ``lease_expired``; handed back when
the ledger releases it. Released means handed back by the table, or freed by the policy without
proof (the hand-back the table refused, kept on the request).

The run is ``harness.loop``'s, in lock-step ticks as the push direction's: one seed decides
every fault and every read order, so two runs with one seed give the same figures on the
in-process engine. The reader checks its reads inside its tick while prefill waits, so
prefill's own view of its arena at that moment gives a second, independent count
(``owner_view_*`` in the result's ``oracle``); the two must agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.adapters.transfer import TargetMemory
from kvlifetime.errors import KVLifetimeError, StaleEvidence, UnauthorizedEvidence
from kvlifetime.evidence import Evidence, SchedulingStopped, TransferCompleted, TransferQuiesced
from kvlifetime.grant import Access, Grant, GrantId, RequestKey
from kvlifetime.guard import Hold, Refusal
from kvlifetime.harness import pattern
from kvlifetime.harness.faults import RequestPlan
from kvlifetime.harness.oracle import TransportOracle
from kvlifetime.harness.owner import Ending, Owner
from kvlifetime.harness.settings import PullSettings
from kvlifetime.harness.wire import (
    EvidenceMsg,
    Message,
    Query,
    ReadAssign,
    ReaderPending,
    ReadsChecked,
    TransferFailed,
    encode,
)
from kvlifetime.ledger import BlockLedger

PLANTED = 1 << 40  # request number of the "other request" a planted stale read belongs to


@attrs.define(slots=True)
class _Src:
    """One request prefill holds: its plan, grant and words, what it was told, when. Where it
    is in its life is ``hold.state`` (the engine-side table)."""

    plan: RequestPlan
    grant: Grant
    words: npt.NDArray[np.uint64]  # the grant's words, one per block
    admitted: int
    last_news: int
    hold: Hold[Grant]  # its engine-side state (``Owner.holds``, the only place it changes)
    queries: int = 0
    stopped_at: int | None = None  # SchedulingStopped's last_seq, once seen
    outcome: Ending | None = None  # how its reads ended, as far as prefill can tell
    stale: bool = False  # one of its reads was stale (counted once per request)
    # The policy freed its blocks without proof: the hand-back the engine-side table refused
    # (its hold stays where the table left it; the blocks are back in the pool all the same).
    refused: Refusal | None = None

    @property
    def released(self) -> bool:
        """Its blocks went back to the pool: handed back by the table, or freed unproven."""
        return self.hold.state == "handed_back" or self.refused is not None

    @property
    def concluded(self) -> bool:
        """The reader's reads of it ended: the READ exposure is over (proven, closed by the
        ledger or a fence), or its reader was lost (the lease reaped: no report comes)."""
        return self.hold.read is None or self.hold.read_reaped

    @property
    def quarantined(self) -> bool:
        return self.hold.state == "quarantined"


class SourceOwner(Owner):
    """Prefill in the pull direction: the memory owner. It computes KV into its own source
    blocks, grants them READ to the decode peer, and decides when they go back to its pool."""

    ROLE: ClassVar[str] = "prefill"
    TIMEOUT_REASON: ClassVar[str] = "send lease expired"
    cfg: PullSettings

    def __init__(self, cfg: PullSettings, source: TargetMemory, ledger: BlockLedger) -> None:
        super().__init__(cfg, source, ledger)
        self.table = source.array.view(np.uint64).reshape(cfg.num_blocks, cfg.block_bytes // 8)
        self.reqs: dict[int, _Src] = {}  # not yet both released and concluded
        self.grants: dict[GrantId, _Src] = {}  # every grant of the run (ReadsChecked lookups)
        self.reader_pending = 0  # the reader's last ReaderPending
        self.reader = ""  # the current reader's connection (the peer ticked last)
        self._ending: list[int] = []  # admitted this tick: prefill ends them at the next
        # Prefill's own view of its arena: the word each block holds (it is the only writer).
        self.oracle = TransportOracle(cfg.num_blocks, cfg.block_bytes, "owner view")
        self.stale_blocks: set[int] = set()

    # ----------------------------------------------------------------- inbound

    def handle(self, msg: Message, sender: str) -> None:
        if isinstance(msg, ReadsChecked):
            self._reads(msg, sender)
        elif isinstance(msg, EvidenceMsg):
            self._evidence(msg.evidence, sender)
        elif isinstance(msg, TransferFailed):
            r = self._about(msg.request, msg.grant, sender, msg.TYPE)
            if r is not None:
                r.last_news = self.now
                self._outcome(r, Ending.TRANSFER_FAILED)
        elif isinstance(msg, ReaderPending):
            if sender != self.reader:
                # Only the current reader's count says whether reads are still to come.
                self._refuse_unauthorized(msg.TYPE, sender, "not the reader")
                return
            self.reader_pending = msg.grants
        else:
            self._refuse_unexpected(msg)

    def _about(
        self, request: int | str, grant: GrantId, sender: str, what: str = ""
    ) -> _Src | None:
        """The request ``grant`` is of, when a message about it from connection ``sender``
        may be acted on: exact match on grant and request, sent by the grant's peer on its own
        connection, not fenced. A message from another connection is refused as unauthorized
        (logged and counted); one about a grant this owner never issued, as unknown."""
        r = self.grants.get(grant)
        if r is None or r.grant.request != request:
            self.count.unknown_refused += 1
            return None
        if r.grant.peer != sender or sender in self._fenced:
            why = "its connection was fenced" if sender in self._fenced else "not the grant's peer"
            self._refuse_unauthorized(what or "message", sender, why, grant=str(grant))
            return None
        return r

    def _reads(self, m: ReadsChecked, sender: str) -> None:
        r = self._about(m.request, m.grant, sender, m.TYPE)
        pos = {int(b): i for i, b in enumerate(r.grant.blocks.tolist())} if r is not None else {}
        if r is None or not all(b in pos for b in m.blocks):
            self.count.reads_refused += 1
            return
        idx = [pos[b] for b in m.blocks]
        stale = np.asarray(m.stale, dtype=bool)
        self.count.reads += len(idx)
        self.count.kv_bytes += len(idx) * self.cfg.block_bytes
        nstale = int(stale.sum())
        if nstale:  # a stale read is KV decode computes from: contaminated
            self.count.contaminated_blocks += nstale
            self.stale_blocks.update(b for b, s in zip(m.blocks, m.stale, strict=True) if s)
            if not r.stale:
                r.stale = True
                self.count.contaminated_requests += 1
        # The second count: what prefill's arena held for these blocks while they were read.
        self.oracle.read(np.asarray(m.blocks, dtype=np.int64), r.words[idx])

    def _evidence(self, ev: Evidence, sender: str) -> None:
        gid = getattr(ev, "grant_id", None)
        req = getattr(ev, "request", None)
        try:
            self.ledger.apply(ev)
        except UnauthorizedEvidence:
            self.count.unauthorized_refused += 1
            return
        except StaleEvidence:
            if sender in self._fenced:
                return  # refused, logged and counted by the ledger: a fenced reader is not heard
            # The ledger forgot the grant because this owner released the request itself
            # (naive, timeout, or a late proof after release): it has no verdict left to give.
            # What the grant's own peer says then only tells when its reads ended - never a
            # second, different stop (the first one stands).
            r = None if gid is None or req is None else self._about(req, gid, sender)
            if r is None or not r.released:
                return
            if isinstance(ev, SchedulingStopped | TransferCompleted) and r.stopped_at not in (
                None,
                ev.last_seq,
            ):
                self.count.contradictory_after_release += 1
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
            self._outcome(r, Ending.COMPLETED)
        elif isinstance(ev, SchedulingStopped):
            r.stopped_at = ev.last_seq
            failed = any(r.plan.fails[: ev.last_seq])
            if ev.last_seq >= 1 and not r.concluded and r.outcome is None:
                self.count.ended_mid_transfer += 1
            self._outcome(r, Ending.TRANSFER_FAILED if failed else Ending.ABORTED)
        if r.released:
            # The ledger forgot the grant: only the reader's own final word ends its reads.
            final = isinstance(ev, TransferCompleted) or (
                isinstance(ev, TransferQuiesced)
                and r.stopped_at is not None
                and ev.through_seq >= r.stopped_at
            )
        else:
            final = not self.ledger.open_grants(int(req))  # the ledger's verdict
        if final:
            self._reads_done(r)

    def _outcome(self, r: _Src, how: Ending) -> None:
        if r.outcome is None:
            r.outcome = how
            self.count.ended(how)

    def _reads_done(self, r: _Src) -> None:
        """The reads of ``r``'s grant are over (``reads_done``: the READ exposure ends)."""
        hold = r.hold
        if not r.concluded and self.holds.fire(str(r.grant.request), "reads_done", hold) is None:
            hold.read = None
        self._settle(r)

    def _settle(self, r: _Src) -> None:
        """Forget ``r`` once it is both released and concluded."""
        if r.released and r.concluded:
            self.reqs.pop(int(r.grant.request), None)

    # ----------------------------------------------------------------- releases

    def _release(self, key: RequestKey, ids: npt.NDArray[np.int64], *, proven: bool = True) -> None:
        # Back in the pool. The blocks keep their bytes until a new owner computes into them:
        # the owner's view (the oracle) changes only then.
        r = self.reqs.get(key) if isinstance(key, int) else None
        if r is None:
            return
        r.refused = self._hand_back(key, r.hold, r.admitted, proven=proven)
        self._settle(r)

    # ----------------------------------------------------------------- one tick

    def _begin_tick(self, n: int, peers: Sequence[str]) -> None:
        """The prefill step that computed last tick's admissions is over: those requests end on
        prefill's side (vLLM: ``request_finished``, the blocks wait for decode's reads)."""
        self.reader = peers[0]
        ending, self._ending = self._ending, []
        for key in ending:
            r = self.reqs.get(key)
            hold = None if r is None else r.hold
            if hold is not None:
                # reading -> withheld (decode may still read), or running -> ended (its reads
                # were proven over first)
                self.holds.fire(str(key), "finished", hold)
            self.ledger.finish(key)
            if hold is not None and hold.read_reaped and hold.state == "withheld":
                # Its reader was lost while prefill ran it: the ledger quarantines it as it
                # ends, and so does the table.
                self.holds.fire(str(key), "lease_expired", hold)
            self._ended(key, "prefill finished")

    def _holding(self, key: int) -> bool:
        r = self.reqs.get(key)
        return r is not None and not r.released

    def _queries(self, n: int) -> None:
        # Lost evidence is asked for again; evidence is idempotent, so asking is always safe.
        for key, r in self.reqs.items():
            if r.concluded or r.queries >= self.cfg.max_queries:
                continue
            if n - r.last_news >= self.cfg.query_every:
                r.queries += 1
                r.last_news = n
                self.count.queries += 1
                self.link.offer(encode(Query(key, r.grant.id)), n)

    def _admit(self, n: int, peers: Sequence[str], outs: list[list[bytes]]) -> None:
        cfg = self.cfg
        peer, out = peers[0], outs[0]
        for _ in range(cfg.arrivals_per_tick):
            p = self._next_plan()
            if p is None:
                break
            key = self.next_request
            ids = self.ledger.allocate(key, p.nblocks)
            self.last_admitted = n
            # The READ grant exists before the addresses leave the process.
            g = self.ledger.grant(key, peer, ids, Access.READ)
            w = pattern.words(key, ids, g.generations)
            self.table[ids] = w[:, None]  # prefill computes the request's KV into its blocks
            self.oracle.granted(key, ids, w)
            hold = self.holds.admit(str(key))
            hold.read, hold.read_step = g, self.holds.step  # its ids leave with this tick
            self.holds.fire(str(key), "read_granted", hold)
            r = _Src(p, g, w, n, n, hold)
            self.reqs[key] = r
            self.grants[g.id] = r
            self.next_request += 1
            addrs = tuple(self.memory.address(int(b) * cfg.block_bytes) for b in ids)
            blocks = tuple(int(b) for b in ids)
            gens = tuple(int(x) for x in g.generations)
            out.append(encode(ReadAssign(key, g.id, peer, blocks, gens, addrs)))
            self._ending.append(key)
            if key == cfg.plant_stale_read:
                self._plant(ids[:1], g.generations[:1])

    def _plant(self, blocks: npt.NDArray[np.int64], gens: npt.ArrayLike) -> None:
        """Give ``blocks`` to another request behind the ledger's back (a test's knob): prefill
        computes that request's KV into them while the grant's read is still to come."""
        w = pattern.words(PLANTED, blocks, gens)
        self.table[blocks] = w[:, None]
        self.oracle.granted(PLANTED, blocks, w)

    # ----------------------------------------------------------------- crashes and fences

    def _lost(self, peer: str, how: Ending) -> None:
        """``peer``'s process is gone and reaped: it reads and reports nothing more."""
        crashed = how is Ending.LOST_TO_CRASH  # a fence ends the reads for real (``fenced``)
        for r in list(self.reqs.values()):
            if r.grant.peer == peer and not r.concluded:
                self._outcome(r, how)
                if crashed:
                    # PeerLost: only time passed; no report will prove these reads over.
                    self.holds.fire(str(r.grant.request), "lease_expired", r.hold)
                    r.hold.read_reaped = True
                    self._settle(r)
        self.reader_pending = 0

    def idle(self) -> bool:
        """The reader will read nothing more, and every request left is released (its final
        evidence lost) or quarantined (waiting for proof that may never come)."""
        return (
            not self._ending
            and self.reader_pending == 0
            and all(r.released or r.quarantined for r in self.reqs.values())
        )

    @property
    def stale_read_blocks(self) -> int:
        return len(self.stale_blocks)

    def oracle_figures(self) -> dict[str, int | str]:
        """The reader's check (what it read, against its grant's words) and, beside it, the
        owner's view of its arena while the blocks were read: two counts that must agree."""
        seen = self.oracle.counts()
        oracle: dict[str, int | str] = dict(attrs.asdict(seen))
        oracle.update(
            method="reader check",
            reads=self.count.reads,
            stale_reads=self.count.contaminated_blocks,
            stale_read_blocks=self.stale_read_blocks,
            owner_view_reads=seen.reads,
            owner_view_stale_reads=seen.stale_reads,
            owner_view_stale_read_blocks=seen.stale_read_blocks,
        )
        return oracle
