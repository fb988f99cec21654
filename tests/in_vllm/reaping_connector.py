"""A connector whose worker side runs vLLM's own NIXL lease reaper, for the guard's worker-side
tests: the smallest inner connector that delays a prefill request's free (as NIXL does for a
remote decode) and whose worker reports finished_sending from consumer notifications *and*
from ``NixlBaseConnectorWorker._reap_expired_send_leases``, with leases extended by
``NixlBaseConnectorWorker._handle_heartbeat`` - vLLM's code, not a copy."""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

from inert_connector import InertConnector, Meta
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)


class SendLeases:
    """The state NIXL's reaper and heartbeat handler read, and both (vLLM's functions)."""

    _reap_expired_send_leases = NixlBaseConnectorWorker._reap_expired_send_leases
    _handle_heartbeat = NixlBaseConnectorWorker._handle_heartbeat

    def __init__(self) -> None:
        # What NIXL's worker derives from its default kv_lease_duration (30 s): a heartbeat
        # extends a lease to 20 s from now.
        self._lease_extension = 30 * 2 // 3
        self._reqs_to_send: dict[str, float] = {}
        self._reqs_to_process: set[str] = set()
        self.consumer_notification_counts_by_req: dict[str, int] = {}
        self.expected_consumer_notifications_by_req: dict[str, int] = {}
        self.xfer_stats = mock.Mock()

    def lease(self, request: str, seconds: float) -> None:
        """The worker learns the request's blocks wait for a remote reader until ``seconds``
        from now (negative: the lease has already run out)."""
        self._reqs_to_send[request] = time.perf_counter() + seconds
        self._reqs_to_process.add(request)


class ReapingConnector(InertConnector):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.connector_worker = SendLeases() if role == KVConnectorRole.WORKER else None
        self.notified: set[str] = set()  # consumers said they are done reading

    # scheduler side
    def build_connector_meta(self, scheduler_output: Any) -> Meta:
        return Meta()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        params = request.kv_transfer_params or {}
        return bool(params.get("do_remote_decode")) and bool(block_ids), None

    # worker side (loading and saving: InertConnector's)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        w = self.connector_worker
        assert w is not None
        done = set(self.notified)
        self.notified.clear()
        for request in done:
            w._reqs_to_send.pop(request, None)
            w._reqs_to_process.discard(request)
        w._reap_expired_send_leases(done)
        return done, set()


def worker(guarded: bool, cfg: Any, kv_cache_config: Any) -> Any:
    """The worker-side connector, guarded (the guard watching the reaper) or not."""
    if guarded:
        from kvlifetime.integrations.vllm.connector import GuardedConnector

        return GuardedConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
    return ReapingConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)


def report(w: Any) -> Any:
    """What vLLM's model runner builds from the worker's connector after a step (no token)."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvlifetime.integrations.vllm.testing import output

    results = w.get_transfer_results(set())
    out = output()
    out.kv_connector_output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        kv_connector_worker_meta=w.build_connector_worker_meta(),
    )
    return out
