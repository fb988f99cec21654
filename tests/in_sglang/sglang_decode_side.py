"""The decode side of the SGLang rig: SGLang's ``DecodePreallocQueue`` and
``DecodeTransferQueue`` over the pools ``sglang_side.Side`` builds, ticked by the Scheduler's
``process_decode_queue``; the requests' places, their pages and the fence that ends every
prefill's access to them (Mooncake's engine destroyed and replaced)."""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeReqToTokenPool,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.scheduler import Scheduler
from sglang_side import (
    ENGINE_PORTS,
    FENCE_NAME,
    Side,
    _fill,
    _phase,
    _poll_name,
    _publish,
    _request,
)


class DecodeSide(Side):
    def __init__(self, options: dict[str, Any], guard: Any) -> None:
        super().__init__(options, guard)
        tokens = int(options["pool_tokens"])
        reqs = int(options.get("max_reqs", 8))
        t = time.monotonic()
        sa = _publish("decode", self.port)
        t = _phase("decode publish + engine", t)
        self._build_pools(
            sa,
            tokens,
            reqs,
            DecodeReqToTokenPool(
                size=reqs,
                max_context_len=tokens + 8,
                device="cpu",
                enable_memory_saver=False,
                pre_alloc_size=reqs,
            ),
            radix_cache=True,
        )
        self.sched = self._scheduler(
            sa, DisaggregationMode.DECODE, {}, collect_inflight_reqs=lambda: []
        )
        self.transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta,
            scheduler=self.sched,
            tree_cache=self.tree,
        )
        self.sched.disagg_decode_transfer_queue = self.transfer_queue
        self.prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta,
            scheduler=self.sched,
            transfer_queue=self.transfer_queue,
            tree_cache=self.tree,
            gpu_id=0,
            bootstrap_port=self.port,
            max_total_num_tokens=tokens,
            num_reserved_decode_tokens=0,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.sched.disagg_decode_prealloc_queue = self.prealloc_queue
        _phase("decode queues", t)

    # -- requests

    def admit(self, rid: str, room: int, tokens: int, seed: int | None = None) -> None:
        req = _request(rid, room, tokens, self.port, seed)
        self.reqs[rid] = req
        self.prealloc_queue.add(req)

    def tick(self) -> dict[str, Any]:
        """One scheduler iteration of the decode's disaggregation queues."""
        SchedulerDisaggregationDecodeMixin.process_decode_queue(self.sched)
        self._note_pages()
        return self.where()

    def _note_pages(self) -> None:
        for decode_req in self.transfer_queue.queue:
            req = decode_req.req
            if req.rid in self.reqs and req.rid not in self.pages:
                n = len(req.origin_input_ids)
                row = self.req_pool.req_to_token[req.kv.req_pool_idx, :n]
                self.pages[req.rid] = [int(x) for x in row]

    def where(self) -> dict[str, Any]:
        """Where each request is: prealloc, transfer, held (deferred release), running
        (transferred, on the waiting queue), or gone (released)."""
        places: dict[str, str] = {rid: "gone" for rid in self.reqs}
        for d in self.prealloc_queue.queue:
            places[d.req.rid] = "prealloc"
        for d in self.transfer_queue.queue:
            places[d.req.rid] = "transfer"
        for entry in self.transfer_queue._deferred_releases:
            places[entry[0].req.rid] = "held"
        for r in self.sched.waiting_queue:
            places[r.rid] = "running"
        return {
            "places": places,
            "free_pages": int(self.allocator.available_size()),
            "free_meta": int(self.meta_alloc.available_size()),
        }

    def abort(self, rid: str) -> None:
        Scheduler.abort_request(self.sched, AbortReq(rid=rid))

    def request_pages(self, rid: str) -> list[int]:
        return self.pages[rid]

    def fill(self, pages: list[int], value: float) -> None:
        _fill(self.kv, pages, value)

    def owner_pages(self, name: str) -> list[int]:
        return self.owners[name]

    def free_owner(self, name: str) -> None:
        pages = self.owners.pop(name)
        if pages:
            self.allocator.free(torch.tensor(pages, dtype=torch.int64))

    def output(self, rid: str) -> dict[str, Any]:
        req = self.reqs[rid]
        return {"output_ids": list(req.output_ids), "finished": repr(req.finished_reason)}

    def deferred_rooms(self) -> list[int]:
        return [int(e[0].req.bootstrap_room) for e in self.transfer_queue._deferred_releases]

    def fence(self) -> dict[str, Any]:
        """End every prefill's access to this decode's KV pages and metadata slots.

        On Mooncake TCP nothing short of destroying the serving engine does (``unregister``
        only refuses requests that have not yet passed their header check). SGLang's decode
        holds one process-wide engine (``MooncakeTransferEngine``, shared by its KV manager):
        a new engine is started and the same buffers registered with it, the wrapper's engine
        and session id swapped, the manager's cached prefill connections dropped (so the next
        request registers the new session with each prefill), then the old engine destroyed
        (its destructor closes every accepted session and joins its copy thread), observed by
        its ports closing. Every in-flight transfer to this decode, of any request, fails."""
        from mooncake.engine import TransferEngine
        from sglang.srt.utils.network import NetworkAddress

        from kvlifetime.adapters.sockets import listening_ports, wait_closed

        mgr = self.prealloc_queue.kv_manager
        wrapper = mgr.engine
        t0 = time.monotonic()
        old, old_session, old_ports = wrapper.engine, wrapper.session_id, set(ENGINE_PORTS)
        before = listening_ports()
        wrapper.engine = TransferEngine()
        wrapper.initialize(hostname=wrapper.hostname, device_name=wrapper.ib_device)
        new_ports = listening_ports() - before
        wrapper.session_id = NetworkAddress(
            wrapper.hostname, wrapper.engine.get_rpc_port()
        ).to_host_port_str()
        mgr.register_buffer_to_engine()
        with mgr.connection_lock:
            mgr.connection_pool.clear()
        t1 = time.monotonic()
        regions = [ptr for ptr, _ in mgr._registerable_regions()]
        old.batch_unregister_memory(regions)  # refuse new requests at once
        del old  # the last reference: the engine is destroyed here
        wait_closed(old_ports, "sglang decode's mooncake engine")
        t2 = time.monotonic()
        ENGINE_PORTS.clear()
        ENGINE_PORTS.update(new_ports)
        revoked = self.guard.revoke(FENCE_NAME) if self.guard is not None else None
        return {
            "old_session": old_session,
            "new_session": wrapper.session_id,
            "new_engine_s": t1 - t0,
            "old_engine_gone_s": t2 - t1,
            "total_s": time.monotonic() - t0,
            "revoked": revoked,
        }

    def reregister(self) -> None:
        """Unregister the decode's buffers from its engine and register them again (what the
        decode would have to do to keep serving later requests after an unregister)."""
        mgr = self.prealloc_queue.kv_manager
        mgr.deregister_buffer_to_engine()
        mgr.register_buffer_to_engine()

    def status(self, room: int) -> str:
        """The receiving manager's status of ``room`` (a read: no poll, no side effect)."""
        mgr = self.prealloc_queue.kv_manager
        if room not in mgr.request_status:
            return "none"
        return _poll_name(mgr.check_status(room))

    def ack_endpoint(self) -> dict[str, Any]:
        """Where the decode's manager takes ABORT_ACKs (what its ABORTs tell the prefill)."""
        mgr = self.prealloc_queue.kv_manager
        return {"ip": str(mgr.local_ip), "port": int(mgr.rank_port)}

    def acks(self, room: int) -> dict[str, Any] | None:
        """The ABORT_ACKs recorded for ``room``'s current abort generation (a read)."""
        state = self.prealloc_queue.kv_manager._deferred_abort_ack_tracker.get(room)
        if state is None:
            return None
        return {"generation": int(state.generation), "ranks": sorted(state.prefill_ranks)}
