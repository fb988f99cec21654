"""The prefill's handlers (``install(role="prefill")``): one method per row of
``facts_v0_5_23.PREFILL_HOOKS`` (SGLang's sender, its frees of source pages, the inflight poll,
the idle check, and the ABORT token each ACK echoes), each translating what SGLang does at that
point into the ``PrefillGuard``'s calls. SGLang's private details are read through the facts
module only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvlifetime.integrations.hooks import PROCEED
from kvlifetime.integrations.sglang import facts_v0_5_23 as facts
from kvlifetime.integrations.sglang.guard import PrefillGuard
from kvlifetime.integrations.sglang.installation import Installation

Original = Callable[..., Any]


class PrefillHooks(Installation):
    """The prefill's handlers over one ``PrefillGuard``."""

    ROWS = facts.PREFILL_HOOKS

    def __init__(self, guard: PrefillGuard) -> None:
        super().__init__(guard)
        self.prefill = guard
        # Held frees (key -> release_kv_cache's arguments), and each lifecycle's manager.
        self.pending: dict[str, tuple[Any, Any, bool]] = {}
        self.managers: dict[str, Any] = {}
        self.echoing = threading.local()  # the token the ACK being sent echoes

    # ------------------------------------------------------------------ the bootstrap queue

    def bind_from_pool(self, queue: Any, out: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.guard.bound:
            self.guard.bind(facts.prefill_pages(queue))
        return out

    def admit(self, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if self.room(req, "prefill_admission") is None:
            facts.fail_bad_request(queue.scheduler, req, "prefill")
            return None
        return PROCEED

    # ------------------------------------------------------------------ the sender

    def send(self, sender: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(sender, "conclude_state", None) is not None or not self.guard.bound:
            return PROCEED
        room = self.room(sender, "send")
        if room is None:
            # Admission refuses these; a room that changed since: nothing is queued (the
            # worker reads nothing) and SGLang fails the request.
            sender.conclude_state = facts.kv_poll().Failed
            return None
        key = self.key_of(sender)
        new = self.accepted(lambda: self.prefill.sending(key, room, kv_indices))
        if new is not None:
            self.set_key(sender, new)
            self.managers[new] = sender.kv_mgr
        return PROCEED

    # ------------------------------------------------------------------ ABORT and its ACK

    def abort_received(self, mgr: Any, msg: Any) -> Any:
        from sglang.srt.disaggregation.common import conn

        n = facts.ABORT_FRAMES
        if isinstance(msg, list) and len(msg) > n and msg[0] == conn.ABORT_TAG:
            # A guarded decode's token for this rank, after SGLang's frames: recorded before
            # SGLang handles the ABORT (it may ACK at once).
            note = conn.AbortNotification.from_zmq(msg)
            if note is not None and note.deferred_ack_target() is not None:
                self.quiet(
                    lambda: self.prefill.abort_received(
                        note.room, note.decode_ip, note.decode_port, note.generation, token=msg[n]
                    )
                )
        return PROCEED

    def sending_ack(self, mgr: Any, original: Original, room: Any, target: Any) -> Any:
        self.echoing.token = self.prefill.echo_token(
            room, target.ip, target.port, target.generation
        )
        try:
            return original(mgr, room, target)
        finally:
            self.echoing.token = None

    def ack_frames(self, ack: Any, frames: Any) -> Any:
        token = getattr(self.echoing, "token", None)
        if token is not None and len(frames) == facts.ACK_FRAMES:
            frames.append(token.encode("ascii"))  # SGLang's parser ignores the next frame
        return frames

    # ------------------------------------------------------------------ frees of source pages

    def release_kv_cache(
        self, req: Any, original: Original, tree_cache: Any, *, checkpoint: bool
    ) -> Any:
        key = self.key_of(getattr(req, "disagg_kv_sender", None))
        if key is None or not self.guard.tracks(key):
            return original(req, tree_cache, checkpoint=checkpoint)
        self.observe(key)
        if self.accepted(lambda: self.prefill.ended(key, now=time.monotonic())):
            out = original(req, tree_cache, checkpoint=checkpoint)
            self.freed(key)
            return out
        # Source pages the transfer worker may still read: freed once drained.
        self.pending[key] = (req, tree_cache, checkpoint)
        return None

    def inflight(self, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        for key in list(self.pending):
            self.observe(key)
        self.guard.tick(time.monotonic())
        released = self.guard.take_released()
        if released:
            release = self.patches.original(facts.PREFILL_MODULE, "release_kv_cache")
            for key in released:
                held = self.pending.pop(key, None)
                if held is not None:
                    req, tree_cache, checkpoint = held
                    release(req, tree_cache, checkpoint=checkpoint)
                    self.freed(key)
        return PROCEED

    def idle(self, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        # A free the guard holds keeps pages out of the allocator: SGLang's idle check would
        # report them as leaked (and flush_cache would clear the pool under them).
        return False if self.pending else PROCEED

    # ------------------------------------------------------------------ what SGLang shows

    def observe(self, key: str) -> None:
        """What SGLang's prefill manager shows about the room: drained, or poisoned."""
        mgr = self.managers.get(key)
        if mgr is None or self.guard.room_shared_with(key) is not None:
            return  # (a reused room's count cannot be attributed: nothing to observe)
        room = int(key.split(":", 1)[1].split("#", 1)[0])
        if facts.poisoned(mgr, room):
            if self.guard.lifecycle(key)["suspect"] != "poisoned":
                self.quiet(lambda: self.prefill.poisoned(key))
            return
        if facts.drained(mgr, room):
            self.quiet(lambda: self.prefill.drained(key))

    def freed(self, key: str) -> None:
        self.quiet(lambda: self.guard.freed(key))
        self.managers.pop(key, None)


__all__ = ["PrefillHooks"]
