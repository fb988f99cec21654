"""SGLangGuard: the exposure guard behind SGLang 0.5.23's disaggregation release points, with no
SGLang import (``hooks.py`` calls it from SGLang's functions; tests drive it directly).

SGLang reports per *room* (the ``bootstrap_room`` integer a request carries) and, on the decode,
per prefill *rank* with an ABORT *generation*. Rooms are reused (a client or router may send the
same room again), so the guard keys every use of a room by a **lifecycle** of its own,
``"sglang:<room>#<n>"`` (``n`` counts the guard's lifecycles): a message about an earlier use of
the room can never count for a later one.

Decode (the pages prefill writes into):

- ``published``: ``_send_kv_metadata`` is about to send the page ids and the metadata slot to
  every prefill rank of ``kv_receiver.bootstrap_infos``: one WRITE grant per rank over the
  pages, opened *before* the addresses leave the process. The ledger keeps its own counts here
  (``counts="ledger"``): several ranks may write the same pages, and a page under an open grant
  is never free in the ledger, so a publish over it is refused and counted
  (``exposed_page_reused``).
- ``armed``: the ABORT generation SGLang's manager assigned to this lifecycle
  (``register_deferred_abort_room``); ``acked``: an ABORT_ACK ``(room, rank, generation)``. Only
  an ACK of the lifecycle's current generation, from one of its ranks, is evidence
  (``TransferCompleted`` of that rank's grant: no chunk of the room is inside ``send_kvcache`` on
  that rank and none will start, see ``signals.PROFILE``). An ACK of an earlier use of the room
  is refused (``StaleEvidence``), of a generation never armed or of another rank
  (``MismatchedEvidence``); each refusal is logged, counted, and changes nothing.
- ``transferred``: ``KVPoll.Success`` (every rank reported its transfer complete): every grant
  closed, the lifecycle over.
- ``held``: SGLang defers the release of a failed transfer (``_defer_release``): the lifecycle
  is rejected in the ledger with SGLang's own deadline. ``tick(now)`` quarantines it when the
  deadline passes unproven (SGLang alone would free it then: ``ready = drained or now >=
  deadline``); ``prefill_lost`` (heartbeat loss) quarantines every lifecycle of that prefill.
  ``releasable`` is the verdict the hooks give SGLang: true only once the ledger released it.
- ``withheld``: SGLang frees a lifecycle the ledger has not released outside the deferred path
  (a failure it does not defer): the guard keeps the pages, quarantined, and hands the lifecycle
  back (``take_released``) once a proof or a fence releases it.

Prefill (the source pages the local transfer worker reads):

- ``sending``: ``sender.send(kv_indices)`` queues a chunk: a READ grant over its pages (to the
  local transfer engine; ``counts="engine"``: cached prefix pages are shared by requests).
- ``drained``: the room's outstanding-chunk count is zero and no more will start (the hooks
  check SGLang's ``_staging_outstanding``, its poisoned rooms and the room's status):
  ``TransferCompleted`` of every grant, a local observation. ``KVPoll.Failed`` proves nothing.
- ``poisoned``: a send returned non-zero with its batch possibly still reading: ``LeaseExpired``
  (the send's own deadline passed), quarantined.
- ``ended``: SGLang frees the source pages (``release_kv_cache``): released now if drained, else
  held until ``drained`` (``take_released``), quarantined at ``drain_timeout``.

Both: ``revoke(fence)`` once the deployment fenced the peers (``AccessRevoked``, local);
``stats()`` (and ``LedgerCollector(guard.ledger)`` for Prometheus); structlog events under
``kvlifetime.sglang``. Thread-safe: ACKs arrive on SGLang's decode thread.

One module over 600 lines, on purpose: the decode's and the prefill's calls share one lifecycle
table, one lock and one ledger, and every call is its own validation, refusal and log; split,
the halves would share private state across modules.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from kvlifetime import inputs
from kvlifetime.errors import (
    BlockUnavailable,
    InvalidField,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnknownRequest,
    UsageError,
)
from kvlifetime.evidence import AccessRevoked, LeaseExpired, PeerLost, TransferCompleted
from kvlifetime.grant import Access, Grant
from kvlifetime.integrations.sglang.errors import GuardNotBound
from kvlifetime.ledger import BlockLedger, LedgerStats
from kvlifetime.machines import RequestState
from kvlifetime.source import Source

_log = structlog.get_logger("kvlifetime.sglang")

Role = Literal["decode", "prefill"]
ROLES: tuple[Role, ...] = ("decode", "prefill")
LOCAL_ENGINE = "sglang-local-transfer-engine"
"""The prefill's peer: its own Mooncake transfer worker reading the source pages."""

