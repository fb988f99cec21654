"""ConnectorGuard: vLLM's scheduler hooks translated onto the guard core, with no vLLM import.

vLLM keeps a finished request's blocks while its connector says so (``request_finished`` ->
``delay_free_blocks=True``) and frees them when the request id comes back in
``finished_sending`` / ``finished_recving``. This translator puts ``kvlifetime.guard.GuardCore``
on that path: a READ exposure when a remote reader has an ended request's block ids, a WRITE
exposure when an asynchronous load is about to land, and an id back to vLLM only once the
ledger has released the request. Each request is a ``Hold`` of the engine-side lifecycle
(docs/engine.md); what each vLLM signal proves is ``signals.PROFILE``; how one scheduler step
runs through the guard, and what leaves the process when, is drawn in docs/vllm.md.

What is vLLM's here and nowhere else: which ids vLLM holds and where (``holds`` / ``phase``,
bound by the connector from the scheduler's request table), the two channels of an output and
their ``Handback``, and the ``GuardStats`` figures vLLM users read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence, Set

import attrs
import numpy as np

from kvlifetime import inputs
from kvlifetime.errors import InvalidField, KVLifetimeError
from kvlifetime.grant import Grant
from kvlifetime.guard import GuardCore, Refusal, RefusalKind
from kvlifetime.integrations.vllm.pause import DelayedFree, delayed_frees
from kvlifetime.ledger import LedgerStats
from kvlifetime.ledger.step_ledger import StepLedger

# The (hold state, signal) pairs that are vLLM's own business (nothing exposed): the id passes
# when vLLM would accept it. Any other is the guard's to decide, through its table (a repeated
# receive of a landed load is a duplicate whatever vLLM's phase).
_ENGINE_DECIDES = frozenset(
    {
        ("running", "load_landed"),
        ("running", "reads_done"),
        ("ended", "load_landed"),
        ("ended", "reads_done"),
        ("load_received", "reads_done"),
    }
)
_DELAYED = frozenset({"withheld", "quarantined", "releasable"})


@attrs.frozen(slots=True)
class RequestView:
    """One request as the guard holds it (``ConnectorGuard.request``): introspection."""

    request: str
    state: str  # its state of the engine-side lifecycle (docs/engine.md)
    read: Grant | None  # the READ grant the ledger still tracks
    write: Grant | None  # the WRITE grant the ledger still tracks
    lease_reaped: bool
    load_failed: bool


@attrs.frozen(slots=True)
class GuardStats:
    """What the guard did, beside the ledger's own ``LedgerStats``."""

    ledger: LedgerStats
    exposed: int  # requests with an exposure the ledger still tracks (or in the journal)
    withheld: int  # ended requests vLLM keeps for the guard (waiting for proof, or quarantined)
    handed_back: int  # ids handed to vLLM after the ledger released them; only grows
    lease_reaped: int  # reaped send leases turned into LeaseExpired; only grows
    load_failed: int  # failed loads turned into LeaseExpired on the WRITE grant; only grows
    failed_loads_held: int  # live requests whose failed load's receive waits for a fence
    dropped: dict[str, int]  # refusals by kind (``RefusalKind``): ids kept from vLLM; only grow


@attrs.frozen(slots=True)
class Handback:
    """What vLLM's scheduler is shown for one connector output."""

    finished_sending: set[str]
    finished_recving: set[str]


