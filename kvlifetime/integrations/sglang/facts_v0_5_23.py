"""Engine facts of SGLang 0.5.23: where the guard's hooks sit, and every private detail of
SGLang they rely on, in one place.

SGLang has no connector plugin API, so the guard replaces functions on SGLang's own classes.
``DECODE_HOOKS`` and ``PREFILL_HOOKS`` are those places as rows (engine class, attribute, when,
core event, handler: ``kvlifetime.integrations.hooks``); ``decode_hooks.DecodeHooks`` and
``prefill_hooks.PrefillHooks`` hold the handlers. ``FACTS`` lists what the handlers read or
rewrite beyond the rows' targets (fields, the deferred-release tuple's layout, the frame counts
of SGLang's ABORT and ABORT_ACK), each with the SGLang code it mirrors; the functions below are
the only code of kvlifetime that reads them. ``check()`` verifies the version, SGLang's
deferred-release setting, every row's target and every fact on the installed SGLang, when the
guard is installed: a mismatch is a typed error and nothing is wrapped.

Importable without SGLang: SGLang is imported when a fact is used or checked.
"""

from __future__ import annotations

import math
from typing import Any

from kvlifetime import inputs
from kvlifetime.integrations import engine_facts
from kvlifetime.integrations.engine_facts import CALLS, FIELD, MEMBER, UNPACKS, Fact
from kvlifetime.integrations.hooks import Hook
from kvlifetime.integrations.sglang.errors import (
    UnsupportedEngineSetting,
    UnsupportedEngineVersion,
)

VERSION = "0.5.23"
"""The SGLang version these facts describe (``sglang.__version__``, exactly)."""

_D = "sglang.srt.disaggregation.decode"
_P = "sglang.srt.disaggregation.prefill"
_C = "sglang.srt.disaggregation.common.conn"
_M = "sglang.srt.disaggregation.mooncake.conn"
_SCHED = "sglang.srt.managers.scheduler:Scheduler"
PREFILL_MODULE = _P
"""SGLang's prefill module (its ``release_kv_cache`` frees a request's source pages)."""
TRANSFER_QUEUE = f"{_D}:DecodeTransferQueue"
"""SGLang's decode transfer queue (the deferred releases live there)."""

# --------------------------------------------------------------------------- the hooks

DECODE_HOOKS: tuple[Hook, ...] = (
    Hook(f"{_D}:DecodePreallocQueue", "__init__", "after", "the ledger sized to the KV pool",
         "bind_from_allocator"),
    Hook(f"{_D}:DecodePreallocQueue", "add", "before",
         "admitted (a malformed room: the request failed with 400, nothing allocated)", "admit"),
    Hook(f"{_C}:CommonKVReceiver", "send_metadata", "before",
         "granted: WRITE on the pages, before their ids leave", "publish"),
    Hook(f"{_C}:CommonKVReceiver", "_send_abort_notification", "around",
         "(the lifecycle whose ABORT is being sent)", "sending_abort"),
    Hook(f"{_C}:CommonKVReceiver", "_connect_to_bootstrap_server", "before",
         "(the rank the next ABORT goes to)", "connecting", kind="classmethod"),
    Hook(f"{_C}:AbortNotification", "to_zmq", "after",
         "(the rank's token after SGLang's frames)", "abort_frames"),
    Hook(f"{_C}:CommonKVManager", "handle_abort_ack_message", "around",
         "(the ABORT_ACK's frames, for its token)", "reading_ack"),
    Hook(f"{_C}:CommonKVManager", "register_deferred_abort_room", "after",
         "the ABORT generation armed", "armed"),
    Hook(f"{_C}:CommonKVManager", "note_abort_ack", "before",
         "proof: an ABORT_ACK (one rank's)", "acked"),
    Hook(f"{_C}:CommonKVManager", "is_abort_release_safe", "around",
         "releasable? (the guard's verdict for its rooms)", "release_safe"),
    Hook(f"{_C}:CommonKVManager", "_handle_node_failure", "before",
         "proof: the prefill is lost (PeerLost)", "node_failed"),
    Hook(TRANSFER_QUEUE, "_commit_transfer_to_req", "before",
         "proof: Success", "committed"),
    Hook(TRANSFER_QUEUE, "_defer_release", "after",
         "ended: held, the guard's deadline", "deferred"),
    Hook(TRANSFER_QUEUE, "resolve_deferred_releases", "around",
         "deadline (the tick), withheld frees handed back", "resolve"),
    Hook(TRANSFER_QUEUE, "_do_release", "around",
         "handed back (refused unless releasable)", "do_release"),
    Hook(TRANSFER_QUEUE, "_release_request", "around",
         "handed back (withheld unless releasable)", "release_request"),
    Hook(TRANSFER_QUEUE, "has_pending_deferred_releases", "after",
         "(withheld frees count as pending)", "has_pending"),
    Hook(TRANSFER_QUEUE, "num_pending_deferred_releases", "after",
         "(withheld frees count as pending)", "num_pending"),
)  # fmt: skip
"""Where the decode's guard sits (``install(role="decode")``), in the order applied."""

