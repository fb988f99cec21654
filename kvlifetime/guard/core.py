"""GuardCore: the one guard under every engine — exposures, the step's journal, proofs, fences.

Sans-IO and role-agnostic: an integration translates its engine's hooks into these calls and
this core's answers back into what the engine sees. Each request is a ``Hold`` stepped only by
the engine-side table (``Holds.fire``); the ledger (``StepLedger``: the step-columnar ledger, by
the engine's own reference counts, which stay in charge of its pool) says what is proven. Its
work is a few batch calls per step over grant handles: no grant, evidence or transition object
is made per request. A scheduler step::

    begin_step()           fences recorded since (any thread) take effect, on earlier steps'
                           grants only
    grant_loads(...)       WRITE grants of the step's loads, one batch; a refused one never
                           reaches the worker
    end(r, ids, ...)       the engine ended r; a READ exposure goes into the journal (no ledger
                           work per request)
    reports.load_landed / reads_done / load_failed / lease_expired, settle()   evidence in
    take_released(), take_fenced()   ids out, each once
    end_step()             the journal into the ledger (READ grants, then the ends, in
                           batches; the refused reads' ids must not leave the process); the
                           step's exposures leave with its output, and only from now on can a
                           report or a fence be about them

A signal that proves nothing comes back as a ``Refusal`` (counted, logged once on the one path,
never raised); an exception only for a caller's misuse, and only a typed kvlifetime error.

Threading: every call but ``fence`` belongs to the engine's scheduler thread. ``fence`` may come
from any thread: it is recorded with the step in progress and takes effect at the next
``begin_step``, on the grants of steps that had ended when it was recorded (``AccessRevoked``
per grant), so a fence never releases blocks whose ids leave in the output of the step it
arrived in (or of a later one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import attrs
import numpy as np
import structlog

from kvlifetime import inputs
from kvlifetime.errors import InvalidField, KVLifetimeError, show
from kvlifetime.evidence import AccessRevoked
from kvlifetime.grant import Access
from kvlifetime.guard.fences import FenceLog, revocations
from kvlifetime.guard.hand_backs import HandBacks
from kvlifetime.guard.holds import Hold, Holds
from kvlifetime.guard.journal import StepJournal
from kvlifetime.guard.refusals import RefusalKind, Refusals
from kvlifetime.guard.reports import Reports
from kvlifetime.ledger import LedgerStats
from kvlifetime.ledger.step_ledger import StepLedger

_log = structlog.get_logger("kvlifetime.guard")

_WITHHELD = frozenset({"withheld", "quarantined"})


@attrs.frozen(slots=True)
class CoreCounts:
    """What the core did, beside the ledger's own ``LedgerStats``; each only grows."""

    handed_back: int  # ids handed to the engine after the ledger released them
    lease_reaped: int  # reaped leases turned into LeaseExpired on a READ grant
    load_failed: int  # failed loads turned into LeaseExpired on a WRITE grant
    fences: int  # fences applied


