"""The prefill side's lifecycle: the source pages the local transfer worker reads, from the
first chunk queued to the free SGLang may do once the room is drained.

- ``sending``: ``sender.send(kv_indices)`` queues a chunk: a READ grant over its pages (to the
  local transfer engine), on the prefill's ``StepLedger`` (the engine's counts: cached prefix
  pages are shared by requests; a chunk's grant is an integer handle, no object per chunk).
- ``drained``: the room's outstanding-chunk count is zero and no more will start (the hooks
  check SGLang's ``_staging_outstanding``, its poisoned rooms and the room's status):
  ``TransferCompleted`` of every grant, a local observation. ``KVPoll.Failed`` proves nothing.
- ``poisoned``: a send returned non-zero with its batch possibly still reading: ``LeaseExpired``
  (the send's own deadline passed), quarantined.
- ``abort_received`` / ``echo_token``: the token the decode's guard sent this rank with an
  ABORT (``tokens.py``), echoed in the rank's ABORT_ACK so the decode can tell it from an ACK in
  this rank's name sent by anyone else.
- ``ended``: SGLang frees the source pages (``release_kv_cache``): released now if drained, else
  held until ``drained`` (``SGLangGuard.take_released``), quarantined at ``drain_timeout``.
"""

from __future__ import annotations

from typing import Any, cast

import numpy.typing as npt

from kvlifetime import inputs
from kvlifetime.errors import (
    InvalidField,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UsageError,
)
from kvlifetime.evidence import LeaseExpired, TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.guard import Refusal
from kvlifetime.integrations.sglang.events import Events, emit, listening
from kvlifetime.integrations.sglang.lifecycles import Lifecycle, RoomLifecycles, room_id, small_int
from kvlifetime.integrations.sglang.tokens import TOKEN_CHARS, wire_token
from kvlifetime.ledger import StepLedger

LOCAL_ENGINE = "sglang-local-transfer-engine"
"""The prefill's peer: its own Mooncake transfer worker reading the source pages."""