PREFILL_HOOKS: tuple[Hook, ...] = (
    Hook(f"{_P}:PrefillBootstrapQueue", "__init__", "after", "the ledger sized to the KV pool",
         "bind_from_pool"),
    Hook(f"{_P}:PrefillBootstrapQueue", "add", "before",
         "admitted (a malformed room: the request failed with 400, nothing allocated)", "admit"),
    Hook(f"{_C}:CommonKVSender", "send", "before",
         "granted: READ on the chunk's source pages, before it is queued", "send"),
    Hook(f"{_M}:MooncakeKVManager", "_handle_abort_notification", "before",
         "(the token a guarded decode's ABORT carries)", "abort_received"),
    Hook(f"{_C}:CommonKVManager", "_send_abort_ack", "around",
         "(the token the ACK being sent echoes)", "sending_ack"),
    Hook(f"{_C}:AbortAck", "to_zmq", "after", "(the echoed token after SGLang's frames)",
         "ack_frames"),
    Hook(PREFILL_MODULE, "release_kv_cache", "around",
         "ended; handed back once drained (held until then)", "release_kv_cache",
         kind="function"),
    Hook(f"{_P}:SchedulerDisaggregationPrefillMixin", "process_disagg_prefill_inflight_queue",
         "before", "proof: drained; deadline; held frees handed back", "inflight"),
    Hook(_SCHED, "is_fully_idle", "before", "(not idle while a free is held)", "idle"),
)  # fmt: skip
"""Where the prefill's guard sits (``install(role="prefill")``), in the order applied."""

# --------------------------------------------------------------------------- what else is relied on

DEFERRED_REQUEST = 0
"""The decode request's position in a ``_deferred_releases`` entry."""
DEFERRED_DEADLINE = 2
"""The deadline's position in a ``_deferred_releases`` entry."""
ABORT_FRAMES = 5
"""The frames of SGLang's ABORT (``AbortNotification.to_zmq``); a sixth, which SGLang's parser
ignores, carries a guarded decode's token."""
ACK_FRAMES = 4
"""The frames of SGLang's ABORT_ACK (``AbortAck.to_zmq``); a fifth carries the echoed token."""

