"""ConnectorGuard: the exposure guard behind vLLM's KV-connector hooks, with no vLLM import.

Why this module is one piece (over 600 lines, about 150 of them docstrings): every hook vLLM
calls reads and moves the same per-request records (``_Record``: phase, load, grants, the step
of each grant) and the same step journal, on the scheduler's thread, and ``flush`` turns that
journal into the ledger's batch calls; splitting the hooks from the records or the journal
would put a phase apart from the code that moves it. The values it hands out
(``RequestView``, ``GuardStats``, ``Handback``) are small and defined beside it.

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
A ``finished_sending`` in the very step that exposes the request's blocks is stale
(``before_exposure``), and an id is handed to vLLM on one channel only (``both_channels``): see
``ConnectorGuard``.

A failed asynchronous load proves nothing about what still lands (``LeaseExpired`` on its WRITE
grant). When the request has ended (aborted, or failed by ``kv_load_failure_policy="fail"``) its
blocks are withheld and quarantined. When it lives on (``"recompute"``) vLLM waits for its
``finished_recving`` before it frees the failed load's blocks or recomputes into them: the guard
withholds that receive (``failed_loads_held``), so the request keeps its blocks, waiting for
remote KVs, until a fence closes the grant; then the receive goes to vLLM and vLLM recovers as
it would have. The request's later blocks were never exposed: they are freed as vLLM decides.

``revoke`` may come from any thread: it records the fence, which takes effect at the next
scheduler step boundary (``begin_step``, from ``build_connector_meta``) whatever the model
runner returns, covering only the exposures of steps that had ended when it was recorded; the
connector takes what it released (``take_released``, ``take_fenced_loads``) in the same
``build_connector_meta`` (the threading contract: ``ConnectorGuard``).

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

The guard keeps one record per request (``_Record``): its phase (``Phase``: running ->
ended -> ready, or finished with nothing exposed), its READ and WRITE grants and what became of
its load (``Load``). Forgetting a request is deleting its record; ``request`` / ``requests``
show them.

What is checked when (the step's journal). The hooks vLLM calls per request do no ledger work
in the common case: ``finished`` decides vLLM's answer from the request's record alone (a
remote reader has the block ids: delay) and appends the READ exposure to the step's journal;
the connector holds a step's loads until ``build_connector_meta``. Once per scheduler step the
journal becomes a few batch calls (``flush``: the READ grants, then ``finish_many`` /
``reject_many``; ``allocated_many``: the WRITE grants; ``output``: one ``apply_many`` for the
step's proofs, one ``finish_many`` for the landed loads, one ``collect_releasable``), each item
granted or refused on its own. A refusal found there still keeps its promise:

- a refused WRITE grant's blocks never reach the worker: the connector tells the inner
  connector of a load only once the guard granted it (``build_connector_meta``), and vLLM takes
  a refused one as a load that loaded nothing (it frees the blocks and schedules the request
  again);
- a refused READ grant's block ids never reach a remote reader: the flush runs at the step's
  end (vLLM 0.33 calls ``get_kv_connector_stats`` at the end of every ``update_from_output``,
  after the step's ``request_finished`` calls, before its outputs leave the scheduler) and the
  connector empties the transfer parameters vLLM returns for the request; vLLM still keeps the
  blocks until the inner connector's own id frees them;
- nothing vLLM does between the hook and the flush frees an exposed block: vLLM keeps a
  delayed request's blocks until its id comes back, and every path that hands an id back
  (``output``, ``take_released``) or reads the ledger (``begin_step``'s fences,
  ``allocated_many``, ``handed_out``) flushes first. A request with a WRITE exposure (ended
  while loading) is done at once, after the journal. ``stats`` counts a journaled exposure as
  exposed; the ledger's own figures are as of the last flush.

This module is sans-IO: ``connector.py`` calls it from vLLM's hooks; tests drive it directly.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence, Set

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime.errors import (
    DoubleRelease,
    InvalidField,
    KVLifetimeError,
    StaleEvidence,
    UnknownRequest,
    UsageError,
)
from kvlifetime.evidence import AccessRevoked, LeaseExpired, TransferCompleted
from kvlifetime.grant import Access, Grant
from kvlifetime.ledger import BlockLedger, LedgerStats

_log = structlog.get_logger("kvlifetime.vllm")

# How many handed-back ids are remembered to tell a duplicate from an unknown id.
_REMEMBERED = 65536


class Phase(enum.Enum):
    """Where a request is, as the guard has seen vLLM's hooks and the ledger's verdicts."""

    RUNNING = "running"  # vLLM runs it (not finished); it may be loading
    # vLLM finished it with nothing exposed: it frees the blocks when the inner connector said
    # (at once, or on an id the guard passes through unchanged).
    FINISHED = "finished"
    # vLLM finished it and keeps its blocks because the guard delayed the free: an exposure is
    # unproven (waiting for proof, or quarantined). Its id reaches vLLM only on release.
    ENDED = "ended"
    # The ledger released it: its id goes to vLLM at the next scheduler step or output, once
    # (then the record is forgotten and the id remembered as handed back).
    READY = "ready"


class Load(enum.Enum):
    """What became of the request's asynchronous KV load (its WRITE exposure)."""

    NONE = "none"  # no asynchronous load since vLLM last started one (or the request ended)
    IN_FLIGHT = "in_flight"  # the WRITE grant is open: the load may still land
    # Reported failed (failed_recving / invalid_block_ids): LeaseExpired on the WRITE grant;
    # nothing proves what still lands.
    FAILED = "failed"
    # Failed, and its finished_recving came while vLLM runs the request: withheld (vLLM would
    # free the blocks or recompute into them on it) until a fence closes the grant.
    RECEIVE_HELD = "receive_held"
    # A fence ended the held failed load: its receive goes to vLLM at the next step, once.
    FENCED = "fenced"
    # vLLM was handed this load's finished_recving: another one is a duplicate.
    RECEIVED = "received"