# How many ended lifecycles are remembered to tell a late or duplicate message from an unknown one.
_REMEMBERED = 65536
_MAX_ROOM = 2**64 - 1  # SGLang rooms are 64-bit integers
_MAX_SMALL = 2**31 - 1  # ranks, slots, generations: SGLang counts them in ints


@attrs.frozen(slots=True)
class SGLangGuardStats:
    """What the guard holds and did, beside the ledger's own ``LedgerStats``."""

    role: str
    ledger: LedgerStats | None  # None until bound
    live: int  # lifecycles with open grants whose request SGLang still runs
    held: int  # ended, SGLang keeps the pages for the guard (waiting for proof or quarantined)
    quarantined: int  # of ``held``: past the deadline, peer lost, poisoned: until a fence
    quarantined_pages: int
    quarantine_reasons: dict[str, int]  # reason -> quarantined lifecycles
    releasable: int  # released by the ledger, not yet freed by SGLang
    completed: int  # lifecycles whose transfer completed (Success); only grows
    freed: int  # ended lifecycles SGLang freed after the ledger released them; only grows
    refused: dict[str, int]  # kind -> messages or calls refused (typed, logged); only grow
    duplicates: int  # repeated messages, no-ops; only grows


@attrs.define(slots=True, eq=False)
class _Life:
    """One use of a room (a lifecycle): what was exposed, to whom, and how far it got."""

    key: str
    room: int
    prefill: str  # decode: the prefill's bootstrap address; prefill: ""
    grants: dict[int, Grant]  # decode: rank -> WRITE grant; prefill: chunk -> READ grant
    peers: dict[int, str]  # rank (or chunk) -> peer id
    pages: set[int]
    slot: int | None
    generation: int | None = None  # the ABORT generation armed for it (decode)
    acked: set[int] = attrs.field(factory=set)
    phase: str = "live"  # live -> held -> released -> (forgotten when SGLang frees it)
    reason: str = ""  # why SGLang ended it ("" while live)
    suspect: str = ""  # what made it suspect: peer_lost / poisoned / freed_unproven
    quarantine: str = ""  # why it is quarantined ("" when it is not)
    withheld: bool = False  # SGLang tried to free it unproven; the hooks free it on release