FACTS: tuple[Fact, ...] = (
    Fact(TRANSFER_QUEUE, "_deferred_releases", UNPACKS,
         "decode.py: _defer_release appends (decode_req, start_time, deadline, "
         "metadata_buffer_index, required_acks) and resolve_deferred_releases unpacks them so: "
         "DecodeHooks.deferred sets the deadline to inf, do_release appends such an entry",
         method="resolve_deferred_releases",
         layout=("decode_req", "_", "deadline", "_", "required_acks")),
    Fact(TRANSFER_QUEUE, "entry", UNPACKS,
         "decode.py: resolve_deferred_releases unpacks each entry it releases as (decode_req, "
         "start_time, _, idx, _) and frees through _do_release(decode_req, idx): held_entry puts "
         "the start time at 1 and the metadata slot at 3",
         method="resolve_deferred_releases",
         layout=("decode_req", "start_time", "_", "idx", "_")),
    Fact(f"{_D}:DecodePreallocQueue", "token_to_kv_pool_allocator", FIELD,
         "the KV pool's allocator (its size and page_size): decode_pages"),
    Fact(f"{_D}:DecodePreallocQueue", "scheduler", FIELD,
         "the scheduler a malformed request is failed through (fail_bad_request)"),
    Fact(f"{_P}:PrefillBootstrapQueue", "scheduler", FIELD, "as the decode's (fail_bad_request)"),
    Fact(f"{_P}:PrefillBootstrapQueue", "token_to_kv_pool", FIELD,
         "the KV pool when the queue has no scheduler (prefill_pages)"),
    Fact(_SCHED, "output_streamer", FIELD,
         "streams a failed request's error to its client (fail_bad_request)",
         method="init_output_streamer"),
    Fact("sglang.srt.disaggregation.utils", "prepare_abort", MEMBER,
         "fails a request with a message and a status code (fail_bad_request)"),
    Fact(f"{_D}:DecodeRequest", "kv_receiver", FIELD,
         "the request's receiver, where the guard keeps the lifecycle key"),
    Fact(f"{_C}:CommonKVReceiver", "bootstrap_room", FIELD, "the room, checked at the hooks"),
    Fact(f"{_C}:CommonKVReceiver", "bootstrap_addr", FIELD, "the prefill a room is published to"),
    Fact(f"{_C}:CommonKVReceiver", "conclude_state", FIELD,
         "set to Failed by the hooks for a room that turned malformed after admission"),
    Fact(f"{_C}:CommonKVReceiver", "bootstrap_infos", FIELD,
         "one entry per prefill rank an ABORT goes to (abort_token, do_release)",
         method="_setup_bootstrap_infos"),
    Fact(f"{_C}:CommonKVReceiver", "prefill_info", FIELD,
         "the prefill's pp and cp sizes (prefill_ranks)", method="init"),
    Fact(f"{_C}:CommonKVReceiver", "target_tp_ranks", FIELD, "prefill_ranks", method="init"),
    Fact(f"{_C}:CommonKVReceiver", "target_cp_ranks", FIELD, "prefill_ranks", method="init"),
    Fact(f"{_C}:CommonKVReceiver", "target_pp_ranks", FIELD, "prefill_ranks", method="init"),
    Fact(f"{_C}:CommonKVSender", "conclude_state", FIELD, "as the receiver's"),
    Fact(f"{_C}:CommonKVSender", "kv_mgr", FIELD, "the room's manager (drained, poisoned)"),
    Fact(f"{_C}:CommonKVManager", "_staging_outstanding", FIELD,
         "the chunks of a room inside send_kvcache, counted at dequeue (drained)"),
    Fact(f"{_C}:CommonKVManager", "request_status", FIELD, "a room's KVPoll status (drained)"),
    Fact(f"{_C}:CommonKVManager", "_deferred_ack_poisoned_rooms", FIELD,
         "rooms whose send the transfer worker could not settle (PrefillHooks.observe)"),
    Fact(_C, "ABORT_TAG", MEMBER, "the first frame of an ABORT (PrefillHooks.abort_received)"),
    Fact(f"{_C}:AbortNotification", "from_zmq", MEMBER, "parses an ABORT's frames"),
    Fact(f"{_C}:AbortNotification", "deferred_ack_target", MEMBER,
         "whether an ABORT asks for an ACK, and whom to send it to"),
    Fact(f"{_C}:CommonKVManager", "to_zmq", CALLS,
         "the prefill ACKs an ABORT through AbortAck.to_zmq (PrefillHooks.sending_ack)",
         method="_send_abort_ack"),
    Fact("sglang.srt.environ:Envs", "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", MEMBER,
         "the deferred decode KV release the decode's guard takes over (check)"),
)  # fmt: skip
"""Every private detail of SGLang 0.5.23 the handlers rely on besides the rows' targets."""


def check(role: str) -> None:
    """SGLang's version, its deferred-release setting, the ``role``'s rows and every fact, on
    the installed SGLang: ``UnsupportedEngineVersion`` naming what is not found,
    ``UnsupportedEngineSetting`` when the deferred decode KV release is off. Imports SGLang."""
    import importlib

    from kvlifetime.extras import needs

    with needs("sglang", "kvlifetime.integrations.sglang.install"):
        sglang = importlib.import_module("sglang")
    version = getattr(sglang, "__version__", None)
    if version != VERSION:
        raise UnsupportedEngineVersion(
            f"kvlifetime's SGLang hooks are built and tested for SGLang {VERSION}; "
            f"this is {version!r}: its release points may have moved, so nothing was wrapped"
        )
    rows = DECODE_HOOKS if role == "decode" else PREFILL_HOOKS
    missing = engine_facts.missing([row.fact for row in rows] + list(FACTS))
    if missing:
        raise UnsupportedEngineVersion(
            f"kvlifetime's SGLang hooks rely on private details of SGLang {VERSION} "
            "(kvlifetime/integrations/sglang/facts_v0_5_23.py) that this SGLang does not have: "
            f"{', '.join(missing)}; nothing was wrapped"
        )
    from sglang.srt.environ import envs

    if not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
        raise UnsupportedEngineSetting(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off: SGLang then frees a "
            "failed transfer's pages at once and counts no ABORT_ACK; the guard needs it on "
            "(SGLang's default)"
        )


