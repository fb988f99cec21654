"""Field bug classes through vLLM 0.33's real scheduler and NIXL connector (scheduler side).

Each scenario runs twice, on the same steps: with NixlConnector alone (what vLLM does today) and
with the same connector guarded (``GuardedConnector``, selected by ``kv_transfer_config``). The
property checked is the one kvlifetime exists for: **no block whose remote access is unproven is
back in vLLM's pool** (reference count 0, so ``get_new_blocks`` may hand it out). Each scenario
must break it unguarded and keep it guarded; the README's table "what vLLM does / what it does
with kvlifetime" has one line per scenario.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import Request, RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.testing import (
    blocks_of,
    free_in_pool,
    output,
    request,
    scheduler,
    step,
)

MODULE = "kvlifetime.integrations.vllm"


def _prefill_exposed(guarded: bool) -> tuple[Any, Request, list[int]]:
    """A prefill request done, its blocks handed to decode (NIXL delays their free)."""
    s = scheduler(guarded=guarded)
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    ids = blocks_of(s, r)
    assert ids and not free_in_pool(s, ids)  # vLLM keeps them for the remote read
    return s, r, ids


def _decode_loading(guarded: bool) -> tuple[Any, Request, list[int]]:
    """A decode request waiting for its prompt's KV from the prefill engine."""
    s = scheduler(guarded=guarded)
    r = request(remote_prefill=True)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = blocks_of(s, r)
    assert ids
    return s, r, ids


def prefill_aborted_while_read(guarded: bool) -> list[int]:
    """The client aborts the prefill request while decode's READ of its blocks is in flight;
    decode, aborted too, stops heartbeating; the send lease is reaped with the READ still
    posted. Returns the blocks vLLM would hand out again while the read is unproven."""
    s, r, ids = _prefill_exposed(guarded)
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    return free_in_pool(s, ids)


def lease_expired_read_in_flight(guarded: bool) -> list[int]:
    """A slow decode: the send lease expires before its READ of the blocks ends."""
    s, r, ids = _prefill_exposed(guarded)
    step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    return free_in_pool(s, ids)


def decode_aborted_write_landing(guarded: bool) -> list[int]:
    """Decode is aborted while waiting for remote KV; its worker gives up on the transfer
    (failed, then reported finished) while the prefill side's data may still land."""
    s, r, ids = _decode_loading(guarded)
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert not free_in_pool(s, ids)  # vLLM waits for finished_recving
    step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    return free_in_pool(s, ids)


def load_failure_invalid_blocks(guarded: bool) -> list[int]:
    """The asynchronous load fails with invalid blocks; vLLM's "fail" policy ends the request
    and frees its blocks, though a failed transfer proves nothing about what still lands."""
    s, r, ids = _decode_loading(guarded)
    step(s, output(invalid_block_ids=set(ids), finished_recving={r.request_id}))
    step(s, output([r]) if r.request_id in s.requests else None)
    assert r.is_finished()
    return free_in_pool(s, ids)


SCENARIOS = {
    "prefill_aborted_while_read": prefill_aborted_while_read,
    "lease_expired_read_in_flight": lease_expired_read_in_flight,
    "decode_aborted_write_landing": decode_aborted_write_landing,
    "load_failure_invalid_blocks": load_failure_invalid_blocks,
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_vllm_alone_reuses_unproven_blocks(name: str) -> None:
    assert SCENARIOS[name](guarded=False), "vLLM alone kept the blocks: the scenario is not one"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_guard_keeps_unproven_blocks_from_the_pool(name: str) -> None:
    assert SCENARIOS[name](guarded=True) == []


def _guard(s: Any) -> GuardedConnector:
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    return c


def test_quarantined_blocks_are_visible_and_fencing_frees_them() -> None:
    s, r, ids = _prefill_exposed(True)
    step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    g = _guard(s).guard
    assert g is not None
    st = g.stats()
    assert st.lease_reaped == 1 and st.withheld == 1
    assert [q.request for q in st.ledger.quarantined] == [r.request_id]
    assert st.ledger.blocks_by_state["quarantined"] == len(ids)
    assert r.request_id in s.requests  # vLLM still holds them
    g.revoke("nixl_agent_recreated")
    step(s, output(finished_sending=set()))
    assert free_in_pool(s, ids) == ids
    assert r.request_id not in s.requests


def test_completed_read_frees_as_vllm_does() -> None:
    for guarded in (False, True):
        s, r, ids = _prefill_exposed(guarded)
        step(s, output(finished_sending={r.request_id}))
        assert free_in_pool(s, ids) == ids
        assert not s.requests


def _duplicate_and_unknown(guarded: bool) -> None:
    s, r, _ids = _prefill_exposed(guarded)
    step(s, output(finished_sending={r.request_id}))
    step(s, output(finished_sending={r.request_id, "never-seen"}))


def test_vllm_alone_crashes_on_a_duplicate_or_unknown_id() -> None:
    with pytest.raises(AssertionError):
        _duplicate_and_unknown(guarded=False)


def test_guard_drops_duplicate_and_unknown_ids() -> None:
    s, r, _ids = _prefill_exposed(True)
    step(s, output(finished_sending={r.request_id}))
    step(s, output(finished_sending={r.request_id, "never-seen"}))
    g = _guard(s).guard
    assert g is not None
    assert g.stats().dropped == {"duplicate_id": 1, "unknown_id": 1}
    assert g.stats().handed_back == 1


def test_guarded_registered_connector_by_name_keeps_hma_support() -> None:
    # "GuardedNixlConnector" from kvlifetime.integrations.vllm: the guarded class of vLLM's
    # registered NixlConnector, which passes the factory's HMA check that GuardedConnector
    # (a wrapper named by config) cannot.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    from kvlifetime.integrations.vllm import GuardedNixlConnector

    assert issubclass(GuardedNixlConnector, NixlConnector) and supports_hma(GuardedNixlConnector)
    assert issubclass(GuardedNixlConnector, GuardedConnector)
    s = scheduler(guarded=False, inner="GuardedNixlConnector", inner_module=MODULE)
    assert isinstance(s.connector, GuardedNixlConnector) and s.connector.guard is not None
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    ids = blocks_of(s, r)
    step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    assert free_in_pool(s, ids) == []
