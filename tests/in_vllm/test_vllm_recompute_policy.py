"""Issue 20 item 4: ``kv_load_failure_policy="recompute"`` on vLLM 0.33's real scheduler.

A decode request's asynchronous load fails. vLLM keeps the request waiting for remote KVs until
the worker reports its ``finished_recving``; then, in ``_update_waiting_for_remote_kv``, it frees
the failed load's blocks (nothing valid loaded) or keeps the valid prefix and recomputes the
rest locally, and schedules the request again. A failed transfer proves nothing about what still
lands (the transport may still be writing, NIXL's handle release does not stop it), so those
blocks must not go back to the pool, nor be recomputed into, until a fence.

Guarded, the receive is held: the request keeps its blocks, waiting, until ``revoke``; then vLLM
recovers exactly as it would have, and the blocks the request gets afterwards - never exposed -
are freed at its end as vLLM decides, never quarantined.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request, RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.guard import ConnectorGuard
from kvlifetime.integrations.vllm.testing import (
    advance,
    blocks_of,
    free_in_pool,
    moved_on,
    output,
    request,
    scheduler,
    step,
)


def _loading(guarded: bool) -> tuple[Any, Request, list[int]]:
    s = scheduler(guarded=guarded, kv_load_failure_policy="recompute")
    r = request(remote_prefill=True)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = blocks_of(s, r)
    assert ids and not free_in_pool(s, ids)
    return s, r, ids


def _guard(s: Any) -> ConnectorGuard:
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    return c.guard


def _fail_load(s: Any, r: Request, ids: list[int], how: str) -> None:
    """The worker reports the load failed (the whole request, or some of its blocks) and done."""
    if how == "failed_recving":
        step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    else:
        step(s, output(invalid_block_ids={ids[1]}, finished_recving={r.request_id}))


def _run_to_end(s: Any, r: Request) -> None:
    for _ in range(20):
        if r.is_finished():
            return
        advance(s, r)
    raise AssertionError(f"{r.request_id} did not finish: {r.status}")


def _after_failure(guarded: bool, how: str) -> tuple[Any, Request, list[int]]:
    s, r, ids = _loading(guarded)
    _fail_load(s, r, ids, how)
    advance(s, r)  # vLLM's next schedule() acts on the receive (_update_waiting_for_remote_kv)
    return s, r, ids


def test_vllm_alone_reuses_a_failed_loads_blocks() -> None:
    # Nothing valid loaded: vLLM frees the blocks and schedules the request again (here its
    # pool hands the same blocks straight back to it, to recompute the prompt into).
    s, r, ids = _after_failure(False, "failed_recving")
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens > 0
    assert moved_on(s, ids) == ids
    # Some blocks valid: vLLM keeps them and recomputes from the first invalid one, locally,
    # into the blocks the failed transfer may still write.
    s, r, ids = _after_failure(False, "invalid_block_ids")
    assert r.status == RequestStatus.RUNNING
    assert moved_on(s, ids) == ids


def test_guard_holds_a_failed_loads_blocks_until_a_fence() -> None:
    for how in ("failed_recving", "invalid_block_ids"):
        s, r, ids = _after_failure(True, how)
        g = _guard(s)
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, how
        assert blocks_of(s, r) == ids and moved_on(s, ids) == [], how
        st = g.stats()
        assert st.load_failed == 1 and st.failed_loads_held == 1, how
        advance(s, r)
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, how
        # The fence: at the next scheduler step vLLM gets the receive and recovers as its
        # policy says (no connector output needed: the connector hands it over itself).
        g.revoke("nixl_agent_recreated")
        assert g.stats().failed_loads_held == 1, how  # recorded: applied at the next step
        advance(s, r)  # this schedule() applies the fence and hands the receive over
        advance(s, r)  # and vLLM's next one recovers
        assert r.status == RequestStatus.RUNNING, how
        assert g.stats().failed_loads_held == 0 and g.stats().exposed == 0, how


def test_the_requests_later_blocks_are_never_quarantined() -> None:
    # The guard used to let vLLM recover at once, then delay the request's end because its
    # failed load was unproven, and quarantine the blocks vLLM had given it since: blocks no
    # transfer ever touched. Whatever happens to the failed load, the request's new blocks go
    # back to the pool at its end.
    s, r, _ids = _after_failure(True, "failed_recving")
    g = _guard(s)
    if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        g.revoke("nixl_agent_recreated")  # (held until a fence: the guard above)
    _run_to_end(s, r)
    assert r.request_id not in s.requests
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1  # all but vLLM's null block
    st = g.stats()
    assert st.withheld == 0 and st.ledger.blocks_by_state["quarantined"] == 0
    assert st.ledger.quarantined == ()


def test_abort_while_held_waits_for_the_fence() -> None:
    s, r, ids = _after_failure(True, "failed_recving")
    g = _guard(s)
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    advance(s, r)
    assert r.request_id in s.requests and free_in_pool(s, ids) == []
    assert g.stats().withheld == 1 and g.stats().failed_loads_held == 0
    g.revoke("nixl_agent_recreated")
    advance(s, r)
    assert r.request_id not in s.requests and free_in_pool(s, ids) == ids
