"""ConnectorGuard: the exposure guard behind vLLM's KV-connector hooks, with no vLLM import.

vLLM keeps a finished request's blocks while its connector says so (``request_finished`` ->
``delay_free_blocks=True``; an asynchronous load in flight) and frees them when the request id
comes back in ``finished_sending`` / ``finished_recving``. The guard sits on that path:

- it records every exposure as a grant on a ledger that guards blocks it does not own
  (``BlockLedger(counts="engine")``: vLLM's own reference counts stay in charge of prefix
  caching, eviction and preemption): a READ grant when the connector delays a free because a
  remote reader has the block ids, a WRITE grant when an asynchronous KV load is about to land;
- it turns each signal into exactly the evidence of ``signals.PROFILE`` (a set membership proves
  one thing about one request; a reaped lease proves only that time passed);
- it hands an ended request's id to vLLM only once the ledger has released it. What can never be
  proven stays held by vLLM and quarantined in the ledger (``stats()``, Prometheus through
  ``LedgerCollector(guard.ledger)``, structured logs), never freed. ``revoke`` is the way out once
  the deployment has fenced the peers (NIXL: the agent recreated).

Duplicate and unknown ids never reach vLLM (its scheduler asserts on them): they are dropped with
a typed error logged (``DoubleRelease`` / ``UnknownRequest``) and counted. So is an id on the
other channel (``wrong_channel``): a ``finished_recving`` membership proves only a WRITE
exposure's load, a ``finished_sending`` one only a READ exposure's reads; an id the guard holds
an exposure for, of either kind, reaches vLLM only once the ledger has released it. And an id
of a request vLLM holds but has not finished (``not_finished``: an early notification, or a stale
one for a reused request id) is dropped too, except a receive for a request waiting for remote
KVs (how a load completes); the connector binds ``phase`` from the scheduler's request table.

A failed asynchronous load proves nothing about what still lands (``LeaseExpired`` on its WRITE
grant). When the request has ended (aborted, or failed by ``kv_load_failure_policy="fail"``) its
blocks are withheld and quarantined. When it lives on (``"recompute"``) vLLM waits for its
``finished_recving`` before it frees the failed load's blocks or recomputes into them: the guard
withholds that receive (``failed_loads_held``), so the request keeps its blocks, waiting for
remote KVs, until a fence closes the grant; then the receive goes to vLLM and vLLM recovers as
it would have. The request's later blocks were never exposed: they are freed as vLLM decides.

``revoke`` takes effect at the next scheduler step whatever the model runner returns: the
connector takes what it released (``take_released``, ``take_fenced_loads``) in
``build_connector_meta``.

What it cannot see:

- blocks vLLM frees without asking the connector. A preemption frees a running request's
  blocks inside ``schedule()`` and may hand them to another request in the same step;
  ``request_finished`` is not called, and the connector learns of it only from
  ``preempted_req_ids`` when that step's metadata is built. A connector's asynchronous save
  still reading those blocks (vLLM #52360) is the worker's to fence (vLLM calls the worker
  connector's ``handle_preemptions`` before the step's forward pass); the guard records no
  exposure for a running request and neither sees nor counts it;
- transfers its connector never reports: a save whose free it is not asked to delay, a lease
  the worker never reaps (the request stays exposed, ``stats()``, until a report or a fence);
- whether a reported transfer really ended: a membership is taken as the evidence of
  ``signals.PROFILE`` and nothing more.

This module is sans-IO: ``connector.py`` calls it from vLLM's hooks; tests drive it directly.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Set

import attrs
import numpy as np
import structlog

from kvlifetime.errors import DoubleRelease, KVLifetimeError, UnknownRequest, UsageError
from kvlifetime.evidence import AccessRevoked, LeaseExpired, TransferCompleted
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger, LedgerStats

_log = structlog.get_logger("kvlifetime.vllm")

# How many handed-back ids are remembered to tell a duplicate from an unknown id.
_REMEMBERED = 65536


@attrs.frozen(slots=True)
class GuardStats:
    """What the guard did, beside the ledger's own ``LedgerStats``."""

    ledger: LedgerStats
    exposed: int  # requests with an exposure the ledger still tracks
    withheld: int  # ended requests vLLM keeps for the guard (waiting for proof, or quarantined)
    handed_back: int  # ids handed to vLLM after the ledger released them; only grows
    lease_reaped: int  # reaped send leases turned into LeaseExpired; only grows
    load_failed: int  # failed loads turned into LeaseExpired on the WRITE grant; only grows
    failed_loads_held: int  # live requests whose failed load's receive waits for a fence
    dropped: dict[str, int]  # "duplicate_id" / "unknown_id" -> ids kept from vLLM; only grow


