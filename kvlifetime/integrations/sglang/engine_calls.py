"""SGLang calls both sides' hooks make (imported lazily: this module loads without SGLang)."""

from __future__ import annotations

from typing import Any

from kvlifetime import inputs
from kvlifetime.errors import KVLifetimeError
from kvlifetime.integrations.sglang.lifecycles import room_id


def plain_room(value: Any) -> int | None:
    """A room SGLang passes back to a hook for a lookup: the plain int, or None (never a
    refusal: the room was checked where it entered)."""
    try:
        return room_id(value)
    except KVLifetimeError:
        return None


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