class PrefillCalls(RoomLifecycles):
    """The prefill's calls (``SGLangGuard`` has them; a decode guard refuses them)."""

    @property
    def rows(self) -> StepLedger:
        """The prefill's ledger: a ``StepLedger`` (``bind``)."""
        return cast(StepLedger, self.ledger)

    def sending(self, key: str | None, room: int, pages: npt.ArrayLike) -> str | Refusal:
        """``sender.send``: a READ grant over the chunk's source pages to the local transfer
        engine. ``key`` is the lifecycle of earlier chunks of the same sender (None for the
        first). Returns the lifecycle key."""
        events: Events = []
        try:
            room = room_id(room)
            with self._lock:
                led = self.rows
                if key is None:
                    new = self._new_key(room)
                    try:
                        g = led.acquire_and_grant(new, pages, LOCAL_ENGINE, Access.READ)
                    except KVLifetimeError:
                        self._next -= 1
                        raise
                    blocks = led.blocks_under(g)
                    life = Lifecycle(new, room, "", {0: g}, {0: LOCAL_ENGINE}, blocks, None)
                    self._add(life)
                    if listening():
                        events.append(("sglang_sending", {"key": new, "pages": len(life.pages)}))
                    return new
                life = self._life(key)
                if life.room != room:
                    raise InvalidField(f"{key} is of room {life.room}, not {room}")
                if life.phase != "live":
                    raise UsageError(f"{key}: a chunk sent after SGLang ended it ({life.phase})")
                g = led.grant_read(key, pages, LOCAL_ENGINE)
                if life.hold.read is None:
                    life.hold.read, life.hold.read_step = g, self._holds.step - 1
                self._fire(life, "read_granted")
                life.grants[len(life.grants)] = g
                life.peers[len(life.peers)] = LOCAL_ENGINE
                life.pages = led.blocks_of(key)  # the earlier chunks' pages, then this one's new
                return key
        except KVLifetimeError as e:
            return self._refuse("sending_refused", e, {"key": key, "room": room})
        finally:
            emit(events)

    def drained(self, key: str) -> bool | Refusal:
        """The room's outstanding-chunk count is zero and no chunk of it will start (checked by
        the hooks in SGLang's manager): ``TransferCompleted`` of every READ grant, observed
        locally. Returns True when it released the lifecycle (it was ended)."""
        events: Events = []
        try:
            with self._lock:
                if self._repeat(key):
                    return False
                life = self._life(key)
                if life.phase == "released":
                    self._duplicates += 1
                    return False
                open_ = [g for i, g in life.grants.items() if i not in life.acked]
                if not open_:
                    self._duplicates += 1
                    return False
                other = self._shared_room(life)
                if other is not None:
                    raise MismatchedEvidence(
                        f"drained for {key}: {other} uses room {life.room} too and is not "
                        "released; SGLang's per-room outstanding count cannot tell their chunks "
                        "apart"
                    )
                self.rows.prove(open_, TransferCompleted)
                life.acked.update(life.grants)
                self._fire(life, "reads_done")  # observed locally: every chunk's reads ended
                if life.phase == "live":
                    life.hold.read = None  # (the ledger keeps the closed grants until the end)
                return key in self._collect(events)
        except KVLifetimeError as e:
            return self._refuse("drained_refused", e, {"key": key})
        finally:
            emit(events)

    def poisoned(self, key: str) -> Refusal | None:
        """A send of the room returned non-zero while its batch may still read the pages
        (SGLang's ``_poison_unsettled_send``): ``LeaseExpired`` of every open grant (the send's
        own deadline passed). Quarantined once SGLang ends the lifecycle."""
        events: Events = []
        try:
            with self._lock:
                life = self._life(key)
                open_ = [g for i, g in life.grants.items() if i not in life.acked]
                if open_ and life.phase == "released":
                    # The ledger released it (a fence): its grants are gone, their handles
                    # someone else's now.
                    raise StaleEvidence(f"poisoned for {key}: the ledger already released it")
                if open_:
                    self.rows.prove(open_, LeaseExpired)
                life.suspect = "poisoned"
                self._quarantined_now(events, "poisoned")
                return None
        except KVLifetimeError as e:
            return self._refuse("poisoned_refused", e, {"key": key})
        finally:
            emit(events)

    def abort_received(
        self, room: int, ip: str, port: int, generation: int, *, token: object
    ) -> bool | Refusal:
        """An ABORT for ``room`` carried ``token`` (the decode's guard sent it to this rank
        only); its ACK, to ``ip``:``port`` under ``generation``, will echo it. Returns True
        when it was recorded. Refused (``InvalidField``, counted ``abort_token_refused``,
        nothing recorded): a value that is not what an ABORT carries."""
        ctx: dict[str, Any] = {"room": room, "port": port, "generation": generation}
        try:
            room = room_id(room)
            ip = inputs.text(ip, "ip")
            port = small_int(port, "port")
            generation = small_int(generation, "generation")
            got = wire_token(token)
            if got is None:
                raise InvalidField(
                    f"an ABORT's token is {TOKEN_CHARS} lowercase hex characters, got "
                    f"a {type(token).__name__}"
                )
            with self._lock:
                self._echo.put((room, ip, port, generation), got)
                return True
        except KVLifetimeError as e:
            return self._refuse("abort_token_refused", e, ctx)

    def echo_token(self, room: int, ip: str, port: int, generation: int) -> str | None:
        """The token to echo in the ABORT_ACK of ``room`` to ``ip``:``port`` under
        ``generation`` (None: its ABORT carried none, e.g. an unguarded decode)."""
        with self._lock:
            return self._echo.get((room, ip, port, generation))

    def ended(self, key: str, *, now: float, reason: str = "released") -> bool | Refusal:
        """SGLang frees the source pages (``release_kv_cache``). Returns True when the ledger
        released the lifecycle now (drained); otherwise the hooks hold the free until
        ``take_released`` returns the key (quarantined ``drain_timeout`` after ``now``)."""
        try:
            now = inputs.finite_time(now, "now")
        except KVLifetimeError as e:
            return self._refuse("end_refused", e, {"key": key})
        return self._end(key, now + self.drain_timeout, reason)
