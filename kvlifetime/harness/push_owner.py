"""The push direction's owner: decode owns the KV arena prefill writes into, and its ledger.

Decode pre-allocates each request's blocks through the ``BlockLedger``, grants them to the
prefill peer *before* their addresses leave the process, and sends them over ZeroMQ. It checks
every block it consumes (and again when it lets go) against the pattern of its current owner,
so contamination is counted, not guessed; that check and the oracle at the transport are its
``ArenaWatch``'s (``harness.arena_watch``), which looks and never acts. What it does when a
request ends early is the policy:

- ``naive``: release at once (``force_release``, counted unsafe) and reuse the blocks;
- ``timeout``: a lease reaper: release when a deadline passes without proof;
- ``proof``: kvlifetime's rule: release only through ``collect_releasable`` once the evidence
  closes every grant; quarantine when no proof can come (a FAILED batch, a crashed peer); and
  **fence** to get the quarantined blocks back: after a crash, and whenever quarantine grows
  past ``fence_quarantined_blocks``, the peer's access is ended for real (``fence_peer``) and
  the ledger is told so by local ``AccessRevoked`` evidence.

The timeout policy sets the ledger's deadline too (as SGLang's decode does): at that tick the
ledger quarantines the request, and the reaper frees it right after.

Evidence from the prefill peer is stamped with the identity of the socket it came in on (one
socket per prefill incarnation), never with the name inside the message: a peer that claims
what it may not (``kvlifetime.provenance``) is refused and counted.

A decode restart (``PushSettings.restart``) re-creates the ledger mid-run over the same arena,
while the prefill peer's writes are still landing: ``naive`` starts with every block free,
``guarded`` starts with every block quarantined (``BlockLedger.after_restart``) and fences
before reusing any.

Each request's engine side is its hold (``Owner.holds``, the specification's table): admitted
``running``, its WRITE grant ``load_granted`` (``loading``), every rank's ``TransferCompleted``
``load_landed`` (``load_received``: consumed), decoded ``finished`` (``ended``); ended early
``aborted`` (``withheld`` while a write may still land), quarantined at its ``deadline`` or when
its peer is lost (``lease_expired``), and handed back when the ledger releases it.

The run is ``harness.loop``'s, in lock-step ticks (see ``wire.Tick``): one seed decides every
fault and every landing order, so two runs with one seed give the same figures, on the
in-process engine. The initiator, prefill, is ``harness.push_initiator``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime.adapters.transfer import TargetMemory
from kvlifetime.errors import KVLifetimeError, UnauthorizedEvidence
from kvlifetime.evidence import SchedulingStopped, TransferCompleted
from kvlifetime.grant import Grant, GrantId, RequestKey
from kvlifetime.guard import Hold, Holds
from kvlifetime.harness.arena_watch import ArenaWatch
from kvlifetime.harness.faults import RequestPlan, chunks
from kvlifetime.harness.owner import HELD_STATES, Ending, Owner
from kvlifetime.harness.prefix_cache import PrefixCache
from kvlifetime.harness.settings import PushSettings
from kvlifetime.harness.wire import (
    Abort,
    Assign,
    EvidenceMsg,
    Message,
    Query,
    Rejected,
    TransferFailed,
    encode,
)
from kvlifetime.ledger import BlockLedger

log = structlog.get_logger("kvlifetime")


@attrs.define(slots=True)
class _Req:
    """One request decode holds: its plan and grants, what it was told, when. Where it is in
    its life is ``hold.state`` (the engine-side table), nothing here."""

    plan: RequestPlan
    grant: Grant
    admitted: int  # tick
    hold: Hold[Grant]  # its engine-side state (``Owner.holds``, the only place it changes)
    ended: Ending | None = None  # why the owner ended it early (the table says only that it did)
    last_news: int = 0  # tick of the last message about it (or of the last query)
    queries: int = 0
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
    def held(self) -> npt.NDArray[np.int64]:
        """Every block it holds, shared prefix included."""
        return (
            self.grant.blocks
            if self.shared is None
            else np.concatenate([self.shared, self.grant.blocks])
        )

    @property
    def nchunks(self) -> int:
        """Batches prefill writes for it (shared blocks are not written)."""
        return chunks(len(self.grant.blocks))

    @property
    def state(self) -> str:
        return self.hold.state

    @property
    def consumed(self) -> bool:
        """Its KV landed and was consumed (``load_received``, and ``ended`` after it: push
        reaches ``ended`` only from there)."""
        return self.hold.state in ("load_received", "ended")

    @property
    def finished(self) -> bool:
        """It decoded to its normal end."""
        return self.hold.state == "ended" and self.ended is None


def _assign(key: int, grant: Grant, addrs: tuple[int, ...], tokens: int) -> bytes:
    """What one prefill rank is told of a request (``Assign``, encoded): its WRITE grant, the
    blocks and generations it covers, their addresses in the arena, the tokens to prefill."""
    return encode(
        Assign(
            key,
            grant.id,
            grant.peer,
            tuple(int(b) for b in grant.blocks),
            tuple(int(x) for x in grant.generations),
            addrs,
            tokens,
        )
    )


class DecodeWorker(Owner):
    """Decode in the push direction: the memory owner. It grants its blocks WRITE to the
    prefill ranks, consumes the KV once every rank completed, and decides when they go back.
    What really landed in its arena is its ``watch``'s to see (``arena_watch.ArenaWatch``)."""

    ROLE: ClassVar[str] = "decode"
    TIMEOUT_SETS_DEADLINE: ClassVar[bool] = True
    cfg: PushSettings

    def __init__(self, cfg: PushSettings, target: TargetMemory, ledger: BlockLedger) -> None:
        super().__init__(cfg, target, ledger, links=cfg.faults.tp_ranks)
        self.reqs: dict[int, _Req] = {}
        self._aborts: dict[int, list[int]] = {}
        self._finishes: dict[int, list[int]] = {}
        self.prefix = PrefixCache()
        self.watch = ArenaWatch(cfg, target)
        self.oracle = self.watch.oracle

    # ----------------------------------------------------------------- inbound

    def observe(self) -> None:
        """Hand the oracle every landing since the last look (before anything changes hands)."""
        self.watch.observe()

    def handle(self, msg: Message, sender: str) -> None:
        """Act on one message that came in on the connection of peer ``sender`` (the
        transport's identity). A control message about a grant is acted on only when it comes
        from that grant's peer on its own connection, and never from a fenced one: anything
        else is refused (``UnauthorizedMessage``), logged, counted and changes nothing.
        Evidence goes to the ledger first, a fenced connection's too (``_evidence``)."""
        if isinstance(msg, EvidenceMsg):
            self._evidence(msg, sender)
        elif isinstance(msg, Rejected | TransferFailed):
            r = self._live(msg.request, msg.grant)
            if r is None:
                self.count.unknown_refused += 1
                return
            why = self._not_from_peer(r, msg.grant, sender)
            if why is not None:
                self._refuse_unauthorized(msg.TYPE, sender, why)
                return
            if r.state == "loading":
                r.last_news = self.now
                how = Ending.REJECTED if isinstance(msg, Rejected) else Ending.TRANSFER_FAILED
                self.end(int(msg.request), how)
        else:
            self._refuse_unexpected(msg)

    def _not_from_peer(self, r: _Req, grant: GrantId, sender: str) -> str | None:
        """Why ``sender`` may not speak about ``grant`` of ``r`` (None: it may)."""
        if sender in self._fenced:
            return "its connection was fenced"
        g = r.grants[r.rank_of(grant) or 0]
        if g.peer != sender:
            return f"grant {g.id} is to {g.peer!r}"
        return None

    def _live(self, request: int | str, grant: object) -> _Req | None:
        # Exact match on both: a message about another grant of a reused key acts on nothing.
        r = self.reqs.get(request) if isinstance(request, int) else None
        if r is None or not isinstance(grant, GrantId) or r.rank_of(grant) is None:
            return None
        return r

    def _evidence(self, msg: EvidenceMsg, sender: str) -> None:
        """Evidence is the ledger's to judge, a fenced connection's too: about a grant the
        fence closed and forgot it is stale, about another incarnation's grant unauthorized
        (refused, logged, counted in ``stats().refused_evidence``). What the ledger takes
        from a fenced connection can only be a no-op (the fence closed every grant to it);
        the worker refuses it at the connection and acts on none of it."""
        ev = msg.evidence
        try:
            self.ledger.apply(ev)
        except UnauthorizedEvidence:
            self.count.unauthorized_refused += 1
            return  # a claim this peer may not make: refused, logged and counted
        except KVLifetimeError:
            # Refused, logged and counted by the ledger; the worker goes on, and its own
            # bookkeeping follows the ledger's verdict: a refused message changes nothing here.
            return
        if sender in self._fenced:
            self._refuse_unauthorized(msg.TYPE, sender, "its connection was fenced")
            return
        gid = getattr(ev, "grant_id", None)
        req = getattr(ev, "request", None)
        if req is None or gid is None:
            return
        r = self._live(req, gid)
        if r is None:
            return
        if r.state in HELD_STATES:
            self._landed(int(req), r)
            return
        if r.state != "loading":
            return
        r.last_news = self.now
        if isinstance(ev, TransferCompleted):
            r.completed.add(gid)
            if len(r.completed) == len(r.grants):  # every rank's KV has landed
                self._consume(int(req), r)
        elif isinstance(ev, SchedulingStopped):
            # Prefill stopped without completing: its Rejected / TransferFailed may be lost.
            rejected = r.plan.tokens > self.cfg.faults.capacity_tokens
            self.end(int(req), Ending.REJECTED if rejected else Ending.TRANSFER_FAILED)

    # ----------------------------------------------------------------- content checks

    def _check(self, key: int, r: _Req) -> None:
        """Decode's own check of ``r``'s blocks (as it consumes them, and as it lets go):
        every block that does not hold what it should is counted contaminated."""
        bad = self.watch.contaminated(key, r.grant, r.shared, r.shared_words)
        if bad:
            self.count.contaminated_blocks += bad
            self.count.contaminated_requests += 1

    def _landed(self, key: int, r: _Req) -> None:
        """Evidence about a request ended early: once the ledger holds every grant closed, its
        writes are over (``load_landed``: the exposure ends; the ledger releases it)."""
        hold = r.hold
        if (
            hold.write is not None
            and not self.ledger.open_grants(key)
            and self.holds.fire(str(key), "load_landed", hold) is None
        ):
            hold.write = None

    def _consume(self, key: int, r: _Req) -> None:
        # Every rank's TransferCompleted: the load landed, its WRITE grants are closed.
        self.holds.fire(str(key), "load_landed", r.hold)
        r.hold.write = None
        self._check(key, r)
        self.count.kv_bytes += len(r.grant.blocks) * self.cfg.block_bytes
        self._finishes.setdefault(self.now + r.plan.decode_ticks, []).append(key)
        if r.plan.nblocks > 1:
            self.prefix.lend(key)  # its settled blocks may serve a prefix hit

    def _finish(self, key: int) -> None:
        r = self.reqs.get(key)
        if r is None or r.state != "load_received":
            return
        # A write landing after consumption corrupts the blocks while this request holds them.
        self._check(key, r)
        self.holds.fire(str(key), "finished", r.hold)
        self.count.ended(Ending.COMPLETED)
        self.ledger.finish(key)

    # ----------------------------------------------------------------- ending early

    def end(self, key: int, how: Ending) -> None:
        """The owner ends the request early: the error response may go out now; what happens
        to the blocks is the policy's decision."""
        r = self.reqs[key]
        r.ended = how
        self.holds.fire(str(key), "aborted", r.hold)  # withheld while a write may land
        self.count.ended(how)
        open_now = bool(self.ledger.open_grants(key))
        # Prefill posts batch c at tick admitted+1+c and reads an abort before its tick's work.
        posted = min(r.nchunks, max(0, self.now - r.admitted))
        if how is Ending.REJECTED:
            posted = max(posted, r.plan.stub_chunks)
        if open_now and posted >= 1:
            self.count.ended_mid_transfer += 1
        self.ledger.reject(key, how.value)
        self._ended(key, how.value)

    def _release(self, key: RequestKey, ids: npt.NDArray[np.int64], *, proven: bool = True) -> None:
        r = self.reqs.pop(key, None) if isinstance(key, int) else None
        self.watch.released(key, None if r is None else r.held, ids)
        if r is None:
            return  # the previous incarnation's blocks after a guarded restart: no request
        self._hand_back(key, r.hold, r.admitted, proven=proven)

    # ----------------------------------------------------------------- one tick

    def _begin_tick(self, n: int, peers: Sequence[str]) -> None:
        for key in self._aborts.pop(n, []):
            r = self.reqs.get(key)
            if r is not None and r.state in ("loading", "load_received"):
                self.end(key, Ending.ABORTED)
                for i, g in enumerate(r.grants):
                    self.links[i].offer(encode(Abort(key, g.id)), n)
        for key in self._finishes.pop(n, []):
            self._finish(key)

    def _holding(self, key: int) -> bool:
        return key in self.reqs

    def _queries(self, n: int) -> None:
        # Lost evidence is asked for again; evidence is idempotent, so asking is always safe.
        for key, r in self.reqs.items():
            # Waiting: for its KV (loading), or ended early for the proof its writes are over.
            state = r.state
            if state == "loading":
                due = self.cfg.overdue_ticks
            elif state in HELD_STATES:
                due = self.cfg.query_every
            else:
                continue
            if r.queries >= self.cfg.max_queries:
                continue
            open_now = self.ledger.open_grants(key) if n - r.last_news >= due else []
            if open_now:
                r.queries += 1
                r.last_news = n
                self.count.queries += 1
                for g in open_now:  # each rank is asked about its own grant
                    rank = r.rank_of(g.id)
                    if rank is not None:
                        self.links[rank].offer(encode(Query(key, g.id)), n)

    def _admit(self, n: int, peers: Sequence[str], outs: list[list[bytes]]) -> None:
        for _ in range(self.cfg.arrivals_per_tick):
            p = self._next_plan()
            if p is None:
                break
            key = self.next_request
            shared, shared_words = self.prefix.hit(key, p.prefix, self.ledger, self._decoding)
            self.count.prefix_hits += shared is not None
            ids = self.ledger.allocate(key, p.nblocks - (0 if shared is None else len(shared)))
            self.last_admitted = n
            # The grants (one per rank) exist before the addresses leave the process.
            gs = [self.ledger.grant(key, peer, ids) for peer in peers]
            g = gs[0]
            self.watch.granted(key, ids, g.generations, shared)
            hold = self.holds.admit(str(key))
            hold.write, hold.write_step = g, self.holds.step  # rank 0's stands for every rank
            self.holds.fire(str(key), "load_granted", hold)
            self.reqs[key] = _Req(
                p,
                g,
                n,
                hold,
                last_news=n,
                shared=shared,
                shared_words=shared_words,
                more=tuple(gs[1:]),
            )
            self.next_request += 1
            if p.abort_after is not None:
                self._aborts.setdefault(n + p.abort_after, []).append(key)
            addrs = tuple(self.memory.address(int(b) * self.cfg.block_bytes) for b in ids)
            for out, gi in zip(outs, gs, strict=True):
                out.append(_assign(key, gi, addrs, p.tokens))

    def _decoding(self, key: int) -> Grant | None:
        """The WRITE grant of ``key`` if it consumed its KV and decodes (a prefix may be lent)."""
        e = self.reqs.get(key)
        return None if e is None or e.state != "load_received" else e.grant

    # ----------------------------------------------------------------- crashes and fences

    def _lost(self, peer: str, how: Ending) -> None:
        crashed = how is Ending.LOST_TO_CRASH  # PeerLost: a write may still land, unknown
        for key, r in list(self.reqs.items()):
            if not r.to(peer) or key not in self.reqs:
                continue
            if r.state == "loading":
                if crashed:
                    self.holds.fire(str(key), "lease_expired", r.hold)  # load_failed
                self.end(key, how)
            elif crashed and r.state == "withheld" and r.hold.write is not None:
                self.holds.fire(str(key), "lease_expired", r.hold)  # quarantined

    # ----------------------------------------------------------------- a decode restart

    def restart(self, mode: str, peers: list[str]) -> None:
        """Decode restarts over the same arena: every request it held is lost with its state,
        and a new ledger (a new incarnation) takes over. ``naive``: every block free.
        ``guarded``: every block quarantined (reason previous_incarnation) until fenced."""
        self.retired.append(self.ledger.stats())
        self.count.lost_to_restart += len(self.reqs)
        self.reqs.clear()
        # The engine side is lost with the process: a new table of holds (refusals counted on).
        observers, self.holds = self.holds.observers, Holds[Grant](self.refusals)
        self.holds.observers = observers
        self._aborts.clear()
        self._finishes.clear()
        self._reaper.clear()
        self.observe()
        n = self.cfg.num_blocks
        if mode == "naive":
            self.ledger = BlockLedger(n)
        else:
            self.ledger = BlockLedger.after_restart(n, peers=peers)
        self.watch.restarted(naive=mode == "naive")

    def idle(self) -> bool:
        """Nothing left but quarantined requests (which wait for proof that may never come)."""
        return all(r.state == "quarantined" for r in self.reqs.values())

    def oracle_figures(self) -> dict[str, int | str]:
        return self.watch.figures()
