"""What an initiator's worker does whichever way the bytes go (prefill writing, decode reading):
its jobs per grant, the final frames of each kept so that lost evidence can be sent again, the
faulty control link, and a handler that nothing a message holds can make raise.

Sans-IO, like the workers built on it (``push_initiator.PrefillWorker``,
``pull_initiator.ReaderWorker``): feed it messages and ticks, it returns frames.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

import structlog

from kvlifetime.evidence import Evidence
from kvlifetime.grant import GrantId
from kvlifetime.harness.faults import FaultConfig, FaultyLink
from kvlifetime.harness.wire import INT64_MAX, UINT32_MAX, EvidenceMsg, Message, Query, encode

log = structlog.get_logger("kvlifetime")

FINALS_KEPT = 8192  # concluded grants whose final messages can still be sent again


class _Assigned(Protocol):
    @property
    def request(self) -> int | str: ...


class _Grantlike(Protocol):
    """What an assignment of a grant to this initiator says (``Assign``, ``ReadAssign``)."""

    @property
    def grant(self) -> GrantId: ...
    @property
    def peer(self) -> str: ...
    @property
    def request(self) -> int | str: ...
    @property
    def blocks(self) -> tuple[int, ...]: ...
    @property
    def generations(self) -> tuple[int, ...]: ...
    @property
    def addresses(self) -> tuple[int, ...]: ...


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Job(Protocol):
    """One grant's work at the initiator."""

    @property
    def assign(self) -> _Assigned: ...
    @property
    def finals(self) -> list[bytes]: ...  # every control frame sent for it, in order


JobT = TypeVar("JobT", bound=Job)


class InitiatorWorker(Generic[JobT]):
    """The part of an initiator's worker both directions share."""

    def __init__(
        self,
        staging_bytes: int,
        *,
        peer: str,
        seed: int,
        faults: FaultConfig,
        block_bytes: int,
        arena: Mapping[str, Any],
        link_salt: int = 1,
    ) -> None:
        self.peer = peer
        self.seed = seed
        self.faults = faults
        self.block_bytes = block_bytes
        self._base = int(arena["base"])  # the owner's arena, as the engine addresses it
        self._nbytes = int(arena["nbytes"])
        # An address past the end of the arena: the engine refuses it, failing the batch.
        self._bad_address = self._base + self._nbytes + 16 * block_bytes
        self.link = FaultyLink(seed, link_salt, faults)
        self._jobs: dict[GrantId, JobT] = {}
        self._finals: collections.OrderedDict[GrantId, JobT] = collections.OrderedDict()
        nslots = staging_bytes // block_bytes
        self._free_slots = list(range(nslots - 1, -1, -1))
        self.counters: collections.Counter[str] = collections.Counter()
        self.now = 0

    # ----------------------------------------------------------------- messages

    def _unfit_grant(self, a: _Grantlike, arena: str, *, distinct: bool = False) -> str | None:
        """Why this worker cannot take the grant ``a`` assigns (None: it can), checked before
        anything changes: a refused assignment posts nothing, so nothing of it touches memory.
        ``arena`` names the owner's memory in the reason; ``distinct``: a block named twice is
        refused too."""
        if a.grant in self._jobs or a.grant in self._finals:
            return "grant already assigned"
        if a.peer != self.peer:
            return f"grant is to {a.peer!r}, this worker is {self.peer!r}"
        r = a.request
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= INT64_MAX:
            return f"request must be a request number in [0, {INT64_MAX}], got {r!r}"
        n = len(a.blocks)
        if n == 0 or len(a.generations) != n or len(a.addresses) != n:
            return "blocks, generations and addresses differ in length"
        bb, nblocks = self.block_bytes, self._nbytes // self.block_bytes
        if not all(is_int(b) and 0 <= b < nblocks for b in a.blocks):
            return f"a block id outside the {arena} {nblocks} blocks"
        if distinct and len(set(a.blocks)) != n:
            return "a block named twice"
        if not all(is_int(g) and 0 <= g <= UINT32_MAX for g in a.generations):
            return "a generation outside [0, 2**32)"
        for addr in a.addresses:
            off = addr - self._base if is_int(addr) else -1
            if off < 0 or off % bb or off + bb > self._nbytes:
                return f"address {addr!r} is not a block of the {arena} arena"
        return None

    def refuse(self, error: Exception, frame: bytes) -> None:
        """A frame that is not a message: logged and counted, and the worker goes on."""
        self.counters["malformed_refused"] += 1
        if structlog.is_configured():
            log.error("message_refused", worker=self.peer, error=str(error), size=len(frame))

    def handle(self, msg: Message) -> None:
        """Act on one message. Nothing a message holds makes this raise: each handler checks
        what it takes first (refused and counted); a failure none of them foresaw is logged
        and counted as ``handler_failed``, and the worker goes on with the next message."""
        try:
            if isinstance(msg, Query):
                self._query(msg)
            elif not self._dispatch(msg):
                self.counters["unexpected_refused"] += 1
                if structlog.is_configured():
                    log.error("message_refused", worker=self.peer, error=f"unexpected {msg.TYPE}")
        except Exception as e:  # a bug of ours, not the peer's: never the end of the worker
            self.counters["handler_failed"] += 1
            if structlog.is_configured():
                log.exception(
                    "handler_failed", worker=self.peer, message=type(msg).__name__, error=str(e)
                )

    def _dispatch(self, msg: Message) -> bool:
        """Handle a message of this direction; False: not one this worker takes."""
        raise NotImplementedError

    def _send(self, job: JobT | None, msg: Message) -> None:
        frame = encode(msg)
        if job is not None:
            job.finals.append(frame)
        self.link.offer(frame, self.now)

    def _send_evidence(self, job: JobT, evs: list[Evidence]) -> None:
        for ev in evs:
            self._send(job, EvidenceMsg(ev))

    def _known(self, grant: GrantId, request: int | str) -> JobT | None:
        job = self._jobs.get(grant) or self._finals.get(grant)
        if job is not None and job.assign.request != request:
            # Exact keys only: a grant naming another request is refused, never "close enough".
            self.counters["mismatched_refused"] += 1
            return None
        return job

    def _query(self, q: Query) -> None:
        job = self._known(q.grant, q.request)
        if job is not None and job.finals:
            # Evidence is idempotent: sending all of it again is always safe.
            self.counters["queries_answered"] += 1
            self._resend(job)

    def _resend(self, job: JobT) -> None:
        for frame in job.finals:
            self.link.offer(frame, self.now)

    def _concluded(self, grant: GrantId, job: JobT) -> None:
        """The grant's work is over: keep its final frames (bounded) for lost evidence."""
        self._jobs.pop(grant, None)
        self._finals[grant] = job
        while len(self._finals) > FINALS_KEPT:
            self._finals.popitem(last=False)

    def _advance_clock(self, n: int) -> bool:
        """Move to tick ``n``; False for a tick before the current one (time never goes back:
        it is counted and does nothing but its ``TickDone``). A non-int or one beyond int64,
        which the schema never lets through, raises ``ValueError``."""
        if is_int(n) and n < self.now:
            self.counters["stale_ticks_refused"] += 1
            return False
        if not is_int(n) or n > INT64_MAX:
            raise ValueError(f"tick must be an int in [0, {INT64_MAX}], got {n!r}")
        self.now = n
        return True

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["link_lost"] = self.link.lost
        out["link_duplicated"] = self.link.duplicated
        out["link_delayed"] = self.link.delayed
        out["link_garbage"] = self.link.garbage
        return out