@attrs.define(slots=True, eq=False)
class _Record:
    """One request the guard knows of: its phase, its exposures, its load. Forgetting the
    request is deleting this record (``ConnectorGuard._forget``); only a record without an
    exposure is ever forgotten."""

    phase: Phase = Phase.RUNNING
    read: Grant | None = None  # READ grant the ledger tracks: a remote reader has the block ids
    lease_reaped: bool = False  # the worker reaped the read's lease: only a fence ends it
    write: Grant | None = None  # WRITE grant the ledger tracks: an asynchronous load
    load: Load = Load.NONE  # FAILED / RECEIVE_HELD only with a write grant
    # The step each grant was made in (``ConnectorGuard.step``): its block ids leave the
    # process with that step's output (READ) or metadata (WRITE).
    read_step: int = 0
    write_step: int = 0

    @property
    def exposed(self) -> bool:
        return self.read is not None or self.write is not None

    @property
    def load_failed(self) -> bool:
        return self.load is Load.FAILED or self.load is Load.RECEIVE_HELD


@attrs.frozen(slots=True)
class RequestView:
    """One request as the guard holds it (``ConnectorGuard.request``): introspection."""

    request: str
    phase: Phase
    load: Load
    read: Grant | None  # the READ grant the ledger still tracks
    write: Grant | None  # the WRITE grant the ledger still tracks
    lease_reaped: bool


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
    # kind ("duplicate_id", "unknown_id", "before_exposure", "both_channels", ...) -> ids kept
    # from vLLM or refusals counted; only grow
    dropped: dict[str, int]


@attrs.frozen(slots=True)
class Handback:
    """What vLLM's scheduler is shown for one connector output."""

    finished_sending: set[str]
    finished_recving: set[str]


