"""The scheduler step as the guard's unit of time, through vLLM 0.33's real scheduler and NIXL
connector.

A READ exposure leaves the process with the output of the step whose ``request_finished``
delayed the free: the block ids travel in the request's ``kv_transfer_params``, which vLLM's
``update_from_output`` returns after ``update_connector_output`` and ``get_kv_connector_stats``.
So, within that step:

- a ``finished_sending`` for the request's id is no evidence about this exposure: no reader has
  the block ids yet. It is a stale notice about an earlier request with the same id (vLLM
  #49796's class); dropped (``before_exposure``), the request withheld until a later step's;
- a fence (``revoke``) recorded during the step, from any thread, never releases the blocks of
  the step's own exposures: it covers the exposures of steps that had ended.

And an id vLLM is handed on one channel is never handed on the other (``both_channels``).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from vllm.v1.request import Request, RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.guard import ConnectorGuard
from kvlifetime.integrations.vllm.testing import (
    blocks_of,
    free_in_pool,
    output,
    request,
    scheduler,
    step,
)

NUM_BLOCKS = 64
EVERY_BLOCK = range(1, NUM_BLOCKS)  # block 0 is vLLM's null block


def _guarded(num_blocks: int = NUM_BLOCKS) -> tuple[Any, ConnectorGuard]:
    s = scheduler(guarded=True, num_blocks=num_blocks)
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    return s, c.guard


def _params(outs: Any, request_id: str) -> list[Any]:
    """The transfer parameters vLLM's step output carries for ``request_id``."""
    return [
        o.kv_transfer_params
        for eco in outs.values()
        for o in eco.outputs
        if o.request_id == request_id
    ]


def _leaving(outs: Any) -> dict[str, list[int]]:
    """The requests whose output carries block ids for a remote reader, and those ids."""
    return {
        o.request_id: list(o.kv_transfer_params["remote_block_ids"])
        for eco in outs.values()
        for o in eco.outputs
        if o.kv_transfer_params and o.kv_transfer_params.get("remote_block_ids")
    }


def _prefill_done_with_a_send(s: Any, r: Request) -> Any:
    """One step in which ``r`` (a prefill for a remote decode) finishes and the worker's output
    carries a ``finished_sending`` for its id. Returns the step's outputs."""
    s.add_request(r)
    so = s.schedule()
    outs = s.update_from_output(so, output([r], finished_sending={r.request_id}))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return outs


# ------------------------------------------------------------------ item 1: evidence and exposure


def test_vllm_alone_frees_on_a_send_in_the_step_that_exposes_the_blocks() -> None:
    s = scheduler(guarded=False, num_blocks=NUM_BLOCKS)
    r = request(remote_decode=True)
    outs = _prefill_done_with_a_send(s, r)
    (params,) = _params(outs, r.request_id)
    # The block ids leave with this output, while vLLM has freed the blocks already.
    assert params["remote_block_ids"] and r.request_id not in s.requests


def test_a_send_in_the_step_that_exposes_the_blocks_proves_nothing() -> None:
    s, g = _guarded()
    r = request(remote_decode=True)
    outs = _prefill_done_with_a_send(s, r)
    (params,) = _params(outs, r.request_id)
    assert params["remote_block_ids"]  # the reader learns the ids from this output
    ids = blocks_of(s, r)
    assert r.request_id in s.requests and free_in_pool(s, ids) == []
    st = g.stats()
    assert st.dropped == {"before_exposure": 1} and st.withheld == 1 and st.handed_back == 0
    view = g.request(r.request_id)
    assert view is not None and view.state == "withheld" and view.read is not None
    # A later step's send is the reader's: the id goes back, once.
    step(s, output(finished_sending={r.request_id}))
    assert r.request_id not in s.requests and free_in_pool(s, ids) == ids
    assert g.stats().handed_back == 1 and g.stats().dropped == {"before_exposure": 1}


def test_a_stale_send_for_a_reused_request_id_frees_nothing() -> None:
    # vLLM #49796's class: request ids are the client's; an earlier request's late notice
    # arrives in the step in which a new request with the same id exposes its blocks.
    s, g = _guarded()
    first = request(remote_decode=True)
    s.add_request(first)
    step(s, output([first]))
    step(s, output(finished_sending={first.request_id}))
    assert first.request_id not in s.requests
    again = request(remote_decode=True)
    again.request_id = first.request_id
    _prefill_done_with_a_send(s, again)
    ids = blocks_of(s, again)
    assert again.request_id in s.requests and free_in_pool(s, ids) == []
    assert g.stats().dropped == {"before_exposure": 1}
    step(s, output(finished_sending={again.request_id}))
    assert again.request_id not in s.requests and free_in_pool(s, ids) == ids


def test_a_reaped_lease_in_the_step_that_exposes_the_blocks_frees_nothing() -> None:
    # Stale too, but a reaped lease frees nothing: taken, the request waits for a fence.
    s, g = _guarded()
    r = request(remote_decode=True)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(
        so, output([r], finished_sending={r.request_id}, lease_reaped={r.request_id})
    )
    ids = blocks_of(s, r)
    assert r.request_id in s.requests and free_in_pool(s, ids) == []
    st = g.stats()
    assert st.lease_reaped == 1 and [q.request for q in st.ledger.quarantined] == [r.request_id]
    step(s, output(finished_sending={r.request_id}))
    assert r.request_id in s.requests and free_in_pool(s, ids) == []
    g.revoke("nixl_agent_recreated")
    step(s)
    assert r.request_id not in s.requests and free_in_pool(s, ids) == ids


