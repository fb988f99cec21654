"""What an initiator's worker does whichever way the bytes go (prefill writing, decode reading):
its jobs per grant, the final frames of each kept so that lost evidence can be sent again, the
faulty control link, and a handler that nothing a message holds can make raise.

Sans-IO, like the workers built on it (``prefill.PrefillWorker``, ``pull.ReaderWorker``): feed
it messages and ticks, it returns frames.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

import structlog

from kvlifetime.evidence import Evidence
from kvlifetime.grant import GrantId
from kvlifetime.harness.faults import FaultConfig, FaultyLink
from kvlifetime.harness.wire import EvidenceMsg, Message, Query, encode

log = structlog.get_logger("kvlifetime")

FINALS_KEPT = 8192  # concluded grants whose final messages can still be sent again


class _Assigned(Protocol):
    @property
    def request(self) -> int | str: ...


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

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["link_lost"] = self.link.lost
        out["link_duplicated"] = self.link.duplicated
        out["link_delayed"] = self.link.delayed
        out["link_garbage"] = self.link.garbage
        return out
