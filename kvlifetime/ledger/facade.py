"""BlockLedger: the fast path a serving engine's allocator embeds.

Per-block state lives in numpy arrays; per-request work is O(1) dict work; request transitions
run the tables compiled from the specification (``table.request_table()``), never a
python-statemachine instance (``checked=True`` adds one per request, for tests and debugging).

What is stored per block, and why only that (12 bytes a block, 16 once ``allocate`` is used;
8 with ``counts="engine"``):

- ``_owner`` (int32): the slot of the request that acquired the block exclusively, ``FREE`` (-1)
  when it is in the pool, ``ORPHANED`` (-2) when its exclusive holder released it while shared
  holders remain. ``FREE`` is the only state in which a block may be handed out fresh. Not kept
  with ``counts="engine"`` (no exclusive owner: the engine's counts decide when a block is free).
- ``_sharers`` (uint16): how many requests hold it shared (prefix-cache hits); with
  ``counts="engine"`` how many requests hold it at all. It never wraps: the acquire that would
  make it 65,536 is refused (``HolderLimit``, ``MAX_SHARERS``).
- ``_unsettled`` / ``_readers`` (uint8 each; widened to uint16, then uint32, before a block's
  count could reach the dtype's limit): how many open write / read grants cover the block. An
  open write grant makes its content unsettled (not shareable); open read grants never do,
  whether their request runs or has ended (draining, quarantined): a reader does not change the
  content. A shared acquire and ``open_access`` read them for their batch only, so their cost
  does not grow with the number of live sharers or grants. With the ledger's counts they are
  kept from the first shared acquire or ``open_access`` on (built then from the open grants,
  once): a ledger that does neither never pays for them on the grant / evidence hot path. With
  ``counts="engine"`` they are kept from the start (every acquire and grant reads them).
  Each count is at most the number of grants of its access counted, so below the dtype's limit
  the widening check is one int compare; only past it does a grant look at its blocks' counts
  (and ``grant`` refuses a block's 2**32-1st open grant of one access: ``HolderLimit``).
- ``_generation`` (uint32): bumped by one each time the block returns to the pool (with
  ``counts="engine"``: each time no request holds it any more), so a grant (which records
  generations) can never be mistaken for one about the block's next use.
- ``_free_stack`` (int32, lazily, only once ``allocate`` is called): the ledger's own free list.

Everything else about a block (owned / exposed / draining / quiesced / quarantined) follows from
its holders' request states and open grants, so it is derived when asked (``block_state``,
``stats``) instead of being written on every transition: the hot path touches per-block arrays
only where the contract needs it — to refuse a block that is not free, to record generations in a
grant, and to put blocks back in the pool.

Companion modules of this package: ``records`` (the per-request and per-grant records),
``events`` (the log events a call notes under the lock and emits after it), ``values``
(``Transition``, ``LedgerStats``, ``QuarantineInfo``, re-exported by the package) and
``counters`` (the open-grant counters that widen instead of wrapping).

Thread safety: every public method holds one lock; evidence may arrive on transfer-engine
threads while the scheduler allocates. Logging never runs under it: a call notes its log events
while it holds the lock (only when structlog is configured) and emits them once it has let go,
so a log processor may call the ledger back, from its own thread or another.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime import errors, inputs
from kvlifetime.errors import (
    BlockUnavailable,
    DoubleRelease,
    DuplicateBlockIds,
    DuplicateRequest,
    EvidenceError,
    HolderLimit,
    IllegalTransition,
    InsufficientEvidence,
    MismatchedEvidence,
    OutOfBlocks,
    SpecDisagreement,
    StaleEvidence,
    UnknownRequest,
    UsageError,
    show,
)
from kvlifetime.evidence import (
    AccessRevoked,
    Evidence,
    GrantEvidence,
    PeerLost,
    to_dict,
)
from kvlifetime.grant import (
    Access,
    BlockIds,
    Grant,
    GrantId,
    PeerId,
    RequestKey,
    make_grant,
    make_grant_id,
)
from kvlifetime.ledger.counters import Counts as _Counts
from kvlifetime.ledger.counters import counted as _counted
from kvlifetime.ledger.counters import narrowest as _narrowest
from kvlifetime.ledger.events import Event, describe, emit, note, note_released
from kvlifetime.ledger.records import GrantRecord, RequestRecord
from kvlifetime.ledger.values import BatchOutcome as BatchOutcome
from kvlifetime.ledger.values import LedgerStats as LedgerStats
from kvlifetime.ledger.values import QuarantineInfo as QuarantineInfo
from kvlifetime.ledger.values import Refusal as Refusal
from kvlifetime.ledger.values import Transition as Transition
from kvlifetime.provenance import check_grant_peer, check_source
from kvlifetime.source import SourceKind
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import request_table
from kvlifetime.spec.vocabulary import (
    ENDED_STATES,
    PROOF_CHAIN,
    BlockState,
    RequestState,
)

FREE = -1
ORPHANED = -2

Counts = Literal["ledger", "engine"]
"""Whose reference counts decide when a block is free (``BlockLedger(counts=...)``)."""
COUNTS: tuple[Counts, ...] = ("ledger", "engine")

_Key = TypeVar("_Key", bound=RequestKey)  # a mapping keyed by str, by int, or by both
_new_tuple = tuple.__new__
_PLAIN = (list, tuple)  # batches acquire_many flattens without a conversion per request

_log = structlog.get_logger("kvlifetime")

_ADMITTED = RequestState.ADMITTED.value
_TRANSFER_QUIESCED = RequestState.TRANSFER_QUIESCED.value
_QUARANTINED = RequestState.QUARANTINED.value
_RELEASED = RequestState.RELEASED.value
_ENDED = frozenset(s.value for s in ENDED_STATES)
# Targets that need bookkeeping beyond the state itself.
_BOOKKEEPING = frozenset({_TRANSFER_QUIESCED, _QUARANTINED, _RELEASED})

_TABLE = request_table()
# For each state, the evidence-driven transitions that may fire from it, in PROOF_CHAIN order:
# (event, guard function, target). Precomputed so a step is a dict lookup and a guard call.
_CHAIN: dict[str, tuple[tuple[str, Any, str], ...]] = {}
for _state in _TABLE.states:
    _CHAIN[_state] = tuple(
        (row.event, _TABLE.guards[row.guard] if row.guard else (lambda _f: True), row.target)
        for ev in PROOF_CHAIN
        for row in _TABLE.rows_for(_state, ev.value)
    )

# How many released request keys are remembered to tell a double release from an unknown key.
_RECENTLY_RELEASED = 4096


def _enabled() -> bool:
    # A library never configures structlog; it stays silent (and cheap) until the application
    # (or structlog.testing.capture_logs) has.
    return structlog.is_configured()


def _empty() -> BlockIds:
    return np.empty(0, dtype=np.int64)


class BlockLedger:
    """The lifetime of every block of one KV pool, guarded by evidence. See README "Embedding
    the ledger" and docs/ledger-api.md.

    Every public call validates its arguments (``kvlifetime.inputs``) before it touches
    anything: a refused call raises a ``KVLifetimeError`` and changes nothing, for anyone.
    """

    MAX_SHARERS = int(np.iinfo(np.uint16).max)
    """The most requests that may hold one block shared (the ``_sharers`` counter's limit):
    one more shared acquire is refused with ``HolderLimit``, never wrapped."""

    def __init__(
        self,
        num_blocks: int,
        *,
        checked: bool = False,
        incarnation: str | None = None,
        counts: Counts = "ledger",
    ) -> None:
        num_blocks = inputs.count(num_blocks, "num_blocks", 1)
        if num_blocks >= 2**31:
            raise errors.InvalidField("num_blocks must be < 2**31")
        checked = inputs.flag(checked, "checked")
        if incarnation is not None:
            incarnation = inputs.peer_id(incarnation, "incarnation")
        engine = inputs.choice(counts, "counts", COUNTS) == "engine"
        self.num_blocks = num_blocks
        self.checked = checked
        self.counts: Counts = "engine" if engine else "ledger"
        """``"ledger"``: a block is free when no request holds it in the ledger (the ledger
        owns the free list, or records exclusive acquires of free blocks). ``"engine"``: the
        engine's own reference counts decide when a block is free; the ledger guards exposure
        only (any number of requests may hold a block; ``allocate`` is refused)."""
        self._engine = engine
        # Random per instance: a grant id from another ledger or an earlier process never matches.
        self.incarnation = incarnation or uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        # Engine mode has no exclusive owner: every hold is counted in _sharers.
        self._owner = np.full(0 if engine else num_blocks, FREE, dtype=np.int32)
        self._sharers = np.zeros(num_blocks, dtype=np.uint16)
        # Open write / read grants per block (uint8, widened before a count could wrap); kept
        # from the first shared acquire or open_access on (``_tracking``).
        self._unsettled: _Counts = np.zeros(num_blocks, np.uint8)
        self._readers: _Counts = np.zeros(num_blocks, np.uint8)
        self._open_writes = 0  # open write grants counted in _unsettled (while tracking)
        self._open_reads = 0  # open read grants counted in _readers (while tracking)
        self._tracking = engine  # engine mode reads them on every acquire and grant
        # Inside apply_many: grants closed whose counts are not yet taken off (see there).
        self._uncounted: list[GrantRecord] | None = None
        self._generation = np.zeros(num_blocks, dtype=np.uint32)
        self._free_stack: npt.NDArray[np.int32] | None = None
        self._free_top = 0
        self._requests: dict[RequestKey, RequestRecord] = {}
        self._by_slot: dict[int, RequestRecord] = {}
        self._next_slot = 0
        self._next_serial = 1
        self._grants: dict[int, GrantRecord] = {}  # serial -> record, for live requests
        self._by_peer: dict[PeerId, dict[int, GrantRecord]] = {}  # open grants per peer
        self._releasable: dict[RequestKey, None] = {}  # requests in transfer_quiesced (ordered)
        self._timed: dict[RequestKey, None] = {}  # requests with a deadline somewhere
        self._shared_holds = 0  # live shared acquisitions; 0 lets release skip _sharers
        self._free_patterns: dict[int, bytes] = {}
        self._marks = np.empty(0, dtype=np.int32)  # distinct markers below ORPHANED
        self._recently_released: collections.OrderedDict[RequestKey, None] = (
            collections.OrderedDict()
        )
        self._unsafe_releases = 0
        self._refused: collections.Counter[str] = collections.Counter()
        self._reclaimed: collections.Counter[str] = collections.Counter()  # fence -> blocks
        self._clock: float | None = None  # last ``now`` passed to expire()
        # Log events noted under the lock, emitted by ``_flush`` once it is released: a log
        # processor may call back into the ledger (``stats()``, from any thread) without a
        # deadlock. Empty (and never appended to) while nobody listens.
        self._pending: list[Event] = []

    def _flush(self) -> None:
        """Emit the log events noted so far, outside the lock. Whichever call flushes takes
        every event noted until then, in the order noted; events of calls running at the same
        time on other threads may be emitted by them, interleaved with these."""
        with self._lock:
            events, self._pending = self._pending, []
        emit(_log, events)

    # =================================================================== restart

    PREVIOUS_INCARNATION = "previous_incarnation"  # the quarantine reason after a restart

    @classmethod
    def after_restart(
        cls,
        num_blocks: int,
        *,
        peers: Sequence[PeerId],
        exposed: npt.ArrayLike | None = None,
        request: RequestKey = "previous-incarnation",
        checked: bool = False,
        incarnation: str | None = None,
        counts: Counts = "ledger",
    ) -> BlockLedger:
        """A ledger that starts over an arena a previous incarnation's peers may still reach.

        The ledger is in memory; the KV arena may outlive it (memory kept by a supervisor,
        shared memory, a pool reused after an in-process reset). A fresh ``BlockLedger`` would
        start with every block free and hand out blocks a peer of the old process may still be
        writing. Here the blocks ``exposed`` (default: all) start held by ``request``, with one
        open write grant per peer in ``peers``, quarantined with reason
        ``previous_incarnation``: never handed out, counted in ``stats()``. Only a completed
        fence ends it - ``apply(AccessRevoked(peer, fence=...))`` for each peer, from the local
        side - after which ``collect_releasable()`` returns them under ``request``.

        Evidence about the previous incarnation's grants stays refused (``MismatchedEvidence``:
        another incarnation) and counted: a late report of the old process proves nothing here.
        So does every claim about the quarantine grants themselves (a ``TransferCompleted``,
        ``SchedulingStopped``, ``TransferQuiesced``, ``CancelReceived`` or ``LeaseExpired``,
        from the peer or from this process): they stand for the old access, which only a fence
        ends. Refused before anything changes, logged and counted like any refused evidence.
        ``counts`` as in the constructor (with ``"engine"``, ``request`` holds the blocks by the
        engine's counts; the engine keeps its own references to them until they are returned).
        """
        if isinstance(peers, str | bytes) or not isinstance(peers, Sequence):
            raise errors.InvalidField(
                f"peers must be a non-empty sequence of peer ids (who may still reach the "
                f"arena), got {show(peers)}"
            )
        # Read once, each one checked (and made a plain str) before any dict hashes it: an
        # unhashable or empty peer is InvalidField, never a TypeError.
        names = list(dict.fromkeys(inputs.peer_id(p) for p in inputs.materialised(peers, "peers")))
        if not names:
            raise errors.InvalidField(
                "peers must be a non-empty sequence of peer ids (who may still reach the arena)"
            )
        request = inputs.request_key(request)
        led = cls(num_blocks, checked=checked, incarnation=incarnation, counts=counts)
        ids = np.arange(num_blocks, dtype=np.int64) if exposed is None else exposed
        led.acquire(request, ids)
        with led._lock:
            # One write grant per peer over the same blocks: opened directly (in engine mode
            # a write grant is refused where any grant is open; here every peer may write).
            req = led._requests[request]
            held = req.all_blocks()
            for peer in names:
                led._open_grant(req, peer, held, Access.WRITE, None)
            for rec in req.open.values():
                rec.fence_only = True
        led.reject(request, reason=cls.PREVIOUS_INCARNATION)
        with led._lock:
            for rec in req.open.values():
                rec.mark_suspect(cls.PREVIOUS_INCARNATION)
            out: list[Transition] = []
            led._advance(req, "after_restart", None, out)
            if _enabled():
                note(led._pending, out)
        if led._pending:
            led._flush()
        return led

    # =================================================================== admission and blocks

    def admit(self, request: RequestKey, *, deadline: float | None = None) -> None:
        """Admit a request that holds no block yet (allocate / acquire admit implicitly)."""
        request = inputs.request_key(request)
        deadline = inputs.optional_time(deadline, "deadline")
        try:
            with self._lock:
                self._admit(request, deadline)
        finally:
            if self._pending:
                self._flush()

    def allocate(self, request: RequestKey, n: int, *, deadline: float | None = None) -> BlockIds:
        """Take ``n`` free blocks from the ledger's own free list for ``request``.

        From the first call on, the ledger owns the free list: fresh blocks come from
        ``allocate``; ``acquire`` is then only for sharing held blocks.
        """
        request = inputs.request_key(request)
        n = inputs.count(n, "n")
        deadline = inputs.optional_time(deadline, "deadline")
        if self._engine:
            raise BlockUnavailable(
                "counts='engine': the engine's allocator hands out blocks in this mode; record "
                "what it handed out with acquire"
            )
        try:
            with self._lock:
                req = self._requests.get(request)
                if req is not None and req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "allocate")
                stack = self._free_stack
                # Refused before the free list is built: a refusal leaves acquire() as it was.
                free = self._free_top if stack is not None else self._count_free()
                if n > free:
                    raise OutOfBlocks(n, free)
                if stack is None:
                    stack = self._build_free_stack()
                if req is None:
                    req = self._admit(request, deadline)
                elif deadline is not None:
                    self._set_deadline(req, deadline)
                top = self._free_top - n
                # The stack's top holds the lowest ids: hand them out in ascending order.
                ids = stack[top : self._free_top][::-1].astype(np.int64)
                self._free_top = top
                self._owner[ids] = req.slot
                ids.flags.writeable = False
                req.excl.append(ids)
                return ids
        finally:
            if self._pending:
                self._flush()

    def acquire(
        self,
        request: RequestKey,
        ids: npt.ArrayLike,
        *,
        shared: bool = False,
        deadline: float | None = None,
    ) -> None:
        """Record that ``request`` holds ``ids`` (handed out by the engine's own allocator).

        Exclusive: every block must be free. ``shared=True`` (a prefix-cache hit): every block
        must already be held and have no open write grant (its content is settled; open read
        grants do not unsettle it, even of a holder that ended). Refused blocks raise
        ``BlockUnavailable``.

        ``counts="engine"``: ``request`` holds ``ids`` by the engine's own counts; any number of
        requests may hold a block (``shared`` makes no difference). Refused
        (``BlockUnavailable``) where an open write grant covers a block (its content is
        unsettled) or ``request`` already holds one; ``HolderLimit`` at ``MAX_SHARERS``.
        """
        request = inputs.request_key(request)
        shared = inputs.flag(shared, "shared")
        deadline = inputs.optional_time(deadline, "deadline")
        engine = self._engine
        shared = shared or engine  # in engine mode every hold is counted like a shared one
        arr = self._ids(ids, unique=shared)
        try:
            with self._lock:
                req = self._requests.get(request)
                if req is not None and req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "acquire")
                self._check_hold(arr, req, shared)
                self._record_hold(request, req, arr, shared, deadline)
        finally:
            if self._pending:
                self._flush()

    def _check_hold(self, arr: BlockIds, req: RequestRecord | None, shared: bool) -> None:
        """``acquire``'s refusals of ``arr`` for ``req`` (``None``: not admitted yet); ``shared``
        is true in engine mode. An exclusive hold that passes leaves the blocks marked (not
        free) until ``_record_hold`` writes their owner."""
        if self._engine:
            self._check_engine_hold(arr, req)
        elif shared:
            self._check_shareable(arr, req)
        else:
            if self._free_stack is not None:
                raise BlockUnavailable(
                    "this ledger owns the free list (allocate was called): take fresh "
                    "blocks with allocate; acquire(shared=True) shares held ones"
                )
            self._mark_free_unique(arr)

    def _record_hold(
        self,
        request: RequestKey,
        req: RequestRecord | None,
        arr: BlockIds,
        shared: bool,
        deadline: float | None,
        first: Callable[[], None] | None = None,
    ) -> RequestRecord:
        """Record the hold ``_check_hold`` allowed: admit the request if new, set its deadline,
        count the blocks. ``first`` runs before anything changes (a refusal there, like one
        from admission, unmarks the blocks and changes nothing)."""
        try:
            if first is not None:
                first()
            if req is None:
                req = self._admit(request, deadline)
            elif deadline is not None:
                self._set_deadline(req, deadline)
        except BaseException:
            if not shared:
                self._owner[arr] = FREE
            raise
        if shared:
            self._sharers[arr] += 1
            self._shared_holds += 1
            req.shared.append(arr)
        else:
            self._owner[arr] = req.slot
            req.excl.append(arr)
        return req

    def acquire_many(self, holds: Mapping[_Key, npt.ArrayLike], *, shared: bool = False) -> None:
        """Many requests' ``acquire`` in one call: a scheduler step's new blocks (decode growing
        each running request by a block, a batch of prefills admitted together).

        The same as ``acquire(request, ids, shared=shared)`` for each item of ``holds`` in order,
        with the same refusals, but all or nothing: if any of them would be refused, this raises
        that refusal and nothing changes, for any request. The ids of every request are
        validated and checked together, as one batch; the per-request work is a dict lookup and
        a list append, so the call costs O(requests + blocks) with numpy's per-call overhead paid
        once per step instead of once per request.
        """
        if not isinstance(holds, Mapping):
            raise errors.InvalidField(
                f"holds must be a mapping of request -> block ids, got {type(holds).__name__}"
            )
        shared = inputs.flag(shared, "shared")
        # One walk, as (key, ids) pairs: a mapping whose keys and values() disagree (or that
        # changes between two walks) cannot pair a request with ids it was not checked with.
        pairs = _pairs(holds)
        if not pairs:
            return
        keys: list[RequestKey]
        keys, values = map(list, zip(*pairs, strict=True))
        # Plain int and str keys of a dict are valid as they are (it keeps them distinct);
        # anything else is normalized, and two keys that become one (an IntEnum member and its
        # value; a mapping that names one key twice) are refused.
        if type(holds) is not dict or not all(
            type(k) is int or (type(k) is str and k) for k in keys
        ):
            keys = [inputs.request_key(k) for k in keys]
            if len(set(keys)) != len(keys):
                raise errors.InvalidField(f"holds names a request twice: {show(keys)}")
        engine = self._engine
        shared = shared or engine
        lens = [len(v) if type(v) in _PLAIN else -1 for v in values]
        flat = list(chain.from_iterable(values)) if -1 not in lens else None
        if flat is not None and len(flat) != sum(lens):
            flat = None  # a list changed under us (another thread): take each one's copy below
        if flat is not None and set(map(type, flat)) <= {int}:
            # The common case, a list or tuple of ints per request: one conversion for all.
            allids = _concat_ids([flat], self.num_blocks)
        else:
            parts = [self._batch_part(v) for v in values]
            lens = [len(p) for p in parts]
            allids = _concat_ids(parts, self.num_blocks)
        starts = [0] * len(keys)
        total = 0
        for i, n in enumerate(lens):
            starts[i] = total
            total += n
        # One sort finds every repeat: within one request it is DuplicateBlockIds, as in
        # acquire; across requests it is a block taken by two of them (refused where holds are
        # exclusive; counted twice, below the holder limit, where they are shared).
        repeats = _repeats(allids, lens)
        if repeats is not None and repeats[0] is not None:
            raise DuplicateBlockIds(
                f"duplicate block ids in one batch of request {show(keys[repeats[0]])}: "
                f"{repeats[2][:16].tolist()}"
            )
        try:
            with self._lock:
                reqs: list[RequestRecord | None] = []
                for key in keys:
                    req = self._requests.get(key)
                    if req is not None and req.state != _ADMITTED:
                        raise IllegalTransition("request", key, req.state, "acquire")
                    reqs.append(req)
                if engine or shared:
                    if engine:
                        self._check_engine_hold(allids, None)
                    else:
                        self._check_shareable(allids, None)
                    self._check_not_held_yet(allids, keys, reqs, starts, lens)
                    if repeats is not None:
                        self._check_repeat_limit(repeats[1], repeats[3])
                else:
                    if self._free_stack is not None:
                        raise BlockUnavailable(
                            "this ledger owns the free list (allocate was called): take fresh "
                            "blocks with allocate; acquire(shared=True) shares held ones"
                        )
                    if repeats is not None:
                        raise BlockUnavailable(
                            f"blocks {repeats[1][:16].tolist()} acquired exclusively by two "
                            "requests in one call"
                        )
                    self._mark_free_unique(allids)
                # Every check passed: from here on nothing is refused.
                try:
                    recs = [
                        r if r is not None else self._admit(k, None)
                        for k, r in zip(keys, reqs, strict=True)
                    ]
                except BaseException:  # keys were validated: only a bug gets here
                    if not shared:
                        self._owner[allids] = FREE
                    raise
                if shared:
                    if repeats is None:
                        self._sharers[allids] += 1
                    else:
                        np.add.at(self._sharers, allids, 1)
                    self._shared_holds += len(recs)
                    for req, view in zip(recs, _views(allids, starts, lens), strict=True):
                        req.shared.append(view)
                        if len(req.shared) > _STEP_VIEWS:
                            self._shared_holds -= _merge(req.shared)
                else:
                    self._owner[allids] = np.repeat(
                        np.fromiter((r.slot for r in recs), np.int32, len(recs)), lens
                    )
                    for req, view in zip(recs, _views(allids, starts, lens), strict=True):
                        req.excl.append(view)
                        if len(req.excl) > _STEP_VIEWS:
                            _merge(req.excl)
        finally:
            if self._pending:
                self._flush()

    def acquire_and_grant(
        self,
        request: RequestKey,
        ids: npt.ArrayLike,
        peer: PeerId,
        access: Access = Access.WRITE,
        *,
        shared: bool = False,
        deadline: float | None = None,
    ) -> Grant:
        """``acquire(request, ids, shared=shared)`` then ``grant(request, peer, ids, access)``,
        in one call and all or nothing: a prefill that takes its blocks and sends their
        addresses to the peer that fills them, or a decode that exposes blocks it just took to
        the peer that reads them.

        Refused exactly where one of the two calls would be (``deadline`` is the request's, as
        in ``acquire``); a refusal changes nothing. One validation and one lock instead of two,
        and no check that the request holds the blocks: it just took them.
        """
        request = inputs.request_key(request)
        peer = inputs.peer_id(peer)
        inputs.instance(access, Access, "access")
        shared = inputs.flag(shared, "shared")
        deadline = inputs.optional_time(deadline, "deadline")
        engine = self._engine
        shared = shared or engine
        arr = self._ids(ids, unique=shared)
        try:
            with self._lock:
                req = self._requests.get(request)
                if req is not None and req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "acquire")
                if access is Access.WRITE and len(arr):
                    # What grant() refuses on blocks the request holds once the hold is recorded
                    # (the hold checks refuse an open write grant on any of them).
                    if engine:
                        if np.count_nonzero(self._sharers.take(arr)):
                            raise BlockUnavailable("a write grant on blocks another request holds")
                        if np.count_nonzero(self._readers.take(arr)):
                            raise BlockUnavailable("a write grant on blocks an open grant covers")
                    elif shared:
                        raise BlockUnavailable("a write grant on a block this request shares")
                self._check_hold(arr, req, shared)
                count = (lambda: self._count_open(arr, access)) if self._tracking else None
                req = self._record_hold(request, req, arr, shared, deadline, count)
                return self._open_grant(req, peer, arr, access, deadline=None, counted=True)
        finally:
            if self._pending:
                self._flush()

    def _batch_part(self, value: object) -> BlockIds | list[int]:
        """One request's ids for ``acquire_many``: an int64 array or a list of ints are taken as
        they are (checked with the whole batch); anything else through ``inputs.block_ids``,
        which refuses what is not a batch of ids."""
        if type(value) is np.ndarray and value.ndim == 1 and value.dtype == np.int64:
            return value
        if isinstance(value, list | tuple) and type(value) in (list, tuple):
            ints = list(value)
            if all(type(v) is int for v in ints):
                return ints
        return inputs.block_ids(value, self.num_blocks, unique=False)

    def _check_not_held_yet(
        self,
        allids: BlockIds,
        keys: Sequence[RequestKey],
        reqs: Sequence[RequestRecord | None],
        starts: Sequence[int],
        lens: Sequence[int],
    ) -> None:
        """``acquire_many`` (shared or engine holds): refuse where a request already holds one
        of the blocks it asks for. Only blocks someone holds can be, and only requests that
        already hold something are looked at."""
        held = self._sharers.take(allids) > 0
        if not self._engine:
            held |= self._owner.take(allids) >= 0
        if not np.count_nonzero(held):
            return
        for key, req, a, n in zip(keys, reqs, starts, lens, strict=True):
            if req is None or not n or not np.count_nonzero(held[a : a + n]):
                continue
            mine = allids[a : a + n]
            if (not self._engine and (self._owner.take(mine) == req.slot).any()) or any(
                np.isin(mine, s, assume_unique=True).any() for s in req.shared
            ):
                raise BlockUnavailable(f"request {show(key)} already holds some of these blocks")

    def _check_repeat_limit(self, ids: BlockIds, times: npt.NDArray[np.int64]) -> None:
        """``acquire_many``: blocks ``ids`` are taken by ``times`` requests of one call; refuse
        if that would pass the holder limit (each alone was checked below it)."""
        over = self._sharers.take(ids).astype(np.int64) + times > self.MAX_SHARERS
        if over.any():
            raise HolderLimit(
                f"blocks {ids[over][:16].tolist()} would have more than {self.MAX_SHARERS} "
                "holders (the counter's limit): not held by one more"
            )

    # =================================================================== grants

    def grant(
        self,
        request: RequestKey,
        peer: PeerId,
        blocks: npt.ArrayLike,
        access: Access = Access.WRITE,
        *,
        deadline: float | None = None,
    ) -> Grant:
        """Record that ``peer`` may now access ``blocks`` of ``request``: from here on only
        evidence can end it. Call it *before* the addresses leave the process.

        ``request`` must be running and hold every block. A write grant is refused
        (``BlockUnavailable``) on a block another request holds (or, with the ledger's counts,
        that ``request`` holds shared); with ``counts="engine"`` also on a block any open grant
        covers, and a read grant on a block another request's open write grant covers."""
        request = inputs.request_key(request)
        peer = inputs.peer_id(peer)
        inputs.instance(access, Access, "access")
        deadline = inputs.optional_time(deadline, "deadline")
        try:
            with self._lock:
                req = self._get(request)
                if req.state != _ADMITTED:
                    raise IllegalTransition("request", request, req.state, "grant")
                arr = self._held_view(req, blocks)
                if self._engine:
                    self._check_engine_grant(req, arr, access)
                elif access is Access.WRITE and self._shared_holds:
                    if req.shared and any(
                        np.isin(arr, s, assume_unique=True).any() for s in req.shared
                    ):
                        raise BlockUnavailable("a write grant on a block this request shares")
                    if np.count_nonzero(self._sharers.take(arr)):
                        raise BlockUnavailable("a write grant on a block with more than one holder")
                return self._open_grant(req, peer, arr, access, deadline)
        finally:
            if self._pending:
                self._flush()

    def _open_grant(
        self,
        req: RequestRecord,
        peer: PeerId,
        arr: BlockIds,
        access: Access,
        deadline: float | None,
        *,
        counted: bool = False,
    ) -> Grant:
        """Open the grant (every check done; ``HolderLimit`` from the counters, if any, comes
        first and changes nothing). ``counted``: the caller already counted it in the per-block
        counters (before changing anything else)."""
        if self._tracking and not counted:
            self._count_open(arr, access)
        request = req.key
        serial = self._next_serial
        self._next_serial = serial + 1
        gens = self._generation.take(arr)
        gens.flags.writeable = False
        g = make_grant(make_grant_id(self.incarnation, serial), request, peer, arr, gens, access)
        rec = GrantRecord(g, req, deadline)
        req.grants[serial] = rec
        req.open[serial] = rec
        self._grants[serial] = rec
        peer_open = self._by_peer.get(peer)
        if peer_open is None:
            peer_open = self._by_peer[peer] = {}
        peer_open[serial] = rec
        if deadline is not None:
            self._timed[request] = None
        if _enabled():
            self._pending.append(("info", "grant_opened", g.describe()))
        return g

    # =================================================================== the owner ends it

    def reject(self, request: RequestKey, reason: str = "rejected") -> list[Transition]:
        """The owner ended the request early (admission refusal, client abort, failure).

        The error response may go out now; nothing about the blocks changes. Evidence already
        gathered may fire further transitions inside this call.
        """
        request = inputs.request_key(request)
        inputs.text(reason, "reason")
        try:
            with self._lock:
                return self._end(request, "rejected", "reject")
        finally:
            if self._pending:
                self._flush()

    def reject_many(self, requests: Sequence[RequestKey], reason: str = "rejected") -> BatchOutcome:
        """``reject`` of many requests in one call (a step's aborts), as ``finish_many`` is
        ``finish``: each request rejected or refused on its own, in order, the outcome as data,
        refusals logged (``reject_refused``). A bad ``reason`` or a ``requests`` that is not a
        sequence raises ``InvalidField`` and changes nothing."""
        inputs.text(reason, "reason")
        return self._end_many(requests, "rejected", "reject")

    def finish(self, request: RequestKey) -> list[Transition]:
        """The normal end on the owner's side. Open grants still need their proof."""
        request = inputs.request_key(request)
        try:
            with self._lock:
                return self._end(request, "finished", "finish")
        finally:
            if self._pending:
                self._flush()

    def _end(self, request: RequestKey, event: str, cause: str) -> list[Transition]:
        """The owner ends ``request`` (validated), under the lock: the one implementation of
        ``reject`` / ``finish`` and of their batch calls."""
        req = self._get(request, ending=True)
        out: list[Transition] = []
        self._fire(req, event, cause, out)
        self._advance(req, cause, None, out)
        if _enabled():
            note(self._pending, out)
        return out

    def _end_many(self, requests: Sequence[RequestKey], event: str, cause: str) -> BatchOutcome:
        items = _batch(requests, "requests", "request keys")
        fired: list[Transition] = []
        refused: list[Refusal] = []
        try:
            with self._lock:
                for i, request in enumerate(items):
                    try:
                        fired += self._end(inputs.request_key(request), event, cause)
                    except UsageError as e:
                        refused.append(Refusal(i, request, e))
                        if _enabled():
                            self._pending.append(
                                (
                                    "warning",
                                    f"{cause}_refused",
                                    {"error": e.kind, "message": str(e), "request": show(request)},
                                )
                            )
            return BatchOutcome(tuple(fired), tuple(refused))
        finally:
            if self._pending:
                self._flush()

    def finish_many(self, requests: Sequence[RequestKey]) -> BatchOutcome:
        """``finish`` of many requests in one call: the requests a scheduler step ended.

        Each request is finished or refused on its own, in order, exactly as ``finish`` would
        be at that point (same checks, same typed error: ``UnknownRequest``, ``DoubleRelease``,
        ``IllegalTransition``, ``InvalidField``); a refused one changes nothing and is logged
        (``finish_refused``). Not all or nothing: one request's end does not depend on
        another's. Returns the transitions fired and the refusals as data, never raising for
        one bad item; a ``requests`` that is not a sequence raises ``InvalidField``. One lock
        for all.
        """
        return self._end_many(requests, "finished", "finish")

    # =================================================================== evidence

    def apply(self, evidence: Evidence) -> list[Transition]:
        """Add one piece of evidence; return the transitions it fired (in order).

        Stale, mismatched or contradictory evidence raises its typed error, is logged and
        counted, and changes nothing. Duplicates and late, weaker reports are no-ops.
        """
        try:
            with self._lock:
                try:
                    return self._apply(evidence)
                except EvidenceError as e:
                    self._refuse(e, evidence)
                    raise
        finally:
            if self._pending:
                self._flush()

    def apply_many(self, evidence: Sequence[Evidence]) -> BatchOutcome:
        """Add many pieces of evidence in one call: what a scheduler step learned (the
        transfers of many requests that completed).

        Each piece is about its own grant (or peer) and is applied or refused on its own, in
        order, exactly as ``apply`` would at that point (the same checks, the same typed
        ``EvidenceError``, logged as ``evidence_refused`` and counted in
        ``stats().refused_evidence``); a refused piece changes nothing. Not all or nothing: a
        forged or stale report must not stop the honest ones beside it. Returns the
        transitions fired and the refusals as data, never raising for one bad piece; an
        ``evidence`` that is not a sequence raises ``InvalidField``. One lock for all.
        """
        items = _batch(evidence, "evidence", "evidence objects")
        fired: list[Transition] = []
        refused: list[Refusal] = []
        try:
            with self._lock:
                # Closing a grant takes it off the per-block open-grant counters; evidence never
                # reads them (only acquire, grant and open_access do, which cannot run while the
                # lock is held), so the batch takes every closed grant off in one write at its end
                # instead of one per grant: the same counts when the lock is let go.
                self._uncounted = [] if self._tracking else None
                try:
                    for i, ev in enumerate(items):
                        try:
                            fired += self._apply(ev)
                        except EvidenceError as e:
                            self._refuse(e, ev)
                            refused.append(Refusal(i, ev, e))
                finally:
                    closed, self._uncounted = self._uncounted, None
                    if closed:
                        self._uncount_all(closed)
            return BatchOutcome(tuple(fired), tuple(refused))
        finally:
            if self._pending:
                self._flush()

    def _refuse(self, e: EvidenceError, evidence: object) -> None:
        """Count and log refused evidence (it changed nothing)."""
        self._refused[e.kind] += 1
        if _enabled():
            self._pending.append(
                (
                    "warning",
                    "evidence_refused",
                    {"error": e.kind, "message": str(e), "evidence": describe(evidence)},
                )
            )

    def _apply(self, ev: Evidence) -> list[Transition]:
        out: list[Transition] = []
        # On the type itself: a ``__class__`` property cannot pass a stranger off as evidence.
        if not issubclass(type(ev), Evidence):
            raise errors.MalformedEvidence(f"not evidence: {show(ev)}", evidence=ev)
        if ev.source.kind is not SourceKind.LOCAL:
            # Who may say it comes first: a claim a peer may not make, or a peer speaking for
            # another, is refused before the grant it names is even looked up.
            check_source(ev)
        if isinstance(ev, GrantEvidence) or (
            isinstance(ev, AccessRevoked) and ev.grant_id is not None
        ):
            gid = ev.grant_id
            assert gid is not None  # AccessRevoked about one grant names it
            rec = self._grants.get(gid.serial) if gid.incarnation == self.incarnation else None
            if rec is None or ev.request != rec.grant.request or ev.peer != rec.peer:
                rec = self._grant_record(ev)  # raises the precise error
            if rec.fence_only:
                _check_fence(rec, ev)
            rec.check(ev)
            # A closed grant of a live request: checked for contradictions above, else a no-op.
            changed = rec.is_open and rec.record(ev)
            if changed:
                self._proven(rec, ev, out)
        elif isinstance(ev, AccessRevoked | PeerLost):
            recs = list(self._by_peer.get(ev.peer, {}).values())
            for rec in recs:
                rec.check(ev)  # every check before any change: all or nothing
            changed = False
            for rec in recs:
                if rec.record(ev):
                    changed = True
                    self._proven(rec, ev, out)
        else:
            raise errors.MalformedEvidence(f"not evidence: {show(ev)}", evidence=ev)
        if _enabled():
            self._pending.append(
                ("info", "evidence_applied", {"evidence": to_dict(ev), "changed": changed})
            )
            note(self._pending, out)
        return out

    def _proven(self, rec: GrantRecord, ev: Evidence, out: list[Transition]) -> None:
        """Something new was proven about ``rec``: close it if it now is, advance its request."""
        req = rec.req
        if rec.is_open and rec.closed:
            self._close(rec)
            if isinstance(ev, AccessRevoked):
                req.fenced_by = ev.fence
        if req.state != _ADMITTED:
            self._advance(req, type(ev).__name__, rec, out)

    def _grant_record(self, ev: GrantEvidence | AccessRevoked) -> GrantRecord:
        gid = ev.grant_id
        assert gid is not None
        if gid.incarnation != self.incarnation:
            raise MismatchedEvidence(
                f"{ev.kind} is about grant {gid} of another ledger or incarnation "
                f"(this one is {self.incarnation})",
                evidence=ev,
            )
        rec = self._grants.get(gid.serial)
        if rec is None:
            if gid.serial < self._next_serial:
                raise StaleEvidence(
                    f"{ev.kind} is about grant {gid}, whose request was already released",
                    evidence=ev,
                )
            raise MismatchedEvidence(f"{ev.kind}: grant {gid} was never issued", evidence=ev)
        g = rec.grant
        # A peer speaking about another peer's grant is unauthorized, not merely mismatched.
        check_grant_peer(ev, g.peer)
        if ev.request != g.request:
            raise MismatchedEvidence(
                f"{ev.kind} names request {show(ev.request)}, grant {gid} is of {show(g.request)}",
                evidence=ev,
            )
        if ev.peer != g.peer:
            raise MismatchedEvidence(
                f"{ev.kind} names peer {show(ev.peer)}, grant {gid} is to {show(g.peer)}",
                evidence=ev,
            )
        return rec

    def _close(self, rec: GrantRecord) -> None:
        rec.is_open = False
        if self._tracking:
            self._uncount_open(rec)
        serial = rec.grant.id.serial
        del rec.req.open[serial]
        peer_open = self._by_peer[rec.grant.peer]
        del peer_open[serial]
        if not peer_open:
            del self._by_peer[rec.grant.peer]

    # =================================================================== deadlines

    def set_deadline(self, request: RequestKey, deadline: float | None) -> None:
        """Set (or clear) the request-wide deadline, on the caller's clock: a finite number,
        refused (``InvalidField``) when set, never later inside ``expire``."""
        request = inputs.request_key(request)
        deadline = inputs.optional_time(deadline, "deadline")
        with self._lock:
            self._set_deadline(self._get(request), deadline)

    def expire(self, now: float) -> list[RequestKey]:
        """Quarantine ended requests with an open grant whose deadline is ``<= now``.

        The core never reads a clock: the caller passes it. A deadline that passes while the
        owner still runs marks the grant; the request is quarantined when the owner ends it.
        Returns the requests quarantined by this call.
        """
        now = inputs.finite_time(now, "now")
        try:
            with self._lock:
                self._clock = now
                newly: list[RequestKey] = []
                for key in list(self._timed):
                    req = self._requests[key]
                    marked = False
                    for rec in req.open.values():
                        dl = rec.deadline if rec.deadline is not None else req.deadline
                        if dl is not None and dl <= now and rec.suspect is None:
                            rec.mark_suspect("deadline")
                            marked = True
                    if marked and req.state != _ADMITTED:
                        out: list[Transition] = []
                        self._advance(req, "expire", None, out)
                        if _enabled():
                            note(self._pending, out)
                        # Only if this call quarantined it: it may already have been (PeerLost).
                        if any(t.target == _QUARANTINED for t in out):
                            newly.append(key)
                    # Nothing left to time out; a quarantined request waits for proof only.
                    if req.state != _ADMITTED and (
                        not req.open or req.state in (_QUARANTINED, _TRANSFER_QUIESCED)
                    ):
                        self._timed.pop(key, None)
                return newly
        finally:
            if self._pending:
                self._flush()

    # =================================================================== release

    def release(self, request: RequestKey) -> BlockIds:
        """Let go of the request's blocks; return those that went back to the pool (with
        ``counts="engine"``: every block it held, which the engine may now drop its own
        references to; a block no request holds any more has its generation bumped).

        Raises ``InsufficientEvidence`` (listing what is unproven, per grant) while any grant
        is open, ``IllegalTransition`` if the owner has not ended the request.
        """
        request = inputs.request_key(request)
        try:
            with self._lock:
                req = self._get(request, ending=True)
                if req.state in _ENDED and req.open:
                    raise InsufficientEvidence(request, self._unproven(req))
                out: list[Transition] = []
                self._fire(req, "released", "release", out)
                return self._let_go([req], out)[0]
        finally:
            if self._pending:
                self._flush()

    def collect_releasable(self) -> dict[RequestKey, BlockIds]:
        """Release every request whose grants are all closed; return, per request, the block
        ids that went back to the pool. A scheduler calls this once per step: the per-block
        work of all of them is done in one batch."""
        try:
            with self._lock:
                if not self._releasable:
                    return {}
                reqs = [self._requests[k] for k in self._releasable]
                out: list[Transition] = []
                for req in reqs:
                    self._fire(req, "released", "collect_releasable", out)
                freed = self._let_go(reqs, out)
                return {req.key: ids for req, ids in zip(reqs, freed, strict=True)}
        finally:
            if self._pending:
                self._flush()

    def force_release(self, request: RequestKey, reason: str) -> BlockIds:
        """UNSAFE: release a request whose grants are not all closed. A peer may still write
        into the blocks returned. Logged at warning and counted in ``stats().unsafe_releases``.
        For a request whose grants are all closed it is an ordinary release."""
        request = inputs.request_key(request)
        inputs.text(reason, "reason")
        try:
            with self._lock:
                req = self._get(request, ending=True)
                out: list[Transition] = []
                if req.state == _TRANSFER_QUIESCED:
                    self._fire(req, "released", "force_release", out)
                else:
                    open_grants = [str(r.grant.id) for r in req.open.values()]
                    self._fire(req, "force_released", "force_release", out)
                    self._unsafe_releases += 1
                    if _enabled():
                        self._pending.append(
                            (
                                "warning",
                                "force_released",
                                {"request": request, "reason": reason, "open_grants": open_grants},
                            )
                        )
                return self._let_go([req], out)[0]
        finally:
            if self._pending:
                self._flush()

    def _let_go(self, reqs: Sequence[RequestRecord], out: list[Transition]) -> list[BlockIds]:
        """Forget the requests; put the blocks no one else holds back in the pool."""
        if self._engine:
            return self._let_go_engine(reqs, out)
        owner = self._owner
        results: list[BlockIds] = []
        excl_all: list[BlockIds] = []
        for req in reqs:
            self._forget(req)
            excl = (
                req.excl[0]
                if len(req.excl) == 1
                else (np.concatenate(req.excl) if req.excl else _empty())
            )
            if req.shared:
                # A shared holder lets go: the block returns only if it was the last holder.
                sh = np.concatenate(req.shared)
                self._sharers[sh] -= 1
                self._shared_holds -= len(req.shared)
                back = sh[(self._sharers.take(sh) == 0) & (owner.take(sh) == ORPHANED)]
            else:
                back = _empty()
            if self._shared_holds and len(excl):
                still = self._sharers.take(excl) > 0
                if np.count_nonzero(still):
                    owner[excl[still]] = ORPHANED
                    excl = excl[~still]
            if len(back):
                excl = np.concatenate([excl, back])
            excl_all.append(excl)
            results.append(excl)
            if req.fenced_by is not None and len(excl):
                self._reclaimed[req.fenced_by] += len(excl)
        if excl_all:
            ids = excl_all[0] if len(excl_all) == 1 else np.concatenate(excl_all)
            if len(ids):
                owner[ids] = FREE
                self._generation[ids] += 1
                if self._free_stack is not None:
                    top = self._free_top
                    self._free_stack[top : top + len(ids)] = ids[::-1]
                    self._free_top = top + len(ids)
        if _enabled():
            note_released(self._pending, reqs, results, out)
        return results

    def _let_go_engine(
        self, reqs: Sequence[RequestRecord], out: list[Transition]
    ) -> list[BlockIds]:
        """Engine mode: forget the requests and drop their holds; return every block each one
        held (the engine may drop its own references to them). A block no request holds any
        more is not guarded: its generation is bumped."""
        sharers = self._sharers
        results: list[BlockIds] = []
        unguarded: list[BlockIds] = []
        if len(reqs) > 1:
            # Many at once (collect_releasable): where no block of theirs has a second holder
            # (the common case, told by one gather), each drops to no holder: one write for all.
            results = [req.all_blocks() for req in reqs]
            allh = np.concatenate(results)
            if not len(allh) or int(sharers.take(allh).max()) == 1:
                for req, held in zip(reqs, results, strict=True):
                    self._forget(req)
                    self._shared_holds -= len(req.shared)
                    if req.fenced_by is not None and len(held):
                        self._reclaimed[req.fenced_by] += len(held)
                sharers[allh] = 0
                self._generation[allh] += 1
                if _enabled():
                    note_released(self._pending, reqs, results, out)
                return results
            results = []
        for req in reqs:
            self._forget(req)
            held = req.all_blocks()
            self._shared_holds -= len(req.shared)
            if len(held):
                sharers[held] -= 1  # one request holds a block once
                gone = held[sharers.take(held) == 0]
                unguarded.append(gone)
                if req.fenced_by is not None and len(gone):
                    self._reclaimed[req.fenced_by] += len(gone)
            results.append(held)
        if unguarded:
            ids = unguarded[0] if len(unguarded) == 1 else np.concatenate(unguarded)
            self._generation[ids] += 1
        if _enabled():
            note_released(self._pending, reqs, results, out)
        return results

    def _forget(self, req: RequestRecord) -> None:
        # The ledger never grows with history: a released request and its grants are gone.
        key = req.key
        del self._requests[key]
        del self._by_slot[req.slot]
        self._releasable.pop(key, None)
        self._timed.pop(key, None)
        for serial, rec in req.grants.items():
            del self._grants[serial]
            if serial in req.open:
                # Only force_release forgets an open grant: it was counted while open.
                if self._tracking:
                    self._uncount_open(rec)
                peer_open = self._by_peer[rec.grant.peer]
                del peer_open[serial]
                if not peer_open:
                    del self._by_peer[rec.grant.peer]
        rr = self._recently_released
        rr[key] = None
        if len(rr) > _RECENTLY_RELEASED:
            rr.popitem(last=False)

    # =================================================================== transitions

    def _fire(self, req: RequestRecord, event: str, cause: str, out: list[Transition]) -> None:
        """Fire a call-driven transition (reject, finish, release, force_released)."""
        target = _TABLE.step(req.state, event, req, req.key)
        if target is None:
            if event == "released":
                raise InsufficientEvidence(req.key, self._unproven(req))
            raise IllegalTransition("request", req.key, req.state, event)
        self._moved(req, event, target, cause, None, out)

    def _advance(
        self, req: RequestRecord, cause: str, rec: GrantRecord | None, out: list[Transition]
    ) -> None:
        """Fire every evidence-driven transition whose guard now holds, in chain order."""
        while True:
            for event, guard, target in _CHAIN[req.state]:
                if guard(req):
                    self._moved(req, event, target, cause, rec, out)
                    break
            else:
                return

    def _moved(
        self,
        req: RequestRecord,
        event: str,
        target: str,
        cause: str,
        rec: GrantRecord | None,
        out: list[Transition],
    ) -> None:
        source = req.state
        if self.checked:
            self._mirror(req, event, target)
        req.state = target
        if target in _BOOKKEEPING:
            if target == _TRANSFER_QUIESCED:
                self._releasable[req.key] = None
            elif target == _QUARANTINED:
                req.quarantine_reason = next(
                    (p.suspect for p in req.open_proofs() if p.suspect is not None), "deadline"
                )
                req.quarantined_at = self._clock
            else:
                self._releasable.pop(req.key, None)
        # tuple.__new__ with every field: a NamedTuple's own constructor (a Python function that
        # fills in defaults) costs more than half again as much, once per transition.
        if rec is None:
            unsafe = event == "force_released"  # never the normal path: flagged in the log
            out.append(
                _new_tuple(Transition, (req.key, event, source, target, cause, None, None, unsafe))
            )
        else:
            out.append(
                _new_tuple(
                    Transition, (req.key, event, source, target, cause, rec.label, rec.peer, False)
                )
            )

    def _mirror(self, req: RequestRecord, event: str, target: str) -> None:
        m = req.machine
        assert m is not None
        try:
            m.send(event)
        except Exception as e:
            raise SpecDisagreement(
                f"request {show(req.key)}: tables fire {event!r} -> {target!r} from {req.state!r}, "
                f"the specification refuses: {e}"
            ) from e
        if m.current_state_value != target:
            raise SpecDisagreement(
                f"request {show(req.key)}: tables reach {target!r} on {event!r}, "
                f"the specification reaches {m.current_state_value!r}"
            )

    # =================================================================== queries

    def state(self, request: RequestKey) -> RequestState:
        """The request's state; ``UnknownRequest`` if it was never admitted or was released
        (a query is not a release: never ``DoubleRelease``)."""
        request = inputs.request_key(request)
        with self._lock:
            return RequestState(self._get(request).state)

    def live_requests(self) -> list[RequestKey]:
        with self._lock:
            return list(self._requests)

    def blocks_of(self, request: RequestKey) -> BlockIds:
        """Every block the request holds (exclusive first, then shared)."""
        request = inputs.request_key(request)
        with self._lock:
            return self._get(request).all_blocks()

    def grants_of(self, request: RequestKey) -> list[Grant]:
        request = inputs.request_key(request)
        with self._lock:
            return [r.grant for r in self._get(request).grants.values()]

    def open_grants(self, request: RequestKey) -> list[Grant]:
        request = inputs.request_key(request)
        with self._lock:
            return [r.grant for r in self._get(request).open.values()]

    def proof_of(self, grant: Grant | GrantId) -> GrantProof:
        """A copy of what has been proven about a live grant."""
        gid = grant.id if isinstance(grant, Grant) else grant
        inputs.instance(gid, GrantId, "grant")
        with self._lock:
            rec = self._grants.get(gid.serial) if gid.incarnation == self.incarnation else None
            if rec is None:
                raise errors.UnknownGrant(f"no live grant {gid}")
            return rec.copy()

    def unproven(self, request: RequestKey) -> dict[str, list[str]]:
        request = inputs.request_key(request)
        with self._lock:
            return self._unproven(self._get(request))

    def generation(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint32]:
        arr = self._ids(ids)
        with self._lock:
            return self._generation.take(arr)

    def holders(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        arr = self._ids(ids)
        with self._lock:
            if self._engine:
                return self._sharers.take(arr).astype(np.int64)
            return (self._owner.take(arr) >= 0).astype(np.int64) + self._sharers.take(arr)

    OPEN_NONE = 0
    """``open_access``: no open grant covers the block."""
    OPEN_READ = 1
    """``open_access``: open grants cover the block, read grants only."""
    OPEN_WRITE = 2
    """``open_access``: an open write grant covers the block."""

    def open_access(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """Per block of ``ids``: ``OPEN_NONE`` (0) no open grant covers it, ``OPEN_READ`` (1)
        only read grants, ``OPEN_WRITE`` (2) an open write grant (of any request, running or
        ended). An engine calls it on blocks it is about to hand out, to detect the reuse of an
        exposed block. O(len(ids)): read from the per-block grant counters (built from the open
        grants at the first call, or the first shared acquire, then kept up to date)."""
        arr = self._ids(ids)
        with self._lock:
            if not self._tracking:
                self._start_tracking()
            out: npt.NDArray[np.uint8] = (self._readers.take(arr) != 0).astype(np.uint8)
            out[self._unsettled.take(arr) != 0] = self.OPEN_WRITE
            return out

    def free_count(self) -> int:
        """Blocks no request holds (with ``counts="engine"``: that the ledger does not guard)."""
        with self._lock:
            return self._count_free()

    def block_state(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """``BlockState`` codes of ``ids``, derived from holders and open grants. A block no
        request holds is ``FREE`` (with ``counts="engine"``: not guarded, the engine may do
        with it what it likes)."""
        arr = self._ids(ids)
        with self._lock:
            return self._derive_block_states().take(arr)

    def _derive_block_states(self) -> npt.NDArray[np.uint8]:
        n = self.num_blocks
        live = np.zeros(n, dtype=np.int32)
        opened = np.zeros(n, dtype=np.int32)
        quarantined = np.zeros(n, dtype=bool)
        for req in self._requests.values():
            if req.state == _ADMITTED:
                for a in req.excl + req.shared:
                    live[a] += 1
            for rec in req.open.values():
                opened[rec.grant.blocks] += 1
                if req.state == _QUARANTINED:
                    quarantined[rec.grant.blocks] = True
        held = self._sharers > 0
        if not self._engine:
            held |= self._owner != FREE
        out = np.full(n, BlockState.QUIESCED, dtype=np.uint8)
        out[~held] = BlockState.FREE
        out[held & (live > 0) & (opened == 0)] = BlockState.OWNED
        out[held & (live > 0) & (opened > 0)] = BlockState.EXPOSED
        ended_open = held & (live == 0) & (opened > 0)
        out[ended_open & ~quarantined] = BlockState.DRAINING
        out[ended_open & quarantined] = BlockState.QUARANTINED
        return out

    def stats(self, now: float | None = None) -> LedgerStats:
        now = inputs.optional_time(now, "now")
        with self._lock:
            states = self._derive_block_states()
            counts = np.bincount(states, minlength=len(BlockState))
            by_req: collections.Counter[str] = collections.Counter(
                r.state for r in self._requests.values()
            )
            quarantined = tuple(
                QuarantineInfo(
                    r.key,
                    r.nblocks(),
                    r.quarantine_reason or "deadline",
                    r.quarantined_at,
                    None if now is None or r.quarantined_at is None else now - r.quarantined_at,
                )
                for r in self._requests.values()
                if r.state == _QUARANTINED
            )
            return LedgerStats(
                num_blocks=self.num_blocks,
                blocks_by_state={s.label: int(counts[s]) for s in BlockState},
                requests_by_state={
                    s.value: by_req.get(s.value, 0) for s in RequestState if s.value != _RELEASED
                },
                quarantined=quarantined,
                unsafe_releases=self._unsafe_releases,
                refused_evidence=dict(self._refused),
                open_grants=sum(len(r.open) for r in self._requests.values()),
                reclaimed_blocks=dict(self._reclaimed),
            )

    # =================================================================== exploration support

    def copy(self) -> BlockLedger:
        """An independent deep copy (same incarnation): for exploration and what-if checks."""
        with self._lock:
            new = BlockLedger.__new__(BlockLedger)
            new.num_blocks = self.num_blocks
            new.checked = self.checked
            new.counts = self.counts
            new._engine = self._engine
            new.incarnation = self.incarnation
            new._lock = threading.Lock()
            new._owner = self._owner.copy()
            new._sharers = self._sharers.copy()
            new._unsettled = self._unsettled.copy()
            new._readers = self._readers.copy()
            new._open_writes = self._open_writes
            new._open_reads = self._open_reads
            new._tracking = self._tracking
            new._uncounted = None  # never set outside an apply_many (which holds the lock)
            new._generation = self._generation.copy()
            new._free_stack = None if self._free_stack is None else self._free_stack.copy()
            new._free_top = self._free_top
            new._next_slot = self._next_slot
            new._next_serial = self._next_serial
            new._requests = {}
            new._by_slot = {}
            new._grants = {}
            new._by_peer = {}
            for key, old in self._requests.items():
                req = RequestRecord(key, old.slot, old.deadline)
                req.state = old.state
                req.excl = list(old.excl)  # the arrays themselves are read-only
                req.shared = list(old.shared)
                req.quarantine_reason = old.quarantine_reason
                req.quarantined_at = old.quarantined_at
                req.fenced_by = old.fenced_by
                for serial, orec in old.grants.items():
                    rec = GrantRecord(orec.grant, req, orec.deadline)
                    rec.assign(orec)
                    rec.is_open = orec.is_open
                    rec.fence_only = orec.fence_only
                    req.grants[serial] = rec
                    new._grants[serial] = rec
                    if serial in old.open:
                        req.open[serial] = rec
                        new._by_peer.setdefault(rec.grant.peer, {})[serial] = rec
                if self.checked:
                    # The specification loads only for a checked ledger (an unchecked one
                    # never imports python-statemachine).
                    from kvlifetime.spec.lifecycles import RequestLifecycle

                    req.machine = RequestLifecycle(req, start_value=req.state)
                new._requests[key] = req
                new._by_slot[req.slot] = req
            new._releasable = dict(self._releasable)
            new._timed = dict(self._timed)
            new._shared_holds = self._shared_holds
            new._free_patterns = self._free_patterns
            new._marks = self._marks
            new._recently_released = collections.OrderedDict(self._recently_released)
            new._unsafe_releases = self._unsafe_releases
            new._refused = collections.Counter(self._refused)
            new._reclaimed = collections.Counter(self._reclaimed)
            new._clock = self._clock
            new._pending = []
            return new

    def fingerprint(self) -> tuple[Any, ...]:
        """The whole observable state as a hashable value (grant serials included)."""
        with self._lock:
            reqs = []
            for key, req in self._requests.items():
                reqs.append(
                    (
                        repr(key),
                        req.state,
                        tuple(tuple(a.tolist()) for a in req.excl),
                        tuple(tuple(a.tolist()) for a in req.shared),
                        req.deadline,
                        tuple(
                            (s, r.grant.peer, r.grant.access.value, r.deadline, r.key())
                            for s, r in sorted(req.grants.items())
                        ),
                    )
                )
            reqs.sort()
            return (
                self.counts,
                self._owner.tobytes(),
                self._sharers.tobytes(),
                self._generation.tobytes(),
                tuple(reqs),
                self._next_serial,
                self._unsafe_releases,
            )

    # =================================================================== internals

    def _admit(self, request: RequestKey, deadline: float | None) -> RequestRecord:
        if isinstance(request, bool) or not isinstance(request, str | int) or request == "":
            raise errors.InvalidField(f"request must be a non-empty str or an int: {show(request)}")
        if request in self._requests:
            raise DuplicateRequest(request)
        slot = self._next_slot
        self._next_slot = (slot + 1) & 0x7FFFFFFF
        req = RequestRecord(request, slot, None)
        if self.checked:
            from kvlifetime.spec.lifecycles import RequestLifecycle

            req.machine = RequestLifecycle(req)
        self._requests[request] = req
        self._by_slot[slot] = req
        self._recently_released.pop(request, None)
        if deadline is not None:
            self._set_deadline(req, deadline)
        if _enabled():
            self._pending.append(("info", "request_admitted", {"request": request}))
        return req

    def _set_deadline(self, req: RequestRecord, deadline: float | None) -> None:
        req.deadline = deadline
        if deadline is not None:
            self._timed[req.key] = None

    def _get(self, request: RequestKey, *, ending: bool = False) -> RequestRecord:
        """The live request; ``request`` was validated by the caller (hashable, exact type).

        ``ending``: the call ends or lets go of the request (reject, finish, release,
        force_release), so a recently released key is a ``DoubleRelease``; for every other call
        (queries, grant, set_deadline) it is simply unknown.
        """
        req = self._requests.get(request)
        if req is None:
            if ending and request in self._recently_released:
                raise DoubleRelease(f"request {show(request)} was already released")
            raise UnknownRequest(request)
        return req

    def _unproven(self, req: RequestRecord) -> dict[str, list[str]]:
        return {f"{r.grant.id} ({r.grant.peer})": r.unproven() for r in req.open.values()}

    def _ids(self, ids: npt.ArrayLike, *, unique: bool = True) -> BlockIds:
        """Validate a batch of block ids (``inputs.block_ids``); return a read-only private
        int64 copy.

        ``unique=False``: the caller detects repeated ids itself (exclusive acquire does it
        while it marks the blocks, cheaper than sorting).
        """
        return inputs.block_ids(ids, self.num_blocks, unique=unique)

    def _count_free(self) -> int:
        if self._engine:
            return int(np.count_nonzero(self._sharers == 0))
        return int(np.count_nonzero(self._owner == FREE))

    def _start_tracking(self) -> None:
        """Build ``_unsettled`` and ``_readers`` from the open grants (once: at the first shared
        acquire or ``open_access``) and keep them up to date from then on."""
        writes = np.zeros(self.num_blocks, dtype=np.int64)
        reads = np.zeros(self.num_blocks, dtype=np.int64)
        nw = nr = 0
        for req in self._requests.values():
            for rec in req.open.values():
                if rec.grant.access is Access.WRITE:
                    writes[rec.grant.blocks] += 1  # a grant's blocks are distinct
                    nw += 1
                else:
                    reads[rec.grant.blocks] += 1
                    nr += 1
        self._unsettled, self._open_writes = _narrowest(writes), nw
        self._readers, self._open_reads = _narrowest(reads), nr
        self._tracking = True

    def _count_open(self, arr: BlockIds, access: Access) -> None:
        """Count one more open grant of ``access`` on ``arr`` (distinct ids). Widens the counter
        first where a block could reach its dtype's limit; ``HolderLimit``, with nothing
        changed, only where a block already has 2**32-1 open grants of that access."""
        if access is Access.WRITE:
            self._unsettled = _counted(self._unsettled, arr, self._open_writes)
            self._open_writes += 1
        else:
            self._readers = _counted(self._readers, arr, self._open_reads)
            self._open_reads += 1

    def _uncount_open(self, rec: GrantRecord) -> None:
        if self._uncounted is not None:
            self._uncounted.append(rec)  # apply_many takes them all off at its end
            return
        if rec.grant.access is Access.WRITE:
            self._unsettled[rec.grant.blocks] -= 1
            self._open_writes -= 1
        else:
            self._readers[rec.grant.blocks] -= 1
            self._open_reads -= 1

    def _uncount_all(self, recs: Sequence[GrantRecord]) -> None:
        """``_uncount_open`` of every record, one write per access kind. A block in several of
        the grants was counted once per grant and is taken off as many times."""
        for access in Access:
            arrs = [r.grant.blocks for r in recs if r.grant.access is access]
            if not arrs:
                continue
            counts = self._unsettled if access is Access.WRITE else self._readers
            if len(arrs) == 1:
                counts[arrs[0]] -= 1  # a grant's blocks are distinct
            else:
                ids = np.sort(np.concatenate(arrs))
                if np.count_nonzero(ids[1:] == ids[:-1]):
                    # np.subtract.at would do, at ~100 ns an id here: 7 ms for 64k ids.
                    ids, times = np.unique(ids, return_counts=True)
                    counts[ids] -= times.astype(counts.dtype)
                else:
                    counts[ids] -= 1
            if access is Access.WRITE:
                self._open_writes -= len(arrs)
            else:
                self._open_reads -= len(arrs)

    def _free_pattern(self, n: int) -> bytes:
        p = self._free_patterns.get(n)
        if p is None:
            p = np.full(n, FREE, dtype=np.int32).tobytes()
            self._free_patterns[n] = p
        return p

    def _mark_free_unique(self, arr: BlockIds) -> None:
        """Refuse unless every block is free and no id repeats; on success the blocks carry
        distinct markers (not FREE) until the caller writes the owner or ``_unmark``s them."""
        owner = self._owner
        k = len(arr)
        if owner.take(arr).tobytes() != self._free_pattern(k):
            bad = arr[owner.take(arr) != FREE]
            raise BlockUnavailable(f"blocks not free: {bad[:16].tolist()}")
        # A distinct marker per position, read back: a repeated id keeps only its last marker.
        # Two scatters and a gather, no sort and no ufunc; the caller's owner write follows.
        marks = self._markers(k)
        owner[arr] = marks
        if owner.take(arr).tobytes() != marks.tobytes():
            owner[arr] = FREE
            raise DuplicateBlockIds(f"duplicate block ids in one batch: {arr.tolist()[:32]}")

    def _markers(self, k: int) -> npt.NDArray[np.int32]:
        m = self._marks
        if len(m) < k:
            m = self._marks = (ORPHANED - 1 - np.arange(max(k, 2 * len(m)))).astype(np.int32)
        return m[:k]

    def _build_free_stack(self) -> npt.NDArray[np.int32]:
        free = np.flatnonzero(self._owner == FREE).astype(np.int32)[::-1]
        stack = np.empty(self.num_blocks, dtype=np.int32)
        stack[: len(free)] = free
        self._free_stack = stack
        self._free_top = len(free)
        return stack

    def _held_view(self, req: RequestRecord, blocks: npt.ArrayLike) -> BlockIds:
        """``blocks`` as a read-only array, refused unless ``req`` holds every one of them."""
        if isinstance(blocks, np.ndarray):
            batches = req.shared if self._engine else req.excl  # where its holds are recorded
            for a in batches:
                if blocks is a:
                    return a
            # Same bytes as a held batch, and the same shape: a 2-d or 0-d array is refused below.
            raw = blocks.tobytes() if blocks.dtype == np.int64 and blocks.ndim == 1 else None
            if raw is not None:
                for a in batches:
                    if len(a) == len(blocks) and a.tobytes() == raw:
                        return a
        arr = self._ids(blocks)
        held = req.all_blocks()
        if not np.isin(arr, held, assume_unique=True).all():
            missing = arr[~np.isin(arr, held)]
            raise BlockUnavailable(
                f"request {show(req.key)} does not hold blocks {missing[:16].tolist()}"
            )
        return arr

    def _check_shareable(self, arr: BlockIds, req: RequestRecord | None) -> None:
        """Refuse a shared acquire of ``arr`` unless every block is held, settled and below the
        holder limit, and ``req`` holds none of them yet. O(len(arr)) whatever the number of
        live sharers: the per-block counters say it all (``_unsettled``, ``_sharers``)."""
        if not self._tracking:
            self._start_tracking()
        owner = self._owner.take(arr)
        sharers = self._sharers.take(arr)
        held = (owner >= 0) | (sharers > 0)
        if np.count_nonzero(held) != len(held):
            raise BlockUnavailable(
                f"shared acquire of blocks nobody holds: {arr[~held][:16].tolist()}"
            )
        if req is not None and (
            (owner == req.slot).any()
            or any(np.isin(arr, s, assume_unique=True).any() for s in req.shared)
        ):
            raise BlockUnavailable(f"request {show(req.key)} already holds some of these blocks")
        # Settled content only: no open write grant. Open read grants do not unsettle a block,
        # whether their request runs or has ended (draining, quarantined): a reader does not
        # change the content.
        unsettled = self._unsettled.take(arr)
        if np.count_nonzero(unsettled):
            raise BlockUnavailable(
                f"blocks {arr[unsettled > 0][:16].tolist()} are not settled: an open write "
                "grant may still change them: not shareable"
            )
        # A block has at most as many holders as there are live holds: below the limit, no
        # block needs looking at.
        if (
            self._shared_holds >= self.MAX_SHARERS
            and int(sharers.max(initial=0)) >= self.MAX_SHARERS
        ):
            raise HolderLimit(
                f"blocks {arr[sharers >= self.MAX_SHARERS][:16].tolist()} already have "
                f"{self.MAX_SHARERS} shared holders (the counter's limit): not shared again"
            )

    def _check_engine_hold(self, arr: BlockIds, req: RequestRecord | None) -> None:
        """Engine mode: refuse a hold on ``arr`` where an open write grant covers a block (its
        content is unsettled), where ``req`` already holds one, or at the holder limit. Open
        read grants do not matter, whoever holds the block and whatever its state."""
        writes = self._unsettled.take(arr)
        if np.count_nonzero(writes):
            raise BlockUnavailable(
                f"blocks {arr[writes > 0][:16].tolist()} are not settled: an open write grant "
                "may still change them: not held by another request"
            )
        holders = self._sharers.take(arr)
        # Only blocks someone holds can be held by req already: O(batch + its own holds).
        if (
            req is not None
            and req.shared
            and np.count_nonzero(holders)
            and np.isin(arr, req.all_blocks(), assume_unique=True).any()
        ):
            raise BlockUnavailable(f"request {show(req.key)} already holds some of these blocks")
        # A block has at most as many holders as there are live holds: below the limit, no
        # block needs looking at.
        if (
            self._shared_holds >= self.MAX_SHARERS
            and int(holders.max(initial=0)) >= self.MAX_SHARERS
        ):
            raise HolderLimit(
                f"blocks {arr[holders >= self.MAX_SHARERS][:16].tolist()} already have "
                f"{self.MAX_SHARERS} holders (the counter's limit): not held by one more"
            )

    def _check_engine_grant(self, req: RequestRecord, arr: BlockIds, access: Access) -> None:
        """Engine mode: a write grant only on blocks ``req`` alone holds and no open grant
        covers; a read grant not on blocks another request's open write grant covers."""
        writes = self._unsettled.take(arr)
        if access is Access.WRITE:
            others = self._sharers.take(arr) > 1  # req holds each block of arr
            if np.count_nonzero(others):
                raise BlockUnavailable(
                    f"a write grant on blocks another request holds: {arr[others][:16].tolist()}"
                )
            covered = (writes != 0) | (self._readers.take(arr) != 0)
            if np.count_nonzero(covered):
                raise BlockUnavailable(
                    f"a write grant on blocks an open grant covers: {arr[covered][:16].tolist()}"
                )
        elif np.count_nonzero(writes):
            # Rare: tell req's own open write grants from another request's.
            own = np.zeros(len(arr), dtype=np.int64)
            for rec in req.open.values():
                if rec.grant.access is Access.WRITE:
                    own += np.isin(arr, rec.grant.blocks, assume_unique=True)
            foreign = writes > own
            if foreign.any():
                raise BlockUnavailable(
                    f"a read grant on blocks another request's open write grant covers: "
                    f"{arr[foreign][:16].tolist()}"
                )


def _check_fence(rec: GrantRecord, ev: GrantEvidence | AccessRevoked) -> None:
    """A restart's quarantine grant stands for what a previous incarnation's peer may still do
    (``after_restart``): only a fence the memory owner's side completed (a local
    ``AccessRevoked``) ends it. Any claim about it - from the peer, whose new connection may
    have learnt the grant id, or from this process - is about that old access, which no word
    can prove over: refused as evidence about another incarnation."""
    if type(ev) is AccessRevoked and ev.source.kind is SourceKind.LOCAL:
        return
    raise MismatchedEvidence(
        f"{ev.kind} from {ev.source} is about grant {rec.label}, the quarantine of a previous "
        "incarnation's access to the arena: only a completed fence (a local AccessRevoked) "
        "ends it",
        evidence=ev,
    )


def _concat_ids(parts: Sequence[BlockIds | list[int]], num_blocks: int) -> BlockIds:
    """The ids of every request of an ``acquire_many``, as one read-only int64 array, refused
    (``BlockOutOfRange``) unless each is in ``[0, num_blocks)``. The parts are int64 arrays
    or lists of ints (``_batch_part``), so the concatenation converts nothing."""
    try:
        if len(parts) == 1:
            arr = np.array(parts[0], dtype=np.int64)
        else:
            arr = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    except OverflowError:
        raise errors.BlockOutOfRange("block ids out of range: beyond int64") from None
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        bad = arr[(arr < 0) | (arr >= num_blocks)]
        raise errors.BlockOutOfRange(
            f"block ids out of range [0, {num_blocks}): {bad[:16].tolist()}"
        )
    arr.flags.writeable = False
    return arr


# A request's holds from acquire_many are views into that step's array of every request's ids:
# past this many, they are merged into one array of its own, so that a long-lived request never
# keeps more than this many steps' arrays alive (memory bounded by the live holds, not by how
# long a request has run).
_STEP_VIEWS = 16


def _merge(batches: list[BlockIds]) -> int:
    """Replace ``batches`` by one read-only array of them all; return how many fewer there are."""
    merged = np.concatenate(batches)
    merged.flags.writeable = False
    fewer = len(batches) - 1
    batches[:] = [merged]
    return fewer


def _views(allids: BlockIds, starts: Sequence[int], lens: Sequence[int]) -> list[BlockIds]:
    """Each request's part of ``allids`` as a read-only view. When every request takes as many
    blocks (a decode step: one each), the rows of a reshape: numpy makes those views in one
    call, at half the cost of slicing each in Python."""
    k = len(lens)
    width = lens[0]
    if width and k * width == len(allids) and lens.count(width) == k:
        return list(allids.reshape(k, width))
    return [allids[a : a + n] for a, n in zip(starts, lens, strict=True)]


def _repeats(
    allids: BlockIds, lens: Sequence[int]
) -> tuple[int | None, BlockIds, BlockIds, npt.NDArray[np.int64]] | None:
    """Repeated ids in ``allids`` (the batches of ``lens`` requests, concatenated). ``None``
    when every id is distinct (the common case: one sort, one comparison). Otherwise
    ``(index of the first request that names an id twice, or None; the ids named by more than
    one request; that request's repeated ids; how many requests name each id)``."""
    if len(allids) < 2:
        return None
    order = np.argsort(allids, kind="stable")
    s = allids[order]
    eq = s[1:] == s[:-1]
    if not np.count_nonzero(eq):
        return None
    seg = np.repeat(np.arange(len(lens), dtype=np.int64), lens)[order]
    same_req = eq & (seg[1:] == seg[:-1])
    if np.count_nonzero(same_req):
        first = int(seg[1:][same_req].min())
        dups = np.unique(s[1:][same_req & (seg[1:] == first)])
        return first, _empty(), dups, np.empty(0, dtype=np.int64)
    ids, times = np.unique(s, return_counts=True)
    multi = times > 1
    return None, ids[multi], _empty(), times[multi].astype(np.int64)


def _pairs(holds: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """``acquire_many``'s mapping as ``(key, ids)`` pairs, from one walk of its items (a
    dict's own, with no code of the caller's run; any other mapping's ``items()``). A walk
    that raises or yields something that is not a pair is ``InvalidField``."""
    if type(holds) is dict:
        return list(holds.items())
    try:
        pairs = list(holds.items())
    except Exception as e:
        raise errors.InvalidField(
            f"holds could not be read: {type(holds).__name__}.items() raised {type(e).__name__}"
        ) from e
    for p in pairs:
        if type(p) is not tuple or len(p) != 2:
            raise errors.InvalidField(
                f"holds.items() must yield (request, block ids) pairs, got {show(p)}"
            )
    return pairs


def _batch(items: object, name: str, what: str) -> Sequence[Any]:
    """A batch call's items: a list or tuple (or another sequence that is not text or a
    mapping), else ``InvalidField`` with nothing changed."""
    t = type(items)
    if t is tuple:
        return items  # type: ignore[return-value]
    if isinstance(items, Sequence) and not issubclass(t, str | bytes | bytearray):
        # One walk (a list copied): the items applied are the items walked, whatever the
        # caller's sequence (or another thread) does meanwhile.
        return inputs.materialised(items, name)
    raise errors.InvalidField(f"{name} must be a sequence of {what}, got {t.__name__}")