# --------------------------------------------------------------------------- the facts


def decode_pages(queue: Any) -> int:
    """The ledger's size for a ``DecodePreallocQueue``: the KV pool's pages, and two spare."""
    alloc = queue.token_to_kv_pool_allocator
    return int(alloc.size) // int(alloc.page_size) + 2


def prefill_pages(queue: Any) -> int:
    """The ledger's size for a ``PrefillBootstrapQueue`` (its scheduler's allocator, or its
    KV pool when it has no scheduler): the pages, and two spare."""
    alloc = getattr(getattr(queue, "scheduler", None), "token_to_kv_pool_allocator", None)
    if alloc is not None:
        return int(alloc.size) // int(alloc.page_size) + 2
    pool = queue.token_to_kv_pool
    return int(pool.size) // int(pool.page_size) + 2


def prefill_ranks(receiver: Any) -> list[int]:
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


def required_acks(receiver: Any) -> int:
    """The ACKs SGLang waits for before it frees a device destination: one per rank."""
    return len(getattr(receiver, "bootstrap_infos", ()) or ())


def held_entry(decode_req: Any, now: float, idx: Any) -> tuple[Any, ...]:
    """A ``_deferred_releases`` entry that only the guard's verdict resolves (no deadline)."""
    return (decode_req, now, math.inf, idx, required_acks(decode_req.kv_receiver))


def without_deadline(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """``entry`` with SGLang's deadline taken away (the guard keeps it and quarantines there)."""
    return (*entry[:DEFERRED_DEADLINE], math.inf, *entry[DEFERRED_DEADLINE + 1 :])


def drained(mgr: Any, room: int) -> bool:
    """No chunk of ``room`` is inside ``send_kvcache`` and none will start: the worker counts a
    chunk at dequeue (``_staging_outstanding``) and drops the chunks of a Failed (or cleared)
    room; a Success room has sent its last chunk."""
    from sglang.srt.disaggregation.base import KVPoll

    if mgr._staging_outstanding.get(room, 0) > 0:
        return False
    status = mgr.request_status.get(room)
    return status is None or status in (KVPoll.Failed, KVPoll.Success)


def poisoned(mgr: Any, room: int) -> bool:
    """The transfer worker could not settle ``room``'s send (SGLang poisoned it)."""
    return room in getattr(mgr, "_deferred_ack_poisoned_rooms", ())


def kv_poll() -> Any:
    from sglang.srt.disaggregation.base import KVPoll

    return KVPoll


def fail_bad_request(scheduler: Any, req: Any, side: str) -> None:
    """Fail ``req`` as SGLang fails a bad request at intake (its queues' capacity check):
    ``prepare_abort`` with 400 and the error streamed to the client; it is not queued."""
    from http import HTTPStatus

    from sglang.srt.disaggregation.utils import prepare_abort

    message = (
        f"Request {getattr(req, 'rid', '?')} has a malformed bootstrap_room "
        f"({inputs._show(getattr(req, 'bootstrap_room', None))}): it must be an int in "
        "[0, 2**64) (kvlifetime's SGLang guard)"
    )
    trace = getattr(getattr(getattr(req, "time_stats", None), "trace_ctx", None), "abort", None)
    if side == "prefill" and callable(trace):
        trace(abort_info={"reason": message})
    prepare_abort(req, message, status_code=HTTPStatus.BAD_REQUEST)
    scheduler.output_streamer.stream_output([req], req.return_logprob)


__all__ = [
    "ABORT_FRAMES",
    "ACK_FRAMES",
    "DECODE_HOOKS",
    "FACTS",
    "PREFILL_HOOKS",
    "PREFILL_MODULE",
    "TRANSFER_QUEUE",
    "VERSION",
    "check",
    "decode_pages",
    "drained",
    "fail_bad_request",
    "held_entry",
    "kv_poll",
    "poisoned",
    "prefill_pages",
    "prefill_ranks",
    "required_acks",
    "without_deadline",
]
