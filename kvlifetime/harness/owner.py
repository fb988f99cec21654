"""The memory owner's side of a run, whichever way the bytes go: decode owning the arena prefill
writes (``push_owner.DecodeWorker``), or prefill owning the blocks decode reads
(``pull_owner.SourceOwner``).

What both share lives here: the typed counters (``OwnerCounts``) and how a request ended
(``Ending``); one tick's frame (the policy's deadlines, the timeout reaper, the releases the
evidence allows, queries, admissions, one ``Tick`` per peer rank); frames in from a peer's
connection (malformed ones refused and counted); what a crash and a fence do to the ledger;
when the proof policy fences; and what counts as *leaked* (``leaked_blocks``). Each direction
says what it does with a message, how it admits a request and what its requests wait for.

The engine's side of each request is the specification's (``EngineSideLifecycle``, docs/engine.md),
held in one ``kvlifetime.guard.Holds`` per owner and stepped only there: whether a request runs,
ended, is withheld or quarantined, releasable or handed back is its hold's state, never a flag of
the owner's. The ledger's release is handed back through the table (``released``, then
``handed_back``); a policy that frees without proof (naive, timeout) does not force the table:
the hand-back the table refuses is recorded (``Refusals``, ``OwnerCounts.refused_hand_backs``).

::

    push: running ─load_granted─► loading ─load_landed─► load_received ─finished─► ended
    pull: running ─read_granted─► reading ─finished─► withheld
    ended early, a peer may still touch the blocks:  loading ─aborted─► withheld
    no proof by the deadline, or the peer lost:  withheld ─deadline, lease_expired─► quarantined
    the ledger released it:  withheld, quarantined ─released─► releasable ─handed_back─► gone
                             ended ─handed_back─► gone        (nothing is exposed any more)
    freed unproven (naive, timeout):  withheld, quarantined ─handed_back─► refused, counted
"""

from __future__ import annotations

import contextlib
import enum
import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime.errors import EvidenceError
from kvlifetime.evidence import AccessRevoked, PeerLost
from kvlifetime.grant import Grant, RequestKey
from kvlifetime.guard import Hold, Holds, Refusal, Refusals
from kvlifetime.harness.faults import FaultyLink, RequestPlan, plan
from kvlifetime.harness.series import StateSeries
from kvlifetime.harness.wire import MalformedMessage, Message, Tick, decode, encode
from kvlifetime.ledger import BlockLedger
from kvlifetime.ledger.values import LedgerStats
from kvlifetime.spec.vocabulary import BlockState, RequestState

# Engine-side states (``EngineState`` values) of a request the owner ended with an exposure
# still open: its blocks wait for the ledger's verdict (``released``) or a fence.
HELD_STATES = frozenset({"withheld", "quarantined"})

if TYPE_CHECKING:
    from kvlifetime.adapters.transfer import TargetMemory
    from kvlifetime.harness.oracle import TransportOracle
    from kvlifetime.harness.settings import RunSettings

log = structlog.get_logger("kvlifetime")


class Ending(enum.Enum):
    """How a request ended, as the owner counts it. The value is the reason the ledger is
    given when the owner ends it early (``BlockLedger.reject``)."""

    COMPLETED = "completed"  # its KV was consumed and it finished normally
    ABORTED = "client_abort"  # by the client
    REJECTED = "rejected"  # by the peer's admission, after the addresses were sent
    TRANSFER_FAILED = "transfer_failed"  # a batch reported FAILED
    LOST_TO_CRASH = "lost_to_crash"  # live when its peer crashed
    LOST_TO_FENCE = "lost_to_fence"  # live when its peer was fenced