# ------------------------------------------------------------------ item 2: one channel per id


def _refused_read(s: Any, g: ConnectorGuard, *, both_channels: bool = False) -> Request:
    """A prefill whose READ grant the step's journal refuses (a load in flight into every
    block, unknown to vLLM): vLLM keeps its blocks as NIXL asked, nothing is exposed.
    ``both_channels``: the worker reports its id on both channels in that very step."""
    g.admitted("ghost")
    assert g.allocated("ghost", EVERY_BLOCK, 16, load_async=True) is True
    r = request(remote_decode=True)
    s.add_request(r)
    so = s.schedule()
    sets = {"finished_sending": {r.request_id}, "finished_recving": {r.request_id}}
    outs = s.update_from_output(so, output([r], **(sets if both_channels else {})))
    assert _params(outs, r.request_id) == [{}]  # refused: no block id leaves
    return r


def test_vllm_alone_asserts_on_one_id_on_both_channels() -> None:
    s = scheduler(guarded=False, num_blocks=NUM_BLOCKS)
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    with pytest.raises(AssertionError):
        step(s, output(finished_sending={r.request_id}, finished_recving={r.request_id}))


@pytest.mark.parametrize("when", ["later_step", "refusing_step"])
def test_a_refused_read_is_handed_back_on_one_channel_only(when: str) -> None:
    s, g = _guarded()
    if when == "refusing_step":
        # The worker reports the id on both channels in the very step whose journal refuses
        # the READ grant.
        r = _refused_read(s, g, both_channels=True)
    else:
        r = _refused_read(s, g)
        ids = blocks_of(s, r)
        assert r.request_id in s.requests and free_in_pool(s, ids) == []
        step(s, output(finished_sending={r.request_id}, finished_recving={r.request_id}))
    assert r.request_id not in s.requests  # freed once, on one channel, no assert
    dropped = g.stats().dropped
    assert dropped["both_channels"] == 1 and dropped["exposed_block_reused"] >= 1
    # The other channel a step later: vLLM no longer holds the id.
    step(s, output(finished_sending={r.request_id}, finished_recving={r.request_id}))
    assert g.stats().dropped["both_channels"] == 1


# ------------------------------------------------------------------ item 3: a fence mid-step


def _quarantined(s: Any) -> tuple[Request, list[int]]:
    """A prefill whose send lease was reaped: only a fence frees it."""
    q = request(remote_decode=True)
    s.add_request(q)
    step(s, output([q]))
    step(s, output(finished_sending={q.request_id}, lease_reaped={q.request_id}))
    assert q.request_id in s.requests
    return q, blocks_of(s, q)


def test_a_fence_from_another_thread_mid_step_spares_the_steps_own_exposure() -> None:
    s, g = _guarded()
    q, q_ids = _quarantined(s)
    r = request(remote_decode=True)
    s.add_request(r)
    c = s.connector
    hook = c.update_connector_output

    def racing(connector_output: Any) -> None:
        # Inside update_from_output, after r's request_finished, before the step's outputs
        # leave the scheduler: an operator's thread fences the peers.
        t = threading.Thread(target=g.revoke, args=("nixl_agent_recreated",))
        t.start()
        t.join()
        hook(connector_output)

    c.update_connector_output = racing
    so = s.schedule()
    outs = s.update_from_output(so, output([r], finished_sending=set()))
    del c.update_connector_output
    leaving = _leaving(outs)
    assert r.request_id in leaving  # r's block ids leave with this step's output ...
    r_ids = blocks_of(s, r)
    assert r.request_id in s.requests and free_in_pool(s, r_ids) == []  # ... kept
    # The next step boundary applies the fence: q (exposed steps ago) is freed, r is not.
    step(s, output(finished_sending=set()))
    assert q.request_id not in s.requests and free_in_pool(s, q_ids) == q_ids
    assert r.request_id in s.requests and free_in_pool(s, r_ids) == []
    view = g.request(r.request_id)
    assert view is not None and view.read is not None  # r's READ grant is still open
    step(s, output(finished_sending={r.request_id}))
    assert r.request_id not in s.requests and free_in_pool(s, r_ids) == r_ids


def test_fences_racing_real_scheduler_steps_never_free_a_leaving_exposure() -> None:
    # A thread fences again and again while the scheduler runs steps; each step a prefill
    # finishes (its ids leave with the step's output) and the previous one's reader reports.
    # Whenever a fence lands, no block whose id leaves in a step is free after that step.
    s, g = _guarded(num_blocks=256)
    q, q_ids = _quarantined(s)
    stop = threading.Event()
    started = threading.Event()
    fences = [0]

    def fencing() -> None:
        while not stop.is_set():
            g.revoke("nixl_agent_recreated")
            fences[0] += 1
            started.set()

    t = threading.Thread(target=fencing)
    t.start()
    try:
        started.wait()
        previous: Request | None = None
        for _ in range(25):
            r = request(remote_decode=True)
            s.add_request(r)
            so = s.schedule()
            sent = {previous.request_id} if previous is not None else set()
            outs = s.update_from_output(so, output([r], finished_sending=sent))
            leaving = _leaving(outs)
            assert r.request_id in leaving
            for request_id in leaving:
                assert request_id in s.requests
                held = blocks_of(s, s.requests[request_id])
                assert free_in_pool(s, held) == [], request_id
            previous = r
    finally:
        stop.set()
        t.join()
    assert fences[0] > 0
    step(s, output(finished_sending={previous.request_id} if previous else set()))
    assert q.request_id not in s.requests and free_in_pool(s, q_ids) == q_ids
    assert not s.requests
