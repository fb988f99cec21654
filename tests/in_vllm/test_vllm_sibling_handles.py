"""Issue 20 item 5 (a), vLLM #56104 ("Fix multiple handles xfer race"): one request's KV load
runs as several transfer handles (NIXL reads one handle per remote rank when the prefill runs
more tensor-parallel ranks than the decode). The first handle fails; before the fix, the worker
reported the request failed and done (``failed_recving`` and ``finished_recving``) while the
sibling handles were still writing into the request's blocks, and reported it again when they
ended (the worker itself then tripped an assert on the metadata it had already dropped).

vLLM 0.33's NIXL worker defers the report until the siblings end (the fix). The scheduler sees
the same two sets either way, and a failed transfer proves nothing about what is still in
flight; so the scenario drives the scheduler with the early report, on both failure policies,
and then the siblings' late report.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import Request, RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.testing import (
    advance,
    blocks_of,
    moved_on,
    output,
    request,
    scheduler,
    step,
)

POLICIES = ["fail", "recompute"]


def _first_handle_failed(guarded: bool, policy: str) -> tuple[Any, Request, list[int]]:
    s = scheduler(guarded=guarded, kv_load_failure_policy=policy)
    r = request(remote_prefill=True)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = blocks_of(s, r)
    # The first handle failed; its siblings still write into ids.
    step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    advance(s, r)  # vLLM's next step acts on it (a recompute is scheduled here)
    return s, r, ids


@pytest.mark.parametrize("policy", POLICIES)
def test_vllm_alone_reuses_blocks_the_siblings_still_write(policy: str) -> None:
    # fail: the request ends with an error and its blocks go back to the pool at once;
    # recompute: they are freed and handed straight back to the request, recomputed into.
    s, _r, ids = _first_handle_failed(False, policy)
    assert moved_on(s, ids) == ids


@pytest.mark.parametrize("policy", POLICIES)
def test_guard_keeps_them_aside(policy: str) -> None:
    s, r, ids = _first_handle_failed(True, policy)
    assert moved_on(s, ids) == []
    assert r.request_id in s.requests  # vLLM still holds them, for the guard
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    st = c.guard.stats()
    assert st.load_failed == 1
    # fail: the request ended, its blocks quarantined; recompute: it waits for a fence.
    assert (st.withheld, st.failed_loads_held) == ((1, 0) if policy == "fail" else (0, 1))


def _siblings_report_late(guarded: bool, policy: str) -> tuple[Any, Request, list[int]]:
    s, r, ids = _first_handle_failed(guarded, policy)
    # The sibling handles end: a worker that reports them reports the request done again.
    advance(s, r, finished_recving={r.request_id})
    return s, r, ids


@pytest.mark.parametrize("policy", POLICIES)
def test_vllm_alone_asserts_on_the_siblings_late_report(policy: str) -> None:
    # fail: the request is gone (req_id in self.requests); recompute: it runs again
    # (RequestStatus.is_finished in _update_from_kv_xfer_finished).
    with pytest.raises(AssertionError):
        _siblings_report_late(False, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_guard_drops_the_siblings_late_report(policy: str) -> None:
    s, r, ids = _siblings_report_late(True, policy)
    assert moved_on(s, ids) == [] and r.request_id in s.requests
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    # recompute: a second receive of a held load is a duplicate; fail: an ended request's
    # failed load stays withheld, whatever is reported for it: each report of it is refused
    # (unprovable: only a fence ends it), counted.
    dropped = c.guard.stats().dropped
    assert dropped == ({"duplicate_id": 1} if policy == "recompute" else {"unprovable": 2})
    # The fence ends both: vLLM frees the ended request, and recovers the live one.
    c.guard.revoke("nixl_agent_recreated")
    advance(s, r)
    advance(s, r)
    if policy == "fail":
        assert r.request_id not in s.requests
    else:
        assert r.status == RequestStatus.RUNNING