@attrs.define(slots=True)
class OwnerCounts:
    """What the owner counted over a run; the result reads it field by field."""

    completed: int = 0
    aborted: int = 0
    rejected: int = 0
    transfer_failed: int = 0
    lost_to_crash: int = 0
    lost_to_fence: int = 0
    lost_to_restart: int = 0  # requests the owner held when it restarted
    ended_mid_transfer: int = 0  # ended early with a transfer posted and the grant open
    # KV consumed with another request's bytes in it: push, blocks checked at consume (and
    # at the end); pull, stale reads (the reader's check of every block it read)
    contaminated_blocks: int = 0
    contaminated_requests: int = 0
    reads: int = 0  # pull: blocks the reader read and checked
    kv_bytes: int = 0  # bytes of KV consumed by decode
    queries: int = 0  # evidence re-requested after a loss
    hold_ticks: int = 0  # allocation to release, summed over released requests
    released_requests: int = 0
    released_by_late_proof: int = 0  # quarantined, then released by proof that came late
    peak_blocks_out: int = 0  # most blocks out of the pool at once
    peak_quarantined_blocks: int = 0  # sampled every 8 ticks (and before each fence)
    admission_stalls: int = 0  # times a request waited for free blocks
    prefix_hits: int = 0  # push: requests that shared their first blocks with an earlier one
    # messages refused: not a message at all; from a connection that may not say it; about
    # a grant this owner never issued; of a kind the owner never takes
    malformed_refused: int = 0
    unauthorized_refused: int = 0
    unknown_refused: int = 0
    unexpected_refused: int = 0
    reads_refused: int = 0  # pull: a reader's check naming blocks its grant does not have
    contradictory_after_release: int = 0  # pull: a second, different stop after release
    # frees the engine-side table refused to hand back: the policy freed blocks the ledger had
    # not proven (naive, timeout); under the proof policy always 0
    refused_hand_backs: int = 0

    def ended(self, how: Ending) -> None:
        """One more request ended ``how``."""
        if how is Ending.COMPLETED:
            self.completed += 1
        elif how is Ending.ABORTED:
            self.aborted += 1
        elif how is Ending.REJECTED:
            self.rejected += 1
        elif how is Ending.TRANSFER_FAILED:
            self.transfer_failed += 1
        elif how is Ending.LOST_TO_CRASH:
            self.lost_to_crash += 1
        else:
            self.lost_to_fence += 1


def leaked_blocks(ledger: BlockLedger) -> int:
    """Blocks out of the pool that no quarantine explains: neither free, nor quarantined, nor
    held by a quarantined request (a prefix it shares, settled, waits with it)."""
    n = ledger.num_blocks
    ok = ledger.block_state(np.arange(n)) == BlockState.FREE
    for st in ledger.stats().quarantined:
        ok[ledger.blocks_of(st.request)] = True
    return int(np.count_nonzero(~ok))


