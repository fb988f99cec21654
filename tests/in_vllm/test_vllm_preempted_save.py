"""Issue 20 item 5 (d), vLLM #52360 ("Preemption frees GPU blocks while async store jobs are
still reading them"): a store connector saves a running request's KV asynchronously (the worker
queues the save after the step's forward pass; a background thread reads the blocks later).
vLLM preempts the request to make room: ``_preempt_request`` frees its blocks inside
``schedule()`` and the same step hands them to another request, whose forward pass overwrites
them while the queued save may still be reading them (the save then stores another request's
KV under the preempted request's key).

The guard cannot see this, and the scenario says so. vLLM does not ask the connector before it
frees a preempted request's blocks (``request_finished`` is not called; there is no delay to
grant); the connector learns of the preemption only from ``preempted_req_ids`` when the step's
metadata is built, after the blocks were handed out. vLLM 0.33's remedy is on the worker side:
``handle_preemptions`` runs before the step's forward pass, for the connector to wait for or
cancel its saves. Guarded, the blocks are handed out exactly as without the guard, and the
guard, which records no exposure for a running request, counts nothing.
(``saving_connector.py`` is the store connector; vLLM's scheduler is real.)
"""

from __future__ import annotations

from typing import Any

import pytest

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.testing import BLOCK, advance, blocks_of, request, scheduler


def _preempted_while_saving(guarded: bool) -> tuple[Any, list[int]]:
    """Returns the scheduler and the blocks vLLM handed to another request in the step that
    preempted a request whose queued save still reads them."""
    s = scheduler(
        guarded=guarded,
        inner="SavingConnector",
        inner_module="saving_connector",
        num_blocks=6,  # 5 usable: the two prompts fill the pool
        max_num_seqs=2,
    )
    a = request(tokens=2 * BLOCK)  # its first decoded token needs a third block
    b = request(tokens=2 * BLOCK + 1)
    s.add_request(a)
    s.add_request(b)
    advance(s, a, b)  # both prefilled; the worker queued a save of each one's blocks
    saver = s.connector
    assert saver.saving[b.request_id] == set(blocks_of(s, b))
    so = advance(s, a, b)  # a needs a block and none is free: vLLM preempts b for it
    assert so.preempted_req_ids == {b.request_id}
    handed = {x for n in so.scheduled_new_reqs for x in n.block_ids[0]}
    handed |= {x for ids in so.scheduled_cached_reqs.new_block_ids if ids for x in ids[0]}
    # The connector learnt of it at build_connector_meta: after the blocks were handed out.
    return s, sorted(handed & saver.preempted_while_saving[b.request_id])


@pytest.mark.parametrize("guarded", [False, True])
def test_a_preempted_requests_blocks_are_handed_out_while_its_save_reads_them(
    guarded: bool,
) -> None:
    s, hit = _preempted_while_saving(guarded)
    assert hit, "no block of the preempted request was handed out: the scenario is not one"
    if guarded:
        # The blind spot, as the guard's module docstring states it: no exposure was recorded
        # for the running request, nothing was refused or counted.
        c = s.connector
        assert isinstance(c, GuardedConnector) and c.guard is not None
        st = c.guard.stats()
        assert st.exposed == 0 and st.withheld == 0 and st.dropped == {}