def _room(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidField(f"room must be an int, got {inputs._show(value)}")
    v = int(value)
    if not 0 <= v <= _MAX_ROOM:
        raise InvalidField(f"room must be in [0, 2**64), got {v}")
    return v


def _small(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidField(f"{name} must be an int, got {inputs._show(value)}")
    v = int(value)
    if not 0 <= v <= _MAX_SMALL:
        raise InvalidField(f"{name} must be in [0, 2**31), got {v}")
    return v


class SGLangGuard:
    """One SGLang process's exposures (decode or prefill). See the module docstring."""

    def __init__(
        self,
        *,
        role: Role,
        ledger_blocks: int | None = None,
        incarnation: str | None = None,
        drain_timeout: float = 30.0,
    ) -> None:
        self.role: Role = inputs.choice(role, "role", ROLES)  # type: ignore[assignment]
        if ledger_blocks is not None:
            ledger_blocks = inputs.count(ledger_blocks, "ledger_blocks", 1)
        if incarnation is not None:
            incarnation = inputs.peer_id(incarnation, "incarnation")
        self.drain_timeout = inputs.finite_time(drain_timeout, "drain_timeout")
        self._incarnation = incarnation
        self._ledger: BlockLedger | None = None
        self._lock = threading.Lock()
        self._lives: dict[str, _Life] = {}
        self._next = 0
        self._by_gen: dict[int, str] = {}  # armed generation -> live lifecycle
        self._max_gen = 0  # the last generation armed (SGLang's counter starts at 1)
        # Generations of lifecycles SGLang has freed (or superseded): generation -> room.
        self._old_gens: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._done: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> room
        self._slots: dict[int, str] = {}  # metadata slot -> lifecycle exposing it
        self._rooms: dict[int, dict[str, None]] = {}  # room -> its lifecycles the guard holds
        self._ready: dict[str, None] = {}  # withheld lifecycles released, for take_released
        self._held: dict[str, None] = {}  # lifecycles in phase "held" (a tick looks at these)
        self._freed = 0
        self._completed = 0
        self._duplicates = 0
        self._refused: collections.Counter[str] = collections.Counter()
        if ledger_blocks is not None:
            self.bind(ledger_blocks)

    # ------------------------------------------------------------------ set-up

    @property
    def ledger(self) -> BlockLedger:
        """The ledger (``GuardNotBound`` before ``bind``)."""
        led = self._ledger
        if led is None:
            raise GuardNotBound("the guard's ledger is not sized yet (bind(num_pages))")
        return led

    @property
    def bound(self) -> bool:
        return self._ledger is not None

    def bind(self, num_pages: int) -> None:
        """Size the ledger: page ids SGLang may publish or send are ``[0, num_pages)``. Once;
        a second ``bind`` with the same size is a no-op, another size ``InvalidField``."""
        n = inputs.count(num_pages, "num_pages", 1)
        with self._lock:
            if self._ledger is not None:
                if self._ledger.num_blocks != n:
                    raise InvalidField(
                        f"the guard is bound to {self._ledger.num_blocks} pages, not {n}"
                    )
                return
            counts: Literal["ledger", "engine"] = "ledger" if self.role == "decode" else "engine"
            self._ledger = BlockLedger(n, counts=counts, incarnation=self._incarnation)

    # ------------------------------------------------------------------ decode

    def published(
        self,
        room: int,
        pages: npt.ArrayLike,
        *,
        slot: int,
        ranks: Sequence[int],
        prefill: str,
    ) -> str:
        """``_send_kv_metadata``: a WRITE grant per prefill rank over ``pages`` (and the
        metadata ``slot``), before the addresses leave. Returns the lifecycle key."""
        self._decode_only("published")
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            room = _room(room)
            slot = _small(slot, "slot")
            prefill = inputs.peer_id(prefill, "prefill")
            rank_list = _ranks(ranks)
            with self._lock:
                led = self.ledger
                key = self._new_key(room)
                peers = {r: f"sglang-prefill:{prefill}:rank{r}" for r in rank_list}
                first = rank_list[0]
                try:
                    grants = {first: led.acquire_and_grant(key, pages, peers[first])}
                except KVLifetimeError as e:
                    self._next -= 1  # no lifecycle was made
                    # A page the guard still holds exposed (a quarantined lifecycle) would be
                    # published again: SGLang handed it out behind the guard's back.
                    kind = "exposed_page_reused" if isinstance(e, BlockUnavailable) else ""
                    raise _Refusal(kind or "published_refused") from e
                for r in rank_list[1:]:
                    grants[r] = led.grant(key, peers[r], grants[first].blocks, Access.WRITE)
                life = _Life(
                    key, room, prefill, grants, peers, set(grants[first].blocks.tolist()), slot
                )
                self._lives[key] = life
                self._rooms.setdefault(room, {})[key] = None
                other = self._slots.get(slot)
                if other is not None and other in self._lives:
                    # The slot of a lifecycle SGLang has not freed through the guard: a late
                    # aux write of the old owner may land in it. Detected, not prevented.
                    self._refused["exposed_slot_reused"] += 1
                    events.append(
                        ("sglang_exposed_slot_reused", {"slot": slot, "key": key, "held_by": other})
                    )
                self._slots[slot] = key
                events.append(
                    (
                        "sglang_published",
                        {"key": key, "room": room, "pages": len(life.pages), "ranks": rank_list},
                    )
                )
                return key
        except _Refusal as r:
            cause = r.__cause__
            assert isinstance(cause, KVLifetimeError)
            self._refuse(r.kind, cause, {"room": room})
            raise cause from None
        except KVLifetimeError as e:
            self._refuse("published_refused", e, {"room": room})
            raise
        finally:
            _emit(events)

    def armed(self, key: str, generation: int) -> None:
        """SGLang armed ABORT-ACK accounting for the lifecycle under ``generation`` (its
        manager's counter): only ACKs of this generation count from now on."""
        self._decode_only("armed")
        try:
            generation = _small(generation, "generation")
            with self._lock:
                life = self._life(key)
                if life.generation == generation:
                    self._duplicates += 1
                    return
                if generation <= self._max_gen:
                    raise MismatchedEvidence(
                        f"generation {generation} is not above {self._max_gen}, the last one "
                        "armed (SGLang's counter only grows)"
                    )
                if life.generation is not None:
                    # Re-armed: SGLang counts only the new generation; so does the guard.
                    del self._by_gen[life.generation]
                    self._remember_gen(life.generation, life.room)
                    life.acked.clear()
                life.generation = generation
                self._by_gen[generation] = key
                self._max_gen = generation
        except KVLifetimeError as e:
            self._refuse("armed_refused", e, {"key": key, "generation": generation})
            raise

    def acked(self, room: int, rank: int, generation: int) -> bool:
        """An ABORT_ACK from prefill rank ``rank`` for ``room`` under ``generation``. Returns
        True when it was new evidence, False for a repeat. Refused (typed, logged, counted,
        nothing changed): a generation of an earlier use of the room (``StaleEvidence``), one
        never armed, of another room or another rank (``MismatchedEvidence``)."""
        self._decode_only("acked")
        ctx: dict[str, Any] = {"room": room, "rank": rank, "generation": generation}
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            room = _room(room)
            rank = _small(rank, "rank")
            generation = _small(generation, "generation")
            with self._lock:
                key = self._by_gen.get(generation)
                if key is None:
                    old = self._old_gens.get(generation)
                    if old == room:
                        raise StaleEvidence(
                            f"ABORT_ACK of room {room} generation {generation}: an earlier use "
                            "of the room, already released (or superseded)"
                        )
                    if old is not None:
                        raise MismatchedEvidence(
                            f"ABORT_ACK names room {room}, generation {generation} was of "
                            f"room {old}"
                        )
                    raise MismatchedEvidence(
                        f"ABORT_ACK of room {room}: generation {generation} was never armed"
                    )
                life = self._lives[key]
                if life.room != room:
                    raise MismatchedEvidence(
                        f"ABORT_ACK names room {room}, generation {generation} is of room "
                        f"{life.room}"
                    )
                if rank not in life.grants:
                    raise MismatchedEvidence(
                        f"ABORT_ACK of room {room} from rank {rank}: not one of the prefill "
                        f"ranks its pages were published to ({sorted(life.grants)})"
                    )
                if rank in life.acked:
                    self._duplicates += 1
                    return False
                if life.phase == "released":
                    life.acked.add(rank)  # fenced before the ACK came: nothing left to prove
                    return True
                other = self._shared_room(life)
                if other is not None:
                    raise MismatchedEvidence(
                        f"ABORT_ACK of room {room} for {key}: {other} uses the room too and is "
                        "not released; the prefill's per-room count, which the ACK reports, "
                        "cannot tell their chunks apart"
                    )
                grant = life.grants[rank]
                ev = TransferCompleted.of(grant, 0)
                ev = attrs.evolve(ev, source=Source.peer(life.peers[rank]))
                self.ledger.apply(ev)
                life.acked.add(rank)
                events.append(("sglang_abort_acked", {"key": key, "rank": rank}))
                self._collect(events)
                return True
        except KVLifetimeError as e:
            self._refuse("ack_refused", e, ctx)
            raise
        finally:
            _emit(events)

    def transferred(self, key: str) -> None:
        """``KVPoll.Success``: every prefill rank reported its transfer of the room complete
        (decode's poll counts one Success per rank): every grant closed, the lifecycle over."""
        self._decode_only("transferred")
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            with self._lock:
                if self._repeat(key):
                    return
                life = self._life(key)
                if life.phase != "live":
                    raise UsageError(f"{key}: Success after SGLang ended it ({life.phase})")
                led = self.ledger
                led.apply_many(
                    [
                        attrs.evolve(TransferCompleted.of(g, 0), source=Source.peer(life.peers[r]))
                        for r, g in life.grants.items()
                    ]
                )
                led.finish(key)
                if key in self._collect(events):
                    self._forget(life)
                    self._completed += 1
        except KVLifetimeError as e:
            self._refuse("transferred_refused", e, {"key": key})
            raise
        finally:
            _emit(events)

    def held(self, key: str, *, deadline: float, reason: str = "transfer_failed") -> bool:
        """SGLang holds a failed transfer's pages (``_defer_release``) until ``deadline`` (its
        own clock). Returns True when the ledger released it at once (proof already in)."""
        self._decode_only("held")
        return self._end(key, deadline, reason)

    def prefill_lost(self, prefill: str) -> list[str]:
        """SGLang's heartbeat to ``prefill`` failed (``_handle_node_failure``): ``PeerLost``
        for every rank of it with an open grant. Returns the lifecycles quarantined now."""
        self._decode_only("prefill_lost")
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            prefill = inputs.peer_id(prefill, "prefill")
            with self._lock:
                hit = [
                    life
                    for life in self._lives.values()
                    if life.prefill == prefill and life.phase != "released"
                ]
                peers = {p for life in hit for r, p in life.peers.items() if r not in life.acked}
                led = self.ledger
                for p in sorted(peers):
                    led.apply(PeerLost(p))
                for life in hit:
                    life.suspect = life.suspect or "peer_lost"
                return self._quarantined_now(events, "peer_lost")
        except KVLifetimeError as e:
            self._refuse("prefill_lost_refused", e, {"prefill": prefill})
            raise
        finally:
            _emit(events)

    # ------------------------------------------------------------------ prefill

    def sending(self, key: str | None, room: int, pages: npt.ArrayLike) -> str:
        """``sender.send``: a READ grant over the chunk's source pages to the local transfer
        engine. ``key`` is the lifecycle of earlier chunks of the same sender (None for the
        first). Returns the lifecycle key."""
        self._prefill_only("sending")
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            room = _room(room)
            with self._lock:
                led = self.ledger
                if key is None:
                    new = self._new_key(room)
                    try:
                        g = led.acquire_and_grant(new, pages, LOCAL_ENGINE, Access.READ)
                    except KVLifetimeError:
                        self._next -= 1
                        raise
                    life = _Life(
                        new, room, "", {0: g}, {0: LOCAL_ENGINE}, set(g.blocks.tolist()), None
                    )
                    self._lives[new] = life
                    self._rooms.setdefault(room, {})[new] = None
                    events.append(("sglang_sending", {"key": new, "pages": len(life.pages)}))
                    return new
                life = self._life(key)
                if life.room != room:
                    raise InvalidField(f"{key} is of room {life.room}, not {room}")
                if life.phase != "live":
                    raise UsageError(f"{key}: a chunk sent after SGLang ended it ({life.phase})")
                arr = inputs.block_ids(pages, led.num_blocks)
                new_pages = np.setdiff1d(arr, np.fromiter(life.pages, np.int64))
                if len(new_pages):
                    led.acquire(key, new_pages)
                g = led.grant(key, LOCAL_ENGINE, arr, Access.READ)
                life.grants[len(life.grants)] = g
                life.peers[len(life.peers)] = LOCAL_ENGINE
                life.pages.update(new_pages.tolist())
                return key
        except KVLifetimeError as e:
            self._refuse("sending_refused", e, {"key": key, "room": room})
            raise
        finally:
            _emit(events)

    def drained(self, key: str) -> bool:
        """The room's outstanding-chunk count is zero and no chunk of it will start (checked by
        the hooks in SGLang's manager): ``TransferCompleted`` of every READ grant, observed
        locally. Returns True when it released the lifecycle (it was ended)."""
        self._prefill_only("drained")
        events: list[tuple[str, dict[str, Any]]] = []
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
                self.ledger.apply_many([TransferCompleted.of(g, 0) for g in open_])
                life.acked.update(life.grants)
                return key in self._collect(events)
        except KVLifetimeError as e:
            self._refuse("drained_refused", e, {"key": key})
            raise
        finally:
            _emit(events)

    def poisoned(self, key: str) -> None:
        """A send of the room returned non-zero while its batch may still read the pages
        (SGLang's ``_poison_unsettled_send``): ``LeaseExpired`` of every open grant (the send's
        own deadline passed). Quarantined once SGLang ends the lifecycle."""
        self._prefill_only("poisoned")
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            with self._lock:
                life = self._life(key)
                led = self.ledger
                for i, g in life.grants.items():
                    if i not in life.acked:
                        led.apply(LeaseExpired.of(g))
                life.suspect = "poisoned"
                self._quarantined_now(events, "poisoned")
        except KVLifetimeError as e:
            self._refuse("poisoned_refused", e, {"key": key})
            raise
        finally:
            _emit(events)

    def ended(self, key: str, *, now: float, reason: str = "released") -> bool:
        """SGLang frees the source pages (``release_kv_cache``). Returns True when the ledger
        released the lifecycle now (drained); otherwise the hooks hold the free until
        ``take_released`` returns the key (quarantined ``drain_timeout`` after ``now``)."""
        self._prefill_only("ended")
        now = inputs.finite_time(now, "now")
        return self._end(key, now + self.drain_timeout, reason)

    # ------------------------------------------------------------------ both

    def withheld(self, key: str, *, now: float) -> bool:
        """SGLang frees a lifecycle the ledger has not released, outside the deferred path
        (decode: a failure it does not defer). Returns True when the ledger released it at once
        (the proof was in: the hooks free it now). Otherwise the hooks keep the pages,
        quarantined now (nothing will prove it: SGLang armed no ACK for it), and
        ``take_released`` returns the key once a proof or a fence releases it."""
        events: list[tuple[str, dict[str, Any]]] = []
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
                self.ledger.expire(now)
                self._quarantined_now(events, "freed_unproven")
                return False
        except KVLifetimeError as e:
            self._refuse("withheld_refused", e, {"key": key})
            raise
        finally:
            _emit(events)

    def tick(self, now: float) -> list[str]:
        """Once per scheduler tick (decode: ``resolve_deferred_releases``; prefill: the
        inflight poll): quarantine held lifecycles whose deadline passed unproven. Returns
        them."""
        now = inputs.finite_time(now, "now")
        events: list[tuple[str, dict[str, Any]]] = []
        with self._lock:
            if self._ledger is None or not self._held:
                return []
            self._ledger.expire(now)
            out = self._quarantined_now(events, "deadline")
        _emit(events)
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

    def freed(self, key: str) -> None:
        """SGLang freed the lifecycle's pages (after ``releasable`` said so): forgotten. A key
        not released is refused (``UsageError``), a repeat is a duplicate (no-op)."""
        try:
            with self._lock:
                if self._repeat(key):
                    return
                life = self._life(key)
                if life.phase != "released":
                    raise UsageError(f"{key} is {life.phase}: SGLang may not free it yet")
                self._forget(life)
                self._freed += 1
        except KVLifetimeError as e:
            self._refuse("freed_refused", e, {"key": key})
            raise

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

    def revoke(self, fence: str, *, prefill: str | None = None) -> list[str]:
        """The deployment fenced the peers (every one, or every rank of ``prefill``):
        ``AccessRevoked`` from the local side for each, then release what that proves.
        Returns the lifecycles released; SGLang frees them at its next tick."""
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            fence = inputs.text(fence, "fence")
            if prefill is not None:
                prefill = inputs.peer_id(prefill, "prefill")
            with self._lock:
                peers = {
                    p
                    for life in self._lives.values()
                    if prefill is None or life.prefill == prefill
                    for p in life.peers.values()
                }
                led = self.ledger
                for p in sorted(peers):
                    led.apply(AccessRevoked(p, fence=fence))
                out = self._collect(events)
                events.append(("sglang_revoked", {"fence": fence, "released": out}))
                return out
        except KVLifetimeError as e:
            self._refuse("revoke_refused", e, {"fence": fence})
            raise
        finally:
            _emit(events)

    def stats(self, now: float | None = None) -> SGLangGuardStats:
        with self._lock:
            lives = list(self._lives.values())
            led = self._ledger
            quarantined = [life for life in lives if life.phase == "held" and life.quarantine]
            reasons: collections.Counter[str] = collections.Counter(
                life.quarantine for life in quarantined
            )
            return SGLangGuardStats(
                role=self.role,
                ledger=None if led is None else led.stats(now),
                live=sum(1 for life in lives if life.phase == "live"),
                held=sum(1 for life in lives if life.phase == "held"),
                quarantined=len(quarantined),
                quarantined_pages=sum(len(life.pages) for life in quarantined),
                quarantine_reasons=dict(reasons),
                releasable=sum(1 for life in lives if life.phase == "released"),
                completed=self._completed,
                freed=self._freed,
                refused=dict(self._refused),
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
                "pages": sorted(life.pages),
                "slot": life.slot,
                "withheld": life.withheld,
            }

    def lifecycles(self) -> list[str]:
        """Every lifecycle the guard holds, oldest first."""
        with self._lock:
            return list(self._lives)

    # ------------------------------------------------------------------ internals

    def _decode_only(self, call: str) -> None:
        if self.role != "decode":
            raise UsageError(f"{call} is a decode call; this guard is the {self.role}'s")

    def _prefill_only(self, call: str) -> None:
        if self.role != "prefill":
            raise UsageError(f"{call} is a prefill call; this guard is the {self.role}'s")

    def _new_key(self, room: int) -> str:
        self._next += 1
        return f"sglang:{room}#{self._next}"

    def _life(self, key: object) -> _Life:
        if not isinstance(key, str):
            raise InvalidField(f"a lifecycle key is a str, got {inputs._show(key)}")
        life = self._lives.get(key)
        if life is None:
            raise UnknownRequest(key)
        return life

    def _repeat(self, key: object) -> bool:
        """A call about a lifecycle already freed: a duplicate (counted, no-op)."""
        if isinstance(key, str) and key in self._done:
            self._duplicates += 1
            return True
        return False

    def _end(self, key: str, deadline: float, reason: str) -> bool:
        events: list[tuple[str, dict[str, Any]]] = []
        try:
            deadline = inputs.finite_time(deadline, "deadline")
            reason = inputs.text(reason, "reason")
            with self._lock:
                if self._repeat(key):
                    return False
                life = self._life(key)
                if life.phase != "live":
                    self._duplicates += 1
                    return life.phase == "released"
                self._end_locked(life, deadline, reason, events)
                return life.phase == "released"
        except KVLifetimeError as e:
            self._refuse("end_refused", e, {"key": key})
            raise
        finally:
            _emit(events)

    def _end_locked(
        self, life: _Life, deadline: float, reason: str, events: list[tuple[str, dict[str, Any]]]
    ) -> None:
        led = self.ledger
        led.set_deadline(life.key, deadline)
        if len(life.acked) == len(life.grants):
            led.finish(life.key)  # every grant proven over: the normal end
        else:
            led.reject(life.key, reason=reason)
        life.phase = "held"
        life.reason = reason
        self._held[life.key] = None
        events.append(("sglang_held", {"key": life.key, "room": life.room, "reason": reason}))
        self._collect(events)
        # Suspect already (a lost prefill, a poisoned send): the ledger quarantined it now.
        self._quarantined_now(events, "deadline")

    def _collect(self, events: list[tuple[str, dict[str, Any]]]) -> list[str]:
        out: list[str] = []
        for k in self.ledger.collect_releasable():
            life = self._lives.get(str(k))
            if life is None:
                continue
            life.phase = "released"
            life.quarantine = ""  # no longer: a late proof or a fence ended it
            self._held.pop(life.key, None)
            out.append(life.key)
            if life.withheld or self.role == "prefill":
                self._ready[life.key] = None
            events.append(("sglang_released", {"key": life.key, "room": life.room}))
        return out

    def _quarantined_now(self, events: list[tuple[str, dict[str, Any]]], why: str) -> list[str]:
        """Mark held lifecycles the ledger has quarantined since the last look (the cause:
        what made them suspect, else ``why``), each logged once."""
        out: list[str] = []
        led = self.ledger
        for key in self._held:
            life = self._lives[key]
            if life.quarantine or led.state(key) is not RequestState.QUARANTINED:
                continue
            life.quarantine = life.suspect or why
            out.append(key)
            events.append(
                (
                    "sglang_quarantined",
                    {
                        "key": key,
                        "room": life.room,
                        "reason": life.quarantine,
                        "pages": len(life.pages),
                        "acked": sorted(life.acked),
                        "ranks": sorted(life.grants),
                    },
                )
            )
        return out

    def _shared_room(self, life: _Life) -> str | None:
        """Another lifecycle of the same room the ledger has not released, if any. SGLang's
        prefill counts a room's chunks in one counter (``_staging_outstanding[room]``) that a new
        use of the room resets: while two uses are unreleased, neither an ABORT_ACK (sent when
        that counter is 0) nor the counter itself can be attributed to one of them."""
        for other in self._rooms.get(life.room, ()):
            if other != life.key and self._lives[other].phase != "released":
                return other
        return None

    def _forget(self, life: _Life) -> None:
        uses = self._rooms.get(life.room)
        if uses is not None:
            uses.pop(life.key, None)
            if not uses:
                del self._rooms[life.room]
        del self._lives[life.key]
        self._ready.pop(life.key, None)
        self._held.pop(life.key, None)
        if life.generation is not None:
            self._by_gen.pop(life.generation, None)
            self._remember_gen(life.generation, life.room)
        if life.slot is not None and self._slots.get(life.slot) == life.key:
            del self._slots[life.slot]
        self._done[life.key] = life.room
        if len(self._done) > _REMEMBERED:
            self._done.popitem(last=False)

    def _remember_gen(self, generation: int, room: int) -> None:
        self._old_gens[generation] = room
        if len(self._old_gens) > _REMEMBERED:
            self._old_gens.popitem(last=False)

    def _refuse(self, kind: str, e: BaseException, ctx: dict[str, Any]) -> None:
        with self._lock:
            self._refused[kind] += 1
        if not structlog.is_configured():
            return
        _log.warning(
            "sglang_guard_refused",
            kind=kind,
            error=type(e).__name__,
            error_kind=getattr(e, "kind", ""),
            message=str(e),
            **{k: _plain(v) for k, v in ctx.items()},
        )


class _Refusal(Exception):
    """Internal: a refusal with its counter kind (the typed error is its ``__cause__``)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _ranks(ranks: object) -> list[int]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable):
        raise InvalidField(f"ranks must be a sequence of ints, got {inputs._show(ranks)}")
    out = [_small(r, "rank") for r in list(ranks)]
    if not out:
        raise InvalidField("ranks is empty: a publish goes to at least one prefill rank")
    if len(set(out)) != len(out):
        raise InvalidField(f"ranks has a repeat: {out}")
    return out


def _plain(v: object) -> object:
    return v if isinstance(v, int | str | float | type(None)) else inputs._show(v)


_WARNINGS = frozenset({"sglang_quarantined", "sglang_exposed_slot_reused"})
# Every request of a healthy run makes these: debug, so a tick stays cheap at info.
_PER_REQUEST = frozenset({"sglang_published", "sglang_sending", "sglang_released"})


def _emit(events: list[tuple[str, dict[str, Any]]]) -> None:
    # Outside the guard's lock: a log processor may call the guard. A library never configures
    # structlog: silent (and cheap on SGLang's hot path) until the application has.
    if not events or not structlog.is_configured():
        return
    for name, fields in events:
        if name in _WARNINGS:
            _log.warning(name, **fields)
        elif name in _PER_REQUEST:
            _log.debug(name, **fields)
        else:
            _log.info(name, **fields)
