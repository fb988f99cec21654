"""The prefill side of the SGLang rig: SGLang's ``PrefillBootstrapQueue`` and inflight queue
over the pools ``sglang_side.Side`` builds (one rank of a prefill instance, its bootstrap server
on the first rank), the forward that writes a marker into a request's pages, and the gate on
its transfer engine (``sglang_transfer_gate``) that can hold a transfer mid-flight."""

from __future__ import annotations

import time
from typing import Any

from sglang.srt.disaggregation.prefill import (
    PrefillBootstrapQueue,
    SchedulerDisaggregationPrefillMixin,
)
from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang_side import (
    HEADS,
    VOCAB,
    Side,
    _fill,
    _parallel,
    _phase,
    _poll_name,
    _publish,
    _request,
)
from sglang_transfer_gate import TransferGate


class PrefillSide(Side):
    def __init__(self, options: dict[str, Any], guard: Any) -> None:
        super().__init__(options, guard)
        tokens = int(options["pool_tokens"])
        reqs = int(options.get("max_reqs", 8))
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

        rank, size = int(options.get("tp_rank", 0)), int(options.get("tp_size", 1))
        t = time.monotonic()
        if rank == 0:  # one bootstrap server per prefill instance, on its first rank
            self.bootstrap_server = MooncakeKVBootstrapServer("127.0.0.1", self.port)
        t = _phase("bootstrap server", t)
        sa = _publish("prefill", self.port, rank, size, options.get("store_port"))
        t = _phase("prefill publish + engine", t)
        self._build_pools(
            sa,
            tokens,
            reqs,
            ReqToTokenPool(
                size=reqs, max_context_len=tokens + 8, device="cpu", enable_memory_saver=False
            ),
            heads=HEADS // size,
            radix_cache=False,
        )
        self.sched = self._scheduler(
            sa,
            DisaggregationMode.PREFILL,
            {"effective_logical_max_total_num_tokens": tokens},
            rust_server=None,
            kv_shard_widening=1,
            disagg_metadata_buffers=self.meta,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            disagg_prefill_inflight_queue=[],
            disagg_prefill_pending_chunk_rids=set(),
            enable_staging=False,
            attn_cp_cpu_group=_parallel().attn_cp_group.cpu_group,
            attn_tp_cpu_group=_parallel().attn_tp_group.cpu_group,
            processed_tokens_counter=0,
        )
        self.bootstrap_queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.kv,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta,
            gpu_id=0,
            bootstrap_port=self.port,
            max_total_num_tokens=tokens,
            scheduler=self.sched,
            scheduler_stage_metrics=None,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.sched.disagg_prefill_bootstrap_queue = self.bootstrap_queue
        _phase("prefill queues", t)
        self.mgr = self.bootstrap_queue.kv_manager
        # SGLang's MooncakeTransferEngine (the process's one): every batch the worker sends.
        self.gate = TransferGate(self.mgr.engine)

    # -- the gate on the transfer engine (test instrumentation: sglang_transfer_gate)

    def hold_transfers(self, after_batches: int, poison: bool = False) -> None:
        self.gate.hold(after_batches, poison)

    def wait_held(self, seconds: float = 10.0) -> bool:
        return self.gate.wait_held(seconds)

    def release_transfers(self, then_hold_after: int | None = None) -> None:
        self.gate.release(then_hold_after)

    def gate_calls(self) -> list[tuple[float, int | None, int]]:
        return list(self.gate.log)

    def wait_late_writes(self, timeout: float = 10.0) -> None:
        self.gate.wait_late_writes(timeout)

    # -- requests

    def admit(self, rid: str, room: int, tokens: int, seed: int | None = None) -> None:
        req = _request(rid, room, tokens, self.port, seed)
        self.reqs[rid] = req
        self.bootstrap_queue.add(req, HEADS)

    def bootstrap(self) -> list[str]:
        """One poll of the bootstrap queue; the requests it hands to the scheduler."""
        return [r.rid for r in self.bootstrap_queue.pop_bootstrapped()]

    def forward(self, rid: str, value: float) -> list[int]:
        """What a prefill forward leaves: the request's KV row allocated, its pages written
        (with ``value``), its first output token; then SGLang's ``send_kv_chunk`` publishes the
        metadata and hands the pages to the transfer worker, and the request waits on the
        inflight queue."""
        req = self.reqs[rid]
        pages = [int(x) for x in self.allocate_forward(req)]
        _fill(self.kv, pages, value)
        self.pages[rid] = pages
        SchedulerDisaggregationPrefillMixin.send_kv_chunk(self.sched, req, last_chunk=True)
        self.sched.disagg_prefill_inflight_queue.append(req)
        return pages

    def allocate_forward(self, req: Req) -> Any:
        """What a prefill forward leaves bar the pages' contents: the request's KV row allocated
        and written, its lengths set, its first output token; returns the row's locations."""
        n = len(req.origin_input_ids)
        self.req_pool.alloc([req])
        loc = self.allocator.alloc(n)
        assert loc is not None, "prefill pool full"
        self.req_pool.write((req.kv.req_pool_idx, slice(0, n)), loc)
        req.kv.kv_committed_len = n
        req.kv.kv_allocated_len = n
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
        req.prefix_len = 0
        req.extend_end = n
        req.output_ids.append(int(req.origin_input_ids[-1]) % VOCAB)
        # The Mooncake sender's host-tensor path copies page indices through pinned memory
        # and a CUDA event (GPU only); SGLang's other path (kv_to_page_indices) is the one
        # every backend without it takes.
        req.disagg_kv_sender.supports_host_tensor_indices = False
        return loc

    def forwarded_pages(self, rid: str) -> list[int]:
        return self.pages[rid]

    def poll_inflight(self) -> list[str]:
        """One poll of the inflight queue (SGLang's own); the requests it concluded."""
        done = SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue(self.sched)
        return [r.rid for r in done]

    def inflight(self) -> list[str]:
        return [r.rid for r in self.sched.disagg_prefill_inflight_queue]

    def poll(self, rid: str) -> str:
        return _poll_name(self.reqs[rid].disagg_kv_sender.poll())

    def outstanding(self, room: int) -> int:
        return int(self.mgr._staging_outstanding.get(room, 0))

    def send_stale_ack(self, room: int, generation: int) -> bool:
        """SGLang's own ABORT_ACK send (``_send_abort_ack``) for ``room`` with ``generation``,
        to the decode endpoint the room's current abort registered: a late ACK of an earlier
        abort, delivered after the decode re-armed the room. False if no abort is registered."""
        from sglang.srt.disaggregation.common.conn import AckTarget

        targets = self.mgr._deferred_ack_targets.get(room) or {}
        for target in list(targets.values()):
            self.mgr._send_abort_ack(room, AckTarget(target.ip, target.port, generation))
        return bool(targets)

    def send_ack_as(self, room: int, rank: int, generation: int, ip: str, port: int) -> bool:
        """A lying prefill rank: an ABORT_ACK of ``room``'s ``generation`` in ``rank``'s name
        (not this rank's), sent as SGLang's ``_send_abort_ack`` sends one, over this rank's
        own socket; guarded, it echoes the token this rank's own ABORT carried (the best a liar
        has). Returns whether it echoed a token."""
        from sglang.srt.disaggregation.common.conn import AbortAck
        from sglang.srt.utils.network import NetworkAddress

        frames = AbortAck(room, rank, generation).to_zmq()
        own = None if self.guard is None else self.guard.echo_token(room, ip, port, generation)
        if own is not None and len(frames) == 4:
            frames.append(own.encode("ascii"))
        na = NetworkAddress(ip, port)
        self.mgr._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
        return own is not None

    def room_status(self, room: int) -> str:
        if room not in self.mgr.request_status:
            return "none"
        return _poll_name(self.mgr.check_status(room))

    def free_pages(self) -> int:
        return int(self.allocator.available_size())

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