class ConnectorGuard:
    """One vLLM scheduler's exposures (scheduler side of the connector).

    The step. The guard counts vLLM's scheduler steps (``step``): ``end_step`` ends one (the
    connector calls it from ``get_kv_connector_stats``, which vLLM 0.33 calls once at the end
    of every ``update_from_output``, after the step's ``request_finished`` calls and its
    ``update_connector_output``, before the step's outputs leave the scheduler); ``begin_step``
    is the boundary where what happened between steps takes effect (the connector calls it from
    ``build_connector_meta``, every scheduler step, whatever the model runner returns). A
    grant is stamped with the step it was made in: a READ grant's block ids leave the process
    with that step's output (the request's ``kv_transfer_params``), a WRITE grant's with that
    step's connector metadata. Evidence never precedes the exposure it proves: a
    ``finished_sending`` for a READ grant of the step in progress is about an earlier request
    with the same id, since no reader has the block ids yet; it is dropped
    (``before_exposure``, ``StaleEvidence`` logged) and the request stays withheld until a
    later step's. (A reaped lease is taken whenever it comes: it frees nothing, it withholds
    until a fence. A ``finished_recving`` in its WRITE grant's step is taken: the metadata
    reached the worker before the step's forward pass.)

    One channel per id. An id handed to vLLM on one channel (``finished_sending`` or
    ``finished_recving``) is never handed on the other: in one output the receive is kept (for
    a finished request vLLM frees on either; for a live one the receive is the only one it
    takes) and the send dropped (``both_channels``); in a later output the id is one vLLM no
    longer holds (dropped as a duplicate or unknown id), or a fenced receive the request's new
    READ exposure supersedes (the id comes back once, on the send, when the read is proven).

    Threading contract. vLLM calls every connector hook from the engine core's one scheduler
    thread; every method of the guard but two is for that thread only. From any thread:

    - ``revoke(fence)`` records the fence, with the step in progress, under a small lock of
      its own, and changes nothing else. The fence takes effect at the next ``begin_step``
      (the next ``build_connector_meta``): it closes (``AccessRevoked`` per grant) every open
      grant made in a step that had ended when ``revoke`` was called, and no other. So a fence
      never releases blocks whose ids leave the process in the output of the step in which it
      was recorded (nor of a later one): those exposures began after the fence and need their
      own proof or a later fence. Fences recorded between two boundaries are applied in order;
      one name recorded twice keeps its latest step.
    - ``stats()`` reads a snapshot (the records' list and the counters are copied in one C
      call each; the ledger has its own lock): each figure is consistent, the set of them may
      straddle a hook.
    """

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
        # Every request the guard knows of, one record each (see ``_Record``).
        self._requests: dict[str, _Record] = {}
        # Whether vLLM still holds a request (its scheduler's own table, where the connector
        # found it); otherwise the guard's own view: a record, from on_new_request until vLLM
        # frees the request.
        self.holds: Callable[[str], bool] = (
            holds if holds is not None else self._requests.__contains__
        )
        # Where vLLM's scheduler has the request (bound by the connector from its request
        # table): None (not held), "finished", "waiting_for_remote_kvs" or "running". vLLM frees
        # blocks on an id only for a finished request (it asserts is_finished()); a receive for
        # a request waiting for remote KVs is how a load completes. Unbound: not checked.
        self.phase: Callable[[str], str | None] | None = phase
        # What the next scheduler step or output hands vLLM (each id once), in order: the
        # requests in phase READY, and those whose load is FENCED. Kept beside the records so
        # that a step with nothing to hand back costs nothing.
        self._to_hand: dict[str, None] = {}
        self._fenced: dict[str, None] = {}
        self._writes_tracked = 0  # records with a WRITE grant (a step with none skips a check)
        # The step's journal: READ exposures ``finished`` delayed (request, block ids, aborted),
        # turned into ledger work by ``flush``; the requests whose grant it refused.
        self._reads_due: list[tuple[str, list[int], bool]] = []
        self._reads_refused: list[str] = []
        # Forgotten requests whose ids vLLM was handed (to tell a duplicate from an unknown id).
        self._handed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._handed_back = 0
        self._reaped = 0
        self._failed = 0
        self._dropped: collections.Counter[str] = collections.Counter()
        # Steps ended so far (``end_step``): the step in progress. Written by the scheduler
        # thread only; read by ``revoke`` from any thread (an int: one atomic read).
        self._step = 0
        # Fences recorded by ``revoke`` (any thread) and not applied yet: name -> the step in
        # progress when it was recorded (insertion order: the order of recording).
        self._fences: dict[str, int] = {}
        self._fences_lock = threading.Lock()

    # ------------------------------------------------------------------ scheduler hooks

    def admitted(self, request: str) -> None:
        """``on_new_request``: vLLM holds the request from now until it frees it."""
        if request not in self._requests:
            self._requests[request] = _Record()

    def allocated(
        self, request: str, block_ids: Iterable[int], num_external_tokens: int, load_async: bool
    ) -> bool:
        """``update_state_after_alloc`` of one request (the connector batches a step's into
        ``allocated_many``): the blocks an asynchronous load will write get a WRITE grant. A
        synchronous load lands inside the step, ordered by vLLM itself: no grant. Returns False
        when the grant was refused (the load must not reach the worker)."""
        if num_external_tokens <= 0 or not load_async:
            return True
        return not self.allocated_many([(request, list(block_ids))])

    def allocated_many(self, loads: Sequence[tuple[str, Sequence[int]]]) -> set[str]:
        """A step's asynchronous loads (``build_connector_meta``, once vLLM has decided which
        loads are asynchronous, before the connector metadata carries their block ids to the
        worker): a WRITE grant each, in one ledger call, each granted or refused on its own.
        Returns the refused requests: vLLM handed out a block another request's transfer may
        still touch; the ledger changed nothing for them, and the connector keeps their load
        from the worker (``GuardedConnector``)."""
        self.flush()
        due: list[tuple[str, Sequence[int]]] = []
        for request, ids in loads:
            rec = self._record(request)
            if rec.load is Load.RECEIVED:
                rec.load = Load.NONE  # a new load (first, or after a preemption)
            if len(ids):
                due.append((request, ids))
        refused: set[str] = set()
        for (request, _), grant in zip(due, self._grant_many(due, Access.WRITE), strict=True):
            if isinstance(grant, KVLifetimeError):
                self._refused("exposed_block_reused", request, grant)
                refused.add(request)
                continue
            rec = self._requests[request]
            self._writes_tracked += rec.write is None
            rec.write, rec.load, rec.write_step = grant, Load.IN_FLIGHT, self._step
        return refused

    def handed_out(self, block_ids: Iterable[int]) -> None:
        """``build_connector_meta``: the blocks vLLM gave requests this step. One under an open
        WRITE grant (an asynchronous load may still land in it) is a reuse vLLM should never
        make while the guard holds the loading request back: logged and counted
        (``exposed_block_reused``); the guard cannot take it back. (A block under READ grants
        only may be a prefix-cache hit, which is allowed.)"""
        ids = np.fromiter(block_ids, dtype=np.int64)
        if len(ids) == 0 or not self._writes_tracked:
            return
        self.flush()
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

        The common case does no ledger work here: the READ exposure goes into the step's
        journal (``flush``, before anything can hand the id back to vLLM) and the answer is
        ``True``; vLLM keeps the blocks until the id comes back, which only ``output`` /
        ``take_released`` do, after the flush.
        """
        rec = self._requests.get(request)
        if rec is not None:
            if rec.load is Load.RECEIVED:
                rec.load = Load.NONE
            elif rec.load is Load.RECEIVE_HELD:
                # An ended request's failed load: withheld and quarantined as ended, and a fence
                # hands it back as an ended one.
                rec.load = Load.FAILED
            if rec.write is not None:
                return self._finished_loading(request, rec, block_ids, delay, aborted)
        ids = list(block_ids) if delay else []
        if ids:
            if rec is None:
                rec = self._requests[request] = _Record()
            elif rec.load is Load.FENCED:
                # A fenced receive not handed to vLLM yet: the READ exposure supersedes it (the
                # id goes back once, on the send, when the read is proven; one channel per id).
                self._fenced.pop(request, None)
                rec.load = Load.NONE
            rec.phase = Phase.ENDED
            self._reads_due.append((request, ids, aborted))
            return True
        if rec is not None:
            self._finished_unexposed(request, rec, delay)
        return delay  # nothing exposed: the inner connector's answer stands

    @property
    def step(self) -> int:
        """The scheduler step in progress: how many steps have ended (``end_step``)."""
        return self._step

    def end_step(self) -> None:
        """The step's end (the connector: ``get_kv_connector_stats``, once at the end of every
        ``update_from_output``): the journal goes into the ledger, and the step's exposures
        leave the process with its output. From now on a ``finished_sending`` may be about
        them, and a fence recorded from now on covers them."""
        self.flush()
        self._step += 1

    def begin_step(self) -> set[str]:
        """The step boundary (the connector: ``build_connector_meta``, every scheduler step):
        the fences ``revoke`` recorded since the last boundary take effect. Returns the ended
        requests they released and the live ones whose held failed load they ended (their ids
        go to vLLM through ``take_released`` / ``take_fenced_loads``)."""
        if not self._fences:
            return set()
        with self._fences_lock:
            fences, self._fences = self._fences, {}
        out: set[str] = set()
        for fence, step in fences.items():
            out |= self._fence(fence, step)
        return out

    def flush(self) -> None:
        """The step's journal into the ledger: the READ grants of the requests ``finished``
        delayed, in one batch call, then their ends (``finish_many`` / ``reject_many``). Each
        request's grant is granted or refused on its own; a refused one is logged and counted
        (``exposed_block_reused``), its record has nothing exposed, and its id is kept for
        ``take_refused_reads`` (the connector withholds its block ids from the output). Called
        by every method that reads the ledger or hands an id back, and by the connector at
        the step's end; a no-op when the journal is empty."""
        due = self._reads_due
        if not due:
            return
        self._reads_due = []
        grants = self._grant_many([(r, ids) for r, ids, _ in due], Access.READ)
        ends: tuple[list[str], list[str]] = ([], [])  # finished, aborted
        for (request, _, aborted), grant in zip(due, grants, strict=True):
            rec = self._requests[request]
            if isinstance(grant, KVLifetimeError):
                self._refused("exposed_block_reused", request, grant)
                # Nothing exposed: vLLM keeps the blocks as the inner connector asked and the
                # id that frees them passes through.
                rec.phase = Phase.FINISHED
                self._reads_refused.append(request)
                continue
            rec.read, rec.read_step = grant, self._step
            ends[aborted].append(request)
        finished, aborted_ = ends
        outcomes = []
        if finished:
            outcomes.append(self.ledger.finish_many(finished))
        if aborted_:
            outcomes.append(self.ledger.reject_many(aborted_, reason="aborted"))
        for outcome in outcomes:
            for refusal in outcome.refused:
                self._refused("finish_refused", str(refusal.item), refusal.error)

    def take_refused_reads(self) -> list[str]:
        """The requests whose READ grant the journal's flush refused since the last call (each
        once): vLLM was told to keep their blocks, and their block ids must not reach a remote
        reader (the connector empties the transfer parameters vLLM returns for them)."""
        out = self._reads_refused
        if out:
            self._reads_refused = []
        return out

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
        self.flush()
        for loading, write in self._failed_loads(failed_recving, invalid_block_ids):
            self._expire(write, "load_failed")
            loading.load = Load.FAILED
            self._failed += 1
        # A reaped lease is taken whenever it comes, even in its grant's own step (then it is
        # an earlier request's): it frees nothing, it only withholds until a fence.
        for request in lease_reaped:
            rec = self._requests.get(request)
            if rec is not None and rec.read is not None and not rec.lease_reaped:
                self._expire(rec.read, "lease_reaped")
                rec.lease_reaped = True
                self._reaped += 1
        completions: list[TransferCompleted] = []  # every proof the output carries
        landed: list[str] = []  # running requests whose load landed: that exposure ends
        recving: set[str] = set()
        passed: set[str] = set()  # ids the guard has no exposure for, vLLM still holds
        for request in finished_recving or ():
            rec = self._requests.get(request)
            if rec is not None and rec.load is Load.RECEIVED:
                self._drop("duplicate_id", request)
                continue
            if rec is None or rec.write is None:
                if rec is not None and self._guarded(rec):
                    # A READ exposure (or a withheld request): a receive proves nothing about
                    # a remote read. The id reaches vLLM only once the ledger releases it.
                    self._drop("wrong_channel", request)
                    continue
                if self._passed_through(request, recving, receive=True):
                    self._received(request)
                continue
            live = rec.phase is not Phase.ENDED
            if not rec.load_failed:
                completions.append(TransferCompleted.of(rec.write, 0))
                if live:
                    # The load landed: that exposure is over. Its record ends here; vLLM's
                    # counts keep the blocks for the running request (and may free them on a
                    # preemption without telling the connector).
                    landed.append(request)
            elif not live:
                continue  # an ended request's failed load: withheld (quarantined)
            else:
                # A live request's failed load (kv_load_failure_policy="recompute"): on this
                # receive vLLM frees the blocks or recomputes into them, while the failed
                # transfer proves nothing about what still lands. Held until a fence.
                self._hold_failed_load(request, rec)
                continue
            if live:
                rec.load = Load.RECEIVED
                recving.add(request)
        for request in finished_sending or ():
            rec = self._requests.get(request)
            if rec is not None and rec.lease_reaped:
                # Withheld: a reaped lease is not a completion. A later membership is another
                # tensor-parallel rank's report (vLLM merges them) or a repeat: it does not
                # prove the reaped rank's reads over either. Only a fence (revoke) ends it.
                continue
            if rec is None or rec.read is None:
                if rec is not None and self._guarded(rec):
                    # A WRITE exposure only (a load in flight, or a failed one withheld): a
                    # send proves nothing about it. Handed back once the ledger releases it.
                    self._drop("wrong_channel", request)
                    continue
                if self._passed_through(request, passed, receive=False):
                    self._forget(request)  # vLLM frees it on this id
                continue
            if rec.read_step == self._step:
                # The READ grant is this step's: its block ids leave with this step's output,
                # so no reader can have finished with them. A stale notice (an earlier request
                # with the same id, vLLM #49796's class): proves nothing, frees nothing.
                self._drop("before_exposure", request)
                continue
            completions.append(TransferCompleted.of(rec.read, 0))
        # Every proof of the step in one apply_many, then the landed loads' ends in one
        # finish_many (each item applied or refused on its own, as one call each would be).
        if completions:
            for refusal in self.ledger.apply_many(completions).refused:
                ev = completions[refusal.position]
                self._refused("evidence_refused", str(ev.request), refusal.error)
        if landed:
            for refusal in self.ledger.finish_many(landed).refused:
                self._refused("finish_refused", str(refusal.item), refusal.error)
        if completions:
            self._collect()
        sending = self.take_released() | passed
        recving |= self.take_fenced_loads()
        if sending and recving:
            for request in sending & recving:
                # One channel per id: vLLM frees a finished request on the receive (and runs a
                # live one on it); the send would hit its assert. (Its record is gone already.)
                self._drop("both_channels", request)
                sending.discard(request)
        return Handback(sending, recving)

    def take_released(self) -> set[str]:
        """The ended requests the ledger has released and vLLM has not been handed yet (each
        once). ``output`` returns them; the connector also takes them at every scheduler step
        (``build_connector_meta``), so a fence takes effect even when the model runner returns
        no connector output (an idle single-worker engine: ``EMPTY_MODEL_RUNNER_OUTPUT``)."""
        if not self._to_hand:
            return set()
        released = set(self._to_hand)
        self._to_hand.clear()
        for request in released:
            self._forget(request)
            self._remember(request)
        self._handed_back += len(released)
        return released

    def take_fenced_loads(self) -> set[str]:
        """The live requests whose failed load a fence has ended: their withheld receive, for
        vLLM to go on as its failure policy says (each once). ``output`` returns them in
        ``finished_recving``; the connector also takes them at every scheduler step."""
        if not self._fenced:
            return set()
        fenced = set(self._fenced)
        self._fenced.clear()
        for request in fenced:
            self._received(request)
        return fenced

    # ------------------------------------------------------------------ the way out

    def revoke(self, fence: str) -> None:
        """The deployment fenced every peer (e.g. NIXL agents recreated); callable from any
        thread. Records the fence with the step in progress and returns: it takes effect at
        the next ``begin_step`` (the connector's next ``build_connector_meta``), where it
        closes every open grant made in a step that had ended before this call (local
        evidence only) and the released requests go back to vLLM. An exposure of the step in
        progress leaves the process after the fence: not covered (see the class docstring)."""
        if not isinstance(fence, str) or not fence or len(fence) > 128:
            raise InvalidField(f"fence must be a non-empty str of at most 128 chars, got {fence!r}")
        with self._fences_lock:
            step = self._step
            self._fences.pop(fence, None)  # recorded again: its latest step, in its new place
            self._fences[fence] = step
        _log.info("vllm_fence_recorded", fence=fence, step=step)

    def _fence(self, fence: str, step: int) -> set[str]:
        """A recorded fence takes effect (``begin_step``): ``AccessRevoked`` for every open
        grant made before ``step``, in one ``apply_many``. Returns the ended requests released
        and the live ones whose held failed load it ended."""
        self.flush()
        revoked: list[AccessRevoked] = []
        for rec in self._requests.values():
            if rec.read is not None and rec.read_step < step:
                revoked.append(AccessRevoked.of(rec.read, fence=fence))
            if rec.write is not None and rec.write_step < step:
                revoked.append(AccessRevoked.of(rec.write, fence=fence))
        if not revoked:
            return set()
        for refusal in self.ledger.apply_many(revoked).refused:
            self._refused("evidence_refused", str(revoked[refusal.position].request), refusal.error)
        released = self._collect()
        fenced = [
            r
            for r, rec in self._requests.items()
            if rec.load is Load.RECEIVE_HELD and not self.ledger.open_grants(r)
        ]
        for request in fenced:
            # The exposure is over (fenced): its record ends, as a landed load's does; vLLM's
            # counts keep the blocks for the request until its recovery frees them.
            self._requests[request].load = Load.FENCED
            self._end(request, aborted=False)
            self._fenced[request] = None
        if fenced:
            self._collect()
        _log.info("vllm_fence_applied", fence=fence, step=step, grants=len(revoked))
        return released | set(fenced)

    def stats(self) -> GuardStats:
        """The guard's counts (the ledger's as of the journal's last ``flush``: the step's
        end). A request whose READ exposure is still in the journal counts as exposed."""
        recs = list(self._requests.values())  # one C call: a snapshot from any thread
        return GuardStats(
            ledger=self.ledger.stats(),
            exposed=sum(rec.exposed or rec.phase is Phase.ENDED for rec in recs),
            withheld=sum(rec.phase is Phase.ENDED for rec in recs),
            handed_back=self._handed_back,
            lease_reaped=self._reaped,
            load_failed=self._failed,
            failed_loads_held=sum(rec.load is Load.RECEIVE_HELD for rec in recs),
            dropped=dict(self._dropped),
        )

    @property
    def loads_tracked(self) -> int:
        """How many requests have a WRITE grant the ledger tracks (0: no block vLLM hands out
        can be under a load: ``handed_out`` has nothing to check)."""
        return self._writes_tracked

    def request(self, request: str) -> RequestView | None:
        """The guard's record of one request (None: the guard holds none for it). A READ
        exposure still in the journal shows once ``flush`` ran."""
        rec = self._requests.get(request)
        if rec is None:
            return None
        return RequestView(request, rec.phase, rec.load, rec.read, rec.write, rec.lease_reaped)

    def requests(self) -> Iterator[RequestView]:
        """Every request the guard holds a record of, oldest first."""
        for request in list(self._requests):
            view = self.request(request)
            if view is not None:
                yield view

    # ------------------------------------------------------------------ internals

    def _record(self, request: str) -> _Record:
        rec = self._requests.get(request)
        if rec is None:
            # A request vLLM holds that the guard was not told of (its table is the truth).
            rec = self._requests[request] = _Record()
        return rec

    def _finished_loading(
        self, request: str, rec: _Record, block_ids: Iterable[int], delay: bool, aborted: bool
    ) -> bool:
        """``finished`` of a request with a WRITE exposure (ended while its load is in flight,
        or failed): done at once, after the journal (rare: an abort during a load)."""
        self.flush()
        if delay:
            ids = np.fromiter(block_ids, dtype=np.int64)
            if len(ids):
                self._expose_read(request, rec, ids)
        if not self._end(request, aborted):
            return delay
        if rec.read is None:  # (an open READ grant: not releasable yet)
            self._collect()  # not ENDED yet: released here means "free it now"
            if rec.write is None:
                self._finished_unexposed(request, rec, delay)
                return delay
        rec.phase = Phase.ENDED
        return True

    def _expose_read(self, request: str, rec: _Record, ids: npt.NDArray[np.int64]) -> None:
        """A READ grant over ``ids`` for a request that holds blocks for its load already."""
        try:
            held = self.ledger.blocks_of(request)
            new = np.setdiff1d(ids, held, assume_unique=True)
            if len(new):
                self.ledger.acquire(request, new)
            rec.read = self.ledger.grant(request, self.peer, ids, Access.READ)
            rec.read_step = self._step
        except KVLifetimeError as e:
            self._refused("exposed_block_reused", request, e)

    def _grant_many(
        self, items: Sequence[tuple[str, Sequence[int]]], access: Access
    ) -> list[Grant | KVLifetimeError]:
        """A step's grants in one ledger call (``acquire_and_grant_many``): for each item
        (request, its blocks) its grant, or the typed refusal (each request's holds and grant
        are all or nothing; the ledger changed nothing for a refused one)."""
        if not items:
            return []
        peer = self.peer
        outcome = self.ledger.acquire_and_grant_many([(r, ids, peer, access) for r, ids in items])
        refused = {r.position: r.error for r in outcome.refused}
        grants = iter(outcome.grants)
        return [refused[i] if i in refused else next(grants) for i in range(len(items))]

    def _finished_unexposed(self, request: str, rec: _Record, delay: bool) -> None:
        """vLLM finished a request the guard holds no exposure of: it frees it now (``delay``
        false; unless a fenced receive is still to reach it, which vLLM waits for), or keeps it
        as the inner connector asked."""
        if delay or rec.load is Load.FENCED:
            rec.phase = Phase.FINISHED
        else:
            self._forget(request)

    def _received(self, request: str) -> None:
        """vLLM was handed the request's receive: a running request's load is over (a repeat
        is a duplicate); a finished one is freed on it."""
        rec = self._record(request)
        if rec.phase is Phase.FINISHED and not rec.exposed:
            self._forget(request)
        else:
            rec.load = Load.RECEIVED

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

    def _hold_failed_load(self, request: str, rec: _Record) -> None:
        if rec.load is Load.RECEIVE_HELD:
            self._drop("duplicate_id", request)  # the worker reported the receive again
            return
        rec.load = Load.RECEIVE_HELD
        _log.warning(
            "vllm_failed_load_held",
            request=request,
            why="a failed load proves nothing about what still lands; held until a fence",
        )

    def _failed_loads(
        self, failed: Iterable[str], invalid: Iterable[int]
    ) -> list[tuple[_Record, Grant]]:
        """The loads the output reports failed (each once, with its WRITE grant): by request
        id, or by a block of their WRITE grant in ``invalid``."""
        out: dict[str, tuple[_Record, Grant]] = {}
        for request in failed:
            rec = self._requests.get(request)
            if rec is not None and rec.write is not None and not rec.load_failed:
                out[request] = (rec, rec.write)
        bad = np.fromiter(invalid, dtype=np.int64)
        if len(bad):
            for request, rec in self._requests.items():
                if (
                    rec.write is not None
                    and not rec.load_failed
                    and request not in out
                    and np.isin(rec.write.blocks, bad).any()
                ):
                    out[request] = (rec, rec.write)
        return list(out.values())

    @staticmethod
    def _guarded(rec: _Record) -> bool:
        """The guard holds an exposure for the request (of either kind), withholds it, or has
        its id to hand back."""
        return rec.exposed or rec.phase is Phase.ENDED or rec.phase is Phase.READY

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

    def _expire(self, grant: Grant, why: str) -> None:
        self._apply(LeaseExpired.of(grant), grant)
        _log.warning("vllm_exposure_unproven", request=grant.request, why=why, grant=str(grant.id))

    def _apply(self, evidence: LeaseExpired | TransferCompleted, grant: Grant) -> None:
        try:
            self.ledger.apply(evidence)
        except KVLifetimeError as e:
            self._refused("evidence_refused", str(grant.request), e)

    def _collect(self) -> set[str]:
        """What the ledger released: the exposures end; an ENDED request becomes READY (its id
        goes to vLLM at the next step or output); a running one goes on."""
        out: set[str] = set()
        for key in self.ledger.collect_releasable():
            request = str(key)
            rec = self._requests.get(request)
            if rec is None:
                continue
            self._writes_tracked -= rec.write is not None
            rec.read = rec.write = None
            rec.lease_reaped = False
            if rec.load is Load.IN_FLIGHT or rec.load is Load.FAILED:
                rec.load = Load.NONE
            if rec.phase is Phase.ENDED:
                rec.phase = Phase.READY
                self._to_hand[request] = None
                out.add(request)
        return out

    def _forget(self, request: str) -> None:
        """The request is over for the guard (vLLM frees it): one deletion."""
        self._requests.pop(request, None)

    def _remember(self, request: str) -> None:
        self._handed[request] = None
        if len(self._handed) > _REMEMBERED:
            self._handed.popitem(last=False)

    def _drop(self, kind: str, request: str) -> None:
        self._dropped[kind] += 1
        err: KVLifetimeError
        if kind == "duplicate_id":
            err = DoubleRelease(f"request {request!r} was already handed back to vLLM")
        elif kind == "before_exposure":
            err = StaleEvidence(
                f"request {request!r}: a report in the step that exposes its blocks (their ids "
                "have not left the process): about an earlier request with the same id"
            )
        elif kind == "both_channels":
            err = UsageError(f"request {request!r}: handed to vLLM on the other channel")
        elif kind in ("not_finished", "wrong_channel"):
            err = UsageError(f"request {request!r}: a {kind} id vLLM would assert on")
        else:
            err = UnknownRequest(request)
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
