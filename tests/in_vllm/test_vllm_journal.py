"""Issue 23 item 2, through vLLM 0.33's real scheduler and NIXL connector: the guard records a
step's exposures in a journal and grants them at the step's end, and a refusal found there still
keeps its promise. A load whose WRITE grant is refused never reaches the worker (the inner
connector is told of a load only once it is granted, at ``build_connector_meta``); a remote read
whose READ grant is refused never learns the block ids (the transfer parameters vLLM returns for
the request are emptied at the step's end, before its outputs leave the scheduler); and an id
vLLM frees on is handed back only after the journal went into the ledger.

The refusals are provoked with a transfer the guard tracks and vLLM does not see: a grant over
every block of the pool, made on the guard directly (what a blind spot looks like from inside:
vLLM hands out a block another request's peer may still touch)."""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

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


def _guarded() -> tuple[Any, ConnectorGuard]:
    s = scheduler(guarded=True, num_blocks=NUM_BLOCKS)
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


def test_a_load_whose_write_grant_is_refused_never_reaches_the_worker() -> None:
    s, g = _guarded()
    g.admitted("ghost")  # a remote reader of every block, unknown to vLLM
    assert g.finished("ghost", EVERY_BLOCK, delay=True, aborted=False) is True
    g.flush()
    r = request(remote_prefill=True)
    s.add_request(r)
    for _ in range(3):  # refused at each step's end: vLLM retries the load, nothing leaves
        so = s.schedule()
        assert r.request_id not in so.kv_connector_metadata.reqs_to_recv
        s.update_from_output(so, output())
    assert g.stats().dropped == {"exposed_block_reused": 3}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    view = g.request(r.request_id)
    assert view is not None and view.write is None  # no grant, no exposure recorded
    # The remote reader's access is fenced: the next step applies the fence (it covers the
    # ghost's exposure, made steps ago), grants the load, and the worker gets it, as vLLM
    # alone would have sent it at once.
    g.revoke("fence")
    so = s.schedule()
    assert r.request_id in so.kv_connector_metadata.reqs_to_recv
    s.update_from_output(so, output())
    view = g.request(r.request_id)
    assert view is not None and view.write is not None
    ids = blocks_of(s, r)
    step(s, output(finished_recving={r.request_id}))
    assert not free_in_pool(s, ids)  # the load landed: vLLM runs the request on it
    assert g.stats().dropped == {"exposed_block_reused": 3}


def test_vllm_alone_sends_the_same_load_to_the_worker_at_once() -> None:
    s = scheduler(guarded=False, num_blocks=NUM_BLOCKS)
    r = request(remote_prefill=True)
    s.add_request(r)
    so = s.schedule()
    assert r.request_id in so.kv_connector_metadata.reqs_to_recv


def test_a_read_whose_grant_is_refused_never_learns_the_block_ids() -> None:
    s, g = _guarded()
    g.admitted("ghost")  # a load in flight into every block, unknown to vLLM
    assert g.allocated("ghost", EVERY_BLOCK, 16, load_async=True) is True
    r = request(remote_decode=True)
    s.add_request(r)
    so = s.schedule()
    outs = s.update_from_output(so, output([r]))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # Refused at the step's end: the output carries no block id for decode to read.
    assert _params(outs, r.request_id) == [{}]
    assert g.stats().dropped["exposed_block_reused"] >= 1
    view = g.request(r.request_id)
    assert view is not None and view.state == "ended" and view.read is None
    # vLLM keeps the blocks as NIXL asked, until its worker's id frees them (passed through).
    ids = blocks_of(s, r)
    assert ids and not free_in_pool(s, ids)
    step(s, output(finished_sending={r.request_id}))
    assert free_in_pool(s, ids) == ids and r.request_id not in s.requests


def test_a_granted_read_keeps_its_block_ids_and_the_next_steps_id_finds_the_grant() -> None:
    # The prefill finishes: its output carries the block ids, granted at the step's end. The
    # reader's send comes in a later step's output (one in the same step is stale, see
    # test_vllm_step_boundary.py): the proof finds the grant and the id goes back.
    s, g = _guarded()
    r = request(remote_decode=True)
    s.add_request(r)
    so = s.schedule()
    outs = s.update_from_output(so, output([r]))
    (params,) = _params(outs, r.request_id)
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert r.request_id in s.requests
    step(s, output(finished_sending={r.request_id}))
    assert r.request_id not in s.requests  # freed on the handed-back id
    st = g.stats()
    assert st.handed_back == 1 and st.exposed == st.withheld == 0 and st.dropped == {}
    assert st.ledger.open_grants == 0
