"""The guard's worker side: vLLM's own NIXL lease reaper is watched, the ids it reaped travel in
the worker metadata, vLLM's own ``KVOutputAggregator`` merges two tensor-parallel ranks, and the
scheduler side quarantines instead of freeing."""

from __future__ import annotations

from typing import Any

import pytest
from reaping_connector import report, worker
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

from kvlifetime.integrations.vllm.connector import GuardWorkerMeta
from kvlifetime.integrations.vllm.testing import (
    blocks_of,
    config,
    free_in_pool,
    kv_cache_config,
    output,
    request,
    scheduler,
    step,
)

INNER: dict[str, Any] = {"inner": "ReapingConnector", "inner_module": "reaping_connector"}


def _worker(guarded: bool) -> Any:
    return worker(guarded, config(guarded=guarded, **INNER), kv_cache_config())


def test_the_reaped_ids_are_named_in_the_worker_metadata() -> None:
    w = _worker(True)
    w.connector_worker.lease("slow", -1.0)  # already expired
    w.connector_worker.lease("fast", 60.0)
    w.notified.add("fast")
    results = w.get_transfer_results(set())
    assert results.finished_sending == {"slow", "fast"}  # what vLLM sees, unchanged
    meta = w.build_connector_worker_meta()
    assert isinstance(meta, GuardWorkerMeta) and meta.lease_reaped == {"slow"}
    assert w.build_connector_worker_meta() is None  # said once


def _two_ranks(guarded: bool) -> list[int]:
    s = scheduler(guarded=guarded, **INNER)
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    ids = blocks_of(s, r)
    assert ids and not free_in_pool(s, ids)
    ranks = [_worker(guarded), _worker(guarded)]
    agg = KVOutputAggregator(expected_finished_count=2)
    ranks[0].connector_worker.lease(r.request_id, -1.0)  # rank 0: the lease runs out
    ranks[1].connector_worker.lease(r.request_id, 60.0)
    step(s, agg.aggregate([report(w) for w in ranks]))
    ranks[1].notified.add(r.request_id)  # rank 1's reader finishes a step later
    step(s, agg.aggregate([report(w) for w in ranks]))
    return free_in_pool(s, ids)


def test_vllm_alone_frees_after_a_reaped_lease_on_one_rank() -> None:
    assert _two_ranks(guarded=False)


def test_guard_quarantines_after_a_reaped_lease_on_one_rank() -> None:
    assert _two_ranks(guarded=True) == []


@pytest.mark.parametrize("guarded", [False, True])
def test_every_rank_notified_frees(guarded: bool) -> None:
    s = scheduler(guarded=guarded, **INNER)
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    ids = blocks_of(s, r)
    ranks = [_worker(guarded), _worker(guarded)]
    agg = KVOutputAggregator(expected_finished_count=2)
    for w in ranks:
        w.connector_worker.lease(r.request_id, 60.0)
        w.notified.add(r.request_id)
    step(s, agg.aggregate([report(w) for w in ranks]))
    assert free_in_pool(s, ids) == ids
