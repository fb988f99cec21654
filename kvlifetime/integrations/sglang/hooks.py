"""The thin hooks: SGLang 0.5.23's release points, wrapped so every decision to reuse a page goes
through the process's ``SGLangGuard``. With ``prefill_hooks`` (the prefill's half) and
``engine_calls`` (SGLang calls both make), the only modules of kvlifetime that import SGLang,
and only inside ``install`` or a hook. Every value a hook reads from SGLang passes one check at
the entry (a room: ``SGLangGuard.engine_room``, at admission on both sides; a malformed one
fails the request as SGLang fails a bad request, before anything is allocated).

SGLang has no connector plugin API (its transfer backends are a closed enum), so the hooks
replace functions on SGLang's own classes and one module attribute, remember each original,
and ``uninstall`` puts every one back. ``install`` must run before the scheduler (or a driver)
builds its disaggregation queues: the queues' constructors bind the guard's ledger to the KV
pool's size, and receivers and senders made before it are not guarded.

Decode (``role="decode"``; ``sglang.srt.disaggregation``):

- ``DecodePreallocQueue.add``: the request's room checked at the door;
- ``CommonKVReceiver._connect_to_bootstrap_server``, ``AbortNotification.to_zmq``,
  ``CommonKVManager.handle_abort_ack_message``: each rank's ABORT carries its token and each
  ACK's echo is read (``tokens.py``);
- ``CommonKVReceiver.send_metadata`` (called by ``DecodePreallocQueue._send_kv_metadata``): the
  WRITE grants, opened before the page ids and the metadata slot leave the process;
- ``CommonKVReceiver._send_abort_notification`` and
  ``CommonKVManager.register_deferred_abort_room``: the ABORT generation armed for the
  lifecycle, recorded before the ABORT leaves (an ACK can come back before
  ``_send_abort_notification`` returns);
- ``CommonKVManager.note_abort_ack`` (an ABORT_ACK, on the decode thread),
  ``is_abort_release_safe`` (answered by the guard for the rooms it holds),
  ``_handle_node_failure`` (heartbeat loss: ``PeerLost``);
- ``DecodeTransferQueue._commit_transfer_to_req`` (Success), ``_defer_release`` (the hold, its
  deadline taken over by the guard), ``resolve_deferred_releases`` (the guard's tick first:
  an overdue unproven entry stays held, quarantined), ``_do_release`` (refused unless the
  ledger released it), ``_release_request`` (a free outside the deferred path is withheld),
  ``has_pending_deferred_releases`` / ``num_pending_deferred_releases`` (withheld entries
  count, so SGLang's idle check stays honest).

Prefill (``role="prefill"``):

- ``PrefillBootstrapQueue.add``: the room checked at the door;
- ``MooncakeKVManager._handle_abort_notification``, ``CommonKVManager._send_abort_ack``,
  ``AbortAck.to_zmq``: the token an ABORT carried, echoed in its ACK;
- ``CommonKVSender.send``: a READ grant over the chunk's source pages before it is queued;
- ``sglang.srt.disaggregation.prefill.release_kv_cache`` (every free in prefill.py, the inflight
  queue's Success and Failed branches among them): held until the room is drained;
- ``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue``: the drain
  check (``_staging_outstanding``, poisoned rooms, the room's status) and the deferred frees,
  every poll, before SGLang's own.
- ``Scheduler.is_fully_idle``: not idle while a free is held (SGLang's idle check would count
  the held pages as leaked, and ``flush_cache`` would clear the pool under them).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import structlog

from kvlifetime.errors import KVLifetimeError, UnauthorizedEvidence
from kvlifetime.integrations.sglang import prefill_hooks
from kvlifetime.integrations.sglang.engine_calls import fail_bad_request, kv_poll, plain_room
from kvlifetime.integrations.sglang.errors import (
    AlreadyInstalled,
    UnsupportedEngineSetting,
    UnsupportedEngineVersion,
)
from kvlifetime.integrations.sglang.guard import DecodeGuard, PrefillGuard, SGLangGuard
from kvlifetime.integrations.sglang.prefill_hooks import drained
from kvlifetime.integrations.sglang.signals import SUPPORTED_VERSION

_log = structlog.get_logger("kvlifetime.sglang")

# The lifecycle key, set on SGLang's receiver / sender objects with the installation that set it:
# a guard's keys start again at "#1", so a key an earlier installation left on an object that
# outlived it would name another lifecycle of the current guard.
_KEY = "_kvl_key"

_lock = threading.Lock()
_installed: _Installation | None = None


def current() -> SGLangGuard | None:
    inst = _installed
    return None if inst is None else inst.guard


def install(
    *,
    role: Literal["decode", "prefill"],
    ledger_blocks: int | None = None,
    drain_timeout: float = 30.0,
    incarnation: str | None = None,
    prefill_guarded: bool = False,
) -> SGLangGuard:
    """Check SGLang's version and settings, build the guard, wrap the release points.

    Refused, with nothing wrapped: another SGLang version (``UnsupportedEngineVersion``),
    deferred decode KV release turned off (``UnsupportedEngineSetting``), a second install
    (``AlreadyInstalled``), a bad argument (``InvalidField``)."""
    global _installed
    guard = SGLangGuard(
        role=role,
        ledger_blocks=ledger_blocks,
        incarnation=incarnation,
        drain_timeout=drain_timeout,
        prefill_guarded=prefill_guarded,
    )
    with _lock:
        if _installed is not None:
            raise AlreadyInstalled(f"the {_installed.guard.role} guard is installed")
        _check_engine()
        inst = _Installation(guard)
        try:
            if role == "decode":
                inst.decode()
            else:
                inst.prefill()
        except BaseException:
            inst.restore()
            raise
        _installed = inst
    if structlog.is_configured():
        _log.info("sglang_guard_installed", role=role, version=SUPPORTED_VERSION)
    return guard


def uninstall() -> None:
    global _installed
    with _lock:
        inst, _installed = _installed, None
    if inst is not None:
        inst.restore()
        if structlog.is_configured():
            _log.info("sglang_guard_uninstalled", role=inst.guard.role)


def _check_engine() -> None:
    import importlib

    from kvlifetime.extras import needs

    with needs("sglang", "kvlifetime.integrations.sglang.install"):
        sglang = importlib.import_module("sglang")
    version = getattr(sglang, "__version__", None)
    if version != SUPPORTED_VERSION:
        raise UnsupportedEngineVersion(
            f"kvlifetime's SGLang hooks are built and tested for SGLang {SUPPORTED_VERSION}; "
            f"this is {version!r}: its release points may have moved, so nothing was wrapped"
        )
    from sglang.srt.environ import envs

    if not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
        raise UnsupportedEngineSetting(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off: SGLang then frees a "
            "failed transfer's pages at once and counts no ABORT_ACK; the guard needs it on "
            "(SGLang's default)"
        )


class _Installation:
    """What one ``install`` wrapped, to restore it exactly."""

    def __init__(self, guard: SGLangGuard) -> None:
        self.guard = guard
        self._saved: list[tuple[Any, str, Any]] = []
        # Decode: withheld frees (key -> (transfer queue, decode_req)); the rooms a running
        # resolve_deferred_releases asks about (room -> lifecycle keys).
        self.withheld: dict[str, tuple[Any, Any]] = {}
        self.resolving = threading.local()
        self.arming = threading.local()  # the lifecycle whose ABORT is being armed and sent
        self.acking = threading.local()  # the ABORT_ACK being read (its frames)
        self.echoing = threading.local()  # prefill: the token the ACK being sent echoes
        # Prefill: held frees (key -> (release_kv_cache args)), and each lifecycle's manager.
        self.pending: dict[str, tuple[Any, Any, bool]] = {}
        self.managers: dict[str, Any] = {}

    @property
    def decode_guard(self) -> DecodeGuard:
        """The guard as the decode's (``install(role="decode")`` made a ``DecodeGuard``)."""
        return cast(DecodeGuard, self.guard)

    @property
    def prefill_guard(self) -> PrefillGuard:
        """The guard as the prefill's (``install(role="prefill")`` made a ``PrefillGuard``)."""
        return cast(PrefillGuard, self.guard)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))
        return original

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def key_of(self, obj: Any) -> str | None:
        """The lifecycle key this installation set on ``obj`` (None: none, or another's)."""
        tag = getattr(obj, _KEY, None)
        if type(tag) is tuple and len(tag) == 2 and tag[0] is self and type(tag[1]) is str:
            return tag[1]
        return None

    def key_of_request(self, decode_req: Any) -> str | None:
        return self.key_of(getattr(decode_req, "kv_receiver", None))

    def set_key(self, obj: Any, key: str) -> None:
        setattr(obj, _KEY, (self, key))

    def room(self, obj: Any, at: str) -> int | None:
        """``obj.bootstrap_room`` through the guard's one entry check (``engine_room``): the
        plain int, or None when it is malformed (refused there: typed, counted, logged)."""
        try:
            return self.guard.engine_room(getattr(obj, "bootstrap_room", None), at=at)
        except KVLifetimeError:
            return None

    def _quiet(self, call: Callable[[], Any]) -> Any:
        """A guard call from inside SGLang: a refusal is already typed, logged and counted by
        the guard; SGLang keeps running."""
        try:
            return call()
        except KVLifetimeError:
            return None

    # ================================================================== decode

    def decode(self) -> None:
        from sglang.srt.disaggregation import decode as dmod
        from sglang.srt.disaggregation.common import conn
        from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver

        guard = self.decode_guard
        inst = self
        tq = dmod.DecodeTransferQueue

        def bind_from_allocator(orig: Any) -> Any:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                orig(self, *args, **kwargs)
                if not guard.bound:
                    alloc = self.token_to_kv_pool_allocator
                    guard.bind(int(alloc.size) // int(alloc.page_size) + 2)

            return __init__

        self.wrap(dmod.DecodePreallocQueue, "__init__", bind_from_allocator)

        def admit(orig: Any) -> Any:
            def wrapped(self: Any, req: Any, *a: Any, **kw: Any) -> Any:
                if inst.room(req, "decode_admission") is None:
                    # Before anything is allocated: failed as SGLang fails a bad request.
                    fail_bad_request(self.scheduler, req, "decode")
                    return None
                return orig(self, req, *a, **kw)

            return wrapped

        self.wrap(dmod.DecodePreallocQueue, "add", admit)

        def send_metadata(orig: Any) -> Any:
            def wrapped(
                self: Any, kv_indices: Any, aux_index: Any = None, *a: Any, **kw: Any
            ) -> Any:
                infos = getattr(self, "bootstrap_infos", None)
                device = "destination" not in kw or getattr(kw["destination"], "name", "") in (
                    "DEVICE",
                    "",
                )
                if infos and device and aux_index is not None:
                    room = inst.room(self, "publish")
                    if room is None:
                        # Admission refuses these; a room that changed since is not published
                        # (no address leaves) and SGLang fails the transfer.
                        self.conclude_state = kv_poll().Failed
                        return None
                    key = inst._quiet(
                        lambda: guard.published(
                            room,
                            kv_indices,
                            slot=int(aux_index),
                            ranks=_prefill_ranks(self),
                            prefill=str(self.bootstrap_addr),
                        )
                    )
                    if key is not None:  # a refused re-publish keeps the receiver's lifecycle
                        inst.set_key(self, key)
                return orig(self, kv_indices, aux_index, *a, **kw)

            return wrapped

        self.wrap(CommonKVReceiver, "send_metadata", send_metadata)

        def send_abort(orig: Any) -> Any:
            def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
                # SGLang arms the room (register_deferred_abort_room) and then sends the ABORT;
                # the ACK may come back on the decode thread before this call returns, so the
                # generation is recorded where it is made, for this receiver's lifecycle.
                inst.arming.key = inst.key_of(self)
                inst.arming.receiver = self
                try:
                    return orig(self, *a, **kw)
                finally:
                    inst.arming.key = inst.arming.receiver = inst.arming.info = None

            return wrapped

        self.wrap(CommonKVReceiver, "_send_abort_notification", send_abort)

        def connect(orig: Any) -> Any:
            bound = orig.__func__

            def wrapped(cls: Any, bootstrap_info: Any) -> Any:
                if getattr(inst.arming, "key", None) is not None:
                    inst.arming.info = bootstrap_info  # the rank the next ABORT goes to
                return bound(cls, bootstrap_info)

            return classmethod(wrapped)

        self.wrap(CommonKVReceiver, "_connect_to_bootstrap_server", connect)

        def abort_frames(orig: Any) -> Any:
            def wrapped(self: Any) -> Any:
                frames = orig(self)
                token = inst._abort_token()
                if token is not None and len(frames) == 5:
                    # After SGLang's five frames, which its parser reads; it ignores a sixth.
                    frames.append(token.encode("ascii"))
                return frames

            return wrapped

        self.wrap(conn.AbortNotification, "to_zmq", abort_frames)

        def read_ack(orig: Any) -> Any:
            def wrapped(self: Any, msg: Any) -> Any:
                inst.acking.frames = msg
                try:
                    return orig(self, msg)
                finally:
                    inst.acking.frames = None

            return wrapped

        self.wrap(CommonKVManager, "handle_abort_ack_message", read_ack)

        def register(orig: Any) -> Any:
            def wrapped(self: Any, bootstrap_room: Any) -> Any:
                generation = orig(self, bootstrap_room)
                key = getattr(inst.arming, "key", None)
                if key is not None:
                    inst._quiet(lambda: guard.armed(key, int(generation)))
                return generation

            return wrapped

        self.wrap(CommonKVManager, "register_deferred_abort_room", register)

        def note_ack(orig: Any) -> Any:
            def wrapped(self: Any, room: Any, rank: Any, generation: Any) -> Any:
                frames = getattr(inst.acking, "frames", None)
                # SGLang reads four frames; a guarded prefill echoes its token in a fifth.
                token = frames[4] if isinstance(frames, list) and len(frames) >= 5 else None
                try:
                    guard.acked(room, rank, generation, token=token)
                except UnauthorizedEvidence:
                    return None  # in another rank's name: SGLang's own count never sees it
                except KVLifetimeError:
                    pass  # refused by the guard (typed, logged, counted); SGLang's own rules
                return orig(self, room, rank, generation)

            return wrapped

        self.wrap(CommonKVManager, "note_abort_ack", note_ack)

        def release_safe(orig: Any) -> Any:
            def wrapped(self: Any, room: Any, required_acks: Any) -> Any:
                rooms = getattr(inst.resolving, "rooms", {})
                keys = rooms.get(plain_room(room)) if rooms else None
                if not keys:
                    return orig(self, room, required_acks)
                # The guard's verdict replaces SGLang's count of ACKs: released by the ledger
                # (every rank's ACK of this lifecycle's generation, or a fence).
                return all(guard.releasable(k) for k in keys)

            return wrapped

        self.wrap(CommonKVManager, "is_abort_release_safe", release_safe)

        def node_failure(orig: Any) -> Any:
            def wrapped(self: Any, failed_bootstrap_addr: Any) -> Any:
                inst._quiet(lambda: guard.prefill_lost(str(failed_bootstrap_addr)))
                return orig(self, failed_bootstrap_addr)

            return wrapped

        self.wrap(CommonKVManager, "_handle_node_failure", node_failure)

        def commit(orig: Any) -> Any:
            def wrapped(self: Any, decode_req: Any) -> Any:
                key = inst.key_of_request(decode_req)
                if key is not None:
                    inst._quiet(lambda: guard.transferred(key))
                return orig(self, decode_req)

            return wrapped

        self.wrap(tq, "_commit_transfer_to_req", commit)

        def defer(orig: Any) -> Any:
            def wrapped(self: Any, decode_req: Any) -> Any:
                out = orig(self, decode_req)
                key = inst.key_of_request(decode_req)
                if key is None or not guard.tracks(key):
                    return out
                entry = self._deferred_releases[-1]
                inst._quiet(lambda: guard.held(key, deadline=float(entry[2])))
                # SGLang's rule is `drained or now >= deadline`: the guard keeps the deadline
                # (it quarantines there) and SGLang sees only its verdict.
                self._deferred_releases[-1] = (entry[0], entry[1], math.inf, *entry[3:])
                return out

            return wrapped

        self.wrap(tq, "_defer_release", defer)

        def resolve(orig: Any) -> Any:
            def wrapped(self: Any) -> Any:
                guard.tick(time.monotonic())
                inst._free_withheld(self)
                rooms: dict[int, list[str]] = {}
                for entry in self._deferred_releases:
                    key = inst.key_of_request(entry[0])
                    room = None if key is None else guard.room_of(key)
                    if key is not None and room is not None:
                        rooms.setdefault(room, []).append(key)
                inst.resolving.rooms = rooms
                try:
                    return orig(self)
                finally:
                    inst.resolving.rooms = {}

            return wrapped

        self.wrap(tq, "resolve_deferred_releases", resolve)

        def do_release(orig: Any) -> Any:
            def wrapped(self: Any, decode_req: Any, idx: Any) -> Any:
                key = inst.key_of_request(decode_req)
                if key is not None and guard.tracks(key) and not guard.releasable(key):
                    # Only the guard's verdict frees a guarded entry: keep it held (the guard
                    # refuses the free: typed, logged, counted as freed_refused).
                    inst._quiet(lambda: guard.freed(key))
                    required = len(getattr(decode_req.kv_receiver, "bootstrap_infos", ()) or ())
                    self._deferred_releases.append(
                        (decode_req, time.monotonic(), math.inf, idx, required)
                    )
                    return None
                out = orig(self, decode_req, idx)
                if key is not None and guard.tracks(key):
                    inst._quiet(lambda: guard.freed(key))
                return out

            return wrapped

        self.wrap(tq, "_do_release", do_release)

        def release_request(orig: Any) -> Any:
            def wrapped(self: Any, decode_req: Any) -> Any:
                key = inst.key_of_request(decode_req)
                if key is None or not guard.tracks(key) or guard.releasable(key):
                    return orig(self, decode_req)
                # A free of pages a prefill rank may still write, outside the deferred path.
                if inst._quiet(lambda: guard.withheld(key, now=time.monotonic())):
                    out = orig(self, decode_req)
                    inst._quiet(lambda: guard.freed(key))
                    return out
                inst.withheld[key] = (self, decode_req)
                return None

            return wrapped

        self.wrap(tq, "_release_request", release_request)

        def pending(orig: Any) -> Any:
            def wrapped(self: Any) -> Any:
                return bool(orig(self)) or any(q is self for q, _ in inst.withheld.values())

            return wrapped

        def num_pending(orig: Any) -> Any:
            def wrapped(self: Any) -> Any:
                return int(orig(self)) + sum(1 for q, _ in inst.withheld.values() if q is self)

            return wrapped

        self.wrap(tq, "has_pending_deferred_releases", pending)
        self.wrap(tq, "num_pending_deferred_releases", num_pending)

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
        ranks = _prefill_ranks(receiver)
        return self.decode_guard.abort_token(key, ranks[at]) if at < len(ranks) else None

    def _free_withheld(self, queue: Any) -> None:
        for key in self.guard.take_released():
            held = self.withheld.pop(key, None)
            if held is None:
                continue
            q, decode_req = held
            orig = self._saved_original(type(q), "_release_request")
            orig(q, decode_req)
            self._quiet(lambda k=key: self.guard.freed(k))  # type: ignore[misc]

    def _saved_original(self, owner: Any, name: str) -> Any:
        for o, n, original in self._saved:
            if n == name and isinstance(o, type) and issubclass(owner, o):
                return original
        raise LookupError(name)

    # ================================================================== prefill

    def prefill(self) -> None:
        prefill_hooks.wrap(self)

    def _observe(self, key: str) -> None:
        """What SGLang's prefill manager shows about the room: drained, or poisoned."""
        mgr = self.managers.get(key)
        if mgr is None or self.guard.room_shared_with(key) is not None:
            return  # (a reused room's count cannot be attributed: nothing to observe)
        room = int(key.split(":", 1)[1].split("#", 1)[0])
        if room in getattr(mgr, "_deferred_ack_poisoned_rooms", ()):
            if self.guard.lifecycle(key)["suspect"] != "poisoned":
                self._quiet(lambda: self.prefill_guard.poisoned(key))
            return
        if drained(mgr, room):
            self._quiet(lambda: self.prefill_guard.drained(key))

    def _freed(self, key: str) -> None:
        self._quiet(lambda: self.guard.freed(key))
        self.managers.pop(key, None)

    def _saved_module_original(self, module: Any, name: str) -> Any:
        for o, n, original in self._saved:
            if o is module and n == name:
                return original
        raise LookupError(name)


def _prefill_ranks(receiver: Any) -> list[int]:
    """The prefill ranks that may write, as the ABORT_ACKs name them: SGLang's prefill sends
    ``attn_tp_rank * (pp_size * attn_cp_size) + pp_rank * attn_cp_size + attn_cp_rank``, and
    ``bootstrap_infos`` lists the ranks in this order (cp, then tp, then pp reversed)."""
    info = receiver.prefill_info
    pp, cp = int(info.pp_size), int(info.attn_cp_size)
    return [
        tp * (pp * cp) + p * cp + c
        for c in receiver.target_cp_ranks
        for tp in receiver.target_tp_ranks
        for p in reversed(receiver.target_pp_ranks)
    ]


def wrapped_points() -> Iterator[tuple[Any, str]]:
    """Every (class or module, attribute) the installed hooks replaced (tests check that
    ``uninstall`` puts each original back)."""
    inst = _installed
    if inst is not None:
        for owner, name, _ in inst._saved:
            yield owner, name
