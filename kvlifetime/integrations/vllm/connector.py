"""GuardedConnector: any vLLM v1 KV connector, with its exposures guarded by a ledger.

Selected the way vLLM selects connectors::

    --kv-transfer-config '{"kv_connector": "GuardedConnector",
                           "kv_connector_module_path": "kvlifetime.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "inner": {"kv_connector": "NixlConnector",
                                         "kv_connector_extra_config": {...}}}}'

``inner`` is the connector being guarded, in the same keys as ``kv_transfer_config``
(``kv_connector``, optionally ``kv_connector_module_path`` and ``kv_connector_extra_config``;
``kv_role`` and the rest are inherited). The object vLLM gets is an instance of a class derived
from the inner connector's own class (``guarded_class``): the inner connector runs unchanged,
``isinstance`` checks against its class hold, and the guard overrides only the hooks on vLLM's
block-freeing path:

- scheduler role: ``on_new_request`` (which ids vLLM holds), ``update_state_after_alloc`` /
  ``build_connector_meta`` (WRITE grants for asynchronous loads; at every step, what a fence
  released: ended requests freed, held failed loads handed on as the receive vLLM waits for),
  ``request_finished`` (READ grants when the inner delays the free; a delay for anything
  unproven), ``update_connector_output`` (evidence in, ids out: ``guard.py``);
- worker role: the connector's lease reaper is watched (NIXL's ``_reap_expired_send_leases``) and
  the ids it reaped travel to the scheduler in the worker metadata (``GuardWorkerMeta``), so a
  reaped lease is told apart from a completed read where that is known.

The scheduler-side guard is ``connector.guard`` (``ConnectorGuard``): ``guard.stats()``,
``LedgerCollector(connector.guard.ledger)`` for Prometheus, ``guard.revoke(fence)`` once peers
are fenced.
"""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from kvlifetime.errors import InvalidField
from kvlifetime.integrations.vllm.guard import ConnectorGuard

_ABORTED = frozenset(
    s
    for s in (
        getattr(RequestStatus, "FINISHED_ABORTED", None),
        getattr(RequestStatus, "FINISHED_ERROR", None),
    )
    if s is not None
)


class GuardWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the ids the worker's lease reaper put in ``finished_sending`` this
    step (and the inner connector's own worker metadata, carried unchanged)."""

    def __init__(
        self, inner: KVConnectorWorkerMetadata | None, lease_reaped: frozenset[str]
    ) -> None:
        self.inner = inner
        self.lease_reaped = lease_reaped

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel ranks: a lease reaped on any rank leaves that rank's reads unproven.
        if not isinstance(other, GuardWorkerMeta):
            inner = other if self.inner is None else self.inner.aggregate(other)
            return GuardWorkerMeta(inner, self.lease_reaped)
        if self.inner is None or other.inner is None:
            inner = self.inner or other.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return GuardWorkerMeta(inner, self.lease_reaped | other.lease_reaped)


def _flat(block_ids: Any) -> list[int]:
    """vLLM passes block ids as a list, or one list per KV-cache group (one block pool)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [b for group in block_ids for b in group]
    return list(block_ids)


def inner_config(vllm_config: Any) -> tuple[type[KVConnectorBase_V1], Any]:
    """The inner connector's class and a copy of ``vllm_config`` naming it."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    inner = extra.get("inner")
    if not isinstance(inner, dict) or not isinstance(inner.get("kv_connector"), str):
        raise InvalidField(
            "GuardedConnector needs kv_connector_extra_config.inner = {'kv_connector': "
            f"<the connector to guard>, ...}}, got {inner!r}"
        )
    fields = {
        "kv_connector": inner["kv_connector"],
        "kv_connector_module_path": inner.get("kv_connector_module_path"),
        "kv_connector_extra_config": dict(inner.get("kv_connector_extra_config") or {}),
    }
    inner_ktc = copy.copy(ktc)
    for key, value in fields.items():
        setattr(inner_ktc, key, value)
    cfg = copy.copy(vllm_config)
    cfg.kv_transfer_config = inner_ktc
    return KVConnectorFactory.get_connector_class(inner_ktc), cfg


class GuardedConnector(KVConnectorBase_V1):
    """The guard, placed before the inner connector's class in the MRO (see module doc)."""

    _kvl_guarded: ClassVar[bool] = True
    guard: ConnectorGuard | None

    def __new__(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> Any:
        if cls is GuardedConnector:
            # Selected by name in kv_transfer_config: build the guarded inner connector.
            inner_cls, cfg = inner_config(vllm_config)
            obj = super().__new__(guarded_class(inner_cls))
            obj._kvl_config = cfg
            return obj
        return super().__new__(cls)

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        cfg = self.__dict__.pop("_kvl_config", vllm_config)
        super().__init__(cfg, role, kv_cache_config)
        self.guard = None
        self._kvl_reaped: set[str] = set()
        self._kvl_pending: list[tuple[Any, list[int], int]] = []
        self._kvl_null: int | None = None
        self._kvl_requests: dict[str, Any] | None = None
        self._kvl_free: Any = None
        self._kvl_received: Any = None
        if role == KVConnectorRole.SCHEDULER:
            num_blocks = _num_blocks(cfg, kv_cache_config)
            extra = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(
                "kvlifetime", {}
            )
            self.guard = ConnectorGuard(num_blocks, peer=str(extra.get("peer", "vllm-kv-peer")))
        else:
            self._kvl_watch_reaper()

    # ------------------------------------------------------------------ scheduler role

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        # vLLM's placeholder block (sliding-window and mamba lists repeat it): never exposed.
        self._kvl_null = kv_cache_manager.block_pool.null_block.block_id
        # vLLM's Scheduler binds its cache manager from its own __init__: its request table
        # is the truth about which ids vLLM holds (an id it does not hold would trip its
        # asserts; one it holds, even one the guard never saw, is vLLM's own business).
        owner = sys._getframe(1).f_locals.get("self")
        requests = getattr(owner, "requests", None)
        if (
            self.guard is not None
            and isinstance(requests, dict)
            and getattr(owner, "kv_cache_manager", None) is kv_cache_manager
        ):
            self.guard.holds = requests.__contains__
            self.guard.phase = _phase_in(requests)
            self._kvl_requests = requests
            self._kvl_free = getattr(owner, "_free_blocks", None)
            self._kvl_received = _receive_in(owner)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        if self.guard is not None:
            self.guard.admitted(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.guard is not None and num_external_tokens > 0:
            # Whether the load is asynchronous is vLLM's decision, made after this hook: read
            # it at build_connector_meta, before the metadata carries the ids to the worker.
            ids = self._kvl_ids(blocks.get_unhashed_block_ids_all_groups())
            self._kvl_pending.append((request, ids, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self.guard is not None:
            self.guard.handed_out(self._kvl_ids(_new_blocks(scheduler_output)))
        if self.guard is not None and self._kvl_pending:
            for request, ids, n in self._kvl_pending:
                waiting = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                self.guard.allocated(request.request_id, ids, n, load_async=waiting)
            self._kvl_pending.clear()
        meta = super().build_connector_meta(scheduler_output)
        if self.guard is not None and self._kvl_requests is not None and self._kvl_free:
            # Every step, whatever the model runner returns: what a fence released (revoke)
            # goes back to vLLM's pool now, not at a step that carries connector output (an
            # idle single-worker engine returns EMPTY_MODEL_RUNNER_OUTPUT and none comes).
            for request_id in self.guard.take_released():
                req = self._kvl_requests.get(request_id)
                if req is not None and req.is_finished():
                    self._kvl_free(req)
            # A fence ended a held failed load: vLLM gets the receive it waits for, as its
            # own _update_from_kv_xfer_finished would take it, and recovers at its next step.
            fenced = self.guard.take_fenced_loads()
            if fenced and self._kvl_received is not None:
                for request_id in fenced:
                    req = self._kvl_requests.get(request_id)
                    if req is None:
                        continue
                    if req.is_finished():
                        self._kvl_free(req)  # aborted while held: vLLM waited for this
                    else:
                        self._kvl_received(req)
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        return self._kvl_finished(request, block_ids, delay), params

    def request_finished_all_groups(
        self, request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        return self._kvl_finished(request, block_ids, delay), params

    def _kvl_finished(self, request: Any, block_ids: Any, delay: bool) -> bool:
        if self.guard is None:
            return delay
        return self.guard.finished(
            request.request_id, self._kvl_ids(block_ids), bool(delay), request.status in _ABORTED
        )

    def _kvl_ids(self, block_ids: Any) -> list[int]:
        """The distinct real blocks of vLLM's block-id list(s): one list per KV-cache group
        (one pool: a block shared by groups is counted once), without the null block."""
        ids = dict.fromkeys(_flat(block_ids))
        ids.pop(self._kvl_null, None)  # type: ignore[arg-type]
        return list(ids)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        reaped: frozenset[str] = frozenset()
        if isinstance(meta, GuardWorkerMeta):
            reaped = meta.lease_reaped
            connector_output.kv_connector_worker_meta = meta.inner
        # The inner connector sees its worker's report unchanged (it keeps its own books).
        super().update_connector_output(connector_output)
        if self.guard is None:
            return
        back = self.guard.output(
            connector_output.finished_sending,
            connector_output.finished_recving,
            failed_recving=connector_output.failed_recving or (),
            invalid_block_ids=connector_output.invalid_block_ids or (),
            lease_reaped=reaped,
        )
        connector_output.finished_sending = back.finished_sending
        connector_output.finished_recving = back.finished_recving

    # ------------------------------------------------------------------ worker role

    def _kvl_watch_reaper(self) -> None:
        worker = getattr(self, "connector_worker", None)
        reap = getattr(worker, "_reap_expired_send_leases", None)
        if worker is None or reap is None:
            return
        reaped = self._kvl_reaped

        def watched(done_sending: set[str]) -> None:
            before = set(done_sending)
            reap(done_sending)
            reaped.update(done_sending - before)

        # NIXL's worker reaps expired send leases into finished_sending: watch what it adds.
        worker._reap_expired_send_leases = watched

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = super().build_connector_worker_meta()
        if not self._kvl_reaped:
            return inner
        meta = GuardWorkerMeta(inner, frozenset(self._kvl_reaped))
        self._kvl_reaped.clear()
        return meta


def _phase_in(requests: dict[str, Any]) -> Any:
    """Where vLLM's scheduler has a request, as the guard names it (see ``ConnectorGuard``)."""
    from vllm.v1.request import RequestStatus

    def phase(request: str) -> str | None:
        req = requests.get(request)
        if req is None:
            return None
        if RequestStatus.is_finished(req.status):
            return "finished"
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return "waiting_for_remote_kvs"
        return "running"

    return phase


def _receive_in(scheduler: Any) -> Any:
    """What vLLM's scheduler does with a ``finished_recving`` id of a request waiting for remote
    KVs (``_update_from_kv_xfer_finished``): the id joins ``finished_recving_kv_req_ids`` and the
    next ``schedule()`` moves the request on. None when the scheduler has no such set."""
    done = getattr(scheduler, "finished_recving_kv_req_ids", None)
    if not isinstance(done, set):
        return None
    stage = getattr(scheduler, "_set_kv_fetch_stage", None)
    try:
        from vllm.v1.metrics.stats import KV_FETCH_COMPLETED_WAITING
    except ImportError:  # an older vLLM: no fetch stages
        stage = None

    def received(req: Any) -> None:
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            done.add(req.request_id)
            if stage is not None:
                stage(req, KV_FETCH_COMPLETED_WAITING)

    return received


def _new_blocks(scheduler_output: Any) -> list[int]:
    """Every block id vLLM gave a request in this step (new requests' and running ones')."""
    out: list[int] = []
    for new in scheduler_output.scheduled_new_reqs:
        out.extend(_flat(new.block_ids))
    for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
        if ids:
            out.extend(_flat(ids))
    return out


def _num_blocks(vllm_config: Any, kv_cache_config: Any) -> int:
    n = getattr(kv_cache_config, "num_blocks", None)
    if not n:
        n = getattr(vllm_config.cache_config, "num_gpu_blocks", None)
    if not n:
        raise InvalidField("GuardedConnector: the KV cache's number of blocks is unknown")
    return int(n)


_CLASSES: dict[type[Any], type[Any]] = {}
_CLASSES_LOCK = threading.Lock()


def guarded_class(inner: type[Any]) -> type[Any]:
    """The class of ``inner`` with the guard in front (one class per inner class)."""
    if getattr(inner, "_kvl_guarded", False):
        return inner
    with _CLASSES_LOCK:
        cls = _CLASSES.get(inner)
        if cls is None:
            cls = type(f"Guarded{inner.__name__}", (GuardedConnector, inner), {})
            _CLASSES[inner] = cls
        return cls


__all__ = ["GuardWorkerMeta", "GuardedConnector", "guarded_class", "inner_config"]
