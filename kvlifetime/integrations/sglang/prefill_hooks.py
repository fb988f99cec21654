"""The prefill's hooks (``role="prefill"``; see ``hooks``): SGLang's sender, its frees of
source pages, the inflight poll, the idle check, and the ABORT token each ACK echoes. Called by
``hooks._Installation.prefill`` with the installation, whose ``wrap`` records each original."""

from __future__ import annotations

import time
from typing import Any

from kvlifetime.integrations.sglang.engine_calls import fail_bad_request, kv_poll


def wrap(inst: Any) -> None:
    """Wrap the prefill's release points for ``inst`` (an ``hooks._Installation``)."""
    from sglang.srt.disaggregation import prefill as pmod
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    guard = inst.guard

    def bind_from_pool(orig: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if not guard.bound:
                guard.bind(prefill_pages(self))

        return __init__

    inst.wrap(pmod.PrefillBootstrapQueue, "__init__", bind_from_pool)

    def admit(orig: Any) -> Any:
        def wrapped(self: Any, req: Any, *a: Any, **kw: Any) -> Any:
            if inst.room(req, "prefill_admission") is None:
                fail_bad_request(self.scheduler, req, "prefill")
                return None
            return orig(self, req, *a, **kw)

        return wrapped

    inst.wrap(pmod.PrefillBootstrapQueue, "add", admit)

    def send(orig: Any) -> Any:
        def wrapped(self: Any, kv_indices: Any, *a: Any, **kw: Any) -> Any:
            if getattr(self, "conclude_state", None) is None and guard.bound:
                key = inst.key_of(self)
                room = inst.room(self, "send")
                if room is None:
                    # Admission refuses these; a room that changed since: nothing is
                    # queued (the worker reads nothing) and SGLang fails the request.
                    self.conclude_state = kv_poll().Failed
                    return None
                new = inst._quiet(lambda: guard.sending(key, room, kv_indices))
                if new is not None:
                    inst.set_key(self, new)
                    inst.managers[new] = self.kv_mgr
            return orig(self, kv_indices, *a, **kw)

        return wrapped

    inst.wrap(CommonKVSender, "send", send)

    def read_abort(orig: Any) -> Any:
        def wrapped(self: Any, msg: Any) -> Any:
            if isinstance(msg, list) and len(msg) >= 6 and msg[0] == conn.ABORT_TAG:
                # A guarded decode's token for this rank, after SGLang's five frames:
                # recorded before SGLang handles the ABORT (it may ACK at once).
                note = conn.AbortNotification.from_zmq(msg)
                if note is not None and note.deferred_ack_target() is not None:
                    inst._quiet(
                        lambda: guard.abort_received(
                            note.room,
                            note.decode_ip,
                            note.decode_port,
                            note.generation,
                            token=msg[5],
                        )
                    )
            return orig(self, msg)

        return wrapped

    inst.wrap(MooncakeKVManager, "_handle_abort_notification", read_abort)

    def send_ack(orig: Any) -> Any:
        def wrapped(self: Any, room: Any, target: Any) -> Any:
            inst.echoing.token = guard.echo_token(room, target.ip, target.port, target.generation)
            try:
                return orig(self, room, target)
            finally:
                inst.echoing.token = None

        return wrapped

    inst.wrap(CommonKVManager, "_send_abort_ack", send_ack)

    def ack_frames(orig: Any) -> Any:
        def wrapped(self: Any) -> Any:
            frames = orig(self)
            token = getattr(inst.echoing, "token", None)
            if token is not None and len(frames) == 4:
                frames.append(token.encode("ascii"))  # SGLang's parser ignores a fifth
            return frames

        return wrapped

    inst.wrap(conn.AbortAck, "to_zmq", ack_frames)

    def release_kv_cache(orig: Any) -> Any:
        def wrapped(req: Any, tree_cache: Any, *, checkpoint: bool) -> Any:
            key = inst.key_of(getattr(req, "disagg_kv_sender", None))
            if key is None or not guard.tracks(key):
                return orig(req, tree_cache, checkpoint=checkpoint)
            inst._observe(key)
            if inst._quiet(lambda: guard.ended(key, now=time.monotonic())):
                out = orig(req, tree_cache, checkpoint=checkpoint)
                inst._freed(key)
                return out
            # Source pages the transfer worker may still read: freed once drained.
            inst.pending[key] = (req, tree_cache, checkpoint)
            return None

        return wrapped

    inst.wrap(pmod, "release_kv_cache", release_kv_cache)

    def inflight(orig: Any) -> Any:
        def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
            for key in list(inst.pending):
                inst._observe(key)
            guard.tick(time.monotonic())
            for key in guard.take_released():
                held = inst.pending.pop(key, None)
                if held is not None:
                    req, tree_cache, checkpoint = held
                    original = inst._saved_module_original(pmod, "release_kv_cache")
                    original(req, tree_cache, checkpoint=checkpoint)
                    inst._freed(key)
            return orig(self, *a, **kw)

        return wrapped

    inst.wrap(
        pmod.SchedulerDisaggregationPrefillMixin,
        "process_disagg_prefill_inflight_queue",
        inflight,
    )

    from sglang.srt.managers.scheduler import Scheduler

    def idle(orig: Any) -> Any:
        def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
            # A free the guard holds keeps pages out of the allocator: SGLang's idle check
            # would report them as leaked (and flush_cache would clear the pool under them).
            if inst.pending:
                return False
            return orig(self, *a, **kw)

        return wrapped

    inst.wrap(Scheduler, "is_fully_idle", idle)


def prefill_pages(queue: Any) -> int:
    alloc = getattr(getattr(queue, "scheduler", None), "token_to_kv_pool_allocator", None)
    if alloc is not None:
        return int(alloc.size) // int(alloc.page_size) + 2
    pool = queue.token_to_kv_pool
    return int(pool.size) // int(pool.page_size) + 2


def drained(mgr: Any, room: int) -> bool:
    """No chunk of ``room`` is inside ``send_kvcache`` and none will start: the worker counts a
    chunk at dequeue (``_staging_outstanding``) and drops the chunks of a Failed (or cleared)
    room; a Success room has sent its last chunk."""
    from sglang.srt.disaggregation.base import KVPoll

    if mgr._staging_outstanding.get(room, 0) > 0:
        return False
    status = mgr.request_status.get(room)
    return status is None or status in (KVPoll.Failed, KVPoll.Success)