@attrs.frozen(slots=True)
class Handback:
    """What vLLM's scheduler is shown for one connector output."""

    finished_sending: set[str]
    finished_recving: set[str]


class ConnectorGuard:
    """One vLLM scheduler's exposures (scheduler side of the connector)."""

    def __init__(
        self,
        num_blocks: int,
        *,
        peer: str = "vllm-kv-peer",
        incarnation: str | None = None,
        holds: Callable[[str], bool] | None = None,
        phase: Callable[[str], str | None] | None = None,
    ) -> None:
        self.ledger = BlockLedger(num_blocks, counts="engine", incarnation=incarnation)
        self.peer = peer
        self._live: set[str] = set()
        self._reads: dict[str, Grant] = {}  # request id -> open READ grant (a remote reader)
        self._writes: dict[str, Grant] = {}  # request id -> WRITE grant (an async load)
        # Whether vLLM still holds a request (its scheduler's own table, where the connector
        # found it); otherwise the guard's own view: on_new_request until vLLM frees it.
        self.holds: Callable[[str], bool] = holds if holds is not None else self._live.__contains__
        # Where vLLM's scheduler has the request (bound by the connector from its request
        # table): None (not held), "finished", "waiting_for_remote_kvs" or "running". vLLM frees
        # blocks on an id only for a finished request (it asserts is_finished()); a receive for
        # a request waiting for remote KVs is how a load completes. Unbound: not checked.
        self.phase: Callable[[str], str | None] | None = phase
        self._ended: dict[str, None] = {}  # ended requests vLLM keeps until the guard says
        self._ready: dict[str, None] = {}  # released, to hand back at the next output
        self._recv_seen: set[str] = set()  # live requests whose finished_recving was passed
        self._load_failed: set[str] = set()
        # Live requests whose load failed: their finished_recving is withheld (vLLM would free
        # or recompute into the blocks on it) until a fence closes the WRITE grant; then it is
        # handed to vLLM once (_fenced_loads), at the next scheduler step or output.
        self._held_recv: dict[str, None] = {}
        self._fenced_loads: dict[str, None] = {}
        self._reaped_ids: set[str] = set()  # exposed requests whose lease a worker reaped
        self._handed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._handed_back = 0
        self._reaped = 0
        self._failed = 0
        self._dropped: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ scheduler hooks

    def admitted(self, request: str) -> None:
        """``on_new_request``: vLLM holds the request from now until it frees it."""
        self._live.add(request)

    def allocated(
        self, request: str, block_ids: Iterable[int], num_external_tokens: int, load_async: bool
    ) -> None:
        """``update_state_after_alloc`` (flushed at ``build_connector_meta``, once vLLM has
        decided whether the load is asynchronous): the blocks an asynchronous load will write
        get a WRITE grant before the connector metadata carries their ids to the worker. A
        synchronous load lands inside the step, ordered by vLLM itself: no grant."""
        if num_external_tokens <= 0 or not load_async:
            return
        self._recv_seen.discard(request)  # a new load (first, or after a preemption)
        ids = np.fromiter(block_ids, dtype=np.int64)
        if len(ids) == 0:
            return
        try:
            # One call, all or nothing: a refused grant leaves no hold behind in the ledger.
            self._writes[request] = self.ledger.acquire_and_grant(
                request, ids, self.peer, Access.WRITE
            )
        except KVLifetimeError as e:
            # vLLM handed out a block that another request's transfer may still touch: the
            # guard cannot stop vLLM here, so it says so (and the ledger changed nothing).
            self._refused("exposed_block_reused", request, e)

    def handed_out(self, block_ids: Iterable[int]) -> None:
        """``build_connector_meta``: the blocks vLLM gave requests this step. One under an open
        WRITE grant (an asynchronous load may still land in it) is a reuse vLLM should never
        make while the guard holds the loading request back: logged and counted
        (``exposed_block_reused``); the guard cannot take it back. (A block under READ grants
        only may be a prefix-cache hit, which is allowed.)"""
        ids = np.fromiter(block_ids, dtype=np.int64)
        if len(ids) == 0 or not self._writes:
            return
        try:
            hit = ids[self.ledger.open_access(ids) == 2]
        except KVLifetimeError as e:
            self._refused("handed_out_refused", "-", e)
            return
        if len(hit):
            self._dropped["exposed_block_reused"] += 1
            _log.error("vllm_exposed_block_handed_out", blocks=hit.tolist())

    def finished(self, request: str, block_ids: Iterable[int], delay: bool, aborted: bool) -> bool:
        """``request_finished``: returns the ``delay_free_blocks`` vLLM should see.

        ``delay`` is the inner connector's answer (a remote reader has the block ids: READ
        grant). A request with an exposure still unproven is delayed whatever the inner said.
        """
        self._recv_seen.discard(request)
        # An ended request whose failed load was held: a fence hands it back as an ended one.
        self._held_recv.pop(request, None)
        if delay:
            ids = np.fromiter(block_ids, dtype=np.int64)
            if len(ids):
                self._expose_read(request, ids)
        if request not in self._reads and request not in self._writes:
            if not delay:
                self._live.discard(request)  # vLLM frees it now
            return delay  # nothing exposed: the inner connector's answer stands
        if not self._end(request, aborted):
            return delay
        if request not in self._reads:  # (an open READ grant: not releasable yet)
            self._collect()  # not in _ended yet: released here means "free it now"
            if request not in self._writes:
                if not delay:
                    self._live.discard(request)
                return delay
        self._ended[request] = None
        return True

    def output(
        self,
        finished_sending: Iterable[str] | None,
        finished_recving: Iterable[str] | None,
        *,
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        lease_reaped: Set[str] = frozenset(),
    ) -> Handback:
        """``update_connector_output``: apply what the output proves; return what vLLM sees."""
        for request in self._failed_loads(failed_recving, invalid_block_ids):
            self._expire(self._writes[request], "load_failed")
            self._load_failed.add(request)
            self._failed += 1
        for request in lease_reaped:
            read = self._reads.get(request)
            if read is not None and request not in self._reaped_ids:
                self._expire(read, "lease_reaped")
                self._reaped_ids.add(request)
                self._reaped += 1
        applied = False  # evidence that may have made an ended request releasable
        recving: set[str] = set()
        passed: set[str] = set()  # ids the guard has no exposure for, vLLM still holds
        for request in finished_recving or ():
            if request in self._recv_seen:
                self._drop("duplicate_id", request)
                continue
            if request not in self._writes:
                if self._guarded(request):
                    # A READ exposure (or a withheld request): a receive proves nothing about
                    # a remote read. The id reaches vLLM only once the ledger releases it.
                    self._drop("wrong_channel", request)
                    continue
                if self._passed_through(request, recving, receive=True):
                    self._recv_seen.add(request)
                continue
            live = request not in self._ended
            if request not in self._load_failed:
                self._complete(self._writes[request])
                applied = True
                if live:
                    # The load landed: that exposure is over. Its record ends here; vLLM's
                    # counts keep the blocks for the running request (and may free them on a
                    # preemption without telling the connector).
                    self._end(request, aborted=False)
            elif not live:
                continue  # an ended request's failed load: withheld (quarantined)
            else:
                # A live request's failed load (kv_load_failure_policy="recompute"): on this
                # receive vLLM frees the blocks or recomputes into them, while the failed
                # transfer proves nothing about what still lands. Held until a fence.
                self._hold_failed_load(request)
                continue
            if live:
                self._recv_seen.add(request)
                recving.add(request)
        # The step's remote reads that ended: every proof in one apply_many (each applied or
        # refused on its own, as one apply each would be).
        sent: list[TransferCompleted] = []
        for request in finished_sending or ():
            if request in self._reaped_ids:
                # Withheld: a reaped lease is not a completion. A later membership is another
                # tensor-parallel rank's report (vLLM merges them) or a repeat: it does not
                # prove the reaped rank's reads over either. Only a fence (revoke) ends it.
                continue
            if request not in self._reads:
                if self._guarded(request):
                    # A WRITE exposure only (a load in flight, or a failed one withheld): a
                    # send proves nothing about it. Handed back once the ledger releases it.
                    self._drop("wrong_channel", request)
                    continue
                if self._passed_through(request, passed, receive=False):
                    self._live.discard(request)  # vLLM frees it on this id
                continue
            sent.append(TransferCompleted.of(self._reads[request], 0))
        if sent:
            for refusal in self.ledger.apply_many(sent).refused:
                ev = sent[refusal.position]
                self._refused("evidence_refused", str(ev.request), refusal.error)
            applied = True
        if applied:
            self._collect()
        return Handback(self.take_released() | passed, recving | self.take_fenced_loads())

    def take_released(self) -> set[str]:
        """The ended requests the ledger has released and vLLM has not been handed yet (each
        once). ``output`` returns them; the connector also takes them at every scheduler step
        (``build_connector_meta``), so a fence takes effect even when the model runner returns
        no connector output (an idle single-worker engine: ``EMPTY_MODEL_RUNNER_OUTPUT``)."""
        released = set(self._ready)
        self._ready.clear()
        for request in released:
            self._remember(request)
            self._live.discard(request)
        self._handed_back += len(released)
        return released

    def take_fenced_loads(self) -> set[str]:
        """The live requests whose failed load a fence has ended: their withheld receive, for
        vLLM to go on as its failure policy says (each once). ``output`` returns them in
        ``finished_recving``; the connector also takes them at every scheduler step."""
        fenced = set(self._fenced_loads)
        self._fenced_loads.clear()
        self._recv_seen.update(fenced)
        return fenced

    # ------------------------------------------------------------------ the way out

    def revoke(self, fence: str) -> set[str]:
        """The deployment fenced every peer (e.g. NIXL agents recreated): close every open grant
        and hand the released requests back at the next scheduler step (``take_released``,
        ``take_fenced_loads``), or the next output. Local evidence only. Returns the ended
        requests released and the live ones whose held failed load the fence ended."""
        self.ledger.apply(AccessRevoked(self.peer, fence=fence))
        released = self._collect()
        fenced = [r for r in self._held_recv if not self.ledger.open_grants(r)]
        for request in fenced:
            del self._held_recv[request]
            # The exposure is over (fenced): its record ends, as a landed load's does; vLLM's
            # counts keep the blocks for the request until its recovery frees them.
            self._end(request, aborted=False)
            self._fenced_loads[request] = None
        if fenced:
            self._collect()
        return released | set(fenced)

    def stats(self) -> GuardStats:
        return GuardStats(
            ledger=self.ledger.stats(),
            exposed=len(self._reads.keys() | self._writes.keys()),
            withheld=len(self._ended),
            handed_back=self._handed_back,
            lease_reaped=self._reaped,
            load_failed=self._failed,
            failed_loads_held=len(self._held_recv),
            dropped=dict(self._dropped),
        )

    # ------------------------------------------------------------------ internals

    def _expose_read(self, request: str, ids: np.ndarray) -> None:
        try:
            if request not in self._writes:  # the common case: nothing held yet
                self._reads[request] = self.ledger.acquire_and_grant(
                    request, ids, self.peer, Access.READ
                )
                return
            held = self.ledger.blocks_of(request)
            new = np.setdiff1d(ids, held, assume_unique=True)
            if len(new):
                self.ledger.acquire(request, new)
            self._reads[request] = self.ledger.grant(request, self.peer, ids, Access.READ)
        except KVLifetimeError as e:
            self._refused("exposed_block_reused", request, e)

    def _end(self, request: str, aborted: bool) -> bool:
        try:
            if aborted:
                self.ledger.reject(request, reason="aborted")
            else:
                self.ledger.finish(request)
        except KVLifetimeError as e:
            self._refused("finish_refused", request, e)
            return False
        return True

    def _hold_failed_load(self, request: str) -> None:
        if request in self._held_recv:
            self._drop("duplicate_id", request)  # the worker reported the receive again
            return
        self._held_recv[request] = None
        _log.warning(
            "vllm_failed_load_held",
            request=request,
            why="a failed load proves nothing about what still lands; held until a fence",
        )

    def _failed_loads(self, failed: Iterable[str], invalid: Iterable[int]) -> list[str]:
        out = [r for r in failed if r in self._writes and r not in self._load_failed]
        bad = np.fromiter(invalid, dtype=np.int64)
        if len(bad):
            for request, g in self._writes.items():
                if (
                    request not in self._load_failed
                    and request not in out
                    and np.isin(g.blocks, bad).any()
                ):
                    out.append(request)
        return out

    def _guarded(self, request: str) -> bool:
        """The guard holds an exposure for the request (of either kind) or withholds it."""
        return request in self._reads or request in self._writes or request in self._ended

    def _passed_through(self, request: str, into: set[str], *, receive: bool) -> bool:
        """An id with no exposure: vLLM's own business while vLLM holds the request and the
        signal is one vLLM accepts for it (passed on unchanged); otherwise a duplicate, an
        unknown id, or one for a request vLLM has not finished (an early notification, or a
        stale one for a reused request id): dropped."""
        if self.holds(request):
            where = self.phase(request) if self.phase is not None else "finished"
            if where != "finished" and not (receive and where == "waiting_for_remote_kvs"):
                self._drop("not_finished", request)
                return False
            into.add(request)
            return True
        self._drop("duplicate_id" if request in self._handed else "unknown_id", request)
        return False

    def _complete(self, grant: Grant) -> None:
        self._apply(TransferCompleted.of(grant, 0), grant)

    def _expire(self, grant: Grant, why: str) -> None:
        self._apply(LeaseExpired.of(grant), grant)
        _log.warning("vllm_exposure_unproven", request=grant.request, why=why, grant=str(grant.id))

    def _apply(self, evidence: LeaseExpired | TransferCompleted, grant: Grant) -> None:
        try:
            self.ledger.apply(evidence)
        except KVLifetimeError as e:
            self._refused("evidence_refused", str(grant.request), e)

    def _collect(self) -> set[str]:
        released = self.ledger.collect_releasable()
        out: set[str] = set()
        for key in released:
            request = str(key)
            if request in self._ended:
                self._ready[request] = None
                out.add(request)
            self._forget(request)
        return out

    def _forget(self, request: str) -> None:
        self._reads.pop(request, None)
        self._writes.pop(request, None)
        self._ended.pop(request, None)
        self._load_failed.discard(request)
        self._reaped_ids.discard(request)

    def _remember(self, request: str) -> None:
        self._handed[request] = None
        if len(self._handed) > _REMEMBERED:
            self._handed.popitem(last=False)

    def _drop(self, kind: str, request: str) -> None:
        self._dropped[kind] += 1
        err = (
            DoubleRelease(f"request {request!r} was already handed back to vLLM")
            if kind == "duplicate_id"
            else UsageError(f"request {request!r}: a {kind} id vLLM would assert on")
            if kind in ("not_finished", "wrong_channel")
            else UnknownRequest(request)
        )
        _log.warning("vllm_id_dropped", kind=kind, request=request, error=str(err))

    def _refused(self, kind: str, request: str, e: KVLifetimeError) -> None:
        self._dropped[kind] += 1
        _log.error(
            "vllm_guard_refused",
            kind=kind,
            request=request,
            error=str(e),
            error_type=type(e).__name__,
        )
