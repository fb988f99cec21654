"""Lifecycles: one use of an SGLang room each, and the table both sides of the guard share.

SGLang reports per *room* (the ``bootstrap_room`` integer a request carries). Rooms are reused
(a client or router may send the same room again), so the guard keys every use of a room by a
lifecycle of its own, ``"sglang:<room>#<n>"`` (``n`` counts the guard's lifecycles): a message
about an earlier use of the room can never count for a later one. While two uses of a room are
unreleased, SGLang's per-room signals cannot be attributed to either
(``RoomLifecycles._shared_room``).

A lifecycle's phase: ``live`` (SGLang still runs the request) -> ``held`` (SGLang ended it; the
ledger has not released it: waiting for proof, or quarantined) -> ``released`` (the ledger
released it; SGLang may free its pages) -> forgotten when SGLang frees them (its key and, on the
decode, its ABORT generation are remembered a while, so a late message is told from an unknown
one).

``RoomLifecycles`` is what ``decode.DecodeCalls`` and ``prefill.PrefillCalls`` (and ``SGLangGuard``
on top of both) share: the lock, the ledger, this table, the counters, and the steps every call
ends with (collect what the ledger released, mark what it quarantined, forget what SGLang freed).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterable
from typing import Any, Generic, Literal, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime import inputs
from kvlifetime.errors import InvalidField, KVLifetimeError, UnknownRequest
from kvlifetime.guard import Hold, Holds, Refusal, Refusals
from kvlifetime.guard.refusals import kind_of
from kvlifetime.integrations.sglang.errors import GuardNotBound
from kvlifetime.integrations.sglang.events import Events, emit, listening, log_refusal
from kvlifetime.integrations.sglang.tokens import EchoTable
from kvlifetime.ledger import BlockLedger, StepLedger
from kvlifetime.source import Source
from kvlifetime.spec.vocabulary import RequestState

Role = Literal["decode", "prefill"]
ROLES: tuple[Role, ...] = ("decode", "prefill")

# How many ended lifecycles are remembered to tell a late or duplicate message from an unknown one.
_REMEMBERED = 65536
_MAX_ROOM = 2**64 - 1  # SGLang rooms are 64-bit integers
_MAX_SMALL = 2**31 - 1  # ranks, slots, generations: SGLang counts them in ints
_SOURCES = 4096  # peer sources kept (one per prefill rank seen); the cache starts over beyond


E = TypeVar("E")
"""What a lifecycle's grants are: decode's ``Grant`` objects (its ``BlockLedger``), prefill's
grant handles (its ``StepLedger``)."""


@attrs.define(slots=True, eq=False)
class Lifecycle(Generic[E]):
    """One use of a room: what was exposed, to whom, and how far it got."""

    key: str
    room: int
    prefill: str  # decode: the prefill's bootstrap address; prefill: ""
    grants: dict[int, E]  # decode: rank -> WRITE grant; prefill: chunk -> READ grant handle
    peers: dict[int, str]  # rank (or chunk) -> peer id
    # The pages exposed, each once (the ledger's grant blocks: validated, unique, read-only): an
    # array, not a set of Python ints, so a publish costs nothing per page here.
    pages: npt.NDArray[np.int64]
    slot: int | None
    generation: int | None = None  # the ABORT generation armed for it (decode)
    acked: set[int] = attrs.field(factory=set)  # ranks (chunks) whose grant is proven over
    # Its state of the engine-side lifecycle (kvlifetime.spec, docs/engine.md), stepped only by
    # the guard's ``Holds``; ``phase`` is SGLang's coarse view of it.
    hold: Hold[E] = attrs.field(init=False)  # set by ``RoomLifecycles._add``, before any use
    # SGLang's coarse view of the hold's state, set by ``_fire`` only (never assigned apart):
    # live (SGLang runs it) -> held (ended, unreleased: waiting for proof, or quarantined) ->
    # released (SGLang may free its pages).
    phase: str = attrs.field(default="live", init=False)
    reason: str = ""  # why SGLang ended it ("" while live)
    suspect: str = ""  # what made it suspect: peer_lost / poisoned / freed_unproven
    quarantine: str = ""  # why it is quarantined ("" when it is not)
    withheld: bool = False  # SGLang tried to free it unproven; the hooks free it on release
    # decode: rank -> the token its ABORT of the current generation carries (tokens.py); never
    # logged, never shown by ``lifecycle()``
    tokens: dict[int, str] = attrs.field(factory=dict)


# SGLang's coarse view of the engine-side states its lifecycles reach.
_PHASE = {
    "running": "live",
    "loading": "live",
    "load_received": "live",
    "reading": "live",
    "withheld": "held",
    "quarantined": "held",
    "releasable": "released",
    "ended": "released",
    "handed_back": "released",
}


def room_id(value: object) -> int:
    """A room as SGLang makes it: an int (a numpy integer too; never a bool) in [0, 2**64)."""
    v = inputs._plain_integer(value)  # the plain value, never through a subclass's __int__
    if v is None:
        raise InvalidField(f"room must be an int, got {inputs._show(value)}")
    if not 0 <= v <= _MAX_ROOM:
        raise InvalidField(f"room must be in [0, 2**64), got {v}")
    return v


def small_int(value: object, name: str) -> int:
    """A rank, slot or generation: an int (a numpy integer too; never a bool) in [0, 2**31)."""
    v = inputs._plain_integer(value)
    if v is None:
        raise InvalidField(f"{name} must be an int, got {inputs._show(value)}")
    if not 0 <= v <= _MAX_SMALL:
        raise InvalidField(f"{name} must be in [0, 2**31), got {v}")
    return v


def rank_ids(ranks: object) -> list[int]:
    """The prefill ranks a publish goes to: at least one, no repeat."""
    if type(ranks) is list and len(ranks) == 1 and type(ranks[0]) is int:
        # The hooks' case (one prefill rank, a plain int): the checks below, without the walk.
        r = ranks[0]
        if 0 <= r <= _MAX_SMALL:
            return [r]
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable):
        raise InvalidField(f"ranks must be a sequence of ints, got {inputs._show(ranks)}")
    out = [small_int(r, "rank") for r in inputs.materialised(ranks, "ranks")]
    if not out:
        raise InvalidField("ranks is empty: a publish goes to at least one prefill rank")
    if len(set(out)) != len(out):
        raise InvalidField(f"ranks has a repeat: {out}")
    return out


class Refused(Exception):
    """Internal: a refusal with its counter kind (the typed error is its ``__cause__``)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class RoomLifecycles:
    """The state both sides share, and the steps on it. Every attribute below is read and
    written under ``_lock`` only."""

    def __init__(
        self,
        *,
        role: Role,
        ledger_blocks: int | None = None,
        incarnation: str | None = None,
        drain_timeout: float = 30.0,
        prefill_guarded: bool = False,
    ) -> None:
        self.role: Role = inputs.choice(role, "role", ROLES)  # type: ignore[assignment]
        if type(prefill_guarded) is not bool:
            raise InvalidField(
                f"prefill_guarded must be a bool, got {inputs._show(prefill_guarded)}"
            )
        # Decode: every prefill it serves runs the guard too, so every ABORT_ACK must echo the
        # token its rank was sent (tokens.py); otherwise an ACK without one is taken on its word.
        self.prefill_guarded = prefill_guarded
        if ledger_blocks is not None:
            ledger_blocks = inputs.count(ledger_blocks, "ledger_blocks", 1)
        if incarnation is not None:
            incarnation = inputs.peer_id(incarnation, "incarnation")
        self.drain_timeout = inputs.finite_time(drain_timeout, "drain_timeout")
        self._incarnation = incarnation
        self._ledger: BlockLedger | StepLedger | None = None
        self._lock = threading.Lock()
        self._lives: dict[str, Lifecycle[Any]] = {}  # every lifecycle SGLang has not freed
        self._next = 0  # the last lifecycle number given out
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
        self._sources: dict[str, Source] = {}  # peer id -> Source.peer(peer id), made once
        self._echo = EchoTable()  # prefill: the token each ABORT carried, to echo in its ACK
        # Every lifecycle's engine-side state, stepped by the spec's table (kvlifetime.guard).
        # (Refusals counted only: a table refusal is counted as ``table_refused`` in the
        # guard's own counter, and nothing is logged under the guard's lock.)
        self._holds: Holds[Any] = Holds(Refusals(f"sglang-{self.role}", log=False))
        if ledger_blocks is not None:
            self.bind(ledger_blocks)

    @property
    def ledger(self) -> BlockLedger | StepLedger:
        """The ledger (``GuardNotBound`` before ``bind``): decode's ``BlockLedger`` (the
        ledger's own counts), prefill's ``StepLedger``."""
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
            # Decode: several ranks may write the same pages, and a page under an open grant is
            # never free in the ledger's own counts. Prefill: cached prefix pages are shared by
            # requests, as SGLang's radix tree counts them.
            # Prefill: the step-columnar ledger (the engine's counts; grant handles, no object
            # per chunk). Decode: the object ledger, for its own counts.
            if self.role == "decode":
                self._ledger = BlockLedger(n, counts="ledger", incarnation=self._incarnation)
            else:
                self._ledger = StepLedger(n, incarnation=self._incarnation)

    # ------------------------------------------------------------------ the table

    def _new_key(self, room: int) -> str:
        self._next += 1
        return f"sglang:{room}#{self._next}"

    def _add(self, life: Lifecycle[Any]) -> None:
        """A new use of a room, exposed at once: decode's pages to the prefill ranks that write
        them (``load_granted``), prefill's to the transfer engine that reads them
        (``read_granted``)."""
        self._lives[life.key] = life
        self._rooms.setdefault(life.room, {})[life.key] = None
        hold = life.hold = self._holds.admit(life.key)
        first = next(iter(life.grants.values()))
        if self.role == "decode":
            hold.write = first
            self._fire(life, "load_granted")
        else:
            # SGLang has no scheduler-step stamp to give: its drain is observed locally after
            # the send, so the exposure counts as out already.
            hold.read, hold.read_step = first, self._holds.step - 1
            self._fire(life, "read_granted")

    def _fire(self, life: Lifecycle[Any], event: str) -> None:
        """Step the lifecycle's hold; a row the table refuses is the guard's own inconsistency
        (counted ``table_refused`` in ``stats().refused``), never the engine's."""
        refusal = self._holds.fire(life.key, event, life.hold)
        life.phase = _PHASE[life.hold.state]
        if refusal is not None:
            self._refused["table_refused"] += 1

    def _life(self, key: object) -> Lifecycle[Any]:
        if not isinstance(key, str):
            raise InvalidField(f"a lifecycle key is a str, got {inputs._show(key)}")
        life = self._lives.get(key)
        if life is None:
            raise UnknownRequest(key)
        return life

    def _source(self, peer: str) -> Source:
        """``Source.peer(peer)``, made once per peer (frozen: one instance serves every piece of
        evidence from that peer) rather than once per message."""
        src = self._sources.get(peer)
        if src is None:
            src = Source.peer(peer)
            if len(self._sources) >= _SOURCES:
                self._sources.clear()
            self._sources[peer] = src
        return src

    def _repeat(self, key: object) -> bool:
        """A call about a lifecycle already freed: a duplicate (counted, no-op)."""
        if isinstance(key, str) and key in self._done:
            self._duplicates += 1
            return True
        return False

    def _shared_room(self, life: Lifecycle[Any]) -> str | None:
        """Another lifecycle of the same room the ledger has not released, if any. SGLang's
        prefill counts a room's chunks in one counter (``_staging_outstanding[room]``) that a new
        use of the room resets: while two uses are unreleased, neither an ABORT_ACK (sent when
        that counter is 0) nor the counter itself can be attributed to one of them."""
        for other in self._rooms.get(life.room, ()):
            if other != life.key and self._lives[other].phase != "released":
                return other
        return None

    def _forget(self, life: Lifecycle[Any]) -> None:
        self._fire(life, "handed_back")  # SGLang freed its pages
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

    # ------------------------------------------------------------------ ending and releasing

    def _end(self, key: str, deadline: float, reason: str) -> bool | Refusal:
        events: Events = []
        try:
            # +inf: no deadline (SGLang's timeout may be set so); only a proof or a fence ends it.
            due = None if deadline == math.inf else inputs.finite_time(deadline, "deadline")
            reason = inputs.text(reason, "reason")
            with self._lock:
                if self._repeat(key):
                    return False
                life = self._life(key)
                if life.phase != "live":
                    self._duplicates += 1
                    return life.phase == "released"
                self._end_locked(life, due, reason, events)
                return life.phase == "released"
        except KVLifetimeError as e:
            return self._refuse("end_refused", e, {"key": key})
        finally:
            emit(events)

    def _end_locked(
        self, life: Lifecycle[Any], deadline: float | None, reason: str, events: Events
    ) -> None:
        led = self.ledger
        proven = len(life.acked) == len(life.grants)
        if proven:
            led.finish(life.key)  # every grant proven over: the normal end
        else:
            led.set_deadline(life.key, deadline)
            led.reject(life.key, reason=reason)
        self._fire(life, "finished" if proven else "aborted")
        life.reason = reason
        self._held[life.key] = None
        if listening():
            events.append(("sglang_held", {"key": life.key, "room": life.room, "reason": reason}))
        self._collect(events)
        if proven and life.phase != "released":
            # Only ``expire`` reads a deadline, and it cannot run before this (the guard's lock):
            # a lifecycle the collect released (the usual case) needs none.
            led.set_deadline(life.key, deadline)
        # Suspect already (a lost prefill, a poisoned send): the ledger quarantined it now.
        self._quarantined_now(events, "deadline")

    def _collect(self, events: Events) -> list[str]:
        out: list[str] = []
        for k in self.ledger.collect_releasable():
            life = self._lives.get(str(k))
            if life is None:
                continue
            if life.hold.state in ("withheld", "quarantined"):
                self._fire(life, "released")
            life.hold.read = life.hold.write = None
            life.quarantine = ""  # no longer: a late proof or a fence ended it
            self._held.pop(life.key, None)
            out.append(life.key)
            if life.withheld or self.role == "prefill":
                self._ready[life.key] = None
            if listening():
                events.append(("sglang_released", {"key": life.key, "room": life.room}))
        return out

    def _quarantined_now(self, events: Events, why: str) -> list[str]:
        """Mark held lifecycles the ledger has quarantined since the last look (the cause:
        what made them suspect, else ``why``), each logged once."""
        out: list[str] = []
        led = self.ledger
        for key in self._held:
            life = self._lives[key]
            if life.quarantine or led.state(key) is not RequestState.QUARANTINED:
                continue
            life.quarantine = life.suspect or why
            self._fire(life, "deadline")
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

    def _refuse(self, kind: str, e: KVLifetimeError, ctx: dict[str, Any]) -> Refusal:
        """A signal from SGLang refused: counted under ``kind`` (the call that refused it, in
        ``stats().refused``), logged on the one path (``guard_refused``), returned as data.
        A caller's misuse is raised instead (a call before ``bind``: ``GuardNotBound``)."""
        if isinstance(e, GuardNotBound):
            raise e
        with self._lock:
            self._refused[kind] += 1
        log_refusal(kind, e, ctx)
        key = ctx.get("key")
        return Refusal(kind_of(e), key if isinstance(key, str) else "-", e)