class Owner:
    """The memory owner's worker, free of sockets: the loop hands it each tick and the frames
    each peer rank answered. A direction implements the abstract part below."""

    ROLE: ClassVar[str] = ""  # "decode" / "prefill", in its log events
    TIMEOUT_REASON: ClassVar[str] = "lease expired"  # what the timeout policy tells the ledger
    # the timeout policy also sets the ledger's deadline (decode's, as SGLang's does: the
    # ledger quarantines the request at that tick and the reaper frees it right after), or
    # only arms the reaper (prefill's, as vLLM's send lease)
    TIMEOUT_SETS_DEADLINE: ClassVar[bool] = False

    cfg: RunSettings
    oracle: TransportOracle

    def __init__(
        self, cfg: RunSettings, memory: TargetMemory, ledger: BlockLedger, links: int = 1
    ) -> None:
        self.cfg = cfg
        self.memory = memory
        self.ledger = ledger
        # one control link per peer rank (rank 0's is ``link``)
        self.links = [FaultyLink(cfg.seed, 2, cfg.faults)] + [
            FaultyLink(cfg.seed, 2 + 7919 * r, cfg.faults) for r in range(1, links)
        ]
        self.link = self.links[0]
        self.count = OwnerCounts()
        self.now = 0
        self.next_request = 0
        self.last_admitted = 0  # tick of the last admission (the pool ran dry if it stays old)
        self._reaper: list[tuple[int, int]] = []  # (deadline, request): timeout policy
        self._fenced: set[str] = set()  # peers whose access a fence ended: heard no more
        self.fences: dict[str, int] = {}  # fence name -> times performed
        self._fencing = False  # True while releasing what a fence made releasable
        self.retired: list[LedgerStats] = []  # the stats of ledgers replaced by a restart
        self.series = StateSeries()  # blocks by state over the run, for the report's plots
        # The engine side of every request (keyed ``str(request)``): the only state it has.
        # Its refusals are data here (counted, in the result), not drained onto the log: the
        # only ones a run makes are the hand-backs of unproven frees, each already logged by
        # the ledger (``force_released``), and a run's log holds the ledger's events alone.
        self.refusals = Refusals(f"harness-{self.ROLE}", log=False)
        self.holds: Holds[Grant] = Holds(self.refusals)

    # ----------------------------------------------------------------- a direction's part

    def _begin_tick(self, n: int, peers: Sequence[str]) -> None:
        """What the tick does before the policy's deadlines (requests ending by the plan)."""
        raise NotImplementedError

    def _holding(self, key: int) -> bool:
        """Whether request ``key`` still holds its blocks (the timeout reaper may free them)."""
        raise NotImplementedError

    def _release(self, key: RequestKey, ids: npt.NDArray[np.int64], *, proven: bool = True) -> None:
        """The ledger released ``key``'s blocks (``ids`` went back to the pool); ``proven``:
        every grant was closed (its verdict), else the policy forced it (``_force``)."""
        raise NotImplementedError

    def _queries(self, n: int) -> None:
        raise NotImplementedError

    def _admit(self, n: int, peers: Sequence[str], outs: list[list[bytes]]) -> None:
        raise NotImplementedError

    def handle(self, msg: Message, sender: str) -> None:
        """Act on one message that came in on the connection of peer ``sender``."""
        raise NotImplementedError

    def _lost(self, peer: str, how: Ending) -> None:
        """``peer`` is gone (crashed, or fenced): end what of its requests it still served."""
        raise NotImplementedError

    def idle(self) -> bool:
        """Nothing left to happen but quarantine (proof that may never come)."""
        raise NotImplementedError

    def oracle_figures(self) -> dict[str, int | str]:
        """The oracle's counts, for the result."""
        raise NotImplementedError

    def observe(self) -> None:
        """Hand the oracle what landed since the last look (before anything changes hands)."""

    @property
    def stale_read_blocks(self) -> int:
        """Distinct blocks a stale read hit (only a reader checks what it read)."""
        return 0

    def restart(self, mode: str, peers: list[str]) -> None:
        raise NotImplementedError(f"the {self.ROLE} owner does not restart")

    # ----------------------------------------------------------------- one tick

    def tick_ranks(self, n: int, peers: Sequence[str], admit_more: bool) -> list[list[bytes]]:
        """The owner's work for tick ``n``; per peer rank (``peers``, one per rank), the frames
        to send it (``Tick`` last)."""
        self.now = n
        outs: list[list[bytes]] = [[] for _ in peers]
        self._begin_tick(n, peers)
        if self.cfg.policy != "naive":
            for qkey in self.ledger.expire(float(n)):
                # Its deadline passed without proof: quarantined.
                self.holds.fire(str(qkey), "deadline")
        while self._reaper and self._reaper[0][0] <= n:
            _, key = heapq.heappop(self._reaper)
            if self._holding(key) and self.ledger.state(key) is not RequestState.TRANSFER_QUIESCED:
                # The lease reaper: the deadline passed without proof, free anyway.
                self.holds.fire(str(key), "lease_expired")
                self._force(key, self.TIMEOUT_REASON)
        for rkey, ids in self.ledger.collect_releasable().items():
            self._release(rkey, ids)
        self._queries(n)
        if admit_more:
            self._admit(n, peers, outs)
        held = self.cfg.num_blocks - self.ledger.free_count()
        self.count.peak_blocks_out = max(self.count.peak_blocks_out, held)
        for link, out in zip(self.links, outs, strict=False):
            out.extend(link.due(n))
            out.append(encode(Tick(n)))
        # The tick's exposures leave with its frames: a report from now on may be about them.
        self.holds.next_step()
        return outs

    def tick(self, n: int, peer: str, admit_more: bool) -> list[bytes]:
        """The owner's work for tick ``n`` with one peer; the frames to send (``Tick`` last)."""
        return self.tick_ranks(n, [peer], admit_more)[0]

    def _ended(self, key: int, reason: str) -> None:
        """What each policy does when the owner's part of ``key`` is over (``reason``) and a
        peer may still touch its blocks: naive frees them, timeout arms the reaper, proof sets
        the deadline at which the ledger quarantines them."""
        cfg = self.cfg
        if cfg.policy == "naive":
            self._force(key, reason)
        elif cfg.policy == "timeout":
            if self.TIMEOUT_SETS_DEADLINE:
                self.ledger.set_deadline(key, self.now + cfg.timeout_ticks)
            heapq.heappush(self._reaper, (self.now + cfg.timeout_ticks, key))
        else:
            self.ledger.set_deadline(key, self.now + cfg.proof_deadline_ticks)

    def _next_plan(self) -> RequestPlan | None:
        """The next request's plan, when it may be admitted now: None when every request was
        admitted or the pool is short of its blocks (back-pressure: it waits, counted)."""
        key = self.next_request
        if key >= self.cfg.requests:
            return None
        p = plan(self.cfg.seed, key, self.cfg.faults)
        if self.ledger.free_count() < p.nblocks:
            self.count.admission_stalls += 1
            return None
        return p

    def _force(self, key: int, reason: str) -> None:
        """The policy frees ``key`` now, proven or not (``force_release``: unsafe, counted by
        the ledger, unless every grant was closed already)."""
        proven = self.ledger.state(key) is RequestState.TRANSFER_QUIESCED
        self._release(key, self.ledger.force_release(key, reason), proven=proven)

    def _hand_back(
        self, key: RequestKey, hold: Hold[Grant], admitted: int, *, proven: bool
    ) -> Refusal | None:
        """The ledger let go of ``key``'s blocks (admitted at tick ``admitted``): hand them
        back through the engine-side table. Proven (the ledger's verdict): an ended request
        with its exposure open goes ``released`` then ``handed_back``. Forced without proof:
        ``handed_back`` only, which the table refuses while it holds the exposure open; the
        refusal is recorded, the table is not forced. Returns it (None: handed back)."""
        request = str(key)
        was = hold.state
        if proven:
            hold.read = hold.write = None  # every grant closed: the exposure is over
            if was in HELD_STATES:
                self.holds.fire(request, "released", hold)
        refusal: Refusal | None = self.holds.fire(request, "handed_back", hold)
        if refusal is not None:
            self.count.refused_hand_backs += 1
        if was == "quarantined" and proven and not self._fencing:
            self.count.released_by_late_proof += 1  # quarantine had a way out: the proof
        self.count.hold_ticks += self.now - admitted
        self.count.released_requests += 1
        return refusal

    # ----------------------------------------------------------------- inbound

    def receive(self, frames: list[bytes], sender: str) -> None:
        """Frames that came in on the connection of peer ``sender`` (the transport's identity:
        evidence in them is stamped with it, whatever they say inside)."""
        self.observe()  # the landings of the tick these frames close happened before them
        for frame in frames:
            try:
                msg = decode(frame, sender=sender)
            except MalformedMessage as e:
                self.count.malformed_refused += 1
                if structlog.is_configured():
                    log.error("message_refused", worker=self.ROLE, error=str(e), size=len(frame))
                continue
            self.handle(msg, sender)

    def _refuse_unauthorized(self, what: str, sender: str, why: str, **about: Any) -> None:
        """A message ``sender`` may not send (``UnauthorizedMessage``): logged and counted, and
        it changes nothing."""
        from kvlifetime.harness.wire import UnauthorizedMessage

        e = UnauthorizedMessage(f"{what} from {sender!r} refused: {why}")
        self.count.unauthorized_refused += 1
        if structlog.is_configured():
            log.error(
                "message_refused",
                worker=self.ROLE,
                kind=e.kind,
                message=what,
                sender=sender,
                error=str(e),
                **about,
            )

    def _refuse_unexpected(self, msg: Message) -> None:
        self.count.unexpected_refused += 1
        if structlog.is_configured():
            log.error("message_refused", worker=self.ROLE, error=f"unexpected {msg.TYPE}")

    # ----------------------------------------------------------------- crashes and fences

    def peer_crashed(self, peer: str) -> None:
        """``peer``'s process died and was reaped: ``PeerLost`` (which proves nothing about
        memory), and what of its requests it still served is lost."""
        with contextlib.suppress(EvidenceError):  # refused and counted by the ledger
            self.ledger.apply(PeerLost(peer))
        self._lost(peer, Ending.LOST_TO_CRASH)

    def fenced(self, peer: str, fence: str) -> None:
        """``peer``'s access to the memory was ended for real by ``fence`` (observed complete
        by this process): its live requests are ended, and the local ``AccessRevoked`` closes
        every grant to it, quarantined ones included."""
        self.observe()  # what landed before the fence, while the blocks are still held
        self._fenced.add(peer)
        self._lost(peer, Ending.LOST_TO_FENCE)
        self.ledger.apply(AccessRevoked(peer, fence=fence))
        self.fences[fence] = self.fences.get(fence, 0) + 1
        for request, hold in self.holds:
            # A request still running whose exposure the fence ended (pull: granted, not yet
            # ended by prefill): it runs on with nothing exposed.
            if (
                hold.state in ("loading", "reading")
                and not self.ledger.open_grants(int(request))
                and self.holds.fire(request, "fenced", hold) is None
            ):
                hold.read = hold.write = None
        self._fencing = True
        try:
            for rkey, ids in self.ledger.collect_releasable().items():
                self._release(rkey, ids)
        finally:
            self._fencing = False

    def quarantined_blocks(self) -> int:
        q = self.ledger.stats().blocks_by_state.get(BlockState.QUARANTINED.label, 0)
        self.count.peak_quarantined_blocks = max(self.count.peak_quarantined_blocks, q)
        return q

    def _sample(self, tick: int) -> LedgerStats:
        """One reading of the ledger, kept in the series (the report's plots)."""
        st = self.ledger.stats()
        old = self.retired
        o = self.oracle
        self.series.sample(
            tick,
            st,
            reclaimed=sum(st.reclaimed_blocks.values())
            + sum(sum(s.reclaimed_blocks.values()) for s in old),
            unsafe_releases=st.unsafe_releases + sum(s.unsafe_releases for s in old),
            late_writes=o.late_into_owned + o.late_into_free,
            stale_reads=o.stale_reads,
        )
        return st

    def wants_fence(self, n: int, *, quiet: bool) -> bool:
        """The proof policy fences on quarantine pressure (checked every 8 ticks), and once
        the system is ``quiet`` with only quarantined requests left (so that it ends with
        nothing lost). The peak of quarantine is sampled whatever the policy, every 8 ticks
        (the series may read the ledger more often; those readings leave the peak alone)."""
        cfg = self.cfg
        checks = not n % 8 or quiet
        if not checks:
            if self.series.due(n):
                self._sample(n)
            return False
        st = self._sample(n)
        q = st.blocks_by_state.get(BlockState.QUARANTINED.label, 0)
        self.count.peak_quarantined_blocks = max(self.count.peak_quarantined_blocks, q)
        if cfg.policy != "proof" or not cfg.fence:
            return False
        return q > 0 and (quiet or 0 < cfg.fence_quarantined_blocks <= q)
