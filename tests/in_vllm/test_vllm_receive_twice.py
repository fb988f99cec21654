"""Issue 20 item 5 (c), vLLM #51786: one receive reported twice, and MultiConnector reporting
one id on both channels, for a decode request loading its prompt's KV."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.testing import blocks_of, free_in_pool, output, request, step


def _loading(guarded: bool) -> tuple[Any, Any, list[int]]:
    from kvlifetime.integrations.vllm.testing import scheduler

    s = scheduler(guarded=guarded)
    r = request(remote_prefill=True)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return s, r, blocks_of(s, r)


def _both_channels(guarded: bool) -> tuple[Any, Any, list[int]]:
    s, r, ids = _loading(guarded)
    step(s, output(finished_sending={r.request_id}, finished_recving={r.request_id}))
    return s, r, ids


def test_vllm_alone_frees_a_loading_request_on_a_send() -> None:
    with pytest.raises(AssertionError):  # _free_blocks: request.is_finished()
        _both_channels(guarded=False)


def test_guard_drops_the_send_of_a_loading_request_and_the_load_completes() -> None:
    s, r, ids = _both_channels(guarded=True)
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    assert r.request_id in s.requests and not free_in_pool(s, ids)
    assert c.guard.stats().dropped == {"wrong_channel": 1}
    # The same receive again, a step later: a duplicate, never vLLM's assert.
    step(s, output([r], finished_recving={r.request_id}))
    assert r.request_id in s.requests and not free_in_pool(s, ids)
    assert c.guard.stats().dropped == {"wrong_channel": 1, "duplicate_id": 1}
