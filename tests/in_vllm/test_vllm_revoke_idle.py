"""Issue 20 item 3: a fence frees what it fenced at the next scheduler step whatever the model
runner returns. On an idle, exhausted, single-worker engine vLLM returns
``EMPTY_MODEL_RUNNER_OUTPUT`` (no connector output), so ``update_connector_output`` never runs."""

from __future__ import annotations

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.request import RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.testing import (
    blocks_of,
    free_in_pool,
    output,
    request,
    scheduler,
    step,
)


def test_revoke_frees_the_fenced_blocks_on_an_idle_exhausted_engine() -> None:
    s = scheduler(guarded=True, num_blocks=5)
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    ids = blocks_of(s, r)
    step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    assert c.guard.stats().withheld == 1  # quarantined: vLLM still holds the blocks
    waiting = request()
    s.add_request(waiting)
    step(s, EMPTY_MODEL_RUNNER_OUTPUT)
    assert waiting.status == RequestStatus.WAITING  # the pool is exhausted
    c.guard.revoke("nixl_agent_recreated")  # recorded; applied at the next step boundary
    assert r.request_id in s.requests
    # The next step: nothing schedulable, the model runner reports nothing.
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0
    s.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
    assert r.request_id not in s.requests
    assert free_in_pool(s, ids) == ids
    assert c.guard.stats().handed_back == 1
    # And the waiting request gets the blocks.
    so = s.schedule()
    assert waiting.status == RequestStatus.RUNNING
    assert waiting.request_id in so.num_scheduled_tokens
