"""The decode's handlers (``install(role="decode")``): one method per row of
``facts_v0_5_23.DECODE_HOOKS``, each translating what SGLang does at that point into the
``DecodeGuard``'s calls. The row says when it runs (``integrations.hooks``); its first argument
after ``self`` is SGLang's own ``self``. SGLang's private details are read through the facts
module only.

Context SGLang does not pass (which lifecycle an ABORT is being sent for, to which rank, the
frames of the ABORT_ACK being read, the rooms a running ``resolve_deferred_releases`` asks
about) is kept per thread for the length of the call that has it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

from kvlifetime.guard import Refusal, RefusalKind
from kvlifetime.integrations.hooks import PROCEED
from kvlifetime.integrations.sglang import facts_v0_5_23 as facts
from kvlifetime.integrations.sglang.guard import DecodeGuard
from kvlifetime.integrations.sglang.installation import Installation, plain_room

Original = Callable[..., Any]


class DecodeHooks(Installation):
    """The decode's handlers over one ``DecodeGuard``."""

    ROWS = facts.DECODE_HOOKS

    def __init__(self, guard: DecodeGuard) -> None:
        super().__init__(guard)
        self.decode = guard
        # Withheld frees (key -> (transfer queue, decode_req)).
        self.withheld: dict[str, tuple[Any, Any]] = {}
        self.resolving_rooms = threading.local()  # room -> lifecycle keys, while SGLang resolves
        self.arming = threading.local()  # the lifecycle whose ABORT is being armed and sent
        self.acking = threading.local()  # the ABORT_ACK being read (its frames)

    def key_of_request(self, decode_req: Any) -> str | None:
        return self.key_of(getattr(decode_req, "kv_receiver", None))

    # ------------------------------------------------------------------ the prealloc queue

    def bind_from_allocator(self, queue: Any, out: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.guard.bound:
            self.guard.bind(facts.decode_pages(queue))
        return out

    def admit(self, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if self.room(req, "decode_admission") is None:
            # Before anything is allocated: failed as SGLang fails a bad request.
            facts.fail_bad_request(queue.scheduler, req, "decode")
            return None
        return PROCEED

    # ------------------------------------------------------------------ the receiver

    def publish(
        self, receiver: Any, kv_indices: Any, aux_index: Any = None, *args: Any, **kw: Any
    ) -> Any:
        destination = kw.get("destination")
        device = destination is None or getattr(destination, "name", "") in ("DEVICE", "")
        if not (getattr(receiver, "bootstrap_infos", None) and device and aux_index is not None):
            return PROCEED
        room = self.room(receiver, "publish")
        if room is None:
            # Admission refuses these; a room that changed since is not published (no address
            # leaves) and SGLang fails the transfer.
            receiver.conclude_state = facts.kv_poll().Failed
            return None
        key = self.accepted(
            lambda: self.decode.published(
                room,
                kv_indices,
                slot=int(aux_index),
                ranks=facts.prefill_ranks(receiver),
                prefill=str(receiver.bootstrap_addr),
            )
        )
        if key is not None:  # a refused re-publish keeps the receiver's lifecycle
            self.set_key(receiver, key)
        return PROCEED

    def sending_abort(self, receiver: Any, original: Original, *args: Any, **kw: Any) -> Any:
        # SGLang arms the room (register_deferred_abort_room) and then sends the ABORT; the
        # ACK may come back on the decode thread before this call returns, so the generation is
        # recorded where it is made, for this receiver's lifecycle.
        self.arming.key = self.key_of(receiver)
        self.arming.receiver = receiver
        try:
            return original(receiver, *args, **kw)
        finally:
            self.arming.key = self.arming.receiver = self.arming.info = None

    def connecting(self, cls: Any, bootstrap_info: Any) -> Any:
        if getattr(self.arming, "key", None) is not None:
            self.arming.info = bootstrap_info  # the rank the next ABORT goes to
        return PROCEED

    def abort_frames(self, note: Any, frames: Any) -> Any:
        token = self._abort_token()
        if token is not None and len(frames) == facts.ABORT_FRAMES:
            frames.append(token.encode("ascii"))  # after SGLang's frames: its parser ignores it
        return frames

    def _abort_token(self) -> str | None:
        """The token of the rank the ABORT being built goes to (``_send_abort_notification``
        is sending it for a guarded lifecycle), or None."""
        key = getattr(self.arming, "key", None)
        receiver = getattr(self.arming, "receiver", None)
        info = getattr(self.arming, "info", None)
        if key is None or receiver is None or info is None:
            return None
        infos = list(getattr(receiver, "bootstrap_infos", None) or ())
        at = next((i for i, x in enumerate(infos) if x is info), None)
        if at is None:
            return None
        ranks = facts.prefill_ranks(receiver)
        return self.decode.abort_token(key, ranks[at]) if at < len(ranks) else None

    # ------------------------------------------------------------------ the manager

    def reading_ack(self, mgr: Any, original: Original, msg: Any) -> Any:
        self.acking.frames = msg
        try:
            return original(mgr, msg)
        finally:
            self.acking.frames = None

    def armed(self, mgr: Any, generation: Any, bootstrap_room: Any) -> Any:
        key = getattr(self.arming, "key", None)
        if key is not None:
            self.quiet(lambda: self.decode.armed(key, int(generation)))
        return generation

    def acked(self, mgr: Any, room: Any, rank: Any, generation: Any) -> Any:
        frames = getattr(self.acking, "frames", None)
        # SGLang reads its frames; a guarded prefill echoes its token in the next one.
        n = facts.ACK_FRAMES
        token = frames[n] if isinstance(frames, list) and len(frames) > n else None
        out = self.quiet(lambda: self.decode.acked(room, rank, generation, token=token))
        if isinstance(out, Refusal) and out.kind is RefusalKind.UNAUTHORIZED:
            return None  # in another rank's name: SGLang's own count never sees it
        return PROCEED  # (another refusal: typed, logged, counted by the guard; SGLang's rules)

    def release_safe(self, mgr: Any, original: Original, room: Any, required_acks: Any) -> Any:
        rooms = getattr(self.resolving_rooms, "rooms", None)
        keys = rooms.get(plain_room(room)) if rooms else None
        if not keys:
            return original(mgr, room, required_acks)
        # The guard's verdict replaces SGLang's count of ACKs: released by the ledger (every
        # rank's ACK of this lifecycle's generation, or a fence).
        return all(self.guard.releasable(k) for k in keys)

    def node_failed(self, mgr: Any, failed_bootstrap_addr: Any) -> Any:
        self.quiet(lambda: self.decode.prefill_lost(str(failed_bootstrap_addr)))
        return PROCEED

    # ------------------------------------------------------------------ the transfer queue

    def committed(self, queue: Any, decode_req: Any) -> Any:
        key = self.key_of_request(decode_req)
        if key is not None:
            self.quiet(lambda: self.decode.transferred(key))
        return PROCEED

    def deferred(self, queue: Any, out: Any, decode_req: Any) -> Any:
        key = self.key_of_request(decode_req)
        if key is None or not self.guard.tracks(key):
            return out
        entry = queue._deferred_releases[-1]
        self.quiet(lambda: self.decode.held(key, deadline=float(entry[facts.DEFERRED_DEADLINE])))
        # SGLang's rule is `drained or now >= deadline`: the guard keeps the deadline (it
        # quarantines there) and SGLang sees only its verdict.
        queue._deferred_releases[-1] = facts.without_deadline(entry)
        return out

    def resolve(self, queue: Any, original: Original) -> Any:
        guard = self.guard
        guard.tick(time.monotonic())
        self._free_withheld()
        rooms: dict[int, list[str]] = {}
        for entry in queue._deferred_releases:
            key = self.key_of_request(entry[facts.DEFERRED_REQUEST])
            room = None if key is None else guard.room_of(key)
            if key is not None and room is not None:
                rooms.setdefault(room, []).append(key)
        self.resolving_rooms.rooms = rooms
        try:
            return original(queue)
        finally:
            self.resolving_rooms.rooms = None

    def do_release(self, queue: Any, original: Original, decode_req: Any, idx: Any) -> Any:
        guard = self.guard
        key = self.key_of_request(decode_req)
        tracked = key is not None and guard.tracks(key)
        if tracked and not guard.releasable(cast(str, key)):
            # Only the guard's verdict frees a guarded entry: keep it held (the guard refuses
            # the free: typed, logged, counted as freed_refused).
            self.quiet(lambda: guard.freed(cast(str, key)))
            queue._deferred_releases.append(facts.held_entry(decode_req, time.monotonic(), idx))
            return None
        out = original(queue, decode_req, idx)
        if tracked:
            self.quiet(lambda: guard.freed(cast(str, key)))
        return out

    def release_request(self, queue: Any, original: Original, decode_req: Any) -> Any:
        guard = self.guard
        key = self.key_of_request(decode_req)
        if key is None or not guard.tracks(key) or guard.releasable(key):
            return original(queue, decode_req)
        # A free of pages a prefill rank may still write, outside the deferred path.
        if self.accepted(lambda: guard.withheld(key, now=time.monotonic())):
            out = original(queue, decode_req)
            self.quiet(lambda: guard.freed(key))
            return out
        self.withheld[key] = (queue, decode_req)
        return None

    def has_pending(self, queue: Any, out: Any) -> Any:
        return bool(out) or any(q is queue for q, _ in self.withheld.values())

    def num_pending(self, queue: Any, out: Any) -> Any:
        return int(out) + sum(1 for q, _ in self.withheld.values() if q is queue)

    def _free_withheld(self) -> None:
        """The withheld frees the ledger released since: handed back to SGLang now."""
        released = self.guard.take_released()
        if not released:
            return
        release = self.patches.original(facts.TRANSFER_QUEUE, "_release_request")
        for key in released:
            held = self.withheld.pop(key, None)
            if held is None:
                continue
            queue, decode_req = held
            release(queue, decode_req)
            self.quiet(lambda k=key: self.guard.freed(k))  # type: ignore[misc]


__all__ = ["DecodeHooks"]