class ConnectorGuard:
    """One vLLM scheduler's exposures (scheduler side of the connector), over ``GuardCore``.

    The step (docs/guard-core.md draws one). ``end_step`` ends one: the connector calls it from
    ``get_kv_connector_stats``, which vLLM 0.33 calls once at the end of every
    ``update_from_output``, after the step's ``request_finished`` calls and its
    ``update_connector_output``, before the step's outputs leave the scheduler. ``begin_step``
    is the boundary where fences take effect (``build_connector_meta``, every step). A grant is
    stamped with its step: a READ grant's block ids leave with that step's output, so a
    ``finished_sending`` in its own step is about an earlier request with the same id
    (``before_exposure``). One channel per id: in one output the receive is kept and the send
    refused (``both_channels``); later, vLLM no longer holds the id.

    Threading: vLLM calls every hook from its scheduler thread. ``revoke`` may be called from
    any thread: the fence is recorded with the step in progress and takes effect at the next
    ``begin_step``, on the grants of steps that had ended when it was recorded, so a fence
    never releases blocks whose ids leave the process in the output of the step it arrived in.
    ``stats`` from another thread reads a snapshot that may straddle a hook.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        peer: str = "vllm-kv-peer",
        incarnation: str | None = None,
        holds: Callable[[str], bool] | None = None,
        phase: Callable[[str], str | None] | None = None,
        failed_load_is_over: bool = False,
    ) -> None:
        self.ledger = StepLedger(num_blocks, incarnation=incarnation)
        self.peer = peer
        self.core = GuardCore(self.ledger, peer=peer, engine="vllm")
        # Whether vLLM still holds a request (its scheduler's own table, where the connector
        # found it); otherwise the guard's own view.
        self.holds: Callable[[str], bool] = (
            holds if holds is not None else self.core.holds.__contains__
        )
        # Where vLLM's scheduler has the request: None (not held), "finished",
        # "waiting_for_remote_kvs" or "running". vLLM frees blocks on an id only for a finished
        # request; a receive for a request waiting for remote KVs is how a load completes.
        self.phase: Callable[[str], str | None] | None = phase
        # The inner connector reports a failed load only once its own job is over (an
        # in-process connector, ``inner_connectors``): the load's receive then proves it ended.
        # Otherwise a failure proves nothing about what still lands (``LeaseExpired``).
        self.failed_load_is_over = inputs.flag(failed_load_is_over, "failed_load_is_over")

    # ------------------------------------------------------------------ scheduler hooks

    def admitted(self, request: str) -> None:
        """``on_new_request``: vLLM holds the request from now until it frees it."""
        self.core.hold(request)  # (a request id that is not a str: InvalidField)

    @property
    def step(self) -> int:
        """The scheduler step in progress: how many have ended (``end_step``)."""
        return self.core.step

    def end_step(self) -> None:
        """The step's end (``get_kv_connector_stats``): the journal into the ledger; the step's
        exposures leave the process with its output."""
        self.core.end_step()
        self._log()

    def begin_step(self) -> set[str]:
        """The step boundary (``build_connector_meta``): fences recorded since take effect.
        Returns the ended requests released and the live ones whose held failed load they
        ended (their ids go to vLLM through ``take_released`` / ``take_fenced_loads``)."""
        out = self.core.begin_step()
        self._log()
        return out

    def allocated(
        self, request: str, block_ids: Iterable[int], num_external_tokens: int, load_async: bool
    ) -> bool:
        """``update_state_after_alloc`` of one request: the blocks an asynchronous load will
        write get a WRITE grant. Returns False when the grant was refused."""
        if num_external_tokens <= 0 or not load_async:
            return True
        return not self.allocated_many([(request, list(block_ids))])

    def allocated_many(self, loads: Sequence[tuple[str, Sequence[int]]]) -> set[str]:
        """A step's asynchronous loads (``build_connector_meta``): a WRITE grant each, in one
        ledger call. Returns the refused requests: the connector keeps their load from the
        worker (vLLM takes it as a load that loaded nothing)."""
        refused = self.core.grant_loads(loads)
        self._log()
        return refused

    def handed_out(self, block_ids: Iterable[int]) -> None:
        """``build_connector_meta``: the blocks vLLM gave requests this step. One under an open
        WRITE grant (an asynchronous load may still land in it) is a reuse vLLM should never
        make while the guard holds the loading request back: counted and logged
        (``exposed_block_reused``); the guard cannot take it back."""
        if not self.core.loads_tracked:
            return
        self.core.flush()
        try:
            ids = inputs.block_ids(list(block_ids), self.ledger.num_blocks, unique=False)
            ids = np.unique(ids)  # a block shared by several of the step's requests: once
            hit = ids[self.ledger.open_access(ids) == 2]
        except (KVLifetimeError, TypeError) as e:
            err = e if isinstance(e, KVLifetimeError) else InvalidField(str(e))
            self.core.refusals.refuse(RefusalKind.HANDED_OUT_REFUSED, "-", err)
        else:
            for block in hit.tolist():
                self.core.refusals.refuse(
                    RefusalKind.EXPOSED_BLOCK_REUSED,
                    "-",
                    KVLifetimeError(f"block {block} handed out under an open WRITE grant"),
                )
        self._log()

    def finished(self, request: str, block_ids: Iterable[int], delay: bool, aborted: bool) -> bool:
        """``request_finished``: returns the ``delay_free_blocks`` vLLM should see.

        ``delay`` is the inner connector's answer (a remote reader has the block ids: a READ
        exposure, journaled until the step's end). A request with an exposure still unproven
        is delayed whatever the inner said."""
        core = self.core
        state = core.end(request, list(block_ids) if delay else [], aborted=aborted)
        self._log()
        if state in _DELAYED:
            return True
        if state == "ended" and not delay and not core.fenced_due(request):
            core.engine_freed(request)  # vLLM frees it now
        return delay

    def flush(self) -> None:
        """The step's journal into the ledger (``GuardCore.flush``); the connector calls it at
        the step's end (``get_kv_connector_stats``), before the step's outputs leave."""
        self.core.flush()
        self._log()

    def take_refused_reads(self) -> list[str]:
        """The requests whose READ grant the flush refused since the last call (each once):
        their block ids must not reach a remote reader."""
        return self.core.take_refused_reads()

    def output(
        self,
        finished_sending: Iterable[str] | None,
        finished_recving: Iterable[str] | None,
        *,
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        lease_reaped: Set[str] = frozenset(),
    ) -> Handback:
        """``update_connector_output``: apply what the output proves; return what vLLM sees.
        No id is handed back on both channels, in this output or a later one."""
        core = self.core
        core.flush()
        # Both failure channels are read (and bad values refused) whatever they prove.
        failed_ids, bad = inputs.str_ids(failed_recving, "failed_recving")
        if bad is not None:
            core.refusals.refuse(RefusalKind.MALFORMED_VALUE, "-", bad)
        failed = [*failed_ids, *core.open_writes(invalid_block_ids)]
        if not self.failed_load_is_over:
            for request in dict.fromkeys(failed):
                if request in core.holds:
                    core.reports.load_failed(request)
        for request in lease_reaped:
            core.reports.lease_expired(request)
        recving: set[str] = set()
        passed: set[str] = set()  # ids of vLLM's own business, passed on unchanged
        sends = (
            finished_sending if isinstance(finished_sending, set) else set(finished_sending or ())
        )
        recvs = (
            finished_recving if isinstance(finished_recving, set) else set(finished_recving or ())
        )
        # A send for a request whose load is exposed proves nothing about the load, even when
        # its receive (processed first) lands it in this very output.
        both = sends & recvs if sends and recvs else ()
        loading = {r for r in both if (h := core.holds.get(r)) is not None and h.write is not None}
        for request in recvs:
            if self._signal(request, "load_landed", recving):
                recving.add(request)
        for request in sends:
            if request in loading and request in recving:
                core.refusals.refuse(RefusalKind.WRONG_CHANNEL, request, event="reads_done")
            elif self._signal(request, "reads_done", recving):
                passed.add(request)
        core.settle()
        sending = core.take_released() | passed
        recving |= core.take_fenced()
        self._log()
        return Handback(sending, recving)

    def take_released(self) -> set[str]:
        """The ended requests the ledger released and vLLM has not been handed yet (each once).
        ``output`` returns them; the connector also takes them at every scheduler step, so a
        fence takes effect even when the model runner returns no connector output."""
        return self.core.take_released()

    def take_fenced_loads(self) -> set[str]:
        """The live requests whose failed load a fence ended: their withheld receive (each
        once), taken like ``take_released``."""
        return self.core.take_fenced()

    # ------------------------------------------------------------------ the way out

    def revoke(self, fence: str) -> None:
        """The deployment fenced every peer (e.g. NIXL agents recreated). From any thread:
        recorded with the step in progress, applied at the next ``begin_step`` to the grants
        of steps that had ended; the released requests go back to vLLM then
        (``take_released``, ``take_fenced_loads``). Local evidence only. A fence name that is
        not a short non-empty str is ``InvalidField``."""
        self.core.fence(fence)

    def stats(self) -> GuardStats:
        """The guard's counts (the ledger's as of the journal's last flush: the step's end). A
        request whose READ exposure is still in the journal counts as exposed."""
        core = self.core
        exposed = withheld = held = 0
        for _, hold in core.holds:
            state = hold.state
            withheld += state == "withheld" or state == "quarantined"
            exposed += hold.read is not None or hold.write is not None or state == "withheld"
            held += state == "receive_held"
        journaled = core.journaled_count
        counts = core.counts()
        return GuardStats(
            ledger=self.ledger.stats(),
            exposed=exposed + journaled,
            withheld=withheld + journaled,
            handed_back=counts.handed_back,
            lease_reaped=counts.lease_reaped,
            load_failed=counts.load_failed,
            failed_loads_held=held,
            dropped=dict(core.refusals.counts),
        )

    def delayed_frees(self) -> tuple[DelayedFree, ...]:
        """The requests vLLM still holds because the guard delays them, oldest first, each with
        what would end the wait (a pausing vLLM waits for exactly these: ``pause.py``)."""
        return delayed_frees(self.core.holds)

    @property
    def loads_tracked(self) -> int:
        """How many requests have a WRITE grant the ledger tracks."""
        return self.core.loads_tracked

    def request(self, request: str) -> RequestView | None:
        """The guard's hold of one request (None: it holds none)."""
        hold = self.core.holds.get(request)
        if hold is None:
            return None
        led = self.ledger
        return RequestView(
            request,
            hold.state,
            None if hold.read is None else led.grant(hold.read),
            None if hold.write is None else led.grant(hold.write),
            hold.read_reaped,
            hold.write_failed,
        )

    def requests(self) -> Iterator[RequestView]:
        """Every request the guard holds, oldest first."""
        for request, _ in self.core.holds:
            view = self.request(request)
            if view is not None:
                yield view

    # ------------------------------------------------------------------ internals

    def _signal(self, request: str, event: str, given: set[str]) -> bool:
        """One id of an output, on one channel: True when it goes to vLLM on that channel now.
        A hold the guard decides for steps its table (a proof reaches vLLM only through a
        release); an id of vLLM's own business passes when vLLM would accept it. An id given
        on the other channel of this output is a duplicate (vLLM frees on either)."""
        core = self.core
        receive = event == "load_landed"
        hold = core.holds.get(request)
        guard_decides = hold is not None and (hold.state, event) not in _ENGINE_DECIDES
        if not guard_decides and self._engine_refuses(request, event, receive=receive):
            return False
        if request in given:
            core.refusals.refuse(RefusalKind.BOTH_CHANNELS, request, event=event)
            return False
        if hold is None:
            return True  # a request vLLM holds that the guard never saw: vLLM's own
        before = hold.state
        fire = core.reports.load_landed if receive else core.reports.reads_done
        passed = fire(request) is None
        return passed and (not guard_decides or before == "loading")

    def _engine_refuses(self, request: str, event: str, *, receive: bool) -> Refusal | None:
        """The refusal of an id vLLM would assert on (None: vLLM accepts it): one it does not
        hold (a duplicate or unknown id), or one for a request it has not finished (a receive
        is accepted for a request waiting for remote KVs: how a load completes)."""
        refusals = self.core.refusals
        if self.core.holds.handed_back(request):
            return refusals.refuse(RefusalKind.DUPLICATE_ID, request, event=event)
        if not self.holds(request):
            return refusals.refuse(RefusalKind.UNKNOWN_ID, request, event=event)
        where = self.phase(request) if self.phase is not None else "finished"
        if where != "finished" and not (receive and where == "waiting_for_remote_kvs"):
            return refusals.refuse(RefusalKind.NOT_FINISHED, request, event=event)
        return None

    def _log(self) -> None:
        self.core.refusals.drain()