class GuardCore:
    """One engine's guard: the holds, the ledger, the step's journal and the fences."""

    def __init__(self, ledger: StepLedger, *, peer: str, engine: str) -> None:
        self.ledger = ledger
        self.peer = inputs.peer_id(peer)  # every grant's peer: checked once, here
        self.refusals = Refusals(engine)
        self.holds: Holds[int] = Holds(self.refusals)
        self.journal = StepJournal(ledger, peer, self.holds, self.refusals)
        self.fences = FenceLog()  # recorded from any thread, applied at ``begin_step``
        self.hand_backs = HandBacks(self.holds)  # what the engine is due, each once
        self._writes = 0  # holds with a WRITE grant (a step with none skips a check)
        self.reports = Reports(ledger, self.holds, self.refusals)  # the engine's reports in
        self._fences_applied = 0

    # ------------------------------------------------------------------ the step

    @property
    def step(self) -> int:
        """The scheduler step in progress: how many have ended (``end_step``)."""
        return self.holds.step

    def end_step(self) -> None:
        """The step's end, before its outputs leave the process: the journal into the ledger;
        the step's exposures leave with its output. From now on a report may be about them,
        and a fence recorded from now on covers them."""
        self.flush()
        self.holds.next_step()

    def begin_step(self) -> set[str]:
        """A scheduler step begins: fences recorded since take effect. Returns the ended
        requests they released and the live ones whose held receive they made due (handed
        to the engine by ``take_released`` / ``take_fenced``)."""
        out: set[str] = set()
        for name, step in self.fences.take().items():
            out |= self.apply_fence(name, step)
        return out

    def fence(self, name: str) -> None:
        """From any thread: the deployment fenced every peer (e.g. NIXL agents recreated).
        Recorded with the step in progress; takes effect at the next ``begin_step`` on the
        grants of steps that had ended by now. A name recorded twice keeps its latest step.
        A name that is not a short non-empty str is ``InvalidField`` (the caller's fault)."""
        step = self.holds.step
        name = self.fences.record(name, step)
        _log.info("guard_fence_recorded", engine=self.refusals.engine, fence=name, step=step)

    def hold(self, request: str) -> Hold[int]:
        """The request's hold; one at ``running`` for a request the engine holds that the guard
        was not told of (the engine's table is the truth). A request id that is not a ``str``
        is ``InvalidField`` (the caller's fault), before anything changes."""
        hold = self.holds.get(request)
        if hold is not None:
            return hold
        if type(request) is not str:
            raise InvalidField(f"a request id is a str, got {show(request)}")
        return self.holds.admit(request)

    # ------------------------------------------------------------------ exposures

    def grant_loads(self, loads: Sequence[tuple[str, Sequence[int]]]) -> set[str]:
        """A step's asynchronous loads: a WRITE grant each, in one ledger call, each granted or
        refused on its own. Returns the refused requests (their load must not reach the
        worker; the ledger changed nothing for them)."""
        self.flush()
        due: list[tuple[str, Sequence[int]]] = []
        refused: set[str] = set()
        for request, _ in loads:
            if type(request) is not str:
                raise InvalidField(f"a request id is a str, got {show(request)}")
        for request, ids in loads:
            self.hold(request)
            if not len(ids):
                continue
            if not self.holds.allows(request, "load_granted"):
                refused.add(request)
                self.holds.fire(request, "load_granted")  # the refusal, counted
                continue
            due.append((request, ids))
        for (request, _), grant in zip(
            due, self.journal.grant_many(due, Access.WRITE), strict=True
        ):
            if isinstance(grant, KVLifetimeError):
                self.refusals.refuse(RefusalKind.EXPOSED_BLOCK_REUSED, request, grant)
                self.holds.fire(request, "grant_refused")
                refused.add(request)
                continue
            hold = self.hold(request)
            self._writes += hold.write is None
            hold.write, hold.write_failed, hold.write_step = grant, False, self.holds.step
            self.holds.fire(request, "load_granted")
        return refused

    def end(self, request: str, block_ids: Sequence[int], *, aborted: bool) -> str:
        """The engine ended ``request``; ``block_ids`` go to a remote reader with this step's
        output (empty: none). Returns the hold's state after: ``withheld`` / ``quarantined``
        (the engine keeps the blocks until the id comes back), ``ended`` (nothing exposed: the
        engine's own business), or ``handed_back`` (the engine frees them now)."""
        hold = self.hold(request)
        if hold.write is not None:
            return self._end_loading(request, hold, block_ids, aborted)
        refusal = self.holds.fire(request, "aborted" if aborted else "finished", hold)
        if refusal is not None:
            return self.holds.state(request) or "handed_back"
        if len(block_ids):
            # A fenced receive not handed back yet: the READ exposure supersedes it (the id
            # goes back once, when the reads are proven; one channel per id).
            self.hand_backs.drop_fenced(request)
            self.journal.append(request, block_ids, aborted)
            return "withheld"
        return "ended"

    @property
    def journaled_count(self) -> int:
        """How many READ exposures are in the step's journal (not flushed yet)."""
        return len(self.journal)

    def flush(self) -> None:
        """The step's journal into the ledger (``StepJournal.flush``)."""
        self.journal.flush()

    def take_refused_reads(self) -> list[str]:
        """The requests whose READ grant ``flush`` refused since the last call (each once):
        their block ids must not leave the process."""
        return self.journal.take_refused()

    # ------------------------------------------------------------------ evidence

    def settle(self) -> None:
        """After a batch of the engine's reports (``reports``): their proofs into the ledger,
        then what the ledger released."""
        if self.reports.settle():
            self.collect()

    # ------------------------------------------------------------------ releases

    def collect(self) -> set[str]:
        """What the ledger released: the exposures end; an ended hold becomes ``releasable``
        (its id is due to the engine, ``take_released``). Proofs queued by reports and not
        settled yet are applied first: their grant handles name live grants only until the
        ledger releases their request (a handle is reused after that)."""
        self.reports.settle()
        out: set[str] = set()
        for key in self.ledger.collect():
            request = cast(str, key)  # the guard's own request ids, as they entered
            hold = self.holds.get(request)
            if hold is None:
                continue
            self._writes -= hold.write is not None
            hold.read = hold.write = None
            hold.read_reaped = hold.write_failed = False
            if hold.state in _WITHHELD and self.holds.fire(request, "released", hold) is None:
                self.hand_backs.released(request)
                out.add(request)
        return out

    def take_released(self) -> set[str]:
        """The ended requests the ledger released and the engine has not been handed yet (each
        once): the engine frees them now."""
        return self.hand_backs.take_released()

    def take_fenced(self) -> set[str]:
        """The live requests whose failed load a fence ended: their held receive, for the
        engine to go on as its failure policy says (each once)."""
        return self.hand_backs.take_fenced()

    def fenced_due(self, request: str) -> bool:
        """Whether the request's held receive is due to the engine (a fence ended its load)."""
        return self.hand_backs.is_fenced(request)

    def engine_freed(self, request: str) -> None:
        """The engine frees a request the guard holds nothing exposed of, on its own id (or at
        once): the hold is forgotten, not remembered as handed back by the guard."""
        self.holds.fire(request, "handed_back")

    def apply_fence(self, name: str, step: int) -> set[str]:
        """A fence, now (the engine's thread): ``AccessRevoked`` for every open grant made in a
        step before ``step``, in one ``prove``; ended holds become releasable, a held
        receive whose grant it closed becomes due. Returns the ended requests released and the
        live ones whose held receive became due."""
        self.flush()
        handles, requests = revocations(self.holds, step)
        if not handles:
            return set()
        self._fences_applied += 1
        for i in self.ledger.prove(handles, AccessRevoked, fence=name):
            self.refusals.refuse(RefusalKind.EVIDENCE_REFUSED, requests[i])
        released = self.collect()
        live: list[str] = []
        for request, hold in self.holds:
            # A held receive whose grant the fence closed: the failed load is over, its hold
            # ends as a landed load's does; the engine's counts keep the blocks until its
            # recovery frees them.
            if (
                hold.state == "receive_held"
                and (hold.write is None or not self.ledger.is_open(hold.write))
                and (hold.read is None or not self.ledger.is_open(hold.read))
                and self.holds.fire(request, "fenced") is None
            ):
                live.append(request)
                self.hand_backs.fenced(request)
        if live:
            for i, error in self.ledger.end_many(live, aborted=False):
                self.refusals.refuse(RefusalKind.FINISH_REFUSED, live[i], error)
            self.collect()
        _log.info(
            "guard_fence_applied",
            engine=self.refusals.engine,
            fence=name,
            step=step,
            grants=len(handles),
        )
        return released | set(live)

    # ------------------------------------------------------------------ reading

    @property
    def loads_tracked(self) -> int:
        """How many holds have a WRITE grant (0: no handed-out block can be under a load)."""
        return self._writes

    def counts(self) -> CoreCounts:
        return CoreCounts(
            self.hand_backs.handed_back,
            self.reports.lease_reaped,
            self.reports.load_failed_count,
            self._fences_applied,
        )

    def stats(self) -> LedgerStats:
        return self.ledger.stats()

    def open_writes(self, invalid: Iterable[int]) -> list[str]:
        """The holds whose open, unfailed WRITE grant covers a block of ``invalid`` (the
        engine's report of blocks a load failed to fill). A report that is not a batch of
        block ids is a refusal (``malformed_value``): it names no block."""
        if not self._writes:
            return []
        try:
            bad = inputs.block_ids(list(invalid), None, unique=False)
        except (KVLifetimeError, TypeError) as e:
            err = e if isinstance(e, KVLifetimeError) else InvalidField(str(e))
            self.refusals.refuse(RefusalKind.MALFORMED_VALUE, "-", err)
            return []
        if not len(bad):
            return []
        under = self.ledger.blocks_under
        return [
            r
            for r, h in self.holds
            if h.write is not None and not h.write_failed and np.isin(under(h.write), bad).any()
        ]

    # ------------------------------------------------------------------ internals

    def _end_loading(
        self, request: str, hold: Hold[int], block_ids: Sequence[int], aborted: bool
    ) -> str:
        """``end`` of a hold with a WRITE grant (ended while its load is in flight, or failed):
        done at once, after the journal (rare: an abort during a load)."""
        self.flush()
        if len(block_ids):
            self._expose_read(request, hold, block_ids)
        if self.holds.fire(request, "aborted" if aborted else "finished") is not None:
            return self.holds.state(request) or "handed_back"
        for _, error in self.ledger.end_many([request], aborted=aborted):
            self.refusals.refuse(RefusalKind.FINISH_REFUSED, request, error)
        self.collect()
        state = self.holds.state(request) or "handed_back"
        if state == "releasable" and not len(block_ids):
            # Released at once (its grant was closed already): the engine frees it now.
            self.hand_backs.handed_at_once(request)
            return "handed_back"
        return state

    def _expose_read(self, request: str, hold: Hold[int], ids: Sequence[int]) -> None:
        """A READ grant over ``ids`` for a request that holds blocks for its load already."""
        try:
            hold.read = self.ledger.grant_read(request, ids, self.peer)
            hold.read_step, hold.read_reaped = self.holds.step, False
        except KVLifetimeError as e:
            self.refusals.refuse(RefusalKind.EXPOSED_BLOCK_REUSED, request, e)
