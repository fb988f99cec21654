"""SGLangGuard: the exposure guard behind SGLang 0.5.23's disaggregation release points, with no
SGLang import (``hooks.py`` calls it from SGLang's functions; tests drive it directly).

Where each concept lives:

- ``lifecycles.py``: a lifecycle (one use of a room, keyed ``"sglang:<room>#<n>"``), the ids
  SGLang passes (rooms, ranks, slots, generations), the table both sides share, and the steps
  every call ends with;
- ``decode.py``: the decode's lifecycle (``published``, ``armed``, ``acked``, ``transferred``,
  ``held``, ``prefill_lost``): WRITE grants per prefill rank;
- ``prefill.py``: the prefill's (``sending``, ``drained``, ``poisoned``, ``ended``): READ grants
  to the local transfer worker;
- here, ``DecodeGuard`` and ``PrefillGuard`` (each role a class of its own: the other role's
  calls are not there to misuse), and what both share: a free SGLang does outside its deferred
  path (``withheld``),
  the tick (``tick``: quarantine at the deadline), the verdict SGLang gets (``releasable``,
  ``take_released``, ``freed``), the fence (``revoke``) and introspection;
- ``stats.py`` (``SGLangGuardStats``) and ``events.py`` (structlog events under
  ``kvlifetime.sglang``).

``withheld``: SGLang frees a lifecycle the ledger has not released outside the deferred path (a
failure it does not defer): the guard keeps the pages, quarantined, and hands the lifecycle back
(``take_released``) once a proof or a fence releases it. ``releasable`` is the verdict the hooks
give SGLang: true only once the ledger released it. ``revoke(fence)`` once the deployment fenced
the peers (``AccessRevoked``, local); ``stats()`` (and ``metrics.SGLangGuardCollector`` for
Prometheus). Thread-safe: ACKs arrive on SGLang's decode thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, overload

from kvlifetime import inputs
from kvlifetime.errors import InvalidField, KVLifetimeError, UsageError
from kvlifetime.evidence import AccessRevoked
from kvlifetime.guard import Refusal
from kvlifetime.integrations.sglang.decode import DecodeCalls
from kvlifetime.integrations.sglang.errors import MalformedEngineValue
from kvlifetime.integrations.sglang.events import Events, emit
from kvlifetime.integrations.sglang.lifecycles import ROLES, Role, RoomLifecycles, room_id
from kvlifetime.integrations.sglang.prefill import LOCAL_ENGINE, PrefillCalls
from kvlifetime.integrations.sglang.stats import SGLangGuardStats, summarize

_MAX_FENCE = 128  # kvlifetime.evidence.AccessRevoked's limit on a fence's name

__all__ = [
    "LOCAL_ENGINE",
    "ROLES",
    "DecodeGuard",
    "PrefillGuard",
    "Role",
    "SGLangGuard",
    "SGLangGuardStats",
]


class SGLangGuard(RoomLifecycles):
    """One SGLang process's exposures: what both roles share (see the module docstring).
    ``SGLangGuard(role="decode", ...)`` makes a ``DecodeGuard``, ``role="prefill"`` a
    ``PrefillGuard``: each role is a class of its own, with only its own calls."""

    @overload
    def __new__(cls, *, role: Literal["decode"], **kwargs: Any) -> DecodeGuard: ...
    @overload
    def __new__(cls, *, role: Literal["prefill"], **kwargs: Any) -> PrefillGuard: ...
    @overload
    def __new__(cls, *, role: object, **kwargs: Any) -> SGLangGuard: ...
    def __new__(cls, *args: Any, role: object = None, **kwargs: Any) -> SGLangGuard:
        if cls is SGLangGuard:
            # A role that is neither is refused by ``__init__`` (``InvalidField``).
            cls = {"decode": DecodeGuard, "prefill": PrefillGuard}.get(str(role), cls)
        return object.__new__(cls)

    def withheld(self, key: str, *, now: float) -> bool | Refusal:
        """SGLang frees a lifecycle the ledger has not released, outside the deferred path
        (decode: a failure it does not defer). Returns True when the ledger released it at once
        (the proof was in: the hooks free it now). Otherwise the hooks keep the pages,
        quarantined now (nothing will prove it: SGLang armed no ACK for it), and
        ``take_released`` returns the key once a proof or a fence releases it."""
        events: Events = []
        try:
            now = inputs.finite_time(now, "now")
            with self._lock:
                life = self._life(key)
                if life.phase == "released":
                    return True
                life.withheld = True
                life.suspect = life.suspect or "freed_unproven"
                if life.phase == "live":
                    self._end_locked(life, now, "freed_unproven", events)
                else:
                    self.ledger.set_deadline(key, now)
                if life.phase == "released":
                    self._ready.pop(key, None)
                    return True
                # The expiry quarantines every held lifecycle past its deadline: each gets its
                # own cause (this one's suspect is freed_unproven, set above; others: deadline).
                self.ledger.expire(now)
                self._quarantined_now(events, "deadline")
                return False
        except KVLifetimeError as e:
            return self._refuse("withheld_refused", e, {"key": key})
        finally:
            emit(events)

    def engine_room(self, value: object, *, at: str) -> int | Refusal:
        """A ``bootstrap_room`` the hooks read from SGLang (``at``: where), as the plain int
        every other call takes. Every room a hook reads passes here first. Refused
        (``MalformedEngineValue``, counted ``malformed_room``, logged; nothing changed): any
        value that is not an int in ``[0, 2**64)`` (a bool, a float, a str, None, ...)."""
        try:
            return room_id(value)
        except InvalidField as e:
            err = MalformedEngineValue(f"bootstrap_room read at {at}: {e}")
            return self._refuse("malformed_room", err, {"at": at, "room": value})

    def tick(self, now: float) -> list[str]:
        """Once per scheduler tick (decode: ``resolve_deferred_releases``; prefill: the
        inflight poll): quarantine held lifecycles whose deadline passed unproven. Returns
        them."""
        try:
            now = inputs.finite_time(now, "now")
        except KVLifetimeError as e:
            self._refuse("tick_refused", e, {"now": now})
            raise
        events: Events = []
        with self._lock:
            if self._ledger is None or not self._held:
                return []
            self._ledger.expire(now)
            out = self._quarantined_now(events, "deadline")
        emit(events)
        return out

    def releasable(self, key: str) -> bool:
        """The verdict SGLang gets: the ledger released the lifecycle (its pages and slot may be
        freed). Unknown keys: False (and ``UnknownRequest`` is not raised: SGLang asks for
        every held entry, guarded or not, and the hooks pass unguarded ones through)."""
        with self._lock:
            life = self._lives.get(key)
            return life is not None and life.phase == "released"

    def room_shared_with(self, key: str) -> str | None:
        """Another unreleased use of ``key``'s room, if any: while there is one, neither an
        ABORT_ACK nor the prefill's outstanding count of the room is evidence for either use
        (``acked`` / ``drained`` refuse it). The hooks ask before they observe the count, so a
        poll does not refuse the same observation again and again."""
        with self._lock:
            life = self._lives.get(key)
            return None if life is None else self._shared_room(life)

    def tracks(self, key: object) -> bool:
        """Whether ``key`` is a lifecycle the guard holds (not yet freed by SGLang)."""
        with self._lock:
            return isinstance(key, str) and key in self._lives

    def room_of(self, key: object) -> int | None:
        """The room of a lifecycle the guard holds (as it was checked when it entered), or
        None."""
        with self._lock:
            life = self._lives.get(key) if isinstance(key, str) else None
            return None if life is None else life.room

    def freed(self, key: str) -> Refusal | None:
        """SGLang freed the lifecycle's pages (after ``releasable`` said so): forgotten. A key
        not released is refused (``UsageError``), a repeat is a duplicate (no-op)."""
        try:
            with self._lock:
                if self._repeat(key):
                    return None
                life = self._life(key)
                if life.phase != "released":
                    raise UsageError(f"{key} is {life.phase}: SGLang may not free it yet")
                self._forget(life)
                self._freed += 1
                return None
        except KVLifetimeError as e:
            return self._refuse("freed_refused", e, {"key": key})

    def take_released(self) -> list[str]:
        """Withheld / held lifecycles released since the last call, for the hooks to free
        (each returned once)."""
        with self._lock:
            out = list(self._ready)
            self._ready.clear()
            return out

    def ready(self) -> tuple[str, ...]:
        """What ``take_released`` would return, without taking it."""
        with self._lock:
            return tuple(self._ready)

    def revoke(
        self, fence: str, *, prefill: str | None = None, fenced: Iterable[str] | None = None
    ) -> list[str]:
        """The deployment fenced the peers (every one, or every rank of ``prefill``):
        ``AccessRevoked`` from the local side, then release what that proves. Returns the
        lifecycles released; SGLang frees them at its next tick.

        A fence ends the access of what was exposed when it ran, not of what SGLang exposed
        after it (a publish to the decode's new engine is a new grant). Without ``fenced`` every
        grant open *now* is revoked: call it right after the fence, on the thread that publishes
        (the scheduler's). Otherwise pass ``fenced=guard.lifecycles()`` taken before the fence:
        only the open grants of those lifecycles are revoked (a key already freed is skipped)."""
        events: Events = []
        try:
            fence = inputs.text(fence, "fence")
            if not fence or len(fence) > _MAX_FENCE:
                # AccessRevoked's own rule, checked before anything: with no peer to revoke, a
                # bad name would otherwise pass unseen.
                raise InvalidField(
                    f"fence must be a non-empty str of at most {_MAX_FENCE} chars, "
                    f"got {inputs._show(fence)}"
                )
            if prefill is not None:
                prefill = inputs.peer_id(prefill, "prefill")
            keys = None if fenced is None else _keys(fenced)
            with self._lock:
                led = self.ledger
                if keys is None:
                    peers = {
                        p
                        for life in self._lives.values()
                        if prefill is None or life.prefill == prefill
                        for p in life.peers.values()
                    }
                    for p in sorted(peers):
                        led.apply(AccessRevoked(p, fence=fence))
                else:
                    lives = [self._lives.get(k) for k in keys]
                    evs = [
                        AccessRevoked(g.peer, grant_id=g.id, request=g.request, fence=fence)
                        for life in lives
                        if life is not None
                        and life.phase != "released"  # its grants are forgotten: nothing open
                        and (prefill is None or life.prefill == prefill)
                        for g in led.open_grants(life.key)
                    ]
                    for ev in evs:
                        led.apply(ev)
                out = self._collect(events)
                events.append(("sglang_revoked", {"fence": fence, "released": out}))
                return out
        except KVLifetimeError as e:
            self._refuse("revoke_refused", e, {"fence": fence})
            raise
        finally:
            emit(events)

    def stats(self, now: float | None = None) -> SGLangGuardStats:
        with self._lock:
            led = self._ledger
            return summarize(
                self.role,
                None if led is None else led.stats(now),
                self._lives.values(),
                completed=self._completed,
                freed=self._freed,
                refused=self._refused,
                duplicates=self._duplicates,
            )

    def lifecycle(self, key: str) -> dict[str, Any]:
        """One lifecycle as plain data (tests, debugging): room, phase, reason, ranks, acked,
        generation, pages, slot."""
        with self._lock:
            life = self._life(key)
            return {
                "room": life.room,
                "phase": life.phase,
                "reason": life.reason,
                "suspect": life.suspect,
                "quarantine": life.quarantine,
                "ranks": sorted(life.grants),
                "acked": sorted(life.acked),
                "generation": life.generation,
                "pages": sorted(life.pages.tolist()),
                "slot": life.slot,
                "withheld": life.withheld,
            }

    def lifecycles(self) -> list[str]:
        """Every lifecycle the guard holds, oldest first."""
        with self._lock:
            return list(self._lives)


class DecodeGuard(DecodeCalls, SGLangGuard):
    """The decode's guard: WRITE grants per prefill rank (``decode.DecodeCalls``)."""


class PrefillGuard(PrefillCalls, SGLangGuard):
    """The prefill's guard: READ grants to the local transfer worker (``prefill.PrefillCalls``)."""


def _keys(value: object) -> list[str]:
    """Lifecycle keys given by the caller: read once, each a plain ``str``."""
    if isinstance(value, str | bytes):
        raise InvalidField(f"fenced must be a collection of lifecycle keys, got {value!r}")
    keys = inputs.materialised(value, "fenced")
    out = []
    for k in keys:
        if type(k) is not str:
            raise InvalidField(f"a lifecycle key is a str, got {inputs._show(k)}")
        out.append(k)
    return out
