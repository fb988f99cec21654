"""The decode side's lifecycle: the pages prefill ranks write into, from the publish of their
addresses to the verdict SGLang gets before it frees them.

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
  (``MismatchedEvidence``); each refusal is logged, counted, and changes nothing. Arming makes
  each rank a token (``abort_token``, ``tokens.py``) its ABORT carries; an ACK echoing another
  token, or none while ``prefill_guarded``, is another rank (or anyone) speaking in that rank's
  name: ``UnauthorizedEvidence``, counted ``ack_unauthorized``.
- ``transferred``: ``KVPoll.Success`` (every rank reported its transfer complete): every grant
  closed, the lifecycle over.
- ``held``: SGLang defers the release of a failed transfer (``_defer_release``): the lifecycle
  is rejected in the ledger with SGLang's own deadline. ``SGLangGuard.tick(now)`` quarantines it
  when the deadline passes unproven (SGLang alone would free it then: ``ready = drained or now >=
  deadline``); ``prefill_lost`` (heartbeat loss) quarantines every lifecycle of that prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy.typing as npt

from kvlifetime import inputs
from kvlifetime.errors import (
    BlockUnavailable,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnauthorizedEvidence,
    UsageError,
)
from kvlifetime.evidence import PeerLost, TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.guard import Refusal
from kvlifetime.integrations.sglang.events import Events, emit, listening
from kvlifetime.integrations.sglang.lifecycles import (
    Lifecycle,
    Refused,
    RoomLifecycles,
    rank_ids,
    room_id,
    small_int,
)
from kvlifetime.integrations.sglang.tokens import matches, new_token, wire_token
from kvlifetime.ledger import BlockLedger


class DecodeCalls(RoomLifecycles):
    """The decode's calls (``SGLangGuard`` has them; a prefill guard refuses them)."""

    @property
    def objects(self) -> BlockLedger:
        """The decode's ledger: a ``BlockLedger`` of the ledger's own counts (``bind``)."""
        return cast(BlockLedger, self.ledger)

    def published(
        self,
        room: int,
        pages: npt.ArrayLike,
        *,
        slot: int,
        ranks: Sequence[int],
        prefill: str,
    ) -> str | Refusal:
        """``_send_kv_metadata``: a WRITE grant per prefill rank over ``pages`` (and the
        metadata ``slot``), before the addresses leave. Returns the lifecycle key."""
        events: Events = []
        try:
            room = room_id(room)
            slot = small_int(slot, "slot")
            prefill = inputs.peer_id(prefill, "prefill")
            rank_list = rank_ids(ranks)
            with self._lock:
                led = self.objects
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
                    raise Refused(kind or "published_refused") from e
                for r in rank_list[1:]:
                    grants[r] = led.grant(key, peers[r], grants[first].blocks, Access.WRITE)
                life = Lifecycle(key, room, prefill, grants, peers, grants[first].blocks, slot)
                self._add(life)
                other = self._slots.get(slot)
                if other is not None and other in self._lives:
                    # The slot of a lifecycle SGLang has not freed through the guard: a late
                    # aux write of the old owner may land in it. Detected, not prevented.
                    self._refused["exposed_slot_reused"] += 1
                    events.append(
                        ("sglang_exposed_slot_reused", {"slot": slot, "key": key, "held_by": other})
                    )
                self._slots[slot] = key
                if listening():
                    events.append(
                        (
                            "sglang_published",
                            {
                                "key": key,
                                "room": room,
                                "pages": len(life.pages),
                                "ranks": rank_list,
                            },
                        )
                    )
                return key
        except Refused as r:
            cause = r.__cause__
            assert isinstance(cause, KVLifetimeError)
            return self._refuse(r.kind, cause, {"room": room})
        except KVLifetimeError as e:
            return self._refuse("published_refused", e, {"room": room})
        finally:
            emit(events)

    def armed(self, key: str, generation: int) -> Refusal | None:
        """SGLang armed ABORT-ACK accounting for the lifecycle under ``generation`` (its
        manager's counter): only ACKs of this generation count from now on."""
        try:
            generation = small_int(generation, "generation")
            with self._lock:
                life = self._life(key)
                if life.generation == generation:
                    self._duplicates += 1
                    return None
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
                # A new ABORT: each rank is sent a token of its own (tokens.py).
                life.tokens = {r: new_token() for r in life.grants}
                self._by_gen[generation] = key
                self._max_gen = generation
                return None
        except KVLifetimeError as e:
            return self._refuse("armed_refused", e, {"key": key, "generation": generation})

    def abort_token(self, key: str, rank: int) -> str | None:
        """The token the ABORT of ``key``'s current generation carries to ``rank`` (the hooks
        add it to that rank's ABORT); None before ``armed``, or for a rank it was not
        published to."""
        with self._lock:
            life = self._lives.get(key) if isinstance(key, str) else None
            return None if life is None else life.tokens.get(rank)

    def acked(
        self, room: int, rank: int, generation: int, *, token: object = None
    ) -> bool | Refusal:
        """An ABORT_ACK from prefill rank ``rank`` for ``room`` under ``generation``, echoing
        ``token`` (None: the ACK carried none). Returns True when it was new evidence, False
        for a repeat. Refused (typed, logged, counted, nothing changed): a generation of an
        earlier use of the room (``StaleEvidence``), one never armed, of another room or
        another rank (``MismatchedEvidence``); a token that is not the one sent to ``rank``, or
        none while ``prefill_guarded`` (``UnauthorizedEvidence``, counted ``ack_unauthorized``:
        another rank, or anyone, speaking in ``rank``'s name)."""
        ctx: dict[str, Any] = {"room": room, "rank": rank, "generation": generation}
        events: Events = []
        kind = "ack_refused"
        try:
            room = room_id(room)
            rank = small_int(rank, "rank")
            generation = small_int(generation, "generation")
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
                got = None if token is None else wire_token(token)
                if token is not None and not (got and matches(life.tokens.get(rank), got)):
                    kind = "ack_unauthorized"
                    raise UnauthorizedEvidence(
                        f"ABORT_ACK of room {room} in rank {rank}'s name does not echo the "
                        f"token rank {rank}'s ABORT carried: sent by another rank, or anyone"
                    )
                if got is None and self.prefill_guarded:
                    kind = "ack_unauthorized"
                    raise UnauthorizedEvidence(
                        f"ABORT_ACK of room {room} in rank {rank}'s name echoes no token: every "
                        "prefill runs the guard (prefill_guarded), so it proves nothing about "
                        "who sent it"
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
                g = life.grants[rank]
                src = self._source(life.peers[rank])
                self.objects.apply(TransferCompleted(g.id, g.request, g.peer, 0, source=src))
                life.acked.add(rank)
                if life.phase == "held":
                    self._fire(life, "load_landed")  # one rank's proof; the ledger has the rest
                events.append(("sglang_abort_acked", {"key": key, "rank": rank}))
                self._collect(events)
                return True
        except KVLifetimeError as e:
            return self._refuse(kind, e, ctx)
        finally:
            emit(events)

    def transferred(self, key: str) -> Refusal | None:
        """``KVPoll.Success``: every prefill rank reported its transfer of the room complete
        (decode's poll counts one Success per rank): every grant closed, the lifecycle over."""
        events: Events = []
        try:
            with self._lock:
                if self._repeat(key):
                    return None
                life = self._life(key)
                if life.phase != "live":
                    raise UsageError(f"{key}: Success after SGLang ended it ({life.phase})")
                led = self.objects
                # Built once each, from the rank's peer (the prefill reported it): not made
                # local and then copied with the peer's source.
                src = self._source
                led.apply_many(
                    [
                        TransferCompleted(g.id, g.request, g.peer, 0, source=src(life.peers[r]))
                        for r, g in life.grants.items()
                    ]
                )
                self._fire(life, "load_landed")  # every rank's transfer landed
                led.finish(key)
                self._fire(life, "finished")
                if key in self._collect(events):
                    self._forget(life)
                    self._completed += 1
                return None
        except KVLifetimeError as e:
            return self._refuse("transferred_refused", e, {"key": key})
        finally:
            emit(events)

    def held(self, key: str, *, deadline: float, reason: str = "transfer_failed") -> bool | Refusal:
        """SGLang holds a failed transfer's pages (``_defer_release``) until ``deadline`` (its
        own clock; ``math.inf``: none, only a proof or a fence ends it). Returns True when the
        ledger released it at once (proof already in)."""
        return self._end(key, deadline, reason)

    def prefill_lost(self, prefill: str) -> list[str] | Refusal:
        """SGLang's heartbeat to ``prefill`` failed (``_handle_node_failure``): ``PeerLost``
        for every rank of it with an open grant. Returns the lifecycles quarantined now."""
        events: Events = []
        try:
            prefill = inputs.peer_id(prefill, "prefill")
            with self._lock:
                hit = [
                    life
                    for life in self._lives.values()
                    if life.prefill == prefill and life.phase != "released"
                ]
                peers = {p for life in hit for r, p in life.peers.items() if r not in life.acked}
                led = self.objects
                for p in sorted(peers):
                    led.apply(PeerLost(p))
                for life in hit:
                    life.suspect = life.suspect or "peer_lost"
                return self._quarantined_now(events, "peer_lost")
        except KVLifetimeError as e:
            return self._refuse("prefill_lost_refused", e, {"prefill": prefill})
        finally:
            emit(events)
